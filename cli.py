"""What the command lines (train.py, evaluate.py, rollout.py) share: one-line argument errors, argument types,
the chat-template flags, and loading a model into a rollout engine."""
from __future__ import annotations

import argparse
import sys

from chat_format import CALL_FORMATS


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (not the 20-line usage), exit 2."""

    def __init__(self, *args, help_hint: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.help_hint = help_hint

    def error(self, message):
        hint = f" (see python {self.prog} --help)" if self.help_hint else ""
        sys.stderr.write(f"{self.prog}: error: {' '.join(str(message).split())}{hint}\n")
        sys.exit(2)


def int_at_least(lo: int):
    """argparse type: an integer >= lo."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def template_kwargs_arg(text: str) -> dict:
    """argparse type of --chat-template-kwargs: a JSON object."""
    import policy
    try:
        return policy.parse_template_kwargs(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def template_kwargs_text(text: str) -> str:
    """argparse type of train.py's --chat-template-kwargs: checked as --chat-template-kwargs is everywhere, kept
    as its text (TrainConfig stores the flag's text)."""
    template_kwargs_arg(text)
    return text


def add_template_args(parser: argparse.ArgumentParser):
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="replace the model's chat template with this jinja file (saved into checkpoints), "
                             "e.g. chat_templates/chatml-tools.jinja for ChatML models without tool support")
    parser.add_argument("--chat-template-kwargs", type=template_kwargs_arg, default=None, metavar="JSON",
                        help="extra chat-template variables as a JSON object, e.g. '{\"enable_thinking\": false}' "
                             "(default: those saved in the checkpoint, if any)")
    parser.add_argument("--tool-call-format", default=None, choices=list(CALL_FORMATS),
                        help="how the model writes tool calls (default: inferred from the chat template)")


def load_engine(name: str, chat_template: str | None = None, template_kwargs: dict | None = None,
                call_format: str | None = None, **load_kwargs):
    """policy.load_policy + rollout.Engine; template_kwargs None means the checkpoint's saved ones.
    Raises policy.PolicyLoadError or chat_format.TemplateError, each a one-line message naming the fix."""
    import policy
    import rollout
    model, tok = policy.load_policy(name, chat_template=chat_template, **load_kwargs)
    return rollout.Engine(model, tok, policy.template_kwargs_for(name, template_kwargs), call_format or None)

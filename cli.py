"""What the command lines (train.py, evaluate.py, rollout.py) share: one-line argument errors, argument types,
the chat-template flags and the benchmark-options flag, so one concept has one flag name everywhere."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import policy
from chat_format import CALL_FORMATS


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (not the 20-line usage), exit 2."""

    def __init__(self, *args, help_hint: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.help_hint = help_hint

    def error(self, message):
        """Write the error as one line on stderr (with a --help hint if asked for) and exit 2."""
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
    try:
        return policy.parse_template_kwargs(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def template_kwargs_text(text: str) -> str:
    """argparse type of train.py's --chat-template-kwargs: checked as --chat-template-kwargs is everywhere, kept
    as its text (TrainConfig stores the flag's text)."""
    template_kwargs_arg(text)
    return text


def parse_task_opts(text: str) -> dict:
    """--task-opts 'families=balance,send,holdout=pairs' -> {'families': 'balance,send', 'holdout': 'pairs'}:
    extra load_tasks options of a benchmark. A comma starts a new pair only before 'key='; values that read as
    JSON (numbers, true/false) are converted. ValueError on a part without '='."""
    out = {}
    for part in filter(None, (p.strip() for p in re.split(r",(?=\s*\w+=)", text or ""))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"--task-opts takes key=value pairs separated by commas, got {part!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def task_opts_arg(text: str) -> dict:
    """argparse type of --task-opts."""
    try:
        return parse_task_opts(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_template_args(parser: argparse.ArgumentParser):
    """--chat-template, --chat-template-kwargs and --tool-call-format, as every command line spells them."""
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="replace the model's chat template with this jinja file (saved into checkpoints), "
                             "e.g. chat_templates/chatml-tools.jinja for ChatML models without tool support")
    parser.add_argument("--chat-template-kwargs", type=template_kwargs_arg, default=None, metavar="JSON",
                        help="extra chat-template variables as a JSON object, e.g. '{\"enable_thinking\": false}' "
                             "(default: those saved in the checkpoint, if any)")
    parser.add_argument("--tool-call-format", default=None, choices=list(CALL_FORMATS),
                        help="how the model writes tool calls (default: inferred from the chat template)")


def load_presets(paths: list[str], kinds: dict[str, str]) -> dict:
    """Settings from TOML presets, later files over earlier ones. kinds: each known key's type name ("int",
    "float", "str", "bool"); an [about] table is documentation and is skipped. ValueError, one line, for a
    missing or malformed file, an unknown key or a value of the wrong type."""
    import tomllib
    checks = {"bool": lambda v: isinstance(v, bool), "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "str": lambda v: isinstance(v, str)}
    out: dict = {}
    for path in paths:
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"--config {path}: not valid TOML ({exc})") from None
        data.pop("about", None)
        unknown = sorted(set(data) - set(kinds))
        if unknown:
            raise ValueError(f"--config {path}: unknown key(s) {', '.join(unknown)}; the keys are the flags "
                             "with '_' for '-' (--help)")
        for key, value in data.items():
            if not checks.get(kinds[key], lambda v: True)(value):
                raise ValueError(f"--config {path}: {key} = {value!r} is not a {kinds[key]}")
        out.update(data)
    return out

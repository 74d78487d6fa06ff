"""Test helpers: a steering hook that scripts the tiny model's turns, and a small deterministic environment.

The script forces structure (tool-call tags, JSON punctuation, closing tags) and leaves "free" slots where the
real model's own logits choose among alphanumeric tokens, so caching bugs still change what is generated.
"""
from __future__ import annotations

import json

import torch

from bench import Task

TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "look a key up",
                                      "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                     "required": ["key"]}}},
    {"type": "function", "function": {"name": "ping", "description": "no arguments",
                                      "parameters": {"type": "object", "properties": {}}}},
]


def call_text(name, args_prefix):
    """Forced head of a call in the template's own format; the argument value is left open."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args_prefix}'


def tasks(n=2):
    out = []
    for i in range(n):
        out.append(Task(id=f"t{i}", tools=TOOLS, messages=[
            {"role": "system", "content": "You look things up." + " Be exact." * i},
            {"role": "user", "content": f"Find key number {i}" + " please" * (2 * i)}]))
    return out


class Script:
    """Per-row segment scripts. A segment is a list of items: str = forced text, int = free tokens,
    list = forced token ids."""

    def __init__(self, tok, act: dict, world: dict | None = None, eos_after=True):
        self.tok = tok
        self.act, self.world = act, world or {}
        self.segment_no: dict[tuple[int, str], int] = {}
        self.allowed = torch.tensor([i for i in range(len(tok)) if tok.decode([i]).isalnum()])
        self.eos_after = eos_after

    def _items(self, row, role_name):
        scripts = (self.act if role_name == "ACT" else self.world).get(row, [])
        k = self.segment_no.get((row, role_name), 0) - 1
        return scripts[k] if 0 <= k < len(scripts) else None

    def plan(self, items):
        """Expand a segment script to a list: token id (forced) or None (free)."""
        out = []
        for it in items:
            if isinstance(it, str):
                out += self.tok(it, add_special_tokens=False)["input_ids"]
            elif isinstance(it, list):
                out += it
            else:
                out += [None] * it
        return out

    def __call__(self, rows, segments, logits):
        for j, (row, (role, ids)) in enumerate(zip(rows, segments)):
            key = (row, role.name)
            if not ids:
                self.segment_no[key] = self.segment_no.get(key, 0) + 1
            items = self._items(row, role.name)
            if items is None:
                continue
            plan = self.plan(items)
            n = len(ids)
            if n < len(plan):
                want = plan[n]
            elif self.eos_after and role.name == "ACT":
                want = self.tok.eos_token_id
            else:
                continue
            keep = logits[j].clone()
            logits[j] = float("-inf")
            if want is None:
                logits[j, self.allowed] = keep[self.allowed]
            else:
                logits[j, want] = 0.0
        return logits


class EchoEnv:
    """step() echoes the call; user_turn() replays scripted follow-ups."""

    def __init__(self, followups=()):
        self.calls, self.followups = [], list(followups)

    def step(self, name, arguments):
        self.calls.append((name, arguments))
        return json.dumps({"tool": name, "args": arguments, "n": len(self.calls)})

    def user_turn(self, assistant_text):
        return self.followups.pop(0) if self.followups else None


def run_train(args):
    """train.main in this process (a subprocess would pay the imports again): exit code and stderr."""
    import contextlib
    import io
    import types

    import train
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = train.main(args)
        except SystemExit as exc:      # argparse errors
            code = exc.code
    return types.SimpleNamespace(returncode=code, stderr=err.getvalue())


def alternating_rewards():
    """A stand-in for reward.trajectory_reward giving 1, 0, 1, 0, ... in call order, so GRPO groups (rows of one
    task are consecutive) are not flat and the loss is computed even for a model that solves nothing."""
    from bench import Score
    counter = [0]

    def fake(bench, task, traj, defects, penalty, kind="success"):
        counter[0] += 1
        return Score(reward=float(counter[0] % 2))
    return fake

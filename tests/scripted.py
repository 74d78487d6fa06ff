"""Test helpers: tiny tasks, a small deterministic environment and train.main in-process. The steering hook
that scripts a model's turns (Script) lives in perf/steering.py and is re-exported here for the tests."""
from __future__ import annotations

import json

from bench import Task
from perf.steering import Script, alternating_rewards, call_text  # noqa: F401  (the tests' steering)

TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "look a key up",
                                      "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                     "required": ["key"]}}},
    {"type": "function", "function": {"name": "ping", "description": "no arguments",
                                      "parameters": {"type": "object", "properties": {}}}},
]


def tasks(n=2):
    out = []
    for i in range(n):
        out.append(Task(id=f"t{i}", tools=TOOLS, messages=[
            {"role": "system", "content": "You look things up." + " Be exact." * i},
            {"role": "user", "content": f"Find key number {i}" + " please" * (2 * i)}]))
    return out


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



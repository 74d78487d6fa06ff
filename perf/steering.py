"""Steering a real model's rollout: scripted turns for speed runs, GPU step checks and tests.

`Script` is a rollout steering hook (rollout.Engine.run's `steer`): it forces structure (tool-call tags, JSON
punctuation, closing tags) and leaves "free" slots where the model's own logits choose among alphanumeric tokens,
so a steered rollout still exercises the model and its KV cache. `placeholder_call` and `first_call_script` steer
a model that never calls a tool by itself (SmolLM2, a random-weight model) into one well-formed call;
`alternating_rewards` stands in for the scorer so GRPO groups are never flat.
"""
from __future__ import annotations

import json

import torch

from bench import Score


def call_text(name, args_prefix):
    """Forced head of a call in the template's own format; the argument value is left open."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args_prefix}'



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




def placeholder_call(task) -> tuple[str, str]:
    """(name, arguments JSON) of a call to the task's tool with the fewest required arguments (the first such),
    a type-fitting placeholder for each required argument."""
    fn = min((t["function"] for t in task.tools), key=lambda f: len(f.get("parameters", {}).get("required", [])))
    params = fn.get("parameters", {})
    placeholder = {"string": "x", "integer": 1, "number": 1, "boolean": True, "array": [], "object": {}}
    args = {k: placeholder.get(params.get("properties", {}).get(k, {}).get("type"), "x")
            for k in params.get("required", [])}
    return fn["name"], json.dumps(args)


def first_call_script(tok, rows: int, name: str, arguments: str, free_tokens: int = 2) -> Script:
    """A Script whose every row first writes the call name(arguments) in the template's hermes text, then a short
    free answer ("Done " and `free_tokens` model-chosen tokens); tool responses and later turns stay the model's."""
    acts = {i: [[call_text(name, arguments) + "}\n</tool_call>"], ["Done ", free_tokens]] for i in range(rows)}
    return Script(tok, acts)


def alternating_rewards():
    """A stand-in for reward.trajectory_reward giving 1, 0, 1, 0, ... in call order, so GRPO groups (rows of one
    task are consecutive) are not flat and the loss is computed even for a model that solves nothing."""
    counter = [0]

    def fake(bench, task, traj, defects, penalty, kind="success"):
        counter[0] += 1
        return Score(reward=float(counter[0] % 2))
    return fake

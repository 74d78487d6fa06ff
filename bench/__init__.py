"""The benchmark interface shared by every module under bench/.

Each benchmark module exposes:

    NAME: str
    load_tasks(split: str, limit: int | None = None, **opts) -> list[Task]
    make_env(task: Task) -> Env      # fresh and deterministic, one per trajectory
    score(task: Task, traj: Trajectory) -> Score   # reward in [0, 1] plus components

`load_bench(name)` imports one by name so train.py and evaluate.py have no special cases.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from chat_format import ToolCall  # noqa: F401  (a parsed call is a chat-format concept; benchmarks score them)

BENCHES = {
    "toyworld": "bench.toyworld",
    "bfcl": "bench.bfcl",
    "tau2": "bench.tau2",
    "vita": "bench.vita",
    "finmcp": "bench.finmcp",
}


@dataclass
class Task:
    id: str
    messages: list[dict]              # chat messages that open the episode (system, user)
    tools: list[dict]                 # OpenAI-style function schemas: {"type": "function", "function": {...}}
    ground_truth: Any = None
    metadata: dict = field(default_factory=dict)
    max_assistant_turns: int | None = None   # e.g. 1 for single-turn function calling


@dataclass
class Trajectory:
    """What scoring sees of one rollout row: the chat view, not tokens."""
    task_id: str
    messages: list[dict]                     # system/user/assistant/tool messages, as the agent saw them
    calls: list[ToolCall] = field(default_factory=list)   # every well-formed call, in order
    observations: list[str] = field(default_factory=list)  # the response each call got (real or rehearsed)
    rehearsed: list[bool] = field(default_factory=list)    # per call: True if the policy wrote the response
    final_answer: str = ""                   # text of the last assistant turn without a call
    end_reason: str = ""
    errors: list[str] = field(default_factory=list)        # typed errors recorded during the rollout


@dataclass
class Score:
    reward: float
    components: dict = field(default_factory=dict)


class Env(Protocol):
    def step(self, name: str, arguments: dict) -> str:
        """Execute one tool call for real; return the observation text (errors as text, never raise)."""

    def user_turn(self, assistant_text: str) -> str | None:
        """The next user message after an assistant turn without a call, or None to end the episode."""


class BenchUnavailable(RuntimeError):
    """A benchmark's package or data is missing; the message says how to install or where to point."""


def load_bench(name: str):
    if name not in BENCHES:
        raise ValueError(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHES)}")
    return importlib.import_module(BENCHES[name])

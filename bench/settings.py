"""Per-benchmark run settings, in one place: what train.py and evaluate.py use unless a flag overrides it.

    settings_for("tau2").max_total_len   # 32768

Each benchmark's limits are sized for its prompts (a tau² prompt with its policy and tools is ~4-6k Qwen tokens;
a BFCL multi-turn one 2-8k; a toy-world chat ~130 tiny-model tokens) and its episodes (tau² and VitaBench run
up to 30 agent turns, the paper's cap; BFCL's own step limit is 20 per user turn). Sampling follows the paper:
temperature 1.0 while training, 0.6 / top-p 0.95 at evaluation.

Protocols (`eval_limits`): training always runs the paper's limits above. Evaluation runs the benchmark's
official protocol by default ("official"): an episode ends where the official harness ends it, not at the
paper's 30-turn cap or a fixed context.
  tau2      the Orchestrator's max_steps 200 and max_errors 10 (tau2.config's defaults; `--task-opts
            max_steps=N,max_errors=M` changes them); the turn cap is max_steps, which every assistant turn counts
            toward, so it never ends an episode first; the context is the model's own (config.json).
  bfcl      no episode cap: BFCL ends a user turn after 20 steps (force termination) and the episode after its
            last user turn; the context is the model's own.
  toyworld, vita, finmcp: no official harness limits are implemented; the paper's limits under both protocols.
"paper" (`evaluate.py --protocol paper`) evaluates with the training limits, as the paper reports.

Splits: `train_split` is what train.py trains on, `eval_split` what evaluate.py scores by default.
  toyworld  train / test (held-out account pairs, bench/toyworld.py)
  tau2      the package's own train / test task splits (tau2/domains/<domain>/split_tasks.json)
  bfcl      BFCL has no train split: train.py trains on "train", a fixed half of the multi-turn entries (by task
            id); "dev" is the other half, the held-out set to evaluate such a run on. "test" (the default of
            evaluate.py) is every offline category, the official number for a model not trained on BFCL.
  vita      VitaBench has no train split: "train" / "dev" is the project's own 80/20 partition by task id.
  finmcp    a test set with recorded reference calls: "train" / "dev" is the project's 80/20 partition.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class RunSettings:
    """Limits and splits of one benchmark. Token counts are per trajectory unless named otherwise."""
    max_new_tokens: int          # per assistant turn
    max_world_tokens: int        # per rehearsed (or simulated) tool response
    max_turns: int               # assistant turns per trajectory
    max_total_len: int           # tokens per trajectory, prompt included
    train_split: str
    eval_split: str
    user_max_new_tokens: int = 256    # one simulated-user reply (tau2, vita)
    user_max_total_len: int = 8192    # the simulated user's own context
    train_temperature: float = 1.0    # the paper: 1.0 in training rollouts ...
    eval_temperature: float = 0.6     # ... 0.6 with top-p 0.95 at evaluation
    eval_top_p: float = 0.95
    official_max_turns: int | None = None  # --protocol official: assistant turns per episode (None: max_turns)
    official_context: bool = False    # --protocol official: max_total_len is the model's context length
    max_steps: int | None = None      # tau2's Orchestrator: steps (messages) before it ends the simulation ...
    max_errors: int | None = None     # ... and tool errors (the agent's and the user's) before it ends it
    eval_limit: int | None = None     # evaluate.py's default task count (None: the whole split)
    eval_fidelity: bool = False       # evaluate.py probes world-model fidelity by default (cheap replays only)
    tiny_warm_start: bool = False     # the embedded tiny model's default warm start is built for this benchmark


NO_EPISODE_CAP = 100_000   # an assistant-turn bound no episode reaches: the benchmark's own rules end it first
PROTOCOLS = ("official", "paper")

SETTINGS = {
    "toyworld": RunSettings(max_new_tokens=48, max_world_tokens=32, max_turns=8, max_total_len=2048,
                            train_split="train", eval_split="test", user_max_new_tokens=48,
                            user_max_total_len=2048, eval_limit=256, eval_fidelity=True, tiny_warm_start=True),
    # eval_limit: 256 of the 1000 test tasks, a success's 95% interval about +-0.055
    "bfcl": RunSettings(max_new_tokens=512, max_world_tokens=256, max_turns=30, max_total_len=16384,
                        train_split="train", eval_split="test", official_max_turns=NO_EPISODE_CAP,
                        official_context=True),
    "tau2": RunSettings(max_new_tokens=512, max_world_tokens=256, max_turns=30, max_total_len=32768,
                        train_split="train", eval_split="test", official_max_turns=200, official_context=True,
                        max_steps=200, max_errors=10),
    "vita": RunSettings(max_new_tokens=512, max_world_tokens=512, max_turns=30, max_total_len=32768,
                        train_split="train", eval_split="test"),
    "finmcp": RunSettings(max_new_tokens=512, max_world_tokens=512, max_turns=30, max_total_len=16384,
                          train_split="train", eval_split="test"),
}
LIMIT_FIELDS = ("max_new_tokens", "max_world_tokens", "max_turns", "max_total_len")


def settings_for(bench: str) -> RunSettings:
    """The run settings of a benchmark by name (ValueError naming the choices for an unknown one)."""
    if bench not in SETTINGS:
        raise ValueError(f"no run settings for benchmark {bench!r}; known: {', '.join(SETTINGS)}")
    return SETTINGS[bench]


def limits_for(bench: str, **overrides) -> dict:
    """{max_new_tokens, max_world_tokens, max_turns, max_total_len} of a benchmark, a value given as not None
    in overrides replacing its default: the one resolution train.py and evaluate.py share."""
    s = settings_for(bench)
    return {k: overrides[k] if overrides.get(k) is not None else getattr(s, k) for k in LIMIT_FIELDS}


def eval_limits(bench: str, protocol: str, model_context: int | None, **overrides) -> dict:
    """The evaluation limits of a benchmark under a protocol ("official" | "paper"): the training limits, with
    "official" replacing the turn cap by the official harness's and the context by the model's own
    (`model_context`, its max_position_embeddings; None keeps max_total_len). A value given as not None in
    overrides wins, as in limits_for."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    s, limits = settings_for(bench), limits_for(bench)
    if protocol == "official":
        if s.official_max_turns is not None:
            limits["max_turns"] = s.official_max_turns
        if s.official_context and model_context:
            limits["max_total_len"] = model_context
    return {k: overrides[k] if overrides.get(k) is not None else v for k, v in limits.items()}


def describe(bench: str) -> dict:
    """A benchmark's RunSettings as a plain dict (for logs and result JSONs)."""
    return dataclasses.asdict(settings_for(bench))

"""Task-success rewards: one function per benchmark family, (task, trajectory) -> Score in [0, 1].

The verifier rule. In EnvACE training the rollout calls no environment: the policy writes every tool response
itself. The reward must still be the task's real success, so every function here scores the *committed calls*
of the trajectory against ground truth, replaying them on a fresh, real environment *after* the rollout where
the benchmark's success depends on environment state. That environment is the verifier, not a source of
observations: nothing it returns reaches the policy during training. Observations the policy rehearsed are
never trusted for scoring.

`trajectory_reward` is what train.py uses: the base reward is either the binary success score or, with
`kind="checklist"`, the fraction of the benchmark's rule-based checklist items met (`checklist`, next to each
benchmark's `score`: gold calls / actions, final state or DB, answer). The official EnvACE reward is a 30B LLM
judge scoring checklist items per turn; the rule stands in for it, and like every function here it checks the
committed calls against ground truth after the rollout, never the rehearsed responses. A configurable penalty
for each defect of a rehearsed response (empty, unterminated, not JSON) is subtracted, so that world tokens get
a signal to be well-formed. Success is kept in the components either way.
"""
from __future__ import annotations

from collections import defaultdict

from bench import Score, Task, Trajectory, load_bench, optional
from diagnostics import fidelity, replay_call


def toyworld_reward(task: Task, traj: Trajectory) -> Score:
    """1 iff, after replaying the calls on a fresh bank/shop, the final state equals the gold state, the last
    integer in the final answer equals the gold value, and every gold lookup was made."""
    return load_bench("toyworld").score(task, traj)


def bfcl_reward(task: Task, traj: Trajectory) -> Score:
    """BFCL's own semantics: single-turn calls through bfcl-eval's AST checker (relevance: no call / some
    call); multi-turn calls grouped by user turn and replayed on fresh backends through its state- and
    response-based multi_turn_checker. 1 iff valid."""
    return load_bench("bfcl").score(task, traj)


def tau2_reward(task: Task, traj: Trajectory) -> Score:
    """tau²'s own evaluator over the calls replayed on a fresh domain environment: the product of the task's
    reward_basis checks (DB hash, ACTION, COMMUNICATE, ENV_ASSERTION). NL assertions (an LLM judge) are off
    and reported as not evaluated."""
    return load_bench("tau2").score(task, traj)


def vita_reward(task: Task, traj: Trajectory) -> Score:
    """The official VitaBench score needs an LLM rubric judge; by default this is the deterministic
    order-state proxy (required orders' stores, products, quantities, status after replay), labelled
    `order_state_proxy` in the components."""
    return load_bench("vita").score(task, traj)


def finmcp_reward(task: Task, traj: Trajectory) -> Score:
    """Tool-name F1 of the calls against the recorded reference calls (precision, recall, exact sequence
    match reported alongside)."""
    return load_bench("finmcp").score(task, traj)


REWARDS = {"toyworld": toyworld_reward, "bfcl": bfcl_reward, "tau2": tau2_reward, "vita": vita_reward,
           "finmcp": finmcp_reward}


REWARD_KINDS = ("success", "checklist")


def has_checklist(bench: str) -> bool:
    """Whether the benchmark offers a rule-based checklist (bench.OPTIONAL: --reward checklist needs one)."""
    return optional(load_bench(bench), "checklist") is not None


def _require_checklist(bench: str):
    if not has_checklist(bench):
        raise ValueError(f"benchmark {bench!r} has no rule-based checklist; use the success reward")


def checklist(bench: str, task: Task, traj: Trajectory) -> list[tuple[str, bool]]:
    """The benchmark's rule-based checklist items (name, met), checked against ground truth after the rollout."""
    _require_checklist(bench)
    return load_bench(bench).checklist(task, traj)


def trajectory_reward(bench: str, task: Task, traj: Trajectory, rehearsal_defects: list[str] = (),
                      defect_penalty: float = 0.0, kind: str = "success") -> Score:
    """The training reward: the base reward (kind "success": the benchmark's success score; "checklist": the
    fraction of checklist items met) minus `defect_penalty` per rehearsal defect, clipped to [0, 1].
    Components keep the success score as `success` (and the items as `checklist`)."""
    if bench not in REWARDS:
        raise ValueError(f"no reward for benchmark {bench!r}; known: {', '.join(REWARDS)}")
    if kind not in REWARD_KINDS:
        raise ValueError(f"reward kind must be one of {', '.join(REWARD_KINDS)}, not {kind!r}")
    if kind == "checklist":   # before scoring: a benchmark without one fails fast
        _require_checklist(bench)
    s = REWARDS[bench](task, traj)
    components = {**s.components, "success": s.reward, "rehearsal_defects": len(rehearsal_defects)}
    base = s.reward
    if kind == "checklist":
        items = checklist(bench, task, traj)
        base = sum(met for _, met in items) / len(items) if items else s.reward
        components["checklist"] = items
    reward = min(1.0, max(0.0, base - defect_penalty * len(rehearsal_defects)))
    return Score(reward=reward, components=components)


# ----------------------------------------------------------------------------------------------------------
# World-model fidelity: what the policy rehearsed against what the real tool answers


def rehearsal_fidelity(bench: str, task: Task, traj: Trajectory) -> list[tuple[str, dict]]:
    """(tool name, diagnostics.fidelity(predicted, real)) for each call whose response the policy rehearsed.

    Verifier logic, run after the rollout: the trajectory's calls are replayed in order on a fresh real
    environment (so each real response sees the state the earlier calls left) and each rehearsed response
    is compared with the real response of the same call. Nothing here reaches the policy."""
    env = load_bench(bench).make_env(task)
    pairs = []
    for i, call in enumerate(traj.calls):
        real = replay_call(env, call.name, call.arguments)
        if i < len(traj.rehearsed) and traj.rehearsed[i] and i < len(traj.observations):
            pairs.append((call.name, fidelity(traj.observations[i], real)))
    return pairs


def fidelity_sums(pairs) -> dict[str, list[float]]:
    """tool -> [calls, exact, kv_agreement sum, calls with a kv_agreement, error_correct]: sums that add up
    over trajectories and processes (see fidelity_by_tool)."""
    sums = defaultdict(lambda: [0.0] * 5)
    for tool, f in pairs:
        s = sums[tool]
        kv = f["kv_agreement"]
        s[0] += 1
        s[1] += float(f["exact"])
        s[2] += kv if kv is not None else 0.0
        s[3] += kv is not None
        s[4] += float(f["error_correct"])
    return dict(sums)


def fidelity_by_tool(sums: dict[str, list[float]]) -> dict[str, dict]:
    """tool -> {"calls", "exact", "kv", "error_correct"} (means over that tool's rehearsed calls; kv over the
    calls whose real response is JSON, None without any)."""
    return {tool: {"calls": int(s[0]), "exact": s[1] / s[0], "kv": s[2] / s[3] if s[3] else None,
                   "error_correct": s[4] / s[0]} for tool, s in sorted(sums.items()) if s[0]}

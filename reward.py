"""Task-success rewards: one function per benchmark family, (task, trajectory) -> Score in [0, 1].

The verifier rule. In EnvACE training the rollout calls no environment: the policy writes every tool response
itself. The reward must still be the task's real success, so every function here scores the *committed calls*
of the trajectory against ground truth, replaying them on a fresh, real environment *after* the rollout where
the benchmark's success depends on environment state. That environment is the verifier, not a source of
observations: nothing it returns reaches the policy during training. Observations the policy rehearsed are
never trusted for scoring.

`trajectory_reward` adds the shaping train.py uses on top: a configurable penalty for each defect of a
rehearsed response (empty, unterminated, not JSON), so that world tokens get a signal to be well-formed.
"""
from __future__ import annotations

from bench import Score, Task, Trajectory, load_bench


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


def trajectory_reward(bench: str, task: Task, traj: Trajectory, rehearsal_defects: list[str] = (),
                      defect_penalty: float = 0.0) -> Score:
    """The training reward: the benchmark's success score minus `defect_penalty` per rehearsal defect,
    clipped to [0, 1]. Components keep the raw score as `success`."""
    if bench not in REWARDS:
        raise ValueError(f"no reward for benchmark {bench!r}; known: {', '.join(REWARDS)}")
    s = REWARDS[bench](task, traj)
    reward = min(1.0, max(0.0, s.reward - defect_penalty * len(rehearsal_defects)))
    return Score(reward=reward, components={**s.components, "success": s.reward,
                                            "rehearsal_defects": len(rehearsal_defects)})

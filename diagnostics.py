"""The world model measured and test-time rehearsal diagnosed, verifier side: nothing here reaches the policy.

    fidelity(predicted, real)     a rehearsed response against the real one (exact, JSON key/value, error kind)
    replay_call(env, name, args)  one call executed for real (the verifier's replays)
    predict_responses(...)        the model's rehearsed responses for given contexts (probes, self memories)
    rehearsal_diagnostics(...)    per turn of an episode: did the assessment agree with the real outcome, did
                                  the committed call differ from the first proposal, and did that help
"""
from __future__ import annotations

import copy
import json

import torch

from chat_format import CallError, assessment_verdict
from kvbatch import KVBatch
from roles import Role
from rollout import Generate, Row, SamplingConfig, derive_seed


# -- fidelity of the world model ---------------------------------------------


@torch.no_grad()
def predict_responses(eng, task, contexts: list[list[int]], cfg: SamplingConfig, steer=None) -> list[str]:
    """The policy's own rehearsed response after each context (token ids ending with the tool-response
    opening), written as at test time: a WORLD segment up to the closing tag or cfg.max_world_tokens, read
    by Engine.rehearsal_text. Row k is stream k (for `steer`) and samples from a generator seeded by
    (cfg.seed, k). A context past cfg.max_total_len predicts ""."""
    predicted = [""] * len(contexts)
    rows = []
    for k, ids in enumerate(contexts):
        def end(row, stopped, k=k):
            predicted[k] = eng.rehearsal_text(row.ids[row.gen_start:], stopped)[0]
        row = Row(task, ids, stream=k, seed=derive_seed(cfg.seed, "self-memory", k), bucket="private")
        row.plan.append(Generate(Role.WORLD, cfg.max_world_tokens, on_end=end))
        eng.advance(row)
        rows.append(row)
    joining = [rows]
    training = eng.model.training
    eng.model.eval()              # sampled as at test time (no dropout), whatever the caller's mode
    try:
        eng.decode(KVBatch(eng.model, eng.tok.pad_token_id), cfg, None, steer,
                   admit=lambda n: joining.pop() if joining else [])
    finally:
        eng.model.train(training)
    return predicted


def _json(text: str):
    try:
        return True, json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return False, None


def is_error_text(text: str) -> bool:
    """An error observation: JSON with an "error" key, or text starting with "Error"."""
    ok, obj = _json(text)
    if ok:
        return isinstance(obj, dict) and "error" in obj
    return text.strip().startswith("Error")


def fidelity(predicted: str, real: str) -> dict:
    """Compare a rehearsed (predicted) tool response with the real one.

    exact: equal after stripping whitespace, or equal as parsed JSON. kv_agreement: the fraction of the real
    JSON object's top-level keys whose value the prediction got right (1/0 for a non-object JSON value; None
    when the real response is not JSON). error_correct: predicted-is-error == real-is-error.
    """
    p_ok, p = _json(predicted)
    r_ok, r = _json(real)
    exact = predicted.strip() == real.strip() or (p_ok and r_ok and p == r)
    if not r_ok:
        kv = None
    elif isinstance(r, dict):
        kv = (sum(1 for k, v in r.items() if isinstance(p, dict) and k in p and p[k] == v) / len(r)) if r else \
            float(p == r)
    else:
        kv = float(p_ok and p == r)
    pe, re_ = is_error_text(predicted), is_error_text(real)
    return {"exact": bool(exact), "predicted_json": p_ok, "kv_agreement": kv, "real_error": re_,
            "predicted_error": pe, "error_correct": pe == re_}


def _plain_calls(items) -> list[dict]:
    """A turn's calls as JSON values: {"name", "arguments"}, or {"error"} for a call the parser refused.
    Takes a private record's items or a parsed turn's ToolCall / CallError items."""
    out = []
    for item in items:
        if isinstance(item, CallError):
            out.append({"error": f"{item.kind}: {item.message}"})
        elif isinstance(item, dict) and "error" in item:
            out.append({"error": item["error"]})
        elif isinstance(item, dict):
            out.append({"name": item["name"], "arguments": item["arguments"]})
        else:
            out.append({"name": item.name, "arguments": item.arguments})
    return out


def _same_calls(a: list[dict], b: list[dict]) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def replay_call(env, name: str, arguments: dict) -> str:
    """One call executed verifier-side on a replayed environment (the trajectory's arguments are not shared)."""
    try:
        return str(env.step(name, copy.deepcopy(arguments)))
    except Exception as exc:     # as the engine does: an environment that raises answers with an error
        return json.dumps({"error": f"environment raised {type(exc).__name__}: {exc}"})


def replayed_env(make_env, task, traj, turn: int):
    """A fresh real environment holding the state the episode's environment had when assistant turn `turn`
    began: the committed calls of earlier turns that were executed, replayed in order. None when that state
    cannot be rebuilt: a replayed call's response differs from the one the episode got (the environment is
    not a function of the calls), or building it raised."""
    try:
        env = make_env(task)
    except Exception:
        return None
    for i, call in enumerate(traj.calls):
        if call.turn >= turn:
            break
        seen = traj.observations[i] if i < len(traj.observations) else None
        if seen is None or (i < len(traj.rehearsed) and traj.rehearsed[i]):
            continue             # never executed in the episode (the row ended first), or rehearsed
        if replay_call(env, call.name, call.arguments) != seen:
            return None
    return env


def _remaining_gold(gold: list[dict], made: list[dict]) -> list[dict]:
    """The gold calls not yet made (multiset difference on name + arguments)."""
    left = list(gold)
    for call in made:
        for k, g in enumerate(left):
            if _same_calls([g], [call]):
                del left[k]
                break
    return left


def real_outcome(calls: list[dict], cut_off: bool, new_env, remaining_gold: list[dict] | None):
    """(outcome, real responses) of one assistant turn (a proposal or the committed turn). Outcomes:
        error       the turn was cut off (max_new_tokens: the engine ends the episode on it), or a call is one
                    the parser refuses, or a call's real response is an error (is_error_text)
        right       no error, and the benchmark names the calls a correct solution makes (gold): every call is
                    a distinct one of the gold calls not yet made by earlier committed turns (order free);
                    an answer (no call) is right when no gold call is left
        wrong       no error, the benchmark has gold calls, and the turn is not right
        ok          no error; the benchmark has no gold calls (whether the call is needed is not judged)
        unmeasured  the turn's calls would have to run but the state cannot be rebuilt (new_env() is None),
                    or it is an answer on a benchmark without gold calls
    `new_env()` gives a fresh environment in the turn's starting state; the calls run on it in order, each
    seeing what the earlier ones did, as in the episode. An answer's text is not judged."""
    if cut_off:
        return "error", []
    if not calls:
        if remaining_gold is None:
            return "unmeasured", []
        return ("wrong" if remaining_gold else "right"), []
    if any("error" in c for c in calls):
        return "error", []
    env = new_env()
    if env is None:
        return "unmeasured", []
    responses = [replay_call(env, c["name"], c["arguments"]) for c in calls]
    if any(is_error_text(r) for r in responses):
        return "error", responses
    if remaining_gold is None:
        return "ok", responses
    left = _remaining_gold(remaining_gold, calls)
    return ("right" if len(left) == len(remaining_gold) - len(calls) else "wrong"), responses


def assessment_agrees(verdict: str | None, outcome: str) -> bool | None:
    """Whether a verdict's decision (ok = commit, fails / wrong = revise) matches the real outcome: right ->
    commit; error or wrong -> revise; ok (no error, need not judged) -> "ok" agrees, "fails" disagrees,
    "wrong" cannot be checked. None: not measured (no verdict, outcome unmeasured, or that last case)."""
    if verdict is None or outcome == "unmeasured" or (outcome == "ok" and verdict == "wrong"):
        return None
    return (verdict == "ok") == (outcome in ("right", "ok"))


def change_effect(first: str, committed: str) -> str:
    """helped / hurt / neutral: whether the committed turn's real outcome ranks above, below or with the first
    proposal's (error < wrong, ok < right); unmeasured when either is unmeasured."""
    if "unmeasured" in (first, committed):
        return "unmeasured"
    a, b = OUTCOME_RANK[first], OUTCOME_RANK[committed]
    return "helped" if b > a else "hurt" if b < a else "neutral"


# -- diagnosing test-time rehearsal (verifier side, after the episode) ---------------------------------------
#
# Does the self-assessment tell a good proposal from a bad one, how often does the committed call differ from
# the first proposal, and did the change help? Each proposal is executed for real, but only here: on a fresh
# environment from `make_env(task)` into which the committed calls of the earlier turns are replayed, once
# the episode has ended. Nothing computed here reaches the policy (the same verifier rule as reward.py).

# how good a real outcome is, to say whether a change helped; "ok" (no error, the benchmark cannot say more)
# is never compared with "wrong"/"right" since one benchmark gives either {error, ok} or {error, wrong, right}
OUTCOME_RANK = {"error": 0, "wrong": 1, "ok": 1, "right": 2}
DIAGNOSTIC_COUNTS = ("turns", "rehearsed_turns", "assessed", "verdict_unparsed", "assess_unmeasured", "assess_agree",
                     "assess_disagree", "changed", "unchanged", "helped", "hurt", "neutral", "effect_unmeasured")


def rehearsal_diagnostics(task, traj, rehearsals: list[list[dict]], make_env, fmt,
                          gold: list[dict] | None = None) -> list[dict]:
    """Per committed turn with private rehearsals: each proposal's verdict and real outcome, whether the
    assessment agrees with it, whether the committed turn differs from the first proposal and, if so, whether
    that helped. Verifier logic, after the episode (see real_outcome for how a turn's outcome is measured).

    rehearsals[t] are the private records of assistant turn t (Episode.rehearsals, or the JSONL's
    "rehearsals"); traj is the committed trajectory; fmt parses the committed turns (ChatFormat); gold, where
    the benchmark has it, is the calls a correct solution makes ({"name", "arguments"}).

    Changed: the committed turn's calls (name and arguments, in order; a refused call by its parser error)
    differ from the first proposal's. Two answers without calls count as the same."""
    committed = [m for m in traj.messages[len(task.messages):] if m.get("role") == "assistant"]
    # a simulated user who acted on the environment (tau2 telecom) changed its state; a replay of the agent's
    # calls cannot rebuild the turns after that
    first_unreplayable, n_assistant = len(committed), 0
    for m in traj.messages[len(task.messages):]:
        n_assistant += m.get("role") == "assistant"
        if m.get("role") == "user" and m.get("user_tool_calls"):   # acted before turn n_assistant began
            first_unreplayable = min(first_unreplayable, n_assistant)
    out = []
    for t, records in enumerate(rehearsals[:len(committed)]):
        made = [{"name": c.name, "arguments": c.arguments} for c in traj.calls if c.turn < t]
        left = _remaining_gold(gold, made) if gold is not None else None

        def new_env(t=t):
            return replayed_env(make_env, task, traj, t) if t < first_unreplayable else None

        proposals = []
        for rec in records:
            calls = _plain_calls(rec["items"])
            outcome, responses = real_outcome(calls, not rec.get("terminated", True), new_env, left)
            verdict = assessment_verdict(rec["assessment"]) if calls else None
            proposals.append({"calls": calls, "verdict": verdict, "outcome": outcome, "real": responses,
                              "agree": assessment_agrees(verdict, outcome) if calls else None})
        msg = committed[t]
        cut_off = t == len(committed) - 1 and traj.end_reason == "max_new_tokens"
        calls = _plain_calls(fmt.parse(msg.get("raw", msg.get("content") or ""), task.tools).items)
        outcome, responses = real_outcome(calls, cut_off, new_env, left)
        rehearsed = any(p["calls"] for p in proposals)
        changed = rehearsed and bool(proposals) and not _same_calls(proposals[0]["calls"], calls)
        out.append({"turn": t, "rehearsed": rehearsed, "proposals": proposals,
                    "committed": {"calls": calls, "outcome": outcome, "real": responses},
                    "changed": changed,
                    "effect": change_effect(proposals[0]["outcome"], outcome) if changed else None})
    return out


def diagnostic_counts(turns: list[dict]) -> dict:
    """Counts over rehearsal_diagnostics' turns (they add up over episodes; see diagnostic_summary):
    turns, rehearsed_turns (a proposal called a tool); over proposals with calls: assessed, verdict_unparsed,
    assess_unmeasured, assess_agree, assess_disagree, and verdict_vs_outcome ("VERDICT/OUTCOME" -> n);
    over rehearsed turns: changed, unchanged; over changed turns: helped, hurt, neutral, effect_unmeasured."""
    c = dict.fromkeys(DIAGNOSTIC_COUNTS, 0)
    matrix: dict[str, int] = {}
    for turn in turns:
        c["turns"] += 1
        for p in turn["proposals"]:
            if not p["calls"]:
                continue             # an answer: nothing was rehearsed or assessed
            c["assessed"] += 1
            key = f"{p['verdict'] or 'unparsed'}/{p['outcome']}"
            matrix[key] = matrix.get(key, 0) + 1
            if p["verdict"] is None:
                c["verdict_unparsed"] += 1
            elif p["agree"] is None:
                c["assess_unmeasured"] += 1
            else:
                c["assess_agree" if p["agree"] else "assess_disagree"] += 1
        if not turn["rehearsed"]:
            continue
        c["rehearsed_turns"] += 1
        c["changed" if turn["changed"] else "unchanged"] += 1
        if turn["changed"]:
            c[turn["effect"] if turn["effect"] != "unmeasured" else "effect_unmeasured"] += 1
    c["verdict_vs_outcome"] = dict(sorted(matrix.items()))
    return c


def diagnostic_summary(counts: list[dict]) -> dict:
    """diagnostic_counts of many episodes added up, with rates: assess_agree_rate (agree / measured
    assessments), changed_rate (changed / rehearsed turns), helped_rate and hurt_rate (over changed turns
    whose effect was measured). A rate without any case is None."""
    total = {k: sum(c.get(k, 0) for c in counts) for k in DIAGNOSTIC_COUNTS}
    matrix: dict[str, int] = {}
    for c in counts:
        for k, v in c.get("verdict_vs_outcome", {}).items():
            matrix[k] = matrix.get(k, 0) + v
    rate = lambda a, n: a / n if n else None  # noqa: E731
    measured = total["assess_agree"] + total["assess_disagree"]
    effects = total["helped"] + total["hurt"] + total["neutral"]
    return {**total, "assess_agree_rate": rate(total["assess_agree"], measured),
            "changed_rate": rate(total["changed"], total["rehearsed_turns"]),
            "helped_rate": rate(total["helped"], effects), "hurt_rate": rate(total["hurt"], effects),
            "verdict_vs_outcome": dict(sorted(matrix.items()))}

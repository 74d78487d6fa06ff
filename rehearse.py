"""Rehearsal at test time: private rehearsals before each committed turn, and the world model's fidelity.

(While training, rollout.py lets the policy write tool responses itself; the text that ends a rehearsed
response and the check of what was written live in chat_format.py, with the rest of the chat format.)
"""
from __future__ import annotations

import copy
import json
import re
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from chat_format import (ASSESS_ERROR, ASSESS_OK, ASSESS_PREFIX, ASSESS_WRONG, MEMORY_HEAD, MEMORY_TAIL, CallError,
                         validate_rehearsal)
from kvbatch import KVBatch
from rollout import (Generate, Response, Role, Row, SamplingConfig, Spawn, Text, current_tools, derive_seed,
                     encode_conversation)

# ==========================================================================================================
# Test-time private rehearsal (evaluate.py)
#
# Before each committed assistant turn the policy may rehearse privately, up to `budget` times:
#
#   proposal    an assistant turn sampled from the committed context (role ACT, private)
#   rehearsal   for each call in it, the template's tool-response opening, then the policy writes the
#               response itself (role WORLD) up to the closing tag; malformed calls get the parser's error
#   assessment  the template's tool-turn close (through the next assistant header), the fixed prefix
#               ASSESS_PREFIX, then a short assistant text (ACT, at most max_assess_tokens) judging the
#               predicted outcome and suggesting a revision
#
# Every private sequence is a child row of the committed row in the engine's one decode loop (rollout.Spawn):
# a child starts from the committed context's cache (its batch row is repeated, nothing is recomputed),
# runs its own plan, and leaves the batch when done; the committed row waits meanwhile.
# parallel:   `budget` proposals from the same committed context at once (`budget` child rows).
# sequential: one proposal at a time; proposal k starts from the committed context plus the memory of
#             rehearsals 1..k-1 (so it sees the earlier predictions and assessments).
#
# The rehearsal memory (memory_text) is a short plain-text block that the committed assistant turn STARTS
# with: a last child row holds the committed context + the memory and samples the committed turn; only those
# sampled tokens are appended to the committed row (fed to it next step). Why there and not as a user-role
# note: (1) the committed context already ends with the generation header, so the branch point is exactly
# the committed length and needs no template surgery; (2) the model reads the notes as its own (like a
# thinking block), which conditions the next tokens most directly; (3) the committed row never holds the
# memory, so the kept context is token-for-token what plain acting with that turn would hold.
# The memory is removed: the committed token sequence never contains it, nor any WORLD token; the
# environment executes only committed calls, and user_turn sees only the committed turn's text.
# (The committed tokens' recorded log-probs are those under the memory-conditioned context.)
#
# What is committed (RehearsalConfig.commit): "checked" (the default) commits the first proposal judged ok
# (RehearsalConfig.judge), its own tokens (parallel: the first such of the round; sequential: the rounds stop at
# the first ok), and regenerates under the memory only when every proposal is judged to fail; "memory" always
# regenerates (the behaviour before, kept for comparison: it changed the committed call on about half the
# rehearsed turns of the tiny model and halved its success at B=1).
#
# A proposal without any call is an answer, not a rehearsal: nothing of it can be rehearsed or fail in the
# world, so "checked" treats it as passing. Parallel: the first proposal in order that is an answer or judged
# ok is committed (an answer ahead of a checked call keeps B=0's answer; committing the call instead replaced
# right answers with extra calls); "memory" commits an answer only when no proposal calls a tool. Sequential:
# the latest proposal, if an answer, is committed as is (sampled from the committed context plus the memory). Budget 0 is plain acting, token for
# token what Engine.run(responses="real") produces for the same seed. The first proposal of a turn samples
# from the committed row's own stream (its rehearsal and assessment from one of their own), so where it is
# committed the episode stays B=0's token for token: B vs B=0 differs only on the turns rehearsal changed
# (with proposals from streams of their own, every rehearsed turn was a fresh draw, and the paired
# difference carried that sampling noise on every task).
#
# Costs are counted per bucket: "act" (the committed row, the memory and the re-fed committed tokens),
# "private" (proposals, rehearsals, assessments) and "fidelity" (the discarded world-model probes); a
# step's wall time is split over its rows by the tokens each fed or sampled.
#
# Many tasks run as rows of one batch (act_many, used by evaluate.py): rows sample from generators seeded
# by their own task's seed, turn and branch, so every episode equals its run alone.

MODES = ("parallel", "sequential")
WORLDS = ("model", "oracle")      # who writes a private rehearsal's responses: the world model | the real
                                  # environment on a rebuilt copy (evaluation only: the headroom of B > 0)
JUDGES = ("assessment", "prediction")   # what judges a proposal for commit "checked": the policy's own
                                        # assessment text | the rehearsed response (ok unless it is an error)
COMMITS = ("checked", "memory")   # what a rehearsed turn commits: the proposal judged ok | a turn regenerated
                                  # under the rehearsal memory (every time: the behaviour before "checked")


@dataclass
class RehearsalConfig:
    """Test-time rehearsal settings: the budget of private rehearsals per committed turn, parallel or sequential,
    assessment and memory lengths, the fidelity probe, and what a rehearsed turn commits."""
    budget: int = 0                 # private rehearsals before each committed turn; 0 = plain acting
    mode: str = "parallel"          # "parallel" or "sequential"
    max_assess_tokens: int = 48
    memory_chars: int = 240         # each predicted response / assessment is cut to this many characters
    fidelity: bool = False          # probe the world model on every real call (a discarded WORLD branch)
    commit: str = "checked"         # checked: commit the first proposal judged ok (judge), token for
                                    # token; regenerate under the memory only when none does. memory: always
                                    # regenerate under the memory
    judge: str = "prediction"       # "checked"'s test: the rehearsed responses hold no error (the world model's
                                    # prediction alone) | "assessment": the policy's own assessment says ok
    world: str = "model"            # oracle: a real environment, rebuilt to the committed state, answers the
                                    # rehearsed calls instead of the world model (needs act_many's oracle_env)

    def __post_init__(self):
        if self.judge not in JUDGES:
            raise ValueError(f"rehearsal judge must be one of {', '.join(JUDGES)}, not {self.judge!r}")
        if self.world not in WORLDS:
            raise ValueError(f"rehearsal world must be one of {', '.join(WORLDS)}, not {self.world!r}")
        if self.mode not in MODES:
            raise ValueError(f"rehearsal mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.commit not in COMMITS:
            raise ValueError(f"rehearsal commit must be one of {', '.join(COMMITS)}, not {self.commit!r}")
        if self.budget < 0:
            raise ValueError(f"rehearsal budget must be >= 0, not {self.budget}")


def _short(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def memory_text(records: list[dict], memory_chars: int = 240) -> str:
    """Condense private rehearsals into the block the committed turn starts with ('' when there are none)."""
    if not records:
        return ""
    lines = [MEMORY_HEAD]
    for i, rec in enumerate(records, 1):
        if not rec["items"]:
            lines.append(f"[{i}] answer without a call: {_short(rec['content'], memory_chars)}\n")
        for item in rec["items"]:
            if "error" in item:
                lines.append(f"[{i}] invalid call ({_short(item['error'], memory_chars)})\n")
            else:
                args = json.dumps(item["arguments"], ensure_ascii=False)
                lines.append(f"[{i}] {item['name']}({args}) -> predicted "
                             f"{_short(item['predicted'], memory_chars)}\n")
        if rec["assessment"]:
            lines.append(f"    assessment: {_short(rec['assessment'], memory_chars)}\n")
    lines.append(MEMORY_TAIL)
    return "".join(lines)


# -- teaching the format: supervised warm-start examples -------------------------------------------------
#
# A model that never saw a memory block or an assessment prefix derails on them (measured: the tiny model
# drops from 56% to 0% at B >= 1). These examples put both formats in the warm start, laid out token for
# token as `act` lays them out at test time:
#   assessment  context | proposal (ACT) | tool-response open | real response (WORLD) | close | ASSESS_PREFIX |
#               assessment text (ACT)
#   memory      context | memory block of 1-4 rehearsals, the first being the assessment example's (PROMPT,
#               not trained) | the reference turn (ACT)
# Proposals are the reference call or a perturbation of it; the "predicted" responses are the real ones
# (what a perfect world model would write). The assessment rule is fixed and learnable: a proposal equal
# to the reference is "ok", one whose response is an error "revise: it fails", else "revise: wrong
# arguments". The committed turn is always the reference, so the memory teaches: commit what was judged ok.

def assessment_for(call_is_reference: bool, response: str) -> str:
    """The fixed rule the warm-start examples teach: ASSESS_OK for the reference call, else ASSESS_ERROR when its
    response is an error, else ASSESS_WRONG."""
    if call_is_reference:
        return ASSESS_OK
    return ASSESS_ERROR if is_error_text(response) else ASSESS_WRONG


def perturb_arguments(arguments: dict, strings: list[str], rng) -> dict:
    """A plausible wrong version of a call's arguments: one integer moved, or one string swapped for another
    string of the episode (or misspelt). Returns a different dict whenever the arguments have a value."""
    keys = [k for k, v in arguments.items() if isinstance(v, (int, str)) and not isinstance(v, bool)]
    if not keys:
        return dict(arguments)
    out = dict(arguments)
    k = rng.choice(keys)
    v = out[k]
    if isinstance(v, int):
        choices = [v * 2, v + rng.randint(1, 9), max(1, v - rng.randint(1, 9)), max(1, v // 2), v * 3]
        choices = [c for c in choices if c != v] or [v + 1]
        out[k] = rng.choice(choices)
    else:
        others = sorted({x for x in strings if x != v})
        out[k] = rng.choice(others) if others and rng.random() < 0.8 else v + v[-1:]
    return out


def _call_turn(call: dict) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]}


MEMORY_SOURCES = ("real", "self")


def warm_start_examples(eng, task, messages: list[dict], make_env, rng, budgets=(1, 2, 4), memory: str = "real",
                        sampling: SamplingConfig | None = None, steer=None) -> list:
    """One assessment example and one memory example (token ids, role ids) from a reference chat.

    A call turn of the reference is picked at random; `make_env(task)` replays the reference calls before it
    to get the real responses of the proposals. Returns [] when the chat has no single-call turn.

    `memory` says what the memory example's lines hold. "real": each proposal's real response, judged by the
    rule on it (assessment_for). "self": what the current model rehearses for the proposal, written as at test
    time (predict_responses with `sampling`, its seed drawn from rng; `steer` as in act), judged by the rule
    on that prediction: where the prediction is right about the call failing or not (fidelity's
    error_correct against the real response) that is the real-mode judgement; where it is not, it is the
    judgement the misleading prediction leads to, as a test-time assessor reading only its own prediction
    would write. The committed turn stays the reference either way, so "self" teaches to commit the right
    call past the model's own wrong notes. The assessment example is the same in both modes (its WORLD
    tokens, which are trained, are the real response)."""
    if memory not in MEMORY_SOURCES:
        raise ValueError(f"memory must be one of {', '.join(MEMORY_SOURCES)}, not {memory!r}")
    fmt = eng.fmt
    turns = [i for i, m in enumerate(messages) if i >= len(task.messages) and m["role"] == "assistant"
             and len(m.get("tool_calls") or []) == 1]
    if not turns:
        return []
    t = rng.choice(turns)
    n = len(encode_conversation(eng, task, messages[:t])[0])
    full_ids, full_roles = encode_conversation(eng, task, messages[:t + 1])
    ref = messages[t]["tool_calls"][0]["function"]
    ref = {"name": ref["name"], "arguments": dict(ref["arguments"])}
    strings = [v for m in messages for tc in (m.get("tool_calls") or [])
               for v in tc["function"]["arguments"].values() if isinstance(v, str)]

    def response(call):
        env = make_env(task)
        for m in messages[:t]:
            for tc in m.get("tool_calls") or []:
                env.step(tc["function"]["name"], tc["function"]["arguments"])
        return str(env.step(call["name"], call["arguments"]))

    def rehearsal():
        """A proposal (the reference call or a perturbation) as a memory record, predicted = real response."""
        prop = ref if rng.random() < 0.5 else {"name": ref["name"],
                                                "arguments": perturb_arguments(ref["arguments"], strings, rng)}
        obs = response(prop)
        return prop, {"content": "", "assessment": assessment_for(prop == ref, obs),
                      "items": [{"name": prop["name"], "arguments": prop["arguments"], "predicted": obs}]}

    def proposal_context(prop):
        """Ids and roles up to where the policy writes the proposal's response, laid out as `act` lays them."""
        ids, roles = encode_conversation(eng, task, messages[:t] + [_call_turn(prop)])
        p, r = fmt.encode([(fmt.after_eos + fmt.tool_open, Role.PROMPT, True)])
        return ids + p, roles + [int(x) for x in r]

    # assessment: the proposal's body as the template renders it, then the rehearsal and the judgement, each
    # stretch encoded as `act` encodes it (text between two generated segments in one piece)
    prop, first = rehearsal()
    obs = first["items"][0]["predicted"]
    ids, roles = proposal_context(prop)
    for pieces in ([(fmt.response_text(obs), Role.WORLD, False), (fmt.obs_end, Role.WORLD, True)],
                   [(fmt.tool_close, Role.PROMPT, True), (ASSESS_PREFIX, Role.PROMPT, False)],
                   [(first["assessment"], Role.ACT, False)]):
        p, r = fmt.encode(pieces)
        ids += p
        roles += [int(x) for x in r]
    examples = [(ids + [fmt.eos_id], roles + [int(Role.ACT)])]
    # memory: that rehearsal and up to 3 more in front of the reference turn
    more = [rehearsal() for _ in range(rng.choice(list(budgets)) - 1)]
    props, records = [prop] + [p for p, _ in more], [first] + [rec for _, rec in more]
    if memory == "self":
        cfg = replace(sampling or SamplingConfig(), seed=rng.randrange(2 ** 31))
        predicted = predict_responses(eng, task, [proposal_context(p)[0] for p in props], cfg, steer)
        records = [{**rec, "assessment": assessment_for(p == ref, pred),
                    "items": [{**rec["items"][0], "predicted": pred}]}
                   for p, rec, pred in zip(props, records, predicted)]
    mem = fmt.encode_text(memory_text(records))
    mem_roles = [int(Role.PROMPT)] * len(mem)
    examples.append((full_ids[:n] + mem + full_ids[n:], full_roles[:n] + mem_roles + full_roles[n:]))
    return examples


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


# -- fidelity of the world model -----------------------------------------------------------------------------

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


def assessment_verdict(text: str) -> str | None:
    """The verdict of a self-assessment, read in the warm start's vocabulary (ASSESS_OK, ASSESS_ERROR,
    ASSESS_WRONG): "ok" (commit it), "fails" (revise: it errors), "wrong" (revise: the arguments look wrong);
    None when the text starts with neither "ok" nor "revise"."""
    t = " ".join(str(text).split()).lower()
    if re.match(r"ok\b", t):
        return "ok"
    if t.startswith("revise"):
        return "fails" if "fail" in t or "error" in t else "wrong"
    return None


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


def _replayed_env(make_env, task, traj, turn: int):
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
            return _replayed_env(make_env, task, traj, t) if t < first_unreplayable else None

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


# -- one committed episode per task, its private rehearsals as child rows of the one decode loop -------------

@dataclass
class Episode:
    """One committed episode: its single-row rollout, the private rehearsal records per committed turn, the
    fidelity probes per real call, its stats and every private row's final token ids."""
    rollout: object                  # rollout.Rollout with the single committed row
    rehearsals: list = field(default_factory=list)   # per committed turn: list of private records
    fidelity: list = field(default_factory=list)     # per real call: {"call", "predicted", "real", **fidelity()}
    stats: dict = field(default_factory=dict)
    private_contexts: list = field(default_factory=list)  # every private row's token ids as it ended, in order

    @property
    def trajectory(self):
        """The committed row's trajectory."""
        return self.rollout.trajectories[0]


class Rehearser:
    """The hooks of one committed row (rollout.RowHooks, set as Row.hooks): private rehearsals before each committed turn and
    a discarded world-model probe before each real call. Each is a Spawn of child rows in the engine's decode
    loop: branches fork the committed context's cache, run their own plans, and leave the batch when done."""

    def __init__(self, eng, task, cfg: SamplingConfig, rcfg: RehearsalConfig, episode: Episode, oracle_env=None):
        self.eng, self.task, self.cfg, self.rcfg, self.episode = eng, task, cfg, rcfg, episode
        self.oracle_env = oracle_env    # make_env(task) of a fresh real environment (rcfg.world == "oracle")
        # committed turns sample as Engine.run's row 0 does; probes from a stream of their own
        self.fidelity_rng = torch.Generator(device="cpu").manual_seed(cfg.seed + 104729)
        self.predicted: dict[int, str] = {}

    # -- private rehearsal before a committed turn ------------------------------------------------------------

    def before_turn(self, row: Row, item: Generate) -> Spawn | None:
        """RowHooks.before_turn: at budget B > 0, B private branches (parallel) or one at a time (sequential),
        each proposing a call, rehearsing its response and assessing it; then the committed turn."""
        self.episode.stats["committed_turns"] += 1
        if self.rcfg.budget == 0:
            return None
        records: list[dict] = []
        self.episode.rehearsals.append(records)
        turn = len(self.episode.rehearsals)
        if self.rcfg.mode == "parallel":
            return Spawn(lambda r: [self.private_branch(r, turn, k, 1 + k, "") for k in range(self.rcfg.budget)],
                         lambda r: self._after_parallel(r, records))
        return self._sequential(records, turn)

    def _sequential(self, records, turn) -> Spawn:
        memory = memory_text(records, self.rcfg.memory_chars)
        return Spawn(lambda r: [self.private_branch(r, turn, len(records), 1, memory)],
                     lambda r: self._after_sequential(r, records, turn))

    def _children(self, row: Row) -> list[Row]:
        children = row.record.pop("children")
        self.episode.private_contexts += [list(c.ids) for c in children]
        return children

    def _after_parallel(self, row: Row, records: list[dict]):
        records += [c.record for c in self._children(row)]
        self._count(records)
        if not any(r["items"] for r in records):     # no proposal calls a tool: commit the first answer as is
            return self._commit(row, records[0]["tokens"], records[0]["logprobs"])
        if self.rcfg.commit == "checked":            # the first proposal, in order, that is an answer (nothing
            first = next((r for r in records if not r["items"] or self._judged_ok(r)), None)   # to rehearse)
            if first is not None and not first["items"]:          # or was judged ok, token for token
                return self._commit(row, first["tokens"], first["logprobs"])
            if first is not None:
                return self._commit_checked(row, first)
        row.spawn = self._commit_from_memory(memory_text(records, self.rcfg.memory_chars))

    def _after_sequential(self, row: Row, records: list[dict], turn: int):
        records += [c.record for c in self._children(row)]
        if not records[-1]["items"]:                 # an answer, sampled from the context + the memory so far
            self._count(records)
            return self._commit(row, records[-1]["tokens"], records[-1]["logprobs"])
        if self._judged_ok(records[-1]):             # stop at the first proposal judged ok and commit it
            self._count(records)
            return self._commit_checked(row, records[-1])
        if len(records) < self.rcfg.budget:
            row.spawn = self._sequential(records, turn)
            return
        self._count(records)
        row.spawn = self._commit_from_memory(memory_text(records, self.rcfg.memory_chars))

    def _judged_ok(self, record: dict) -> bool:
        """A proposal that called a tool, ended on its own and is judged ok (commit "checked"): judge "prediction",
        none of its calls is malformed and no rehearsed response is an error; "assessment", its assessment says ok."""
        if not (self.rcfg.commit == "checked" and bool(record["items"]) and record["terminated"]):
            return False
        if self.rcfg.judge == "prediction":
            return not any("error" in item or is_error_text(item["predicted"]) for item in record["items"])
        return assessment_verdict(record["assessment"]) == "ok"

    def _commit_checked(self, row: Row, record: dict):
        self.episode.stats["committed_checked"] += 1
        self._commit(row, record["tokens"], record["logprobs"])

    def _count(self, records):
        stats, n_reh = self.episode.stats, sum(1 for r in records if r["items"])
        stats["rehearsals"] += n_reh
        stats["rehearsed_turns"] += bool(n_reh)

    def private_branch(self, parent: Row, turn: int, k: int, stream: int, memory: str) -> Row:
        """A branch that proposes a turn, rehearses each call's response and assesses the outcome."""
        eng, fmt, cfg = self.eng, self.eng.fmt, self.cfg
        line = parent.fork(stream, derive_seed(cfg.seed, "private", turn, k), "private")
        first = k == 0 and not memory
        if first:      # the first proposal is the turn B=0 samples: the committed stream, so committing it
            line.rng = parent.rng          # leaves the episode token for token as without rehearsal
        parent.record.setdefault("children", []).append(line)
        line.record = {"content": "", "raw": "", "items": [], "assessment": "", "terminated": False, "tokens": [],
                       "seen_memory": memory}

        def on_world(index):
            def end(ln, stopped):
                text, on_tag = eng.rehearsal_text(ln.ids[ln.gen_start:], stopped)
                ln.record["items"][index].update(predicted=text, defects=validate_rehearsal(text, on_tag))
                if not on_tag:
                    ln.plan.appendleft(Text(fmt.obs_end, Role.PROMPT))
            return end

        def on_assess(ln, stopped):
            gen_ids = ln.ids[ln.gen_start:]
            ln.record["assessment"] = self._decode(gen_ids[:-1] if stopped else gen_ids).strip()

        def on_proposal(ln, stopped):
            if first:                      # its rehearsal and assessment draw from a stream of their own
                ln.rng = torch.Generator(device="cpu").manual_seed(derive_seed(cfg.seed, "private", turn, k))
            gen_ids = ln.ids[ln.gen_start:]
            ln.record["tokens"], ln.record["logprobs"] = list(gen_ids), list(ln.logprobs[ln.gen_start:])
            ln.record["terminated"] = stopped
            text = self._decode(gen_ids[:-1] if stopped else gen_ids)
            parsed = fmt.parse(text, current_tools(parent))     # the tools revealed so far (BFCL miss_func)
            ln.record["raw"], ln.record["content"] = text, parsed.content
            if not stopped or not parsed.items:
                return                                   # an answer (or a cut-off turn): nothing to rehearse
            oracle = self._oracle(parent) if self.rcfg.world == "oracle" else None
            for kind, value in fmt.tool_turn(len(parsed.items)):
                item = parsed.items[value] if kind == "response" else None
                if kind == "text":
                    ln.plan.append(Text(value, Role.PROMPT))
                elif isinstance(item, CallError):
                    obs = item.observation()
                    ln.record["items"].append({"error": f"{item.kind}: {item.message}", "predicted": obs})
                    ln.plan += [Text(fmt.response_text(obs), Role.OBS, False), Text(fmt.obs_end, Role.PROMPT)]
                elif oracle is not None:                 # the real response on the rebuilt copy, in order
                    obs = replay_call(oracle, item.name, item.arguments)
                    ln.record["items"].append({"name": item.name, "arguments": item.arguments, "predicted": obs,
                                               "oracle": True})
                    ln.plan += [Text(fmt.response_text(obs), Role.OBS, False), Text(fmt.obs_end, Role.PROMPT)]
                else:
                    ln.record["items"].append({"name": item.name, "arguments": item.arguments, "predicted": ""})
                    ln.plan.append(Generate(Role.WORLD, cfg.max_world_tokens,
                                            on_end=on_world(len(ln.record["items"]) - 1)))
            ln.plan.append(Text(ASSESS_PREFIX, Role.PROMPT, False))
            ln.plan.append(Generate(Role.ACT, self.rcfg.max_assess_tokens, on_end=on_assess))

        if memory:
            line.plan.append(Text(memory, Role.PROMPT, False))
        line.plan.append(Generate(Role.ACT, cfg.max_new_tokens, on_end=on_proposal))
        return line

    def _oracle(self, row: Row):
        """A real environment in the committed row's current state (the executed calls replayed on a fresh
        one), or None where it cannot be rebuilt: the world model writes that proposal's responses then, and
        stats["oracle_unavailable"] counts it."""
        env = _replayed_env(self.oracle_env, self.task, row.traj, turn=10**9) if self.oracle_env else None
        if env is None:
            self.episode.stats["oracle_unavailable"] = self.episode.stats.get("oracle_unavailable", 0) + 1
        return env

    def _commit_from_memory(self, memory: str) -> Spawn:
        """The committed turn, generated after the memory on a branch; the committed row gets its tokens only
        (the memory never enters the committed sequence)."""
        def make(parent):
            line = parent.fork(0, 0, "act")
            line.rng = parent.rng                       # the committed stream, as without rehearsal
            line.extra_len = len(self.eng.fmt.encode_text(memory))
            parent.record.setdefault("children", []).append(line)
            line.plan += [Text(memory, Role.PROMPT, False), Generate(Role.ACT, self.cfg.max_new_tokens,
                                                                     on_end=lambda ln, stopped: None)]
            return [line]

        def then(parent):
            line = self._children(parent)[0]
            self.episode.stats["memory_tokens"] += line.gen_start - len(parent.ids)
            self._commit(parent, line.ids[line.gen_start:], line.logprobs[line.gen_start:])
        return Spawn(make, then)

    def _commit(self, row: Row, tokens: list[int], logprobs: list[float]):
        """Append a committed turn sampled elsewhere (its tokens are fed to the committed row next step) and
        apply the turn transition exactly as if the row had sampled it."""
        self.episode.stats["refed_tokens"] += max(len(tokens) - 1, 0)
        row.gen, row.gen_start = Generate(Role.ACT, self.cfg.max_new_tokens), len(row.ids)
        row.append(tokens, Role.ACT, logprobs)
        stopped = tokens[-1] in self.eng.fmt.stop_ids
        if stopped or len(tokens) >= self.cfg.max_new_tokens:
            self.eng.end_act(row, stopped, self.cfg, None)
        else:
            row.gen = None

    # -- the world-model probe before a real call --------------------------------------------------------------

    def before_response(self, row: Row, item: Response) -> Spawn | None:
        """RowHooks.before_response: with fidelity on, a discarded probe writes the world model's prediction of
        the call's response before the real one is applied."""
        if not self.rcfg.fidelity:
            return None

        def end(probe, stopped):    # the engine says whether the segment stopped; nothing re-derives it
            self.predicted[item.call] = self.eng.rehearsal_text(probe.ids[probe.gen_start:], stopped)[0]

        def make(parent):
            probe = parent.fork(-1, 0, "fidelity")
            probe.rng = self.fidelity_rng
            parent.record.setdefault("children", []).append(probe)
            probe.plan += [copy.copy(t) for t in parent.pending]
            probe.plan.append(Generate(Role.WORLD, self.cfg.max_world_tokens, on_end=end))
            return [probe]

        return Spawn(make, lambda parent: self._children(parent))

    def after_response(self, row: Row, index: int, text: str):
        """RowHooks.after_response: the probe's prediction against the real response (episode.fidelity)."""
        if index in self.predicted:
            call = row.traj.calls[index]
            predicted = self.predicted.pop(index)
            self.episode.fidelity.append({"call": {"name": call.name, "arguments": call.arguments},
                                          "predicted": predicted, "real": text, **fidelity(predicted, text)})

    def _decode(self, ids):
        return self.eng.tok.decode(ids, skip_special_tokens=False)


@dataclass
class EpisodeSpec:
    """One committed trajectory to run: its task, sampling config (seed included) and real environment
    (`env`, or `make_env(task)` called when the episode starts)."""
    task: object
    cfg: SamplingConfig
    env: object = None
    make_env: object = None


@torch.inference_mode()
def act_many(eng, specs, rcfg: RehearsalConfig | None = None, steer=None, max_rows: int = 64, on_done=None,
             progress=None, world_model=None, memory_budget: int | None = None, oracle_env=None) -> list[Episode]:
    """Committed trajectories for many tasks in one engine batch: each task's committed row and its private
    branches are rows of the same decode loop; tasks join as rows leave, holding at most ~max_rows
    KV-cache rows (a task holds up to max(1, budget) at once in parallel mode, 1 in sequential mode: the
    committed row lends its own to a branch while it waits). Results equal running each spec alone (greedy:
    the same tokens; sampled: each row samples from generators seeded by its own spec). on_done(i, episode)
    as each one ends.
    world_model: another model writes every WORLD segment (private rehearsals, fidelity probes), as a
    per-role run's trained world model (Engine.run's argument of the same name).
    oracle_env: make_env(task) of the benchmark (no simulated user), for rcfg.world == "oracle".
    memory_budget: bytes for KV-cache rows (None: kvbatch.memory_budget_bytes, half the free memory); max_rows
    is lowered to the rows that fit (kvbatch.memory_rows), so a large batch waits instead of running out."""
    rcfg = rcfg or RehearsalConfig()
    if rcfg.world == "oracle" and oracle_env is None:
        raise ValueError("rehearsal world 'oracle' needs oracle_env (the benchmark's make_env)")
    specs = list(specs)
    if specs:
        max_rows = min(max_rows, eng.rows_that_fit(specs[0].cfg, memory_budget))
    if len({json.dumps({**s.cfg.__dict__, "seed": 0}, sort_keys=True) for s in specs}) > 1:
        raise ValueError("act_many runs specs whose sampling configs differ only in their seeds")
    episodes: list[Episode | None] = [None] * len(specs)
    queue = deque(range(len(specs)))
    live: dict[int, tuple] = {}
    per_task = max(1, rcfg.budget) if rcfg.mode == "parallel" else 1

    def start(i):
        spec = specs[i]
        stats = {"seconds": 0.0, "act_seconds": 0.0, "private_seconds": 0.0, "fidelity_seconds": 0.0,
                 "committed_turns": 0, "rehearsed_turns": 0, "rehearsals": 0, "memory_tokens": 0, "refed_tokens": 0,
                 "committed_checked": 0}
        ep = Episode(rollout=None, stats=stats)
        env = spec.make_env(spec.task) if spec.make_env is not None else spec.env
        row = Row(spec.task, eng.prompt_ids(spec.task), env, task_idx=i, stream=0, seed=spec.cfg.seed,
                  counts=stats)
        row.hooks = Rehearser(eng, spec.task, spec.cfg, rcfg, ep, oracle_env)
        row.plan.append(Generate(Role.ACT, spec.cfg.max_new_tokens))
        eng.advance(row)
        live[i] = (row, ep, time.perf_counter())
        return row

    def admit(n_rows):
        joining = []
        while queue and (n_rows + len(joining) * per_task + per_task <= max(max_rows, per_task) or not n_rows
                         and not joining):
            joining.append(start(queue.popleft()))
        return joining

    def finished():
        for i, (row, ep, t0) in list(live.items()):
            if row.done:
                del live[i]
                episodes[i] = _close(eng, row, ep, time.perf_counter() - t0)
                if on_done is not None:
                    on_done(i, episodes[i])

    cfg = specs[0].cfg if specs else SamplingConfig()
    batch = KVBatch(eng.model, eng.tok.pad_token_id, world_model=world_model)
    eng.decode(batch, cfg, None, steer, admit=lambda n: (finished(), admit(n))[1], progress=progress)
    finished()
    return episodes


def _close(eng, row: Row, ep: Episode, seconds: float) -> Episode:
    stats = ep.stats
    for key in ("act_sampled", "act_fed", "private_sampled", "private_fed", "fidelity_sampled", "fidelity_fed"):
        stats.setdefault(key, 0)
    # seconds: this episode's share of the batch's step times (the steps split by tokens fed or sampled), so
    # the episodes of one batch add up to its wall time; wall_seconds: from its start to its end (overlapping)
    stats["wall_seconds"] = seconds
    stats["seconds"] = stats["act_seconds"] + stats["private_seconds"] + stats["fidelity_seconds"]
    stats["committed_calls"] = len(row.traj.calls)
    # extra work over plain acting on the same committed sequence, which samples each ACT token once and
    # feeds each committed token once (fidelity probes are reported apart): the private branches' tokens, the
    # memory fed before a regenerated turn and the committed tokens fed again after it. A prompt head shared
    # by several tasks is prefilled once and charged once, to the first task's act bucket: never extra.
    stats["extra_sampled"] = max(0, stats["act_sampled"] + stats["private_sampled"] - row.roles.count(int(Role.ACT)))
    stats["extra_fed"] = stats["private_fed"] + stats["memory_tokens"] + stats["refed_tokens"]
    stats["extra_tokens"] = stats["extra_sampled"] + stats["extra_fed"]
    ep.rollout = eng.collect([row], {k: v for k, v in stats.items()})
    return ep


def act(eng, task, cfg=None, env=None, rcfg: RehearsalConfig | None = None, steer=None) -> Episode:
    """One committed trajectory on the real environment `env`, with private rehearsal before each turn."""
    return act_many(eng, [EpisodeSpec(task, cfg or SamplingConfig(), env)], rcfg, steer)[0]

"""Rehearsal diagnostics (diagnostics.rehearsal_diagnostics): the self-assessment's verdict against the proposal's
real outcome, committed turns that differ from the first proposal, and whether that helped or hurt; measured on
hand-made episodes and on scripted test-time rehearsals of the toy world."""
import json
import types

import pytest

import diagnostics
import evaluate
from evaluate import reference_calls
import rehearse
from bench import ToolCall, Trajectory, toyworld
from chat_format import ASSESS_ERROR, ASSESS_OK, ASSESS_WRONG, assessment_verdict, parse_turn
from diagnostics import diagnostic_counts, rehearsal_diagnostics
from rehearse import RehearsalConfig, act
from rollout import Engine, SamplingConfig
from tests.scripted import Script, call_text

HERMES = types.SimpleNamespace(parse=parse_turn)   # what rehearsal_diagnostics needs of a ChatFormat


def half_task():
    """fay 2, dee 6; gold: get_balance(fay), transfer(fay, dee, 1)."""
    task = toyworld.load_tasks("train", limit=1, seed=0, families="half")[0]
    assert reference_calls(toyworld, task) == [{"name": "get_balance", "arguments": {"account": "fay"}},
                                         {"name": "transfer", "arguments": {"src": "fay", "dst": "dee", "amount": 1}}]
    return task


def raw_call(name, arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def proposal(name=None, arguments=None, assessment="", error=None):
    """A private record as rehearse.Rehearser writes it (a call, a refused call, or an answer)."""
    if error is not None:
        items = [{"error": error, "predicted": json.dumps({"error": error})}]
    elif name is not None:
        items = [{"name": name, "arguments": arguments, "predicted": "{}"}]
    else:
        items = []
    return {"content": "" if items else "dee has 7", "raw": "", "items": items, "assessment": assessment,
            "terminated": True, "seen_memory": ""}


def episode(task, committed):
    """A committed trajectory: committed = per turn (name, arguments), or a str for a final answer. The
    observations are what the real environment answered."""
    env = toyworld.make_env(task)
    traj = Trajectory(task_id=task.id, messages=[dict(m) for m in task.messages], end_reason="final_answer")
    for turn, c in enumerate(committed):
        if isinstance(c, str):
            traj.messages.append({"role": "assistant", "content": c, "raw": c, "tool_calls": []})
            traj.final_answer = c
            continue
        name, arguments = c
        traj.messages.append({"role": "assistant", "content": "", "raw": raw_call(name, arguments),
                              "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]})
        traj.calls.append(ToolCall(name, arguments, turn=turn))
        obs = env.step(name, arguments)
        traj.observations.append(obs)
        traj.rehearsed.append(False)
        traj.messages.append({"role": "tool", "name": name, "content": obs})
    return traj


BAL_FAY = ("get_balance", {"account": "fay"})
BAL_DEE = ("get_balance", {"account": "dee"})
HALF = ("transfer", {"src": "fay", "dst": "dee", "amount": 1})
TOO_MUCH_AFTER = ("transfer", {"src": "fay", "dst": "dee", "amount": 2})   # fine at the start, not once fay has 1


def hand_made():
    task = half_task()
    traj = episode(task, [BAL_FAY, BAL_DEE, HALF, "dee has 7"])
    rehearsals = [
        # turn 0: an erroring transfer judged failing (agree), the gold read judged ok (agree); the committed read
        # differs from the first proposal and is right: helped
        [proposal("transfer", {"src": "fay", "dst": "dee", "amount": 5}, ASSESS_ERROR), proposal(*BAL_FAY, ASSESS_OK)],
        # turn 1: the gold transfer judged wrong (disagree), a repeated read judged ok (disagree: not needed any
        # more), a refused call with a verdict in no known form (unparsed); the committed read of dee is not
        # needed: the change from the right first proposal hurt
        [proposal(*HALF, ASSESS_WRONG), proposal(*BAL_FAY, ASSESS_OK),
         proposal(error="malformed_json: Expecting value", assessment="hmm")],
        # turn 2: the gold transfer judged ok (agree), committed as proposed: unchanged
        [proposal(*HALF, "ok")],
        # turn 3: a transfer that the replayed state refuses (fay has 1 now) judged ok (disagree); the committed
        # answer (no gold call left: right) differs: helped
        [proposal(*TOO_MUCH_AFTER, ASSESS_OK)],
    ]
    return task, traj, rehearsals


def test_verdicts_are_read_in_the_warm_start_vocabulary():
    assert assessment_verdict(ASSESS_OK) == "ok" and assessment_verdict("OK, commit") == "ok"
    assert assessment_verdict(ASSESS_ERROR) == "fails" and assessment_verdict("revise: errors out") == "fails"
    assert assessment_verdict(ASSESS_WRONG) == "wrong" and assessment_verdict("  revise it") == "wrong"
    for text in ("", "okay then", "looks fine", "maybe revise"):
        assert assessment_verdict(text) is None


def test_agreement_and_effect_rules():
    agrees = diagnostics.assessment_agrees
    assert agrees("ok", "right") and agrees("fails", "error") and agrees("wrong", "error") and agrees("wrong", "wrong")
    assert agrees("ok", "ok") and agrees("fails", "wrong") and agrees("ok", "error") is False  # revise either way
    assert agrees("fails", "ok") is False and agrees("ok", "wrong") is False
    assert agrees("wrong", "ok") is None and agrees(None, "error") is None and agrees("ok", "unmeasured") is None
    effect = diagnostics.change_effect
    assert effect("error", "right") == effect("error", "ok") == effect("wrong", "right") == "helped"
    assert effect("right", "error") == effect("right", "wrong") == "hurt"
    assert effect("error", "error") == effect("wrong", "wrong") == "neutral"
    assert effect("unmeasured", "right") == effect("error", "unmeasured") == "unmeasured"


def test_hand_made_episode_counts_agree_changed_helped_hurt():
    task, traj, rehearsals = hand_made()
    turns = rehearsal_diagnostics(task, traj, rehearsals, toyworld.make_env, HERMES, reference_calls(toyworld, task))
    assert [[p["outcome"] for p in t["proposals"]] for t in turns] == [
        ["error", "right"], ["right", "wrong", "error"], ["right"], ["error"]]
    assert [[p["agree"] for p in t["proposals"]] for t in turns] == [
        [True, True], [False, False, None], [True], [False]]
    assert [t["committed"]["outcome"] for t in turns] == ["right", "wrong", "right", "right"]
    assert [t["changed"] for t in turns] == [True, True, False, True]
    assert [t["effect"] for t in turns] == ["helped", "hurt", None, "helped"]
    # each proposal ran on the state of its own turn: at turn 3 fay has 1 left
    assert turns[3]["proposals"][0]["real"] == ['{"error": "insufficient funds"}']
    assert turns[0]["proposals"][1]["real"] == ['{"balance": 2}']
    assert turns[2]["committed"]["real"] == ['{"fay": 1, "dee": 7}']
    c = diagnostic_counts(turns)
    assert {k: c[k] for k in diagnostics.DIAGNOSTIC_COUNTS} == {
        "turns": 4, "rehearsed_turns": 4, "assessed": 7, "verdict_unparsed": 1, "assess_unmeasured": 0,
        "assess_agree": 3, "assess_disagree": 3, "changed": 3, "unchanged": 1, "helped": 2, "hurt": 1, "neutral": 0,
        "effect_unmeasured": 0}
    assert c["verdict_vs_outcome"] == {"fails/error": 1, "ok/error": 1, "ok/right": 2, "ok/wrong": 1,
                                       "unparsed/error": 1, "wrong/right": 1}
    s = diagnostics.diagnostic_summary([c, c])
    assert s["assessed"] == 14 and s["assess_agree_rate"] == 0.5 and s["changed_rate"] == 0.75
    assert s["helped_rate"] == pytest.approx(2 / 3) and s["hurt_rate"] == pytest.approx(1 / 3)
    assert s["verdict_vs_outcome"]["ok/right"] == 4


def test_without_gold_only_errors_are_judged_and_an_unrebuildable_state_is_unmeasured():
    task, traj, rehearsals = hand_made()
    turns = rehearsal_diagnostics(task, traj, rehearsals, toyworld.make_env, HERMES, gold=None)
    assert [[p["outcome"] for p in t["proposals"]] for t in turns] == [
        ["error", "ok"], ["ok", "ok", "error"], ["ok"], ["error"]]
    # "revise: wrong arguments" cannot be checked without knowing which call is needed
    assert [p["agree"] for p in turns[1]["proposals"]] == [None, True, None]
    assert turns[3]["effect"] == "unmeasured"          # an answer is not judged without gold calls
    # the episode saw another response than a replay gives: the state after that call cannot be rebuilt
    traj.observations[0] = '{"balance": 99}'
    turns = rehearsal_diagnostics(task, traj, rehearsals, toyworld.make_env, HERMES, reference_calls(toyworld, task))
    assert [p["outcome"] for p in turns[0]["proposals"]] == ["error", "right"]          # turn 0: a fresh env
    assert [p["outcome"] for p in turns[1]["proposals"]] == ["unmeasured", "unmeasured", "error"]
    assert [t["effect"] for t in turns] == ["helped", "unmeasured", None, "unmeasured"]
    c = diagnostic_counts(turns)
    assert c["assess_unmeasured"] == 4 and c["effect_unmeasured"] == 2 and c["assess_agree"] == 2
    # a simulated user acting on the environment (tau2 telecom) also makes the later turns unmeasured
    task, traj, rehearsals = hand_made()
    traj.messages.insert(len(task.messages) + 2, {"role": "user", "content": "done on my phone",
                                                  "user_tool_calls": [{"name": "toggle", "arguments": {}}]})
    turns = rehearsal_diagnostics(task, traj, rehearsals, toyworld.make_env, HERMES, reference_calls(toyworld, task))
    assert turns[0]["proposals"][1]["outcome"] == "right" and turns[1]["proposals"][0]["outcome"] == "unmeasured"


def test_diagnostics_leave_the_episode_environment_alone():
    task, traj, rehearsals = hand_made()
    made = []

    def make_env(t):
        made.append(toyworld.make_env(t))
        return made[-1]
    episode_env = toyworld.make_env(task)
    before = episode_env.state()
    rehearsal_diagnostics(task, traj, rehearsals, make_env, HERMES, reference_calls(toyworld, task))
    assert episode_env.state() == before and len(made) >= 9     # a fresh environment for every executed turn


def test_cut_off_turns_are_errors():
    task, traj, rehearsals = hand_made()
    rehearsals[0][0]["terminated"] = False
    rehearsals[0][0]["items"] = []
    traj.end_reason = "max_new_tokens"
    turns = rehearsal_diagnostics(task, traj, rehearsals, toyworld.make_env, HERMES, reference_calls(toyworld, task))
    assert turns[0]["proposals"][0]["outcome"] == "error" and turns[0]["proposals"][0]["agree"] is None
    assert turns[3]["committed"]["outcome"] == "error"       # the last committed turn was cut off
    assert turns[3]["effect"] == "neutral"


# -- scripted test-time rehearsal on the toy world ---------------------------------------------------------------

@pytest.fixture(scope="module")
def eng(micro64):
    model, tok = micro64
    return Engine(model, tok)


def balance_task():
    task = toyworld.load_tasks("train", limit=1, seed=0, families="balance")[0]
    assert reference_calls(toyworld, task) == [{"name": "get_balance", "arguments": {"account": "hal"}}]
    return task


BAD = [call_text("get_balance", '{"account": "zed"}}\n</tool_call>')]   # unknown account: a real error
GOOD = [call_text("get_balance", '{"account": "hal"}}\n</tool_call>')]
PREDICTED = ['{"balance": 3}\n</tool_response>']
ANSWER = ["hal has 14"]


def run_scripted(eng, tok, mode, private, committed, n_world, commit="memory", judge="assessment"):
    task = balance_task()
    script = Script(tok, {0: committed, 1: private}, {1: [PREDICTED] * n_world})
    env = toyworld.make_env(task)
    ep = act(eng, task, SamplingConfig(greedy=True, max_new_tokens=80, seed=0), env,
             RehearsalConfig(budget=len(private) // 2 if mode == "sequential" else 1, mode=mode, commit=commit,
                             judge=judge), steer=script)
    turns = rehearsal_diagnostics(task, ep.trajectory, ep.rehearsals, toyworld.make_env, eng.fmt,
                                  reference_calls(toyworld, task))
    return ep, env, turns


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_scripted_erroring_proposal_judged_fine_then_a_good_commit(eng, micro64, mode):
    """The brief's case: the proposal errors, the assessment says it is fine, the committed call differs and
    succeeds -> disagree, changed, helped."""
    _, tok = micro64
    ep, env, turns = run_scripted(eng, tok, mode, [BAD, [ASSESS_OK], ANSWER], [GOOD, ANSWER], 1)
    assert [c.name for c in ep.trajectory.calls] == ["get_balance"]
    assert ep.trajectory.observations == ['{"balance": 14}'] and env.state()["balances"]["hal"] == 14
    assert turns[0]["proposals"][0]["calls"] == [{"name": "get_balance", "arguments": {"account": "zed"}}]
    assert turns[0]["proposals"][0]["verdict"] == "ok" and turns[0]["proposals"][0]["outcome"] == "error"
    assert turns[0]["proposals"][0]["real"] == ['{"error": "unknown account: zed"}']
    assert turns[0]["committed"]["outcome"] == "right"
    c = diagnostic_counts(turns)
    assert (c["assess_disagree"], c["assess_agree"], c["changed"], c["helped"], c["hurt"]) == (1, 0, 1, 1, 0)
    assert c["rehearsed_turns"] == 1 and c["turns"] == 2     # turn 1: the proposal answered, committed as is


def test_scripted_good_proposal_judged_failing_then_a_bad_commit_hurts(eng, micro64):
    _, tok = micro64
    ep, _, turns = run_scripted(eng, tok, "parallel", [GOOD, [ASSESS_ERROR], ANSWER], [BAD, ANSWER], 1)
    assert ep.trajectory.observations == ['{"error": "unknown account: zed"}']
    c = diagnostic_counts(turns)
    assert (c["assess_disagree"], c["changed"], c["hurt"], c["helped"]) == (1, 1, 1, 0)


def test_scripted_sequential_second_proposal_agrees_and_the_commit_equals_it(eng, micro64):
    _, tok = micro64
    private = [BAD, [ASSESS_ERROR], GOOD, [ASSESS_OK], ANSWER]
    ep, _, turns = run_scripted(eng, tok, "sequential", private, [GOOD, ANSWER], 2)
    assert [p["outcome"] for p in turns[0]["proposals"]] == ["error", "right"]
    c = diagnostic_counts(turns)
    assert (c["assessed"], c["assess_agree"], c["assess_disagree"]) == (2, 2, 0)
    assert (c["changed"], c["helped"]) == (1, 1)      # against the FIRST proposal, which erred
    # a commit equal to the first proposal is unchanged
    ep, _, turns = run_scripted(eng, tok, "parallel", [GOOD, [ASSESS_OK], ANSWER], [GOOD, ANSWER], 1)
    c = diagnostic_counts(turns)
    assert (c["assess_agree"], c["changed"], c["unchanged"], c["helped"]) == (1, 0, 1, 0)


def test_summary_and_table_show_the_diagnostics():
    task, traj, rehearsals = hand_made()
    counts = diagnostic_counts(rehearsal_diagnostics(task, traj, rehearsals, toyworld.make_env, HERMES,
                                                     reference_calls(toyworld, task)))
    rec = {"task_id": task.id, "reward": 1.0, "group": None, "components": {}, "fidelity": [],
           "stats": {"committed_turns": 4, "committed_calls": 3}, "rehearsal_diagnostics": {"counts": counts}}
    with_diag = evaluate.summarize("toyworld", [rec, rec], 1)
    plain = evaluate.summarize("toyworld", [{k: v for k, v in rec.items() if k != "rehearsal_diagnostics"}], 1)
    d = with_diag["rehearsal_diagnostics"]
    assert (d["assess_agree"], d["assess_disagree"], d["changed"], d["helped"], d["hurt"]) == (6, 6, 6, 4, 2)
    assert d["assess_agree_rate"] == 0.5 and "rehearsal_diagnostics" not in plain
    text = evaluate.table("toyworld", {"B=0": plain, "B=2": with_diag})
    row = next(line for line in text.splitlines() if line.startswith("rehearsal assess_agree_rate"))
    assert row.split()[-2:] == ["-", "0.500"]
    assert any(line.startswith("rehearsal helped ") and line.split()[-1] == "4" for line in text.splitlines())


def test_evaluate_writes_the_scripted_episodes_diagnostics(eng, micro64, tmp_path, monkeypatch):
    """evaluate.run_budget at B=1 on the scripted episode: the JSONL record holds the per-turn log and the
    counts (disagree / changed / helped), and the run summary adds them up."""
    _, tok = micro64
    task = balance_task()
    script = Script(tok, {0: [GOOD, ANSWER], 1: [BAD, [ASSESS_OK], ANSWER]}, {1: [PREDICTED]})
    act_many = rehearse.act_many
    monkeypatch.setattr(rehearse, "act_many", lambda *a, **kw: act_many(*a, steer=script, **kw))
    args = types.SimpleNamespace(rehearsal_mode="parallel", rehearsal_commit="memory", temperature=0.6, top_p=0.95, greedy=True, seed=0,
                                 num_trials=1, max_new_tokens=80, max_world_tokens=32, max_turns=8,
                                 max_total_len=2048, max_rows=None)
    path = tmp_path / "traj.jsonl"
    records = evaluate.run_budget(eng, toyworld, [task], args, 1, path, False)
    assert json.loads(path.read_text().splitlines()[0]) == records[0]
    diag = records[0]["rehearsal_diagnostics"]
    assert diag["turns"][0]["proposals"][0]["real"] == ['{"error": "unknown account: zed"}']
    assert diag["turns"][0]["committed"]["outcome"] == "right" and diag["turns"][0]["effect"] == "helped"
    c = diag["counts"]
    assert (c["assess_disagree"], c["changed"], c["helped"], c["turns"]) == (1, 1, 1, 2)
    s = evaluate.summarize("toyworld", records, 1)["rehearsal_diagnostics"]
    assert s["assess_agree_rate"] == 0.0 and s["changed_rate"] == 1.0 and s["helped_rate"] == 1.0
    assert s["verdict_vs_outcome"] == {"ok/error": 1}


# ---------------------------------------------------------------------- commit what was checked (the default)

@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_a_proposal_judged_ok_is_committed_token_for_token(eng, micro64, mode):
    """B=1 and B=2: the first proposal's assessment says ok, so its own tokens are the committed turn (the
    committed-row script, which would call with a bad account, is never asked)."""
    _, tok = micro64
    for budget in (1, 2):
        private = [GOOD, [ASSESS_OK], ANSWER] + ([BAD, [ASSESS_OK], ANSWER] if budget == 2 else [])
        task = balance_task()
        script = Script(tok, {0: [BAD, ANSWER], 1: private, 2: private[3:]}, {1: [PREDICTED] * 2, 2: [PREDICTED]})
        env = toyworld.make_env(task)
        n = budget if mode == "parallel" else 1
        ep = act(eng, task, SamplingConfig(greedy=True, max_new_tokens=80, seed=0), env,
                 RehearsalConfig(budget=budget, mode=mode), steer=script)
        first = ep.rehearsals[0][0]
        committed_turn = ep.rollout.ids[0, :].tolist()
        start = next(i for i in range(len(committed_turn)) if committed_turn[i:i + len(first["tokens"])] ==
                     first["tokens"])
        assert committed_turn[start:start + len(first["tokens"])] == first["tokens"]
        assert [c.arguments for c in ep.trajectory.calls] == [{"account": "hal"}]
        assert ep.trajectory.observations == ['{"balance": 14}']
        assert ep.stats["committed_checked"] == 1 and ep.stats["memory_tokens"] == 0, (budget, n)


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_every_proposal_judged_failing_triggers_the_memory_conditioned_turn(eng, micro64, mode):
    _, tok = micro64
    ep, _, _ = run_scripted(eng, tok, mode, [BAD, [ASSESS_ERROR], ANSWER], [GOOD, ANSWER], 1, commit="checked")
    assert ep.stats["committed_checked"] == 0 and ep.stats["memory_tokens"] > 0
    assert ep.trajectory.observations == ['{"balance": 14}']          # the regenerated (committed-row) call


def test_the_memory_flag_restores_the_regenerated_commit_even_when_judged_ok(eng, micro64):
    _, tok = micro64
    ep, _, _ = run_scripted(eng, tok, "parallel", [BAD, [ASSESS_OK], ANSWER], [GOOD, ANSWER], 1, commit="memory")
    assert ep.stats["committed_checked"] == 0 and ep.trajectory.observations == ['{"balance": 14}']
    ep, _, _ = run_scripted(eng, tok, "parallel", [BAD, [ASSESS_OK], ANSWER], [GOOD, ANSWER], 1, commit="checked")
    assert ep.stats["committed_checked"] == 1 and ep.trajectory.observations == ['{"error": "unknown account: zed"}']
    with pytest.raises(ValueError, match="rehearsal commit"):
        RehearsalConfig(commit="sometimes")

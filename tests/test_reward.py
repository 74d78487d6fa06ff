"""reward.py: the checklist reward and the verifier-side world-model fidelity per tool."""
import json

import pytest

import reward
from bench import ToolCall, Trajectory
from bench import toyworld as tw


def afford_task():
    return next(t for t in tw.load_tasks("train", limit=16) if t.metadata["family"] == "afford")


def test_fidelity_per_tool_replays_the_calls_in_order_on_hand_made_trajectories():
    task = afford_task()
    w = task.metadata["world"]
    a, b = list(w["balances"])[:2]
    item = next(iter(w["prices"]))
    price, stock = w["prices"][item], w["stock"][item]
    calls = [ToolCall("get_balance", {"account": a}),                    # rehearsed right
             ToolCall("transfer", {"src": a, "dst": b, "amount": 1}),     # real: not compared
             ToolCall("get_balance", {"account": a}),                    # rehearsed with the pre-transfer value
             ToolCall("get_price", {"item": item}),                      # price wrong, stock right
             ToolCall("get_balance", {"account": "zzz"}),               # an error, predicted as an error
             ToolCall("get_price", {"item": "zzz"})]                     # an error, predicted as a value
    observations = [json.dumps({"balance": w["balances"][a]}), "(whatever the env said)",
                    json.dumps({"balance": w["balances"][a]}), json.dumps({"price": price + 1, "stock": stock}),
                    json.dumps({"error": "unknown account: zzz"}), json.dumps({"price": 3, "stock": 1})]
    traj = Trajectory(task_id=task.id, messages=[], calls=calls, observations=observations,
                      rehearsed=[True, False, True, True, True, True])
    pairs = reward.rehearsal_fidelity("toyworld", task, traj)
    assert [tool for tool, _ in pairs] == ["get_balance", "get_balance", "get_price", "get_balance", "get_price"]
    assert [f["exact"] for _, f in pairs] == [True, False, False, True, False]
    by_tool = reward.fidelity_by_tool(reward.fidelity_sums(pairs))
    assert set(by_tool) == {"get_balance", "get_price"}     # the real transfer is not a rehearsal
    assert by_tool["get_balance"] == {"calls": 3, "exact": pytest.approx(2 / 3), "kv": pytest.approx(2 / 3),
                                      "error_correct": 1.0}
    assert by_tool["get_price"] == {"calls": 2, "exact": 0.0, "kv": pytest.approx(0.25), "error_correct": 0.5}
    # sums add up over trajectories (and processes)
    twice = reward.fidelity_sums(pairs + pairs)
    assert twice["get_price"] == [2 * x for x in reward.fidelity_sums(pairs)["get_price"]]
    # a real-environment rollout has nothing rehearsed to compare
    assert reward.rehearsal_fidelity("toyworld", task, Trajectory(task_id=task.id, messages=[], calls=calls,
                                                                  observations=observations,
                                                                  rehearsed=[False] * 6)) == []


def test_checklist_reward_is_the_fraction_met_and_success_is_kept():
    task = afford_task()
    gold = tw.trajectory_from_messages(task, tw.reference_messages(task), rehearsed=True)
    half = Trajectory(task_id=task.id, messages=gold.messages, calls=gold.calls[:2], observations=[],
                      final_answer=gold.final_answer)   # the purchase missing: 3 of 5 items
    s = reward.trajectory_reward("toyworld", task, half, kind="checklist")
    assert s.reward == pytest.approx(3 / 5) and s.components["success"] == 0.0
    assert [met for _, met in s.components["checklist"]] == [True, True, False, False, True]
    assert reward.trajectory_reward("toyworld", task, half).reward == 0.0      # the binary default
    s = reward.trajectory_reward("toyworld", task, gold, ["unterminated"], 0.1, kind="checklist")
    assert s.reward == pytest.approx(0.9) and s.components["success"] == 1.0
    with pytest.raises(ValueError, match="no rule-based checklist"):
        reward.trajectory_reward("finmcp", task, gold, kind="checklist")
    with pytest.raises(ValueError, match="reward kind"):
        reward.trajectory_reward("toyworld", task, gold, kind="judge")
    assert not reward.has_checklist("vita") and not reward.has_checklist("finmcp")
    assert all(reward.has_checklist(b) for b in ("toyworld", "tau2", "bfcl"))

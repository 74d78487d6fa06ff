"""FinMCP-Bench loader, replay env and tool P/R/F1, on a small SYNTHETIC fixture in the published format."""
import json
from pathlib import Path

import pytest

from bench import BenchUnavailable, ToolCall, Trajectory
from bench import finmcp

FIXTURE = Path(__file__).parent / "fixtures" / "finmcp_synthetic.json"


@pytest.fixture(scope="module")
def tasks():
    return {t.metadata["category"]: t for t in finmcp.load_tasks("test", data=FIXTURE)}


def _calls(task):
    return [ToolCall(c["name"], dict(c["arguments"]), user_turn=c["user_turn"]) for c in task.ground_truth["calls"]]


def _traj(task, calls):
    return Trajectory(task_id=task.id, messages=[], calls=calls)


def test_fixture_is_marked_synthetic():
    assert all("synthetic" in r["_note"] for r in json.loads(FIXTURE.read_text()))


def test_no_data_is_unavailable(tmp_path):
    with pytest.raises(BenchUnavailable, match=r"--data PATH.*|DianJin/FinMCP-Bench") as e:
        finmcp.load_tasks("test")
    assert "--data PATH" in str(e.value) and "DianJin/FinMCP-Bench" in str(e.value)
    with pytest.raises(BenchUnavailable, match="does not exist"):
        finmcp.load_tasks("test", data=tmp_path / "missing")
    with pytest.raises(BenchUnavailable, match="benchmark_multi_turn.json"):
        finmcp.load_tasks("test", data=tmp_path, category="multi_turn")


def test_bad_options_and_files(tmp_path):
    with pytest.raises(ValueError, match="single_tool, multi_tool, multi_turn"):
        finmcp.load_tasks("test", data=FIXTURE, category="parallel")
    with pytest.raises(ValueError, match="split"):
        finmcp.load_tasks("validation", data=FIXTURE)
    bad = tmp_path / "benchmark_all.json"
    bad.write_text("{[ nope")
    with pytest.raises(ValueError, match="neither JSON"):
        finmcp.load_tasks("test", data=bad)
    bad.write_text(json.dumps([{"id": 1}]))
    with pytest.raises(ValueError, match="messages"):
        finmcp.load_tasks("test", data=bad)


def test_loader_fields(tasks):
    assert set(tasks) == {"single_tool", "multi_tool", "multi_turn"}
    mt = tasks["multi_turn"]
    assert [m["role"] for m in mt.messages] == ["system", "user"]
    assert mt.metadata["scenery"].startswith("账户与持仓") and mt.metadata["level"] == "hard"
    assert mt.metadata["later_user_messages"] == ["000003最近一个月净值走势呢？"]
    names = [s["function"]["name"] for s in mt.tools]
    assert names == sorted({"SearchFinancialNews", "SearchFund", "GetFundNav", "GetFundFee", "GetUserHoldings"})
    nav = next(s for s in mt.tools if s["function"]["name"] == "GetFundNav")["function"]["parameters"]
    assert nav["properties"]["fund_code"]["type"] == "string" and nav["properties"]["days"]["type"] == "integer"
    assert nav["required"] == ["days", "fund_code"]
    own = finmcp.load_tasks("test", data=FIXTURE, category="multi_turn", tools="task")[0]
    assert [s["function"]["name"] for s in own.tools] == ["GetFundNav", "GetUserHoldings"]


def test_directory_layouts(tmp_path):
    recs = json.loads(FIXTURE.read_text())
    for r in recs:
        r.pop("task")                                   # category must then come from the file name
    names = {"single_tool": "benchmark_stss.json", "multi_tool": "benchmark_multi_tool.json",
             "multi_turn": "benchmark_multi_turn.json"}
    for rec, name in zip(recs, names.values()):
        (tmp_path / name).write_text(json.dumps([rec], ensure_ascii=False))
    all_tasks = finmcp.load_tasks("test", data=tmp_path)
    assert sorted(t.metadata["category"] for t in all_tasks) == ["multi_tool", "multi_turn", "single_tool"]
    assert [t.id for t in finmcp.load_tasks("test", data=tmp_path, category="multi_tool")] == ["finmcp/multi_tool/2"]
    # JSON Lines, no task field, no telling file name: category from diff_level
    jl = tmp_path / "x.jsonl"
    jl.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in recs))
    assert [t.metadata["category"] for t in finmcp.load_tasks("test", data=jl)] == ["single_tool", "multi_tool", "multi_turn"]


def test_ground_truth_replay(tasks):
    for t in tasks.values():
        env = finmcp.make_env(t)
        for c, rec in zip(_calls(t), t.metadata["recorded"]):
            assert env.step(c.name, c.arguments) == rec["response"]
        assert env.user_turn("done") == (t.metadata["later_user_messages"] or [None])[0]
        assert env.user_turn("done") is None
        s = finmcp.score(t, _traj(t, _calls(t)))
        assert s.reward == 1.0 and s.components["exact_match"] == 1.0 and s.components["arg_exact_recall"] == 1.0


def test_hand_computed_metrics(tasks):
    t = tasks["multi_tool"]                  # gold: SearchFund, GetFundNav, GetFundNav, GetFundFee
    pred = [ToolCall("SearchFund", {"query": "沪深300", "limit": 2}), ToolCall("GetFundNav", {"fund_code": "000009"}),
            ToolCall("SearchFinancialNews", {"keyword": "x"})]
    c = finmcp.score(t, _traj(t, pred)).components
    assert (c["tp"], c["fp"], c["fn"]) == (2, 1, 2)
    assert c["precision"] == pytest.approx(2 / 3) and c["recall"] == pytest.approx(0.5)
    assert c["f1"] == pytest.approx(4 / 7) and c["exact_match"] == 0.0
    assert c["arg_exact_recall"] == pytest.approx(1 / 4)
    assert finmcp.score(t, _traj(t, pred)).reward == pytest.approx(4 / 7)
    rev = list(reversed(_calls(t)))
    s = finmcp.score(t, _traj(t, rev))
    assert s.reward == 1.0 and s.components["exact_match"] == 0.0       # multiset equal, order differs
    assert finmcp.score(t, _traj(t, [])).reward == 0.0
    assert finmcp.score(t, _traj(t, _calls(t) + _calls(t))).components["precision"] == pytest.approx(0.5)


def test_replay_matching_rule(tasks):
    t = tasks["multi_tool"]
    rec = {c["arguments"].get("fund_code"): c["response"] for c in t.metadata["recorded"] if c["name"] == "GetFundNav"}
    env = finmcp.make_env(t)
    # exact match regardless of key order / surrounding spaces, even out of logged order
    assert env.step("GetFundNav", {"days": 5, "fund_code": " 000002 "}) == rec["000002"]
    assert env.step("GetFundNav", {"days": 5, "fund_code": "000002"}) == rec["000002"]   # a repeat: same answer
    # different arguments: the next unused logged call of that name
    assert env.step("GetFundNav", {"fund_code": "999999", "days": 1}) == rec["000001"]
    # nothing left for this name and these arguments
    assert env.step("GetFundNav", {"fund_code": "888888", "days": 1}).startswith("Error: no recorded response")
    assert env.step("GetUserHoldings", {"user_id": "u"}).startswith("Error: no recorded response")   # other task's tool
    assert env.step("Nope", {}).startswith("Error: unknown tool")
    assert env.step("GetFundNav", {"fund_code": 1, "days": 5}).startswith("Error: argument 'fund_code'")
    assert env.step("GetFundNav", {"fund_code": "000001", "days": "5"}).startswith("Error: argument 'days'")
    assert env.step("GetFundNav", ["000001"]).startswith("Error: arguments")

"""VitaBench: loader, deterministic tool env, order-state proxy score (data in ../shared/data/vitabench)."""
import copy
import json
import random

import pytest

from bench import BenchUnavailable, ToolCall, Trajectory
from bench import vita

if not vita.DEFAULT_DATA.is_dir():
    pytest.skip(f"VitaBench data not found at {vita.DEFAULT_DATA}", allow_module_level=True)


@pytest.fixture(scope="module")
def tasks():
    return {(d, l): vita.load_tasks("test", domain=d, lang=l) for d, l in
            [("delivery", "en"), ("delivery", "zh"), ("instore", "en")]}


def _traj(task, calls, observations=None):
    return Trajectory(task_id=task.id, messages=[], calls=calls, observations=observations or [])


def test_available_domains_and_counts(tasks):
    assert vita.available_domains() == {"delivery": ["en", "zh"], "instore": ["en"]}
    assert {k: len(v) for k, v in tasks.items()} == {("delivery", "en"): 100, ("delivery", "zh"): 100,
                                                     ("instore", "en"): 100}
    assert len(vita.load_tasks("test", domain="all")) == 200
    assert len(vita.load_tasks("test", limit=3)) == 3


def test_bad_options(tmp_path):
    with pytest.raises(ValueError, match="delivery, instore, all"):
        vita.load_tasks("test", domain="airline")
    with pytest.raises(ValueError, match="en, zh"):
        vita.load_tasks("test", lang="fr")
    with pytest.raises(ValueError, match="split"):
        vita.load_tasks("validation")
    with pytest.raises(BenchUnavailable, match="--data"):
        vita.load_tasks("test", domain="instore", lang="zh")
    with pytest.raises(BenchUnavailable, match="--data"):
        vita.load_tasks("test", data=tmp_path / "nowhere")
    (tmp_path / "delivery").mkdir()
    (tmp_path / "delivery" / "tasks_en.json").write_text("[{not json")
    assert vita.available_domains(tmp_path) == {"delivery": ["en"]}
    with pytest.raises(ValueError, match="not valid JSON"):
        vita.load_tasks("test", domain="delivery", data=tmp_path)


def test_splits_partition():
    train = {t.id for t in vita.load_tasks("train", domain="all")}
    dev = {t.id for t in vita.load_tasks("dev", domain="all")}
    assert train and dev and not (train & dev) and len(train | dev) == 200


def test_task_shape(tasks):
    t = tasks[("delivery", "en")][0]
    assert [m["role"] for m in t.messages] == ["system", "user"]
    assert "Current time: 2025-06-21 11:20:00 Saturday" in t.messages[0]["content"]
    assert "###STOP###" in t.messages[0]["content"]
    assert "rice noodles" in t.messages[1]["content"] and "U000001" in t.messages[1]["content"]
    names = [s["function"]["name"] for s in t.tools]
    assert len(names) == len(set(names)) and "create_delivery_order" in names and "instore_book" not in names
    for s in t.tools:
        assert s["type"] == "function" and s["function"]["parameters"]["type"] == "object"
    zh = tasks[("delivery", "zh")][0]
    assert "当前时间" in zh.messages[0]["content"] and "星期六" in zh.messages[0]["content"]
    ins = tasks[("instore", "en")][0]
    assert "instore_reservation" in [s["function"]["name"] for s in ins.tools]
    chat = vita.load_tasks("test", domain="delivery", limit=1, mode="chat")[0]
    assert "ask the user" in chat.messages[0]["content"]


def test_ground_truth_replay_scores_one(tasks):
    derived = {}
    for key, ts in tasks.items():
        n = 0
        for t in ts:
            calls, problems = vita.reference_calls(t)
            s = vita.score(t, _traj(t, calls))
            assert 0.0 <= s.reward <= 1.0 and s.components["metric"] == "order_state_proxy"
            if not problems:
                n += 1
                assert s.reward == 1.0, (t.id, s.components)
                assert s.components["replay_errors"] == 0
        derived[key] = n
    # the rest are data defects (product or shop missing from the task's database, booking not enabled)
    assert derived == {("delivery", "en"): 97, ("delivery", "zh"): 97, ("instore", "en"): 96}


def _first_create(calls, name):
    return next(i for i, c in enumerate(calls) if c.name == name)


def test_corrupted_calls_score_lower(tasks):
    t = tasks[("delivery", "en")][0]            # one order: 1 x product P88296 from one store, paid
    calls, problems = vita.reference_calls(t)
    assert not problems and vita.score(t, _traj(t, calls)).reward == 1.0
    i = _first_create(calls, "create_delivery_order")

    wrong_qty = copy.deepcopy(calls)
    wrong_qty[i].arguments["product_cnts"] = [3]
    s = vita.score(t, _traj(t, wrong_qty))
    assert s.reward == pytest.approx(0.75)      # store, products, status right; quantity wrong

    unpaid = calls[:i + 1]                      # created but never paid
    assert vita.score(t, _traj(t, unpaid)).reward == pytest.approx(0.75)

    assert vita.score(t, _traj(t, [])).reward == 0.0       # missing order

    twice = calls + calls                       # a second, unrequested active order
    assert vita.score(t, _traj(t, twice)).reward == pytest.approx(0.5)

    # wrong product: another task with several products in the chosen store
    for t2 in tasks[("delivery", "en")]:
        calls2, problems2 = vita.reference_calls(t2)
        j = next((k for k, c in enumerate(calls2) if c.name == "create_delivery_order"), None)
        if problems2 or j is None:
            continue
        store = t2.metadata["environment"]["stores"][calls2[j].arguments["store_id"]]
        others = [p["product_id"] for p in store["products"] if p["product_id"] not in calls2[j].arguments["product_ids"]]
        if others and len(calls2[j].arguments["product_ids"]) == 1:
            bad = copy.deepcopy(calls2)
            bad[j].arguments["product_ids"] = [others[0]]
            s = vita.score(t2, _traj(t2, bad))
            assert s.reward < 1.0 and s.components["n_exact"] < s.components["n_required"]
            break
    else:
        pytest.fail("no task with an alternative product found")


def test_instore_corrupted_and_cancel(tasks):
    t = next(t for t in tasks[("instore", "en")] if not vita.reference_calls(t)[1]
             and any(c.name == "instore_reservation" for c in vita.reference_calls(t)[0]))
    calls, _ = vita.reference_calls(t)
    k = _first_create(calls, "instore_reservation")
    bad = copy.deepcopy(calls)
    bad[k].arguments["customer_count"] = bad[k].arguments["customer_count"] + 1
    assert vita.score(t, _traj(t, bad)).reward < 1.0
    assert vita.score(t, _traj(t, [c for n, c in enumerate(calls) if n != k])).reward < 1.0


def test_wrong_argument_types_are_error_observations(tasks):
    t = tasks[("delivery", "en")][0]
    env = vita.make_env(t)
    bad = [
        ("delivery_store_search_recommand", {"keywords": "rice noodles"}),
        ("create_delivery_order", {"user_id": "U000001", "store_id": "S85277471199200385_S98778",
                                   "product_ids": ["S26110520013660896_P88296"], "product_cnts": ["1"],
                                   "address": "x", "dispatch_time": "2025-06-21 11:30:00"}),
        ("get_delivery_store_info", {"store_id": 42}),
        ("get_delivery_store_info", {}),
        ("get_delivery_store_info", {"store_id": "S85277471199200385_S98778", "extra": 1}),
        ("longitude_latitude_to_distance", {"longitude1": True, "latitude1": 1, "longitude2": 1, "latitude2": 1}),
        ("no_such_tool", {}),
        ("get_delivery_store_info", "not a dict"),
    ]
    for name, args in bad:
        out = env.step(name, args)
        assert isinstance(out, str) and out.startswith("Error"), (name, args, out)
    rng = random.Random(0)
    values = [None, 1, 1.5, "x", [], ["x"], [1], {}, True, "2025-13-45 99:99:99"]
    for spec in t.tools + tasks[("instore", "en")][0].tools:
        props = spec["function"]["parameters"]["properties"]
        for _ in range(5):
            args = {k: rng.choice(values) for k in props}
            assert isinstance(env.step(spec["function"]["name"], args), str)
    assert env.db["orders"] == {}      # nothing got created by bad calls


def test_tool_semantics(tasks):
    t = tasks[("delivery", "en")][0]
    env = vita.make_env(t)
    sid, pid = "S85277471199200385_S98778", "S26110520013660896_P88296"
    addr = t.metadata["environment"]["location"][0]["address"]
    assert "Jintugo" in env.step("delivery_store_search_recommand", {"keywords": ["rice noodles"]}).splitlines()[0]
    assert json.loads(env.step("get_delivery_product_info", {"product_id": pid}))["price"] == 25
    assert env.step("weather", {"address": "Kunming", "date_start": "2025-06-21", "date_end": "2025-06-21"}).count("rainy") == 1
    assert json.loads(env.step("address_to_longitude_latitude", {"address": addr})) == [102.713518, 25.048244]
    assert env.step("get_holiday_date", {"year": "2025", "holiday_name": "Mid-Autumn Festival"}) == "2025-10-06"
    assert env.step("get_date_holiday_info", {"date": "2025-10-03"}) == "National Day"
    past = env.step("create_delivery_order", {"user_id": "U000001", "store_id": sid, "product_ids": [pid],
                                              "product_cnts": [1], "address": addr, "dispatch_time": "2025-06-21 10:00:00"})
    assert past.startswith("Error") and "future" in past
    wrong_user = env.step("create_delivery_order", {"user_id": "U9", "store_id": sid, "product_ids": [pid],
                                                    "product_cnts": [1], "address": addr, "dispatch_time": "2025-06-21 11:30:00"})
    assert "does not match" in wrong_user
    order = json.loads(env.step("create_delivery_order", {"user_id": "U000001", "store_id": sid, "product_ids": [pid],
                                                          "product_cnts": [2], "address": addr,
                                                          "dispatch_time": "2025-06-21 11:30:00"}))
    assert order["status"] == "unpaid" and order["total_price"] == 50 and order["shipping_time"] > 25
    oid = order["order_id"]
    assert env.step("pay_delivery_order", {"order_id": oid}) == "Payment successful"
    assert "not in `unpaid`" in env.step("pay_delivery_order", {"order_id": oid})
    assert env.step("get_delivery_order_status", {"order_id": oid}) == "paid"
    assert "cancelled" in env.step("cancel_delivery_order", {"order_id": oid})
    assert env.step("cancel_delivery_order", {"order_id": oid}).startswith("Error")
    assert env.step("pay_delivery_order", {"order_id": "OTnope"}).startswith("Error")
    # deterministic ids: a fresh env creates the same id
    env2 = vita.make_env(t)
    again = json.loads(env2.step("create_delivery_order", {"user_id": "U000001", "store_id": sid, "product_ids": [pid],
                                                           "product_cnts": [2], "address": addr,
                                                           "dispatch_time": "2025-06-21 11:30:00"}))
    assert again["order_id"] == oid


def test_rehearsed_ids_are_aliased(tasks):
    t = tasks[("delivery", "en")][0]
    calls, _ = vita.reference_calls(t)
    i = _first_create(calls, "create_delivery_order")
    invented = "OTdeadbeef00"
    calls = copy.deepcopy(calls)
    calls[i + 1].arguments["order_id"] = invented        # the pay call uses the id the policy made up
    obs = [""] * len(calls)
    obs[i] = json.dumps({"order_id": invented, "status": "unpaid"})
    assert vita.score(t, _traj(t, calls, obs)).reward == 1.0
    assert vita.score(t, _traj(t, calls)).reward == pytest.approx(0.75)   # without the observation: not paid


def test_user_turn_and_judge(tasks):
    t = tasks[("delivery", "en")][0]
    assert vita.make_env(t).user_turn("Done.") is None
    env = vita.make_env(t, user_fn=lambda text, task: f"ok ({task.metadata['raw_id']})")
    assert env.user_turn("Shall I pay?") == "ok (10711001)"
    assert env.user_turn("All done ###STOP###") is None
    calls, _ = vita.reference_calls(t)
    n = len(t.ground_truth["rubrics"])
    seen = {}

    def judge(rubrics, messages, state):
        seen["state"] = state
        return [True] * len(rubrics)
    s = vita.score(t, _traj(t, calls), judge_fn=judge)
    assert s.reward == 1.0 and s.components["rubric_score"] == 1.0 and len(seen["state"]["orders"]) == 1
    s = vita.score(t, _traj(t, calls), judge_fn=lambda r, m, st: [True] * (n - 1) + [False])
    assert s.reward == 0.0 and s.components["proxy_reward"] == 1.0

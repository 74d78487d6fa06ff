import copy
import itertools
import json
import random

import pytest

from bench import ToolCall, load_bench
from bench import toyworld as tw


def traj_of(task, messages=None, **kw):
    return tw.trajectory_from_messages(task, messages or tw.reference_messages(task), **kw)


def state_names(task):
    return list(task.metadata["world"]["balances"])


@pytest.fixture(scope="module")
def train():
    return tw.load_tasks("train", limit=4000)


@pytest.fixture(scope="module")
def test():
    return tw.load_tasks("test")


# ----------------------------------------------------------------------------- loading

def test_load_bench_and_sizes():
    assert load_bench("toyworld") is tw
    assert len(tw.load_tasks("train", limit=10)) == 10
    assert len(tw.load_tasks("test", n=30)) == 30
    assert len(tw.load_tasks("test", limit=5000)) == tw.DEFAULT_N["test"]


def test_bad_options_raise_valueerror():
    with pytest.raises(ValueError, match="train, test"):
        tw.load_tasks("dev")
    with pytest.raises(ValueError, match="balance"):
        tw.load_tasks("train", families=["nope"])
    with pytest.raises(ValueError, match="pairs, names, none"):
        tw.load_tasks("train", holdout="items")


def test_determinism_and_prefix():
    dump = lambda ts: [(t.id, t.messages, t.ground_truth, t.metadata) for t in ts]
    a = tw.load_tasks("train", limit=300, seed=3)
    assert dump(a) == dump(tw.load_tasks("train", limit=300, seed=3))
    assert dump(a[:50]) == dump(tw.load_tasks("train", limit=50, seed=3))
    b = tw.load_tasks("train", limit=300, seed=4)
    same = sum(x.messages == y.messages for x, y in zip(a, b))
    assert same < 10
    assert len({json.dumps(t.messages) for t in a}) == len(a)


def test_families_round_robin(train):
    fams = [t.metadata["family"] for t in train[:16]]
    assert fams == tw.FAMILIES * 2
    for t in train[:800]:
        assert len(t.ground_truth["calls"]) == tw.N_CALLS[t.metadata["family"]] == t.metadata["n_gold_calls"]
    only = tw.load_tasks("train", limit=20, families="chain,pool")
    assert {t.metadata["family"] for t in only} == {"chain", "pool"}


def test_prompts_short_and_show_state(train):
    for t in train[:400]:
        text = t.messages[0]["content"] + t.messages[1]["content"]
        assert len(text) < 320
        for name, bal in t.metadata["world"]["balances"].items():
            assert f"{name} {bal}" in t.messages[0]["content"]
    hidden = tw.load_tasks("train", limit=5, show_state=False)
    assert all(t.messages[0]["content"] == tw.SYSTEM for t in hidden)


# ----------------------------------------------------------------------------- hold-out

def _principal_pair(task):
    calls = task.ground_truth["calls"]
    fam = task.metadata["family"]
    if fam == "total":
        return {calls[0]["arguments"]["account"], calls[1]["arguments"]["account"]}
    if fam in ("send", "half", "chain", "pool"):
        tr = next(c for c in calls if c["name"] == "transfer")["arguments"]
        return {tr["src"], tr["dst"]}
    return None


def test_holdout_pairs(train, test):
    for t in train:
        names = state_names(t)
        assert not any(frozenset(p) in tw.HELD_PAIRS for p in itertools.combinations(names, 2)), t.id
        for c in t.ground_truth["calls"]:
            if c["name"] == "buy":
                assert (c["arguments"]["account"], c["arguments"]["item"]) not in tw.HELD_BUYS
    train_texts = {t.messages[1]["content"] + t.messages[0]["content"] for t in train}
    for t in test:
        names = state_names(t)
        assert any(frozenset(p) in tw.HELD_PAIRS for p in itertools.combinations(names, 2)), t.id
        pair = _principal_pair(t)
        if pair is not None:
            assert frozenset(pair) in tw.HELD_PAIRS, t.id
        fam = t.metadata["family"]
        if fam == "balance":
            asked = t.ground_truth["calls"][0]["arguments"]["account"]
            assert any(asked in p and set(p) <= set(names) for p in tw.HELD_PAIRS)
        if fam in ("buy", "afford"):
            b = next(c for c in t.ground_truth["calls"] if c["name"] == "buy")["arguments"]
            assert (b["account"], b["item"]) in tw.HELD_BUYS
        assert t.messages[1]["content"] + t.messages[0]["content"] not in train_texts


def test_holdout_names():
    tr = tw.load_tasks("train", limit=1500, holdout="names")
    te = tw.load_tasks("test", limit=300, holdout="names")
    for t in tr:
        text = json.dumps(tw.reference_messages(t))
        for n in tw.HELD_NAMES + tw.HELD_ITEMS:
            assert f"{n} " not in text and f"\"{n}\"" not in text and f"{n}'" not in text, (t.id, n)
    for t in te:
        used = {v for c in t.ground_truth["calls"] for v in c["arguments"].values()}
        assert used & set(tw.HELD_NAMES), t.id
        if t.metadata["family"] in ("buy", "afford"):
            assert used & set(tw.HELD_ITEMS)


# ----------------------------------------------------------------------------- scoring

def test_reference_replays_to_one(train, test):
    r = random.Random(0)
    sample = r.sample(train, 250) + r.sample(test, 150)
    sample += tw.load_tasks("test", limit=50, holdout="names") + tw.load_tasks("train", limit=50, show_state=False)
    assert len(sample) == 500
    for t in sample:
        s = tw.score(t, traj_of(t))
        assert s.reward == 1.0, (t.id, s)
        c = s.components
        assert c["state_correct"] == c["answer_correct"] == c["reads_done"] == c["calls_match_gold"] == 1.0
        assert c["n_calls"] == c["n_obs"] == c["n_obs_correct"] == len(t.ground_truth["calls"])


def _msgs_with_calls(task, calls, answer=None, obs=None):
    """Gold-style messages for arbitrary calls; observations from the real env unless given."""
    env = tw.make_env(task)
    msgs = list(task.messages)
    for i, (name, args) in enumerate(calls):
        msgs.append({"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]})
        msgs.append({"role": "tool", "content": obs[i] if obs else env.step(name, args)})
    msgs.append({"role": "assistant", "content": task.ground_truth["answer_text"] if answer is None else answer})
    return msgs


def gold(task):
    return [(c["name"], copy.deepcopy(c["arguments"])) for c in task.ground_truth["calls"]]


def test_corrupted_trajectories_score_zero(train):
    checked = {"amount": 0, "missing_write": 0, "missing_read": 0, "answer": 0}
    for t in train[:400]:
        calls = gold(t)
        # wrong final answer
        ans = t.ground_truth["answer_text"].replace(str(t.ground_truth["answer"]), str(t.ground_truth["answer"] + 1))
        s = tw.score(t, traj_of(t, _msgs_with_calls(t, calls, answer=ans)))
        assert s.reward == 0.0 and s.components["answer_correct"] == 0.0
        checked["answer"] += 1
        for i, (name, args) in enumerate(calls):
            if name == "transfer" or (name == "buy" and t.metadata["family"] == "afford"):
                key = "amount" if name == "transfer" else "qty"
                bad = copy.deepcopy(calls)
                bad[i][1][key] = args[key] - 1 if args[key] > 1 else args[key] + 1
                s = tw.score(t, traj_of(t, _msgs_with_calls(t, bad)))
                if '"error"' not in _gold_obs(t)[i]:  # a failing gold call may still fail with another amount
                    assert s.reward == 0.0 and s.components["state_correct"] == 0.0, (t.id, bad)
                    checked["amount"] += 1
            # missing call: a write changes the state, a read is required by the reads rule
            dropped = calls[:i] + calls[i + 1:]
            s = tw.score(t, traj_of(t, _msgs_with_calls(t, dropped)))
            failed_write = name in ("transfer", "buy") and '"error"' in _gold_obs(t)[i]
            if not failed_write:
                assert s.reward == 0.0, (t.id, dropped)
                checked["missing_read" if name.startswith("get_") else "missing_write"] += 1
    assert min(checked.values()) > 50, checked


def _gold_obs(task):
    return [m["content"] for m in tw.reference_messages(task) if m["role"] == "tool"]


def test_require_reads_off_allows_skipping_lookups():
    t = tw.load_tasks("train", limit=4, families=["half"], require_reads=False)[0]
    calls = [c for c in gold(t) if c[0] == "transfer"]
    s = tw.score(t, traj_of(t, _msgs_with_calls(t, calls)))
    assert s.reward == 1.0 and s.components["reads_done"] == 0.0
    t2 = tw.load_tasks("train", limit=4, families=["half"])[0]
    assert tw.score(t2, traj_of(t2, _msgs_with_calls(t2, calls))).reward == 0.0


def test_score_ignores_rehearsed_observations():
    """Rehearsal rule: right calls + wrong invented observations still succeed; obs accuracy shows the error."""
    t = tw.load_tasks("train", limit=8, families=["chain"])[0]
    calls = gold(t)
    fake = ['{"balance": 999}', '{"x": 1}', "nonsense", '{"error": "insufficient funds"}']
    s = tw.score(t, traj_of(t, _msgs_with_calls(t, calls, obs=fake), rehearsed=True))
    assert s.reward == 1.0
    assert s.components["n_obs"] == 4 and s.components["n_obs_correct"] == 0
    assert s.components["n_rehearsed"] == 4 and s.components["n_rehearsed_correct"] == 0
    # whitespace differences in a rehearsed observation still count as correct (compared as JSON)
    real = _gold_obs(t)
    spaced = [o.replace(": ", ":") for o in real]
    s = tw.score(t, traj_of(t, _msgs_with_calls(t, calls, obs=spaced)))
    assert s.components["obs_accuracy"] == 1.0
    # a wrong belief about the first response (balance 10 instead of the real one) -> wrong transfer -> 0
    a = calls[0][1]["account"]
    believed = 10 if t.metadata["world"]["balances"][a] != 10 else 12
    bad = copy.deepcopy(calls)
    bad[1][1]["amount"] = believed // 2
    assert tw.score(t, traj_of(t, _msgs_with_calls(t, bad))).reward == 0.0


def test_final_answer_fallback_and_last_integer():
    t = tw.load_tasks("train", limit=1, families=["balance"])[0]
    tr = traj_of(t)
    tr.final_answer = ""
    assert tw.score(t, tr).reward == 1.0
    v = t.ground_truth["answer"]
    tr.final_answer = f"{v} or maybe {v + 1}"
    assert tw.score(t, tr).reward == 0.0
    tr.final_answer = f"Answer: {v + 3}... no, {v}"
    assert tw.score(t, tr).reward == 1.0
    tr.final_answer = "no number"
    assert tw.score(t, tr).reward == 0.0


def test_score_with_toolcalls_directly():
    t = tw.load_tasks("train", limit=2, families=["total"])[0]
    from bench import Trajectory
    calls = [ToolCall(n, a) for n, a in gold(t)]
    tr = Trajectory(task_id=t.id, messages=[], calls=calls, final_answer=str(t.ground_truth["answer"]))
    s = tw.score(t, tr)
    assert s.reward == 1.0 and s.components["n_obs"] == 0 and s.components["obs_accuracy"] == 1.0
    # a garbage call (wrong type) is an error, not an exception, and a read of an unknown account too
    tr.calls = calls + [ToolCall("transfer", {"src": 1, "dst": [], "amount": "x"}), ToolCall("nope", None)]
    s = tw.score(t, tr)
    assert s.reward == 1.0 and s.components["n_errors"] == 2


# ----------------------------------------------------------------------------- environment rules

def env():
    return tw.ToyEnv({"ann": 40, "bob": 12, "cal": 7}, {"pen": 3, "cup": 8}, {"pen": 5, "cup": 2})


def test_env_rules_by_hand():
    e = env()
    assert e.step("get_balance", {"account": "ann"}) == '{"balance": 40}'
    assert e.step("get_price", {"item": "cup"}) == '{"price": 8, "stock": 2}'
    assert e.step("transfer", {"src": "ann", "dst": "bob", "amount": 20}) == '{"ann": 20, "bob": 32}'
    assert e.step("get_balance", {"account": "bob"}) == '{"balance": 32}'
    assert e.step("buy", {"account": "bob", "item": "pen", "qty": 3}) == '{"cost": 9, "balance": 23, "stock": 2}'
    assert e.step("get_price", {"item": "pen"}) == '{"price": 3, "stock": 2}'
    assert e.step("transfer", {"src": "cal", "dst": "ann", "amount": 7}) == '{"cal": 0, "ann": 27}'
    assert e.state() == {"balances": {"ann": 27, "bob": 23, "cal": 0}, "stock": {"pen": 2, "cup": 2}}
    assert e.user_turn("done") is None
    # make_env gives a fresh copy: tasks are never mutated by stepping
    t = tw.load_tasks("train", limit=3, families=["pool"])[0]
    before = copy.deepcopy(t.metadata["world"])
    e1 = tw.make_env(t)
    for n, a in gold(t):
        e1.step(n, a)
    assert t.metadata["world"] == before and tw.make_env(t).state()["balances"] == before["balances"]


@pytest.mark.parametrize("name,args,msg", [
    ("nope", {}, "unknown tool: nope"),
    (None, {}, "unknown tool: None"),
    ("get_balance", "ann", "arguments must be an object"),
    ("get_balance", None, "arguments must be an object"),
    ("get_balance", {}, "missing argument: account"),
    ("get_balance", {"account": "ann", "x": 1}, "unexpected argument: x"),
    ("get_balance", {"account": 3}, "account must be a string"),
    ("get_balance", {"account": "zed"}, "unknown account: zed"),
    ("get_price", {"item": "car"}, "unknown item: car"),
    ("get_price", {"item": ["pen"]}, "item must be a string"),
    ("transfer", {"src": "ann", "dst": "bob"}, "missing argument: amount"),
    ("transfer", {"src": "ann", "dst": "bob", "amount": "5"}, "amount must be a positive integer"),
    ("transfer", {"src": "ann", "dst": "bob", "amount": 5.0}, "amount must be a positive integer"),
    ("transfer", {"src": "ann", "dst": "bob", "amount": True}, "amount must be a positive integer"),
    ("transfer", {"src": "ann", "dst": "bob", "amount": 0}, "amount must be a positive integer"),
    ("transfer", {"src": "ann", "dst": "bob", "amount": -3}, "amount must be a positive integer"),
    ("transfer", {"src": "ann", "dst": "zed", "amount": 1}, "unknown account: zed"),
    ("transfer", {"src": "ann", "dst": "ann", "amount": 1}, "same account"),
    ("transfer", {"src": "bob", "dst": "ann", "amount": 13}, "insufficient funds"),
    ("buy", {"account": "ann", "item": "cup", "qty": 3}, "not enough stock"),
    ("buy", {"account": "cal", "item": "cup", "qty": 1}, "insufficient funds"),
    ("buy", {"account": "ann", "item": "cup", "qty": None}, "qty must be a positive integer"),
])
def test_bad_calls_give_error_observations(name, args, msg):
    e = env()
    before = e.state()
    out = e.step(name, args)
    assert json.loads(out) == {"error": msg}
    assert e.state() == before


def test_boundaries_succeed():
    e = env()
    assert e.step("transfer", {"src": "bob", "dst": "cal", "amount": 12}) == '{"bob": 0, "cal": 19}'
    assert e.step("buy", {"account": "cal", "item": "cup", "qty": 2}) == '{"cost": 16, "balance": 3, "stock": 0}'
    assert json.loads(e.step("buy", {"account": "ann", "item": "cup", "qty": 1})) == {"error": "not enough stock"}


def test_corpus_text_covers_world():
    lines = tw.corpus_text(200, seed=0)
    assert all(isinstance(x, str) for x in lines)
    text = "\n".join(lines)
    for word in ["get_balance", "transfer", "get_price", "buy", "insufficient funds", "not enough stock",
                 "unknown account", '{"balance": ', "Accounts:", "Shop:"]:
        assert word in text
    for n in tw.NAMES:
        assert n in text
    assert lines == tw.corpus_text(200, seed=0)


def test_gold_answers_by_hand(train, test):
    """Each family's gold answer recomputed from the shown table, independently of the env."""
    for t in train[:800] + test[:200]:
        w, fam = t.metadata["world"], t.metadata["family"]
        bal, price, stock = w["balances"], w["prices"], w["stock"]
        args = [c["arguments"] for c in t.ground_truth["calls"]]
        obs = _gold_obs(t)
        if fam not in ("send", "buy"):
            assert not any('"error"' in o for o in obs), t.id
        if fam == "balance":
            want = bal[args[0]["account"]]
        elif fam == "total":
            want = bal[args[0]["account"]] + bal[args[1]["account"]]
        elif fam == "send":
            a, b, n = args[0]["src"], args[0]["dst"], args[0]["amount"]
            want = bal[b] + n if n <= bal[a] else bal[b]
        elif fam == "buy":
            a, i, q = args[0]["account"], args[0]["item"], args[0]["qty"]
            ok = q <= stock[i] and q * price[i] <= bal[a]
            want = bal[a] - q * price[i] if ok else bal[a]
        elif fam == "half":
            a, b = args[1]["src"], args[1]["dst"]
            assert bal[a] % 2 == 0 and args[1]["amount"] == bal[a] // 2
            want = bal[b] + bal[a] // 2
        elif fam == "afford":
            a, i = args[0]["account"], args[1]["item"]
            want = min(bal[a] // price[i], stock[i])
            assert want >= 1 and args[2]["qty"] == want
        elif fam == "chain":
            a, b, c = args[1]["src"], args[1]["dst"], args[3]["dst"]
            mid = bal[b] + bal[a] // 2
            assert mid % 2 == 0 and args[3]["amount"] == mid // 2
            want = bal[c] + mid // 2
        elif fam == "pool":
            a, b, c = args[1]["dst"], args[1]["src"], args[3]["src"]
            want = bal[a] + bal[b] + bal[c]
        assert t.ground_truth["answer"] == want, t.id
        assert str(want) in t.ground_truth["answer_text"]


def test_error_variants_present(train):
    errs = {}
    for t in train[:2000]:
        for o in _gold_obs(t):
            if '"error"' in o:
                errs[(t.metadata["family"], json.loads(o)["error"])] = errs.get((t.metadata["family"], json.loads(o)["error"]), 0) + 1
    assert set(errs) == {("send", "insufficient funds"), ("buy", "not enough stock"), ("buy", "insufficient funds")}
    assert 40 < errs[("send", "insufficient funds")] < 100  # about 1 in 4 of the 250 send tasks


def test_determinism_across_processes():
    """Same tasks whatever PYTHONHASHSEED is (no dependence on set/dict hash order)."""
    import os
    import subprocess
    import sys
    code = ("import json, hashlib; from bench import toyworld as tw; print(hashlib.md5(json.dumps("
            "[(t.messages, t.ground_truth) for h in tw.HOLDOUTS for s in ('train', 'test') "
            "for t in tw.load_tasks(s, limit=200, holdout=h)]).encode()).hexdigest())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outs = set()
    for h in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=h, PYTHONPATH=root)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                                text=True, check=True).stdout)
    assert len(outs) == 1


# ----------------------------------------------------------------------------- world examples (warm start)

def test_world_examples_replay_on_the_env_and_cover_valid_and_invalid_calls(train):
    errors, valid_by_tool = set(), set()
    for i, task in enumerate(train[:300]):
        msgs = tw.world_examples(task, random.Random(i), 4)
        assert msgs[:len(task.messages)] == task.messages
        turns = msgs[len(task.messages):]
        assert [m["role"] for m in turns] == ["assistant", "tool"] * 4
        env = tw.make_env(task)   # replay on a fresh env: every response is the real one, in order
        for call_msg, tool_msg in zip(turns[::2], turns[1::2]):
            (tc,) = call_msg["tool_calls"]
            name, args = tc["function"]["name"], tc["function"]["arguments"]
            # the tool-call parser would accept it: a known tool with its required arguments
            assert name in tw._SIGNATURES and set(tw._SIGNATURES[name]) <= set(args)
            assert tool_msg["content"] == env.step(name, args)
            obs = json.loads(tool_msg["content"])
            if "error" in obs:
                errors.add(obs["error"].split(":")[0])
            else:
                valid_by_tool.add(name)
        assert msgs == tw.world_examples(task, random.Random(i), 4)   # seeded
    assert valid_by_tool == set(tw._SIGNATURES)
    assert errors >= {"unknown account", "unknown item", "amount must be a positive integer",
                      "qty must be a positive integer", "insufficient funds", "not enough stock", "same account",
                      "unexpected argument", "account must be a string"}
    with pytest.raises(ValueError, match="n >= 1"):
        tw.world_examples(train[0], random.Random(0), 0)


def test_world_example_lookups_are_valid_real_lookups_and_off_by_default(train):
    lookups = other = 0
    for i, task in enumerate(train[:100]):
        assert tw.world_examples(task, random.Random(i), 3) == \
            tw.world_examples(task, random.Random(i), 3, lookup_frac=0.0)   # the old stream, unchanged
        msgs = tw.world_examples(task, random.Random(i), 4, lookup_frac=1.0)
        turns = msgs[len(task.messages):]
        env = tw.make_env(task)
        for call_msg, tool_msg in zip(turns[::2], turns[1::2]):
            f = call_msg["tool_calls"][0]["function"]
            assert f["name"] in tw.LOOKUP_TOOLS and tool_msg["content"] == env.step(f["name"], f["arguments"])
            assert "error" not in json.loads(tool_msg["content"])
        for m in tw.world_examples(task, random.Random(i), 4, lookup_frac=0.5)[len(task.messages)::2]:
            f = m["tool_calls"][0]["function"]
            lookups += f["name"] in tw.LOOKUP_TOOLS
            other += f["name"] not in tw.LOOKUP_TOOLS
    assert other > 0 and lookups > 2 * other   # half lookups, plus the random calls' own lookups
    with pytest.raises(ValueError, match="lookup_frac"):
        tw.world_examples(train[0], random.Random(0), 2, lookup_frac=1.5)


def test_world_example_lookups_leave_out_skipped_tools(train):
    for i, task in enumerate(train[:50]):
        assert tw.world_examples(task, random.Random(i), 4, lookup_frac=0.5) == \
            tw.world_examples(task, random.Random(i), 4, lookup_frac=0.5, skip_lookups={"buy"})   # same stream
        msgs = tw.world_examples(task, random.Random(i), 4, lookup_frac=1.0, skip_lookups={"get_price"})
        assert {m["tool_calls"][0]["function"]["name"] for m in msgs[len(task.messages)::2]} == {"get_balance"}
    with pytest.raises(ValueError, match="every lookup tool is skipped"):
        tw.world_examples(train[0], random.Random(0), 2, lookup_frac=0.5, skip_lookups=set(tw.LOOKUP_TOOLS))


# ----------------------------------------------------------------------------- checklist (--reward checklist)

def test_checklist_items_are_checked_against_ground_truth(train):
    rng = random.Random(0)
    for task in train[:400]:
        gold = traj_of(task)
        items = tw.checklist(task, gold)
        assert [name for name, _ in items][-2:] == ["final state", "answer"]
        assert len(items) == len(task.ground_truth["calls"]) + 2 and all(met for _, met in items)
        # a corrupted trajectory: every item met still means success (all met => score 1)
        calls = [ToolCall(c.name, dict(c.arguments)) for c in gold.calls]
        kind = rng.choice(["drop", "swap", "amount", "extra"])
        if kind == "drop":
            del calls[rng.randrange(len(calls))]
        elif kind == "swap" and len(calls) > 1:
            calls[0], calls[1] = calls[1], calls[0]
        elif kind == "amount":
            c = rng.choice(calls)
            key = next(iter(c.arguments))
            c.arguments[key] = c.arguments[key] + 1 if isinstance(c.arguments[key], int) else "zed"
        else:
            calls.append(ToolCall("transfer", {"src": state_names(task)[0], "dst": state_names(task)[1], "amount": 1}))
        bad = tw.Trajectory(task_id=task.id, messages=gold.messages, calls=calls, final_answer=gold.final_answer)
        if all(met for _, met in tw.checklist(task, bad)):
            assert tw.score(task, bad).reward == 1.0, (task.id, kind)


def test_checklist_by_hand():
    chain = next(t for t in tw.load_tasks("train", limit=64) if t.metadata["family"] == "chain")
    gold = traj_of(chain)
    # the second call (a transfer) missing: its item, the final state; the others are still in order
    missing = tw.Trajectory(task_id=chain.id, messages=gold.messages, calls=gold.calls[:1] + gold.calls[2:],
                            final_answer=gold.final_answer)
    assert [met for _, met in tw.checklist(chain, missing)] == [True, False, True, True, False, True]
    # order matters: the calls reversed meet only one gold call (the transfers commute: same final state)
    rev = tw.Trajectory(task_id=chain.id, messages=gold.messages, calls=gold.calls[::-1], final_answer="nothing")
    assert [met for _, met in tw.checklist(chain, rev)] == [True, False, False, False, True, False]
    # rehearsed observations neither earn nor lose an item
    made_up = copy.deepcopy(gold)
    made_up.observations = ['{"balance": 999}'] * len(gold.calls)
    made_up.rehearsed = [True] * len(gold.calls)
    assert tw.checklist(chain, made_up) == tw.checklist(chain, gold)
    assert tw.checklist(chain, tw.Trajectory(task_id=chain.id, messages=[], calls=[], final_answer="")) == [
        (name, False) for name, _ in tw.checklist(chain, gold)]


def test_costly_families_fail_on_an_errored_call_or_an_extra_write_that_classic_ones_forgive():
    from bench import Trajectory, ToolCall
    tasks = tw.load_tasks("test", limit=60, families="costly")
    assert {t.metadata["family"] for t in tasks} == set(tw.COSTLY_FAMILIES) and all(t.metadata["strict"] for t in tasks)
    assert tw.load_tasks("test", limit=16) == tw.load_tasks("test", limit=16, families="classic")   # default kept

    def traj(task, calls):
        env = tw.make_env(task)
        calls = [ToolCall(n, a) for n, a in calls]
        return Trajectory(task_id=task.id, messages=[], calls=calls, observations=[env.step(c.name, c.arguments)
                                                                              for c in calls],
                          final_answer=task.ground_truth["answer_text"])
    seen = set()
    for task in tasks:
        gold = [(g["name"], g["arguments"]) for g in task.ground_truth["calls"]]
        assert tw.score(task, traj(task, gold)).reward == 1.0
        assert all(ok for _, ok in tw.checklist(task, traj(task, gold)))
        fam = task.metadata["family"]
        # an errored call first (a purchase that cannot be paid), then the gold calls: the same final state
        w = task.metadata["world"]
        item = next(iter(w["prices"]))
        too_much = ("buy", {"account": next(iter(w["balances"])), "item": item, "qty": w["stock"][item] + 1})
        bad = traj(task, [too_much] + gold)
        s = tw.score(task, bad)
        assert s.components["state_correct"] == 1.0 and s.components["no_costly_mistake"] == 0.0 and s.reward == 0
        assert ("no failed call, no extra write", False) in tw.checklist(task, bad)
        seen.add(fam)
        if fam == "topup_buy":    # the quantity the balance before the top-up affords is wrong
            q = gold[2][1]["qty"]
            assert q > w["balances"][gold[2][1]["account"]] // w["prices"][gold[2][1]["item"]]
    assert seen == set(tw.COSTLY_FAMILIES)
    # a classic task forgives the same errored call
    classic = tw.load_tasks("test", limit=8)[5]            # afford
    gold = [(g["name"], g["arguments"]) for g in classic.ground_truth["calls"]]
    w = classic.metadata["world"]
    item = next(iter(w["prices"]))
    extra = ("buy", {"account": next(iter(w["balances"])), "item": item, "qty": w["stock"][item] + 1})
    assert classic.metadata["family"] == "afford" and tw.score(classic, traj(classic, [extra] + gold)).reward == 1.0
    with pytest.raises(ValueError, match="choose from"):
        tw.load_tasks("test", limit=2, families="costlyy")

"""BFCL-v4 on bfcl-eval 2026.3.23: loading, environments, and BFCL's own scoring (ground truth replays, corruptions)."""
import copy
import importlib.util
import sys

import pytest

from bench import BenchUnavailable, ToolCall, Trajectory

HAVE_BFCL = importlib.util.find_spec("bfcl_eval") is not None
needs_bfcl = pytest.mark.skipif(not HAVE_BFCL, reason="bfcl-eval not installed: "
                                "pip install --no-deps bfcl-eval==2026.3.23 mpmath==1.3.0")

from bench import bfcl  # noqa: E402  (the module itself imports nothing from bfcl_eval at import time)

EXPECTED_COUNTS = {
    "simple_python": 400, "simple_java": 100, "simple_javascript": 50, "multiple": 200, "parallel": 200,
    "parallel_multiple": 200, "live_simple": 258, "live_multiple": 1053, "live_parallel": 16,
    "live_parallel_multiple": 24, "irrelevance": 240, "live_irrelevance": 884, "live_relevance": 16,
    "multi_turn_base": 200, "multi_turn_miss_func": 200, "multi_turn_miss_param": 200, "multi_turn_long_context": 200,
}
AST = bfcl.AST_CATEGORIES
MT = bfcl.MULTI_TURN_CATEGORIES


@pytest.fixture(scope="module")
def all_tasks():
    tasks = bfcl.load_tasks("test")
    by = {}
    for t in tasks:
        by.setdefault(t.metadata["category"], []).append(t)
    return by


def traj(task, calls, observations=None):
    return Trajectory(task_id=task.id, messages=list(task.messages), calls=calls,
                      observations=observations or [], rehearsed=[True] * len(observations or []))


# ---------------------------------------------------------------------------------------------------------------
# loading


@needs_bfcl
def test_counts_per_category(all_tasks):
    assert {c: len(ts) for c, ts in all_tasks.items()} == EXPECTED_COUNTS
    assert [t.metadata["category"] for t in bfcl.load_tasks("live_parallel,irrelevance", limit=3)] == \
        ["live_parallel"] * 3 + ["irrelevance"] * 3
    assert {t.metadata["category"] for t in bfcl.load_tasks("x", categories=["simple_java"], limit=2)} == {"simple_java"}
    assert len(bfcl.load_tasks("multi_turn", limit=5)) == 20


@needs_bfcl
def test_task_shape_and_schemas(all_tasks):
    json_types = {"string", "integer", "number", "boolean", "array", "object"}

    def walk(s):
        assert s["type"] in json_types, s
        for v in s.get("properties", {}).values():
            walk(v)
        if "items" in s:
            walk(s["items"])

    for cat, ts in all_tasks.items():
        for t in ts:
            assert t.messages[0]["role"] == "system" and t.messages[-1]["role"] == "user"
            assert t.tools or cat == "live_irrelevance"   # a few live_irrelevance questions come with no function
            assert all(x["type"] == "function" for x in t.tools)
            for tool in t.tools:
                f = tool["function"]
                assert f["parameters"]["type"] == "object"
                walk(f["parameters"])
                if cat in ("simple_java", "simple_javascript"):   # BFCL FC: Java/JS values travel as strings
                    assert all(p["type"] == "string" for p in f["parameters"]["properties"].values())
            assert t.max_assistant_turns == (None if cat in MT else 1)
    t = all_tasks["simple_python"][0]
    assert t.tools[0]["function"]["description"].endswith("Note that the provided function is in Python 3 syntax.")
    assert bfcl.load_tasks("simple_python", limit=1, system_prompt=None)[0].messages[0]["role"] == "user"
    # BFCL's own types map to JSON schema
    doc = {"name": "f.g", "description": "d", "parameters": {"type": "dict", "required": ["a"], "properties": {
        "a": {"type": "float", "description": ""}, "b": {"type": "tuple", "items": {"type": "integer"}},
        "c": {"type": "dict", "properties": {"x": {"type": "any"}}}, "d": {"type": "array", "items": {"type": "dict"}}}}}
    out = bfcl.to_tool(doc, "simple_python")["function"]
    p = out["parameters"]["properties"]
    assert (out["name"], p["a"]["type"], p["b"]["type"], p["b"]["items"]["type"], p["c"]["type"],
            p["c"]["properties"]["x"]["type"], p["d"]["items"]["type"]) == \
        ("f.g", "number", "array", "integer", "object", "string", "object")
    assert bfcl.to_tool(doc, "simple_python", underscore_names=True)["function"]["name"] == "f_g"


def test_unknown_category_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        bfcl.load_tasks("simple_cobol")
    assert "simple_python" in str(e.value) and "multi_turn_base" in str(e.value)
    with pytest.raises(ValueError):
        bfcl.load_tasks("test", categories=["multi_turn_base", "nope"])


@pytest.mark.parametrize("cat", ["web_search_base", "web_search_no_snippet", "memory_kv", "memory_vector",
                                 "memory_rec_sum", "format_sensitivity", "web_search", "memory"])
def test_online_categories_say_why(cat):
    with pytest.raises(BenchUnavailable) as e:
        bfcl.load_tasks(cat)
    assert "offline" in str(e.value) and ("web" in str(e.value) or "memory" in str(e.value)
                                          or "prompt" in str(e.value))


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bfcl_eval", None)   # makes `import bfcl_eval` raise ImportError
    with pytest.raises(BenchUnavailable) as e:
        bfcl.load_tasks("simple_python")
    assert "pip install --no-deps bfcl-eval==2026.3.23" in str(e.value)


@needs_bfcl
def test_checker_import_leaves_no_stand_in():
    bfcl._ast_checker()
    mod = sys.modules.get("bfcl_eval.constants.model_config")
    assert mod is None or hasattr(mod, "__file__")   # either absent or the real one, never our stand-in


# ---------------------------------------------------------------------------------------------------------------
# ground truth replays: every task of every offline category


@needs_bfcl
@pytest.mark.parametrize("cat", AST)
def test_ground_truth_replay_ast(all_tasks, cat):
    for t in all_tasks[cat]:
        s = bfcl.score(t, traj(t, bfcl.reference_calls(t)))
        if t.id in bfcl.UNREACHABLE_GROUND_TRUTH:   # BFCL data errors: no output passes BFCL's checker
            assert s.reward == 0.0, t.id
        else:
            assert s.reward == 1.0 and s.components["valid"] and s.components["error_type"] is None, \
                (t.id, s.components)
            assert s.components["category"] == cat


@needs_bfcl
def test_underscore_names_score_like_bfcl_api_fc():
    tasks = [t for t in bfcl.load_tasks("simple_python,parallel_multiple", underscore_names=True)
             if any("." in f["name"] for f in t.metadata["functions"])][:40]
    assert tasks
    for t in tasks:
        assert not any("." in x["function"]["name"] for x in t.tools)
        calls = bfcl.reference_calls(t)
        assert bfcl.score(t, traj(t, calls)).reward == 1.0, t.id
        dotted = [ToolCall(next(f["name"] for f in t.metadata["functions"] if f["name"].replace(".", "_") == c.name),
                           c.arguments) for c in calls]
        assert bfcl.score(t, traj(t, dotted)).reward == 0.0 or dotted == calls


@needs_bfcl
def test_relevance_semantics(all_tasks):
    for cat in ("irrelevance", "live_irrelevance"):
        for t in all_tasks[cat]:
            assert bfcl.score(t, traj(t, [])).reward == 1.0
        t = all_tasks[cat][0]
        s = bfcl.score(t, traj(t, [ToolCall(t.tools[0]["function"]["name"], {})]))
        assert s.reward == 0.0 and s.components["error_type"] == "irrelevance_error:decoder_success"
    for t in all_tasks["live_relevance"]:
        assert bfcl.score(t, traj(t, [ToolCall(t.tools[0]["function"]["name"], {})])).reward == 1.0
        s = bfcl.score(t, traj(t, []))
        assert s.reward == 0.0 and s.components["error_type"] == "relevance_error:decoder_failed"


@needs_bfcl
@pytest.mark.parametrize("cat", MT)
def test_ground_truth_replay_multi_turn(all_tasks, cat):
    """The whole set; the trajectory carries real observations from our Env, which must equal BFCL's executor."""
    _, utils = bfcl._multi_turn()
    for i, t in enumerate(all_tasks[cat]):
        tr = bfcl.ground_truth_trajectory(t, with_observations=True)
        s = bfcl.score(t, tr)
        assert s.reward == 1.0, (t.id, s.components)
        if i < 20:
            name = "testenvace" + str(i)
            want = []
            for calls in t.ground_truth:
                r, _ = utils.execute_multi_turn_func_call(calls, t.metadata["initial_config"],
                                                          t.metadata["involved_classes"], name, t.id,
                                                          long_context=t.metadata["long_context"])
                want += r
            for k in [k for k in vars(utils) if k.startswith(name)]:
                del vars(utils)[k]
            assert tr.observations == want, t.id
    assert not [k for k in vars(utils) if k.startswith("envace")]   # score cleans the package's instance cache


@needs_bfcl
def test_observations_do_not_matter(all_tasks):
    """Rehearsal: score replays the calls and ignores whatever the policy wrote as observations."""
    t = all_tasks["multi_turn_base"][0]
    calls = bfcl.reference_calls(t)
    assert bfcl.score(t, traj(t, calls, ["made up"] * len(calls))).reward == 1.0


# ---------------------------------------------------------------------------------------------------------------
# corrupted trajectories score 0


def _wrong(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 7919
    if isinstance(v, str):
        return "zzwrong_" + v
    if isinstance(v, list):
        return v + ["zzwrong"]
    return "zzwrong"


@needs_bfcl
@pytest.mark.parametrize("cat", AST)
def test_corrupted_ast_calls_fail(all_tasks, cat):
    for t in [t for t in all_tasks[cat] if t.id not in bfcl.UNREACHABLE_GROUND_TRUTH][:20]:
        calls = bfcl.reference_calls(t)
        # wrong value of a required argument
        funcs = {f["name"]: f for f in t.metadata["functions"]}
        for i, c in enumerate(calls):
            req = [k for k in funcs[c.name]["parameters"].get("required", []) if k in c.arguments]
            if req:
                bad = copy.deepcopy(calls)
                bad[i].arguments[req[0]] = _wrong(bad[i].arguments[req[0]])
                assert bfcl.score(t, traj(t, bad)).reward == 0.0, (t.id, bad[i])
                break
        # a missing call, a wrong function, an extra call
        assert bfcl.score(t, traj(t, calls[:-1])).reward == 0.0
        wrong_name = copy.deepcopy(calls)
        wrong_name[0].name = wrong_name[0].name + "_x"
        assert bfcl.score(t, traj(t, wrong_name)).reward == 0.0
        assert bfcl.score(t, traj(t, calls + calls[:1])).reward == 0.0


@needs_bfcl
@pytest.mark.parametrize("cat", MT)
def test_corrupted_multi_turn_calls_fail(all_tasks, cat):
    for t in all_tasks[cat][:20]:
        calls = bfcl.reference_calls(t)
        i = max(i for i, c in enumerate(calls) if c.arguments)
        bad = copy.deepcopy(calls)
        k = next(iter(bad[i].arguments))
        bad[i].arguments[k] = _wrong(bad[i].arguments[k])
        s = bfcl.score(t, traj(t, bad))
        assert s.reward == 0.0 and s.components["error_type"].startswith("multi_turn:"), t.id
        assert bfcl.score(t, traj(t, calls[:-1])).reward == 0.0, t.id
        wrong = copy.deepcopy(calls)
        wrong[-1].name = "not_a_function"
        assert bfcl.score(t, traj(t, wrong)).reward == 0.0, t.id
        # all calls in turn 0 (answering the wrong user turns) fails too
        flat = [ToolCall(c.name, c.arguments, 0, 0) for c in calls]
        assert bfcl.score(t, traj(t, flat)).reward == 0.0, t.id


@needs_bfcl
def test_force_termination_and_turn_range(all_tasks):
    t = all_tasks["multi_turn_base"][0]
    calls = bfcl.reference_calls(t)
    spam = [ToolCall("pwd", {}, turn=100 + k, user_turn=0) for k in range(bfcl.MAX_STEPS_PER_TURN + 1)]
    s = bfcl.score(t, traj(t, spam + calls))
    assert s.reward == 0.0 and s.components["error_type"] == "multi_turn:force_terminated"
    s = bfcl.score(t, traj(t, calls + [ToolCall("pwd", {}, 99, 99)]))
    assert s.reward == 0.0 and s.components["error_type"] == "multi_turn:turn_out_of_range"



def _last_turn_padded(t, n_steps: int, gold_first: bool = False):
    """The reference calls with read-only `pwd()` steps added to the last user turn, so that it has n_steps
    calling steps; the gold steps of that turn come after the padding, or before it with gold_first."""
    calls = bfcl.reference_calls(t)
    last = t.metadata["num_user_turns"] - 1
    gold = [c for c in calls if c.user_turn == last]
    pad = [ToolCall("pwd", {}, turn=1000 + k, user_turn=last) for k in range(n_steps - len({c.turn for c in gold}))]
    head = [c for c in calls if c.user_turn != last]
    return head + (gold + pad if gold_first else pad + gold)


@needs_bfcl
def test_force_quit_in_last_turn_scores_as_the_leaderboard(all_tasks):
    """BFCL's inference loop appends the last turn's 21 steps before it force-quits, so eval_runner's turn-count
    check does not fire and multi_turn_checker decides; the leaderboard passes such an entry."""
    checker, utils = bfcl._multi_turn()
    from bfcl_eval.constants.default_prompts import MAXIMUM_STEP_LIMIT
    assert bfcl.MAX_STEPS_PER_TURN == MAXIMUM_STEP_LIMIT
    t = all_tasks["multi_turn_base"][0]
    calls = _last_turn_padded(t, MAXIMUM_STEP_LIMIT + 1)
    turns, err = bfcl.decoded_turns(t, traj(t, calls))
    assert err is None and len(turns[-1]) == MAXIMUM_STEP_LIMIT + 1 and len(turns) == len(t.ground_truth)
    entry = {"id": t.id, "initial_config": copy.deepcopy(t.metadata["initial_config"]),
             "involved_classes": list(t.metadata["involved_classes"])}
    official = checker.multi_turn_checker(turns, copy.deepcopy(t.ground_truth), entry, "multi_turn_base",
                                          "envace_oracle")
    for key in [k for k in vars(utils) if k.startswith("envace_oracle")]:
        del vars(utils)[key]
    assert official["valid"] is True
    s = bfcl.score(t, traj(t, calls))
    assert s.reward == 1.0 and s.components["valid"] is True, s.components
    # steps past the 21st would never be generated by BFCL's loop: gold calls there do not count
    late = _last_turn_padded(t, MAXIMUM_STEP_LIMIT + 3)
    if any(c.user_turn == t.metadata["num_user_turns"] - 1 for c in bfcl.reference_calls(t)):
        s = bfcl.score(t, traj(t, late))
        assert s.reward == 0.0 and s.components["error_type"] != "multi_turn:force_terminated"
    assert bfcl.score(t, traj(t, _last_turn_padded(t, MAXIMUM_STEP_LIMIT + 3, gold_first=True))).reward == 1.0

# ---------------------------------------------------------------------------------------------------------------
# environments: errors become observations, bad calls are scored, envs are independent


@needs_bfcl
def test_single_turn_env_records_and_reports(all_tasks):
    t = all_tasks["simple_python"][0]
    env = bfcl.make_env(t)
    name = t.tools[0]["function"]["name"]
    good = bfcl.reference_calls(t)[0]
    assert env.step(good.name, good.arguments).startswith("recorded")
    assert "unknown function" in env.step("nope", {})
    props = t.tools[0]["function"]["parameters"]["properties"]
    k = next(iter(props))
    assert "should be" in env.step(name, {**good.arguments, k: {"a": [1]}})
    assert "must be a JSON object" in env.step(name, "not a dict")
    assert env.user_turn("done") is None
    assert len(env.calls) == 3
    # such calls are scored, not crashed on
    for calls in ([ToolCall("nope", {})], [ToolCall(name, {k: {"a": [1]}})], [ToolCall(name, {"zz": 1})]):
        assert bfcl.score(t, traj(t, calls)).reward == 0.0
    tj = all_tasks["simple_java"][0]
    assert bfcl.score(tj, traj(tj, [ToolCall(tj.tools[0]["function"]["name"], {"controller": 5, "parent": []})])
                      ).components["error_type"] == "type_error:java"


@needs_bfcl
def test_multi_turn_env_errors_are_observations(all_tasks, tmp_path):
    t = all_tasks["multi_turn_base"][0]
    env = bfcl.make_env(t)
    assert env.step("ls", {}).startswith("{")
    for name, args in [("cd", {"folder": 5}), ("cd", {"bad": 1}), ("nope", {}), ("cd", "x"), ("kill", {}),
                       (None, {}), ("cd", {"folder": ["a", {"b": None}]})]:
        out = env.step(name, args)
        assert isinstance(out, str) and out.startswith("Error during execution"), (name, args, out)
    # calls the checker would eval: never executed beyond the backends (no file appears), scored 0
    canary = tmp_path / "canary.txt"
    evil = [ToolCall("open", {"file": str(canary), "mode": "w"}),
            ToolCall("__import__('os').system", {}),
            ToolCall("cd", {"folder=__import__('os').getcwd(),x": 1}),
            ToolCall("cd", {"folder": object()})]
    for c in evil:
        s = bfcl.score(t, traj(t, [c] + bfcl.reference_calls(t)[1:]))
        assert s.reward == 0.0
        assert isinstance(env.step(c.name, c.arguments), str)
    assert not canary.exists()
    # arguments that would make MathAPI compute for minutes are refused, fast
    m = next(t for t in all_tasks["multi_turn_base"] if "MathAPI" in t.metadata["involved_classes"])
    menv = bfcl.make_env(m)
    assert "too large" in menv.step("power", {"base": 10, "exponent": 10**9})
    assert "too large" in menv.step("square_root", {"number": 2, "precision": 10**7})
    assert '"result": 8' in menv.step("power", {"base": 2, "exponent": 3})
    assert bfcl.score(m, traj(m, [ToolCall("logarithm", {"value": 2, "base": 10, "precision": 10**8})])).reward == 0


@needs_bfcl
def test_envs_are_independent(all_tasks):
    t = all_tasks["multi_turn_base"][0]
    a, b = bfcl.make_env(t), bfcl.make_env(t)
    assert a.step("mkdir", {"dir_name": "only_in_a"}) == "None"
    assert "only_in_a" in a.step("ls", {}) and "only_in_a" not in b.step("ls", {})
    # a used env does not leak into scoring either
    assert bfcl.score(t, traj(t, bfcl.reference_calls(t))).reward == 1.0
    c = bfcl.make_env(t)
    assert "only_in_a" not in c.step("ls", {})


@needs_bfcl
def test_user_turns_and_held_out_functions(all_tasks):
    t = all_tasks["multi_turn_base"][0]
    env = bfcl.make_env(t)
    turns = t.metadata["turns"]
    got = [env.user_turn("ok") for _ in range(len(turns))]
    assert got[:-1] == [m[0]["content"] for m in turns[1:]] and got[-1] is None
    for t in all_tasks["multi_turn_miss_func"][:20]:
        (turn, names), = {k: [f["name"] for f in v] for k, v in t.metadata["held_out_functions"].items()}.items()
        assert not set(names) & {x["function"]["name"] for x in t.tools}
        env = bfcl.make_env(t)
        n0 = len(env.tools)
        for u in range(1, len(t.metadata["turns"])):
            msg = env.user_turn("")
            if u == int(turn):
                assert bfcl.ADDED_FUNCTIONS_MESSAGE in msg and all(n in msg for n in names)
                assert len(env.tools) == n0 + len(names)
            else:
                assert msg == t.metadata["turns"][u][0]["content"]
        assert env.user_turn("") is None


@needs_bfcl
@pytest.mark.parametrize("cat", ["simple_python", "parallel", "multiple", "parallel_multiple", "simple_java",
                                 "irrelevance", "multi_turn_base"])
def test_checklist_items_are_the_gold_calls(all_tasks, cat):
    for t in [t for t in all_tasks[cat] if t.id not in bfcl.UNREACHABLE_GROUND_TRUTH][:10]:
        calls = bfcl.reference_calls(t)
        items = bfcl.checklist(t, traj(t, calls, ["made up"] * len(calls)))
        assert items and all(met for _, met in items), (t.id, items)
        if cat == "irrelevance":
            assert items == [("no call", True)]
            assert bfcl.checklist(t, traj(t, [ToolCall("f", {})])) == [("no call", False)]
            continue
        if len(t.ground_truth) == 1 and cat != "multi_turn_base":   # one item per argument, name, no extras
            _check_argument_items(t, calls[0])
            continue
        assert len(items) == len(calls)
        # the last gold call missing: only its item is unmet
        assert [met for _, met in bfcl.checklist(t, traj(t, calls[:-1]))] == [True] * (len(calls) - 1) + [False]
        # a wrong value of an argument: that call's item is unmet
        i = max(k for k, c in enumerate(calls) if c.arguments)
        bad = copy.deepcopy(calls)
        key = next(iter(bad[i].arguments))
        bad[i].arguments[key] = _wrong(bad[i].arguments[key])
        assert not bfcl.checklist(t, traj(t, bad))[i][1], (t.id, bad[i])
        if cat == "multi_turn_base":   # answering the wrong user turn earns nothing for the later turns
            flat = [ToolCall(c.name, c.arguments, 0, 0) for c in calls]
            assert [met for _, met in bfcl.checklist(t, traj(t, flat))] == [c.user_turn == 0 for c in calls]


def _check_argument_items(t, ref):
    (name, answer), = t.ground_truth[0].items()
    items = bfcl.checklist(t, traj(t, [ref]))
    assert [k for k, _ in items] == [f"call 1: {name}"] + [f"call 1: {name}.{k}" for k in answer] + \
        [f"call 1: {name}: no other arguments"]
    assert not any(met for _, met in bfcl.checklist(t, traj(t, [])))
    assert not any(met for _, met in bfcl.checklist(t, traj(t, [ToolCall(ref.name + "_x", ref.arguments)])))
    wrong_seen = 0
    for key in ref.arguments:   # a changed value: that argument's item alone follows the checker's verdict
        bad = copy.deepcopy(ref)
        bad.arguments[key] = _wrong(bad.arguments[key])
        valid = bfcl.score(t, traj(t, [bad])).reward == 1.0   # (Java's converter accepts some changed strings)
        met = [m for _, m in bfcl.checklist(t, traj(t, [bad]))]
        assert met == [valid or k != 1 + list(answer).index(key) for k in range(len(met))], (t.id, key, met)
        wrong_seen += not valid
    assert wrong_seen or not ref.arguments, t.id
    extra = copy.deepcopy(ref)
    extra.arguments["made_up_argument"] = 1
    assert [m for _, m in bfcl.checklist(t, traj(t, [extra]))] == [True] * (len(items) - 1) + [False]


@pytest.fixture(scope="module")
def long_context_micro(tmp_path_factory):
    """The tests' micro model with room for BFCL multi-turn prompts (positions to 32k; steered, so its random
    weights never choose a token)."""
    import dataclasses

    import policy
    from tests.conftest import MICRO
    path = policy.build_tiny(tmp_path_factory.mktemp("micro-long") / "model",
                             dataclasses.replace(MICRO, max_position_embeddings=32768))
    return policy.load_policy(str(path))


def _steered_reference(engine, task):
    """A Script whose row 0 writes the task's reference chat: each reference call as one assistant turn in the
    template's call text, then a closing text per user turn."""
    import json

    from tests.scripted import Script
    turns = []
    for m in bfcl.reference_messages(task)[len(task.messages):]:
        if m["role"] != "assistant":
            continue
        if m.get("tool_calls"):
            f = m["tool_calls"][0]["function"]
            turns.append([f"<tool_call>\n{json.dumps({'name': f['name'], 'arguments': f['arguments']})}\n</tool_call>"])
        else:
            turns.append([m["content"]])
    return Script(engine.tok, {0: turns})


@needs_bfcl
def test_a_miss_func_ground_truth_passes_end_to_end_through_the_rollout(long_context_micro):
    """The held-out function is revealed at a later user turn; the ground truth calls it. The engine parses
    that call against the tools revealed so far (the environment's list), so it is executed and BFCL's checker
    passes the entry."""
    import rollout
    model, tok = long_context_micro
    engine = rollout.Engine(model.eval(), tok)
    (task,) = bfcl.load_tasks("multi_turn_miss_func", ids="multi_turn_miss_func_1")
    held = {t["function"]["name"] for tools in task.metadata["held_out_tools"].values() for t in tools}
    assert held & {c.name for c in bfcl.reference_calls(task)} == {"mv"}
    cfg = rollout.SamplingConfig(greedy=True, max_new_tokens=96, max_turns=30, max_total_len=32768)
    ro = engine.run([task], 1, cfg, make_env=bfcl.make_env, responses="real", steer=_steered_reference(engine, task))
    traj = ro.trajectories[0]
    assert [c.name for c in traj.calls] == [c.name for c in bfcl.reference_calls(task)], traj.errors
    assert not [e for e in traj.errors if e.startswith("unknown_tool")]
    assert bfcl.score(task, traj).reward == 1.0


# ------------------------------------------- the raw text, decoded as BFCL's Qwen FC handler decodes it

def _raw_traj(task, *raws, user_turns=()):
    """A trajectory as the engine records it: each assistant turn's raw text in the hermes format."""
    msgs = list(task.messages)
    for k, raw in enumerate(raws):
        if k in user_turns:
            msgs.append({"role": "user", "content": "next"})
        msgs.append({"role": "assistant", "content": "", "raw": raw, "call_format": "hermes"})
    return Trajectory(task_id=task.id, messages=msgs)


def _call_text(name, arguments, key="arguments", newline=True):
    import json
    nl = "\n" if newline else ""
    return f"<tool_call>{nl}{json.dumps({'name': name, key: arguments})}{nl}</tool_call>"


@needs_bfcl
def test_raw_text_gets_bfcls_verdict_on_single_turn_tasks():
    """qwen_fc.py _extract_tool_calls keeps unknown names and calls missing arguments and drops what does not
    match <tool_call>\\n...\\n</tool_call> or is not JSON; decode_ast needs "arguments" as an object."""
    (t,) = bfcl.load_tasks("simple_python", limit=1)
    gt = bfcl.reference_calls(t)[0]
    good = _call_text(gt.name, gt.arguments)
    assert bfcl.score(t, _raw_traj(t, good)).reward == 1.0
    extra = good + "\n" + _call_text("made_up_function", {})
    assert bfcl.score(t, _raw_traj(t, extra)).components["error_type"] == "simple_function_checker:wrong_count"
    missing = _call_text(gt.name, {})                       # required arguments missing: judged, not dropped
    assert bfcl.score(t, _raw_traj(t, missing)).components["error_type"].startswith("simple_function_checker")
    for rejected in (_call_text(gt.name, gt.arguments, newline=False), _call_text(gt.name, gt.arguments, "parameters"),
                     good.replace(json_dumps(gt.arguments), json_dumps(json_dumps(gt.arguments)))):
        assert bfcl.score(t, _raw_traj(t, rejected)).reward == 0.0, rejected
    (irr,) = bfcl.load_tasks("irrelevance", limit=1)
    hallucinated = _call_text("made_up_function", {"x": 1})
    s = bfcl.score(irr, _raw_traj(irr, hallucinated))
    assert s.reward == 0.0 and s.components["error_type"] == "irrelevance_error:decoder_success"
    assert bfcl.score(irr, _raw_traj(irr, "I cannot help with that.")).reward == 1.0


def json_dumps(x):
    import json
    return json.dumps(x)


@needs_bfcl
def test_raw_steps_count_toward_force_termination_as_bfcl_counts_them():
    """base_handler.py inference_multi_turn_prompting: every decoded step counts (an unknown function too);
    more than 20 in a user turn that is not the last force-terminates the entry. A step that fails to decode
    ends the user turn: the steps after it never happen."""
    (t,) = bfcl.load_tasks("multi_turn_base", limit=1)
    unknown = _call_text("no_such_function", {"a": 1})
    steps = [unknown] * 21 + ["Done."]
    s = bfcl.score(t, _raw_traj(t, *steps, user_turns=()))
    assert s.components["error_type"] == "multi_turn:force_terminated", s.components
    raw = bfcl.raw_turns(t, _raw_traj(t, "not a call", unknown, unknown))
    assert bfcl.official_decoded_turns(t, raw)[0] == []    # ended at the undecodable first step
    raw = bfcl.raw_turns(t, _raw_traj(t, unknown, unknown))
    assert bfcl.official_decoded_turns(t, raw)[0] == [["no_such_function(a=1)"]] * 2


def _llama_traj(task, *raws):
    msgs = list(task.messages) + [{"role": "assistant", "content": "", "raw": r, "call_format": "llama3_json"}
                                  for r in raws]
    return Trajectory(task_id=task.id, messages=msgs)


@needs_bfcl
def test_llama3_json_raw_text_is_decoded_by_bfcls_llama_handler_and_never_run(tmp_path):
    """llama3_json turns are scored from their raw text through BFCL's LlamaHandler_3_1 decoder: a Python list
    of calls (which the engine's parser reads as an answer) passes as in BFCL, "arguments" for "parameters"
    fails as in BFCL, and an expression is refused instead of evaluated."""
    import json
    (t,) = bfcl.load_tasks("simple_python", limit=1)
    gt = bfcl.reference_calls(t)[0]
    call = json.dumps({"name": gt.name, "parameters": gt.arguments})
    assert bfcl.score(t, _llama_traj(t, "<|python_tag|>" + call)).reward == 1.0
    assert bfcl.score(t, _llama_traj(t, f"[{call}]")).reward == 1.0       # BFCL's list form
    wrong_key = json.dumps({"name": gt.name, "arguments": gt.arguments})
    assert bfcl.score(t, _llama_traj(t, wrong_key)).components["error_type"] == "ast_decoder:decoder_failed"
    marker = tmp_path / "ran"
    attack = f"__import__('pathlib').Path({str(marker)!r}).write_text('x')"
    assert bfcl.score(t, _llama_traj(t, attack)).components["error_type"] == "ast_decoder:decoder_failed"
    assert not marker.exists()
    from bfcl_eval.model_handler.local_inference import llama_3_1
    assert "eval" not in vars(llama_3_1)                                  # the module is left as it was
    (m,) = bfcl.load_tasks("multi_turn_base", limit=1)
    raw = bfcl.raw_turns(m, _llama_traj(m, "<|python_tag|>" + json.dumps({"name": "ls", "parameters": {}})))
    assert bfcl.official_decoded_turns(m, raw, "llama3_json")[0] == [["ls()"]]

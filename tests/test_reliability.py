"""Reliability: fuzzed model outputs and environment calls, kills and interrupts during training, non-finite
updates, bad flags and data, resource limits.

Every generator is seeded; the counts tried are printed (pytest -s) and summed up in the README.
"""
import contextlib
import copy
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import checkpoint
import diagnostics
import distributed
import grpo
import policy
import rehearse
import rollout
import train
import warm_start
from bench import ToolCall
from chat_format import CALL_ERRORS, REHEARSAL_DEFECTS, CallError, derive_chat_format, parse_turn, validate_rehearsal
from tests.scripted import run_train

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def deadline(seconds, what):
    """Fail (instead of hanging) if the block runs longer than `seconds` (main thread, SIGALRM)."""
    def boom(signum, frame):
        raise TimeoutError(f"{what} took more than {seconds}s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ==========================================================================================================
# Model output fuzzing: the tool-call parser

def _fn(name, required=(), **props):
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": list(required)}}}


TOOLS = [_fn("get_balance", ["account"], account="string"),
         _fn("transfer", ["src", "dst", "amount"], src="string", dst="string", amount="integer"),
         _fn("ping"),
         _fn("查询", ["q"], q="string", limit="integer")]
REQUIRED = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in TOOLS}
TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
ALPHABET = "abcXYZ019 _-.,:;'\"\\/{}[]()\n\t€é中文🙂\u200b\x00\x7f"


def rand_text(r, n=None, tags=False):
    """Free text; never a tag unless `tags` (so expectations stay exact)."""
    n = r.randint(0, 30) if n is None else n
    s = "".join(r.choice(ALPHABET) for _ in range(n))
    if tags:
        return s
    for t in TAGS:
        s = s.replace(t, "")
    return s.replace("<", "(")


def rand_value(r, depth=0):
    kind = r.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return r.random() < 0.5
    if kind == 2:
        return r.choice([0, -1, 7, 2 ** 63, -(10 ** 30), r.randint(-10 ** 6, 10 ** 6)])
    if kind == 3:
        return r.choice([0.5, -1e-300, 1e300, 3.141592653589793, r.uniform(-1e6, 1e6)])
    if kind in (4, 5):
        return rand_text(r)
    if kind == 6:
        return [rand_value(r, depth + 1) for _ in range(r.randint(0, 4))]
    return {rand_text(r, r.randint(0, 6)): rand_value(r, depth + 1) for _ in range(r.randint(0, 4))}


def canon(x):
    """Type-exact comparison key (1, 1.0 and True differ)."""
    return json.dumps(x, sort_keys=True, ensure_ascii=True)


def dump(r, obj):
    seps = r.choice([(",", ":"), (", ", ": "), (" ,", " : ")])
    return json.dumps(obj, ensure_ascii=r.random() < 0.5, indent=r.choice([None, None, 1, 4]), separators=seps)


def good_call(r):
    """(name, arguments, JSON body) of a well-formed call in one of the accepted spellings."""
    name = r.choice(list(REQUIRED))
    args = {k: rand_value(r) for k in REQUIRED[name]}
    for _ in range(r.randint(0, 3)):
        args[rand_text(r, r.randint(1, 8))] = rand_value(r)
    style = r.randrange(4)
    if style == 0:
        body = {"name": name, "arguments": args}
    elif style == 1:
        body = {"name": name, "arguments": json.dumps(args, ensure_ascii=r.random() < 0.5)}   # OpenAI style
    elif style == 2:
        body = {"name": name, "parameters": args}
    else:
        body = {"arguments": args, "name": name, "id": "call_1"}
    if not args and not REQUIRED[name] and r.random() < 0.3:
        body = {"name": name}
    return name, args, dump(r, body)


def wrap(body, r):
    ws = lambda: r.choice(["", "\n", " ", "\n\n", "\t"])  # noqa: E731
    return f"<tool_call>{ws()}{body}{ws()}</tool_call>"


def bad_call(r):
    """(expected CallError kinds, tag-wrapped text[, text left over as content]) of one malformed call."""
    name, args, body = good_call(r)
    k = r.randrange(16)
    if k == 0:      # truncated JSON
        compact = json.dumps({"name": name, "arguments": args})
        return {"malformed_json"}, wrap(compact[:r.randrange(1, len(compact))], r)
    if k == 1:      # random bytes
        junk = bytes(r.randrange(256) for _ in range(r.randint(1, 60))).decode("latin-1")
        junk = junk.replace("<", "(")
        return {"malformed_json", "not_an_object"}, wrap(junk, r)
    if k == 2:      # a JSON value that is not an object
        return {"not_an_object"}, wrap(json.dumps(r.choice([[1, 2], "get_balance", 3, None, True, [{"name": name}]])), r)
    if k == 3:      # no name / a name that is not a non-empty string
        obj = {"arguments": args} if r.random() < 0.5 else {"name": r.choice([None, 3, ["get_balance"], "", {}]),
                                                             "arguments": args}
        return {"missing_name"}, wrap(json.dumps(obj), r)
    if k == 4:      # arguments of the wrong type
        bad = r.choice([[1], 3, True, "not json {", json.dumps([1, 2]), json.dumps("x"), None, 1.5])
        return {"bad_arguments"}, wrap(json.dumps({"name": name, "arguments": bad}), r)
    if k == 5:      # a tool that does not exist (near misses included)
        other = r.choice(["Get_balance", "get_balance ", "get-balance", "transfer2", "查", "rm -rf", rand_text(r, 5) + "x"])
        return {"unknown_tool"}, wrap(json.dumps({"name": other, "arguments": args}), r)
    if k == 6:      # a required argument left out
        name = r.choice(["get_balance", "transfer", "查询"])
        args = {p: 1 for p in REQUIRED[name][:-1]}
        return {"missing_arguments"}, wrap(json.dumps({"name": name, "arguments": args}), r)
    if k == 7:      # duplicate keys: which one did the model mean?
        if r.random() < 0.5:
            text = '{"name": "ping", "name": "get_balance", "arguments": {"account": "a"}}'
        else:
            text = '{"name": "get_balance", "arguments": {"account": "a", "account": "b"}}'
        return {"malformed_json"}, wrap(text, r)
    if k == 8:      # Python's non-JSON numbers
        lit = r.choice(["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
        return {"malformed_json"}, wrap('{"name": "transfer", "arguments": {"src": "a", "dst": "b", "amount": %s}}' % lit, r)
    if k == 9:      # nesting far deeper than any decoder's recursion
        n = r.choice([2000, 50000])
        return {"malformed_json"}, wrap('{"name": "ping", "arguments": {"x": ' + "[" * n + "]" * n + "}}", r)
    if k == 10:     # an unpaired surrogate escape (not Unicode; echoed back it breaks the tokenizer)
        return {"malformed_json"}, wrap('{"name": "get_balance", "arguments": {"account": "a\\udc80"}}', r)
    if k == 11:     # an integer past Python's int-string limit
        return {"malformed_json"}, wrap('{"name": "transfer", "arguments": {"src": "a", "dst": "b", "amount": %s}}'
                                        % ("9" * 5000), r)
    if k == 12:     # two calls in one tag
        return {"malformed_json"}, wrap(body + body, r)
    if k == 13:     # the closing tag inside a string value cuts the call short
        return {"malformed_json"}, '<tool_call>{"name": "get_balance", "arguments": {"account": "x</tool_call>"}}', '"}}'
    if k == 14:     # arguments given as a JSON string that is itself malformed / not an object
        return {"bad_arguments"}, wrap(json.dumps({"name": name, "arguments": r.choice(['{"a": ', "[]", "NaN", "1"])}), r)
    return {"malformed_json"}, wrap("", r)   # empty


def gen_turn(r):
    """A generated assistant turn and what the parser must make of it: [(kind set | (name, args))], content."""
    expect, parts, content = [], [], []
    if r.random() < 0.3:   # thinking, with a call inside that must be ignored
        _, _, body = good_call(r)
        parts.append(f"<think>{rand_text(r)}{wrap(body, r)}{rand_text(r)}</think>")
    for _ in range(r.randint(0, 4)):
        t = rand_text(r)
        parts.append(t)
        content.append(t)
        if r.random() < 0.5:
            name, args, body = good_call(r)
            parts.append(wrap(body, r))
            expect.append((name, args))
        else:
            kinds, text, *extra = bad_call(r)
            parts.append(text)
            expect.append(kinds)
            content += extra
    tail = rand_text(r) + r.choice(["", " Final answer: 42. <|im_end|> more text after the answer", "\x00"])
    parts.append(tail)
    content.append(tail)
    return "".join(parts), expect, "".join(content).strip()


def check_items(items, tools):
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    for it in items:
        assert isinstance(it, (ToolCall, CallError)), it
        if isinstance(it, CallError):
            assert it.kind in CALL_ERRORS and it.message
            json.loads(it.observation())
        else:
            assert it.name in by_name and isinstance(it.arguments, dict)
            assert all(p in it.arguments for p in by_name[it.name]["parameters"].get("required", []))


def test_parser_on_generated_turns_round_trips_and_types_every_error():
    r = random.Random(1234)
    n_turns = n_good = n_bad = 0
    t0 = time.perf_counter()
    with deadline(30, "parsing the generated turns"):
        for _ in range(2500):
            text, expect, content = gen_turn(r)
            parsed = parse_turn(text, TOOLS)
            check_items(parsed.items, TOOLS)
            assert len(parsed.items) == len(expect), (text, parsed.items)
            for got, want in zip(parsed.items, expect):
                if isinstance(want, tuple):            # well-formed: exactly its name and arguments
                    assert isinstance(got, ToolCall), (text, got)
                    assert got.name == want[0] and canon(got.arguments) == canon(want[1]), (text, got)
                    n_good += 1
                else:
                    assert isinstance(got, CallError) and got.kind in want, (text, got)
                    n_bad += 1
            assert parsed.content == content, text
            n_turns += 1
    print(f"\nparser: {n_turns} turns, {n_good} well-formed calls round-tripped, {n_bad} malformed calls typed, "
          f"{time.perf_counter() - t0:.1f}s")


_OLD_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OLD_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def test_parser_on_random_soup_is_total_and_never_invents_a_call():
    """Random bytes, unicode and tag fragments: typed items only, and every ToolCall is literally in the text."""
    r = random.Random(99)
    frags = list(TAGS) + ['{"name": "ping"}', '{"name": "get_balance", "arguments": {"account": "a"}}',
                          '{"name": ', '"arguments": {', "}", "{", '"', "\\", "\n", "<|im_end|>", "NaN"]
    n = 0
    with deadline(20, "parsing random soup"):
        for i in range(2000):
            if i % 4 == 0:
                text = bytes(r.randrange(256) for _ in range(r.randint(0, 300))).decode("utf-8", errors="replace")
            elif i % 4 == 1:
                text = "".join(chr(r.choice([r.randrange(32, 127), r.randrange(0x80, 0x2FFF), r.randrange(0x1F300, 0x1F6FF)]))
                               for _ in range(r.randint(0, 200)))
            else:
                text = "".join(r.choice(frags) if r.random() < 0.6 else rand_text(r, 5, tags=True)
                               for _ in range(r.randint(0, 40)))
            parsed = parse_turn(text, TOOLS)
            check_items(parsed.items, TOOLS)
            segments = [m.group(1) for m in _OLD_CALL.finditer(_OLD_THINK.sub("", text))]
            for call in parsed.calls:
                found = False
                for seg in segments:
                    try:
                        obj = json.loads(seg)
                    except ValueError:
                        continue
                    if isinstance(obj, dict) and obj.get("name") == call.name:
                        a = obj.get("arguments", obj.get("parameters", {}))
                        a = json.loads(a) if isinstance(a, str) and a.strip() else ({} if isinstance(a, str) else a)
                        found = found or canon(a) == canon(call.arguments)
                assert found, (text, call)
            n += 1
    print(f"\nparser: {n} random-soup turns")


def test_parser_is_linear_on_degenerate_repetition():
    for piece in ("<tool_call>", "<think>", '<tool_call>{"name": ', "</tool_call>", "<think><tool_call>"):
        with deadline(2, f"parsing 20000 x {piece!r}"):
            parsed = parse_turn(piece * 20000, TOOLS)
        check_items(parsed.items, TOOLS)
    big = "x" * 2_000_000   # a huge argument is still a call, exactly
    parsed = parse_turn(wrap(json.dumps({"name": "get_balance", "arguments": {"account": big}}), random.Random(0)), TOOLS)
    assert parsed.calls[0].arguments == {"account": big}


def test_stray_closing_tag_between_calls_is_an_error_not_content():
    good = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    for text in (f"a</tool_call>b{good}", f"{good}x</tool_call>{good}", f"<tool_call><tool_call>{{}}</tool_call></tool_call>{good}"):
        parsed = parse_turn(text, TOOLS)
        assert "</tool_call>" not in parsed.content
        assert any(isinstance(i, CallError) and i.kind == "stray_close_tag" for i in parsed.items), parsed.items


# ----------------------------------------------------------------------------------------------------------
# The rehearsal validator

OBS_END = "\n</tool_response>"


def test_rehearsal_validator_on_generated_responses(micro64):
    r = random.Random(7)
    fmt = derive_chat_format(micro64[1])
    assert fmt.obs_end == OBS_END
    stop = fmt.world_stop
    n = 0
    with deadline(20, "validating generated rehearsals"):
        for i in range(2500):
            k = i % 6
            if k == 0:
                payload = json.dumps(rand_value(r), ensure_ascii=r.random() < 0.5)
            elif k == 1:
                s = json.dumps({"balance": rand_value(r)})
                payload = s[:r.randrange(1, len(s))]
            elif k == 2:
                payload = bytes(r.randrange(256) for _ in range(r.randint(0, 80))).decode("utf-8", "replace")
            elif k == 3:
                payload = "[" * r.choice([10, 5000, 100000])
            elif k == 4:
                payload = r.choice(["", " ", "\n\n", "NaN", '{"a": 1} trailing', '{"a": 1}{"b": 2}', "null"])
            else:
                payload = rand_text(r, 40, tags=True)
            payload = payload.replace(stop, "")
            terminated = r.random() < 0.7
            generated = payload + (OBS_END if terminated else "")
            text = fmt.rehearsed_text(generated, terminated)
            defects = validate_rehearsal(text, terminated)
            assert set(defects) <= set(REHEARSAL_DEFECTS)
            if terminated:
                assert text == payload, (generated, text)
            assert ("unterminated" in defects) == (not terminated)
            assert ("empty" in defects) == (not text.strip())
            try:
                json.loads(text)
                valid = True
            except (ValueError, RecursionError):
                valid = False
            assert ("invalid_json" in defects) == (bool(text.strip()) and not valid), text[:80]
            diagnostics.fidelity(text, '{"balance": 3}')      # the probe's comparison is total too
            n += 1
    print(f"\nrehearsal validator: {n} generated responses")


# ==========================================================================================================
# Benchmark environments: random-typed arguments never raise; tau² answers them as its own environment does

FINMCP_FIXTURE = ROOT / "tests" / "fixtures" / "finmcp_synthetic.json"


def _env_sets():
    from bench import finmcp, toyworld, vita
    sets = [("toyworld", toyworld.load_tasks("test", limit=4), toyworld.make_env),
            ("finmcp", finmcp.load_tasks("test", data=FINMCP_FIXTURE), finmcp.make_env)]
    if vita.DEFAULT_DATA.is_dir():
        sets.append(("vita", vita.load_tasks("test", domain="delivery", lang="en", limit=2)
                     + vita.load_tasks("test", domain="instore", limit=2), vita.make_env))
    if importlib.util.find_spec("bfcl_eval") is not None:
        from bench import bfcl
        sets.append(("bfcl", bfcl.load_tasks("test", limit=2, categories=["multi_turn_base", "multi_turn_long_context"]),
                     bfcl.make_env))
    if importlib.util.find_spec("tau2") is not None:
        from bench import tau2
        sets.append(("tau2", [tau2.load_tasks("test", domain=d, limit=1)[0] for d in tau2.DOMAINS], tau2.make_env))
    return sets


def _wrong_type(r, schema):
    """A value whose JSON type is not the parameter's."""
    kind = schema.get("type")
    pool = {"string": [[1], {"a": 1}, 3, True, 2.5], "integer": ["x", [1], {"a": 1}, 2.5, True],
            "number": ["x", [1], {}, True], "boolean": ["yes", [1], {}, 3], "array": ["x", 3, {"a": 1}, True],
            "object": ["x", 3, [1], True]}
    return r.choice(pool.get(kind, ["x", 3, [1], {}]))


def _tau2_official_answer(env, name, args) -> str | None:
    """What tau²'s own environment answers (its Orchestrator's path), None when tau² cannot represent the call."""
    from bench import tau2
    try:
        tc = tau2._tau2().msg.ToolCall(id="x", name=name, arguments=args, requestor="assistant")
    except Exception:
        return None
    return env.get_response(tc).content


def test_environments_turn_random_typed_arguments_into_error_observations():
    r = random.Random(5)
    counts = {}
    for label, tasks, make_env in _env_sets():
        n = 0
        for task in tasks:
            env = make_env(task)
            official = None
            if label == "tau2":   # a twin package environment that sees the same calls in the same order
                from bench import tau2
                official = tau2._fresh_env(tau2._tau2_task(task), task.metadata["domain"])
            for tool in task.tools + [_fn("no_such_tool_zz", ["x"], x="string")]:
                fn = tool["function"]
                props = fn["parameters"].get("properties") or {}
                cases = [{}, {rand_text(r, 6) or "k": rand_value(r)}]
                cases += [{k: rand_value(r) for k in props} for _ in range(6)]
                typed = [k for k, v in props.items() if v.get("type") in ("string", "integer", "number", "boolean",
                                                                         "array", "object")]
                wrong = []
                for k in typed:
                    a = {p: 1 for p in props}
                    a[k] = _wrong_type(r, props[k])
                    wrong.append(a)
                for args in cases + wrong:
                    with deadline(5, f"{label} {fn['name']}({args})"):
                        obs = env.step(fn["name"], copy.deepcopy(args))
                    assert isinstance(obs, str), (label, fn["name"], args, obs)
                    obs.encode("utf-8")      # the engine tokenizes it next
                    if official is not None:   # tau² answers wrong types as its tools do, not with our checks
                        want = _tau2_official_answer(official, fn["name"], copy.deepcopy(args))
                        assert obs == want or (want is None and obs.startswith("Error")), (fn["name"], args, obs)
                    n += 1
        counts[label] = n
    assert {"toyworld", "finmcp"} <= set(counts)
    print(f"\nenvironments: {counts} calls with random, missing, extra and wrong-typed arguments")


# ==========================================================================================================
# Crash safety: SIGKILL at random points, resume, compare with an uninterrupted run; Ctrl-C

def tiny_args(micro_path, out, sft=4, steps=2, extra=()):
    return ["--model", str(micro_path), "--out", str(out), "--sft-steps", str(sft), "--steps", str(steps),
            "--sft-batch", "4", "--tasks-per-step", "2", "--group-size", "2", "--max-new-tokens", "16",
            "--max-world-tokens", "8", "--max-turns", "2", "--lr", "1e-3", "--save-every", "1", "--no-require-update",
            *extra]


def metrics_of(run):
    lines = (Path(run) / "metrics.jsonl").read_text().splitlines() if (Path(run) / "metrics.jsonl").exists() else []
    return [json.loads(x) for x in lines]        # a torn line fails here


def check_checkpoints(run):
    """Every visible checkpoint is complete and loadable; `latest` names one; returns the latest step."""
    from safetensors.torch import load_file
    steps = []
    for d in sorted((Path(run) / "ckpt").glob("step_*")):
        state = json.loads((d / "state.json").read_text())
        assert state["step"] == int(d.name.split("_")[1]), d
        json.loads((d / "config.json").read_text())
        load_file(str(d / "model.safetensors"))
        torch.load(d / "optim_rank0.pt", weights_only=False)
        steps.append(state["step"])
    if not (Path(run) / "latest").exists():
        return 0
    latest = checkpoint.latest_checkpoint(Path(run))
    step = json.loads((latest / "state.json").read_text())["step"]
    assert step in steps and step >= max(steps) - 1, (step, steps)   # at most the step being published
    return step


def spawn(args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_lines(run, n, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        try:
            if len((Path(run) / "metrics.jsonl").read_text().splitlines()) >= n:
                return True
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    return False


def test_sigkill_at_random_points_then_resume_matches_the_uninterrupted_run(micro_path, tmp_path):
    full, run = tmp_path / "full", tmp_path / "killed"
    total = 30   # long enough that a kill within 0.3 s of a new step always lands mid-run, even on a fast machine
    assert run_train(tiny_args(micro_path, full, sft=28, steps=2)).returncode == 0
    r = random.Random(2024)
    kills, killed_at = 0, []
    for _ in range(10):
        if kills == 3:
            break
        resume = (run / "latest").exists()
        before = len(metrics_of(run))
        proc = spawn(["--resume", str(run)] if resume else tiny_args(micro_path, run, sft=28, steps=2,
                                                                      extra=["--overwrite"]))
        # let this process reach training (its first new metrics line), then kill at a random moment
        wait_for_lines(run, (before if resume else 0) + 1 - (1 if resume and before >= total else 0), proc)
        time.sleep(r.uniform(0.0, 0.3))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait()
        proc.stdout.close(), proc.stderr.close()
        step = check_checkpoints(run)
        killed_at.append(step)
        recs = metrics_of(run)
        assert [x["step"] for x in recs] == list(range(len(recs))), [x["step"] for x in recs]
        assert len(recs) >= step
        if step >= total:
            break
    res = run_train(["--resume", str(run)])
    assert res.returncode == 0, res.stderr[-2000:]
    assert check_checkpoints(run) == total
    a, b = metrics_of(full), metrics_of(run)
    assert [x["step"] for x in b] == list(range(total))
    for ra, rb in zip(a, b):
        for key in ("loss", "reward_mean", "act_tokens", "world_tokens", "grad_norm", "tokens"):
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    from safetensors.torch import load_file
    pa = load_file(str(full / "ckpt" / f"step_{total:06d}" / "model.safetensors"))
    pb = load_file(str(run / "ckpt" / f"step_{total:06d}" / "model.safetensors"))
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=1e-6, rtol=0)
    assert kills >= 3
    print(f"\ncrash safety: {kills} SIGKILLs (latest checkpoint after each: {killed_at}), resumed to step {total}, params and metrics equal the uninterrupted run")


# Evaluation crash safety: SIGKILL at random moments, rerun the same command, compare with an uninterrupted run

def eval_argv(micro_path, out, extra=()):
    return [sys.executable, "evaluate.py", "--model", str(micro_path), "--limit", "16", "--compare", "0,1",
            "--max-new-tokens", "16", "--max-world-tokens", "8", "--max-turns", "3", "--max-rows", "3",
            "--out", str(out), *extra]


def without_timings(x):
    """A record or summary with its wall-clock and host-memory fields dropped (the rest is decided by the seeds)."""
    if isinstance(x, dict):
        return {k: without_timings(v) for k, v in x.items()
                if "second" not in k and k not in ("tokens_per_s", "batch_rows", "memory")}
    if isinstance(x, list):
        return [without_timings(v) for v in x]
    return x


def eval_records(out):
    recs = {}
    for f in sorted(Path(out).glob("trajectories_*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)                    # a torn line fails here
            key = (f.name, rec["task_id"], rec["trial"])
            assert key not in recs, f"{key} written twice"
            recs[key] = without_timings(rec)
    return recs


def test_evaluation_killed_at_random_moments_resumes_to_the_uninterrupted_result(micro_path, tmp_path):
    full, run = tmp_path / "full", tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    assert subprocess.run(eval_argv(micro_path, full), cwd=ROOT, env=env, capture_output=True,
                          timeout=300).returncode == 0
    r, kills = random.Random(7), 0
    for _ in range(12):
        before = sum(len(f.read_text().splitlines()) for f in run.glob("trajectories_*.jsonl"))
        proc = subprocess.Popen(eval_argv(micro_path, run), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        t0 = time.time()           # let it write at least one new trajectory, then kill at a random moment
        while proc.poll() is None and time.time() - t0 < 120 and sum(
                len(f.read_text().splitlines()) for f in run.glob("trajectories_*.jsonl")) <= before:
            time.sleep(0.02)
        time.sleep(r.uniform(0.0, 0.3))
        if proc.poll() is not None:
            break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        eval_records(run)          # whatever a kill left is whole lines, each (task, trial) once
        if kills == 3:
            break
    res = subprocess.run(eval_argv(micro_path, run), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert kills >= 2
    a, b = eval_records(full), eval_records(run)
    assert sorted(a) == sorted(b) and len(a) == 32
    for key in a:
        assert a[key] == b[key], key
    sa, sb = (without_timings(json.loads((d / "summary.json").read_text())) for d in (full, run))
    assert sa == sb
    # a changed config on the same --out is refused in one line, and loses nothing
    res = subprocess.run(eval_argv(micro_path, run, ["--seed", "1"]), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "another seed" in res.stderr, res.stderr
    assert eval_records(run) == b


def test_a_torn_last_trajectory_line_is_cut_and_the_rest_kept(tmp_path):
    import evaluate
    path = tmp_path / "trajectories_B0_parallel.jsonl"
    whole = [json.dumps({"task_id": f"t{i}", "trial": 0, "reward": i}) + "\n" for i in range(3)]
    path.write_text("".join(whole) + '{"task_id": "t3", "tri')
    done = evaluate.finished_records(path)
    assert sorted(done) == [("t0", 0), ("t1", 0), ("t2", 0)] and path.read_text() == "".join(whole)
    assert evaluate.finished_records(tmp_path / "none.jsonl") == {}


def test_metrics_log_on_resume_keeps_only_steps_the_checkpoint_holds(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i}) + "\n" for i in range(5)) + '{"step": 5, "lo')
    checkpoint.MetricsLog(path, keep_before_step=3).write({"step": 3})   # checkpoint step_3 = steps 0..2 done
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2, 3]


def test_ctrl_c_saves_a_checkpoint_at_the_step_reached_and_exits_0(micro_path, tmp_path):
    run = tmp_path / "int"
    proc = spawn(tiny_args(micro_path, run, sft=200, steps=1))
    assert wait_for_lines(run, 2, proc), "training did not start"
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "interrupt" in err
    recs = metrics_of(run)
    assert check_checkpoints(run) == len(recs) < 200
    assert (run / "latest").read_text().strip() == f"ckpt/step_{len(recs):06d}"


# ==========================================================================================================
# Numerical safety: non-finite steps are skipped, counted, logged, and stop the run if they repeat

def params_at(run, step):
    from safetensors.torch import load_file
    return load_file(str(Path(run) / "ckpt" / f"step_{step:06d}" / "model.safetensors"))


def same_params(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def varied_rewards(monkeypatch):
    """Rewards 1, 0, 1, 0, ... so GRPO groups are not flat and the loss is computed."""
    import reward
    from tests.scripted import alternating_rewards
    monkeypatch.setattr(reward, "trajectory_reward", alternating_rewards())


def test_a_nan_loss_skips_that_update_only(micro_path, tmp_path, monkeypatch, varied_rewards):
    orig, calls = grpo.grpo_loss, [0]

    def nan_on_step_1(*a, **kw):
        loss, st = orig(*a, **kw)
        calls[0] += 1
        return (loss * float("nan"), st) if calls[0] == 2 else (loss, st)   # one micro-batch per step
    monkeypatch.setattr(train, "grpo_loss", nan_on_step_1)
    run = tmp_path / "nan"
    res = run_train(tiny_args(micro_path, run, sft=0, steps=3, extra=["--micro-batch", "8"]))
    assert res.returncode == 0, res.stderr
    recs = metrics_of(run)
    assert [x["skipped_update"] for x in recs] == [False, True, False]
    assert "step 1: non-finite loss or gradient; update skipped (1 in a row)" in res.stderr
    assert same_params(params_at(run, 1), params_at(run, 2))          # the skipped step changed nothing
    assert not same_params(params_at(run, 2), params_at(run, 3))      # the next one trains again


def test_repeated_non_finite_steps_stop_the_run_with_exit_1(micro_path, tmp_path):
    run = tmp_path / "blowup"     # lr 1e30: the first update makes the weights huge, every later loss NaN
    res = run_train(tiny_args(micro_path, run, sft=6, steps=1, extra=["--sft-lr", "1e30", "--max-bad-steps", "2"]))
    assert res.returncode == 1, res.stderr
    errors = [l for l in res.stderr.splitlines() if l.startswith("train.py: error:")]
    assert len(errors) == 1 and "2 consecutive steps" in errors[0] and "--lr" in errors[0], res.stderr
    recs = metrics_of(run)
    assert [x["skipped_update"] for x in recs][-2:] == [True, True] and len(recs) < 7


def test_flat_reward_groups_train_nothing_and_are_counted(micro_path, tmp_path):
    run = tmp_path / "flat"       # the untrained micro model never solves a task: every group is all-0
    # binary success (a checklist gives partial credit) and no KL term (which trains any row once it drifts)
    res = run_train(tiny_args(micro_path, run, sft=0, steps=2, extra=["--reward", "success", "--kl-coef", "0"]))
    assert res.returncode == 0, res.stderr
    recs = metrics_of(run)
    assert all(x["flat_groups"] == 2 and x["loss"] == 0 and not x["skipped_update"] for x in recs)
    assert same_params(params_at(run, 1), params_at(run, 2))


def test_no_trained_token_is_a_zero_gradient_not_a_crash(micro64):
    from rollout import Role
    model, _ = micro64
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    roles = torch.full((2, 10), int(Role.ACT))
    roles[:, :3] = Role.PROMPT
    model.zero_grad()
    batch = train.Batch(ids, roles, torch.zeros(2, 10, dtype=torch.float64), torch.ones(2, 10, dtype=torch.float64))
    st = train.policy_gradient(model, batch, [Role.WORLD], grpo.LossConfig(), distributed.Dist(), 8, 1.0, 64)
    assert st["loss"] == 0 and st["tokens"] == 0
    seq = (ids[0].tolist(), roles[0].tolist(), warm_start.trained_role_mask(roles[0].tolist(), [Role.WORLD]))
    loss, n = warm_start.sft_loss(model, [seq], distributed.Dist(), 0, 64)
    assert loss == 0 and n == 0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    adv, flat = grpo.group_advantages(torch.tensor([0.5, 0.5, 1.0]), torch.tensor([0, 0, 1]))
    assert flat == 2 and torch.equal(adv, torch.zeros(3))


# ==========================================================================================================
# Bad CLI values and data: one clear line, exit 2, nothing written or overwritten

def error_lines(stderr):
    return [l for l in stderr.splitlines() if l.strip() and "Loading weights" not in l and "it/s]" not in l]


TRAIN_BAD = [  # (flag values, text the one line must contain); every TrainConfig field is covered
    (["--model", "/nonexistent/model"], "does not exist"), (["--bench", "nope"], "argument --bench: invalid choice: 'nope'"),
    (["--split", "nosplit"], "nosplit"), (["--env", "simulated"], "--env"), (["--train-roles", ""], "roles"),
    (["--train-roles", "act,dream"], "roles"), (["--sft-roles", "x"], "roles"),
    (["--aggregate", "sum"], "--aggregate"), (["--steps", "0"], "--steps"), (["--steps", "2.5"], "invalid int"),
    (["--tasks-per-step", "-1"], "--tasks-per-step"), (["--group-size", "0"], "--group-size"),
    (["--group-size", "x"], "invalid int"), (["--micro-batch", "0"], "--micro-batch"),
    (["--updates-per-batch", "0"], "--updates-per-batch"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-world-tokens", "-3"], "--max-world-tokens"), (["--max-turns", "0"], "--max-turns"),
    (["--max-total-len", "0"], "--max-total-len"), (["--sft-batch", "0"], "--sft-batch"),
    (["--sft-steps", "x"], "invalid int"), (["--save-every", "0"], "--save-every"),
    (["--chunk-size", "0"], "--chunk-size"), (["--max-bad-steps", "0"], "--max-bad-steps"),
    (["--seed", "1.5"], "invalid int"), (["--lr", "nan"], "--lr"), (["--lr", "-5"], "--lr"),
    (["--lr", "abc"], "invalid float"), (["--sft-lr", "0"], "--sft-lr"), (["--grad-clip", "inf"], "--grad-clip"),
    (["--clip-low", "-0.1"], "--clip-low"), (["--clip-high", "nan"], "--clip-high"),
    (["--temperature", "0"], "--temperature"), (["--top-p", "1.5"], "--top-p"), (["--top-p", "0"], "--top-p"),
    (["--dual-clip", "0.5"], "--dual-clip"), (["--kl-coef", "-1"], "--kl-coef"),
    (["--defect-penalty", "nan"], "--defect-penalty"), (["--weight-decay", "-1"], "--weight-decay"),
    (["--act-weight", "-1"], "--act-weight"), (["--world-weight", "inf"], "--world-weight"),
    (["--overwrite=yes"], "--overwrite"), (["--scale-std=no"], "--scale-std"), (["--per-role-adv", "1"], "unrecognized"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints"), (["--beta2", "1"], "--beta2"), (["--beta2", "nan"], "--beta2"), (["--sft-warmup", "-1"], "--sft-warmup"),
    (["--sft-rehearsal-frac", "1.5"], "--sft-rehearsal-frac"), (["--sft-rehearsal-frac", "nan"], "--sft-rehearsal-frac"),
    (["--sft-memory", "guess"], "--sft-memory"),
    (["--reward", "judge"], "argument --reward: invalid choice: 'judge'"), (["--reward", "checklist", "--bench", "finmcp"], "no rule-based checklist"),
    (["--sft-world-frac", "1.5"], "--sft-world-frac"), (["--sft-world-frac", "nan"], "--sft-world-frac"),
    (["--sft-world-frac", "0.5", "--bench", "tau2"], "world examples"), (["--sft-world-skip", "get_price,"], "--sft-world-skip"),
    (["--sft-world-skip", "get_prize"], "names no tool"), (["--sft-world-lookup", "-0.1"], "--sft-world-lookup"),
    (["--sft-world-lookup", "0.5", "--sft-world-skip", "get_price,get_balance"], "every one without loss"),
    (["--no-such-flag"], "unrecognized"),
]


@pytest.mark.parametrize("argv,needle", TRAIN_BAD, ids=[" ".join(a) or "empty" for a, _ in TRAIN_BAD])
def test_train_bad_flag_is_one_line_exit_2_and_writes_nothing(argv, needle, micro_path, tmp_path):
    out = tmp_path / "run"
    base = ["--out", str(out), "--model", str(micro_path), "--steps", "1", "--sft-steps", "0", "--tasks-per-step", "1",
            "--group-size", "1", "--max-new-tokens", "2"]       # tiny if a case were (wrongly) accepted
    res = run_train(base + argv)
    lines = error_lines(res.stderr)
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, (argv, res.stderr)
    assert "error" in lines[0] and (needle is None or needle in lines[0]), lines
    assert not out.exists()


def _copy_model(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit:
        edit(Path(dst))
    return dst


def _tokenizer_config(path, change):
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    change(cfg)
    cfg_path.write_text(json.dumps(cfg))
    for f in path.glob("chat_template.*"):
        f.unlink()


def bad_models(micro_path, tmp_path):
    tpl = policy.CHAT_TEMPLATE
    return [
        (tmp_path / "nothing", "does not exist"),
        (_copy_model(micro_path, tmp_path / "empty", lambda p: [f.unlink() for f in p.iterdir()]), "incomplete"),
        (_copy_model(micro_path, tmp_path / "badcfg", lambda p: (p / "config.json").write_text("{oops")), "cannot load"),
        (_copy_model(micro_path, tmp_path / "badweights",
                     lambda p: (p / "model.safetensors").write_bytes(b"\0" * 100)), "cannot load model weights"),
        (_copy_model(micro_path, tmp_path / "badtok", lambda p: (p / "tokenizer.json").write_text("[")), "tokenizer"),
        (_copy_model(micro_path, tmp_path / "notemplate",
                     lambda p: _tokenizer_config(p, lambda c: c.pop("chat_template", None))), "no chat template"),
        (_copy_model(micro_path, tmp_path / "notappend",   # the system turn shows how many messages follow
                     lambda p: _tokenizer_config(p, lambda c: c.__setitem__(
                         "chat_template", "{{- messages | length }}" + tpl))), "append-only"),
        (_copy_model(micro_path, tmp_path / "noeos",
                     lambda p: _tokenizer_config(p, lambda c: c.__setitem__("chat_template", tpl.replace(
                         "'<|im_end|>\\n' }}\n{%- elif message.role == 'tool'", "'\\n' }}\n{%- elif message.role == 'tool'")))),
         "no end-of-turn token"),
    ]


def test_broken_model_folders_are_one_line_exit_2_and_never_touch_an_existing_run(micro_path, tmp_path, capsys):
    import evaluate
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "metrics.jsonl").write_text('{"step": 0}\n')
    for model, needle in bad_models(micro_path, tmp_path):
        res = run_train(["--model", str(model), "--out", str(existing), "--overwrite"])
        lines = error_lines(res.stderr)
        assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], (model.name, res.stderr)
        assert (existing / "metrics.jsonl").read_text() == '{"step": 0}\n'      # --overwrite: not before loading
        with pytest.raises(SystemExit) as exc:
            evaluate.main(["--model", str(model), "--limit", "1", "--out", str(tmp_path / "ev")])
        err = capsys.readouterr().err
        lines = error_lines(err)
        assert exc.value.code == 2 and len(lines) == 1 and needle in lines[0], (model.name, err)
        assert not (tmp_path / "ev").exists()


EVAL_BAD = [
    (["--limit", "0"], "--limit"), (["--num-trials", "x"], "--num-trials"), (["--rehearsal-budget", "-1"], "budget"),
    (["--rehearsal-mode", "beam"], "--rehearsal-mode"), (["--compare", ""], "--compare"), (["--compare", "1,-2"], "--compare"),
    (["--temperature", "0"], "--temperature"), (["--temperature", "hot"], "--temperature"), (["--top-p", "2"], "--top-p"),
    (["--seed", "x"], "--seed"), (["--max-new-tokens", "0"], "--max-new-tokens"), (["--max-world-tokens", "0"], "--max-world-tokens"),
    (["--max-turns", "0"], "--max-turns"), (["--max-total-len", "8"], "--max-total-len"), (["--task-opts", "x"], "key=value"),
    (["--task-opts", "nosuchoption=1"], "nosuchoption"), (["--bench", "nope"], "--bench"), (["--split", "nosplit"], "nosplit"),
    (["--device", "tpu"], "device"), (["--fidelity=maybe"], "--fidelity"),
]


@pytest.mark.parametrize("argv,needle", EVAL_BAD, ids=[" ".join(a) for a, _ in EVAL_BAD])
def test_evaluate_bad_flag_is_one_line_exit_2(argv, needle, micro_path, tmp_path, capsys):
    import evaluate
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--model", str(micro_path), "--limit", "1", "--out", str(tmp_path / "ev"), *argv])
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert exc.value.code == 2 and len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "ev").exists()


def test_missing_packages_and_corrupt_task_files_are_one_line_exit_2(micro_path, tmp_path, capsys, monkeypatch):
    import evaluate
    corrupt = tmp_path / "finmcp.json"
    corrupt.write_text('[{"messages": [')
    wrong = tmp_path / "finmcp_wrong.json"
    wrong.write_text('[{"no_messages": 1}]')
    vita_dir = tmp_path / "vita"
    (vita_dir / "delivery").mkdir(parents=True)
    cases = [(["--bench", "finmcp"], "FinMCP"), (["--bench", "finmcp", "--task-opts", f"data={corrupt}"], "neither JSON"),
             (["--bench", "finmcp", "--task-opts", f"data={wrong}"], "messages"),
             (["--bench", "finmcp", "--task-opts", f"data={tmp_path / 'none.json'}"], "does not exist"),
             (["--bench", "vita", "--task-opts", f"data={tmp_path / 'novita'}"], "not found"),
             (["--bench", "vita", "--task-opts", f"data={vita_dir}"], "no VitaBench")]
    for name in ("bfcl_eval", "tau2"):   # as if the package were not installed (and never imported)
        monkeypatch.setitem(sys.modules, name, None)
    import bench.tau2
    caches = [f for f in vars(bench.tau2).values() if hasattr(f, "cache_clear")]
    for f in caches:
        f.cache_clear()
    cases += [(["--bench", "bfcl"], "pip install"), (["--bench", "tau2"], "pip install")]
    for argv, needle in cases:
        with pytest.raises(SystemExit) as exc:
            evaluate.main(["--model", str(micro_path), "--limit", "1", "--out", str(tmp_path / "ev"), *argv])
        err = capsys.readouterr().err
        lines = error_lines(err)
        assert exc.value.code == 2 and len(lines) == 1 and needle in lines[0], (argv, err)
        if argv[1] in ("bfcl", "tau2", "finmcp"):
            res = run_train(["--model", str(micro_path), "--out", str(tmp_path / "tr"), *argv[:2]])
            lines = error_lines(res.stderr)
            assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, (argv, res.stderr)
        assert not (tmp_path / "ev").exists() and not (tmp_path / "tr").exists()
    for f in caches:
        f.cache_clear()


def test_bad_run_folders_are_one_line_exit_2(micro_path, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    res = run_train(["--model", str(micro_path), "--out", str(afile)])
    assert res.returncode == 2 and len(error_lines(res.stderr)) == 1 and "not a folder" in res.stderr, res.stderr
    assert afile.read_text() == "not a folder"
    for content, needle in (("{oops", "config.json"), ('{"no_such_field": 1}', "no_such_field")):
        run = tmp_path / f"r{len(content)}"
        run.mkdir()
        (run / "config.json").write_text(content)
        res = run_train(["--resume", str(run)])
        lines = error_lines(res.stderr)
        assert res.returncode == 2 and len(lines) == 1 and needle in lines[0], res.stderr
        assert (run / "config.json").read_text() == content


# ==========================================================================================================
# Resource limits: contexts are cut with a recorded reason; out-of-memory names the flags that help

def test_context_past_the_limit_is_cut_with_a_recorded_reason(micro_path):
    from bench import toyworld
    model, tok = policy.load_policy(str(micro_path))
    eng = rollout.Engine(model.eval(), tok)
    tasks = toyworld.load_tasks("test", limit=2)
    n_prompt = max(len(eng.prompt_ids(t)) for t in tasks)
    for limit in (n_prompt - 5, n_prompt + 7):      # the prompt itself too long; the trajectory grows too long
        cfg = rollout.SamplingConfig(max_total_len=limit, max_new_tokens=64, seed=1)
        ro = eng.run(tasks, 2, cfg, make_env=toyworld.make_env, responses="rehearse")
        for b, (tr, reason) in enumerate(zip(ro.trajectories, ro.end_reasons)):
            prompt = len(eng.prompt_ids(tasks[ro.task_index[b]]))
            if prompt >= limit:                      # nothing generated; the prompt is kept whole
                assert reason == "max_length" and int(ro.lengths[b]) == prompt
            else:
                assert int(ro.lengths[b]) <= limit
            if reason == "max_length":
                assert any(e.startswith("context_too_long") for e in tr.errors), tr.errors
        assert "max_length" in ro.end_reasons
        ep = rehearse.act(eng, tasks[0], cfg, toyworld.make_env(tasks[0]), rehearse.RehearsalConfig(budget=1))
        assert int(ep.rollout.lengths[0]) <= max(limit, len(eng.prompt_ids(tasks[0]))) and (
            ep.trajectory.end_reason != "max_length"
                                                    or any("context_too_long" in e for e in ep.trajectory.errors))
    old = model.config.max_position_embeddings       # the model's own maximum wins over a larger max_total_len
    model.config.max_position_embeddings = n_prompt + 3
    try:
        ro = eng.run(tasks, 1, rollout.SamplingConfig(max_total_len=10_000, max_new_tokens=64), responses="rehearse")
    finally:
        model.config.max_position_embeddings = old
    assert int(ro.lengths.max()) <= n_prompt + 3 and "max_length" in ro.end_reasons


def test_out_of_memory_names_the_flags_that_reduce_memory(micro_path, tmp_path, monkeypatch):
    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(rollout.Engine, "run", oom)
    res = run_train(tiny_args(micro_path, tmp_path / "oom", sft=1, steps=1))
    lines = [l for l in error_lines(res.stderr) if l.startswith("train.py: error")]
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    for flag in ("--micro-batch", "--group-size", "--max-new-tokens", "--max-total-len", "--chunk-size"):
        assert flag in lines[0]
    assert check_checkpoints(tmp_path / "oom") == 1        # the step before stays resumable


def test_only_the_newest_checkpoints_are_kept(micro_path, tmp_path):
    run = tmp_path / "run"
    res = run_train(tiny_args(micro_path, run, sft=4, steps=1, extra=["--keep-checkpoints", "2"]))
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["step_000004", "step_000005"]
    assert check_checkpoints(run) == 5
    res = run_train(tiny_args(micro_path, tmp_path / "all", sft=3, steps=0, extra=["--keep-checkpoints", "0"]))
    assert res.returncode == 0 and len(list((tmp_path / "all" / "ckpt").glob("step_*"))) == 3

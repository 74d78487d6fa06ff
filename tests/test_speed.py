"""Smoke test of bench/speed.py: the smallest configuration runs and its JSON has every field.

Never asserts a time. It does assert what is deterministic: the three rollout methods sample the same token
ids, the cached engine processes fewer positions and FLOPs than re-encoding, and the chunked log-probs equal
the naive ones.
"""
import json

import pytest
import torch

from bench import speed


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
    assert [(c["workload"], c["turns"]) for c in cells] == [("toyworld", 1), ("toyworld", 2), ("tau2", 2)]
    for c in cells:
        assert c["identical_ids"], "HF generate per turn did not reproduce the cached engine's token ids"
        for method in ("cached", "hf"):
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
    assert "1. multi-turn rollout" in smoke["table"]


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

"""evaluate.py: CLI errors exit 2 with one line, an end-to-end run writes JSONL + summary, metrics."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import evaluate

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv,needle", [
    (["--rehearsal-budget", "-1"], "--rehearsal-budget"),
    (["--rehearsal-budget", "two"], "integer"),
    (["--rehearsal-mode", "beam"], "--rehearsal-mode"),
    (["--top-p", "0"], "--top-p"),
    (["--temperature", "0"], "--temperature"),
    (["--num-trials", "0"], "--num-trials"),
    (["--limit", "0"], "--limit"),
    (["--bench", "nosuch"], "--bench"),
    (["--compare", "1,x"], "--compare"),
    (["--task-opts", "novalue"], "key=value"),
])
def test_bad_cli_values_exit_2_with_one_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        evaluate.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("evaluate.py: error:") and needle in err


def test_missing_model_and_bad_task_option_exit_2(tmp_path, capsys):
    for argv, needle in ([["--model", str(tmp_path / "nope"), "--limit", "1"], "does not exist"],
                         [["--model", str(tmp_path), "--limit", "1"], "incomplete"],
                         [["--split", "nosplit", "--limit", "1"], "nosplit"]):
        with pytest.raises(SystemExit) as exc:
            evaluate.main(argv + ["--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and needle in err, err


def test_unavailable_bench_is_one_line_exit_2():
    try:
        import bench.tau2  # noqa: F401
        pytest.skip("bench.tau2 is present in this checkout")
    except ImportError:
        pass
    proc = subprocess.run([sys.executable, "evaluate.py", "--bench", "tau2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "tau2" in proc.stderr


def test_end_to_end_writes_jsonl_and_summary(micro_path, tmp_path):
    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "evaluate.py", "--model", str(micro_path), "--limit", "4",
                           "--rehearsal-budget", "1", "--max-new-tokens", "24", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = (out / "trajectories_B1_parallel.jsonl").read_text().splitlines()
    assert len(lines) == 4
    rec = json.loads(lines[0])
    assert rec["budget"] == 1 and rec["group"] == "family=balance" and 0.0 <= rec["reward"] <= 1.0
    assert "[PROMPT t0" in rec["text"] and "components" in rec and len(rec["rehearsals"]) >= 1
    assert rec["stats"]["committed_turns"] >= 1 and "extra_tokens" in rec["stats"]
    summary = json.loads((out / "summary.json").read_text())
    run = summary["runs"]["B=1"]
    assert run["overall"]["tasks"] == 4 and set(run["groups"]) == {"family=balance", "family=send",
                                                                  "family=buy", "family=half"}
    assert "fidelity" in run and run["cost"]["committed_turns"] >= 4
    assert "toyworld success" in proc.stdout and "B=1" in proc.stdout
    # rehearsal diagnostics: per committed turn in the JSONL, summed in the summary and the table
    recs = [json.loads(x) for x in lines]
    diag = run["rehearsal_diagnostics"]
    assert diag["turns"] == sum(r["rehearsal_diagnostics"]["counts"]["turns"] for r in recs) >= 4
    assert all(len(r["rehearsal_diagnostics"]["turns"]) == r["rehearsal_diagnostics"]["counts"]["turns"]
               <= len(r["rehearsals"]) for r in recs)
    assert diag["assessed"] == (diag["verdict_unparsed"] + diag["assess_unmeasured"] + diag["assess_agree"]
                                + diag["assess_disagree"])
    assert diag["changed"] == diag["helped"] + diag["hurt"] + diag["neutral"] + diag["effect_unmeasured"]
    assert "rehearsal assess_agree_rate" in proc.stdout and "rehearsal changed_rate" in proc.stdout


def test_compare_runs_budgets_on_the_same_seeds(micro_path, tmp_path, capsys):
    rc = evaluate.main(["--model", str(micro_path), "--limit", "2", "--compare", "0,2", "--max-new-tokens", "12",
                        "--num-trials", "2", "--no-fidelity", "--out", str(tmp_path)])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["runs"]) == ["B=0", "B=2"]
    recs = {b: [json.loads(x) for x in (tmp_path / f"trajectories_B{b}_parallel.jsonl").read_text().splitlines()]
            for b in (0, 2)}
    assert [(r["task_id"], r["seed"]) for r in recs[0]] == [(r["task_id"], r["seed"]) for r in recs[2]]
    assert len(recs[0]) == 4 and "pass^2" in summary["runs"]["B=0"]["overall"]
    assert recs[0][0]["stats"]["extra_tokens"] == 0 and recs[2][0]["stats"]["extra_tokens"] > 0
    assert "rehearsal_diagnostics" not in recs[0][0] and "rehearsal_diagnostics" in recs[2][0]
    assert "rehearsal_diagnostics" not in summary["runs"]["B=0"] and "rehearsal_diagnostics" in summary["runs"]["B=2"]
    out = capsys.readouterr().out
    assert "B=0" in out and "B=2" in out
    # the paired difference on the same tasks and seeds, recomputed from the two JSONL files
    from intervals import paired_difference, per_task_rewards, success_interval
    d = paired_difference(per_task_rewards(recs[2]), per_task_rewards(recs[0]))
    assert summary["paired"]["B=2 - B=0"]["overall"] == pytest.approx(
        {"diff": d.diff, "lo": d.lo, "hi": d.hi, "tasks": 2, "better": d.better, "worse": d.worse, "same": d.same})
    assert "paired differences in success" in out and "B=2 - B=0" in out
    rate = success_interval(per_task_rewards(recs[0]))
    assert summary["runs"]["B=0"]["overall"]["success_95ci"] == pytest.approx([rate.lo, rate.hi])
    assert summary["runs"]["B=0"]["jsonl"] == "trajectories_B0_parallel.jsonl"      # no machine path


def test_auto_model_falls_back_to_tiny_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert evaluate.resolve_model("auto") == "tiny"
    assert capsys.readouterr().out.count("\n") == 1
    (tmp_path / "runs/tiny-toyworld").mkdir(parents=True)
    (tmp_path / "runs/tiny-toyworld/latest").write_text("ckpt/step_000200\n")
    assert evaluate.resolve_model("auto") == str(Path("runs/tiny-toyworld/ckpt/step_000200"))
    assert evaluate.resolve_model("/x/y") == "/x/y"


def test_pass_hat_k_and_summary_metrics():
    assert evaluate.pass_hat_k({"a": [True, True], "b": [True, False]}, 1) == pytest.approx(0.75)
    assert evaluate.pass_hat_k({"a": [True, True], "b": [True, False]}, 2) == pytest.approx(0.5)
    assert evaluate.pass_hat_k({"a": [True, True, False, True]}, 2) == pytest.approx(3 / 6)
    assert math.isnan(evaluate.pass_hat_k({"a": [True]}, 2))

    def rec(tid, reward, group, comps=None, fid=()):
        return {"task_id": tid, "reward": reward, "group": group, "components": comps or {}, "fidelity": list(fid),
                "stats": {"committed_turns": 2, "committed_calls": 1, "extra_tokens": 10, "private_seconds": 0.5}}
    f = {"exact": True, "kv_agreement": 1.0, "error_correct": True, "real_error": False, "predicted_error": False}
    recs = [rec("a", 1.0, "category=x", {"precision": 1.0, "recall": 0.5, "f1": 2 / 3}, [f]),
            rec("a", 0.0, "category=x", {"precision": 0.0, "recall": 0.0, "f1": 0.0}),
            rec("b", 1.0, "category=y", {"precision": 1.0, "recall": 1.0, "f1": 1.0}),
            rec("b", 1.0, "category=y", {"precision": 1.0, "recall": 1.0, "f1": 1.0}),
            rec("c", 0.0, "category=y", {"evaluator_error": "ValueError: replay mismatch"}),
            rec("c", 0.0, "category=y", {"evaluator_error": "ValueError: replay mismatch"})]
    s = evaluate.summarize("finmcp", recs, 2)
    assert s["overall"]["evaluator_errors"] == 2 and s["groups"]["category=x"]["evaluator_errors"] == 0
    assert s["groups"]["category=y"]["evaluator_errors"] == 2
    recs = recs[:4]
    s = evaluate.summarize("finmcp", recs, 2)
    assert s["overall"]["success"] == 0.75 and s["overall"]["pass^2"] == 0.5
    assert s["groups"]["category=x"]["success"] == 0.5 and s["groups"]["category=y"]["pass^2"] == 1.0
    assert s["overall"]["recall"] == pytest.approx(0.625) and s["fidelity"]["pairs"] == 1
    assert s["cost"]["extra_tokens_per_call"] == 10 and s["cost"]["extra_tokens_per_turn"] == 5
    text = evaluate.table("finmcp", {"B=0": s, "B=1": s})
    assert "category=x (n=1) success    0.500 [" in text and "finmcp pass^2" in text and "finmcp evaluator_errors" in text


def test_sampling_defaults_are_the_benchmark_settings(monkeypatch):
    """evaluate.py's temperature / top-p and train.py's temperature come from bench/settings.py unless set."""
    import dataclasses
    import train
    from bench import settings
    assert evaluate.sampling_defaults("tau2", None, None) == (0.6, 0.95)
    assert evaluate.sampling_defaults("tau2", 0.3, None) == (0.3, 0.95)
    monkeypatch.setitem(settings.SETTINGS, "toyworld", dataclasses.replace(
        settings.SETTINGS["toyworld"], eval_temperature=0.7, eval_top_p=0.9, train_temperature=0.8))
    assert evaluate.sampling_defaults("toyworld", None, None) == (0.7, 0.9)
    assert train.TrainConfig().resolved().temperature == 0.8
    assert train.TrainConfig(temperature=1.0).resolved().temperature == 1.0


def test_the_resolved_config_is_read_only_and_leaves_the_parsed_flags_alone():
    parsed = evaluate.build_parser().parse_args(["--bench", "tau2"])
    cfg = evaluate.resolve_config(parsed, context=40960)
    assert (cfg.split, cfg.temperature, cfg.top_p, cfg.max_total_len, cfg.max_turns) == ("test", 0.6, 0.95, 40960, 200)
    assert parsed.split is None and parsed.temperature is None and parsed.max_total_len is None
    with pytest.raises(AttributeError, match="read-only"):
        cfg.temperature = 1.0


def test_summary_reports_peak_memory_against_the_budget_it_ran_under(micro_path, tmp_path, capsys):
    import kvbatch
    import policy
    model, _ = policy.load_policy(str(micro_path))
    row = kvbatch.memory_row_bytes(model, 512)
    budget_gb = 3.5 * row / 2**30          # three rows fit
    rc = evaluate.main(["--model", str(micro_path), "--limit", "6", "--max-new-tokens", "12", "--max-total-len", "512",
                        "--memory-budget", repr(budget_gb), "--no-fidelity", "--out", str(tmp_path)])
    assert rc == 0
    mem = json.loads((tmp_path / "summary.json").read_text())["memory"]
    assert mem["kv_budget_bytes"] == int(budget_gb * 2**30) and mem["row_bytes"] == row
    assert mem["batch_rows"] == 3
    assert mem["peak_bytes"] >= mem["loaded_bytes"] > 0
    assert mem["peak_above_loaded_bytes"] == mem["peak_bytes"] - mem["loaded_bytes"]
    assert "memory: KV-cache budget" in capsys.readouterr().out


def test_memory_report_flags_a_peak_over_the_budget(monkeypatch):
    import kvbatch
    monkeypatch.setattr(kvbatch, "peak_rss_bytes", lambda: 5 << 30)
    over = evaluate.memory_report({"device": "cpu", "loaded_bytes": 1 << 30}, 2 << 30, 1 << 20, 8, "cpu")
    assert over["peak_above_loaded_bytes"] == 4 << 30 and not over["within_budget"]
    assert "OVER the budget" in evaluate.memory_line(over)
    under = evaluate.memory_report({"device": "cpu", "loaded_bytes": 1 << 30}, 8 << 30, 1 << 20, 8, "cpu")
    assert under["within_budget"] and "within the budget" in evaluate.memory_line(under)


def test_peak_rss_sees_an_allocation_after_its_reset():
    import kvbatch
    kvbatch.reset_peak_rss()
    before = kvbatch.peak_rss_bytes()
    import mmap
    block = mmap.mmap(-1, 200 << 20)      # fresh anonymous pages (a heap block could reuse resident freed memory)
    for i in range(0, len(block), 4096):
        block[i] = 1                      # touched: resident
    assert kvbatch.peak_rss_bytes() - before >= 150 << 20
    assert kvbatch.rss_bytes() >= 200 << 20
    block.close()

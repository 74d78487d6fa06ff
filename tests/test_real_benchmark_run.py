"""experiments/real_benchmark_run.py on hand-made train.py metrics and evaluate.py summaries: the curve holds the
run's own numbers, fidelity is weighted by calls, a torn last line is skipped, bad --eval is one clear error."""
import json

import pytest

from experiments import real_benchmark_run as rbr


def write_run(folder):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"bench": "bfcl", "steps": 2}))
    lines = [{"phase": "sft", "step": 0, "loss": 0.5, "t_step": 3.0},
             {"phase": "grpo", "step": 1, "reward_mean": 0.25, "success_rate": 0.25, "flat_group_share": 0.5,
              "fidelity_n/f": 3, "fidelity_exact/f": 1.0, "fidelity_error/f": 1.0,
              "fidelity_n/g": 1, "fidelity_exact/g": 0.0, "fidelity_error/g": 0.0, "t_step": 10.0},
             {"phase": "grpo", "step": 2, "reward_mean": 0.5, "success_rate": 0.5, "flat_group_share": 0.0,
              "t_step": 12.0}]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + '\n{"phase": "gr')


def write_eval(folder, success):
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({
        "model": "m", "bench": "bfcl", "split": "dev", "tasks": 4, "seconds": 1.0,
        "sampling": {"temperature": 0.6}, "runs": {"B=0": {"overall": {"success": success}}}}))


def test_report_holds_the_runs_numbers(tmp_path):
    write_run(tmp_path / "run")
    write_eval(tmp_path / "before", 0.0)
    write_eval(tmp_path / "after", 0.25)
    assert rbr.main(["--run", str(tmp_path / "run"), "--eval", f"before={tmp_path / 'before'}",
                     "--eval", f"after={tmp_path / 'after'}", "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "run.json").read_text())
    assert [p["step"] for p in report["grpo"]] == [1, 2]
    assert report["grpo"][0]["reward_mean"] == 0.25 and report["grpo"][1]["success_rate"] == 0.5
    assert report["grpo"][0]["fidelity"] == {"calls": 4, "exact": 0.75, "error_correct": 0.75}
    assert report["grpo"][1]["fidelity"]["exact"] is None
    assert report["warm_start"]["steps"] == 1 and report["grpo_seconds"] == 22.0
    assert report["held_out"]["after"]["overall"]["success"] == 0.25


def test_bad_eval_folder_is_a_clear_error(tmp_path, capsys):
    write_run(tmp_path / "run")
    with pytest.raises(SystemExit):
        rbr.main(["--run", str(tmp_path / "run"), "--eval", f"x={tmp_path}", "--out", str(tmp_path / "o")])
    assert "LABEL=FOLDER" in capsys.readouterr().err

"""experiments/real_benchmark_run.py on hand-made train.py metrics and evaluate.py summaries: the curve holds the
run's own numbers, fidelity is weighted by calls, a torn last line is skipped, held-out figures carry their
interval and are paired with the baseline on the same tasks, bad --run/--eval/--baseline is one clear error."""
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


def write_eval(folder, rewards):
    """An evaluate.py folder: its summary and one B=0 trajectory per task (task i's reward rewards[i])."""
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({
        "model": "m", "bench": "bfcl", "split": "dev", "tasks": len(rewards), "seconds": 1.0,
        "sampling": {"temperature": 0.6},
        "runs": {"B=0": {"overall": {"success": sum(rewards) / len(rewards)}}}}))
    (folder / "trajectories_B0_parallel.jsonl").write_text(
        "".join(json.dumps({"task_id": f"t{i}", "trial": 0, "reward": r}) + "\n" for i, r in enumerate(rewards)))


def test_report_holds_the_runs_numbers(tmp_path):
    write_run(tmp_path / "run")
    before = [0.0] * 30 + [1.0] * 10
    after = [1.0] * 12 + [0.0] * 18 + [1.0] * 10          # 12 tasks gained, none lost
    write_eval(tmp_path / "before", before)
    write_eval(tmp_path / "after", after)
    assert rbr.main(["--run", f"real={tmp_path / 'run'}", "--eval", f"before={tmp_path / 'before'}",
                     "--eval", f"after={tmp_path / 'after'}", "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "run.json").read_text())
    run = report["runs"]["real"]
    assert [p["step"] for p in run["grpo"]] == [1, 2]
    assert run["grpo"][0]["reward_mean"] == 0.25 and run["grpo"][1]["success_rate"] == 0.5
    assert run["grpo"][0]["fidelity"] == {"calls": 4, "exact": 0.75, "error_correct": 0.75}
    assert run["grpo"][1]["fidelity"]["exact"] is None
    assert run["warm_start"]["steps"] == 1 and run["grpo_seconds"] == 22.0
    held = report["held_out"]["after"]["success"]
    assert held["tasks"] == 40 and held["mean"] == 0.55 and held["lo"] < 0.55 < held["hi"]
    assert held["method"] == "wilson"
    d = report["paired"]["after - before"]
    assert d["tasks"] == 40 and abs(d["diff"] - 0.3) < 1e-12 and d["better"] == 12 and d["worse"] == 0
    assert d["resolved"] and 0 < d["lo"] < 0.3 < d["hi"]


def test_bad_arguments_are_clear_errors(tmp_path, capsys):
    write_run(tmp_path / "run")
    with pytest.raises(SystemExit):
        rbr.main(["--run", str(tmp_path / "run"), "--eval", f"x={tmp_path}", "--out", str(tmp_path / "o")])
    assert "LABEL=FOLDER" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rbr.main(["--run", str(tmp_path), "--out", str(tmp_path / "o")])
    assert "no metrics.jsonl" in capsys.readouterr().err
    write_eval(tmp_path / "e", [1.0, 0.0])
    with pytest.raises(SystemExit):
        rbr.main(["--run", str(tmp_path / "run"), "--eval", f"e={tmp_path / 'e'}", "--baseline", "nope",
                  "--out", str(tmp_path / "o")])
    assert "--baseline 'nope'" in capsys.readouterr().err

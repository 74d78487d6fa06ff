"""experiments/rehearsal_headroom.py from hand-made evaluate.py folders: paired B vs B=0 figures and the table."""
import json
import types

from experiments import rehearsal_headroom as rh
from intervals import paired_difference, per_task_rewards


def fake_run(folder, rewards, diag=None):
    folder.mkdir(parents=True)
    recs = [{"task_id": f"t{i}", "trial": 0, "reward": r} for i, r in enumerate(rewards)]
    (folder / "trajectories_B0_parallel.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = {"rehearsal_diagnostics": diag} if diag else {}
    (folder / "summary.json").write_text(json.dumps({"seconds": 12.0, "runs": {"B=x": run}}))
    return recs


def test_summary_pairs_every_budget_with_b0_of_its_family_set(tmp_path):
    args = types.SimpleNamespace(out=tmp_path, sets=["costly", "classic"], variants=["model", "oracle"], budgets=[1],
                                 limit=40, seed=0, model_label="ckpt")
    base = fake_run(rh.run_dir(tmp_path, "costly", "", 0), [1.0] * 20 + [0.0] * 20)
    model = fake_run(rh.run_dir(tmp_path, "costly", "model", 1), [1.0] * 18 + [0.0] * 22,
                     {"changed": 5, "helped": 0, "hurt": 2, "rehearsed_turns": 30})
    oracle = fake_run(rh.run_dir(tmp_path, "costly", "oracle", 1), [1.0] * 30 + [0.0] * 10)
    result = rh.summarize(args)
    entry = result["sets"]["costly"]
    assert list(result["sets"]) == ["costly"]            # classic not run yet: left out, not an error
    assert entry["B=0"]["mean"] == 0.5 and entry["B=0"]["tasks"] == 40
    d = paired_difference(per_task_rewards(oracle), per_task_rewards(base))
    assert entry["oracle B=1"]["vs_B0"]["diff"] == d.diff == 0.25 and entry["oracle B=1"]["vs_B0"]["better"] == 10
    assert entry["model B=1"]["vs_B0"]["worse"] == 2 and entry["model B=1"]["hurt"] == 2
    text = rh.table(result)
    assert "| costly | oracle B=1 | 0.750 [" in text and "| 10 / 0 |" in text
    assert "no difference" in text.split("model B=1")[1].split("\n")[0]        # -0.05 with 2 worse of 40
    assert len(per_task_rewards(model)) == 40

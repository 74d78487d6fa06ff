"""The method's smallest end-to-end claim, run for real: training the embedded tiny model on the embedded toy
world (a shortened `python train.py`: supervised warm start, then EnvACE GRPO) raises held-out success above
the untrained model's. ~6 minutes on 2 cores: the tiny model's copy transition is chaotic (step ~280 in one
run, ~575 in this test's seed-0 stream on our machine; README), so 660 steps leave a margin past it."""
import json

import evaluate
import train
from tests.scripted import run_train

SFT_STEPS, GRPO_STEPS = 660, 2
# balance and send are the families the tiny model solves first (75-100% right after the transition);
# held-out test tasks (the test split's account pairs never appear together in training)
EVAL = ["--bench", "toyworld", "--greedy", "--limit", "16", "--opt", "families=balance,send", "--no-fidelity"]


def success(tmp_path, name, model):
    out = tmp_path / name
    assert evaluate.main(["--model", str(model), "--out", str(out), *EVAL]) in (0, None)
    return json.loads((out / "summary.json").read_text())["runs"]["B=0"]["overall"]["success"]


def test_training_raises_held_out_success_above_the_untrained_model(tmp_path):
    run = tmp_path / "run"
    res = run_train(["--out", str(run), "--sft-steps", str(SFT_STEPS), "--steps", str(GRPO_STEPS),
                     "--save-every", str(SFT_STEPS + GRPO_STEPS)])
    assert res.returncode == 0, res.stderr[-2000:]
    trained = train.latest_checkpoint(run)
    assert trained.name == f"step_{SFT_STEPS + GRPO_STEPS:06d}"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["phase"] for m in metrics].count("grpo") == GRPO_STEPS
    before, after = success(tmp_path, "untrained", "tiny"), success(tmp_path, "trained", trained)
    print(f"held-out success (balance, send; 16 tasks, greedy): untrained {before:.3f}, trained {after:.3f}")
    assert after >= before + 0.25, (before, after)

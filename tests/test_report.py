"""--report-to: the loggers receive metrics.jsonl's scalars at the same steps (tensorboard's event files read
back), wandb runs offline by default and keeps its id over a resume, a missing package is one line, exit 2."""
import json
import sys
import types

import pytest

import report
from tests.scripted import run_train
from tests.test_train import small_run


def test_scalars_flatten_nested_counts_and_drop_text():
    rec = {"step": 3, "phase": "grpo", "loss": 0.5, "no_signal": True, "note": "x", "kl": None,
           "end_reasons": {"max_turns": 2, "final_answer": 6}}
    assert report.scalars(rec) == {"loss": 0.5, "no_signal": 1.0, "end_reasons/max_turns": 2.0,
                                   "end_reasons/final_answer": 6.0}


def test_tensorboard_events_hold_the_metrics_of_every_step(micro_path, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    res = run_train(small_run(micro_path, out, 2, ["--report-to", "tensorboard"]))
    assert res.returncode == 0, res.stderr
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for rec in records:
        for name, value in report.scalars(rec).items():
            tag = f"{rec['phase']}/{name}"
            assert tag in tags, tag
            (event,) = [e for e in acc.Scalars(tag) if e.step == rec["step"]]
            assert event.value == pytest.approx(value, rel=1e-6, abs=1e-6), tag
    assert {"sft/loss", "grpo/reward_mean", "grpo/entropy", "grpo/kl"} <= tags


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished += 1


def test_wandb_is_offline_by_default_and_a_resume_keeps_its_run(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    r = report.make_reporter("wandb", tmp_path, {"lr": 1e-4})
    r.log({"step": 0, "phase": "grpo", "loss": 0.25, "end_reasons": {"final_answer": 4}})
    r.close()
    assert fake.inits[0]["mode"] == "offline" and fake.inits[0]["config"] == {"lr": 1e-4}
    assert fake.logged == [(0, {"grpo/loss": 0.25, "grpo/end_reasons/final_answer": 4.0})] and fake.finished == 1
    first_id = fake.inits[0]["id"]
    monkeypatch.setenv("WANDB_MODE", "online")
    report.make_reporter("wandb", tmp_path, {}, start_step=5)
    assert fake.inits[1]["id"] == first_id and fake.inits[1]["mode"] == "online"
    report.make_reporter("wandb", tmp_path, {})              # a new run (step 0): a new id
    assert fake.inits[2]["id"] != first_id


def test_a_missing_logger_package_is_one_line_and_exit_2(micro_path, tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    out = tmp_path / "run"
    res = run_train(small_run(micro_path, out, 1, ["--report-to", "wandb"]))
    assert res.returncode == 2 and "requirements-loggers.txt" in res.stderr and not out.exists()
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr

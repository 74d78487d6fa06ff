"""Experiment loggers beside metrics.jsonl: `--report-to none | tensorboard | wandb` (TRL's `report_to`).

metrics.jsonl stays the record (every step, fsynced, trimmed on resume); a logger receives the same scalars,
named `<phase>/<field>` (nested counts such as end_reasons flattened to `grpo/end_reasons/max_turns`), at the
same step. Both are optional dependencies (requirements-loggers.txt):

    tensorboard   event files in <run>/tensorboard; on resume, events at or past the resumed step are purged
    wandb         offline (files under <run>/wandb) unless WANDB_MODE says otherwise; a resumed run continues
                  the same wandb run id, kept in <run>/wandb_id
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

REPORTERS = ("none", "tensorboard", "wandb")
INSTALL = "pip install -r requirements-loggers.txt"


class ReporterUnavailable(RuntimeError):
    """The chosen logger's package is not installed."""


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The record's numbers (bools as 0/1, nested dicts flattened with '/'); strings and None are left out."""
    out = {}
    for key, value in record.items():
        if key in ("step", "phase"):
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = float(value)
    return out


class NoReporter:
    def log(self, record: dict):
        pass

    def close(self):
        pass


class TensorBoardReporter:
    def __init__(self, run: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter
        # purge_step: a resumed run drops the events the killed process wrote past its checkpoint
        self.writer = SummaryWriter(log_dir=str(run / "tensorboard"), purge_step=start_step or None)

    def log(self, record: dict):
        phase = record.get("phase", "train")
        for name, value in scalars(record).items():
            self.writer.add_scalar(f"{phase}/{name}", value, global_step=record["step"])
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandbReporter:
    def __init__(self, run: Path, config: dict, start_step: int):
        import wandb
        id_file = run / "wandb_id"
        run_id = id_file.read_text().strip() if start_step and id_file.exists() else secrets.token_hex(8)
        id_file.write_text(run_id + "\n")
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "envace-ref"), dir=str(run), id=run_id,
                              resume="allow", config=config, name=run.name,
                              mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, record: dict):
        phase = record.get("phase", "train")
        self.run.log({f"{phase}/{k}": v for k, v in scalars(record).items()}, step=record["step"])

    def close(self):
        self.run.finish()


def make_reporter(kind: str, run: Path, config: dict, start_step: int = 0):
    """The logger `kind` names, writing into the run folder; ReporterUnavailable if its package is missing."""
    check_available(kind)
    if kind == "none":
        return NoReporter()
    if kind == "tensorboard":
        return TensorBoardReporter(run, start_step)
    if kind == "wandb":
        return WandbReporter(run, config, start_step)
    raise ValueError(f"--report-to must be one of {', '.join(REPORTERS)}, not {kind!r}")


def check_available(kind: str):
    """ReporterUnavailable (one line) when the chosen logger's package is missing: train.py calls it before the
    run starts, make_reporter again for callers that did not."""
    module = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(kind)
    if module is None:
        return
    import importlib.util
    import sys
    if module not in sys.modules and importlib.util.find_spec(module) is None:
        raise ReporterUnavailable(f"--report-to {kind} needs the {module} package ({INSTALL})")

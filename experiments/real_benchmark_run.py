"""A GRPO run of a real model on a real benchmark, summarised: per-step curves, held-out evaluation before and after.

    python -m experiments.real_benchmark_run --run runs/smol-bfcl-simple --eval base=runs/eval/smol-base \
        --eval warm-start=runs/eval/smol-warm --eval after-grpo=runs/eval/smol-grpo --out results/smol_bfcl

Reads RUN/metrics.jsonl (train.py's per-step lines) and each evaluate.py output folder's summary.json, and
writes OUT/run.json (the run's config, every step's reward, success, flat-group share, world-model fidelity,
timings; the held-out evaluations) and OUT/curves.png (matplotlib optional: requirements-plot.txt). Nothing is
recomputed: the numbers are the ones train.py and evaluate.py wrote.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STEP_KEYS = ("reward_mean", "success_rate", "flat_group_share", "act_tokens", "world_tokens", "signal_tokens",
             "no_signal", "loss", "kl", "grad_norm", "t_rollout", "t_update", "t_step", "end_reasons")


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of a file (a torn last line, from a run stopped mid-write, is left out)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def world_fidelity(record: dict) -> dict:
    """{"calls", "exact", "error_correct"} over every tool of one GRPO step (calls-weighted), None-free."""
    calls = {k.split("/", 1)[1]: n for k, n in record.items() if k.startswith("fidelity_n/")}
    n = sum(calls.values())
    if not n:
        return {"calls": 0, "exact": None, "error_correct": None}
    mean = lambda key: sum(record[f"{key}/{t}"] * c for t, c in calls.items()) / n  # noqa: E731
    return {"calls": n, "exact": mean("fidelity_exact"), "error_correct": mean("fidelity_error")}


def grpo_curve(metrics: list[dict]) -> list[dict]:
    """One point per GRPO step: the run's own numbers plus the step's world-model fidelity."""
    return [{"step": r["step"], **{k: r.get(k) for k in STEP_KEYS}, "fidelity": world_fidelity(r)}
            for r in metrics if r.get("phase") == "grpo"]


def held_out(folder: Path) -> dict:
    """The overall figures of an evaluate.py run (its first budget) and what it evaluated."""
    summary = json.loads((folder / "summary.json").read_text())
    label, run = next(iter(summary["runs"].items()))
    return {"model": summary["model"], "bench": summary["bench"], "split": summary["split"],
            "tasks": summary["tasks"], "budget": label, "sampling": summary["sampling"],
            "overall": run["overall"], "seconds": summary["seconds"]}


def plot(curve: list[dict], path: Path) -> Path | None:
    """reward, success, flat-group share and world-model exact fidelity per GRPO step; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [p["step"] for p in curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("reward_mean", "reward (mean)"), ("success_rate", "success"),
                       ("flat_group_share", "flat-group share")):
        ax.plot(steps, [p[key] for p in curve], marker="o", ms=3, label=label)
    ax.plot(steps, [p["fidelity"]["exact"] for p in curve], marker="s", ms=3, label="world-model exact fidelity")
    ax.set_xlabel("train.py step (GRPO steps follow the warm start)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    """Read the run and its evaluations, write run.json and curves.png."""
    ap = argparse.ArgumentParser(prog="python -m experiments.real_benchmark_run", description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="train.py run folder (metrics.jsonl, config.json)")
    ap.add_argument("--eval", action="append", default=[], metavar="LABEL=FOLDER",
                    help="an evaluate.py output folder (summary.json) under a label; repeatable")
    ap.add_argument("--hardware", default="", help="where it was measured, e.g. '2-core x86, one core, shared'")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    run, out = Path(args.run), Path(args.out)
    if not (run / "metrics.jsonl").exists():
        ap.error(f"{run} has no metrics.jsonl: not a train.py run folder")
    metrics = read_jsonl(run / "metrics.jsonl")
    evals = {}
    for item in args.eval:
        label, sep, folder = item.partition("=")
        if not sep or not (Path(folder) / "summary.json").exists():
            ap.error(f"--eval {item!r}: expected LABEL=FOLDER holding an evaluate.py summary.json")
        evals[label] = held_out(Path(folder))
    curve = grpo_curve(metrics)
    sft = [r for r in metrics if r.get("phase") == "sft"]
    report = {"run": str(run), "hardware": args.hardware,
              "config": json.loads((run / "config.json").read_text()),
              "warm_start": {"steps": len(sft), "first_loss": sft[0]["loss"] if sft else None,
                             "last_loss": sft[-1]["loss"] if sft else None,
                             "seconds": sum(r.get("t_step", 0) for r in sft)},
              "grpo": curve, "grpo_seconds": sum(p["t_step"] or 0 for p in curve), "held_out": evals}
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(report, indent=1) + "\n")
    png = plot(curve, out / "curves.png") if curve else None
    print(f"wrote {out / 'run.json'}" + (f" and {png}" if png else " (no plot: matplotlib missing or no GRPO step)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

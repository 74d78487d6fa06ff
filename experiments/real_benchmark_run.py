"""GRPO runs of a real model on a real benchmark, summarised: per-step curves, held-out evaluations with 95%
intervals, and paired differences against a baseline evaluation (the same tasks and seeds).

    python -m experiments.real_benchmark_run --run real=runs/smol-real --eval warm-start=runs/eval/warm \
        --eval real=runs/eval/real --baseline warm-start --out results/smol_bfcl_real

Reads each RUN/metrics.jsonl (train.py's per-step lines) and each evaluate.py output folder (summary.json and
its trajectories), and writes OUT/run.json (each run's config and every step's diagnostics; each held-out
evaluation's success with its interval; each evaluation minus the baseline, paired) and OUT/curves.png
(matplotlib optional: requirements-plot.txt). The figures are the ones train.py and evaluate.py wrote; only
the intervals are computed here (intervals.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import intervals

STEP_KEYS = ("reward_mean", "reward_std", "success_rate", "flat_group_share", "entropy", "response_tokens",
             "act_tokens", "world_tokens", "signal_tokens", "no_signal", "loss", "kl", "clip_frac", "grad_norm",
             "logp_mismatch", "t_rollout", "t_update", "t_step", "end_reasons")


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


def held_out(folder: Path) -> tuple[dict, dict]:
    """The overall figures of an evaluate.py run (its first budget) with a 95% interval over its tasks, and its
    per-task rewards (for pairing)."""
    summary = json.loads((folder / "summary.json").read_text())
    label, run = next(iter(summary["runs"].items()))
    records = [r for path in sorted(folder.glob(f"trajectories_B{label.split('=')[-1]}_*.jsonl"))
               for r in read_jsonl(path)]
    per_task = intervals.per_task_rewards(records) if records else {}
    rate = intervals.success_interval(per_task) if per_task else None
    return {"model": summary["model"], "bench": summary["bench"], "split": summary["split"],
            "tasks": summary["tasks"], "budget": label, "sampling": summary["sampling"],
            "overall": run["overall"], "seconds": summary["seconds"],
            "success": None if rate is None else {"mean": rate.mean, "lo": rate.lo, "hi": rate.hi,
                                                  "tasks": rate.tasks, "method": rate.method}}, per_task


def paired(per_task: dict, baseline: str) -> dict:
    """Every evaluation minus the baseline on the tasks both hold: the paired-bootstrap interval and counts."""
    out = {}
    for label, tasks in per_task.items():
        if label == baseline or not tasks or not per_task.get(baseline):
            continue
        d = intervals.paired_difference(tasks, per_task[baseline])
        out[f"{label} - {baseline}"] = {"diff": d.diff, "lo": d.lo, "hi": d.hi, "tasks": d.tasks,
                                        "better": d.better, "worse": d.worse, "resolved": d.resolved,
                                        "text": str(d)}
    return out


def plot(curves: dict, evals: dict, path: Path) -> Path | None:
    """Left: each run's training reward and flat-group share per GRPO step. Right: held-out success of each
    evaluation with its 95% interval. None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    for name, curve in curves.items():
        steps = [p["step"] for p in curve]
        line, = left.plot(steps, [p["reward_mean"] for p in curve], marker="o", ms=3, label=f"{name}: reward")
        left.plot(steps, [p["flat_group_share"] for p in curve], ls=":", color=line.get_color(),
                  label=f"{name}: flat-group share")
    left.set_xlabel("train.py step (GRPO steps follow the warm start)")
    left.set_ylim(-0.05, 1.05)
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    shown = [(k, v["success"]) for k, v in evals.items() if v["success"]]
    for i, (label, r) in enumerate(shown):
        right.errorbar([i], [r["mean"]], yerr=[[r["mean"] - r["lo"]], [r["hi"] - r["mean"]]], fmt="o", capsize=4)
    right.set_xticks(range(len(shown)), [k for k, _ in shown], rotation=20, fontsize=8)
    right.set_ylabel("held-out success (95% interval)")
    right.set_ylim(-0.05, 1.05)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    """Read the run and its evaluations, write run.json and curves.png."""
    ap = argparse.ArgumentParser(prog="python -m experiments.real_benchmark_run", description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", default=[], metavar="[LABEL=]FOLDER",
                    help="a train.py run folder (metrics.jsonl, config.json), optionally labelled; repeatable")
    ap.add_argument("--eval", action="append", default=[], metavar="LABEL=FOLDER",
                    help="an evaluate.py output folder (summary.json) under a label; repeatable")
    ap.add_argument("--baseline", default=None, metavar="LABEL",
                    help="the --eval every other one is paired against (default: the first)")
    ap.add_argument("--hardware", default="", help="where it was measured, e.g. '2-core x86, one core, shared'")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not args.run:
        ap.error("give at least one --run FOLDER")
    runs = {}
    for item in args.run:
        label, sep, folder = item.rpartition("=") if "=" in item else ("", "", item)
        run = Path(folder)
        if not (run / "metrics.jsonl").exists():
            ap.error(f"--run {item!r}: {run} has no metrics.jsonl: not a train.py run folder")
        runs[label or run.name] = run
    evals, per_task = {}, {}
    for item in args.eval:
        label, sep, folder = item.partition("=")
        if not sep or not (Path(folder) / "summary.json").exists():
            ap.error(f"--eval {item!r}: expected LABEL=FOLDER holding an evaluate.py summary.json")
        evals[label], per_task[label] = held_out(Path(folder))
    baseline = args.baseline or next(iter(evals), None)
    if baseline is not None and baseline not in evals:
        ap.error(f"--baseline {baseline!r} is not one of the --eval labels {sorted(evals)}")
    reports, curves = {}, {}
    for name, run in runs.items():
        metrics = read_jsonl(run / "metrics.jsonl")
        curves[name] = curve = grpo_curve(metrics)
        sft = [r for r in metrics if r.get("phase") == "sft"]
        reports[name] = {"run": str(run), "config": json.loads((run / "config.json").read_text()),
                         "warm_start": {"steps": len(sft), "first_loss": sft[0]["loss"] if sft else None,
                                        "last_loss": sft[-1]["loss"] if sft else None,
                                        "seconds": sum(r.get("t_step", 0) for r in sft)},
                         "grpo": curve, "grpo_seconds": sum(p["t_step"] or 0 for p in curve)}
    report = {"hardware": args.hardware, "runs": reports, "held_out": evals,
              "paired": paired(per_task, baseline) if baseline else {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(report, indent=1) + "\n")
    for label, e in evals.items():
        r = e["success"]
        print(f"{label}: " + (f"{r['mean']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] on {r['tasks']} tasks" if r
                              else f"{e['overall']['success']:.3f} (no trajectories: no interval)"))
    for key, d in report["paired"].items():
        print(f"{key}: {d['text']}")
    png = plot(curves, evals, out / "curves.png") if curves or evals else None
    print(f"wrote {out / 'run.json'}" + (f" and {png}" if png else " (no plot: matplotlib missing)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

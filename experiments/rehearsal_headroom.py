"""What private rehearsal adds on the toy world, against what a perfect world model would let it add.

    python -m experiments.rehearsal_headroom --model runs/tiny-toyworld/ckpt/step_000030 --out results/rehearsal_headroom

For each family set (classic: the eight original families; costly: the strict ones, where an errored call or a
wrong write fails the task) and each rehearsal variant (the world model's own rehearsals or the oracle's, judged
by the policy's assessment or by the rehearsed response, or condensed into the paper's memory), evaluate.py runs
once per budget on the same held-out tasks and seeds; B=0 once per family set, since it does not rehearse. Every
(set, variant, budget) is its own evaluate.py folder under OUT/runs/, so a stopped run continues where it stopped.
Then OUT/headroom.json holds each run's success with its 95% interval and every B vs B=0 paired difference
(intervals.py), and OUT/table.md the same as a table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from intervals import paired_difference, per_task_rewards, success_interval

ROOT = Path(__file__).resolve().parent.parent
FAMILY_SETS = {"classic": "classic", "costly": "costly"}
# variant -> evaluate.py flags: who writes the rehearsed responses, and what decides to commit a proposal
VARIANTS = {
    "model": ["--world-model", "shared", "--rehearsal-judge", "assessment"],
    "model, prediction judge": ["--world-model", "shared", "--rehearsal-judge", "prediction"],
    "oracle": ["--world-model", "oracle", "--rehearsal-judge", "assessment"],
    "oracle, prediction judge": ["--world-model", "oracle", "--rehearsal-judge", "prediction"],
    # the paper's commit: every rehearsal condensed into one memory that conditions one committed turn
    "model, memory commit": ["--world-model", "shared", "--rehearsal-commit", "memory"],
    "oracle, memory commit": ["--world-model", "oracle", "--rehearsal-commit", "memory"],
}


def run_dir(out: Path, family_set: str, variant: str, budget: int) -> Path:
    name = "B0" if budget == 0 else f"{variant.replace(', ', '-').replace(' ', '-')}-B{budget}"
    return out / "runs" / family_set / name


def evaluate(model: str, family_set: str, variant: str, budget: int, args) -> Path:
    """One evaluate.py run (skipped when its summary exists); its folder."""
    folder = run_dir(args.out, family_set, variant, budget)
    if (folder / "summary.json").exists():
        return folder
    cmd = [sys.executable, "evaluate.py", "--model", model, "--limit", str(args.limit), "--seed", str(args.seed),
           "--task-opts", f"families={FAMILY_SETS[family_set]}", "--rehearsal-budget", str(budget),
           "--no-fidelity", "--out", str(folder)]
    if budget:
        cmd += VARIANTS[variant]
    t0 = time.perf_counter()
    log = folder.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"evaluate.py failed ({rc}) for {family_set} {variant} B={budget}: see {log}")
    print(f"{family_set} {variant if budget else ''} B={budget}: {time.perf_counter() - t0:.0f} s", flush=True)
    return folder


def records(folder: Path) -> list[dict]:
    (jsonl,) = folder.glob("trajectories_*.jsonl")
    return [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()]


def summarize(args) -> dict:
    """Each run's success with its interval and diagnostics, each B vs B=0 paired, per family set."""
    out = {"model": args.model_label, "tasks": args.limit, "seed": args.seed, "sets": {}}
    for family_set in args.sets:
        if not (run_dir(args.out, family_set, "", 0) / "summary.json").exists():
            continue                                 # not reached yet (the runs go set by set)
        base = per_task_rewards(records(run_dir(args.out, family_set, "", 0)))
        entry = {"B=0": {**vars(success_interval(base)), "seconds": seconds(run_dir(args.out, family_set, "", 0))}}
        for variant in args.variants:
            for b in args.budgets:
                folder = run_dir(args.out, family_set, variant, b)
                if not (folder / "summary.json").exists():
                    continue
                recs = records(folder)
                rewards = per_task_rewards(recs)
                summary = json.loads((folder / "summary.json").read_text())
                (run,) = summary["runs"].values()
                diag = run.get("rehearsal_diagnostics", {})
                entry[f"{variant} B={b}"] = {
                    **vars(success_interval(rewards)),
                    "vs_B0": vars(paired_difference(rewards, base)),
                    "changed": diag.get("changed"), "helped": diag.get("helped"), "hurt": diag.get("hurt"),
                    "rehearsed_turns": diag.get("rehearsed_turns"), "seconds": seconds(folder)}
        out["sets"][family_set] = entry
    return out


def seconds(folder: Path) -> float:
    return round(json.loads((folder / "summary.json").read_text())["seconds"], 1)


def table(result: dict) -> str:
    lines = [f"Model `{result['model']}`, {result['tasks']} held-out tasks per family set, seed {result['seed']}; "
             "success [95% interval]; B vs B=0 paired on the same tasks and seeds [95% paired-bootstrap interval]; "
             "changed / helped / hurt: rehearsed turns whose committed call differs from the first proposal, and "
             "whether that changed the real outcome for the better or the worse.", "",
             "| family set | run | success | − B=0 | better / worse tasks | changed / helped / hurt | seconds |",
             "|---|---|---|---|---|---|---|"]
    for family_set, entry in result["sets"].items():
        for label, r in entry.items():
            d = r.get("vs_B0")
            diff = "" if d is None else (f"{d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]"
                                         + ("" if d["lo"] > 0 or d["hi"] < 0 else " no difference"))
            counts = "" if d is None else f"{d['better']} / {d['worse']}"
            changes = "" if r.get("changed") is None else f"{r['changed']} / {r['helped']} / {r['hurt']}"
            lines.append(f"| {family_set} | {label} | {r['mean']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}] | {diff} | "
                         f"{counts} | {changes} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the checkpoint to evaluate")
    ap.add_argument("--model-label", default="", help="how the results name the model (default: --model)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", default="1,2")
    ap.add_argument("--sets", default="classic,costly")
    ap.add_argument("--variants", default="all", help=f"'all' or a ';'-separated list of: {'; '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.sets = args.sets.split(",")
    args.variants = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(";")]
    bad = [v for v in args.variants if v not in VARIANTS] + [s for s in args.sets if s not in FAMILY_SETS]
    if bad:
        ap.error(f"unknown variant or family set: {', '.join(bad)}")
    args.model_label = args.model_label or args.model
    for family_set in args.sets:
        evaluate(args.model, family_set, "", 0, args)
        for b in args.budgets:
            for variant in args.variants:
                evaluate(args.model, family_set, variant, b, args)
                result = summarize(args)
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "headroom.json").write_text(json.dumps(result, indent=1) + "\n")
                (args.out / "table.md").write_text(table(result))
    print(table(summarize(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

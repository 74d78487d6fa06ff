"""The miniature of the paper's claims, on the embedded toy world with the tiny model (CPU).

    python bench/experiment.py                      # 3 seeds; writes runs/experiment/results.{md,json}
    python bench/experiment.py --seeds 0 --grpo-steps 10 --eval-limit 16    # a quick look

Per seed: one supervised warm start (reference trajectories, act + world turns), then three arms with the
same GRPO budget from that checkpoint:
  grpo-real   standard GRPO, the real environment answers every call   (--env real --train-roles act)
  envace      rehearsal only during training, both roles trained       (--env rehearse --train-roles act,world)
  act-only    rehearsal during training, only actor tokens trained     (--env rehearse --train-roles act)
Each final checkpoint (and the warm start) is evaluated on held-out test tasks with committed execution on
the real environment, private-rehearsal budgets 0/1/2/4 (parallel and sequential), and world-model fidelity.
Reported as mean ± std over seeds. Whatever the numbers say is the result.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = {
    "grpo-real": ["--env", "real", "--train-roles", "act"],
    "envace": ["--env", "rehearse", "--train-roles", "act,world"],
    "act-only": ["--env", "rehearse", "--train-roles", "act"],
}


def run(cmd: list[str], log: Path):
    t0 = time.time()
    with open(log, "w") as f:
        res = subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if res.returncode != 0:
        raise SystemExit(f"failed ({res.returncode}): {' '.join(cmd)}; see {log}")
    print(f"  {time.time() - t0:6.0f}s  {' '.join(cmd)}", flush=True)


def latest(run_dir: Path) -> Path:
    return run_dir / (run_dir / "latest").read_text().strip()


def evaluate(ckpt: Path, out: Path, args, seed: int) -> dict:
    """Budgets 0,1,2,4 parallel and 1,2,4 sequential on the same tasks and seed; returns {label: summary}."""
    results = {}
    out.mkdir(parents=True, exist_ok=True)
    for mode, budgets in (("parallel", args.budgets), ("sequential", args.seq_budgets)):
        if not budgets:
            continue
        dest = out / mode
        if not (dest / "summary.json").exists():
            run(["evaluate.py", "--model", str(ckpt), "--limit", str(args.eval_limit), "--seed", str(seed),
                 "--compare", ",".join(map(str, budgets)), "--rehearsal-mode", mode, "--out", str(dest),
                 "--temperature", str(args.eval_temperature),
                 *(["--opt", f"families={args.families}"] if args.families else [])], out / f"eval-{mode}.log")
        summary = json.loads((dest / "summary.json").read_text())
        for label, s in summary.get("runs", summary).items():
            results[f"{mode}/{label}" if mode == "sequential" else label] = s
    return results


def success_of(s: dict) -> float | None:
    for key in ("success", "avg@k", "pass^1"):
        if isinstance(s.get(key), (int, float)):
            return float(s[key])
    overall = s.get("overall", {})
    return float(overall["success"]) if isinstance(overall.get("success"), (int, float)) else None


def fidelity_of(s: dict) -> float | None:
    fid = s.get("fidelity") or s.get("overall", {}).get("fidelity") or {}
    v = fid.get("exact") if isinstance(fid, dict) else None
    return float(v) if isinstance(v, (int, float)) else None


def mean_std(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--grpo-steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--tasks-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--eval-limit", type=int, default=32)
    ap.add_argument("--eval-temperature", type=float, default=0.6)
    ap.add_argument("--budgets", default="0,1,2,4", help="parallel budgets evaluated")
    ap.add_argument("--seq-budgets", default="1,2,4", help="sequential budgets evaluated ('' for none)")
    ap.add_argument("--warm-start", default="", help="use this checkpoint as every seed's warm start "
                    "instead of training one per seed (the GRPO seeds still differ)")
    ap.add_argument("--families", default="", help="restrict train and test tasks to these toy-world families")
    ap.add_argument("--out", default="runs/experiment")
    args = ap.parse_args(argv)
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.seq_budgets = [int(b) for b in args.seq_budgets.split(",") if b.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    table: dict[str, dict[str, list]] = {}
    curves: dict[str, dict[int, list]] = {}
    for seed in seeds:
        print(f"seed {seed}", flush=True)
        if args.warm_start:
            warm = Path(args.warm_start).resolve()
        else:
            sft = out / f"sft-s{seed}"
            if not (sft / "latest").exists():
                run(["train.py", "--out", str(sft), "--overwrite", "--seed", str(seed), "--sft-steps",
                     str(args.sft_steps), "--steps", "0", "--save-every", str(args.sft_steps)],
                    out / f"sft-s{seed}.log")
            warm = latest(sft)
        arms = {"warm-start": warm}
        for arm, flags in ARMS.items():
            rd = out / f"{arm}-s{seed}"
            if not (rd / "latest").exists() or not (latest(rd) / "state.json").exists() or \
                    json.loads((latest(rd) / "state.json").read_text())["step"] < args.grpo_steps:
                run(["train.py", "--model", str(warm), "--out", str(rd), "--overwrite", "--seed", str(seed),
                     "--sft-steps", "0", "--steps", str(args.grpo_steps), "--lr", str(args.lr),
                     "--tasks-per-step", str(args.tasks_per_step), "--group-size", str(args.group_size),
                     "--save-every", str(args.grpo_steps), *flags,
                     *(["--task-opts", f"families={args.families}"] if args.families else [])],
                    out / f"{arm}-s{seed}.log")
            arms[arm] = latest(rd)
            for line in (rd / "metrics.jsonl").read_text().splitlines():
                rec = json.loads(line)
                curves.setdefault(arm, {}).setdefault(rec["step"], []).append(rec.get("success_rate"))
        for arm, ckpt in arms.items():
            res = evaluate(ckpt, out / f"eval-{arm}-s{seed}", args, seed)
            for label, s in res.items():
                table.setdefault(arm, {}).setdefault(f"success {label}", []).append(success_of(s))
                if label == "B=0":
                    table[arm].setdefault("fidelity exact (B=0)", []).append(fidelity_of(s))
    cols = sorted({c for row in table.values() for c in row})
    lines = ["| arm | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for arm, row in table.items():
        lines.append(f"| {arm} | " + " | ".join(mean_std(row.get(c, [])) for c in cols) + " |")
    lines += ["", "Training success rate (rollouts of the step; rehearsal arms scored by the verifier), "
              "mean over seeds, every 5 steps:", "", "| step | " + " | ".join(curves) + " |",
              "|---" * (len(curves) + 1) + "|"]
    steps = sorted({s for c in curves.values() for s in c})
    for st in steps[::5] + ([steps[-1]] if steps and steps[-1] not in steps[::5] else []):
        lines.append(f"| {st} | " + " | ".join(mean_std(curves[a].get(st, [])) for a in curves) + " |")
    text = "\n".join(lines)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"table": table, "curves": curves, "args": vars(args)}, indent=1))
    print(text)


if __name__ == "__main__":
    main()

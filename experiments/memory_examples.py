"""Do memory examples built from the model's own rehearsals change what test-time rehearsal does?

    python -m experiments.memory_examples --warm-start runs/ws-skip-price/ckpt/step_001500 --steps 200

The warm start's memory examples (warm_start.warm_start_examples) hold, by default, the REAL response of each
proposal and a rule-made judgement, while at test time the memory holds the model's own predictions. Two
continuations of one warm start, identical but for `--sft-memory real|self` (same seed, so the same task
draws), then each evaluated on the same held-out tasks at B=0 and B=2 (parallel) with the rehearsal
diagnostics (evaluate.py: does the assessment agree with the real outcome; how often does the committed call
differ from the first proposal, and did that help or hurt). One JSON per arm in --results; an arm whose JSON
exists is skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIAGNOSTICS = ("assess_agree_rate", "changed_rate", "helped_rate", "hurt_rate", "changed", "helped", "hurt",
               "assessed", "rehearsed_turns")


def run(cmd: list[str], log: Path) -> float:
    """`python cmd...` in the repository root, output to `log` (raises on failure); its wall seconds."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run([sys.executable, *cmd], cwd=ROOT, check=True, stdout=f, stderr=subprocess.STDOUT)
    return round(time.perf_counter() - t0, 1)


def main(argv=None):
    """Per --sft-memory (real, self): continue the warm start, evaluate at B=0 and B=--budget, write the arm's
    JSON; an arm whose JSON exists is skipped."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm-start", required=True)
    ap.add_argument("--steps", type=int, default=200, help="continued warm-start steps per arm")
    ap.add_argument("--rehearsal-frac", type=float, default=0.25, help="share of rehearsal-format examples (the "
                    "tiny default; a checkpoint folder would otherwise get 0, and the flag would change nothing)")
    ap.add_argument("--budget", type=int, default=2)
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default="runs/memory_examples")
    ap.add_argument("--results", default="results/memory_examples")
    ap.add_argument("--host", default="2 cores of a shared x86 host")
    args = ap.parse_args(argv)
    runs, results = ROOT / args.runs, ROOT / args.results
    runs.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    for memory in ("real", "self"):
        path = results / f"{memory}.json"
        if path.exists():
            print(f"{memory}: {path} exists, skipped")
            continue
        out = runs / memory
        train_cmd = ["train.py", "--model", args.warm_start, "--out", str(out), "--overwrite", "--seed",
                     str(args.seed), "--sft-steps", str(args.steps), "--steps", "0", "--save-every",
                     str(args.steps), "--sft-memory", memory, "--sft-rehearsal-frac", str(args.rehearsal_frac)]
        t_train = run(train_cmd, runs / f"{memory}.train.log")
        ckpt = out / (out / "latest").read_text().strip()
        eval_cmd = ["evaluate.py", "--model", str(ckpt), "--limit", str(args.limit), "--seed", str(args.seed),
                    "--compare", f"0,{args.budget}", "--no-fidelity", "--out", str(out / "eval")]
        t_eval = run(eval_cmd, runs / f"{memory}.eval.log")
        summary = json.loads((out / "eval" / "summary.json").read_text())
        result = {"sft_memory": memory, "warm_start": args.warm_start, "continued_steps": args.steps,
                  "seed": args.seed, "tasks": args.limit, "host": args.host,
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
                  "train_command": " ".join(train_cmd), "eval_command": " ".join(eval_cmd),
                  "train_seconds": t_train, "eval_seconds": t_eval,
                  "success": {label: r["overall"]["success"] for label, r in summary["runs"].items()},
                  "rehearsal_diagnostics": {k: v for k, v in summary["runs"][f"B={args.budget}"]
                                            .get("rehearsal_diagnostics", {}).items() if k in DIAGNOSTICS}}
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()

"""The GRPO step-size check: held-out success of the real arm after 100 steps at each learning rate, paired
against the warm start it began from, beside the training diagnostics of each run.

    python -m experiments.grpo_step_size            # reads results/grpo_lr, writes its summary.json and table.md

Each lr folder holds the run's metrics.jsonl and its experiment piece (the held-out evaluation, per task); the
run at 3e-4 is the ablation's real arm, seed 0 (results/ablation/classic/real-s0.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from intervals import paired_difference, success_interval

ROOT = Path(__file__).resolve().parent.parent
PIECES = {"3e-4": "results/ablation/classic/real-s0.json", "1e-4": "results/grpo_lr/lr1e-4/classic/real-s0.json",
          "3e-5": "results/grpo_lr/lr3e-5/classic/real-s0.json"}
WARM_START = "results/ablation/classic/warm-start.json"
DIAGNOSTICS = ("success_rate", "reward_mean", "reward_std", "flat_group_share", "kl", "entropy", "grad_norm",
               "response_tokens")


def window_means(records: list[dict], size: int = 10) -> dict:
    """Each diagnostic's mean over the first and the last `size` steps (None where the run did not log it)."""
    out = {}
    for key in DIAGNOSTICS:
        vals = [r.get(key) for r in records]
        if any(v is None for v in vals):
            out[key] = None
            continue
        out[key] = {"first": sum(vals[:size]) / len(vals[:size]), "last": sum(vals[-size:]) / len(vals[-size:])}
    return out


def summarize(root: Path = ROOT) -> dict:
    warm = json.loads((root / WARM_START).read_text())["held_out"]["B=0"]["per_task"]
    rows = {}
    for lr, piece in PIECES.items():
        held = json.loads((root / piece).read_text())["held_out"]["B=0"]["per_task"]
        metrics = [json.loads(x) for x in (root / f"results/grpo_lr/lr{lr}/metrics.jsonl").read_text().splitlines()]
        rate, diff = success_interval(held), paired_difference(held, warm)
        rows[lr] = {"piece": piece, "held_out": dataclasses.asdict(rate), "minus_warm_start": dataclasses.asdict(diff),
                    "training": window_means(metrics), "steps": len(metrics)}
    return {"warm_start": {"piece": WARM_START, "held_out": dataclasses.asdict(success_interval(warm))}, "runs": rows}


def table(s: dict) -> str:
    w = s["warm_start"]["held_out"]
    lines = [f"Warm start: held-out success {w['mean']:.3f} [{w['lo']:.3f}, {w['hi']:.3f}] on {w['tasks']} tasks.", "",
             "| lr | held-out B=0 [95%] | − warm start [95% paired] | train success first→last 10 | KL last 10 "
             "| entropy first→last 10 |", "|---|---|---|---|---|---|"]
    for lr, r in s["runs"].items():
        h, d, t = r["held_out"], r["minus_warm_start"], r["training"]
        ent = t["entropy"]
        lines.append(f"| {lr} | {h['mean']:.3f} [{h['lo']:.3f}, {h['hi']:.3f}] | {d['diff']:+.3f} "
                     f"[{d['lo']:+.3f}, {d['hi']:+.3f}] ({d['better']} better, {d['worse']} worse) | "
                     f"{t['success_rate']['first']:.3f} → {t['success_rate']['last']:.3f} | {t['kl']['last']:.3f} | "
                     + ("-" if ent is None else f"{ent['first']:.3f} → {ent['last']:.3f}") + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/grpo_lr", help="where summary.json and table.md go")
    args = ap.parse_args(argv)
    s = summarize()
    out = ROOT / args.out
    (out / "summary.json").write_text(json.dumps(s, indent=1))
    (out / "table.md").write_text(table(s))
    print(table(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

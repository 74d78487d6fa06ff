"""Evaluation throughput: tasks batched across one engine batch vs one task at a time, same results.

    python -m perf.eval_speed                      # 32 toy-world tasks, B=0 and B=2, the tiny model
    python -m perf.eval_speed --model runs/tiny-toyworld/ckpt/step_001630 --budgets 0,2,4

Prints tasks/s of each way, their ratio (target: >= 3x at B=0 and B=2) and whether every episode's tokens
are identical. Ratios are measured in one run; absolute speeds depend on the machine. The ratio of the
process's CPU seconds is written too: on a shared host, where other jobs take the core now and then, it
moves less than the wall-clock one.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import policy
from bench import toyworld
from rehearse import EpisodeSpec, RehearsalConfig, act, act_many
from rollout import Engine, SamplingConfig

TARGET = 3.0


def run(eng, n_tasks: int, budget: int, max_rows: int, seed: int) -> dict:
    """Run the same toy-world episodes one task at a time and batched (act_many) at one budget: times, ratios,
    whether every episode's ids are identical, and the success rate."""
    tasks = toyworld.load_tasks("test", limit=n_tasks)
    specs = [EpisodeSpec(t, SamplingConfig(temperature=0.6, top_p=0.95, max_new_tokens=48, max_world_tokens=32,
                                           max_turns=8, max_total_len=2048, seed=seed + i), make_env=toyworld.make_env)
             for i, t in enumerate(tasks)]
    rcfg = RehearsalConfig(budget=budget, fidelity=False)
    t0, c0 = time.perf_counter(), time.process_time()
    alone = [act(eng, s.task, s.cfg, s.make_env(s.task), rcfg) for s in specs]
    t_alone, c_alone = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    together = act_many(eng, specs, rcfg, max_rows=max_rows)
    t_batched, c_batched = time.perf_counter() - t0, time.process_time() - c0
    identical = all(torch.equal(a.rollout.ids, b.rollout.ids) for a, b in zip(alone, together))
    return {"budget": budget, "tasks": n_tasks, "max_rows": max_rows, "one_at_a_time_s": round(t_alone, 2),
            "batched_s": round(t_batched, 2), "tasks_per_s_alone": round(n_tasks / t_alone, 3),
            "tasks_per_s_batched": round(n_tasks / t_batched, 3), "ratio": round(t_alone / t_batched, 2),
            "cpu_one_at_a_time_s": round(c_alone, 2), "cpu_batched_s": round(c_batched, 2),
            "cpu_ratio": round(c_alone / c_batched, 2),
            "identical": identical,
            "success": sum(toyworld.score(s.task, ep.trajectory).reward for s, ep in zip(specs, together)) / n_tasks}


def main(argv=None):
    """Load the model, run every budget, print the table and optionally write the rows as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tasks", type=int, default=32)
    ap.add_argument("--budgets", default="0,2")
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok = policy.load_policy(args.model)
    eng = Engine(model.eval(), tok)
    rows = [run(eng, args.tasks, int(b), args.max_rows, args.seed) for b in args.budgets.split(",")]
    print(f"{'B':>3} {'tasks':>5} {'alone s':>8} {'batched s':>9} {'ratio':>6} {'cpu ratio':>9} {'identical':>9}  "
          f"target >= {TARGET}x")
    for r in rows:
        met = "met" if r["ratio"] >= TARGET else "NOT met"
        print(f"{r['budget']:>3} {r['tasks']:>5} {r['one_at_a_time_s']:>8} {r['batched_s']:>9} {r['ratio']:>5}x "
              f"{r['cpu_ratio']:>8}x {str(r['identical']):>9}  {met}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()

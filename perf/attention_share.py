"""How much of a multi-turn rollout is attention, and so how fast the engine can be against HF per-row generate.

    python -m perf.attention_share                                   # tau2 airline, 8 tasks x G=4, 8 turns
    python -m perf.attention_share --tasks 2 --group 4 --turns 3     # the same cell, smaller (~2 min)
    python -m perf.attention_share --workload toyworld --quick       # seconds (the test suite's run)

The same scripted rollout as perf/speed.py's rollout cells, run twice in one process: by the engine
(rollout.Engine) and by HF generate per row reusing its cache (perf.speed.hf_row_cache, the `rowcache`
baseline). Every scaled_dot_product_attention call is timed and sized (query positions x key columns, summed
over rows), split into decode (one query position) and feeds (prefill, observations). Why: batching rows
saves the weights' reads and the per-call overheads, not attention. A decode step reads every row's keys and
values however rows are grouped, and a feed attends over its row's context either way. So the engine's time
can not go below its own attention time, and

    bound = HF's wall time / the engine's attention time

is the most the engine could gain at this cell if everything but attention cost nothing. Prints the table and
writes --out (JSON).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from perf import speed
from rollout import Engine, SamplingConfig


@contextlib.contextmanager
def timed_attention(model, sums: dict):
    """Within the block, every torch SDPA call adds to sums[(who, "decode"|"feed")] = [calls, seconds, q*kv],
    `who` read from sums["who"] at call time. The kind and query length come from the model call's input ids
    (a decode query may be reshaped on the way: transformers packs a GQA decode step's heads as positions)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    current = {"q": 1}

    def note_input(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        current["q"] = ids.shape[-1]

    def timed(query, key, value, *args, **kwargs):
        t0 = time.perf_counter()
        out = sdpa(query, key, value, *args, **kwargs)
        entry = sums.setdefault((sums["who"], "decode" if current["q"] == 1 else "feed"), [0, 0.0, 0])
        entry[0] += 1
        entry[1] += time.perf_counter() - t0
        entry[2] += query.shape[0] * current["q"] * key.shape[-2]
        return out

    hook = model.register_forward_pre_hook(note_input, with_kwargs=True)
    torch.nn.functional.scaled_dot_product_attention = timed
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        hook.remove()


def attention_share(model, tok, workload, group: int, turns: int) -> dict:
    """Wall seconds of the engine and of HF per-row generate on one cell, each split into attention (decode,
    feeds) and the rest; the ids checked identical; the bound."""
    cfg = SamplingConfig(greedy=True, max_new_tokens=max(48, workload.longest_turn(tok) + 8),
                         max_total_len=model.config.max_position_embeddings, seed=0)
    sums: dict = {"who": "engine"}
    speed.run_engine(model, tok, workload, 2, 2, cfg, True)          # warm-up (first-call overheads)
    with torch.no_grad(), timed_attention(model, sums):
        t0 = time.perf_counter()
        ref = speed.run_engine(model, tok, workload, group, turns, cfg, True)
        engine_s = time.perf_counter() - t0
        sums["who"] = "rowcache"
        t0 = time.perf_counter()
        out = speed.hf_row_cache(model, tok, Engine(model, tok), workload, group, ref, cfg, turns)
        rowcache_s = time.perf_counter() - t0
    result = {"workload": workload.name, "tasks": len(workload.tasks), "group": group, "turns": turns,
              "context_tokens": int(ref.lengths.float().mean()), "identical_ids": out["turns_mismatched"] == 0}
    for who, wall in (("engine", engine_s), ("rowcache", rowcache_s)):
        parts = {}
        for kind in ("decode", "feed"):
            calls, seconds, q_kv = sums.get((who, kind), (0, 0.0, 0))
            parts[kind] = {"calls": calls, "seconds": seconds, "q_kv_millions": q_kv / 1e6}
        attention = parts["decode"]["seconds"] + parts["feed"]["seconds"]
        result[who] = {"seconds": wall, "attention_seconds": attention, "attention_share": attention / wall, **parts}
    result["speedup"] = rowcache_s / engine_s
    result["bound"] = rowcache_s / result["engine"]["attention_seconds"]
    return result


def table(r: dict) -> str:
    """The result as a few printable lines."""
    lines = [f"{r['workload']} {r['tasks']} tasks x G={r['group']}, {r['turns']} turns, ~{r['context_tokens']} "
             f"tokens of context; identical ids: {r['identical_ids']}",
             f"{'':10} {'wall s':>8} {'attention s':>12} {'share':>6} | {'decode s':>9} {'q*kv M':>8} | "
             f"{'feeds s':>8} {'q*kv M':>8}"]
    for who in ("engine", "rowcache"):
        m = r[who]
        lines.append(f"{who:10} {m['seconds']:8.1f} {m['attention_seconds']:12.1f} {m['attention_share']:6.0%} | "
                     f"{m['decode']['seconds']:9.1f} {m['decode']['q_kv_millions']:8.1f} | "
                     f"{m['feed']['seconds']:8.1f} {m['feed']['q_kv_millions']:8.1f}")
    lines.append(f"engine / rowcache: {r['speedup']:.2f}x measured; at most {r['bound']:.2f}x if everything "
                 f"but the engine's attention were free")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Build the speed model, run the cell, print the table, write the JSON; 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="tau2", choices=sorted(speed.WORKLOADS))
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="perf.speed's quick model (seconds)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (one job per core)")
    ap.add_argument("--out", default="runs/speed/attention_share.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    setup = speed.Setup(torch.device("cpu"), torch.float32, "sdpa")
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = speed.build_tiny_model(Path(tmp), speed.QUICK_MODEL if args.quick else speed.CPU_MODEL, setup)
        result = attention_share(model, tok, speed.WORKLOADS[args.workload](args.tasks), args.group, args.turns)
    result["machine"] = {"platform": platform.platform(), "torch": torch.__version__, "threads": args.threads,
                         "cpus": os.cpu_count(), "model": "quick" if args.quick else "perf.speed CPU_MODEL"}
    print(table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

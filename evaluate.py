"""Evaluate a policy on a benchmark split, optionally with test-time private rehearsal.

    python evaluate.py --rehearsal-budget 4                     # default model on the embedded toy world
    python evaluate.py --model /ckpt/Qwen3-8B --bench tau2 --num-trials 4 --rehearsal-budget 2
    python evaluate.py --limit 50 --compare 0,1,2,4             # budgets side by side, same tasks and seeds
    python evaluate.py --model SmolLM2-135M-Instruct.Q4_1.gguf --chat-template chat_templates/chatml-tools.jinja

Each (task, trial) is one committed trajectory on the real environment (rehearse.act): with budget B > 0
the policy privately rehearses up to B calls before each committed turn (see rehearse.py). Writes
`OUT/trajectories_B{B}_{mode}.jsonl` (one line per task and trial: readable text, calls, observations,
score, rehearsals, fidelity, costs) and `OUT/summary.json`, and prints the summary table.

Resumable: each finished (task, trial) is written as it ends, and `OUT/eval_config.json` records what decides
the trajectories (model and its weight files, benchmark, tasks, sampling, limits, rehearsal settings). Rerunning
the same command with the same --out skips what is done (every episode samples from its own task's seed, so
the result does not depend on what ran beside it) and writes the summary an uninterrupted run writes; a rerun
with another config into the same --out is refused (--overwrite starts over).

Reported per benchmark and per category (task.metadata "family" / "category" / "domain"): success
(Avg@k = pass^1, the mean reward over tasks and trials), pass^k (tau²'s pass_hat_k, local fallback: mean
over tasks of C(c,k)/C(n,k), c = trials with reward 1), tool precision/recall/F1 where the score has them
(FinMCP), world-model fidelity on real calls (`--fidelity`, on by default for toyworld), and what rehearsal
cost: extra sampled + fed tokens and seconds per committed turn and per committed call.

With B > 0, rehearsal diagnostics (diagnostics.rehearsal_diagnostics, verifier side, after each episode: every
proposal is executed on a fresh environment rebuilt to its turn's state, nothing reaches the policy): per
committed turn in the JSONL ("rehearsal_diagnostics": "turns" and "counts"), summed per run in summary.json
(runs.B=N.rehearsal_diagnostics) and in the table (rows "rehearsal ..."): how often the self-assessment's
verdict agrees with the proposal's real outcome, how often the committed call differs from the first
proposal, and whether such a change helped or hurt.

--model auto (default) uses the checkpoint `python train.py` writes: runs/tiny-toyworld/latest holds the path
of an HF folder relative to runs/tiny-toyworld/; without it the embedded tiny model as shipped
(pretrained for recall, not trained on the task) is used.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

import diagnostics
import kvbatch
import policy
import rehearse
from bench import BENCHES, DEFAULT_BENCH, BenchUnavailable, load_bench, optional, settings
from intervals import paired_difference, per_task_rewards, success_interval
from chat_format import TemplateError
from cli import OneLineParser, add_template_args, int_at_least, task_opts_arg
from rollout import SamplingConfig, describe_row, load_engine, make_env_fn, model_user_fn

GROUP_KEYS = ("family", "category", "domain")
# rehearsal diagnostics shown in the table (B > 0); summary.json holds them all
TABLE_DIAGNOSTICS = ("rehearsed_turns", "assessed", "assess_agree_rate", "assess_agree", "assess_disagree",
                     "assess_unmeasured", "verdict_unparsed", "changed_rate", "changed", "helped", "hurt", "neutral",
                     "effect_unmeasured")
TRAIN_RUN = Path("runs/tiny-toyworld")


def _budgets(text):
    """argparse type of --compare: '0,1,2' -> [0, 1, 2]."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated budgets like 0,1,2, got {text!r}")
    if not out or any(b < 0 for b in out):
        raise argparse.ArgumentTypeError(f"budgets must be integers >= 0, got {text!r}")
    return out


def build_parser() -> OneLineParser:
    """evaluate.py's command line (one-line errors)."""
    p = OneLineParser(prog="evaluate.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="auto", help="'auto' (train.py's latest checkpoint, else tiny), 'tiny', "
                   "a local HF folder or a .gguf file")
    add_template_args(p)
    p.add_argument("--bench", default=DEFAULT_BENCH, choices=list(BENCHES))
    p.add_argument("--world-model", default="auto", metavar="{auto,shared,separate,oracle,PATH}",
                   help="who writes the private rehearsals and fidelity probes, as train.py's --world-model: shared "
                   "(the policy itself), separate (the checkpoint's world_model/ folder, saved by a train.py "
                   "--world-model separate run), auto (separate where the checkpoint has one, else shared), a "
                   "local HF folder sharing the policy's tokenizer, or oracle (evaluation only: the real "
                   "environment, rebuilt to the committed state, answers every rehearsed call; the policy still "
                   "assesses; what a perfect world model would let B > 0 add)")
    p.add_argument("--user-model", default="", help="local HF folder of the simulated user (tau2, vita); "
                   "default: the policy itself plays the user, in its own context")
    p.add_argument("--split", default=None, help="split to score (default: per benchmark, bench/settings.py: "
                   "test; BFCL-trained runs: dev, the held-out half of BFCL's multi-turn entries)")
    p.add_argument("--limit", type=int_at_least(1), default=None,
                   help="first N tasks of the split, in the benchmark's order (default: all; toyworld: the "
                        "first 256 of its 1000; BFCL's order is by category: pick categories with --split)")
    p.add_argument("--task-opts", type=task_opts_arg, default={}, metavar="OPTS",
                   help="extra load_tasks options as key=value,key=value, as train.py's --task-opts (e.g. "
                        "domain=airline, categories=simple_python)")
    p.add_argument("--num-trials", type=int_at_least(1), default=1, help="k trials per task (Avg@k, pass^k)")
    p.add_argument("--rehearsal-budget", type=int_at_least(0), default=0)
    p.add_argument("--rehearsal-mode", choices=["parallel", "sequential"], default="parallel")
    p.add_argument("--rehearsal-commit", choices=["checked", "memory"], default="checked",
                   help="what a rehearsed turn commits: checked (the first proposal judged ok (--rehearsal-judge), "
                        "token for token; a turn regenerated under the rehearsal memory only when none does) or "
                        "memory (always the regenerated turn)")
    p.add_argument("--rehearsal-judge", choices=["assessment", "prediction"], default="prediction",
                   help="what decides that a rehearsed proposal is committed (--rehearsal-commit checked): the "
                        "rehearsed responses holding no error (default), or the policy's assessment saying ok "
                        "(measured to hurt: it calls right proposals wrong)")
    p.add_argument("--compare", type=_budgets, default=None, metavar="B1,B2,...",
                   help="run these budgets on the same tasks and seeds and print them side by side")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: per benchmark, bench/settings.py: the paper's 0.6)")
    p.add_argument("--top-p", type=float, default=None,
                   help="top-p (default: per benchmark, bench/settings.py: the paper's 0.95)")
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--protocol", choices=list(settings.PROTOCOLS), default="official",
                   help="official (default): episodes end where the benchmark's official harness ends them (tau2: "
                        "its 200 steps and 10 errors; BFCL: 20 steps per user turn, no episode cap) with the "
                        "model's own context; paper: the paper's and training's limits (30 turns, 16k/32k tokens). "
                        "The same under both for toyworld, vita, finmcp (bench/settings.py)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=None,
                   help="tokens per assistant turn (default: per benchmark, bench/settings.py)")
    p.add_argument("--max-world-tokens", type=int_at_least(1), default=None,
                   help="tokens per rehearsed tool response (default: per benchmark, bench/settings.py)")
    p.add_argument("--max-turns", type=int_at_least(1), default=None,
                   help="assistant turns per trajectory (default: per benchmark, bench/settings.py)")
    p.add_argument("--max-total-len", type=int_at_least(16), default=None,
                   help="tokens per trajectory, prompt included (default: per benchmark, bench/settings.py)")
    p.add_argument("--fidelity", action=argparse.BooleanOptionalAction, default=None,
                   help="probe the world model on every real call (default: on for toyworld)")
    p.add_argument("--max-rows", type=int_at_least(1), default=None,
                   help="KV-cache rows of one engine batch: tasks run together, each holding up to max(1, B) "
                        "rows at once (1 in sequential mode), and join as others finish (results equal running "
                        "them one at a time; batched is faster at every budget, perf/eval_speed.py). "
                        "Default: 64")
    p.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                   help="memory for KV-cache rows, in GB; a batch holds at most budget / (max-total-len x KV bytes "
                        "per token x 2) rows and the rest wait (default: half the memory free at start)")
    p.add_argument("--out", default=None, help="output folder (default runs/eval/BENCH-SPLIT); a rerun with the "
                   "same flags resumes what it holds")
    p.add_argument("--overwrite", action="store_true", help="discard what --out holds and start over")
    p.add_argument("--device", default="auto")
    return p


# ----------------------------------------------------------------------------------------------------------
# metrics


def pass_hat_k(results_by_task: dict, k: int) -> float:
    """tau²'s pass^k: mean over tasks of C(c, k) / C(n, k), c successes among n trials (tasks with n < k skipped)."""
    vals = []
    for results in results_by_task.values():
        n, c = len(results), sum(1 for r in results if r)
        if n >= k:
            vals.append(math.comb(c, k) / math.comb(n, k))
    return sum(vals) / len(vals) if vals else float("nan")


def _pass_k_fn(bench_name):
    """The benchmark's own pass^k where it offers one (tau2's, from its package), else the local formula."""
    try:
        own = optional(load_bench(bench_name), "pass_hat_k")
    except (ImportError, BenchUnavailable, ValueError):   # its optional package is missing: the local formula
        own = None
    return own or pass_hat_k


def _mean(xs):
    """Mean of the values that are not None (None when there are none)."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def group_of(task) -> str | None:
    """The task's reporting group ("family=...", "category=..." or "domain=..."), None where it has none."""
    for key in GROUP_KEYS:
        if key in task.metadata and isinstance(task.metadata[key], (str, int)):
            return f"{key}={task.metadata[key]}"
    return None


def paired_comparisons(records_by_run: dict) -> dict:
    """Every run against the first (B=0 where it was asked for), paired on the same tasks and trials (seeds):
    the difference in success with its paired-bootstrap 95% interval and the tasks that got better or worse;
    per group too."""
    names = list(records_by_run)
    if "B=0" in names:
        names.remove("B=0")
        names.insert(0, "B=0")
    base = names[0]
    out = {}
    for name in names[1:]:
        a, b = records_by_run[name], records_by_run[base]
        entry = {"overall": asdict(paired_difference(per_task_rewards(a), per_task_rewards(b))), "groups": {}}
        for g in sorted({r["group"] for r in b if r["group"] is not None}):
            ga = per_task_rewards([r for r in a if r["group"] == g])
            gb = per_task_rewards([r for r in b if r["group"] == g])
            if set(ga) & set(gb):
                entry["groups"][g] = asdict(paired_difference(ga, gb))
        out[f"{name} - {base}"] = entry
    return out


def paired_lines(paired: dict) -> list[str]:
    """The paired comparisons as text lines (overall, then each group)."""
    lines = []
    for label, entry in paired.items():
        for g, d in [("overall", entry["overall"]), *entry["groups"].items()]:
            verdict = "" if d["lo"] > 0 or d["hi"] < 0 else "  no difference"
            lines.append(f"{label:<12} {g:<22} {d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]  n={d['tasks']}  "
                         f"{d['better']} better, {d['worse']} worse{verdict}")
    return lines


def summarize(bench_name: str, records: list[dict], k: int, fidelity_on: bool = False) -> dict:
    """Aggregate JSONL records (one per task and trial) into the summary of one run."""
    pass_k = _pass_k_fn(bench_name)

    def block(recs):
        by_task, rewards = defaultdict(list), per_task_rewards(recs)
        for r in recs:
            by_task[r["task_id"]].append(r["reward"] >= 1.0 - 1e-9)
        rate = success_interval(rewards)
        out = {"tasks": len(by_task), "trajectories": len(recs), "success": _mean([r["reward"] for r in recs]),
               "success_95ci": [rate.lo, rate.hi], "ci_method": rate.method,
               # the scorer raised: those rows hold a 0 that is no verdict
               "evaluator_errors": sum(bool(r["components"].get("evaluator_error")) for r in recs)}
        if k > 1:
            out[f"pass^{k}"] = pass_k(dict(by_task), k)
        for key in ("precision", "recall", "f1"):
            vals = [r["components"].get(key) for r in recs if isinstance(r["components"].get(key), (int, float))]
            if vals:
                out[key] = _mean(vals)
        return out

    summary = {"overall": block(records), "groups": {}}
    groups = defaultdict(list)
    for r in records:
        if r["group"] is not None:
            groups[r["group"]].append(r)
    for g in sorted(groups):
        summary["groups"][g] = block(groups[g])
    pairs = [f for r in records for f in r["fidelity"]]
    if fidelity_on and not pairs:
        summary["fidelity"] = {"pairs": 0}
    if pairs:
        summary["fidelity"] = {"pairs": len(pairs), "exact": _mean([float(f["exact"]) for f in pairs]),
                               "kv_agreement": _mean([f["kv_agreement"] for f in pairs]),
                               "error_correct": _mean([float(f["error_correct"]) for f in pairs]),
                               "real_errors": sum(f["real_error"] for f in pairs),
                               "predicted_errors": sum(f["predicted_error"] for f in pairs)}
    diagnosed = [r["rehearsal_diagnostics"]["counts"] for r in records if "rehearsal_diagnostics" in r]
    if diagnosed:
        summary["rehearsal_diagnostics"] = diagnostics.diagnostic_summary(diagnosed)
    st = [r["stats"] for r in records]
    tot = {key: sum(s.get(key, 0) for s in st) for key in
           ("committed_turns", "committed_calls", "committed_checked", "rehearsals", "extra_sampled", "extra_fed",
            "extra_tokens",
            "memory_tokens", "seconds", "private_seconds", "fidelity_seconds", "oracle_unavailable")}
    turns, calls = tot["committed_turns"], tot["committed_calls"]
    per = lambda x, n: x / n if n else None  # noqa: E731
    summary["cost"] = {**tot, "extra_tokens_per_turn": per(tot["extra_tokens"], turns),
                       "extra_tokens_per_call": per(tot["extra_tokens"], calls),
                       "extra_seconds_per_turn": per(tot["private_seconds"], turns),
                       "extra_seconds_per_call": per(tot["private_seconds"], calls),
                       "seconds_per_turn": per(tot["seconds"], turns)}
    return summary


def _fmt(v):
    """A table cell: floats to 3 decimals, None as a dash."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3f}"
    return str(v)


def _with_ci(block: dict) -> dict:
    """A summary block for the table: the 95% interval as one cell under success, the method left out."""
    out = {}
    for key, v in block.items():
        if key == "success_95ci":
            out["success 95% CI"] = f"[{v[0]:.3f}, {v[1]:.3f}]"
        elif key != "ci_method":
            out[key] = v
    return out


def _group_cells(block: dict) -> dict:
    """A group's table cells: success with its interval in one cell, then pass^k / F1 where present."""
    if not block:
        return {}
    lo, hi = block["success_95ci"]
    out = {"success": f"{block['success']:.3f} [{lo:.3f}, {hi:.3f}]"}
    out.update({k: v for k, v in block.items() if k not in ("tasks", "trajectories", "success", "success_95ci",
                                                            "ci_method", "evaluator_errors")})
    return out


def table(bench_name: str, runs: dict) -> str:
    """Side-by-side text table: one column per run (budget), rows = metrics."""
    names = list(runs)
    rows = []

    def metric_rows(prefix, get):
        keys = []
        for s in runs.values():
            for key in get(s) or {}:
                if key not in keys:
                    keys.append(key)
        for key in keys:
            rows.append([f"{prefix}{key}"] + [_fmt((get(runs[n]) or {}).get(key)) for n in names])

    metric_rows(f"{bench_name} ", lambda s: _with_ci(s["overall"]))
    groups = []
    for s in runs.values():
        groups += [g for g in s["groups"] if g not in groups]
    for g in groups:
        n = max(s["groups"].get(g, {}).get("tasks", 0) for s in runs.values())
        metric_rows(f"  {g} (n={n}) ", lambda s, g=g: _group_cells(s["groups"].get(g, {})))
    metric_rows("fidelity ", lambda s: s.get("fidelity"))
    metric_rows("rehearsal ", lambda s: {k: s["rehearsal_diagnostics"][k] for k in TABLE_DIAGNOSTICS}
                if "rehearsal_diagnostics" in s else None)
    metric_rows("cost ", lambda s: {k: s["cost"][k] for k in ("committed_turns", "committed_calls", "rehearsals",
                                                               "extra_tokens_per_turn",
                                                               "extra_tokens_per_call", "extra_seconds_per_turn",
                                                               "seconds_per_turn")})
    header = ["metric"] + names
    width = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, width))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# running


def resolve_model(name: str) -> str:
    """--model auto: the latest checkpoint `python train.py` wrote (runs/tiny-toyworld/latest), else tiny."""
    if name != "auto":
        return name
    latest = TRAIN_RUN / "latest"
    if latest.is_file():
        return str(TRAIN_RUN / latest.read_text().strip())
    print(f"note: no trained checkpoint ({latest} is missing; run `python train.py`): evaluating the tiny "
          "model as shipped (pretrained, not trained on the task)")
    return "tiny"


def _jsonable(x):
    """x with dataclasses as dicts and anything else JSON cannot hold as text."""
    return json.loads(json.dumps(x, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))


def reference_calls(mod, task) -> list[dict] | None:
    """The calls a correct solution makes ({"name", "arguments"}), where the benchmark can say (its optional
    `reference_calls`), else None: rehearsal diagnostics then judge errors only."""
    calls = optional(mod, "reference_calls")
    return None if calls is None else [{"name": c.name, "arguments": dict(c.arguments)} for c in calls(task)]


# ----------------------------------------------------------------------------------------------------------
# resuming a stopped evaluation

EVAL_CONFIG = "eval_config.json"


def weight_files(model_name: str) -> list:
    """(name, bytes, mtime_ns) of the model's weight files: a retrained checkpoint at the same path differs."""
    path = policy.resolve_model_path(model_name) if model_name in policy.TINY_NAMES else Path(model_name)
    files = [path] if path.is_file() else sorted(
        f for f in path.glob("*") if f.suffix in (".safetensors", ".bin", ".gguf", ".pt") and f.is_file())
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def eval_identity(args, model_name: str, tasks, fidelity_on: bool, world: str) -> dict:
    """Everything that decides the trajectories of an evaluation (budgets aside: one JSONL each)."""
    return {"bench": args.bench, "split": args.split, "model": model_name, "weights": weight_files(model_name),
            "chat_template": args.chat_template, "chat_template_kwargs": args.chat_template_kwargs,
            "tool_call_format": args.tool_call_format, "task_opts": args.task_opts,
            "tasks": [t.id for t in tasks], "num_trials": args.num_trials, "seed": args.seed,
            "sampling": {"temperature": args.temperature, "top_p": args.top_p, "greedy": args.greedy},
            "protocol": args.protocol, "limits": {k: getattr(args, k) for k in settings.LIMIT_FIELDS},
            "rehearsal": {"mode": args.rehearsal_mode, "commit": args.rehearsal_commit,
                          "judge": args.rehearsal_judge, "world_model": world},
            "fidelity": fidelity_on, "user_model": args.user_model}


def refuse_out(out: Path, identity: dict, overwrite: bool) -> str | None:
    """The one-line reason `out` cannot hold this evaluation (another config's trajectories), or None when it is
    new, a resume of the same identity, or is to be overwritten. Writes nothing."""
    config = out / EVAL_CONFIG
    old_files = [f for f in out.glob("trajectories_*.jsonl") if f.stat().st_size]
    if overwrite or not old_files:
        return None
    if not config.exists():
        return f"--out {out} holds trajectories without {EVAL_CONFIG}; pass --overwrite or another --out"
    try:
        old = json.loads(config.read_text())
    except ValueError:
        return f"--out {out}: {EVAL_CONFIG} is unreadable; pass --overwrite to start over"
    changed = [k for k in identity if old.get(k) != identity[k]]
    if changed:
        return (f"--out {out} holds an evaluation with another {', '.join(changed)}; rerun it with the same "
                "flags to resume, or pass --overwrite or another --out")
    return None


def claim_out(out: Path, identity: dict, overwrite: bool) -> None:
    """Make `out` hold this evaluation (after the models loaded, so a broken model touches nothing): with
    overwrite, an old evaluation's files go; the identity is written atomically."""
    config = out / EVAL_CONFIG
    if overwrite:
        for f in [*out.glob("trajectories_*.jsonl"), out / "summary.json", config]:
            f.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    tmp = config.with_suffix(".tmp")
    tmp.write_text(json.dumps(identity, indent=1) + "\n")
    tmp.replace(config)


def finished_records(path: Path) -> dict:
    """(task_id, trial) -> record of the trajectories a stopped run wrote to path; a torn last line (the run
    was killed mid-write) is cut off the file, so appending continues it."""
    if not path.exists():
        return {}
    done, keep = {}, 0
    raw = path.read_bytes()
    for line in raw.splitlines(keepends=True):
        try:
            rec = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            rec = None
        if rec is None:
            break
        done[rec["task_id"], rec["trial"]] = rec
        keep += len(line)
    if keep < len(raw):
        with open(path, "r+b") as fh:
            fh.truncate(keep)
    return done


def run_budget(eng, mod, tasks, args, budget, out_path, fidelity_on, world_engine=None, user_engine=None):
    """Every (task, trial) at rehearsal budget `budget` on the real environment (rehearse.act_many), scored by
    the benchmark; writes one JSONL line per trajectory to out_path as it ends and returns the records in task
    order. Trajectories already in out_path (a stopped run of the same config) are kept, not rerun.
    world_engine: a separate model writing the rehearsed responses; user_engine: the simulated user's engine
    (default: the policy itself, in its own context)."""
    oracle = getattr(args, "world_model", "") == "oracle"
    rcfg = rehearse.RehearsalConfig(budget=budget, mode=args.rehearsal_mode, fidelity=fidelity_on,
                                    commit=getattr(args, "rehearsal_commit", "checked"),
                                    judge=getattr(args, "rehearsal_judge", "prediction"),
                                    world="oracle" if oracle else "model")
    # benchmarks with a simulated user (tau2, vita) get the policy itself playing the user, in its own context
    user_eng = user_engine or eng
    limits = settings.settings_for(mod.NAME)
    make_env = make_env_fn(mod, model_user_fn(user_eng, SamplingConfig(
        temperature=args.temperature, top_p=args.top_p, greedy=args.greedy, seed=args.seed,
        max_new_tokens=limits.user_max_new_tokens, max_total_len=limits.user_max_total_len)))
    specs, keys = [], []
    for trial in range(args.num_trials):
        for i, task in enumerate(tasks):
            seed = args.seed + 100_003 * trial + i          # the same for every budget (--compare)
            cfg = SamplingConfig(temperature=args.temperature, top_p=args.top_p, greedy=args.greedy,
                                 max_new_tokens=args.max_new_tokens, max_world_tokens=args.max_world_tokens,
                                 max_turns=args.max_turns, max_total_len=args.max_total_len, seed=seed)
            specs.append(rehearse.EpisodeSpec(task, cfg, make_env=make_env))
            keys.append((trial, seed))
    finished = finished_records(out_path)
    records: list = [finished.get((spec.task.id, trial)) for spec, (trial, _) in zip(specs, keys)]
    todo = [k for k, rec in enumerate(records) if rec is None]
    if len(todo) < len(specs):
        print(f"B={budget}: resuming, {len(specs) - len(todo)} of {len(specs)} trajectories already in "
              f"{out_path.name}", file=sys.stderr)
    bar = tqdm(total=len(specs), initial=len(specs) - len(todo), desc=f"{mod.NAME} B={budget}", unit="traj",
               file=sys.stderr)
    with open(out_path, "a") as fh:
        def done(j, ep):                # written as each episode ends, so a stopped run keeps what it has
            k = todo[j]
            task, (trial, seed) = specs[k].task, keys[k]
            traj = ep.trajectory
            score = mod.score(task, traj)
            rec = {"task_id": task.id, "trial": trial, "seed": seed, "budget": budget, "mode": args.rehearsal_mode,
                   "group": group_of(task),
                   "metadata": {k: task.metadata[k] for k in GROUP_KEYS if k in task.metadata},
                   "reward": float(score.reward), "components": _jsonable(score.components),
                   "end_reason": traj.end_reason, "final_answer": traj.final_answer,
                   "calls": [{"name": c.name, "arguments": c.arguments, "turn": c.turn} for c in traj.calls],
                   "observations": traj.observations, "errors": traj.errors,
                   "messages": _jsonable(traj.messages), "text": describe_row(ep.rollout, eng.tok, 0),
                   "rehearsals": [[{k: v for k, v in r.items() if k not in ("tokens", "logprobs")} for r in turn]
                                  for turn in ep.rehearsals],
                   "fidelity": ep.fidelity,
                   "stats": {k: v for k, v in ep.stats.items()}}
            if budget > 0:   # verifier side, after the episode: proposals run on a rebuilt copy of the env
                turns = diagnostics.rehearsal_diagnostics(task, traj, ep.rehearsals, mod.make_env, eng.fmt,
                                                       reference_calls(mod, task))
                rec["rehearsal_diagnostics"] = {"counts": diagnostics.diagnostic_counts(turns), "turns": turns}
            rec = _jsonable(rec)
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            records[k] = rec
            bar.update(1)

        rehearse.act_many(eng, [specs[k] for k in todo], rcfg, max_rows=args.max_rows or 64, on_done=done, world_model=world_engine,
                          memory_budget=budget_bytes(args), oracle_env=mod.make_env if oracle else None)
    bar.close()
    return records


def limits_text(args, task) -> str:
    """The episode limits in force, as the summary line prints them; with the harness limits a benchmark's
    tasks carry in their metadata (tau2's max_steps, max_errors)."""
    turns = "no turn cap" if args.max_turns >= settings.NO_EPISODE_CAP else f"{args.max_turns} turns"
    harness = "".join(f", {k} {task.metadata[k]}" for k in ("max_steps", "max_errors") if k in task.metadata)
    return f"{turns}, {args.max_total_len} tokens{harness}"


def memory_mark(device: str) -> dict:
    """What the process holds once every model is loaded, with the peak counter reset there."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return {"device": "cuda", "loaded_bytes": torch.cuda.memory_allocated(device)}
    kvbatch.reset_peak_rss()
    return {"device": "cpu", "loaded_bytes": kvbatch.rss_bytes()}


def memory_report(start: dict, budget: int, row_bytes: int, batch_rows: int, device: str) -> dict:
    """The peak over the run against the KV-cache budget it ran under: the rows the budget admits are the only
    memory that grows with the task count, so peak − loaded must stay within it (plus transients)."""
    if start["device"] == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = kvbatch.peak_rss_bytes()
    above = peak - start["loaded_bytes"]
    return {"device": start["device"], "kv_budget_bytes": budget, "row_bytes": row_bytes, "batch_rows": batch_rows,
            "loaded_bytes": start["loaded_bytes"], "peak_bytes": peak, "peak_above_loaded_bytes": above,
            "within_budget": above <= budget}


def memory_line(m: dict) -> str:
    """The memory report as one line of the printed summary."""
    gb = lambda b: f"{b / 2**30:.2f} GB"
    what = "peak RSS" if m["device"] == "cpu" else "peak CUDA memory"
    verdict = "within the budget" if m["within_budget"] else "OVER the budget"
    return (f"memory: KV-cache budget {gb(m['kv_budget_bytes'])} (batches of up to {m['batch_rows']} rows, "
            f"{gb(m['row_bytes'])} each at full length); {what} {gb(m['peak_bytes'])}, "
            f"{gb(m['peak_above_loaded_bytes'])} above the loaded models ({verdict})")


def budget_bytes(args) -> int | None:
    """--memory-budget in bytes (None: the engine's default, half the free memory)."""
    gb = getattr(args, "memory_budget", None)
    return None if gb is None else int(gb * 2**30)


def model_context(model_name: str) -> int | None:
    """The model's context length (config.json's max_position_embeddings, or its text_config's); None where the
    folder does not say. PolicyLoadError for a model that cannot be found."""
    path = policy.resolve_model_path(model_name) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    n = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return n if isinstance(n, int) and n > 0 else None


class EvalConfig(argparse.Namespace):
    """The evaluation's command line with every unset value resolved (resolve_config): read-only once built,
    as train.py's TrainConfig.resolved() is, so nothing later changes what the summary reports."""

    def __init__(self, **values):
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def __setattr__(self, key, value):
        raise AttributeError(f"the evaluation config is resolved and read-only (tried to set {key})")


def resolve_config(args: argparse.Namespace, context: int | None = None) -> EvalConfig:
    """The parsed flags with each None filled from the benchmark's run settings (bench/settings.py): the split,
    temperature and top-p, and the limits under --protocol (eval_limits; with --protocol paper the resolution
    train.py uses). context: the model's context length, the official protocol's max_total_len where the
    benchmark has no limit of its own. The parsed Namespace is left as it was."""
    s = settings.settings_for(args.bench)
    values = dict(vars(args))
    values["temperature"], values["top_p"] = sampling_defaults(args.bench, args.temperature, args.top_p)
    values["split"] = args.split or s.eval_split
    overrides = {k: values[k] for k in settings.LIMIT_FIELDS}
    values.update(settings.eval_limits(args.bench, args.protocol, context, **overrides))
    return EvalConfig(**values)


def sampling_defaults(bench: str, temperature: float | None, top_p: float | None) -> tuple[float, float]:
    """The evaluation's temperature and top-p: the user's, else the benchmark's (bench/settings.py)."""
    s = settings.settings_for(bench)
    return (s.eval_temperature if temperature is None else temperature, s.eval_top_p if top_p is None else top_p)


def main(argv=None) -> int:
    """Load the model and the split, run every budget, write summary.json and print the table."""
    parser = build_parser()
    parsed = parser.parse_args(argv)
    model_name = resolve_model(parsed.model)
    try:
        context = model_context(model_name) if settings.settings_for(parsed.bench).official_context else None
    except policy.PolicyLoadError as exc:
        parser.error(str(exc))
    args = resolve_config(parsed, context)
    if not args.greedy and args.temperature <= 0:
        parser.error(f"--temperature must be > 0 (or pass --greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.memory_budget is not None and not args.memory_budget > 0:
        parser.error(f"--memory-budget must be a positive number of GB, got {args.memory_budget}")

    try:
        mod = load_bench(args.bench)
    except ImportError as exc:
        parser.error(f"benchmark {args.bench!r} is not available in this checkout ({exc})")
    except (BenchUnavailable, ValueError) as exc:
        parser.error(str(exc))
    try:
        limit = args.limit if args.limit is not None else settings.settings_for(args.bench).eval_limit
        tasks = mod.load_tasks(args.split, limit=limit, **args.task_opts)
        tasks = tasks[:limit] if limit is not None else tasks     # a loader's limit may be per group (BFCL)
    except (BenchUnavailable, ValueError, TypeError, FileNotFoundError) as exc:
        parser.error(f"cannot load {args.bench} split {args.split!r}: {exc}")
    if not tasks:
        parser.error(f"{args.bench} split {args.split!r} has no tasks")

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        kind = torch.device(device).type
    except RuntimeError:
        parser.error(f"--device {device!r} is not a torch device; use auto, cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device} was asked for but CUDA is not available here; use --device cpu or auto")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    world = args.world_model
    saved_world = Path(model_name) / "world_model"
    if world == "separate" and not (saved_world / "config.json").exists():
        parser.error(f"--world-model separate: {model_name} has no world_model/ folder (written by train.py "
                     "--world-model separate); use shared or a folder")
    if world in ("auto", "separate"):
        world = str(saved_world) if (saved_world / "config.json").exists() else "shared"
    fidelity_on = args.fidelity if args.fidelity is not None else settings.settings_for(args.bench).eval_fidelity
    out = Path(args.out or f"runs/eval/{args.bench}-{args.split}")
    try:                         # before loading anything: a refused resume costs nothing
        identity = eval_identity(args, model_name, tasks, fidelity_on, world)
    except policy.PolicyLoadError as exc:
        parser.error(str(exc))
    refused = refuse_out(out, identity, args.overwrite)
    if refused:
        parser.error(refused)
    try:
        eng = load_engine(model_name, args.chat_template, args.chat_template_kwargs, args.tool_call_format,
                          dtype=dtype, device=device)
        eng.model.eval()
    except (policy.PolicyLoadError, TemplateError) as exc:
        parser.error(str(exc))
    need = kvbatch.memory_row_bytes(eng.model, eng.max_len(SamplingConfig(max_total_len=args.max_total_len)))
    have = kvbatch.model_budget_bytes(eng.model, budget_bytes(args))
    if need > have:   # one row at the full context would not fit: say so now, not with an OOM hours in
        parser.error(f"one trajectory of --max-total-len {args.max_total_len} needs {need / 2**30:.1f} GB of KV "
                     f"cache, over the memory budget of {have / 2**30:.1f} GB; pass a smaller --max-total-len or "
                     "a larger --memory-budget")

    world_engine = None          # the world model's module (None: the policy writes WORLD segments)
    if world == "oracle":
        print("world model: oracle, the real environment answers the rehearsed calls", file=sys.stderr)
    elif world != "shared":
        try:
            wm, wtok = policy.load_policy(world, dtype=dtype, device=device)
        except policy.PolicyLoadError as exc:
            parser.error(f"--world-model: {exc}")
        if wtok.get_vocab() != eng.tok.get_vocab():
            parser.error(f"--world-model {world} has another tokenizer than the policy; both read one token sequence")
        world_engine = wm.eval()
        print(f"world model: {world} writes the rehearsed responses", file=sys.stderr)
    user_engine = None
    if args.user_model:   # the user model keeps its own template and variables
        try:
            user_engine = load_engine(args.user_model, dtype=dtype, device=device)
            user_engine.model.eval()
        except (policy.PolicyLoadError, TemplateError) as exc:
            parser.error(f"--user-model: {exc}")
    claim_out(out, identity, args.overwrite)
    memory_start = memory_mark(device)
    budgets = args.compare or [args.rehearsal_budget]
    runs, records_by_run, t0 = {}, {}, time.perf_counter()
    for b in budgets:
        path = out / f"trajectories_B{b}_{args.rehearsal_mode}.jsonl"
        records = run_budget(eng, mod, tasks, args, b, path, fidelity_on, world_engine, user_engine)
        records_by_run[f"B={b}"] = records
        runs[f"B={b}"] = {**summarize(args.bench, records, args.num_trials, fidelity_on), "jsonl": path.name}
    paired = paired_comparisons(records_by_run) if len(runs) > 1 else {}
    batch_rows = min(args.max_rows or 64, eng.rows_that_fit(SamplingConfig(max_total_len=args.max_total_len), have))
    summary = {"bench": args.bench, "split": args.split, "model": model_name, "mode": args.rehearsal_mode,
               "commit": args.rehearsal_commit, "judge": args.rehearsal_judge, "world_model": world,
               "protocol": args.protocol, "limits": {k: getattr(args, k) for k in settings.LIMIT_FIELDS},
               "chat_template": args.chat_template, "chat_template_kwargs": eng.template_kwargs,
               "num_trials": args.num_trials, "tasks": len(tasks), "seed": args.seed,
               "sampling": {"temperature": args.temperature, "top_p": args.top_p, "greedy": args.greedy},
               "batch_rows": batch_rows, "memory": memory_report(memory_start, have, need, batch_rows, device),
               "seconds": time.perf_counter() - t0, "runs": runs, "paired": paired}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{args.bench}/{args.split}: {len(tasks)} tasks x {args.num_trials} trials, model {model_name}, "
          f"rehearsal {args.rehearsal_mode}, protocol {args.protocol} ({limits_text(args, tasks[0])})")
    print(table(args.bench, runs))
    print(memory_line(summary["memory"]))
    if paired:
        print("paired differences in success (same tasks and seeds; 95% paired-bootstrap interval):")
        print("\n".join(paired_lines(paired)))
    for name, run in runs.items():
        if run["overall"]["evaluator_errors"]:
            print(f"warning: {name}: the scorer raised on {run['overall']['evaluator_errors']} trajectories; they "
                  f"count as 0 (see components.evaluator_error in {out / run['jsonl']})", file=sys.stderr)
    print(f"wrote {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

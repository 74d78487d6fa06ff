"""The paper's ablation in miniature: who writes the tool responses during GRPO, and who is trained on them.

    # 1. one shared warm start, trained once (get_price responses get no world loss: the mechanism test)
    python train.py --sft-steps 3000 --steps 0 --sft-world-frac 0.5 --sft-world-skip get_price --out runs/ws-skip-price
    # 2. every arm x seed from it, then the report; rerun the same command to continue after a stop
    python -m experiments.experiment --warm-start runs/ws-skip-price/ckpt/step_003000
    python -m experiments.experiment --warm-start runs/ws-skip-price/ckpt/step_003000 --arms envace --seeds 0
    python -m experiments.experiment --only-report         # tables and plots from the JSONs already written

The paper (EnvACE on tau², official code Within-yao/EnvACE, examples/drmas_trainer/) reports standard GRPO
31.2 < per-role policies 35.5 < EnvACE 36.7. The arms here, all from ONE warm-start checkpoint with the same
GRPO budget and the paper's settings (train.py's defaults: checklist reward, Dr.GRPO, (task, role) groups,
group size 4, KL 1e-4 k3, clip 0.2/0.2, dual clip 3), on the embedded toy world with the tiny model:

  frozen-sim  standard GRPO, mirrors run_checklist_caller_only.sh: a frozen copy of the warm start writes
              every tool response; only the caller's ACT tokens are trained.  --env sim --train-roles act
  per-role    mirrors run_checklist_noshare.sh: a second model, initialised from the warm start, writes the
              responses and is trained on its WORLD tokens by the same reward; the actor on ACT tokens.
                                                          --env rehearse --world-model separate
  envace      mirrors run_checklist_share.sh: one set of weights plays both roles.   --env rehearse
  real        the real environment answers every call: a ceiling the paper never claims to beat.
                                                          --env real --train-roles act
  act-only    (only with --act-only) the policy rehearses, only ACT tokens trained.
                                                          --env rehearse --train-roles act

One piece is one (arm, seed): train runs/experiment/<arm>-s<seed>/ (continued with `train.py --resume` if its
latest checkpoint has fewer steps), evaluate the final checkpoint on held-out test tasks (parallel budgets
0,1,2,4 with the fidelity probe, sequential budget 2), write results/experiment/<arm>-s<seed>.json. The warm
start itself is the piece warm-start.json. A piece whose JSON exists is skipped (delete it to redo or
lengthen a piece; its run folder is then continued, not retrained). Then the report: results/experiment/
table.md and the PNG plots training_success.png, training_fidelity.png, from every piece JSON there.

A piece JSON holds: the arm, seed, train flags and mirrored script; the warm start (path, --warm-start-note,
its own training config); the evaluated checkpoint and GRPO settings; host and OMP_NUM_THREADS; `commands`,
every command the piece ran over all invocations (runs/experiment/<piece>.commands.jsonl) with wall and CPU
seconds, and their sums; `training_curve` (per GRPO step: reward_mean, success_rate, flat_group_share,
fidelity_exact/<tool>, fidelity_n/<tool>); `held_out` (per budget label B=0, B=1, B=2, B=4, seq B=2:
evaluate.py's summary of that run plus fidelity_by_tool); `fidelity_by_tool` (B=0's); and
`rehearsal_diagnostics` when evaluate.py's summary has one. Logs: runs/experiment/<piece>.*.log.

The numbers are the result: nothing is tuned until an arm wins.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from intervals import paired_difference, per_task_rewards, success_interval

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Arm:
    """One arm of the ablation: its train.py flags on top of the shared ones and the official script it mirrors."""
    flags: list[str]      # train.py flags on top of the shared ones
    mirrors: str          # the official script this arm stands for ("" = none)
    config: dict          # the train.py settings its preset sets


ARM_DIR = ROOT / "configs" / "arms"


def load_arms() -> dict[str, Arm]:
    """The arms as configs/arms/*.toml define them (the one definition train.py, experiments and the README
    use): each piece runs train.py --config configs/arms/<arm>.toml."""
    import tomllib
    arms = {}
    for path in sorted(ARM_DIR.glob("*.toml")):
        data = tomllib.loads(path.read_text())
        about = data.pop("about", {})
        arms[path.stem] = Arm(["--config", str(path.relative_to(ROOT))], about.get("mirrors", ""), data)
    return arms


ARMS = load_arms()


def arm_config(arm: str) -> dict:
    """The train.py settings an arm's preset sets (empty for the warm start)."""
    return dict(ARMS[arm].config) if arm in ARMS else {}
DEFAULT_ARMS = ["frozen-sim", "per-role", "envace", "real"]
ROW_ORDER = ["warm-start", "frozen-sim", "per-role", "envace", "act-only", "real"]
PAPER_ORDER = ["frozen-sim", "per-role", "envace"]          # increasing success, as the paper reports
TOOLS = ["get_balance", "get_price", "transfer", "buy"]
BUDGET_LABELS = ["B=0", "B=1", "B=2", "B=4", "seq B=2"]
WINDOW = 10           # steps: the plots' moving average, and the first/last windows of training-time fidelity
PIECE_CPU_LIMIT = 3600


# ----------------------------------------------------------------------------------------------------------
# Running commands: every finished command is appended to the piece's ledger, so a piece continued by a
# later invocation still reports the time of all its parts.


class CommandFailed(RuntimeError):
    """train.py or evaluate.py exited non-zero; the message names its log."""


def run_command(cmd: list[str], log: Path) -> dict:
    """`python cmd...` in the repository root, its output appended to `log`; what the piece JSON records."""
    log.parent.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "a") as f:
        rc = subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    print(f"  {wall:7.0f} s wall {cpu:7.0f} s CPU  python {' '.join(cmd)}", flush=True)
    if rc != 0:
        raise CommandFailed(f"exit {rc}: python {' '.join(cmd)} (see {log})")
    return {"cmd": "python " + " ".join(cmd), "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1)}


def run_logged(cmd: list[str], log: Path, ledger: Path):
    """run_command, then its record appended to the piece's ledger (JSON lines)."""
    record = run_command(cmd, log)
    with open(ledger, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; [] when it does not exist."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rel(path: Path) -> str:
    """A path as the commands and JSONs spell it: relative to the repository root where possible."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ----------------------------------------------------------------------------------------------------------
# One piece: train (or continue), evaluate, write the JSON


def latest_checkpoint(run_dir: Path) -> tuple[Path | None, int]:
    """(the run's latest complete checkpoint, the steps it holds), or (None, 0) without one."""
    pointer = run_dir / "latest"
    if not pointer.is_file():
        return None, 0
    ckpt = run_dir / pointer.read_text().strip()
    if not (ckpt / "state.json").is_file():
        return None, 0
    return ckpt, json.loads((ckpt / "state.json").read_text())["step"]


def train_command(arm: str, seed: int, run_dir: Path, args) -> list[str] | None:
    """None when the run already holds args.steps steps; `--resume` when it holds fewer; else a new run
    (--overwrite: a folder without a checkpoint is a run killed before its first save)."""
    ckpt, done = latest_checkpoint(run_dir)
    if ckpt is not None:
        started_from = json.loads((run_dir / "config.json").read_text()).get("model", "")
        if (ROOT / started_from).resolve() != (ROOT / args.warm_start).resolve():
            raise SystemExit(f"{run_dir} started from {started_from}, not --warm-start {args.warm_start}: "
                             "move it away (or its piece JSON) before running this piece again")
        return None if done >= args.steps else ["train.py", "--resume", rel(run_dir), "--steps", str(args.steps)]
    return ["train.py", "--model", args.warm_start, "--out", rel(run_dir), "--overwrite", "--seed", str(seed),
            "--sft-steps", "0", "--steps", str(args.steps), "--lr", str(args.lr),
            "--tasks-per-step", str(args.tasks_per_step), "--group-size", str(args.group_size),
            "--save-every", str(args.save_every), *task_opts_flag(args.task_opts), *ARMS[arm].flags]


def eval_labels(args) -> list[str]:
    """The held-out runs a piece holds: parallel budgets ("B=2") and sequential ones ("seq B=2")."""
    return [f"B={b}" for b in args.budgets] + [f"seq B={b}" for b in args.seq_budgets]


def task_opts_flag(opts: str) -> list[str]:
    """["--task-opts", opts] for train.py and evaluate.py, [] without options."""
    return ["--task-opts", opts] if opts else []


def eval_command(label: str, ckpt: str, seed: int, out: Path, limit: int, task_opts: str = "") -> list[str]:
    """One budget, one folder: a piece can gain budgets later without redoing the ones it has. B=0 carries
    the fidelity probe (every real call also rehearsed in a discarded fork), which needs no rehearsal budget."""
    budget = int(label.split("=")[1])
    mode = "sequential" if label.startswith("seq") else "parallel"
    cmd = ["evaluate.py", "--model", ckpt, "--limit", str(limit), "--seed", str(seed),
           "--rehearsal-budget", str(budget), "--rehearsal-mode", mode, "--out", rel(out), *task_opts_flag(task_opts)]
    world = ROOT / ckpt / "world_model"            # per-role: the trained world model writes the rehearsals
    if world.is_dir():
        cmd += ["--world-model", rel(world)]
    return cmd + (["--fidelity"] if label == "B=0" else ["--no-fidelity"])


def training_curve(metrics: Path) -> list[dict]:
    """The GRPO steps of metrics.jsonl: step, reward, success, flat groups, fidelity per tool."""
    curve = []
    for rec in read_jsonl(metrics):
        if rec.get("phase") != "grpo":
            continue
        point = {k: rec.get(k) for k in ("step", "reward_mean", "success_rate", "flat_group_share")}
        point.update({k: v for k, v in rec.items() if k.startswith(("fidelity_exact/", "fidelity_n/"))})
        curve.append(point)
    return curve


def fidelity_per_tool(trajectories: Path) -> dict:
    """Held-out world-model fidelity per tool, from the probes recorded in evaluate.py's JSONL."""
    import reward
    pairs = [(f["call"]["name"], f) for rec in read_jsonl(trajectories) for f in rec.get("fidelity", [])]
    return reward.fidelity_by_tool(reward.fidelity_sums(pairs))


def held_out_result(out: Path) -> tuple[dict, dict | None]:
    """(evaluate's summary of one run, with fidelity per tool; its rehearsal_diagnostics or None)."""
    summary = json.loads((out / "summary.json").read_text())
    (run,) = summary["runs"].values()
    entry = {k: v for k, v in run.items() if k != "jsonl"}
    trajectories = out / Path(run["jsonl"]).name
    entry["fidelity_by_tool"] = fidelity_per_tool(trajectories)
    entry["per_task"] = per_task_rewards(read_jsonl(trajectories))     # what the paired intervals resample
    return entry, run.get("rehearsal_diagnostics", summary.get("rehearsal_diagnostics"))


def warm_start_config(ckpt: str) -> dict:
    """What the warm start was trained with, read from its state.json (empty if it has none)."""
    state = ROOT / ckpt / "state.json"
    if not state.is_file():
        return {}
    cfg = json.loads(state.read_text()).get("config", {})
    keys = ("model", "sft_steps", "sft_world_frac", "sft_world_skip", "sft_rehearsal_frac", "sft_lr", "seed")
    return {k: cfg[k] for k in keys if k in cfg}


def run_piece(name: str, arm: str, seed: int, args, piece: dict | None = None) -> dict:
    """Train (or continue) and evaluate one piece; returns its JSON record (not yet written). Given the
    piece's existing record, only the held-out runs it lacks are evaluated."""
    run_dir, ledger = args.runs / name, args.runs / f"{name}.commands.jsonl"
    if piece is None:
        curve, ckpt, steps = [], args.warm_start, 0
        if arm != "warm-start":
            cmd = train_command(arm, seed, run_dir, args)
            if cmd:
                run_logged(cmd, args.runs / f"{name}.train.log", ledger)
            ckpt_path, steps = latest_checkpoint(run_dir)
            ckpt, curve = rel(ckpt_path), training_curve(run_dir / "metrics.jsonl")
        piece = {"piece": name, "arm": arm, "seed": seed, "train_flags": ARMS[arm].flags if arm in ARMS else [],
                 "arm_config": arm_config(arm),
                 "mirrors": ARMS[arm].mirrors if arm in ARMS else "",
                 "warm_start": args.warm_start, "warm_start_note": args.warm_start_note,
                 "warm_start_config": warm_start_config(args.warm_start),
                 "checkpoint": ckpt, "grpo_steps": steps, "lr": args.lr, "tasks_per_step": args.tasks_per_step,
                 "group_size": args.group_size, "eval_tasks": args.limit, "eval_seed": seed,
                 "task_opts": args.task_opts, "eval_task_opts": args.eval_task_opts,
                 "host": args.host, "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
                 "training_curve": curve, "held_out": {}}
    # by checkpoint (a continued run is re-evaluated) and task set (one trained run, several held-out sets)
    eval_set = "-" + "".join(c if c.isalnum() else "_" for c in args.eval_task_opts) if args.eval_task_opts else ""
    eval_dir = run_dir / f"eval-{Path(piece['checkpoint']).name}{eval_set}"
    for label in eval_labels(args):
        if label in piece["held_out"]:
            continue
        out = eval_dir / label.replace(" ", "-").replace("=", "")
        if not (out / "summary.json").exists():
            run_logged(eval_command(label, piece["checkpoint"], seed, out, piece["eval_tasks"], args.eval_task_opts),
                       args.runs / f"{name}.eval-{out.name}.log", ledger)
        piece["held_out"][label], diagnostics = held_out_result(out)
        if diagnostics:
            piece.setdefault("rehearsal_diagnostics", {})[label] = diagnostics
    commands = read_jsonl(ledger)
    piece.update(commands=commands, wall_seconds=round(sum(c["wall_seconds"] for c in commands), 1),
                 cpu_seconds=round(sum(c["cpu_seconds"] for c in commands), 1),
                 fidelity_by_tool=piece["held_out"].get("B=0", {}).get("fidelity_by_tool", {}))
    return piece


def run_pieces(args) -> list[str]:
    """Every piece not yet written, the warm start first, then seed by seed so each seed completes a
    comparison; a failed piece is reported and the others go on. Returns the failures."""
    args.results.mkdir(parents=True, exist_ok=True)
    args.runs.mkdir(parents=True, exist_ok=True)
    todo = [("warm-start", "warm-start", args.seeds[0])]
    todo += [(f"{arm}-s{seed}", arm, seed) for seed in args.seeds for arm in args.arms]
    failures = []
    for name, arm, seed in todo:
        path = args.results / f"{name}.json"
        done = json.loads(path.read_text()) if path.exists() else None
        if done is not None and all(label in done["held_out"] for label in eval_labels(args)):
            print(f"{name}: {rel(path)} holds every budget asked for, skipped")
            continue
        print(f"{name}:" if done is None else f"{name}: adding budgets to {rel(path)}", flush=True)
        try:
            piece = run_piece(name, arm, seed, args, done)
        except CommandFailed as exc:
            print(f"{name}: FAILED, {exc}", flush=True)
            failures.append(name)
            continue
        path.write_text(json.dumps(piece, indent=1) + "\n")
        over = "  OVER the hour a piece should take" if piece["cpu_seconds"] > PIECE_CPU_LIMIT else ""
        print(f"{name}: {piece['wall_seconds'] / 60:.1f} min wall, {piece['cpu_seconds'] / 60:.1f} min CPU, "
              f"B=0 success {piece['held_out'].get('B=0', {}).get('overall', {}).get('success')}; wrote {rel(path)}{over}",
              flush=True)
    return failures


# ----------------------------------------------------------------------------------------------------------
# The report: tables and one computed sentence from the piece JSONs


def load_pieces(results: Path) -> dict[str, list[dict]]:
    """arm -> its pieces (seed order), arms in the table's order."""
    groups: dict[str, list[dict]] = {}
    for path in sorted(results.glob("*.json")):
        piece = json.loads(path.read_text())
        if isinstance(piece, dict) and "arm" in piece:
            groups.setdefault(piece["arm"], []).append(piece)
    order = ROW_ORDER + sorted(set(groups) - set(ROW_ORDER))
    return {arm: sorted(groups[arm], key=lambda p: p.get("seed") or 0) for arm in order if arm in groups}


def mean_std(values) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1) of the values that exist; std None under two values."""
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return None, None
    if len(values) == 1:
        return values[0], None
    return statistics.mean(values), statistics.stdev(values)


def fmt(mean: float | None, std: float | None = None) -> str:
    """'mean ± std' to three decimals, the mean alone without a std, '-' without a mean."""
    if mean is None:
        return "-"
    return f"{mean:.3f}" if std is None else f"{mean:.3f} ± {std:.3f}"


def success(piece: dict, label: str) -> float | None:
    """A piece's held-out overall success at a budget label, None where it was not evaluated."""
    return piece.get("held_out", {}).get(label, {}).get("overall", {}).get("success")


def seed_tasks(pieces: list[dict], label: str, seeds=None) -> dict:
    """task -> its held-out rewards at `label`, one per seed in seed order (the seeds given, or every seed whose
    piece recorded per-task rewards): what intervals.py resamples, tasks as the unit."""
    out: dict = {}
    for p in pieces:
        per_task = p.get("held_out", {}).get(label, {}).get("per_task")
        if per_task is None or (seeds is not None and p.get("seed") not in seeds):
            continue
        for task, rewards in per_task.items():
            out.setdefault(task, []).extend(rewards)
    return out


def interval_cell(pieces: list[dict], label: str) -> str:
    """'mean [lo, hi]' over tasks (seeds pooled per task) with the std over seeds; mean ± std where the pieces
    hold no per-task rewards (older pieces)."""
    per_task = seed_tasks(pieces, label)
    mean, std = mean_std(success(p, label) for p in pieces)
    if not per_task:
        return fmt(mean, std) + (" (no interval)" if mean is not None else "")
    rate = success_interval(per_task)
    return f"{rate.mean:.3f} [{rate.lo:.3f}, {rate.hi:.3f}]" + ("" if std is None else f" sd {std:.3f}")


def shared_seeds(a: list[dict], b: list[dict], label_a: str, label_b: str) -> list:
    """The seeds both arms evaluated with per-task rewards at the given labels."""
    has = lambda ps, label: {p.get("seed") for p in ps  # noqa: E731
                             if p.get("held_out", {}).get(label, {}).get("per_task") is not None}
    return sorted(has(a, label_a) & has(b, label_b))


def paired_cell(a: list[dict], b: list[dict], label_a: str, label_b: str) -> tuple[str, int]:
    """The paired difference a - b on the same tasks and seeds as text, and the seeds it pairs (0: none)."""
    seeds = shared_seeds(a, b, label_a, label_b)
    if not seeds:
        return "-", 0
    d = paired_difference(seed_tasks(a, label_a, seeds), seed_tasks(b, label_b, seeds))
    return (f"{d.diff:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}] ({d.better} better, {d.worse} worse)"
            + ("" if d.resolved else " no difference")), len(seeds)


ARM_PAIRS = [("envace", "frozen-sim"), ("envace", "per-role"), ("per-role", "frozen-sim"), ("envace", "real"),
             ("real", "warm-start"), ("envace", "warm-start")]


def paired_tables(groups: dict) -> list[str]:
    """Markdown rows: arm vs arm at each budget, and each budget vs B=0 within an arm, paired on tasks and
    seeds (the warm start, evaluated once with the first seed, pairs with that seed of the other arm)."""
    lines = ["| comparison | budget | seeds | difference in success [95% paired interval] |", "|---" * 4 + "|"]
    for a, b in ARM_PAIRS:
        if a not in groups or b not in groups:
            continue
        for label in BUDGET_LABELS:
            cell, n = paired_cell(groups[a], groups[b], label, label)
            if n:
                lines.append(f"| {a} − {b} | {label} | {n} | {cell} |")
    for arm, pieces in groups.items():
        for label in BUDGET_LABELS[1:]:
            cell, n = paired_cell(pieces, pieces, label, "B=0")
            if n:
                lines.append(f"| {arm}: {label} − B=0 | | {n} | {cell} |")
    return lines


def success_table(groups: dict) -> list[str]:
    """Markdown rows: per arm, held-out success at each budget with its 95% interval over tasks (seeds pooled
    per task) and the std over seeds, and wall minutes per piece."""
    lines = ["| arm | seeds | " + " | ".join(BUDGET_LABELS) + " | wall min / piece |",
             "|---" * (len(BUDGET_LABELS) + 3) + "|"]
    for arm, pieces in groups.items():
        cells = [interval_cell(pieces, label) for label in BUDGET_LABELS]
        wall, _ = mean_std(p.get("wall_seconds") for p in pieces)
        minutes = "-" if wall is None else f"{wall / 60:.0f}"
        lines.append(f"| {arm} | {len(pieces)} | " + " | ".join(cells) + f" | {minutes} |")
    return lines


def held_out_fidelity_table(groups: dict) -> list[str]:
    """Markdown rows: per arm, held-out exact world-model fidelity of each tool (mean ± std over seeds)."""
    lines = ["| arm | " + " | ".join(TOOLS) + " |", "|---" * (len(TOOLS) + 1) + "|"]
    for arm, pieces in groups.items():
        cells = [fmt(*mean_std(p.get("fidelity_by_tool", {}).get(tool, {}).get("exact") for p in pieces))
                 for tool in TOOLS]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def diagnostics_table(groups: dict) -> list[str]:
    """Item 6 per arm and budget, counts summed over the arm's seeds (rates are of the pooled counts)."""
    lines = ["| arm | budget | seeds | rehearsed turns | committed call changed | helped | hurt | neutral "
             "| assessment agrees with the real outcome |", "|---" * 9 + "|"]
    for arm, pieces in groups.items():
        for label in BUDGET_LABELS[1:]:
            found = [p["rehearsal_diagnostics"][label] for p in pieces
                     if label in p.get("rehearsal_diagnostics", {})]
            if not found:
                continue
            total = {key: sum(d.get(key, 0) for d in found) for key in
                     ("rehearsed_turns", "changed", "helped", "hurt", "neutral", "assess_agree",
                      "assess_disagree")}
            changed = total["changed"] / total["rehearsed_turns"] if total["rehearsed_turns"] else None
            judged = total["assess_agree"] + total["assess_disagree"]       # verdicts parsed and measured
            agree = total["assess_agree"] / judged if judged else None
            lines.append(f"| {arm} | {label} | {len(found)} | {total['rehearsed_turns']} | "
                         f"{'-' if changed is None else f'{changed:.0%}'} ({total['changed']}) | {total['helped']} | "
                         f"{total['hurt']} | {total['neutral']} | "
                         f"{'-' if agree is None else f'{agree:.0%}'} ({total['assess_agree']} of {judged}) |")
    return lines


def window_fidelity(curve: list[dict], tool: str, last: bool) -> float | None:
    """Exact fidelity of `tool` over the first (or last) WINDOW training steps, weighted by its calls."""
    window = curve[-WINDOW:] if last else curve[:WINDOW]
    calls = sum(p.get(f"fidelity_n/{tool}", 0) for p in window)
    if not calls:
        return None
    return sum(p.get(f"fidelity_exact/{tool}", 0.0) * p.get(f"fidelity_n/{tool}", 0) for p in window) / calls


def training_fidelity(pieces: list[dict], tool: str) -> tuple[float | None, float | None]:
    """(first-window, last-window) exact fidelity of `tool`, means over seeds."""
    first, _ = mean_std(window_fidelity(p.get("training_curve", []), tool, last=False) for p in pieces)
    last, _ = mean_std(window_fidelity(p.get("training_curve", []), tool, last=True) for p in pieces)
    return first, last


def training_fidelity_table(groups: dict) -> list[str]:
    """Markdown rows: per trained arm, each tool's training-time exact fidelity, first window -> last window."""
    lines = ["| arm | " + " | ".join(TOOLS) + " |", "|---" * (len(TOOLS) + 1) + "|"]
    for arm, pieces in groups.items():
        if arm == "warm-start":
            continue
        cells = []
        for tool in TOOLS:
            first, last = training_fidelity(pieces, tool)
            cells.append("-" if first is None and last is None else f"{fmt(first)} → {fmt(last)}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def ordering_sentence(groups: dict) -> str:
    """The arms ordered by mean held-out B=0 success, and whether the paper's frozen-sim < per-role < envace
    holds (strictly), computed from the pieces."""
    means = {arm: mean_std(success(p, "B=0") for p in pieces)[0]
             for arm, pieces in groups.items() if arm != "warm-start"}
    means = {arm: m for arm, m in means.items() if m is not None}
    ranked = sorted(means, key=lambda arm: -means[arm])
    text = f"{ranked[0]} ({means[ranked[0]]:.3f})" if ranked else "no arm has B=0 results"
    for prev, arm in zip(ranked, ranked[1:]):
        text += f" {'=' if means[arm] == means[prev] else '>'} {arm} ({means[arm]:.3f})"
    sentence = f"By mean held-out success at B=0: {text}; "
    missing = [arm for arm in PAPER_ORDER if arm not in means]
    sentence += f"the paper's ordering {' < '.join(PAPER_ORDER)} "
    if missing:
        return sentence + f"cannot be checked ({', '.join(missing)} missing)."
    holds = all(means[a] < means[b] for a, b in zip(PAPER_ORDER, PAPER_ORDER[1:]))
    sentence += "holds in the means" if holds else "does not hold in the means"
    resolved = []
    for lower, higher in zip(PAPER_ORDER, PAPER_ORDER[1:]):
        seeds = shared_seeds(groups[higher], groups[lower], "B=0", "B=0")
        if not seeds:
            return sentence + " (no per-task rewards to pair)."
        d = paired_difference(seed_tasks(groups[higher], "B=0", seeds), seed_tasks(groups[lower], "B=0", seeds))
        resolved.append(f"{higher} − {lower} {d.diff:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}]"
                        + ("" if d.resolved else ", no difference"))
    return sentence + "; paired on the same tasks and seeds: " + "; ".join(resolved) + "."


def mechanism_sentence(groups: dict) -> str:
    """How get_price's training-time fidelity moved per arm (last window minus first)."""
    parts = []
    for arm, pieces in groups.items():
        first, last = training_fidelity(pieces, "get_price")
        if first is not None and last is not None:
            parts.append(f"{arm} {last - first:+.3f}")
    return ("get_price training-time exact fidelity, last minus first " + str(WINDOW) + " steps: "
            + (", ".join(parts) if parts else "no arm has get_price calls in both windows") + ".")


# ----------------------------------------------------------------------------------------------------------
# Plots (matplotlib is optional: requirements-plot.txt)


def moving_average(values: list[float | None], window: int) -> list[float | None]:
    """Trailing mean over the last `window` points that exist; None where none does."""
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1):i + 1] if v is not None]
        out.append(sum(recent) / len(recent) if recent else None)
    return out


def seed_band(pieces: list[dict], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, min, max) over seeds of each seed's moving-averaged training curve of `key`."""
    steps = sorted({p["step"] for piece in pieces for p in piece.get("training_curve", [])})
    smoothed = []
    for piece in pieces:
        by_step = {p["step"]: p.get(key) for p in piece.get("training_curve", [])}
        smoothed.append(moving_average([by_step.get(s) for s in steps], WINDOW))
    out_steps, mean, low, high = [], [], [], []
    for i, step in enumerate(steps):
        values = [seed[i] for seed in smoothed if seed[i] is not None]
        if values:
            out_steps.append(step)
            mean.append(sum(values) / len(values))
            low.append(min(values))
            high.append(max(values))
    return out_steps, mean, low, high


def plot_band(ax, groups: dict, key: str):
    """Plot each arm's moving-averaged training curve of `key` on ax: mean over seeds, min-max band."""
    for arm, pieces in groups.items():
        steps, mean, low, high = seed_band(pieces, key)
        if not steps:
            continue
        line, = ax.plot(steps, mean, label=f"{arm} ({len(pieces)} seeds)")
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("GRPO step")
    ax.grid(alpha=0.3)


def write_plots(groups: dict, out: Path) -> list[Path] | None:
    """training_success.png and training_fidelity.png; None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    trained = {arm: pieces for arm, pieces in groups.items() if arm != "warm-start"}
    band = f"moving average of {WINDOW} steps; line: mean over seeds, band: min-max"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plot_band(ax, trained, "success_rate")
    ax.set_ylabel("training success rate")
    ax.set_title(f"Training success rate ({band})", fontsize=9)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "training_success.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True, sharey=True)
    for ax, tool in zip(axes.flat, TOOLS):
        plot_band(ax, trained, f"fidelity_exact/{tool}")
        ax.set_title(tool)
        ax.set_ylabel("exact fidelity")
    labelled = {}                            # one legend for the figure: an arm may lack calls of a tool
    for ax in axes.flat:
        labelled.update({label: line for line, label in zip(*ax.get_legend_handles_labels())})
    if labelled:
        fig.legend(list(labelled.values()), list(labelled), fontsize=8, loc="lower center", ncol=len(labelled))
    fig.suptitle(f"Training-time world-model fidelity per tool ({band}; frozen-sim: the frozen simulator's)",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out / "training_fidelity.png", dpi=110)
    plt.close(fig)
    return [out / "training_success.png", out / "training_fidelity.png"]


# ----------------------------------------------------------------------------------------------------------
# The report file


def report_header(groups: dict) -> list[str]:
    """The report's title and setup lines: the warm start(s) and notes, GRPO settings, held-out tasks, host."""
    pieces = [p for ps in groups.values() for p in ps]
    warm = sorted({p.get("warm_start", "") for p in pieces})
    trained = [p for p in pieces if p["arm"] != "warm-start"]
    notes = sorted({p["warm_start_note"] for p in pieces if p.get("warm_start_note")})
    several = " (MORE THAN ONE: these arms are not comparable)" if len(warm) > 1 else ""
    lines = ["# The ablation in miniature: who writes the tool responses during GRPO", "",
             f"Warm start: `{', '.join(warm)}`{several}" + "".join(f"; {n}" for n in notes) + "."]
    if trained:
        steps = sorted({p.get("grpo_steps") for p in trained})
        lines.append(f"GRPO steps {', '.join(map(str, steps))}, lr {trained[0].get('lr')}, "
                     f"{trained[0].get('tasks_per_step')} tasks x group {trained[0].get('group_size')} per step; "
                     f"held-out: {trained[0].get('eval_tasks')} toy-world test tasks; "
                     f"host: {trained[0].get('host')}.")
    return lines + [""]


SUCCESS_NOTE = ("Success with its 95% interval over tasks (each task's rewards over the seeds averaged, then a "
                "bootstrap over tasks; Wilson for one seed) and the sample std over seeds; pieces without per-task "
                "rewards show mean ± std over seeds. B = private rehearsals before each committed "
                "turn, B proposals at once (parallel); seq B=2: two in sequence, the second seeing the first's "
                "memory. The warm start is evaluated once.")
PAIRED_NOTE = ("Differences in held-out success on the same tasks and evaluation seeds, with a paired-bootstrap "
               "95% interval over tasks; better / worse count the tasks whose mean reward rose or fell. An interval "
               "that holds 0 is reported as no difference.")
HELD_OUT_FIDELITY_NOTE = ("Every real call is also rehearsed by the evaluated checkpoint in a discarded fork and "
                          "compared with the real response (per-role: by its trained world model, which evaluate.py "
                          "takes from the checkpoint's world_model/ folder).")
TRAINING_FIDELITY_NOTE = ("Exact fidelity of the responses written during training, weighted by calls, mean over "
                          "seeds. The warm start gave get_price no world supervision: does its fidelity rise when "
                          "the world role is trained (envace, per-role) and stay flat when it is not? Note: under "
                          "frozen-sim the responses are written by the frozen simulator, which cannot change; its "
                          "row only moves with the calls the actor makes. real has no rehearsed responses.")


DIAGNOSTICS_NOTE = ("Rehearsed turns are turns where the agent rehearsed before committing; the committed call "
                    "changed when it differs from the first proposal, and helped / hurt compares the real outcome "
                    "of the committed call with that of the first proposal (both replayed by the verifier on a "
                    "fresh copy of the environment). Agreement: the self-assessment's verdict on a proposal against "
                    "that proposal's real outcome. Counts summed over seeds.")


def comparison_table(groups: dict, before: dict) -> list[str]:
    """Markdown rows: per arm in both, held-out success at each budget and get_balance / get_price exact
    fidelity (B=0), the earlier experiment's mean -> this one's."""
    lines = ["| arm | " + " | ".join(BUDGET_LABELS) + " | get_balance | get_price |",
             "|---" * (len(BUDGET_LABELS) + 3) + "|"]
    for arm, pieces in groups.items():
        if arm not in before:
            continue
        cells = [f"{fmt(mean_std(success(p, label) for p in before[arm])[0])} → "
                 f"{fmt(mean_std(success(p, label) for p in pieces)[0])}" for label in BUDGET_LABELS]
        for tool in ("get_balance", "get_price"):
            old, new = (mean_std(p.get("fidelity_by_tool", {}).get(tool, {}).get("exact") for p in ps)[0]
                        for ps in (before[arm], pieces))
            cells.append(f"{fmt(old)} → {fmt(new)}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def write_report(results: Path, plots: bool = True, compare_with: Path | None = None) -> Path:
    """Write table.md in `results` (tables, sentences and, unless plots=False, the plots) from the piece JSONs
    there, with the earlier experiment in `compare_with` side by side when given; its path."""
    groups = load_pieces(results)
    lines = report_header(groups)
    lines += ["## Held-out success", "", SUCCESS_NOTE, "", *success_table(groups), "", ordering_sentence(groups), "",
              "## Paired differences", "", PAIRED_NOTE, "", *paired_tables(groups), "",
              "## Held-out world-model fidelity (exact, B=0)", "", HELD_OUT_FIDELITY_NOTE, "",
              *held_out_fidelity_table(groups), "",
              f"## Training-time fidelity: first {WINDOW} → last {WINDOW} GRPO steps", "", TRAINING_FIDELITY_NOTE, "",
              *training_fidelity_table(groups), "", mechanism_sentence(groups), ""]
    diagnostics = diagnostics_table(groups)
    if len(diagnostics) > 2:
        lines += ["## Test-time rehearsal diagnosed", "", DIAGNOSTICS_NOTE, "", *diagnostics, ""]
    if compare_with is not None:
        before = load_pieces(compare_with)
        lines += [f"## Beside the earlier experiment (`{rel(compare_with)}`)", "",
                  "Mean over seeds, earlier → this one: held-out success per budget, held-out exact fidelity (B=0).",
                  "", *comparison_table(groups, before), ""]
    written = write_plots(groups, results) if plots else []
    if written is None:
        print("plots skipped: matplotlib is not installed (pip install -r requirements-plot.txt)")
    for path in written or []:
        lines += [f"![{path.stem}]({path.name})", ""]
    table = results / "table.md"
    table.write_text("\n".join(lines))
    return table


def parse_args(argv=None):
    """The command line, checked: arms known, seeds and budgets as ints, a warm start that is a model folder."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--warm-start", default="", help="the shared warm-start checkpoint (required to run pieces)")
    ap.add_argument("--warm-start-note", default="", help="how the warm start was trained, recorded in every piece")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--act-only", action="store_true", help="also run the act-only arm")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=100, help="GRPO steps per arm")
    ap.add_argument("--lr", type=float, default=3e-5, help="GRPO learning rate (3e-4 drifts the tiny model below "
                    "its warm start: results/grpo_lr)")
    ap.add_argument("--tasks-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=10, help="checkpoint interval: a stopped piece loses less")
    ap.add_argument("--limit", type=int, default=256, help="held-out test tasks evaluated")
    ap.add_argument("--task-opts", default="", help="the toy world's load_tasks options for training and, unless "
                    "--eval-task-opts, evaluation (e.g. families=all)")
    ap.add_argument("--eval-task-opts", default=None, help="load_tasks options of the held-out set (e.g. "
                    "families=costly): a second --results folder over the same trained runs")
    ap.add_argument("--budgets", default="0,1,2,4", help="parallel rehearsal budgets evaluated (a piece written "
                    "with fewer gains the missing ones on a later run)")
    ap.add_argument("--seq-budgets", default="2", help="sequential rehearsal budgets evaluated ('' for none)")
    ap.add_argument("--host", default="2 cores of a shared x86 host", help="recorded with every piece")
    ap.add_argument("--runs", default="runs/experiment", help="run folders (not committed)")
    ap.add_argument("--results", default="results/experiment", help="piece JSONs, table.md and plots")
    ap.add_argument("--only-report", action="store_true", help="write the report from existing pieces only")
    ap.add_argument("--compare-with", default="", help="an earlier experiment's results folder, reported side by side")
    args = ap.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a.strip()] + (["act-only"] if args.act_only else [])
    args.arms = list(dict.fromkeys(args.arms))
    bad = [a for a in args.arms if a not in ARMS]
    if bad:
        ap.error(f"unknown arm(s) {', '.join(bad)}; choose from {', '.join(ARMS)}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    args.seq_budgets = [int(b) for b in args.seq_budgets.split(",") if b.strip()]
    if not args.only_report and not args.warm_start:
        ap.error("--warm-start PATH is required to run pieces (train it as the module docstring says)")
    if args.warm_start:
        args.warm_start = rel(Path(args.warm_start))
        if not (ROOT / args.warm_start / "config.json").is_file():
            ap.error(f"--warm-start {args.warm_start} is not a model folder (no config.json)")
    args.runs, args.results = Path(args.runs).resolve(), Path(args.results).resolve()
    if args.eval_task_opts is None:
        args.eval_task_opts = args.task_opts
    return args


def main(argv=None) -> int:
    """Run the missing pieces (unless --only-report), write and print the report; 1 if a piece failed, else 0."""
    args = parse_args(argv)
    failures = [] if args.only_report else run_pieces(args)
    args.results.mkdir(parents=True, exist_ok=True)
    table = write_report(args.results, compare_with=Path(args.compare_with).resolve() if args.compare_with else None)
    print(table.read_text())
    print(f"wrote {rel(table)}")
    if failures:
        print(f"failed pieces (rerun to retry): {', '.join(failures)}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

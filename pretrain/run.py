"""Pretrain the embedded tiny model on pretrain/data.py's documents, resumably, and ship its weights.

    python -m pretrain.run --out runs/pretrain --steps 20000          # start, or continue where it stopped
    python -m pretrain.run --out runs/pretrain --steps 20000 --until 3000   # one piece: stop at step 3000
    python -m pretrain.run --out runs/pretrain --export weights/tiny-recall  # bf16 HF folder of the latest
    python -m pretrain.run --out runs/pretrain --resume-from results/pretrain/state   # continue a committed run

Starts from the deterministic tiny model (policy.build_tiny: its tokenizer and random init). Every
--save-every steps it writes a checkpoint (weights, AdamW state, step) to OUT/ckpt, replacing the last one,
runs the keyed-lookup probe on held-out toy-world tables (experiments/warm_start_world.lookup_probe) and appends
one JSON line per step to OUT/metrics.jsonl (loss per document kind; the probe's exact and argument-blind
share when it ran). A piece that is stopped (Ctrl-C, --until, a session's end) resumes from the last
checkpoint with the same documents (pretrain.data.document is a pure function of seed, step and row) and the
same learning-rate schedule. Runs on CPU in float32 (one thread by default) or on a GPU with --device cuda.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

import chat_format
import policy
from bench import toyworld
from experiments.warm_start_world import lookup_probe, write_probe
from pretrain import data


@dataclass
class PretrainConfig:
    """One config: the schedule, the batch and the data mixture (the probe runs at every save)."""
    steps: int = 20000
    batch: int = 8
    lr: float = 1e-3
    min_lr_frac: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 250
    probe_tasks: int = 16
    # [[first step, pretrain.data stage name], ...]: the document mixture from each step on (--stage appends)
    stages: list = field(default_factory=lambda: [[0, "recall"]])
    # [[first step, last step, peak lr], ...]: schedules appended past `steps` by --extend-to (a warm restart:
    # cosine from the peak down to min_lr_frac * lr over the extension)
    extensions: list = field(default_factory=list)


def stage_at(step: int, cfg: PretrainConfig) -> str:
    """The data stage that step `step` draws its documents from."""
    return [name for first, name in cfg.stages if first <= step][-1]


def last_step(cfg: PretrainConfig) -> int:
    """Where the schedule ends: cfg.steps, or the end of its last extension."""
    return max([cfg.steps] + [end for _, end, _ in cfg.extensions])


def lr_at(step: int, cfg: PretrainConfig) -> float:
    """Linear warmup, then cosine down to min_lr_frac * lr at cfg.steps; in an extension, cosine from its peak."""
    floor = cfg.min_lr_frac * cfg.lr
    for first, end, peak in reversed(cfg.extensions):
        if step >= first:
            t = min(1.0, (step - first) / max(1, end - first))
            return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * t))
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def collate(docs, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and targets (next token, -100 where no loss)."""
    width = max(len(ids) for ids, _, _ in docs)
    ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(docs), width), dtype=torch.long)
    targets = torch.full((len(docs), width), -100, dtype=torch.long)
    for r, (x, mask, _) in enumerate(docs):
        ids[r, :len(x)] = torch.tensor(x)
        attn[r, :len(x)] = 1
        t = torch.tensor(x[1:])
        m = torch.tensor(mask[1:], dtype=torch.bool)
        targets[r, :len(x) - 1] = torch.where(m, t, torch.full_like(t, -100))   # token t+1 predicted at t
    return ids.to(device), attn.to(device), targets.to(device)


def loss_per_row(model, ids, attn, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed token loss per row, trained tokens per row). The output layer runs only where a token is
    trained (about half the positions): on a 3.5M-parameter model it is a third of the compute."""
    hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
    where = targets != -100
    logits = model.lm_head(hidden[where]).float()
    nll = torch.nn.functional.cross_entropy(logits, targets[where], reduction="none")
    per_row = torch.zeros(ids.shape[0], dtype=nll.dtype, device=nll.device).index_add_(
        0, where.nonzero()[:, 0], nll)
    return per_row, where.sum(-1)


def save_checkpoint(out: Path, step: int, model, tok, optimizer, cfg: PretrainConfig):
    """OUT/ckpt: an HF folder + optimizer.pt + state.json, written beside and renamed into place."""
    tmp = out / "ckpt.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "config": asdict(cfg)}, indent=1))
    old = out / "ckpt.old"
    shutil.rmtree(old, ignore_errors=True)
    if (out / "ckpt").exists():
        os.replace(out / "ckpt", old)
    os.replace(tmp, out / "ckpt")
    shutil.rmtree(old, ignore_errors=True)


def probe(folder: Path, n_tasks: int) -> dict:
    """On held-out toy-world tables: keyed lookups (exact and argument-blind share per lookup tool) and the
    world's arithmetic (exact share of valid transfers, purchases and the lookups after them)."""
    tasks = toyworld.load_tasks("test", limit=n_tasks)
    result = lookup_probe(str(folder), tasks)
    out = {tool: {k: v[k] for k in ("exact", "chance", "argument_blind")} for tool, v in result.items()}
    writes = write_probe(str(folder), tasks)
    return {**out, **{tool: v for tool, v in writes.items() if tool != "rows"}}


def export(out: Path, dest: Path):
    """The latest checkpoint as a bf16 HF folder (weights + tokenizer + recipe), for shipping."""
    ckpt = out / "ckpt"
    state = json.loads((ckpt / "state.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(ckpt)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    probe_result = probe(ckpt, 32)
    (tmp / "pretrain.json").write_text(json.dumps(
        {"step": state["step"], "config": state["config"],
         "data": {name: data.describe(data.stage_config(name)) for _, name in state["config"].get("stages", [[0, "recall"]])},
         "tiny_recipe": json.loads((ckpt / "tiny_recipe.json").read_text()) if (ckpt / "tiny_recipe.json").exists()
         else None, "lookup_probe_32_tasks": probe_result}, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return probe_result


PROBE_COLUMNS = [("get_balance", "exact"), ("get_balance", "argument_blind"), ("get_price", "exact"),
                 ("get_price", "argument_blind"), ("transfer", "exact"), ("buy", "exact"),
                 ("lookup after write", "exact")]


def probe_table(metrics: Path, first_step: int = 0) -> str:
    """The probe curve of a metrics.jsonl as a markdown table, one row per probed step from first_step, with
    the mean loss of each document kind over the steps since the previous row."""
    rows, losses = [], {}
    state = metrics.parent / "state.json"           # the stages, where the metrics sit beside a checkpoint
    stages = json.loads(state.read_text())["config"].get("stages") if state.exists() else None
    cfg = PretrainConfig(stages=stages or [[0, "recall"]])
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue                        # a torn last line of a stopped run
        for kind in data.KINDS:
            if f"loss_{kind}" in rec:
                losses.setdefault(kind, []).append(rec[f"loss_{kind}"])
        if "probe" not in rec:
            continue
        if rec["step"] >= first_step:
            cells = [rec["probe"].get(tool, {}).get(key) for tool, key in PROBE_COLUMNS]
            mean = {k: sum(v) / len(v) for k, v in losses.items() if v}
            rows.append([str(rec["step"]), stage_at(rec["step"] - 1, cfg)]
                        + ["-" if c is None else f"{c:.2f}" for c in cells]
                        + [f"{mean[k]:.2f}" if k in mean else "-" for k in data.KINDS])
        losses = {}
    head = ["step", "stage"] + [f"{t} {'blind' if k == 'argument_blind' else k}" for t, k in PROBE_COLUMNS] + \
        [f"loss {k}" for k in data.KINDS]
    return "\n".join(["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
                     + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def main(argv=None) -> int:
    """Export the latest checkpoint (--export), or run or resume pretraining up to --until, checkpointing and
    probing every save_every steps and logging a metrics line per step; the exit code."""
    ap = argparse.ArgumentParser(prog="python -m pretrain.run", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/pretrain", help="run folder (checkpoint, metrics.jsonl)")
    ap.add_argument("--steps", type=int, default=PretrainConfig.steps, help="length of the lr schedule")
    ap.add_argument("--until", type=int, default=0, help="stop this piece at this step (0: at --steps)")
    ap.add_argument("--batch", type=int, default=PretrainConfig.batch)
    ap.add_argument("--lr", type=float, default=PretrainConfig.lr)
    ap.add_argument("--save-every", type=int, default=PretrainConfig.save_every)
    ap.add_argument("--probe-tasks", type=int, default=PretrainConfig.probe_tasks,
                    help="held-out tables the lookup probe reads at each save (0: no probe)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (one job per core)")
    ap.add_argument("--export", default="", metavar="DEST", help="only write the latest checkpoint to DEST (bf16)")
    ap.add_argument("--table", default="", metavar="METRICS",
                    help="only print the probe curve of a metrics.jsonl as a markdown table (--table-from STEP)")
    ap.add_argument("--table-from", type=int, default=0)
    ap.add_argument("--resume-from", default="", metavar="STATE",
                    help="a committed state folder (results/pretrain/state): copied to OUT/ckpt when OUT has none, "
                         "with its metrics.jsonl beside it, so a new machine continues the same run")
    ap.add_argument("--extend-to", type=int, default=0, metavar="STEP",
                    help="lengthen a finished schedule to this step: a warm restart at --extend-lr (recorded in the state)")
    ap.add_argument("--extend-lr", type=float, default=3e-4, help="peak lr of the --extend-to restart")
    ap.add_argument("--stage", default="", choices=["", *data.STAGES],
                    help="draw documents from this pretrain.data stage from the current step on (recorded in the "
                         "state, so later pieces keep it)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.table:
        print(probe_table(Path(args.table), args.table_from), end="")
        return 0
    if args.export:
        if not (out / "ckpt" / "state.json").exists():
            ap.error(f"no checkpoint in {out / 'ckpt'}: run a piece first")
        print(json.dumps(export(out, Path(args.export)), indent=1))
        return 0
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    out.mkdir(parents=True, exist_ok=True)
    if args.resume_from and not (out / "ckpt" / "state.json").exists():
        state_dir = Path(args.resume_from)
        if not (state_dir / "state.json").exists():
            ap.error(f"--resume-from {state_dir}: no state.json there (not a pretraining state folder)")
        shutil.copytree(state_dir, out / "ckpt", ignore=shutil.ignore_patterns("metrics.jsonl"))
        if (state_dir / "metrics.jsonl").exists():
            shutil.copy(state_dir / "metrics.jsonl", out / "metrics.jsonl")
        shutil.copy(state_dir / "tiny_recipe.json", out / "tiny_recipe.json")
    start = 0
    if (out / "ckpt" / "state.json").exists():
        state = json.loads((out / "ckpt" / "state.json").read_text())
        cfg = PretrainConfig(**state["config"])
        start = state["step"]
        source = out / "ckpt"
    else:
        cfg = PretrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, save_every=args.save_every,
                             probe_tasks=args.probe_tasks)
        source = policy.ensure_tiny()
    if args.extend_to and args.extend_to > last_step(cfg):
        if start < last_step(cfg):
            ap.error(f"--extend-to: the schedule has not ended (step {start} of {last_step(cfg)}); finish it first")
        cfg.extensions = [*cfg.extensions, [start, args.extend_to, args.extend_lr]]
    if args.stage and stage_at(start, cfg) != args.stage:
        cfg.stages = [*[s for s in cfg.stages if s[0] < start], [start, args.stage]]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(device).train()
    tok = AutoTokenizer.from_pretrained(source)
    if not (out / "ckpt").exists():
        shutil.copy(Path(source) / "tiny_recipe.json", out / "tiny_recipe.json")
    fmt = chat_format.derive_chat_format(tok)
    held = data.HeldOut()
    stage_configs = {name: data.stage_config(name) for _, name in cfg.stages}
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, cfg.beta2),
                                  weight_decay=cfg.weight_decay)
    if start:
        optimizer.load_state_dict(torch.load(out / "ckpt" / "optimizer.pt", map_location=device))
    until = min(args.until or last_step(cfg), last_step(cfg))
    log = open(out / "metrics.jsonl", "a")
    bar = tqdm(range(start, until), initial=start, total=until, desc="pretrain", dynamic_ncols=True)
    t_last = time.perf_counter()
    for step in bar:
        dcfg = stage_configs[stage_at(step, cfg)]
        docs = [data.document(fmt, cfg.seed, step, r, dcfg, held) for r in range(cfg.batch)]
        ids, attn, targets = collate(docs, tok.pad_token_id, device)
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, cfg)
        nll, count = loss_per_row(model, ids, attn, targets)
        loss = nll.sum() / count.sum().clamp(min=1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        optimizer.step()
        record = {"step": step + 1, "loss": round(loss.item(), 4), "lr": lr_at(step, cfg),
                  "grad_norm": round(grad_norm, 3), "tokens": int(attn.sum())}
        for kind in data.KINDS:
            rows = [r for r, d in enumerate(docs) if d[2] == kind]
            if rows:
                record[f"loss_{kind}"] = round((nll[rows].sum() / count[rows].sum().clamp(min=1)).item(), 4)
        if (step + 1) % cfg.save_every == 0 or step + 1 == until:
            save_checkpoint(out, step + 1, model, tok, optimizer, cfg)
            shutil.copy(out / "tiny_recipe.json", out / "ckpt" / "tiny_recipe.json")
            now = time.perf_counter()
            record["seconds_since_last_save"] = round(now - t_last, 1)
            if cfg.probe_tasks:
                record["probe"] = probe(out / "ckpt", cfg.probe_tasks)
                bal, price = record["probe"]["get_balance"], record["probe"]["get_price"]
                writes = " | ".join(f"{tool} exact {record['probe'][tool]['exact']:.2f}"
                                    for tool in ("transfer", "buy", "lookup after write") if tool in record["probe"])
                tqdm.write(f"step {step + 1}: loss {record['loss']:.3f} | get_balance exact {bal['exact']:.2f} "
                           f"blind {bal['argument_blind']:.2f} | get_price exact {price['exact']:.2f} "
                           f"blind {price['argument_blind']:.2f} | {writes}")
            t_last = time.perf_counter()
        log.write(json.dumps(record) + "\n")
        log.flush()
        bar.set_postfix(loss=f"{record['loss']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Runs on disk: model folders, checkpoints (written atomically), resume, the frozen start-of-GRPO snapshot, and
the metrics log.

A run folder holds config.json, metrics.jsonl, samples.jsonl, ckpt/step_N/ (an HF folder with the tokenizer and
chat template, optim_rank{r}.pt, state.json; world_model/ with --world-model separate), `latest` (the path of
the newest complete checkpoint) and reference/ (the policy as GRPO began). Every write goes to a hidden temp
file or folder that is renamed into place, so a kill at any moment leaves the previous state readable.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import policy
from distributed import Dist, enable_activation_checkpointing, shard


WORLD_DIR = "world_model"   # the separate world model inside a checkpoint folder


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the file and the fix."""


class VocabularyMismatch(ValueError):
    """A second model (--sim-model) whose tokenizer differs from the policy's; main() prints it and exits 2."""


def write_atomic(path: Path, text: str):
    """Write `text` to `path` through a temp file, fsynced, then renamed: never a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    """The python, numpy and torch generator states, saved with each checkpoint."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def save_model_folder(model, tok, folder: Path, d: Dist, template_kwargs: dict | None = None):
    """The full model (gathered from FSDP shards) and tokenizer (with its chat template and the template
    variables) as an HF folder, written by rank 0."""
    if d.world_size > 1:
        # slow to import, only needed under torchrun
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        dist.barrier()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        full = None
    if d.main:
        model.save_pretrained(folder, state_dict=full) if full is not None else model.save_pretrained(folder)
        tok.save_pretrained(folder)
        policy.save_template_kwargs(folder, template_kwargs or {})
    if d.world_size > 1:
        dist.barrier()


def grpo_start_snapshot(model, tok, run: Path, d: Dist) -> Path:
    """RUN/reference/: the policy as GRPO began (the end of the warm start), written once (temp folder, then
    renamed; gathered from the shards under FSDP). The KL reference, the default frozen simulator and the
    separate world model's starting point are all loaded back from it, so a resumed run gets the models of
    the uninterrupted one, bit for bit, instead of the policy it resumed from (and no sharded model is ever
    deep-copied, which FSDP2 does not support)."""
    folder = run / "reference"
    if not (folder / "config.json").exists():
        tmp = run / ".reference.tmp"
        if d.main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        save_model_folder(model, tok, tmp, d)
        if d.main:
            os.replace(tmp, folder)
        if d.world_size > 1:
            dist.barrier()
    return folder


def load_model(folder: Path, d: Dist, what: str, tok=None, trainable: bool = False, checkpointing: bool = False):
    """A model from an HF folder, sharded like the policy; frozen (eval, no gradients) unless trainable
    (then with activation checkpointing when asked, as the policy).
    With `tok` (the policy's tokenizer), a model with another vocabulary is refused: both models read one
    token sequence."""
    try:
        model, its_tok = policy.load_policy(str(folder), dtype=torch.float32, device=d.device)
    except policy.PolicyLoadError as exc:
        raise CheckpointError(f"cannot load {what} from {folder} ({exc})") from exc
    if tok is not None and its_tok.get_vocab() != tok.get_vocab():
        raise VocabularyMismatch(f"{what} {folder} has another tokenizer than the policy; both models read one "
                                 "token sequence, so they must share the vocabulary")
    if trainable and checkpointing:
        enable_activation_checkpointing(model)
    model = shard(model, d)
    for p in model.parameters():
        p.requires_grad_(trainable)
    return model.train() if trainable else model.eval()


def reference_model(model, tok, run: Path, d: Dist):
    """The frozen KL reference: the policy as GRPO began."""
    folder = grpo_start_snapshot(model, tok, run, d)
    try:
        return load_model(folder, d, "the KL reference")
    except CheckpointError as exc:
        raise CheckpointError(f"{exc}; delete {folder} to take the resumed policy as the reference") from exc


def save_checkpoint(run: Path, step: int, model, tok, optimizer, cfg, d: Dist, extra: dict,
                    template_kwargs: dict | None = None, world=None):
    """ckpt/step_N/: HF folder (model + tokenizer with its chat template, the template variables),
    optim_rank{r}.pt, state.json (cfg, a train.TrainConfig, saved in it); then `latest` -> it. With
    world=(model, optimizer) (--world-model separate), the world model in ckpt/step_N/world_model/ beside
    optim_world_rank{r}.pt.

    Everything is written into a hidden temp folder that is renamed into place, and `latest` is replaced
    last, so a kill at any moment leaves the previous checkpoint as the latest complete one.
    """
    name = f"step_{step:06d}"
    final = run / "ckpt" / name
    tmp = run / "ckpt" / f".{name}.tmp"
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    save_model_folder(model, tok, tmp, d, template_kwargs)
    torch.save({"optimizer": optimizer.state_dict(), "rng": rng_state()}, tmp / f"optim_rank{d.rank}.pt")
    if world is not None:
        if d.main:
            (tmp / WORLD_DIR).mkdir()
        save_model_folder(world[0], tok, tmp / WORLD_DIR, d, template_kwargs)
        torch.save({"optimizer": world[1].state_dict()}, tmp / f"optim_world_rank{d.rank}.pt")
    if d.world_size > 1:
        dist.barrier()
    if d.main:
        state = {"step": step, "world_size": d.world_size, "config": asdict(cfg), **extra}
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_atomic(run / "latest", f"ckpt/{name}\n")
        if cfg.keep_checkpoints > 0:
            for old in sorted((run / "ckpt").glob("step_*"))[:-cfg.keep_checkpoints]:
                if old != final:   # hidden first, then deleted: a visible checkpoint is never half-removed
                    trash = old.with_name(f".trash-{old.name}")
                    os.replace(old, trash)
                    shutil.rmtree(trash, ignore_errors=True)
    if d.world_size > 1:
        dist.barrier()
    return final


def load_optimizer_state(optimizer, path: Path):
    """Restore an optimizer from a checkpoint's optim_*.pt; any failure is a CheckpointError naming the file."""
    try:
        optimizer.load_state_dict(torch.load(path, weights_only=False)["optimizer"])
    except Exception as exc:
        raise CheckpointError(f"cannot load optimizer state from {path}: {type(exc).__name__}: {exc}") from exc


def latest_checkpoint(run: Path) -> Path:
    """The checkpoint folder RUN/latest names, checked to be complete (state.json and config.json present)."""
    pointer = run / "latest"
    if not pointer.exists():
        raise CheckpointError(f"{run} has no 'latest' checkpoint pointer; nothing to resume (start a new run "
                              "without --resume)")
    path = run / pointer.read_text().strip()
    need = [path / "state.json", path / "config.json"]
    if not path.is_dir() or any(not p.exists() for p in need):
        raise CheckpointError(f"checkpoint {path} named by {pointer} is missing or incomplete")
    return path


def read_state(ckpt: Path) -> dict:
    """A checkpoint's state.json (step, world size, config); a corrupt one is a CheckpointError with the fix."""
    try:
        return json.loads((ckpt / "state.json").read_text())
    except ValueError as exc:
        raise CheckpointError(f"{ckpt / 'state.json'} is corrupt ({exc}); resume from an earlier checkpoint "
                              "by editing the 'latest' file, or start a new run") from exc


class MetricsLog:
    """One JSON object per line, flushed and fsynced per record, so a killed run never leaves a torn line.
    On resume from checkpoint step_N (N steps done: 0..N-1), records of steps >= N (written after that
    checkpoint by the killed process, and re-run now) and any torn tail are dropped first."""

    def __init__(self, path: Path, keep_before_step: int | None = None):
        self.path = path
        if keep_before_step is not None and path.exists():
            kept = []
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    break
                if rec.get("step", -1) < keep_before_step:
                    kept.append(line)
            write_atomic(path, "".join(k + "\n" for k in kept))
        self.f = open(path, "a")

    def write(self, record: dict):
        """Append one record as a line, on disk before this returns."""
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

"""EnvACE training: GRPO on role-masked token log-probs, acting and world rehearsal optimised jointly.

    python train.py                                       # tiny model on the embedded toy world (CPU, minutes)
    torchrun --nproc_per_node 8 train.py --model /ckpt/Qwen3-8B --bench tau2

One step: sample tasks -> roll out G trajectories per task (rehearsal by default: the policy writes every
tool response) -> verifier reward (reward.py) -> group-normalised advantages -> clipped-ratio loss on the
trained roles' tokens -> AdamW.

The paper's ablation arms (named after the launch scripts in the official repository's examples/drmas_trainer/):
    --env sim --train-roles act           standard GRPO: a frozen simulator writes every tool response
                                          (run_checklist_caller_only.sh)
    --env rehearse --world-model separate per-role policies: a second model writes and is trained on the
                                          WORLD tokens (run_checklist_noshare.sh)
    --env rehearse                        EnvACE: one set of weights plays both roles (run_checklist_share.sh)
    --env real --train-roles act          the real environment (a ceiling, not one of the paper's arms)

This file is the run: its config (TrainConfig, one flag per field), the loop and its two kinds of step, the CLI.
The pieces it puts together live one concern per file: grpo.py (the GRPO math: masked log-probs, advantages,
the loss), warm_start.py (the supervised warm start's sequences and loss), distributed.py (processes, FSDP2,
sums over ranks), checkpoint.py (model folders, checkpoints, resume, the metrics log).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import policy
import report
import reward
import rollout
from bench import BENCHES, DEFAULT_BENCH, BenchUnavailable, lacks, load_bench, optional, settings
from chat_format import CALL_FORMATS
from checkpoint import (WORLD_DIR, CheckpointError, MetricsLog, VocabularyMismatch, grpo_start_snapshot,
                        latest_checkpoint, load_model, load_optimizer_state, read_state, reference_model,
                        save_checkpoint, write_atomic)
from cli import OneLineParser, load_presets, parse_task_opts as parse_opts_text, template_kwargs_text
from distributed import (Dist, all_sum, autocast, enable_activation_checkpointing, gather_sums,
                         gathered_for_generation, setup_dist, shard)
from grpo import LossConfig, grpo_loss, role_advantages, role_mask, role_weights, token_logprobs
from roles import Role
from rollout import load_engine
from warm_start import sft_loss, sft_sequence

# ----------------------------------------------------------------------------------------------------------
# Configuration


def opt(default, help: str, choices=None):
    """A TrainConfig field with its --help text (and choices): the config documents its own flags."""
    return field(default=default, metadata={"help": help, "choices": choices})


PER_BENCH = "per benchmark, bench/settings.py"


@dataclass
class TrainConfig:
    """Every knob of a run; each field is a flag (--field-name). None means: resolved at start (resolved())."""
    model: str = opt("tiny", "'tiny' (the embedded model, pretrained: weights/tiny-recall), 'tiny-init' (its "
                             "random init), a local HF folder or a .gguf file")
    chat_template: str | None = opt(None, "a jinja file replacing the model's chat template (default: the model's own)")
    chat_template_kwargs: str | None = opt(None, "extra chat-template variables as a JSON object, e.g. "
                                        "'{\"enable_thinking\": false}' (default: those saved with the model)")
    tool_call_format: str | None = opt(None, "how the model writes tool calls (default: inferred from the chat template)",
                                list(CALL_FORMATS))
    bench: str = opt(DEFAULT_BENCH, "benchmark to train on", list(BENCHES))
    split: str | None = opt(None, f"split to train on (default: {PER_BENCH}: tau2's own train split, BFCL's train half)")
    task_opts: str | None = opt(None, "extra load_tasks options as key=value,key=value (e.g. domain=airline)")
    out: str | None = opt(None, "run folder (default: runs/MODEL-BENCH, e.g. runs/tiny-toyworld)")
    env: str = opt("rehearse", "who writes tool responses in GRPO rollouts: rehearse (the policy's world role, "
                               "EnvACE), real (the environment), sim (a frozen simulator)", ["rehearse", "real", "sim"])
    sim_model: str | None = opt(None, "--env sim: the frozen simulator, a local HF folder (default: a frozen copy of the "
                             "policy as GRPO began, kept in RUN/reference/)")
    world_model: str = opt("shared", "shared: one model plays both roles (EnvACE); separate: a second model "
                                     "writes and is trained on the WORLD tokens (per-role policies)",
                           ["shared", "separate"])
    user_model: str | None = opt(None, "simulated user for tau2/vita, a local HF folder (default: the policy itself)")
    train_roles: str | None = opt(None, "roles whose tokens get the GRPO loss: act,world or act (default: act,world "
                                   "with --env rehearse, else act)")
    steps: int = opt(30, "GRPO steps (after --sft-steps warm-start steps)")
    tasks_per_step: int = opt(8, "tasks per GRPO step (the paper: 16)")
    group_size: int = opt(4, "rollouts per task: the GRPO group (the paper: 4)")
    lr: float | None = opt(None, "GRPO learning rate (default: 1e-6 for a real model, the paper's; 3e-5 tiny)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "gradient-norm clip")
    updates_per_batch: int = opt(1, "optimizer updates per rollout batch (the paper: 1)")
    micro_batch: int = opt(8, "rows per forward/backward")
    temperature: float | None = opt(None, f"sampling temperature of training rollouts ({PER_BENCH}: the paper's 1.0)")
    top_p: float = opt(1.0, "top-p of training rollouts")
    max_new_tokens: int | None = opt(None, f"tokens per assistant turn (default: {PER_BENCH})")
    max_world_tokens: int | None = opt(None, f"tokens per rehearsed tool response (default: {PER_BENCH})")
    max_turns: int | None = opt(None, f"assistant turns per trajectory (default: {PER_BENCH})")
    max_total_len: int | None = opt(None, f"tokens per trajectory, prompt included (default: {PER_BENCH})")
    respond_at_turn_limit: bool = opt(True, "a single-turn task's calls still get their responses (rehearsed by the "
                                      "world role under --env rehearse) before the episode ends, so every call "
                                      "trains the world model; the verdict never reads them")
    clip_low: float = opt(0.2, "PPO ratio clip below 1")
    clip_high: float = opt(0.2, "PPO ratio clip above 1")
    dual_clip: float = opt(3.0, "dual-clip bound for negative advantages (0: off)")
    kl_coef: float = opt(1e-4, "k3 KL to the policy as GRPO began (kept in RUN/reference/); 0: none")
    aggregate: str = opt("token_mean", "loss aggregation", ["token_mean", "seq_mean"])
    scale_std: bool = opt(False, "divide advantages by the group's std (GRPO); off: Dr.GRPO, as the paper")
    per_role_adv: bool = opt(True, "role-wise groups: each role normalised over the rows that hold it")
    act_weight: float = opt(1.0, "loss weight of ACT tokens")
    world_weight: float = opt(1.0, "loss weight of WORLD tokens")
    reward: str | None = opt(None, "checklist (share of rule-based items met), success (binary task score); "
                              "default: checklist where the benchmark has one", ["checklist", "success"])
    defect_penalty: float = opt(0.1, "reward lost per defect of a rehearsed response (when WORLD is trained)")
    sft_steps: int | None = opt(None, "supervised warm-start steps on reference chats before GRPO (default on "
                                      "toyworld: 400 for tiny, 1600 for tiny-init; else 0)")
    sft_batch: int = opt(16, "warm-start sequences per step")
    sft_lr: float | None = opt(None, "warm-start learning rate (default: 1e-3 for tiny, pretrained; 5e-3 for "
                                     "tiny-init; 1e-5 for a real model)")
    sft_warmup: int = opt(30, "linear ramp of --sft-lr over the first steps")
    sft_rehearsal_frac: float | None = opt(None, "share of warm-start sequences teaching the test-time rehearsal "
                                                 "format (default: 0.25 for tiny on toyworld, else 0)")
    sft_memory: str = opt("real", "rehearsal-format memory lines: real responses, or the model's own rehearsed "
                                  "ones (self)", ["real", "self"])
    sft_world_frac: float = opt(0.0, "share of warm-start sequences that are world examples (toy world only)")
    sft_world_lookup: float = opt(0.0, "share of world-example calls that are valid lookups (the rest random)")
    sft_world_skip: str | None = opt(None, "comma list of tools whose responses get no warm-start loss (mechanism test)")
    beta2: float = opt(0.95, "AdamW beta2")
    sft_roles: str = opt("act,world", "roles trained in the warm start")
    seed: int = opt(0, "seed of task draws, sampling and init")
    save_every: int = opt(20, "steps between checkpoints")
    report_to: str = opt("none", "experiment logger beside metrics.jsonl (report.py; wandb runs offline unless "
                         "WANDB_MODE is set)", choices=["none", "tensorboard", "wandb"])
    keep_checkpoints: int = opt(3, "step_N folders kept (older ones removed after each save); 0 keeps all")
    chunk_size: int = opt(1024, "positions per LM-head chunk in the log-prob pass")
    activation_checkpointing: str | None = opt(None, "recompute each decoder layer in backward instead of keeping its "
                                                "activations (a 16k-token row of an 8B model keeps ~80 GB without "
                                                "it); default: on for a real model, off for tiny", ["on", "off"])
    max_bad_steps: int = opt(3, "consecutive non-finite steps before the run stops")
    overwrite: bool = opt(False, "replace an existing --out folder")
    require_update: bool = opt(True, "exit 1 when no GRPO step of the run had a learning signal (every group flat "
                                     "or nothing trained); --no-require-update for smoke runs: a warning instead")

    def resolved(self) -> "TrainConfig":
        """A copy with every None replaced by its value for this model and benchmark (None is the one "unset")."""
        c = TrainConfig(**asdict(self))
        tiny = c.model in policy.TINY_NAMES
        bench = settings.settings_for(c.bench)
        if c.lr is None:
            c.lr = 3e-5 if tiny else 1e-6    # 3e-4 drifts the tiny model below its warm start (results/grpo_lr)
        if c.sft_steps is None:
            c.sft_steps = SFT_TINY_STEPS.get(c.model, 0) if bench.tiny_warm_start else 0
        if c.sft_lr is None:    # the random init needs the large step; pretrained weights keep their recall at 1e-3
            c.sft_lr = SFT_TINY_LR.get(c.model, 1e-5)
        if c.sft_rehearsal_frac is None:   # the tiny model never saw the format
            c.sft_rehearsal_frac = 0.25 if tiny and bench.tiny_warm_start else 0.0
        for key, value in settings.limits_for(c.bench, **{k: getattr(c, k) for k in settings.LIMIT_FIELDS}).items():
            setattr(c, key, value)
        c.split = c.split or bench.train_split
        c.temperature = bench.train_temperature if c.temperature is None else c.temperature
        c.out = c.out or default_out(c.model, c.bench)
        if c.train_roles is None:
            c.train_roles = "act,world" if c.env == "rehearse" else "act"
        if c.activation_checkpointing is None:
            c.activation_checkpointing = "off" if tiny else "on"
        if c.reward is None:
            c.reward = "checklist" if reward.has_checklist(c.bench) else "success"
        return c


def default_out(model: str, bench: str) -> str:
    """runs/MODEL-BENCH: MODEL the folder or file name without its extension ('tiny' for the tiny model)."""
    name = Path(model.rstrip("/")).name
    for ext in (".gguf", ".safetensors"):
        name = name[:-len(ext)] if name.endswith(ext) else name
    return f"runs/{name or 'model'}-{bench}"


# warm-start steps on the toy world: the shipped weights need few (held-out B=0 0.69 at 400, keyed lookups kept;
# results/warm_start_pretrained/), the random init waits for its copy transition (~280-1200 steps, results/README.md)
SFT_TINY_STEPS = {"tiny": 400, "tiny-init": 1600}
SFT_TINY_LR = {"tiny": 1e-3, "tiny-init": 5e-3}   # 5e-3 erodes the pretrained recall (results/warm_start_pretrained/)
ROLE_NAMES = {"act": Role.ACT, "world": Role.WORLD}


class ConfigError(ValueError):
    """A bad flag value; main() prints it as one line and exits 2."""


def parse_roles(text: str) -> list[Role]:
    """'act,world' -> [Role.ACT, Role.WORLD]; anything else is a ConfigError."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in ROLE_NAMES]
    if bad or not names:
        raise ConfigError(f"roles must be a comma list of act,world; got {text!r}")
    return [ROLE_NAMES[n] for n in names]


def parse_task_opts(text: str | None) -> dict:
    """--task-opts as load_tasks options (cli.parse_task_opts, the parser evaluate.py uses too); ConfigError on a
    malformed one. None (unset): no options."""
    try:
        return parse_opts_text(text or "")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def parse_tool_names(text: str) -> frozenset:
    """'get_price,buy' -> frozenset of names ("" -> empty)."""
    names = [t.strip() for t in text.split(",")]
    if text.strip() and not all(names):
        raise ConfigError(f"--sft-world-skip takes a comma list of tool names, got {text!r}")
    return frozenset(n for n in names if n)


def validate(cfg: TrainConfig):
    """Refuse a bad flag value (or combination) with a ConfigError naming the flag, before anything loads."""
    if cfg.bench not in BENCHES:
        raise ConfigError(f"unknown --bench {cfg.bench!r}; choose one of: {', '.join(BENCHES)}")
    if cfg.env not in ("rehearse", "real", "sim"):
        raise ConfigError(f"--env must be rehearse, real or sim, not {cfg.env!r}")
    if cfg.world_model not in ("shared", "separate"):
        raise ConfigError(f"--world-model must be shared or separate, not {cfg.world_model!r}")
    roles = set(parse_roles(cfg.train_roles)) if cfg.train_roles is not None else set()
    if cfg.env == "sim" and Role.WORLD in roles:
        raise ConfigError("--env sim: the frozen simulator's WORLD tokens are never trained; use --train-roles act "
                          "(the default with --env sim)")
    if cfg.sim_model and cfg.env != "sim":
        raise ConfigError(f"--sim-model is the frozen simulator of --env sim; it has no use with --env {cfg.env}")
    if cfg.sim_model and not Path(cfg.sim_model).exists():
        raise ConfigError(f"--sim-model {cfg.sim_model}: no such file or folder")
    if cfg.world_model == "separate" and (cfg.env != "rehearse" or roles and Role.WORLD not in roles):
        raise ConfigError("--world-model separate trains a second model on the WORLD tokens it writes: it needs "
                          "--env rehearse and WORLD among --train-roles (for an untrained simulator use --env sim)")
    if cfg.reward is not None and cfg.reward not in reward.REWARD_KINDS:
        raise ConfigError(f"--reward must be one of {', '.join(reward.REWARD_KINDS)}, not {cfg.reward!r}")
    if cfg.reward == "checklist" and not reward.has_checklist(cfg.bench):
        raise ConfigError(f"--reward checklist: benchmark {cfg.bench!r} has no rule-based checklist (toyworld, "
                          "tau2 and bfcl do); use --reward success")
    parse_roles(cfg.sft_roles), parse_task_opts(cfg.task_opts)
    if cfg.steps < 0:
        raise ConfigError(f"--steps must be >= 0 (0: only the supervised warm start), got {cfg.steps}")
    positive = ["tasks_per_step", "group_size", "micro_batch", "updates_per_batch", "max_new_tokens",
                "max_world_tokens", "max_turns", "max_total_len", "sft_batch", "save_every", "chunk_size",
                "max_bad_steps"]
    for name in positive:
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    for name in ("lr", "sft_lr", "grad_clip", "clip_low", "clip_high", "temperature", "top_p"):
        v = getattr(cfg, name)
        if name in ("lr", "sft_lr", "temperature") and v is None:   # resolved per model or benchmark
            continue
        if not math.isfinite(v) or v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got {v}")
    if cfg.top_p > 1:
        raise ConfigError(f"--top-p must be in (0, 1], got {cfg.top_p}")
    if not 0 <= cfg.beta2 < 1:
        raise ConfigError(f"--beta2 must be in [0, 1), got {cfg.beta2}")
    if cfg.sft_warmup < 0:
        raise ConfigError(f"--sft-warmup must be >= 0, got {cfg.sft_warmup}")
    if cfg.sft_rehearsal_frac is not None and not 0 <= cfg.sft_rehearsal_frac <= 1:
        raise ConfigError(f"--sft-rehearsal-frac must be in [0, 1], got {cfg.sft_rehearsal_frac}")
    if cfg.sft_steps is not None and cfg.sft_steps < 0:
        raise ConfigError(f"--sft-steps must be >= 0, got {cfg.sft_steps}")
    if cfg.tool_call_format and cfg.tool_call_format not in CALL_FORMATS:
        raise ConfigError(f"--tool-call-format must be one of {', '.join(CALL_FORMATS)}, not {cfg.tool_call_format!r}")
    resolved = cfg.resolved()
    if resolved.sft_steps > 0 and "reference_messages" in lacks(load_bench(cfg.bench)):
        raise ConfigError(f"--sft-steps {resolved.sft_steps}: benchmark {cfg.bench!r} has no reference solutions "
                          "to warm-start on; use --sft-steps 0")
    if cfg.sft_memory not in ("real", "self"):
        raise ConfigError(f"--sft-memory must be real or self, not {cfg.sft_memory!r}")
    if not 0 <= cfg.sft_world_frac <= 1:   # also refuses nan
        raise ConfigError(f"--sft-world-frac must be in [0, 1], got {cfg.sft_world_frac}")
    if not 0 <= cfg.sft_world_lookup <= 1:
        raise ConfigError(f"--sft-world-lookup must be in [0, 1], got {cfg.sft_world_lookup}")
    if cfg.sft_world_frac > 0 and optional(load_bench(cfg.bench), "world_examples") is None:
        raise ConfigError(f"--sft-world-frac needs a benchmark that generates world examples (toyworld); "
                          f"{cfg.bench!r} has none")
    parse_tool_names(cfg.sft_world_skip or "")
    try:
        report.check_available(cfg.report_to)
    except report.ReporterUnavailable as exc:
        raise ConfigError(str(exc)) from None
    if cfg.keep_checkpoints < 0:
        raise ConfigError(f"--keep-checkpoints must be >= 0 (0 keeps all), got {cfg.keep_checkpoints}")
    for name in ("kl_coef", "dual_clip", "defect_penalty", "weight_decay", "act_weight", "world_weight"):
        if not math.isfinite(getattr(cfg, name)) or getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if 0 < cfg.dual_clip <= 1:
        raise ConfigError(f"--dual-clip must be > 1 (or 0 to disable), got {cfg.dual_clip}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for name in ("tasks_per_step", "sft_batch"):
        if getattr(cfg, name) % world:
            raise ConfigError(f"--{name.replace('_', '-')} ({getattr(cfg, name)}) must be divisible by the number "
                              f"of processes ({world}) so every rank gets the same work")
    if cfg.aggregate not in ("token_mean", "seq_mean"):
        raise ConfigError(f"--aggregate must be token_mean or seq_mean, not {cfg.aggregate!r}")
    template_kwargs(cfg)


def template_kwargs(cfg: TrainConfig) -> dict | None:
    """--chat-template-kwargs parsed; None when not given (the model's saved variables then apply)."""
    if not cfg.chat_template_kwargs:
        return None
    try:
        return policy.parse_template_kwargs(cfg.chat_template_kwargs)
    except ValueError as exc:
        raise ConfigError(f"--chat-template-kwargs: {exc}") from exc


# ----------------------------------------------------------------------------------------------------------
# One policy update on a batch of rollout rows (shared by the loop, the SFT warm start and the tests)


@dataclass
class Batch:
    """A batch of rollout rows as the policy update reads them."""
    ids: torch.Tensor          # [B, T] right-padded
    roles: torch.Tensor        # [B, T]
    old_logp: torch.Tensor     # [B, T] sampling log-probs
    advantages: torch.Tensor   # [B, T]

    def rows(self, idx):
        """The rows `idx` (a slice or an index tensor) as a Batch."""
        return Batch(self.ids[idx], self.roles[idx], self.old_logp[idx], self.advantages[idx])


def trained_weight_total(batch: Batch, train_roles, lcfg: LossConfig, d: Dist) -> float:
    """The loss denominator over the whole (global) batch, so micro-batches and ranks add up to one mean."""
    mask = role_mask(batch.roles, train_roles)
    if lcfg.aggregate == "seq_mean":
        local = float(mask.any(-1).sum())
    else:
        local = float(role_weights(batch.roles, train_roles, lcfg.role_weights).sum())
    return max(all_sum([local], d)[0], 1e-8)


def policy_gradient(model, batch: Batch, train_roles, lcfg: LossConfig, d: Dist, micro_batch: int,
                    temperature: float, chunk_size: int, ref_logp: torch.Tensor | None = None,
                    weight_total: float | None = None) -> dict:
    """Accumulate the GRPO loss's gradient over micro-batches of this rank's rows. No optimizer step.

    weight_total: the loss denominator of the global batch (default: computed from `batch` on all ranks)."""
    total = weight_total if weight_total is not None else trained_weight_total(batch, train_roles, lcfg, d)
    stats = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "tokens": 0, "logp_mismatch": 0.0}
    B = batch.ids.shape[0]
    for s in range(0, B, micro_batch):
        mb = batch.rows(slice(s, s + micro_batch))
        lengths = (mb.roles != Role.PAD).sum(-1)
        width = int(lengths.max())
        ids, roles = mb.ids[:, :width].to(d.device), mb.roles[:, :width].to(d.device)
        attn = (roles != Role.PAD).long()
        with autocast(d):
            logp = token_logprobs(model, ids, role_mask(roles, train_roles), attn, temperature, chunk_size)
        ref = None if ref_logp is None else ref_logp[s:s + micro_batch, :width].to(d.device)
        loss, st = grpo_loss(logp, mb.old_logp[:, :width].to(d.device), mb.advantages[:, :width].to(d.device),
                             roles, train_roles, lcfg, ref, token_weight_sum=total)
        # FSDP averages gradients over ranks; the loss is already normalised globally, so undo the average
        (loss * d.world_size).backward()
        m = role_mask(roles, train_roles)
        stats["loss"] += float(loss.detach())
        stats["tokens"] += st["tokens"]
        stats["clip_frac"] += st["clip_frac"] * st["tokens"]
        stats["kl"] += st["kl"] * st["tokens"]
        stats["logp_mismatch"] += float(((logp.detach() - mb.old_logp[:, :width].to(d.device)).abs() * m).sum())
    n = max(stats["tokens"], 1)
    for k in ("clip_frac", "kl", "logp_mismatch"):
        stats[k] /= n
    loss_sum, tokens = all_sum([stats["loss"], stats["tokens"]], d)
    stats["loss"], stats["tokens"] = loss_sum, int(tokens)
    return stats


def optimizer_step(model, optimizer, grad_clip: float) -> tuple[float, bool]:
    """Clip and step; a non-finite gradient norm skips the step (gradients dropped). Returns (norm, stepped)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return norm, False
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, True


def make_optimizer(model, cfg: TrainConfig):
    """AdamW over the model's parameters with the run's lr, weight decay and beta2."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, cfg.beta2))


# ----------------------------------------------------------------------------------------------------------
# The loop


def subconfig(cls, cfg, **overrides):
    """A dataclass (SamplingConfig, LossConfig) filled from TrainConfig's fields of the same name."""
    names = {f.name for f in fields(cls)}
    return cls(**{**{k: v for k, v in asdict(cfg).items() if k in names}, **overrides})


@dataclass
class Trainer:
    """What the loop needs, built once by `setup`: the run's config, model, optimizer, data and logs."""
    cfg: TrainConfig
    d: Dist
    run: Path
    bench: object
    tasks: list
    engine: object                 # rollout.Engine over the (sharded) model
    model: object
    optimizer: object
    make_env: object
    loss_cfg: LossConfig
    sampling: object               # rollout.SamplingConfig for GRPO rollouts (the seed is set per step)
    train_roles: list
    sft_roles: list
    world_skip: frozenset
    metrics: MetricsLog | None
    samples: MetricsLog | None
    reporter: object               # report.py: the same scalars to tensorboard / wandb (NoReporter: none)
    ref_model: object = None       # the frozen KL reference, made when GRPO begins
    sim_model: object = None       # --env sim: the frozen simulator writing every tool response
    world: object = None           # --world-model separate: the world model, trained on WORLD tokens ...
    world_optimizer: object = None  # ... with an optimizer of its own; both made when GRPO begins

    def world_parts(self):
        """(model, optimizer) of the separate world model for checkpoints; None while there is none."""
        return (self.world, self.world_optimizer) if self.world is not None else None


def train(cfg: TrainConfig, resume: Path | None = None) -> Path:
    """The loop: a supervised warm start (sft_step), then GRPO (grpo_step); metrics, checkpoints, Ctrl-C."""
    t, start_step = setup(cfg, resume)
    cfg, d = t.cfg, t.d
    total_steps = cfg.sft_steps + cfg.steps
    stop = {"flag": False}

    def on_sigint(signum, frame):
        """First Ctrl-C: finish the step, save, exit."""
        stop["flag"] = True
        signal.signal(signal.SIGINT, signal.default_int_handler)   # a second Ctrl-C stops at once
        print("\ninterrupt: finishing this step, saving a checkpoint, then exiting", file=sys.stderr)

    signal.signal(signal.SIGINT, on_sigint)
    bad_steps, grpo_steps, no_signal_steps = 0, 0, 0
    bar = tqdm(range(start_step, total_steps), initial=start_step, total=total_steps, disable=not d.main,
               desc="train", dynamic_ncols=True)
    for step in bar:
        t_step = time.perf_counter()
        pick = random.Random(cfg.seed * 1_000_003 + step)      # the step's task draw, the same on resume
        phase = "sft" if step < cfg.sft_steps else "grpo"
        record, ok = (sft_step if phase == "sft" else grpo_step)(t, step, pick)
        bad_steps = 0 if ok else bad_steps + 1
        if phase == "grpo":
            grpo_steps += 1
            no_signal_steps += bool(record.get("no_signal"))
            record["no_signal_steps"] = no_signal_steps
        record.update(step=step, phase=phase, skipped_update=not ok, t_step=time.perf_counter() - t_step)
        if t.metrics is not None:
            t.metrics.write(record)
            t.reporter.log(record)
            bar.set_postfix(progress_fields(record))
        if not ok:
            print(f"warning: step {step}: non-finite loss or gradient; update skipped "
                  f"({bad_steps} in a row)", file=sys.stderr)
            if bad_steps >= cfg.max_bad_steps:
                raise FloatingPointError(f"{bad_steps} consecutive steps had a non-finite loss or gradient; "
                                         "stopping. Lower --lr or --sft-lr, or check the data")
        done = step + 1
        if done % cfg.save_every == 0 or done == total_steps or stop["flag"]:
            save_checkpoint(t.run, done, t.model, t.engine.tok, t.optimizer, cfg, d, {"phase": phase},
                            t.engine.template_kwargs, world=t.world_parts())
        if stop["flag"]:
            break
    bar.close()
    t.reporter.close()
    if d.world_size > 1:
        dist.destroy_process_group()
    if grpo_steps and no_signal_steps == grpo_steps:
        if not cfg.require_update:
            print(f"warning: the policy was never updated: all {grpo_steps} GRPO steps had every group flat or no "
                  "trained token", file=sys.stderr)
            return t.run
        raise NothingToTrain(f"the policy was never updated: all {grpo_steps} GRPO steps of this run had every "
                             f"group flat (equal rewards in each group) or no trained token; see "
                             f"{t.run / 'metrics.jsonl'} (reward_mean, end_reasons). Try more steps, a larger "
                             "--group-size, --reward checklist, or a warm start (--sft-steps)")
    return t.run


def setup(cfg: TrainConfig, resume: Path | None) -> tuple[Trainer, int]:
    """Check the run folder, resolve the config, load data, model, optimizer state and logs."""
    d = setup_dist()
    cfg = cfg.resolved()
    run = Path(cfg.out)
    start_step, ckpt = 0, None
    if resume is not None:
        ckpt = latest_checkpoint(resume)
        state = read_state(ckpt)
        start_step = state["step"]
        if state.get("world_size", 1) != d.world_size:
            raise CheckpointError(f"{ckpt} was written by {state.get('world_size')} processes; resume it with "
                                  f"the same --nproc_per_node (got {d.world_size})")
    elif run.exists() and not run.is_dir():
        raise ConfigError(f"--out {run} exists and is not a folder; pass a folder path for the run")
    elif run.exists() and any(run.iterdir()) and not cfg.overwrite:
        raise ConfigError(f"run folder {run} already exists; use --resume {run} to continue it, --out for a new "
                          "one, or --overwrite to replace it")
    if cfg.sft_steps + cfg.steps <= 0:
        raise ConfigError("nothing to do: --steps and --sft-steps are both 0")
    random.seed(cfg.seed + d.rank)
    np.random.seed(cfg.seed + d.rank)
    torch.manual_seed(cfg.seed)

    bench = load_bench(cfg.bench)
    tasks = bench.load_tasks(cfg.split, **parse_task_opts(cfg.task_opts))
    if not tasks:
        raise ConfigError(f"benchmark {cfg.bench!r} split {cfg.split!r} has no tasks")
    world_skip = parse_tool_names(cfg.sft_world_skip or "")
    known_tools = {t["function"]["name"] for task in tasks[:200] for t in task.tools}
    if world_skip - known_tools:
        raise ConfigError(f"--sft-world-skip names no tool of {cfg.bench!r}: "
                          f"{', '.join(sorted(world_skip - known_tools))}; its tools include: "
                          f"{', '.join(sorted(known_tools)[:20])}")
    lookup_tools = set(optional(bench, "LOOKUP_TOOLS") or ())
    if cfg.sft_world_lookup > 0 and lookup_tools and lookup_tools <= world_skip:
        raise ConfigError(f"--sft-world-lookup {cfg.sft_world_lookup} draws lookups of {', '.join(sorted(lookup_tools))}, "
                          f"but --sft-world-skip leaves every one without loss: drop one from the skip list")
    # a checkpoint carries its chat template (chat_template.jinja) and variables, so resuming reads them there
    engine = load_engine(str(ckpt) if ckpt else cfg.model, None if ckpt else cfg.chat_template or None,
                         template_kwargs(cfg), cfg.tool_call_format or None, dtype=torch.float32,
                         device=d.device)   # fails early if unusable
    if cfg.activation_checkpointing == "on":   # only in train mode: rollouts (eval mode) run as before
        enable_activation_checkpointing(engine.model)
    model = shard(engine.model, d)
    optimizer = make_optimizer(model, cfg)
    world, world_optimizer = None, None
    if ckpt is not None:
        load_optimizer_state(optimizer, ckpt / f"optim_rank{d.rank}.pt")
        if cfg.world_model == "separate" and start_step > cfg.sft_steps:   # GRPO had begun: both models saved
            if not (ckpt / WORLD_DIR / "config.json").exists():
                raise CheckpointError(f"{ckpt} has no {WORLD_DIR}/ but its run trains a separate world model")
            world = load_model(ckpt / WORLD_DIR, d, "the world model", trainable=True,
                               checkpointing=cfg.activation_checkpointing == "on")
            world_optimizer = make_optimizer(world, cfg)
            load_optimizer_state(world_optimizer, ckpt / f"optim_world_rank{d.rank}.pt")
    sim_model = load_model(Path(cfg.sim_model), d, "--sim-model", tok=engine.tok) if cfg.sim_model else None
    if d.main:
        if resume is None and run.exists() and cfg.overwrite:
            shutil.rmtree(run)
        (run / "ckpt").mkdir(parents=True, exist_ok=True)
        write_atomic(run / "config.json", json.dumps(asdict(cfg), indent=1))
    keep = start_step if resume else None
    metrics = MetricsLog(run / "metrics.jsonl", keep_before_step=keep) if d.main else None
    samples = MetricsLog(run / "samples.jsonl", keep_before_step=keep) if d.main else None
    reporter = report.make_reporter(cfg.report_to, run, asdict(cfg), start_step) if d.main else report.NoReporter()
    # tau2/vita need a simulated user: --user-model (with its own template), or the policy in its own context
    user_engine = engine
    if cfg.user_model:
        user_engine = load_engine(cfg.user_model, dtype=torch.float32, device=d.device)
        user_engine.model.eval()
    make_env = rollout.make_env_fn(bench, rollout.model_user_fn(user_engine, user_sampling(cfg)))
    loss_cfg = subconfig(LossConfig, cfg, role_weights={"act": cfg.act_weight, "world": cfg.world_weight})
    return Trainer(cfg=cfg, d=d, run=run, bench=bench, tasks=tasks, engine=engine, model=model,
                   optimizer=optimizer, make_env=make_env, loss_cfg=loss_cfg,
                   sampling=subconfig(rollout.SamplingConfig, cfg), train_roles=parse_roles(cfg.train_roles),
                   sft_roles=parse_roles(cfg.sft_roles), world_skip=world_skip, metrics=metrics,
                   samples=samples, reporter=reporter, sim_model=sim_model, world=world, world_optimizer=world_optimizer), start_step


def user_sampling(cfg: TrainConfig):
    """Sampling of the simulated user's replies (tau2, vita): the benchmark's user limits, the run's temperature."""
    s = settings.settings_for(cfg.bench)
    return subconfig(rollout.SamplingConfig, cfg, max_new_tokens=s.user_max_new_tokens,
                     max_total_len=s.user_max_total_len, respond_at_turn_limit=False)   # the user's one turn ends it


def sft_step(t: Trainer, step: int, pick: random.Random) -> tuple[dict, bool]:
    """One supervised warm-start step on reference chats (and rehearsal-format / world examples)."""
    cfg, d = t.cfg, t.d
    for g in t.optimizer.param_groups:
        g["lr"] = cfg.sft_lr * min(1.0, (step + 1) / max(cfg.sft_warmup, 1))
    batch_tasks = pick.sample(t.tasks, min(cfg.sft_batch, len(t.tasks)))[d.rank::d.world_size]
    # self memory generates with the model: unsharded once under FSDP, as for a rollout
    with (gathered_for_generation(t.model) if cfg.sft_memory == "self" and d.world_size > 1
          else contextlib.nullcontext()), autocast(d):
        seqs = [sft_sequence(t.engine, t.bench, task, t.sft_roles, cfg.sft_rehearsal_frac, pick, cfg.sft_world_frac,
                             t.world_skip, cfg.sft_memory, t.sampling, cfg.sft_world_lookup) for task in batch_tasks]
    t.model.train()
    loss, n_tok = sft_loss(t.model, seqs, d, t.engine.tok.pad_token_id, cfg.chunk_size)
    norm, ok = optimizer_step(t.model, t.optimizer, cfg.grad_clip) if math.isfinite(loss) else (float("nan"), False)
    if not ok:
        t.optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "tokens": n_tok, "grad_norm": norm}, ok


def grpo_step(t: Trainer, step: int, pick: random.Random) -> tuple[dict, bool]:
    """One GRPO step: roll out G trajectories per task, score them with the verifier, update the policy."""
    cfg, d = t.cfg, t.d
    for g in t.optimizer.param_groups:
        g["lr"] = cfg.lr
    begin_grpo(t)
    batch_tasks = pick.sample(t.tasks, min(cfg.tasks_per_step, len(t.tasks)))[d.rank::d.world_size]
    t.model.eval()
    writer = t.sim_model if cfg.env == "sim" else t.world       # who writes the WORLD segments; None: the policy
    if t.world is not None:
        t.world.eval()
    t0 = time.perf_counter()
    seed = cfg.seed * 7919 + step * d.world_size + d.rank
    with contextlib.ExitStack() as gathered:
        for m in ([t.model] + ([writer] if writer is not None else [])) if d.world_size > 1 else []:
            gathered.enter_context(gathered_for_generation(m))
        with autocast(d):
            ro = t.engine.run(batch_tasks, cfg.group_size, dataclasses.replace(t.sampling, seed=seed),
                              make_env=t.make_env, responses="real" if cfg.env == "real" else "rehearse",
                              world_model=writer)
    t_rollout = time.perf_counter() - t0
    refuse_if_nothing_acted(ro, cfg, d, step, t.engine.model.config)
    t0 = time.perf_counter()
    # a defective rehearsed response costs reward only where its writer is trained (the world role)
    penalty = cfg.defect_penalty if Role.WORLD in t.train_roles else 0.0
    scores = [reward.trajectory_reward(cfg.bench, batch_tasks[ti], tr, defects, penalty, cfg.reward)
              for ti, tr, defects in zip(ro.task_index, ro.trajectories, ro.rehearsal_defects)]
    t_reward = time.perf_counter() - t0
    # verifier-side world-model fidelity per tool (replays the calls; nothing reaches the policy)
    fid_sums = reward.fidelity_sums(pair for ti, tr in zip(ro.task_index, ro.trajectories)
                                    for pair in reward.rehearsal_fidelity(cfg.bench, batch_tasks[ti], tr))
    t_fidelity = time.perf_counter() - t0 - t_reward
    rewards = torch.tensor([s.reward for s in scores])                          # [B]
    groups = torch.tensor([d.rank * 100_000 + i for i in ro.task_index])        # [B] the task of each row
    adv, flat = role_advantages(rewards, groups, ro.roles, t.train_roles, cfg.scale_std, cfg.per_role_adv)
    ref_logp = None                                                             # [B, T] under the reference
    if t.ref_model is not None:
        with torch.no_grad(), autocast(d):     # token_logprobs runs each group's shared prompt once itself
            ref_logp = token_logprobs(t.ref_model, ro.ids.to(d.device),
                                      role_mask(ro.roles, t.train_roles).to(d.device),
                                      (ro.roles != Role.PAD).long().to(d.device), cfg.temperature,
                                      cfg.chunk_size).cpu()
    batch = Batch(ro.ids, ro.roles, ro.logprobs, adv)
    # shared: one model, one loss over every trained role. separate: each model its own loss over its role's
    # tokens, its own token mean and its own optimizer step (two agents, as the official noshare arm).
    if t.world is None:
        updates = {"": (t.model, t.optimizer, t.train_roles)}
    else:
        updates = {"": (t.model, t.optimizer, [Role.ACT]), "world_": (t.world, t.world_optimizer, [Role.WORLD])}
    totals = {prefix: trained_weight_total(batch, roles, t.loss_cfg, d) for prefix, (_, _, roles) in updates.items()}
    if ref_logp is None and d.world_size == 1:
        # rows whose advantages are all 0 add no gradient: skip their forward (the loss denominator
        # still counts them). Under FSDP every rank must run the same passes, so nothing is skipped.
        batch = batch.rows(torch.nonzero((adv != 0).any(-1)).flatten())
    t0 = time.perf_counter()
    pg, norms, ok = {}, {}, True
    for prefix, (model, optimizer, roles) in updates.items():
        model.train()
        for _ in range(cfg.updates_per_batch):
            pg[prefix] = policy_gradient(model, batch, roles, t.loss_cfg, d, cfg.micro_batch, cfg.temperature,
                                         cfg.chunk_size, ref_logp, totals[prefix])
            if not math.isfinite(pg[prefix]["loss"]):
                optimizer.zero_grad(set_to_none=True)
                ok = False
                break
            norms[prefix], ok = optimizer_step(model, optimizer, cfg.grad_clip)
            if not ok:
                break
        if not ok:
            break
    t_update = time.perf_counter() - t0
    succ = [s.components.get("success", s.reward) for s in scores]
    trained = role_mask(ro.roles, t.train_roles).bool()
    neg_logp, act_sampled = sampled_neg_logp(ro.logprobs, ro.roles)
    local = {"reward": float(rewards.sum()), "reward_sq": float((rewards ** 2).sum()),
             "neg_logp": neg_logp, "act_sampled": act_sampled,
             "success": float(sum(succ)), "rows": len(scores), "flat_groups": flat,
             "act_tokens": ro.stats["act_tokens"], "world_tokens": ro.stats["world_tokens"],
             "defects": sum(len(x) for x in ro.rehearsal_defects), "sampled": ro.stats["tokens_sampled"],
             "evaluator_errors": sum(bool(s.components.get("evaluator_error")) for s in scores),
             "groups": len(set(ro.task_index)), "trained_tokens": int(trained.sum()),
             "signal_tokens": int((trained & (adv != 0)).sum())}
    n = dict(zip(local, all_sum(list(local.values()), d)))     # each count summed over ranks, by name
    mean = n["reward"] / n["rows"]
    record = dict(reward_mean=mean, reward_std=math.sqrt(max(n["reward_sq"] / n["rows"] - mean ** 2, 0.0)),
                  success_rate=n["success"] / n["rows"], rows=int(n["rows"]),
                  # mean -log p of the sampled action tokens: the policy's entropy estimated from its own
                  # samples (exact in expectation at temperature 1, top-p 1); falling fast = collapsing
                  entropy=n["neg_logp"] / max(n["act_sampled"], 1),
                  response_tokens=n["act_tokens"] / n["rows"],     # action tokens per trajectory
                  flat_groups=int(n["flat_groups"]), act_tokens=int(n["act_tokens"]),
                  world_tokens=int(n["world_tokens"]), rehearsal_defects=int(n["defects"]),
                  evaluator_errors=int(n["evaluator_errors"]), trained_tokens=int(n["trained_tokens"]),
                  signal_tokens=int(n["signal_tokens"]),   # trained tokens with a nonzero advantage
                  no_signal=n["signal_tokens"] == 0,        # every group flat or nothing trained: no update
                  tokens_per_s=n["sampled"] / max(t_rollout, 1e-9) / d.world_size,
                  t_rollout=t_rollout, t_reward=t_reward, t_fidelity=t_fidelity, t_update=t_update,
                  end_reasons={r: ro.end_reasons.count(r) for r in set(ro.end_reasons)},
                  flat_group_share=n["flat_groups"] / max(1.0, n["groups"]))      # groups whose rewards are all equal
    for prefix in updates:           # loss, kl, ... of the policy; world_loss, world_kl, ... of a separate world model
        for key in ("loss", "kl", "clip_frac", "logp_mismatch"):
            record[prefix + key] = pg.get(prefix, {}).get(key)
        record[prefix + "grad_norm"] = norms.get(prefix, float("nan"))
    for tool, f in reward.fidelity_by_tool(gather_sums(fid_sums, d)).items():
        record[f"fidelity_n/{tool}"] = f["calls"]
        record[f"fidelity_exact/{tool}"] = f["exact"]
        record[f"fidelity_kv/{tool}"] = f["kv"]
        record[f"fidelity_error/{tool}"] = f["error_correct"]
    if t.samples is not None and ro.ids.shape[0]:
        t.samples.write({"step": step, "task": ro.trajectories[0].task_id, "reward": scores[0].reward,
                         "text": rollout.describe_row(ro, t.engine.tok, 0)})
    return record, ok


def sampled_neg_logp(logprobs: torch.Tensor, roles: torch.Tensor) -> tuple[float, int]:
    """(sum of -log p, count) over the sampled action tokens of a rollout ([B, T] each; a log-prob of exactly 0
    marks a token that was not sampled). Their mean estimates the policy's entropy at the sampling temperature."""
    act = (roles == Role.ACT) & (logprobs != 0)
    return float(-(logprobs * act).sum()), int(act.sum())


class NothingToTrain(RuntimeError):
    """A GRPO step whose rows wrote no action: training on it would silently do nothing."""


def refuse_if_nothing_acted(ro, cfg: TrainConfig, d: Dist, step: int, model_config=None):
    """Stop the run when no row of the step (on any rank) wrote a single ACT token: the prompt was over
    --max-total-len, or every turn was cut before its first token. The message names the limit and its flag."""
    if all_sum([float(ro.stats["act_tokens"])], d)[0] > 0:
        return
    reasons = sorted(set(ro.end_reasons))
    errors = [e for tr in ro.trajectories for e in tr.errors if e.startswith("context_too_long")]
    window = getattr(model_config, "max_position_embeddings", None)
    if errors and window is not None and window < cfg.max_total_len:
        fix = (f"{errors[0].split(': ', 1)[1]}: the model's context window (max_position_embeddings {window}) is "
               "the limit, below --max-total-len; use a model with a longer context or shorter tasks")
    elif errors:
        fix = (f"{errors[0].split(': ', 1)[1]}; raise --max-total-len (now {cfg.max_total_len}) above the "
               "prompt, or pick shorter tasks")
    else:
        fix = f"raise --max-new-tokens (now {cfg.max_new_tokens}) or --max-total-len (now {cfg.max_total_len})"
    raise NothingToTrain(f"GRPO step {step}: no row wrote an action (rows ended {', '.join(reasons) or 'empty'}): "
                         f"{fix}")


def begin_grpo(t: Trainer):
    """The models GRPO needs besides the policy, made at its first step from the policy as GRPO began
    (RUN/reference/): the KL reference, the default frozen simulator, the separate world model."""
    cfg, d = t.cfg, t.d
    if cfg.kl_coef > 0 and t.ref_model is None:
        t.ref_model = reference_model(t.model, t.engine.tok, t.run, d)
    if cfg.env == "sim" and t.sim_model is None:
        # the frozen copy of the start is the KL reference's weights: share the module when there is one
        t.sim_model = t.ref_model or load_model(grpo_start_snapshot(t.model, t.engine.tok, t.run, d), d,
                                                "the frozen simulator")
    if cfg.world_model == "separate" and t.world is None:
        t.world = load_model(grpo_start_snapshot(t.model, t.engine.tok, t.run, d), d, "the world model",
                             trainable=True, checkpointing=cfg.activation_checkpointing == "on")
        t.world_optimizer = make_optimizer(t.world, cfg)


def progress_fields(record: dict) -> dict:
    """The progress bar: loss, and on GRPO steps reward, success, flat-group share and the mean exact
    fidelity of the step's rehearsed calls (`fid`)."""
    out = {k: round(record[k], 3) for k in ("loss", "reward_mean", "success_rate", "flat_group_share")
           if record.get(k) is not None}
    if record.get("no_signal_steps"):
        out["no_signal"] = record["no_signal_steps"]
    calls = {k.split("/", 1)[1]: n for k, n in record.items() if k.startswith("fidelity_n/")}
    if calls:
        out["fid"] = round(sum(record[f"fidelity_exact/{t}"] * n for t, n in calls.items()) / sum(calls.values()), 3)
    return {{"reward_mean": "reward", "success_rate": "success", "flat_group_share": "flat"}.get(k, k): v
            for k, v in out.items()}


# ----------------------------------------------------------------------------------------------------------
# CLI


def load_config_files(paths: list[str]) -> dict:
    """The TrainConfig fields set by TOML presets (configs/*.toml), later files over earlier ones (cli.py)."""
    try:
        return load_presets(paths, {f.name: str(f.type).split(" | ")[0] for f in fields(TrainConfig)})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def legacy_unset_to_none(saved: dict) -> dict:
    """A saved config as this TrainConfig reads it: runs written before None was the one "unset" stored "" or
    "auto" (and -1 for some numbers) in the fields whose default is now None."""
    unset = {f.name for f in fields(TrainConfig) if f.default is None}
    return {k: None if k in unset and (v in ("", "auto") or (isinstance(v, (int, float)) and v == -1)) else v
            for k, v in saved.items()}


def build_parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field, its help and choices from the field's metadata."""
    ap = OneLineParser(prog="train.py", description="EnvACE GRPO training (rehearsal by default).",
                       argument_default=argparse.SUPPRESS, help_hint=True)
    kinds = {"int": int, "float": float, "str": str}
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        text, choices = f.metadata["help"], f.metadata["choices"]
        default = f.default if f.default != "" else "none"
        shown = "" if f.default is None or "default:" in text else f" (default: {default})"
        if f.type in ("bool", bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, help=text + shown)
            continue
        kind = kinds[str(f.type).split(" | ")[0]]
        if f.name == "chat_template_kwargs":   # the same check as evaluate.py's and rollout.py's flag
            kind = template_kwargs_text
        metavar = {int: "N", float: "X"}.get(kind, f.name.split("_")[-1].upper())
        ap.add_argument(flag, type=kind, choices=choices, help=text + shown, metavar=None if choices else metavar)
    ap.add_argument("--resume", type=str, metavar="RUN", help="continue the run in this folder from its latest "
                                                                "checkpoint")
    ap.add_argument("--config", action="append", metavar="FILE.toml", help="a preset (configs/: the default run, "
                    "the paper's recipe, each ablation arm); repeat to layer them; flags given here win")
    return ap


def main(argv=None) -> int:
    """The command line: parse flags (or a run's saved config with --resume), validate, train. Returns the exit
    code: 0 done, 2 a bad flag or unusable input (one line on stderr), 1 a run that failed while training."""
    args = vars(build_parser().parse_args(argv))
    resume = args.pop("resume", None)
    presets = args.pop("config", None) or []
    try:
        if presets and resume is not None:
            raise ConfigError("--config and --resume do not go together: a resumed run keeps its saved config")
        args = {**load_config_files(presets), **args}
        if resume is not None:
            run = Path(resume)
            try:
                saved = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else None
            except ValueError as exc:
                raise CheckpointError(f"{run / 'config.json'} is corrupt ({exc}); start a new run with --out") from exc
            if saved is None:
                raise CheckpointError(f"{run} has no config.json: not a training run folder")
            unknown = sorted(set(saved) - {f.name for f in fields(TrainConfig)}) if isinstance(saved, dict) else []
            if not isinstance(saved, dict) or unknown:
                raise CheckpointError(f"{run / 'config.json'} is not a config this train.py wrote (unknown fields: "
                                      f"{', '.join(unknown) or 'not an object'}); start a new run with --out")
            saved.setdefault("reward", "success")   # runs written before --reward existed trained on success
            saved = legacy_unset_to_none(saved)
            cfg = TrainConfig(**{**saved, **args, "out": str(run)})
        else:
            cfg = TrainConfig(**args)
        validate(cfg)
        run = train(cfg, Path(resume) if resume else None)
    except (ConfigError, CheckpointError, VocabularyMismatch, policy.PolicyLoadError, BenchUnavailable,
            FileNotFoundError) as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:   # e.g. a rollout template error or an unknown split from a loader
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 2
    except (FloatingPointError, NothingToTrain) as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "out of memory"
        print(f"train.py: error: out of device memory ({first[:160]}); reduce --micro-batch (rows per forward/backward), "
              "--group-size, --max-new-tokens, --max-total-len or --chunk-size (log-prob positions per LM-head "
              "chunk), then --resume the run", file=sys.stderr)
        return 1
    print(f"run saved in {run} (latest checkpoint: {(run / 'latest').read_text().strip()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

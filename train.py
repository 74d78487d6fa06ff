"""EnvACE training: GRPO on role-masked token log-probs, acting and world rehearsal optimised jointly.

    python train.py                                       # tiny model on the embedded toy world (CPU, minutes)
    torchrun --nproc_per_node 8 train.py --model /ckpt/Qwen3-8B --bench tau2

One step: sample tasks -> roll out G trajectories per task (rehearsal by default: the policy writes every
tool response) -> verifier reward (reward.py) -> group-normalised advantages -> clipped-ratio loss on the
trained roles' tokens -> AdamW.

The paper's ablation arms (the official launch scripts in examples/drmas_trainer/):
    --env sim --train-roles act           standard GRPO: a frozen simulator writes every tool response
                                          (run_checklist_caller_only.sh)
    --env rehearse --world-model separate per-role policies: a second model writes and is trained on the
                                          WORLD tokens (run_checklist_noshare.sh)
    --env rehearse                        EnvACE: one set of weights plays both roles (run_checklist_share.sh)
    --env real --train-roles act          the real environment (a ceiling, not one of the paper's arms)
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
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bench import BENCHES
from chat_format import CALL_FORMATS
from rollout import Role, role_mask, role_weights

# ----------------------------------------------------------------------------------------------------------
# Role-masked token log-probs, chunked (the full [B, T, V] float32 tensor is never built)


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = hidden @ weight.t()
    if logits.dtype in (torch.float16, torch.bfloat16):  # the softmax always runs in at least fp32
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets[:, None])[:, 0]
    return picked - torch.logsumexp(logits, dim=-1)


def token_logprobs(model, ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """log p(ids[b, t] | ids[b, :t]) at positions where `loss_mask` is True; exactly 0 elsewhere.

    Only the masked positions go through the LM head, `chunk_size` positions at a time, each chunk under
    activation checkpointing: the peak is one [chunk, V] block instead of [B, T, V], in forward and backward.
    ids/loss_mask/attention_mask: [B, T]; sequences are right-padded (positions 0..len-1).
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(ids)
    # The root forward (not the inner decoder) must run, so FSDP's hooks gather the root's parameters; the
    # LM head is swapped out for the call so it returns the final hidden states instead of [B, T, V] logits.
    head = model.get_output_embeddings()
    model.set_output_embeddings(torch.nn.Identity())
    try:
        hidden = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits   # [B, T, H]
    finally:
        model.set_output_embeddings(head)
    predict = loss_mask[:, 1:]                                                          # token t from state t-1
    h = hidden[:, :-1][predict]                                                         # [N, H]
    targets = ids[:, 1:][predict]
    weight = head.weight
    parts = []
    for s in range(0, h.shape[0], chunk_size):
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logprobs, h[s:s + chunk_size], weight, targets[s:s + chunk_size],
                                    temperature, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(h[s:s + chunk_size], weight, targets[s:s + chunk_size], temperature))
    # no trained position in this batch: an empty result that is still part of the graph, so backward()
    # works (zero gradients) instead of failing with "does not require grad"
    flat = torch.cat(parts) if parts else _chunk_logprobs(h, weight, targets, temperature)
    out = torch.zeros(predict.shape, dtype=flat.dtype, device=ids.device).masked_scatter(predict, flat)
    return F.pad(out, (1, 0))


# ----------------------------------------------------------------------------------------------------------
# GRPO


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, scale_std: bool = True, eps: float = 1e-6):
    """(r - mean_group) / (std_group + eps), or Dr.GRPO's r - mean_group with scale_std=False.

    A group whose rewards are all equal (including a group of one) gets advantage 0: no gradient.
    Returns (advantages, number of such zero-signal groups).
    """
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    flat_groups = 0
    for g in torch.unique(group_ids):
        sel = group_ids == g
        r = rewards[sel].float()
        if r.numel() < 2 or torch.all(r == r[0]):
            flat_groups += 1
            continue
        centred = r - r.mean()
        adv[sel] = centred / (r.std(unbiased=False) + eps) if scale_std else centred
    return adv, flat_groups


@dataclass
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float = 3.0          # bound on the loss of negative-advantage tokens (Ye et al.); 0 = off
    kl_coef: float = 0.0            # k3 KL to the frozen reference; 0 = no reference model
    aggregate: str = "token_mean"   # or "seq_mean": mean over each sequence's tokens, then over sequences
    role_weights: dict = field(default_factory=lambda: {"act": 1.0, "world": 1.0})


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, roles: torch.Tensor,
              train_roles, cfg: LossConfig, ref_logp: torch.Tensor | None = None, token_weight_sum=None):
    """Clipped-ratio policy loss on the trained roles' tokens. All inputs [B, T] except advantages [B] or [B, T].

    `token_weight_sum` lets gradient accumulation divide by the token count of the whole batch (so micro-
    batches add up to one token mean); by default this micro-batch's own count.
    Returns (loss, stats dict of floats).
    """
    mask = role_mask(roles, train_roles)                              # [B, T] bool
    weight = role_weights(roles, train_roles, cfg.role_weights).to(logp.dtype)   # [B, T], 0 off the mask
    adv = advantages[:, None].expand_as(logp) if advantages.dim() == 1 else advantages
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    per_token = -torch.min(surr1, surr2)
    if cfg.dual_clip > 0:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -cfg.dual_clip * adv), per_token)
    kl = torch.zeros_like(logp)
    if ref_logp is not None and cfg.kl_coef > 0:
        d = torch.where(mask, ref_logp - logp, torch.zeros_like(logp))
        kl = torch.exp(d) - d - 1                                 # k3: unbiased, always >= 0
        per_token = per_token + cfg.kl_coef * kl
    per_token = per_token * weight
    if cfg.aggregate == "token_mean":
        denom = token_weight_sum if token_weight_sum is not None else weight.sum().clamp(min=1e-8)
        loss = per_token.sum() / denom
    elif cfg.aggregate == "seq_mean":
        seq = per_token.sum(-1) / weight.sum(-1).clamp(min=1e-8)
        has = (weight.sum(-1) > 0).float()
        denom = token_weight_sum if token_weight_sum is not None else has.sum().clamp(min=1)
        loss = (seq * has).sum() / denom
    else:
        raise ValueError(f"aggregate must be token_mean or seq_mean, not {cfg.aggregate!r}")
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clipped = mask & (((ratio < 1 - cfg.clip_low) & (adv < 0)) | ((ratio > 1 + cfg.clip_high) & (adv > 0)))
        stats = {"clip_frac": float(clipped.sum() / n), "kl": float((kl * mask).sum() / n),
                 "ratio_mean": float((ratio * mask).sum() / n), "tokens": int(mask.sum())}
    return loss, stats


def role_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, roles: torch.Tensor, train_roles,
                    scale_std: bool, per_role: bool):
    """Per-token advantages [B, T]. per_role=True normalises each role over the rows that contain it, as the
    official code's (task, role) groups do; otherwise one advantage per row for all its trained tokens."""
    adv, flat = group_advantages(rewards, group_ids, scale_std)
    out = adv[:, None].expand_as(roles).clone()
    if per_role:
        for role in train_roles:
            has = (roles == int(role)).any(-1)
            if not has.any():
                continue
            role_adv = torch.zeros_like(adv)
            role_adv[has], _ = group_advantages(rewards[has], group_ids[has], scale_std)
            out = torch.where(roles == int(role), role_adv[:, None], out)
    return out, flat


# ----------------------------------------------------------------------------------------------------------
# Configuration


def opt(default, help: str, choices=None):
    """A TrainConfig field with its --help text (and choices): the config documents its own flags."""
    return field(default=default, metadata={"help": help, "choices": choices})


PER_BENCH = "per benchmark, bench/settings.py"


@dataclass
class TrainConfig:
    """Every knob of a run; each field is a flag (--field-name). None means: resolved at start (resolved())."""
    model: str = opt("tiny", "'tiny' (the embedded model), a local HF folder or a .gguf file")
    chat_template: str = opt("", "a jinja file replacing the model's chat template (default: the model's own)")
    chat_template_kwargs: str = opt("", "extra chat-template variables as a JSON object, e.g. "
                                        "'{\"enable_thinking\": false}' (default: those saved with the model)")
    tool_call_format: str = opt("", "how the model writes tool calls (default: inferred from the chat template)",
                                list(CALL_FORMATS))
    bench: str = opt("toyworld", "benchmark to train on", list(BENCHES))
    split: str = opt("", f"split to train on (default: {PER_BENCH}: tau2's own train split, BFCL's train half)")
    task_opts: str = opt("", "extra load_tasks options as key=value,key=value (e.g. domain=airline)")
    out: str = opt("", "run folder (default: runs/MODEL-BENCH, e.g. runs/tiny-toyworld)")
    env: str = opt("rehearse", "who writes tool responses in GRPO rollouts: rehearse (the policy's world role, "
                               "EnvACE), real (the environment), sim (a frozen simulator)", ["rehearse", "real", "sim"])
    sim_model: str = opt("", "--env sim: the frozen simulator, a local HF folder (default: a frozen copy of the "
                             "policy as GRPO began, kept in RUN/reference/)")
    world_model: str = opt("shared", "shared: one model plays both roles (EnvACE); separate: a second model "
                                     "writes and is trained on the WORLD tokens (per-role policies)",
                           ["shared", "separate"])
    user_model: str = opt("", "simulated user for tau2/vita, a local HF folder (default: the policy itself)")
    train_roles: str = opt("auto", "roles whose tokens get the GRPO loss: act,world or act (auto: act,world with "
                                   "--env rehearse, else act)")
    steps: int = opt(30, "GRPO steps (after --sft-steps warm-start steps)")
    tasks_per_step: int = opt(8, "tasks per GRPO step (the paper: 16)")
    group_size: int = opt(4, "rollouts per task: the GRPO group (the paper: 4)")
    lr: float | None = opt(None, "GRPO learning rate (default: 1e-6 for a real model, the paper's; 3e-4 tiny)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "gradient-norm clip")
    updates_per_batch: int = opt(1, "optimizer updates per rollout batch (the paper: 1)")
    micro_batch: int = opt(8, "rows per forward/backward")
    temperature: float = opt(1.0, "sampling temperature of training rollouts (the paper: 1.0)")
    top_p: float = opt(1.0, "top-p of training rollouts")
    max_new_tokens: int | None = opt(None, f"tokens per assistant turn (default: {PER_BENCH})")
    max_world_tokens: int | None = opt(None, f"tokens per rehearsed tool response (default: {PER_BENCH})")
    max_turns: int | None = opt(None, f"assistant turns per trajectory (default: {PER_BENCH})")
    max_total_len: int | None = opt(None, f"tokens per trajectory, prompt included (default: {PER_BENCH})")
    clip_low: float = opt(0.2, "PPO ratio clip below 1")
    clip_high: float = opt(0.2, "PPO ratio clip above 1")
    dual_clip: float = opt(3.0, "dual-clip bound for negative advantages (0: off)")
    kl_coef: float = opt(1e-4, "k3 KL to the policy as GRPO began (kept in RUN/reference/); 0: none")
    aggregate: str = opt("token_mean", "loss aggregation", ["token_mean", "seq_mean"])
    scale_std: bool = opt(False, "divide advantages by the group's std (GRPO); off: Dr.GRPO, as the paper")
    per_role_adv: bool = opt(True, "role-wise groups: each role normalised over the rows that hold it")
    act_weight: float = opt(1.0, "loss weight of ACT tokens")
    world_weight: float = opt(1.0, "loss weight of WORLD tokens")
    reward: str = opt("auto", "checklist (share of rule-based items met), success (binary task score); auto: "
                              "checklist where the benchmark has one", ["checklist", "success", "auto"])
    defect_penalty: float = opt(0.1, "reward lost per defect of a rehearsed response (when WORLD is trained)")
    sft_steps: int | None = opt(None, "supervised warm-start steps on reference chats before GRPO (default: 1600 "
                                      "for tiny on toyworld, SFT_TINY_STEPS, else 0)")
    sft_batch: int = opt(16, "warm-start sequences per step")
    sft_lr: float = opt(5e-3, "warm-start learning rate")
    sft_warmup: int = opt(30, "linear ramp of --sft-lr over the first steps")
    sft_rehearsal_frac: float | None = opt(None, "share of warm-start sequences teaching the test-time rehearsal "
                                                 "format (default: 0.25 for tiny on toyworld, else 0)")
    sft_memory: str = opt("real", "rehearsal-format memory lines: real responses, or the model's own rehearsed "
                                  "ones (self)", ["real", "self"])
    sft_world_frac: float = opt(0.0, "share of warm-start sequences that are world examples (toy world only)")
    sft_world_lookup: float = opt(0.0, "share of world-example calls that are valid lookups (the rest random)")
    sft_world_skip: str = opt("", "comma list of tools whose responses get no warm-start loss (mechanism test)")
    beta2: float = opt(0.95, "AdamW beta2")
    sft_roles: str = opt("act,world", "roles trained in the warm start")
    seed: int = opt(0, "seed of task draws, sampling and init")
    save_every: int = opt(20, "steps between checkpoints")
    keep_checkpoints: int = opt(3, "step_N folders kept (older ones removed after each save); 0 keeps all")
    chunk_size: int = opt(1024, "positions per LM-head chunk in the log-prob pass")
    activation_checkpointing: str = opt("auto", "recompute each decoder layer in backward instead of keeping its "
                                                "activations (a 16k-token row of an 8B model keeps ~80 GB without "
                                                "it); auto: on for a real model, off for tiny", ["auto", "on", "off"])
    max_bad_steps: int = opt(3, "consecutive non-finite steps before the run stops")
    overwrite: bool = opt(False, "replace an existing --out folder")
    require_update: bool = opt(True, "exit 1 when no GRPO step of the run had a learning signal (every group flat "
                                     "or nothing trained); --no-require-update for smoke runs: a warning instead")

    def resolved(self) -> "TrainConfig":
        """A copy with every None (and the 'auto' choices) replaced by its value for this model and benchmark.
        Runs saved before these were None stored -1 for 'auto': read the same."""
        from bench import settings
        c = TrainConfig(**asdict(self))
        tiny = c.model == "tiny"
        bench = settings.settings_for(c.bench)
        if c.lr is None or c.lr < 0:
            c.lr = 3e-4 if tiny else 1e-6
        if c.sft_steps is None or c.sft_steps < 0:
            c.sft_steps = SFT_TINY_STEPS if tiny and c.bench == "toyworld" else 0
        if c.sft_rehearsal_frac is None or c.sft_rehearsal_frac < 0:   # the tiny model never saw the format
            c.sft_rehearsal_frac = 0.25 if tiny and c.bench == "toyworld" else 0.0
        for key, value in settings.limits_for(c.bench, **{k: getattr(c, k) for k in settings.LIMIT_FIELDS}).items():
            setattr(c, key, value)
        c.split = c.split or bench.train_split
        c.out = c.out or default_out(c.model, c.bench)
        if c.train_roles == "auto":
            c.train_roles = "act,world" if c.env == "rehearse" else "act"
        if c.activation_checkpointing == "auto":
            c.activation_checkpointing = "off" if tiny else "on"
        if c.reward == "auto":
            import reward
            c.reward = "checklist" if reward.has_checklist(c.bench) else "success"
        return c


def default_out(model: str, bench: str) -> str:
    """runs/MODEL-BENCH: MODEL the folder or file name without its extension ('tiny' for the tiny model)."""
    name = Path(model.rstrip("/")).name
    for ext in (".gguf", ".safetensors"):
        name = name[:-len(ext)] if name.endswith(ext) else name
    return f"runs/{name or 'model'}-{bench}"


SFT_TINY_STEPS = 1600  # copy transition at ~280-575 on one machine, ~800-1200 on another; gains go on to 1800 (README)
ROLE_NAMES = {"act": Role.ACT, "world": Role.WORLD}


class ConfigError(ValueError):
    """A bad flag value; main() prints it as one line and exits 2."""


def parse_roles(text: str) -> list[Role]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in ROLE_NAMES]
    if bad or not names:
        raise ConfigError(f"roles must be a comma list of act,world; got {text!r}")
    return [ROLE_NAMES[n] for n in names]


def parse_task_opts(text: str) -> dict:
    """'families=balance,send,holdout=pairs' -> {'families': 'balance,send', 'holdout': 'pairs'} (a comma
    starts a new pair only before 'key='); values that read as JSON (numbers, true/false) are converted."""
    import re
    out = {}
    for part in filter(None, (p.strip() for p in re.split(r",(?=\s*\w+=)", text))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ConfigError(f"--task-opts takes key=value pairs separated by commas, got {part!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def parse_tool_names(text: str) -> frozenset:
    """'get_price,buy' -> frozenset of names ("" -> empty)."""
    names = [t.strip() for t in text.split(",")]
    if text.strip() and not all(names):
        raise ConfigError(f"--sft-world-skip takes a comma list of tool names, got {text!r}")
    return frozenset(n for n in names if n)


def validate(cfg: TrainConfig):
    from bench import BENCHES, load_bench
    if cfg.bench not in BENCHES:
        raise ConfigError(f"unknown --bench {cfg.bench!r}; choose one of: {', '.join(BENCHES)}")
    if cfg.env not in ("rehearse", "real", "sim"):
        raise ConfigError(f"--env must be rehearse, real or sim, not {cfg.env!r}")
    if cfg.world_model not in ("shared", "separate"):
        raise ConfigError(f"--world-model must be shared or separate, not {cfg.world_model!r}")
    roles = set(parse_roles(cfg.train_roles)) if cfg.train_roles != "auto" else set()
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
    import reward
    if cfg.reward not in (*reward.REWARD_KINDS, "auto"):
        raise ConfigError(f"--reward must be one of {', '.join(reward.REWARD_KINDS)} or auto, not {cfg.reward!r}")
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
        if name == "lr" and v is None:   # resolved per model
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
    if resolved.sft_steps > 0 and not hasattr(load_bench(cfg.bench), "reference_messages"):
        raise ConfigError(f"--sft-steps {resolved.sft_steps}: benchmark {cfg.bench!r} has no reference solutions "
                          "to warm-start on; use --sft-steps 0")
    if cfg.sft_memory not in ("real", "self"):
        raise ConfigError(f"--sft-memory must be real or self, not {cfg.sft_memory!r}")
    if not 0 <= cfg.sft_world_frac <= 1:   # also refuses nan
        raise ConfigError(f"--sft-world-frac must be in [0, 1], got {cfg.sft_world_frac}")
    if not 0 <= cfg.sft_world_lookup <= 1:
        raise ConfigError(f"--sft-world-lookup must be in [0, 1], got {cfg.sft_world_lookup}")
    if cfg.sft_world_frac > 0 and not hasattr(load_bench(cfg.bench), "world_examples"):
        raise ConfigError(f"--sft-world-frac needs a benchmark that generates world examples (toyworld); "
                          f"{cfg.bench!r} has none")
    parse_tool_names(cfg.sft_world_skip)
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
    import policy
    if not cfg.chat_template_kwargs:
        return None
    try:
        return policy.parse_template_kwargs(cfg.chat_template_kwargs)
    except ValueError as exc:
        raise ConfigError(f"--chat-template-kwargs: {exc}") from exc


# ----------------------------------------------------------------------------------------------------------
# Distributed setup: FSDP2 under torchrun (NCCL on CUDA, gloo on CPU), a plain module otherwise


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_dist() -> Dist:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world_size == 1:
        return Dist(device=torch.device("cuda" if cuda else "cpu"))
    import torch.distributed as dist
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(rank=dist.get_rank(), world_size=world_size, device=torch.device(f"cuda:{local}" if cuda else "cpu"))


def shard(model, d: Dist):
    """FSDP2: each decoder layer, then the root; bf16 compute with fp32 reduction on GPU."""
    if d.world_size == 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(d.device.type, (d.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if d.device.type == "cuda" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


class gathered_for_generation:
    """Unshard every FSDP module once for a whole rollout (no per-token all-gathers; ranks may generate
    different numbers of tokens), then reshard. A no-op without FSDP."""

    def __init__(self, model):
        from torch.distributed.fsdp import FSDPModule
        self.root = model
        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def __enter__(self):
        for m in self.modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()

    def __exit__(self, *exc):
        for m in self.modules:
            m.reshard()
            # back to fully_shard's defaults: the root keeps its parameters after forward (token_logprobs then
            # uses the unsharded LM-head weight; resharded, it would be a DTensor and the matmul fails)
            m.set_reshard_after_forward(m is not self.root, recurse=False)


def all_sum(values: list[float], d: Dist) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    if d.world_size > 1:
        import torch.distributed as dist
        dist.all_reduce(t)
    return t.tolist()


def gather_sums(sums: dict[str, list[float]], d: Dist) -> dict[str, list[float]]:
    """Per-key lists of sums added over ranks (keys may differ between ranks)."""
    if d.world_size == 1:
        return sums
    import torch.distributed as dist
    parts = [None] * d.world_size
    dist.all_gather_object(parts, sums)
    out: dict[str, list[float]] = {}
    for part in parts:
        for key, vals in part.items():
            out[key] = [a + b for a, b in zip(out.get(key, [0.0] * len(vals)), vals)]
    return out


def autocast(d: Dist):
    if d.device.type == "cuda" and d.world_size == 1:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


# ----------------------------------------------------------------------------------------------------------
# One policy update on a batch of rollout rows (shared by the loop, the SFT warm start and the tests)


@dataclass
class Batch:
    ids: torch.Tensor          # [B, T] right-padded
    roles: torch.Tensor        # [B, T]
    old_logp: torch.Tensor     # [B, T] sampling log-probs
    advantages: torch.Tensor   # [B, T]

    def rows(self, idx):
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


WORLD_EXAMPLE_MAX_CALLS = 4   # the reference chats of the toy world hold 1-4 calls


def world_response_tools(engine, task, ids: list[int], roles: list[int]) -> list[tuple[int, int, str | None]]:
    """(start, end, tool name) of each WORLD stretch of a sequence: the k-th stretch after an assistant turn
    answers that turn's k-th call, parsed from the turn's own tokens (None for a malformed call). Works on
    every warm-start layout (reference chats, rehearsal-format examples, world examples)."""
    spans, names, k, start = [], [], 0, 0
    for pos in range(1, len(roles) + 1):
        if pos < len(roles) and roles[pos] == roles[start]:
            continue
        role = roles[start]
        if role == Role.ACT:
            body = [t for t in ids[start:pos] if t != engine.fmt.eos_id]
            parsed = engine.fmt.parse(engine.tok.decode(body, skip_special_tokens=False), task.tools)
            names, k = [getattr(item, "name", None) for item in parsed.items], 0
        elif role == Role.WORLD:
            spans.append((start, pos, names[k] if k < len(names) else None))
            k += 1
        start = pos
    return spans


def without_world_loss(engine, task, ids: list[int], roles: list[int], tools: frozenset) -> list[int]:
    """roles with the WORLD tokens of responses to `tools` turned into PROMPT: no loss on them, while the
    calls that lead to them (ACT) are still trained."""
    roles = list(roles)
    for start, end, name in world_response_tools(engine, task, ids, roles):
        if name in tools:
            roles[start:end] = [int(Role.PROMPT)] * (end - start)
    return roles


def sft_sequence(engine, bench, task, rehearsal_frac: float, rng: random.Random, world_frac: float = 0.0,
                 world_skip: frozenset = frozenset(), memory: str = "real", sampling=None, world_lookup: float = 0.0):
    """(ids, roles) of one warm-start sequence: with probability world_frac a world example
    (bench.world_examples: random valid and invalid calls with their real responses, a world_lookup share of
    them valid lookups, never of a tool in world_skip), else the reference
    chat, or with probability rehearsal_frac one of rehearse.warm_start_examples (an assessment or a
    memory-prefixed turn, its memory lines from `memory`, "self" sampled with `sampling`) built from it.
    Responses of the tools in world_skip carry no loss."""
    import rehearse
    import rollout
    seq, world_example = None, world_frac > 0 and rng.random() < world_frac
    if world_example:
        n_calls = rng.randint(1, WORLD_EXAMPLE_MAX_CALLS)
        messages = bench.world_examples(task, rng, n_calls, lookup_frac=world_lookup, skip_lookups=world_skip) \
            if world_lookup else bench.world_examples(task, rng, n_calls)
    else:
        messages = bench.reference_messages(task)
        if rehearsal_frac > 0 and rng.random() < rehearsal_frac:
            examples = rehearse.warm_start_examples(engine, task, messages, bench.make_env, rng, memory=memory,
                                                    sampling=sampling)
            if examples:
                seq = rng.choice(examples)
    ids, roles = seq if seq is not None else rollout.encode_conversation(engine, task, messages)
    if world_skip:
        roles = without_world_loss(engine, task, ids, roles, world_skip)
    if world_example:   # the random calls are not behaviour to imitate: only their responses (WORLD) train
        roles = [int(Role.PROMPT) if r == Role.ACT else r for r in roles]
    return ids, roles


def sft_loss(model, seqs: list[tuple[list[int], list[int]]], train_roles, d: Dist, pad_id: int, chunk_size: int):
    """Mean negative log-likelihood of the trained roles' tokens of reference sequences; backward included."""
    width = max(len(i) for i, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    roles = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, (i, r) in enumerate(seqs):
        ids[b, :len(i)], roles[b, :len(r)] = torch.tensor(i), torch.tensor(r)
    ids, roles = ids.to(d.device), roles.to(d.device)
    mask = role_mask(roles, train_roles)
    total = max(all_sum([float(mask.sum())], d)[0], 1.0)
    with autocast(d):
        logp = token_logprobs(model, ids, mask, (roles != Role.PAD).long(), 1.0, chunk_size)
    loss = -(logp * mask).sum() / total
    (loss * d.world_size).backward()
    return all_sum([float(loss.detach())], d)[0], int(all_sum([float(mask.sum())], d)[0])


# ----------------------------------------------------------------------------------------------------------
# Runs: config, metrics, checkpoints (atomic), resume


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the file and the fix."""


def write_atomic(path: Path, text: str):
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def save_model_folder(model, tok, folder: Path, d: Dist, template_kwargs: dict | None = None):
    """The full model (gathered from FSDP shards) and tokenizer (with its chat template and the template
    variables) as an HF folder, written by rank 0."""
    import torch.distributed as dist

    import policy
    if d.world_size > 1:
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
            import torch.distributed as dist
            dist.barrier()
    return folder


def enable_activation_checkpointing(model):
    """Recompute each decoder layer in backward (non-reentrant); active in train mode only."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def load_model(folder: Path, d: Dist, what: str, tok=None, trainable: bool = False, checkpointing: bool = False):
    """A model from an HF folder, sharded like the policy; frozen (eval, no gradients) unless trainable
    (then with activation checkpointing when asked, as the policy).
    With `tok` (the policy's tokenizer), a model with another vocabulary is refused: both models read one
    token sequence."""
    import policy
    try:
        model, its_tok = policy.load_policy(str(folder), dtype=torch.float32, device=d.device)
    except policy.PolicyLoadError as exc:
        raise CheckpointError(f"cannot load {what} from {folder} ({exc})") from exc
    if tok is not None and its_tok.get_vocab() != tok.get_vocab():
        raise ConfigError(f"{what} {folder} has another tokenizer than the policy; both models read one token "
                          "sequence, so they must share the vocabulary")
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


def make_optimizer(model, cfg: TrainConfig):
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, cfg.beta2))


def save_checkpoint(run: Path, step: int, model, tok, optimizer, cfg: TrainConfig, d: Dist, extra: dict,
                    template_kwargs: dict | None = None, world=None):
    """ckpt/step_N/: HF folder (model + tokenizer with its chat template, the template variables),
    optim_rank{r}.pt, state.json; then `latest` -> it. With world=(model, optimizer) (--world-model
    separate), the world model in ckpt/step_N/world_model/ beside optim_world_rank{r}.pt.

    Everything is written into a hidden temp folder that is renamed into place, and `latest` is replaced
    last, so a kill at any moment leaves the previous checkpoint as the latest complete one.
    """
    import torch.distributed as dist

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


WORLD_DIR = "world_model"   # the separate world model inside a checkpoint folder


def load_optimizer_state(optimizer, path: Path):
    try:
        optimizer.load_state_dict(torch.load(path, weights_only=False)["optimizer"])
    except Exception as exc:
        raise CheckpointError(f"cannot load optimizer state from {path}: {type(exc).__name__}: {exc}") from exc


def latest_checkpoint(run: Path) -> Path:
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
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


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
    ref_model: object = None       # the frozen KL reference, made when GRPO begins
    sim_model: object = None       # --env sim: the frozen simulator writing every tool response
    world: object = None           # --world-model separate: the world model, trained on WORLD tokens ...
    world_optimizer: object = None  # ... with an optimizer of its own; both made when GRPO begins

    def world_parts(self):
        """(model, optimizer) of the separate world model for checkpoints; None while there is none."""
        return (self.world, self.world_optimizer) if self.world is not None else None


def train(cfg: TrainConfig, resume: Path | None = None) -> Path:
    """The loop: a supervised warm start (sft_step), then GRPO (grpo_step); metrics, checkpoints, Ctrl-C."""
    from tqdm import tqdm

    t, start_step = setup(cfg, resume)
    cfg, d = t.cfg, t.d
    total_steps = cfg.sft_steps + cfg.steps
    stop = {"flag": False}

    def on_sigint(signum, frame):
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
    if d.world_size > 1:
        import torch.distributed as dist
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
    import rollout
    from bench import load_bench
    from cli import load_engine

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
    world_skip = parse_tool_names(cfg.sft_world_skip)
    known_tools = {t["function"]["name"] for task in tasks[:200] for t in task.tools}
    if world_skip - known_tools:
        raise ConfigError(f"--sft-world-skip names no tool of {cfg.bench!r}: "
                          f"{', '.join(sorted(world_skip - known_tools))}; its tools include: "
                          f"{', '.join(sorted(known_tools)[:20])}")
    lookup_tools = set(getattr(bench, "LOOKUP_TOOLS", ()))
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
                   samples=samples, sim_model=sim_model, world=world, world_optimizer=world_optimizer), start_step


def user_sampling(cfg: TrainConfig):
    """Sampling of the simulated user's replies (tau2, vita): the benchmark's user limits, the run's temperature."""
    import rollout
    from bench import settings
    s = settings.settings_for(cfg.bench)
    return subconfig(rollout.SamplingConfig, cfg, max_new_tokens=s.user_max_new_tokens,
                     max_total_len=s.user_max_total_len)


def sft_step(t: Trainer, step: int, pick: random.Random) -> tuple[dict, bool]:
    """One supervised warm-start step on reference chats (and rehearsal-format / world examples)."""
    cfg, d = t.cfg, t.d
    for g in t.optimizer.param_groups:
        g["lr"] = cfg.sft_lr * min(1.0, (step + 1) / max(cfg.sft_warmup, 1))
    batch_tasks = pick.sample(t.tasks, min(cfg.sft_batch, len(t.tasks)))[d.rank::d.world_size]
    # self memory generates with the model: unsharded once under FSDP, as for a rollout
    with (gathered_for_generation(t.model) if cfg.sft_memory == "self" and d.world_size > 1
          else contextlib.nullcontext()), autocast(d):
        seqs = [sft_sequence(t.engine, t.bench, task, cfg.sft_rehearsal_frac, pick, cfg.sft_world_frac,
                             t.world_skip, cfg.sft_memory, t.sampling, cfg.sft_world_lookup) for task in batch_tasks]
    t.model.train()
    loss, n_tok = sft_loss(t.model, seqs, t.sft_roles, d, t.engine.tok.pad_token_id, cfg.chunk_size)
    norm, ok = optimizer_step(t.model, t.optimizer, cfg.grad_clip) if math.isfinite(loss) else (float("nan"), False)
    if not ok:
        t.optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "tokens": n_tok, "grad_norm": norm}, ok


def grpo_step(t: Trainer, step: int, pick: random.Random) -> tuple[dict, bool]:
    """One GRPO step: roll out G trajectories per task, score them with the verifier, update the policy."""
    import reward
    import rollout
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
        with torch.no_grad(), autocast(d):
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
    n = dict(zip(SUM_KEYS, all_sum([
        float(rewards.sum()), float(sum(succ)), len(scores), flat, ro.stats["act_tokens"], ro.stats["world_tokens"],
        sum(len(x) for x in ro.rehearsal_defects), ro.stats["tokens_sampled"],
        sum(bool(s.components.get("evaluator_error")) for s in scores), len(set(ro.task_index)),
        int(trained.sum()), int((trained & (adv != 0)).sum())], d)))
    record = dict(reward_mean=n["reward"] / n["rows"], success_rate=n["success"] / n["rows"], rows=int(n["rows"]),
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


SUM_KEYS = ("reward", "success", "rows", "flat_groups", "act_tokens", "world_tokens", "defects", "sampled",
            "evaluator_errors", "groups", "trained_tokens", "signal_tokens")   # summed over ranks each step


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


def build_parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field, its help and choices from the field's metadata."""
    from cli import OneLineParser
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
            from cli import template_kwargs_text
            kind = template_kwargs_text
        metavar = {int: "N", float: "X"}.get(kind, f.name.split("_")[-1].upper())
        ap.add_argument(flag, type=kind, choices=choices, help=text + shown, metavar=None if choices else metavar)
    ap.add_argument("--resume", type=str, metavar="RUN", help="continue the run in this folder from its latest "
                                                                "checkpoint")
    return ap


def main(argv=None) -> int:
    import policy
    from bench import BenchUnavailable
    args = vars(build_parser().parse_args(argv))
    resume = args.pop("resume", None)
    try:
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
            cfg = TrainConfig(**{**saved, **args, "out": str(run)})
        else:
            cfg = TrainConfig(**args)
        validate(cfg)
        run = train(cfg, Path(resume) if resume else None)
    except (ConfigError, CheckpointError, policy.PolicyLoadError, BenchUnavailable, FileNotFoundError) as exc:
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

"""EnvACE training: GRPO on role-masked token log-probs, acting and world rehearsal optimised jointly.

    python train.py                                       # tiny model on the embedded toy world (CPU, minutes)
    torchrun --nproc_per_node 8 train.py --model /ckpt/Qwen3-8B --bench tau2

One step: sample tasks -> roll out G trajectories per task (rehearsal by default: the policy writes every
tool response; `--env real` is the standard environment-interaction GRPO baseline) -> verifier reward
(reward.py) -> group-normalised advantages -> clipped-ratio loss on the trained roles' tokens -> AdamW.
"""
from __future__ import annotations

import argparse
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

from rollout import Role, role_mask

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
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    hidden = body(input_ids=ids, attention_mask=attention_mask).last_hidden_state      # [B, T, H]
    predict = loss_mask[:, 1:]                                                          # token t from state t-1
    h = hidden[:, :-1][predict]                                                         # [N, H]
    targets = ids[:, 1:][predict]
    weight = model.get_output_embeddings().weight
    parts = []
    for s in range(0, h.shape[0], chunk_size):
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logprobs, h[s:s + chunk_size], weight, targets[s:s + chunk_size],
                                    temperature, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(h[s:s + chunk_size], weight, targets[s:s + chunk_size], temperature))
    flat = torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.promote_types(h.dtype, torch.float32))
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
    mask = role_mask(roles, train_roles)
    weight = torch.zeros_like(logp)
    for role in train_roles:
        weight = torch.where(roles == int(role), cfg.role_weights.get(Role(role).name.lower(), 1.0), weight)
    weight = weight * mask
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
    n = mask.sum().clamp(min=1)
    clipped = mask & (((ratio < 1 - cfg.clip_low) & (adv < 0)) | ((ratio > 1 + cfg.clip_high) & (adv > 0)))
    stats = {"clip_frac": float(clipped.sum() / n), "kl": float((kl * mask).sum() / n),
             "ratio_mean": float((ratio * mask).sum() / n), "tokens": int(mask.sum())}
    return loss, stats

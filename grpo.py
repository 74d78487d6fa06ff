"""The GRPO math, alone: per-token log-probs under a loss mask, group-normalised advantages, the clipped-ratio loss.

Nothing here knows about processes, files or the training loop (train.py): every function takes tensors and
returns tensors, so the objective can be read, tested and forked on its own.

    logp = token_logprobs(model, ids, role_mask(roles, train_roles), attention_mask)     # [B, T]
    adv, flat = role_advantages(rewards, group_ids, roles, train_roles, scale_std, per_role)
    loss, stats = grpo_loss(logp, old_logp, adv, roles, train_roles, LossConfig())
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from roles import Role

# ----------------------------------------------------------------------------------------------------------
# The loss's view of the role array


def role_mask(roles: torch.Tensor, train_roles) -> torch.Tensor:
    """The one place a loss mask is made: True where a token's role is in `train_roles`."""
    mask = torch.zeros_like(roles, dtype=torch.bool)
    for role in train_roles:
        mask |= roles == int(role)
    return mask


def role_weights(roles: torch.Tensor, train_roles, weights: dict) -> torch.Tensor:
    """The loss weight of each token: weights[role name] (default 1) where role_mask is True, else 0."""
    out = torch.zeros(roles.shape, dtype=torch.float32, device=roles.device)
    for role in train_roles:
        out = torch.where(roles == int(role), float(weights.get(Role(role).name.lower(), 1.0)), out)
    return out


# ----------------------------------------------------------------------------------------------------------
# Masked token log-probs, chunked (the full [B, T, V] float32 tensor is never built)


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    """log p(target) of one chunk of positions: [N, H] hidden states through the LM head, softmax in fp32."""
    logits = hidden @ weight.t()
    if logits.dtype in (torch.float16, torch.bfloat16):  # the softmax always runs in at least fp32
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets[:, None])[:, 0]
    return picked - torch.logsumexp(logits, dim=-1)


MIN_SHARED_PREFIX = 16   # below this a separate prefix pass costs more than it saves


def shared_prefix_len(ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """How many leading tokens every row of ids [B, T] has in common (real tokens in every row), at most T - 1
    so each row keeps a suffix; 0 for a single row (nothing to share)."""
    if ids.shape[0] < 2:
        return 0
    same = ((ids == ids[:1]) & attention_mask.bool()).all(0)                            # [T]
    differs = torch.nonzero(~same)
    first = int(differs[0]) if differs.numel() else ids.shape[1]
    return min(first, ids.shape[1] - 1)


def prefix_runs(ids: torch.Tensor, attention_mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """Adjacent rows that share a prompt of at least MIN_SHARED_PREFIX tokens, as (first, end, prefix length).

    A run grows while each next row shares at least the run's first two rows' prefix with the first row, so a
    micro-batch holding two GRPO groups (the same system prompt, different tasks) gives two runs, each with its
    task's whole prompt. Rows in no run are left out."""
    B, runs, a = ids.shape[0], [], 0
    while a + 1 < B:
        prefix = shared_prefix_len(ids[a:a + 2], attention_mask[a:a + 2])
        if prefix < MIN_SHARED_PREFIX:
            a += 1
            continue
        b = a + 2
        while b < B and shared_prefix_len(ids[[a, b]], attention_mask[[a, b]]) >= prefix:
            b += 1
        runs.append((a, b, prefix))
        a = b
    return runs


def _hidden_shared_prefix(model, ids: torch.Tensor, attention_mask: torch.Tensor, prefix: int) -> torch.Tensor:
    """Final hidden states [B, T, H] with the common prefix run once: the prompt of a GRPO group is the same in
    its G rows, so its forward (and, under autograd, its backward) runs once and its KV cache, still part of the
    graph, is repeated for the rows' suffixes. Equal to the full forward up to float rounding."""
    B, T = ids.shape
    first = model(input_ids=ids[:1, :prefix], attention_mask=attention_mask[:1, :prefix], use_cache=True)
    cache = first.cache
    cache.batch_repeat_interleave(B)                                                    # [1, ...] -> [B, ...]
    positions = torch.arange(prefix, T, device=ids.device)[None].expand(B, -1)
    rest = model(input_ids=ids[:, prefix:], attention_mask=attention_mask, cache=cache,
                 position_ids=positions, use_cache=True).logits                           # [B, T - prefix, H]
    return torch.cat([first.logits.expand(B, -1, -1), rest], dim=1)


def token_logprobs(model, ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: float = 1.0, chunk_size: int = 1024, share_prefix: bool = True) -> torch.Tensor:
    """log p(ids[b, t] | ids[b, :t]) at positions where `loss_mask` is True; exactly 0 elsewhere.

    Only the masked positions go through the LM head, `chunk_size` positions at a time, each chunk under
    activation checkpointing: the peak is one [chunk, V] block instead of [B, T, V], in forward and backward.
    ids/loss_mask/attention_mask: [B, T]; sequences are right-padded (positions 0..len-1).
    share_prefix: run the prompt adjacent rows have in common (a GRPO group's) once (prefix_runs); off under
    activation checkpointing, which has no KV cache.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(ids)
    # The root forward (not the inner decoder) must run, so FSDP's hooks gather the root's parameters; the
    # LM head is swapped out for the call so it returns the final hidden states instead of [B, T, V] logits.
    head = model.get_output_embeddings()
    model.set_output_embeddings(torch.nn.Identity())
    try:
        # HF turns the KV cache off under activation checkpointing while training: no prompt to share then
        checkpointed = getattr(model, "is_activation_checkpointing", False) and model.training
        runs = prefix_runs(ids, attention_mask) if share_prefix and not checkpointed else []
        whole = sorted(set(range(ids.shape[0])) - {i for a, b, _ in runs for i in range(a, b)})
        parts, order = [], []
        if whole:                                                       # rows sharing no prompt: one forward
            parts.append(model(input_ids=ids[whole], attention_mask=attention_mask[whole], use_cache=False).logits)
            order += whole
        for a, b, prefix in runs:
            parts.append(_hidden_shared_prefix(model, ids[a:b], attention_mask[a:b], prefix))
            order += range(a, b)
        hidden = torch.cat(parts)[torch.argsort(torch.tensor(order, device=ids.device))]   # [B, T, H]
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
# Advantages


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
# The clipped-ratio loss


@dataclass
class LossConfig:
    """The loss's knobs (filled from TrainConfig's fields of the same name by train.subconfig)."""
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

"""The supervised warm start before GRPO: its sequences (reference chats, rehearsal-format examples, world
examples) and its loss (the mean NLL of the tokens its loss mask selects).

Roles always say who wrote a token (rollout.Role); whether a token is trained is a separate per-token loss
mask. A sequence's mask starts as role_mask(roles, trained roles) and is then switched off where a token is
shown but not taught: the random calls of a world example (ACT tokens that are no behaviour to imitate) and
the responses of the tools in --sft-world-skip (WORLD tokens, for the mechanism test).
"""
from __future__ import annotations

import random

import torch

import rehearse
import rollout
from distributed import Dist, all_sum, autocast
from grpo import token_logprobs
from grpo import role_mask
from roles import Role

WORLD_EXAMPLE_MAX_CALLS = 4   # the reference chats of the toy world hold 1-4 calls


def trained_role_mask(roles: list[int], train_roles) -> list[bool]:
    """The starting loss mask of a sequence: True on the tokens of the trained roles."""
    return role_mask(torch.tensor(roles, dtype=torch.long), train_roles).tolist()


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


def without_world_loss(engine, task, ids: list[int], roles: list[int], loss_mask: list[bool],
                       tools: frozenset) -> list[bool]:
    """`loss_mask` with the WORLD tokens of responses to `tools` switched off: no loss on them, while the calls
    that lead to them (ACT) are still trained. The roles are left as they are."""
    loss_mask = list(loss_mask)
    for start, end, name in world_response_tools(engine, task, ids, roles):
        if name in tools:
            loss_mask[start:end] = [False] * (end - start)
    return loss_mask


def sft_sequence(engine, bench, task, train_roles, rehearsal_frac: float, rng: random.Random, world_frac: float = 0.0,
                 world_skip: frozenset = frozenset(), memory: str = "real", sampling=None, world_lookup: float = 0.0):
    """(ids, roles, loss_mask) of one warm-start sequence: with probability world_frac a world example
    (bench.world_examples: random valid and invalid calls with their real responses, a world_lookup share of
    them valid lookups, never of a tool in world_skip), else the reference
    chat, or with probability rehearsal_frac one of rehearse.warm_start_examples (an assessment or a
    memory-prefixed turn, its memory lines from `memory`, "self" sampled with `sampling`) built from it.
    loss_mask: the tokens of `train_roles`, except the responses of the tools in world_skip and, in a world
    example, its calls."""
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
    loss_mask = trained_role_mask(roles, train_roles)
    if world_skip:
        loss_mask = without_world_loss(engine, task, ids, roles, loss_mask, world_skip)
    if world_example:   # the random calls are not behaviour to imitate: only their responses (WORLD) train
        loss_mask = [m and r != Role.ACT for m, r in zip(loss_mask, roles)]
    return ids, roles, loss_mask


def sft_loss(model, seqs: list[tuple[list[int], list[int], list[bool]]], d: Dist, pad_id: int, chunk_size: int):
    """Mean negative log-likelihood over the loss-masked tokens of (ids, roles, loss_mask) sequences, over all
    ranks; backward included. Returns (loss, number of trained tokens)."""
    width = max(len(i) for i, _, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    roles = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for b, (i, r, m) in enumerate(seqs):
        ids[b, :len(i)], roles[b, :len(r)], mask[b, :len(m)] = torch.tensor(i), torch.tensor(r), torch.tensor(m)
    ids, roles, mask = ids.to(d.device), roles.to(d.device), mask.to(d.device)
    total = max(all_sum([float(mask.sum())], d)[0], 1.0)
    with autocast(d):
        logp = token_logprobs(model, ids, mask, (roles != Role.PAD).long(), 1.0, chunk_size)
    loss = -(logp * mask).sum() / total
    (loss * d.world_size).backward()
    return all_sum([float(loss.detach())], d)[0], int(all_sum([float(mask.sum())], d)[0])

"""The supervised warm start before GRPO: its sequences (reference chats, rehearsal-format examples, world
examples) and its loss (the mean NLL of the tokens its loss mask selects).

Roles always say who wrote a token (rollout.Role); whether a token is trained is a separate per-token loss
mask. A sequence's mask starts as role_mask(roles, trained roles) and is then switched off where a token is
shown but not taught: the random calls of a world example (ACT tokens that are no behaviour to imitate) and
the responses of the tools in --sft-world-skip (WORLD tokens, for the mechanism test).
"""
from __future__ import annotations

import random
from dataclasses import replace

import torch

import rollout
from chat_format import ASSESS_ERROR, ASSESS_OK, ASSESS_PREFIX, ASSESS_WRONG
from diagnostics import is_error_text, predict_responses
from distributed import Dist, all_sum, autocast
from grpo import role_mask, token_logprobs
from rehearse import memory_text
from roles import Role
from rollout import SamplingConfig, encode_conversation

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
    chat, or with probability rehearsal_frac one of warm_start_examples (an assessment or a
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
            examples = warm_start_examples(engine, task, messages, bench.make_env, rng, memory=memory,
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


# ----------------------------------------------------------------------------------------------------------
# -- teaching the format: supervised warm-start examples -------------------------------------------------
#
# A model that never saw a memory block or an assessment prefix derails on them (measured: the tiny model
# drops from 56% to 0% at B >= 1). These examples put both formats in the warm start, laid out token for
# token as `act` lays them out at test time:
#   assessment  context | proposal (ACT) | tool-response open | real response (WORLD) | close | ASSESS_PREFIX |
#               assessment text (ACT)
#   memory      context | memory block of 1-4 rehearsals, the first being the assessment example's (PROMPT,
#               not trained) | the reference turn (ACT)
# Proposals are the reference call or a perturbation of it; the "predicted" responses are the real ones
# (what a perfect world model would write). The assessment rule is fixed and learnable: a proposal equal
# to the reference is "ok", one whose response is an error "revise: it fails", else "revise: wrong
# arguments". The committed turn is always the reference, so the memory teaches: commit what was judged ok.

MEMORY_SOURCES = ("real", "self")


def assessment_for(call_is_reference: bool, response: str) -> str:
    """The fixed rule the warm-start examples teach: ASSESS_OK for the reference call, else ASSESS_ERROR when its
    response is an error, else ASSESS_WRONG."""
    if call_is_reference:
        return ASSESS_OK
    return ASSESS_ERROR if is_error_text(response) else ASSESS_WRONG


def perturb_arguments(arguments: dict, strings: list[str], rng) -> dict:
    """A plausible wrong version of a call's arguments: one integer moved, or one string swapped for another
    string of the episode (or misspelt). Returns a different dict whenever the arguments have a value."""
    keys = [k for k, v in arguments.items() if isinstance(v, (int, str)) and not isinstance(v, bool)]
    if not keys:
        return dict(arguments)
    out = dict(arguments)
    k = rng.choice(keys)
    v = out[k]
    if isinstance(v, int):
        choices = [v * 2, v + rng.randint(1, 9), max(1, v - rng.randint(1, 9)), max(1, v // 2), v * 3]
        choices = [c for c in choices if c != v] or [v + 1]
        out[k] = rng.choice(choices)
    else:
        others = sorted({x for x in strings if x != v})
        out[k] = rng.choice(others) if others and rng.random() < 0.8 else v + v[-1:]
    return out


def _call_turn(call: dict) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]}


def warm_start_examples(eng, task, messages: list[dict], make_env, rng, budgets=(1, 2, 4), memory: str = "real",
                        sampling: SamplingConfig | None = None, steer=None) -> list:
    """One assessment example and one memory example (token ids, role ids) from a reference chat.

    A call turn of the reference is picked at random; `make_env(task)` replays the reference calls before it
    to get the real responses of the proposals. Returns [] when the chat has no single-call turn.

    `memory` says what the memory example's lines hold. "real": each proposal's real response, judged by the
    rule on it (assessment_for). "self": what the current model rehearses for the proposal, written as at test
    time (predict_responses with `sampling`, its seed drawn from rng; `steer` as in act), judged by the rule
    on that prediction: where the prediction is right about the call failing or not (fidelity's
    error_correct against the real response) that is the real-mode judgement; where it is not, it is the
    judgement the misleading prediction leads to, as a test-time assessor reading only its own prediction
    would write. The committed turn stays the reference either way, so "self" teaches to commit the right
    call past the model's own wrong notes. The assessment example is the same in both modes (its WORLD
    tokens, which are trained, are the real response)."""
    if memory not in MEMORY_SOURCES:
        raise ValueError(f"memory must be one of {', '.join(MEMORY_SOURCES)}, not {memory!r}")
    fmt = eng.fmt
    turns = [i for i, m in enumerate(messages) if i >= len(task.messages) and m["role"] == "assistant"
             and len(m.get("tool_calls") or []) == 1]
    if not turns:
        return []
    t = rng.choice(turns)
    n = len(encode_conversation(eng, task, messages[:t])[0])
    full_ids, full_roles = encode_conversation(eng, task, messages[:t + 1])
    ref = messages[t]["tool_calls"][0]["function"]
    ref = {"name": ref["name"], "arguments": dict(ref["arguments"])}
    strings = [v for m in messages for tc in (m.get("tool_calls") or [])
               for v in tc["function"]["arguments"].values() if isinstance(v, str)]

    def response(call):
        env = make_env(task)
        for m in messages[:t]:
            for tc in m.get("tool_calls") or []:
                env.step(tc["function"]["name"], tc["function"]["arguments"])
        return str(env.step(call["name"], call["arguments"]))

    def rehearsal():
        """A proposal (the reference call or a perturbation) as a memory record, predicted = real response."""
        prop = ref if rng.random() < 0.5 else {"name": ref["name"],
                                                "arguments": perturb_arguments(ref["arguments"], strings, rng)}
        obs = response(prop)
        return prop, {"content": "", "assessment": assessment_for(prop == ref, obs),
                      "items": [{"name": prop["name"], "arguments": prop["arguments"], "predicted": obs}]}

    def proposal_context(prop):
        """Ids and roles up to where the policy writes the proposal's response, laid out as `act` lays them."""
        ids, roles = encode_conversation(eng, task, messages[:t] + [_call_turn(prop)])
        p, r = fmt.encode([(fmt.after_eos + fmt.tool_open, Role.PROMPT, True)])
        return ids + p, roles + [int(x) for x in r]

    # assessment: the proposal's body as the template renders it, then the rehearsal and the judgement, each
    # stretch encoded as `act` encodes it (text between two generated segments in one piece)
    prop, first = rehearsal()
    obs = first["items"][0]["predicted"]
    ids, roles = proposal_context(prop)
    for pieces in ([(fmt.response_text(obs), Role.WORLD, False), (fmt.obs_end, Role.WORLD, True)],
                   [(fmt.tool_close, Role.PROMPT, True), (ASSESS_PREFIX, Role.PROMPT, False)],
                   [(first["assessment"], Role.ACT, False)]):
        p, r = fmt.encode(pieces)
        ids += p
        roles += [int(x) for x in r]
    examples = [(ids + [fmt.eos_id], roles + [int(Role.ACT)])]
    # memory: that rehearsal and up to 3 more in front of the reference turn
    more = [rehearsal() for _ in range(rng.choice(list(budgets)) - 1)]
    props, records = [prop] + [p for p, _ in more], [first] + [rec for _, rec in more]
    if memory == "self":
        cfg = replace(sampling or SamplingConfig(), seed=rng.randrange(2 ** 31))
        predicted = predict_responses(eng, task, [proposal_context(p)[0] for p in props], cfg, steer)
        records = [{**rec, "assessment": assessment_for(p == ref, pred),
                    "items": [{**rec["items"][0], "predicted": pred}]}
                   for p, rec, pred in zip(props, records, predicted)]
    mem = fmt.encode_text(memory_text(records))
    mem_roles = [int(Role.PROMPT)] * len(mem)
    examples.append((full_ids[:n] + mem + full_ids[n:], full_roles[:n] + mem_roles + full_roles[n:]))
    return examples

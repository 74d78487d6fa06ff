"""Token-in, token-out multi-turn rollouts with a KV cache kept across turns.

One sequence per trajectory holds every token with a role id:

    PROMPT  system/user text and the chat template's scaffolding (the engine writes it)
    ACT     tokens the policy sampled as the agent
    WORLD   tokens the policy sampled while rehearsing a tool's response
    OBS     tokens a real environment returned (and the engine's error observations)

After the policy emits a tool call, the engine appends the template's tool-response opening and then either
lets the same policy write the response (rehearsal, WORLD) or executes the call for real (OBS). The prompt is
prefilled once per task and its cache is forked for the G samples of the group; after that each forward pass
feeds only the tokens each row has not cached yet (its last sampled token plus any appended scaffolding or
observation), with ragged per-row lengths handled by an attention mask with holes and explicit positions.
Rows leave the batch as they finish. No turn re-encodes the context.

Token ids are the source of truth: sampled ids are kept as sampled, and only new text (scaffolding,
observations, user turns) is tokenized, as deltas cut at special-token boundaries.
"""
from __future__ import annotations

import copy
import functools
import json
import time
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Callable

import torch

from bench import Task, Trajectory
import chat_format
from chat_format import CallError, ChatFormat, ToolCall, derive_chat_format, validate_rehearsal


def new_kv_cache():
    """A transformers Cache whose layers write into preallocated buffers (see PreallocatedKVLayer)."""
    from transformers.cache_utils import Cache
    return Cache(layer_class_to_replicate=_preallocated_layer_class())


@functools.cache   # the class is defined on first use: transformers is imported lazily
def _preallocated_layer_class():
    from transformers.cache_utils import DynamicLayer

    class PreallocatedKVLayer(DynamicLayer):
        """A KV layer that writes new keys/values into a buffer with spare room instead of concatenating.

        DynamicLayer's torch.cat copies the whole cache at every decode step (O(L) per token, ~30-40% of a
        tiny model's step on CPU). Here the buffer grows geometrically, so appending is amortised O(new tokens);
        `keys`/`values` are views of the filled part. Batch selection, forking and cropping keep the layout."""

        def lazy_initialization(self, key_states, value_states):
            self.device = key_states.device
            self.length = 0
            self._k = self._v = None
            self.keys = key_states[..., :0, :]
            self.values = value_states[..., :0, :]
            self.is_initialized = True

        def _views(self):
            self.keys = self._k[..., :self.length, :]
            self.values = self._v[..., :self.length, :]

        def _grow(self, need, like_k, like_v):
            cap = max(need, 64, 2 * (0 if self._k is None else self._k.shape[-2]))
            k = like_k.new_empty((*like_k.shape[:-2], cap, like_k.shape[-1]))
            v = like_v.new_empty((*like_v.shape[:-2], cap, like_v.shape[-1]))
            if self.length:
                k[..., :self.length, :] = self._k[..., :self.length, :]
                v[..., :self.length, :] = self._v[..., :self.length, :]
            self._k, self._v = k, v

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            if self._k is None or self.length + n > self._k.shape[-2]:
                self._grow(self.length + n, key_states, value_states)
            self._k[..., self.length:self.length + n, :] = key_states
            self._v[..., self.length:self.length + n, :] = value_states
            self.length += n
            self._views()
            return self.keys, self.values

        def get_seq_length(self):
            return self.length if self.is_initialized else 0

        def reset(self):
            self._k = self._v = None
            self.length = 0
            super().reset()

        def crop(self, tokens_to_remove):
            if tokens_to_remove > 0:
                raise ValueError("crop takes a negative number of tokens to remove")
            if self.is_initialized and self._k is not None and tokens_to_remove:
                self.length = max(self.length + tokens_to_remove, 0)
                self._views()

        def batch_repeat_interleave(self, repeats):
            if self.get_seq_length() > 0:
                self._k = self._k.repeat_interleave(repeats, dim=0)
                self._v = self._v.repeat_interleave(repeats, dim=0)
                self._views()

        def batch_select_indices(self, indices):
            if self.get_seq_length() > 0:
                self._k, self._v = self._k[indices, ...], self._v[indices, ...]
                self._views()

        def __deepcopy__(self, memo):
            twin = copy.copy(self)
            if self._k is not None:
                twin._k, twin._v = self._k.clone(), self._v.clone()
                twin._views()
            return twin

    return PreallocatedKVLayer


class Role(IntEnum):
    PAD = 0
    PROMPT = 1
    ACT = 2
    WORLD = 3
    OBS = 4


def role_mask(roles: torch.Tensor, train_roles) -> torch.Tensor:
    """The one place a loss mask is made: True where a token's role is in `train_roles`."""
    mask = torch.zeros_like(roles, dtype=torch.bool)
    for role in train_roles:
        mask |= roles == int(role)
    return mask


# ----------------------------------------------------------------------------------------------------------
# Configuration and results


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    max_new_tokens: int = 256        # per assistant turn
    max_world_tokens: int = 128      # per rehearsed tool response
    max_turns: int = 8               # assistant turns per trajectory
    max_total_len: int = 4096        # tokens per trajectory, prompt included
    seed: int = 0


@dataclass
class Span:
    role: Role
    start: int
    end: int          # exclusive
    turn: int


@dataclass
class Rollout:
    ids: torch.Tensor          # [B, T] long, right-padded with the pad id
    roles: torch.Tensor        # [B, T] long, Role values (PAD past each row's length)
    logprobs: torch.Tensor     # [B, T] float: log p(ids[b, t] | ids[b, :t]) at sampling time, 0 if not sampled
    lengths: torch.Tensor      # [B]
    task_index: list[int]      # the task of each row; the G rows of a group are adjacent
    spans: list[list[Span]]
    trajectories: list[Trajectory]
    end_reasons: list[str]
    rehearsal_defects: list[list[str]]   # per row, one entry per defect of a rehearsed response
    stats: dict


WorldSwitch = Callable[[int, ToolCall], bool]   # (row, call) -> True to rehearse it, False to execute it
Steer = Callable[[list[int], list[tuple[Role, list[int]]], torch.Tensor], torch.Tensor]


class _Row:
    """Host-side state of one trajectory while it is being generated."""

    def __init__(self, index, task_idx, task, env, prompt_ids):
        self.index, self.task_idx, self.task, self.env = index, task_idx, task, env
        self.ids = list(prompt_ids)
        self.roles = [int(Role.PROMPT)] * len(prompt_ids)
        self.logprobs = [0.0] * len(prompt_ids)
        self.spans = [Span(Role.PROMPT, 0, len(prompt_ids), 0)]
        self.n_cached = len(prompt_ids)
        self.plan: deque = deque()   # ("text", text, role, trusted) / ("response", call, error) / ("gen", role, payload)
        self.gen_role, self.gen_payload, self.gen_start = Role.ACT, None, len(prompt_ids)
        self.turn = self.user_turn = 0
        self.traj = Trajectory(task_id=task.id, messages=[dict(m) for m in task.messages])
        self.defects: list[str] = []
        self.done = False

    @property
    def feed(self) -> list[int]:
        return self.ids[self.n_cached:]

    def append(self, ids, role, logprobs=None):
        if not ids:
            return
        start = len(self.ids)
        self.ids += ids
        self.roles += [int(role)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        last = self.spans[-1]
        if last.role == role and last.end == start and last.turn == self.turn:
            last.end += len(ids)
        else:
            self.spans.append(Span(role, start, start + len(ids), self.turn))

    def append_text(self, fmt: ChatFormat, pieces: list):
        """Append text pieces (text, role, trusted), encoded together; each token takes its piece's role."""
        ids, roles = fmt.encode(pieces)
        start = 0
        for k in range(1, len(ids) + 1):
            if k == len(ids) or roles[k] != roles[start]:
                self.append(ids[start:k], roles[start])
                start = k

    def truncate(self, n):
        """Cut appended (never sampled-then-cached) tokens past n, e.g. an observation that overflows."""
        del self.ids[n:], self.roles[n:], self.logprobs[n:]
        self.spans = [s for s in self.spans if s.start < n]
        self.spans[-1].end = min(self.spans[-1].end, n)

    def finish(self, reason):
        self.done = True
        self.traj.end_reason = reason


class Engine:
    """Holds the model, tokenizer and the chat format derived from its template; `run` does the rollouts."""

    def __init__(self, model, tok, template_kwargs: dict | None = None, call_format: str | None = None):
        """template_kwargs: extra variables for the chat template, e.g. {"enable_thinking": False} (Qwen3).
        call_format: a tool-call format name (chat_format.CALL_FORMATS); None infers it from the template."""
        self.model, self.tok = model, tok
        self.template_kwargs = dict(template_kwargs or {})
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        stop_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        self.fmt: ChatFormat = derive_chat_format(tok, self.template_kwargs, call_format, stop_ids)

    def prompt_ids(self, task: Task) -> list[int]:
        return self.fmt.prompt_ids(task.messages, task.tools)

    # -- host logic run when a row's generated segment ends --------------------------------------------

    def _start_next(self, row: _Row, execute: Callable | None = None):
        """Apply plan items in order until the next generation segment; an empty plan ends the row.

        Text appended between two generated segments is encoded in one piece (chat_format.ChatFormat.encode),
        so the ids equal the template's own tokenization. execute(row, call_index, pending_pieces) ->
        observation replaces the plain real execution (rehearse.py wraps it with a discarded fidelity probe)."""
        fmt, pending = self.fmt, []
        while row.plan:
            item = row.plan.popleft()
            if item[0] == "text":
                pending.append(item[1:])
            elif item[0] == "response":   # a real response: call index, or None and the CallError to report
                _, index, error = item
                if index is None:
                    text = error.observation()
                    row.traj.messages.append({"role": "tool", "content": text})
                else:
                    text = execute(row, index, pending) if execute else self.execute_call(row, row.traj.calls[index])
                    self._record_response(row, index, text, rehearsed=False)
                pending += [(fmt.response_text(text), Role.OBS, False), (fmt.obs_end, Role.PROMPT, True)]
            else:
                row.append_text(fmt, pending)
                _, row.gen_role, row.gen_payload = item
                row.gen_start = len(row.ids)
                return
        row.append_text(fmt, pending)
        if not row.done:
            row.finish("plan_exhausted")

    def execute_call(self, row: _Row, call: ToolCall) -> str:
        if row.env is None:
            return json.dumps({"error": "no environment: a call was to be executed for real but the rollout "
                                        "was given no make_env"})
        try:
            return str(row.env.step(call.name, call.arguments))
        except Exception as exc:  # an environment bug becomes an observation, not a dead batch
            return json.dumps({"error": f"environment raised {type(exc).__name__}: {exc}"})

    def _record_response(self, row: _Row, index: int, text: str, rehearsed: bool):
        row.traj.observations[index] = text
        row.traj.rehearsed[index] = rehearsed
        row.traj.messages.append({"role": "tool", "name": row.traj.calls[index].name, "content": text})

    def _end_act(self, row: _Row, terminated: bool, world: WorldSwitch | None):
        fmt, traj = self.fmt, row.traj
        gen_ids = row.ids[row.gen_start:]
        text = self.tok.decode(gen_ids[:-1] if terminated else gen_ids, skip_special_tokens=False)
        parsed = fmt.parse(text, row.task.tools)
        call_index = {}
        for k, item in enumerate(parsed.items):
            if isinstance(item, ToolCall):
                item.turn, item.user_turn = row.turn, row.user_turn
                call_index[k] = len(traj.calls)
                traj.calls.append(item)
                traj.observations.append(None)   # filled when the response is written or executed
                traj.rehearsed.append(None)
            else:
                traj.errors.append(f"{item.kind}: {item.message}")
        traj.messages.append({"role": "assistant", "content": parsed.content, "raw": text,
                              "tool_calls": [{"type": "function", "function": {"name": c.name,
                                              "arguments": c.arguments}} for c in parsed.calls]})
        row.turn += 1
        if not terminated:
            traj.errors.append("truncated_turn: the assistant turn hit max_new_tokens before its end token")
            return row.finish("max_new_tokens")
        if not parsed.items:
            if not parsed.content:
                traj.errors.append("empty_turn: the assistant turn had no text and no tool call")
                return row.finish("empty_turn")
            traj.final_answer = parsed.content
            try:
                reply = row.env.user_turn(parsed.content) if row.env is not None else None
            except Exception as exc:  # a broken user simulator ends this row, not the batch
                traj.errors.append(f"user_error: {type(exc).__name__}: {exc}")
                return row.finish("user_error")
            if reply is None:
                return row.finish("final_answer")
            if row.turn >= self.cfg.max_turns:
                return row.finish("max_turns")
            row.user_turn += 1
            user_msg = {"role": "user", "content": reply}
            if getattr(row.env, "last_user_tool_calls", None):  # tau2 telecom: the user acted on their device
                user_msg["user_tool_calls"] = list(row.env.last_user_tool_calls)
            traj.messages.append(user_msg)
            row.plan.extend([("text", text, Role.PROMPT, trusted) for text, trusted in fmt.user_turn_pieces(reply)])
            row.plan.append(("gen", Role.ACT, None))
            return
        limit = row.task.max_assistant_turns
        if row.turn >= self.cfg.max_turns or (limit is not None and row.turn >= limit):
            return row.finish("max_turns")
        # one response per call item: rehearsed (WORLD), executed (OBS), or an error observation (OBS)
        for kind, value in fmt.tool_turn(len(parsed.items)):
            item = parsed.items[value] if kind == "response" else None
            if kind == "text":
                row.plan.append(("text", value, Role.PROMPT, True))
            elif isinstance(item, CallError):
                row.plan.append(("response", None, item))
            elif world is not None and world(row.index, item):
                row.plan.append(("gen", Role.WORLD, call_index[value]))
            else:
                row.plan.append(("response", call_index[value], None))
        row.plan.append(("gen", Role.ACT, None))

    def _end_world(self, row: _Row, stopped: bool):
        gen_ids = row.ids[row.gen_start:]
        text, on_tag = self.rehearsal_text(gen_ids, stopped)
        defects = validate_rehearsal(text, on_tag)
        row.defects += defects
        self._record_response(row, row.gen_payload, text, rehearsed=True)
        if not on_tag:  # close the response ourselves so the context stays well-formed
            row.traj.errors.append("rehearsal_unterminated: the rehearsed response did not end with its tag")
            row.plan.appendleft(("text", self.fmt.obs_end, Role.PROMPT, True))

    def rehearsal_text(self, gen_ids: list[int], stopped: bool) -> tuple[str, bool]:
        """(the observation a WORLD segment wrote, whether it ended on the closing tag)."""
        on_tag = stopped and self.fmt.ends_with_world_stop(gen_ids)
        text = self.tok.decode(gen_ids if on_tag or not stopped else gen_ids[:-1], skip_special_tokens=False)
        return self.fmt.rehearsed_text(text, on_tag), on_tag

    # -- the generation loop ---------------------------------------------------------------------------

    @torch.no_grad()  # not inference_mode: the returned tensors feed the trainer's autograd
    def run(self, tasks: list[Task], group_size: int = 1, cfg: SamplingConfig | None = None,
            make_env: Callable[[Task], object] | None = None, world: str | WorldSwitch = "rehearse",
            use_cache: bool = True, steer: Steer | None = None, progress=None) -> Rollout:
        """Roll out `group_size` trajectories per task.

        world: "rehearse" (the policy writes every tool response), "real" (the environment executes every
        call), or a callable (row, call) -> bool choosing per call. make_env(task) gives a fresh environment
        per row; it is needed for real calls and for multi-turn user replies.
        use_cache=False re-encodes the whole sequence at every step (the reference the cache is tested against).
        steer(rows, segments, logits) -> logits changes which token is chosen (constrained decoding, scripted
        tests); `segments` holds each row's (role, ids generated so far in this segment). The recorded
        log-probs stay those of the model's own distribution.
        """
        cfg = self.cfg = cfg or SamplingConfig()
        if world == "rehearse":
            world_fn = lambda r, c: True  # noqa: E731
        elif world == "real":
            world_fn = None
        elif callable(world):
            world_fn = world
        else:
            raise ValueError(f"world must be 'rehearse', 'real' or a callable, not {world!r}")
        max_len = min(cfg.max_total_len, getattr(self.model.config, "max_position_embeddings", cfg.max_total_len))
        device = next(self.model.parameters()).device
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        t0 = time.perf_counter()
        stats = {"forward_calls": 0, "tokens_fed": 0, "tokens_sampled": 0}

        prompts = [self.prompt_ids(t) for t in tasks]
        rows = []
        for ti, (task, p) in enumerate(zip(tasks, prompts)):
            for _ in range(group_size):
                env = make_env(task) if make_env is not None else None
                rows.append(_Row(len(rows), ti, task, env, p))
        for row in rows:
            if len(row.ids) >= max_len:
                row.traj.errors.append(f"context_too_long: the prompt has {len(row.ids)} tokens, limit {max_len}")
                row.finish("max_length")

        # prefill each distinct prompt once, then fork its cache for the group
        cache, mask, logits = None, None, None
        active = [r for r in rows if not r.done]
        if active and use_cache:
            live_tasks = sorted({r.task_idx for r in active})
            width = max(len(prompts[i]) for i in live_tasks)
            pad = self.tok.pad_token_id
            ids = torch.full((len(live_tasks), width), pad, dtype=torch.long)
            mask = torch.zeros((len(live_tasks), width), dtype=torch.long)
            for j, i in enumerate(live_tasks):
                ids[j, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[j, width - len(prompts[i]):] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = new_kv_cache()
            out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                             cache=cache, use_cache=True, logits_to_keep=1)
            stats["forward_calls"] += 1
            stats["tokens_fed"] += int(mask.sum())
            # fork: row order is task-major, so select each live row's task slot
            slot = {i: j for j, i in enumerate(live_tasks)}
            pick = torch.tensor([slot[r.task_idx] for r in active], device=device)
            cache.batch_select_indices(pick)
            mask = mask.to(device)[pick]
            logits = out.logits[:, -1].float()[pick]
            for r in active:
                r.n_cached = len(r.ids)

        bar = progress
        while active:
            if not use_cache:  # reference path: re-encode every row's whole sequence (right-padded, no cache)
                width = max(len(r.ids) for r in active)
                ids = torch.full((len(active), width), self.tok.pad_token_id, dtype=torch.long)
                full_mask = torch.zeros((len(active), width), dtype=torch.long)
                for j, r in enumerate(active):
                    ids[j, :len(r.ids)] = torch.tensor(r.ids)
                    full_mask[j, :len(r.ids)] = 1
                all_logits = self.model(input_ids=ids.to(device), attention_mask=full_mask.to(device)).logits
                last = torch.tensor([len(r.ids) - 1 for r in active], device=device)
                logits = all_logits[torch.arange(len(active), device=device), last].float()
                stats["forward_calls"] += 1
                stats["tokens_fed"] += sum(len(r.ids) for r in active)
            steered = None if steer is None else steer(
                [r.index for r in active], [(r.gen_role, r.ids[r.gen_start:]) for r in active], logits.clone())
            tokens, logps = sample(logits, cfg, gen, steered)
            stats["tokens_sampled"] += len(active)
            for r, tok_id, lp in zip(active, tokens.tolist(), logps.tolist()):
                r.append([tok_id], r.gen_role, [lp])
                n_gen = len(r.ids) - r.gen_start
                if r.gen_role == Role.ACT:
                    stopped = tok_id in self.fmt.stop_ids
                    if stopped or n_gen >= cfg.max_new_tokens:
                        self._end_act(r, stopped, world_fn)
                        self._start_next(r)
                else:
                    stopped = tok_id in self.fmt.stop_ids or self.fmt.ends_with_world_stop(r.ids[r.gen_start:])
                    if stopped or n_gen >= cfg.max_world_tokens:
                        self._end_world(r, stopped)
                        self._start_next(r)
                if not r.done and len(r.ids) >= max_len:
                    r.traj.errors.append(f"context_too_long: the trajectory reached max_total_len={max_len}")
                    r.truncate(max_len)
                    r.finish("max_length")
            if bar is not None:
                bar.update(len(active))
            keep = [i for i, r in enumerate(active) if not r.done]
            if len(keep) < len(active) and use_cache and keep:
                idx = torch.tensor(keep, device=device)
                cache.batch_select_indices(idx)
                mask = mask[idx]
            active = [active[i] for i in keep]
            if not active or not use_cache:
                continue
            # feed each row's uncached tokens; chunks are left-padded so the last column is real for all rows
            feeds = [r.feed for r in active]
            ids, chunk_mask, pos = ragged_chunk(feeds, [r.n_cached for r in active], self.tok.pad_token_id)
            mask = torch.cat([mask, chunk_mask.to(device)], dim=1)
            out = self.model(input_ids=ids.to(device), attention_mask=mask, position_ids=pos.to(device),
                             cache=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1].float()
            stats["forward_calls"] += 1
            stats["tokens_fed"] += sum(len(f) for f in feeds)
            for r in active:
                r.n_cached = len(r.ids)

        stats["seconds"] = time.perf_counter() - t0
        return self._collect(rows, stats)

    def _collect(self, rows: list[_Row], stats: dict) -> Rollout:
        width = max(len(r.ids) for r in rows)
        B = len(rows)
        ids = torch.full((B, width), self.tok.pad_token_id, dtype=torch.long)
        roles = torch.zeros((B, width), dtype=torch.long)
        logprobs = torch.zeros((B, width), dtype=torch.float32)
        for b, r in enumerate(rows):
            n = len(r.ids)
            ids[b, :n] = torch.tensor(r.ids)
            roles[b, :n] = torch.tensor(r.roles)
            logprobs[b, :n] = torch.tensor(r.logprobs)
        stats["act_tokens"] = int((roles == Role.ACT).sum())
        stats["world_tokens"] = int((roles == Role.WORLD).sum())
        return Rollout(ids=ids, roles=roles, logprobs=logprobs,
                       lengths=torch.tensor([len(r.ids) for r in rows]), task_index=[r.task_idx for r in rows],
                       spans=[r.spans for r in rows], trajectories=[r.traj for r in rows],
                       end_reasons=[r.traj.end_reason for r in rows], rehearsal_defects=[r.defects for r in rows],
                       stats=stats)


def ragged_chunk(feeds: list[list[int]], offsets: list[int], pad_id: int):
    """Left-pad each row's new tokens into one [B, W] chunk (so the last column is real for every row), with
    its attention-mask columns and explicit positions continuing each row's own count of cached tokens."""
    width = max(len(f) for f in feeds)
    ids = torch.full((len(feeds), width), pad_id, dtype=torch.long)
    chunk_mask = torch.zeros((len(feeds), width), dtype=torch.long)
    pos = torch.zeros((len(feeds), width), dtype=torch.long)
    for j, (f, start) in enumerate(zip(feeds, offsets)):
        ids[j, width - len(f):] = torch.tensor(f)
        chunk_mask[j, width - len(f):] = 1
        pos[j, width - len(f):] = torch.arange(start, start + len(f))
    return ids, chunk_mask, pos


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator, steered: torch.Tensor | None = None):
    """Sample one token per row; return (tokens, log-prob under the temperature-scaled full distribution).

    The recorded log-prob ignores top-p truncation and steering on purpose: it is what the trainer recomputes.
    """
    choose = logits if steered is None else steered
    if cfg.greedy or cfg.temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = choose.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits / cfg.temperature, dim=-1)
    probs = torch.softmax(choose / cfg.temperature, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p > cfg.top_p   # keep the smallest head with mass >= top_p
        sorted_p = sorted_p.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    tokens = torch.multinomial(probs.cpu(), 1, generator=gen)[:, 0].to(logits.device)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


def describe_row(rollout: Rollout, tok, row: int) -> str:
    """The row's text with every span labelled by its role, for reading a trajectory."""
    ids = rollout.ids[row].tolist()
    parts = []
    for s in rollout.spans[row]:
        text = tok.decode(ids[s.start:s.end], skip_special_tokens=False)
        parts.append(f"[{s.role.name} t{s.turn} {s.end - s.start} tok]{text}")
    return "".join(parts) + f"\n[end: {rollout.end_reasons[row]}]"


def model_user_fn(engine: Engine, cfg: SamplingConfig | None = None):
    """A simulated user played by a model through this engine, in its own context (not the agent's).

    Returns user_fn(messages, tools=None) -> str | {"content", "tool_calls"} as bench environments expect:
    the user-simulator chat (its system prompt, the conversation with roles flipped) is rolled out for one
    assistant turn. Each reply prefills the user's context anew; user turns are few and short next to the
    agent's, so the agent's cache is what matters.
    """
    cfg = cfg or SamplingConfig(temperature=0.6, top_p=0.95)
    engine = Engine(engine.model, engine.tok, engine.template_kwargs)   # its own state: it runs while the agent's rollout is paused
    calls = [0]

    def user_fn(messages, tools=None):
        calls[0] += 1
        task = Task(id=f"user-{calls[0]}", messages=messages, tools=tools or [], max_assistant_turns=1)
        run_cfg = SamplingConfig(**{**cfg.__dict__, "seed": cfg.seed + calls[0]})
        traj = engine.run([task], 1, run_cfg, world="real").trajectories[0]
        last = next((m for m in reversed(traj.messages) if m["role"] == "assistant"), {"content": ""})
        if last.get("tool_calls"):
            return {"content": last.get("content", ""), "tool_calls": last["tool_calls"]}
        return last.get("content", "")

    return user_fn


def make_env_fn(bench, user_fn=None):
    """bench.make_env, given the simulated user where the benchmark takes one (tau2, vita)."""
    import inspect
    takes_user = "user_fn" in inspect.signature(bench.make_env).parameters
    if takes_user and user_fn is not None:
        return lambda task: bench.make_env(task, user_fn=user_fn)
    return bench.make_env


ROLE_OF_LABEL = {"prompt": Role.PROMPT, "act": Role.ACT, "world": Role.WORLD, "obs": Role.OBS}


def encode_conversation(engine: Engine, task: Task, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and roles of a finished chat (e.g. a reference trajectory), laid out exactly as a rehearsal
    rollout would: assistant text + eos is ACT, each tool response + its closing tag is WORLD, the rest PROMPT
    (chat_format.encode_conversation)."""
    ids, labels = chat_format.encode_conversation(engine.fmt, task.messages, task.tools, messages)
    return ids, [int(ROLE_OF_LABEL[label]) for label in labels]


def main(argv=None):
    """Demo: roll out the tiny model on a few toy-world tasks and print one trajectory with role labels."""
    import argparse

    import policy
    from bench import load_bench

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--bench", default="toyworld")
    ap.add_argument("--world", default="rehearse", choices=["rehearse", "real"])
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    model, tok = policy.load_policy(args.model)
    bench = load_bench(args.bench)
    tasks = bench.load_tasks("test", limit=2)
    out = Engine(model, tok).run(tasks, args.group_size, SamplingConfig(seed=args.seed, max_new_tokens=64),
                                 make_env=bench.make_env, world=args.world)
    print(describe_row(out, tok, 0))
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.stats.items()})


if __name__ == "__main__":
    main()

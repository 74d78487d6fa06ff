"""Token-in, token-out multi-turn rollouts with a KV cache kept across turns.

One sequence per trajectory holds every token with a role id:

    PROMPT  system/user text and the chat template's scaffolding (the engine writes it)
    ACT     tokens the policy sampled as the agent
    WORLD   tokens the policy sampled while rehearsing a tool's response
    OBS     tokens a real environment returned (and the engine's error observations)

After the policy emits a tool call, the engine appends the template's tool-response opening and then either
lets the same policy write the response (rehearsal, WORLD) or executes the call for real (OBS). The prompt is
prefilled once per task and its cache is forked for the G samples of the group (a long head the tasks' prompts
share, such as a system prompt with its tools, is prefilled once for all); after that each forward pass
feeds only the tokens each row has not cached yet (its last sampled token plus any appended scaffolding or
observation), with ragged per-row lengths handled by an attention mask with holes and explicit positions.
Rows leave the batch as they finish. No turn re-encodes the context.

Token ids are the source of truth: sampled ids are kept as sampled, and only new text (scaffolding,
observations, user turns) is tokenized, as deltas cut at special-token boundaries.
"""
from __future__ import annotations

import copy
import hashlib
import inspect
import json
import time
from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Protocol

import torch
from transformers.cache_utils import Cache, DynamicLayer

import chat_format
import policy
from bench import BENCHES, BenchUnavailable, Task, Trajectory, load_bench
from chat_format import CallError, ChatFormat, ToolCall, derive_chat_format, validate_rehearsal
from cli import OneLineParser, add_template_args, int_at_least


def new_kv_cache():
    """A transformers Cache whose layers write into preallocated buffers (see PreallocatedKVLayer)."""
    return Cache(layer_class_to_replicate=PreallocatedKVLayer)


def kv_buffer(like: torch.Tensor, shape) -> torch.Tensor:
    """An unset buffer for a KV layer (a test fills it with NaN to check no unset value is ever read)."""
    return like.new_empty(shape)


class PreallocatedKVLayer(DynamicLayer):
    """A KV layer that writes new keys/values into a buffer with spare room instead of concatenating.

    DynamicLayer's torch.cat copies the whole cache at every decode step (O(L) per token, ~30-40% of a
    tiny model's step on CPU). Here the buffer has spare columns and spare rows, both grown geometrically,
    so appending tokens or rows is amortised O(new data); `keys`/`values` are views of the filled part
    (`rows` x `length`). Besides transformers' own operations (batch selection, forking, cropping) it
    writes a few rows only (`update_rows`, `put`, `copy_row`) and compacts (`compact`), for KVBatch.
    Buffers are not zeroed when allocated (fresh memory costs a page fault per 4 KiB touched, so room
    never used is never touched): every column below `length` of every row below `rows` is written
    before it is read, holes with zeros, as masked columns must hold finite numbers (a masked NaN still
    poisons attention: 0 * NaN)."""

    def lazy_initialization(self, key_states, value_states):
        """Set up on the first write: unlike DynamicLayer's, no tensor yet (reserve allocates the buffers) and
        `length`/`rows` at 0, with `keys`/`values` empty views."""
        self.device = key_states.device
        self.length = self.rows = 0
        self._k = self._v = None
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self.is_initialized = True

    def _views(self):
        self.keys = self._k[:self.rows, :, :self.length]
        self.values = self._v[:self.rows, :, :self.length]

    def reserve(self, rows, length, like_k, like_v):
        """Room for `rows` rows and `length` columns; what is written stays, new room is unset."""
        if not self.is_initialized:
            self.lazy_initialization(like_k, like_v)
        have_b, have_l = (0, 0) if self._k is None else (self._k.shape[0], self._k.shape[-2])
        if rows <= have_b and length <= have_l:
            return
        # a quarter of spare rows, not more: fresh memory costs a page fault per 4 KiB
        cap_b = rows + rows // 4
        cap_l = have_l if length <= have_l else max(length, 64, 2 * have_l)
        k = kv_buffer(like_k, (cap_b, *like_k.shape[1:-2], cap_l, like_k.shape[-1]))
        v = kv_buffer(like_v, (cap_b, *like_v.shape[1:-2], cap_l, like_v.shape[-1]))
        if self._k is not None and self.rows and self.length:
            k[:self.rows, :, :self.length] = self._k[:self.rows, :, :self.length]
            v[:self.rows, :, :self.length] = self._v[:self.rows, :, :self.length]
        self._k, self._v = k, v

    def update(self, key_states, value_states, *args, **kwargs):
        """DynamicLayer.update without torch.cat: write every row's new columns into the buffer (grown only when
        full) and return views of the filled part."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, n = key_states.shape[0], key_states.shape[-2]
        self.reserve(b, self.length + n, key_states, value_states)
        self.rows = b
        self._k[:b, :, self.length:self.length + n] = key_states
        self._v[:b, :, self.length:self.length + n] = value_states
        self.length += n
        self._views()
        return self.keys, self.values

    def update_rows(self, slots, key_states, value_states):
        """A forward over rows `slots` only: their new columns are written (the other rows get masked
        columns, zero) and their whole cache is returned (a copy of those rows)."""
        n = key_states.shape[-2]
        self.reserve(self.rows, self.length + n, key_states, value_states)
        self._k[:self.rows, :, self.length:self.length + n] = 0
        self._v[:self.rows, :, self.length:self.length + n] = 0
        self._k[slots, :, self.length:self.length + n] = key_states
        self._v[slots, :, self.length:self.length + n] = value_states
        self.length += n
        self._views()
        return self._k[slots, :, :self.length], self._v[slots, :, :self.length]

    def put(self, rows, slots, start, keys, values):
        """Write other caches' rows (e.g. a prefill's) into rows `slots`, ending at our last column (which
        moves right if they are longer: the other rows get zero holes); ours then has `rows` rows."""
        end = start + keys.shape[-2]
        self.reserve(rows, end, keys, values)
        assert end >= self.length, "put rows end at the cache's last column"
        for buf, new in ((self._k, keys), (self._v, values)):
            buf[:rows, :, self.length:end] = 0
            buf[slots, :, :start] = 0
            buf[slots, :, start:end] = new
        self.rows, self.length = rows, end
        self._views()

    def resize_rows(self, rows):
        """Use `rows` rows (new ones are set by the caller: copy_row or put)."""
        if self._k is not None:
            self.reserve(rows, self.length, self._k, self._v)
            self.rows = rows
            self._views()

    def copy_row(self, src, dst):
        """Copy row `src`'s cached columns into row `dst` (a child row forked within the batch)."""
        self._k[dst, :, :self.length] = self._k[src, :, :self.length]
        self._v[dst, :, :self.length] = self._v[src, :, :self.length]

    def compact(self, slots, cols):
        """Keep rows `slots` (in that order) and, in each, the columns cols[i] (a [rows, width] index),
        in the same buffers (their room is kept for the columns to come)."""
        k = self._k[slots[:, None], :, cols].transpose(1, 2)    # [rows, heads, width, dim], a copy
        v = self._v[slots[:, None], :, cols].transpose(1, 2)
        self._k[:k.shape[0], :, :k.shape[-2]] = k
        self._v[:k.shape[0], :, :k.shape[-2]] = v
        self.rows, self.length = k.shape[0], k.shape[-2]
        self._views()

    def get_seq_length(self):
        """The filled columns (`length`), not the buffer's room; 0 before the first update."""
        return self.length if self.is_initialized else 0

    def reset(self):
        """Drop the buffers as well as DynamicLayer's state, so the next update allocates afresh."""
        self._k = self._v = None
        self.length = self.rows = 0
        super().reset()

    def crop(self, tokens_to_remove):
        """DynamicLayer.crop (a negative count only) by moving `length` back: no copy, the buffer keeps its room."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if self.is_initialized and self._k is not None and tokens_to_remove:
            self.length = max(self.length + tokens_to_remove, 0)
            self._views()

    def batch_repeat_interleave(self, repeats):
        """DynamicLayer's, on the buffers: each filled row repeated `repeats` times (new buffers keep the spare
        columns, not spare rows)."""
        if self.get_seq_length() > 0:
            self._k = self._k[:self.rows].repeat_interleave(repeats, dim=0)
            self._v = self._v[:self.rows].repeat_interleave(repeats, dim=0)
            self.rows *= repeats
            self._views()

    def batch_select_indices(self, indices):
        """DynamicLayer's, on the buffers: keep rows `indices` (a copy keeping the spare columns, not spare rows)."""
        if self.get_seq_length() > 0:
            self._k, self._v = self._k[indices, ...], self._v[indices, ...]
            self.rows = self._k.shape[0]
            self._views()

    def __deepcopy__(self, memo):
        twin = copy.copy(self)
        if self._k is not None:
            twin._k, twin._v = self._k.clone(), self._v.clone()
            twin._views()
        return twin


class RowSubsetLayer(DynamicLayer):
    """A forward over some rows of a PreallocatedKVLayer (KVBatch feeds long feeds apart)."""

    def __init__(self, layer, slots):
        super().__init__()
        self.layer, self.slots, self.is_initialized = layer, slots, True

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the new columns of rows `slots` only (update_rows) and return those rows' whole cache."""
        return self.layer.update_rows(self.slots, key_states, value_states)

    def get_seq_length(self):
        """The underlying layer's filled length (all rows share it)."""
        return self.layer.get_seq_length()


def row_subset_cache(cache, slots):
    """A Cache for a forward over rows `slots` of `cache` (new_kv_cache's): it writes their new columns into
    `cache` (the other rows' become masked holes) and reads their whole cache."""
    return Cache(layers=[RowSubsetLayer(layer, slots) for layer in cache.layers])


class Role(IntEnum):
    """A token's role: PAD, PROMPT (prompt, scaffolding, user turns), ACT (sampled assistant tokens), WORLD (a
    tool response the policy rehearsed) or OBS (a real tool response); stored as ints in Rollout.roles."""
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


def role_weights(roles: torch.Tensor, train_roles, weights: dict) -> torch.Tensor:
    """The loss weight of each token: weights[role name] (default 1) where role_mask is True, else 0."""
    out = torch.zeros(roles.shape, dtype=torch.float32, device=roles.device)
    for role in train_roles:
        out = torch.where(roles == int(role), float(weights.get(Role(role).name.lower(), 1.0)), out)
    return out


# ----------------------------------------------------------------------------------------------------------
# Configuration and results


@dataclass
class SamplingConfig:
    """How rollouts sample (temperature, top-p or greedy, seed) and their length limits per turn and trajectory."""
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    max_new_tokens: int = 256        # per assistant turn
    max_world_tokens: int = 128      # per rehearsed tool response
    max_turns: int = 8               # assistant turns per trajectory
    max_total_len: int = 4096        # tokens per trajectory, prompt included
    seed: int = 0
    # a task's own turn limit (single-turn BFCL) ends the episode after its calls; with this on, their responses
    # are still written (rehearsed by the world role, or executed) first: EnvACE training rehearses every call
    respond_at_turn_limit: bool = False


@dataclass
class Span:
    """A run of consecutive tokens [start, end) of one role in one assistant turn of a row."""
    role: Role
    start: int
    end: int          # exclusive
    turn: int


@dataclass
class Rollout:
    """A batch of trajectories as right-padded tensors (ids, roles, sampling log-probs, lengths), with each row's
    task, spans, trajectory, end reason and rehearsal defects, and the run's stats."""
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


ResponseSwitch = Callable[[int, ToolCall], bool]   # (row, call) -> True to rehearse it, False to execute it
Steer = Callable[[list[int], list[tuple[Role, list[int]]], torch.Tensor], torch.Tensor]


def derive_seed(*parts) -> int:
    """A seed from a row's identity (task seed, stream, turn, ...), the same whatever else shares the batch."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "big")


# ----------------------------------------------------------------------------------------------------------
# A row's plan: what happens between two generated segments


@dataclass
class Text:
    """Text the engine appends: scaffolding, an observation, a user turn. Consecutive Texts are encoded as one
    piece (so the ids equal the template's own tokenization); untrusted text never becomes an added token."""
    text: str
    role: Role
    trusted: bool = True


@dataclass
class Response:
    """A real response in a tool turn: call number `call` executed on the row's environment, or `error`'s
    observation (a malformed call). `probed`: the fidelity probe (rehearse.py) has already run for it."""
    call: int | None
    error: CallError | None = None
    probed: bool = False


@dataclass
class Generate:
    """A segment the policy samples. WORLD segments write the response of call number `call`. on_end(row,
    stopped) replaces the engine's own turn transition (test-time rehearsal's private branches)."""
    role: Role
    max_tokens: int
    call: int | None = None
    on_end: Callable | None = None


@dataclass
class Spawn:
    """Fork child rows off this row once its tokens are cached: make(row) -> rows, each starting from this
    row's context (its cache is copied, not recomputed). The row waits; then(row) runs when all have ended."""
    make: Callable
    then: Callable | None = None


class RowHooks(Protocol):
    """What a committed row may be told at its turn transitions (Row.hooks; Engine.advance calls them). The one
    implementation is test-time rehearsal (rehearse.Rehearser); training rows have no hooks. A hook that
    returns a Spawn makes the row wait while the spawned child rows run in the same decode loop (their caches
    fork the row's), then the row continues with the item it was about to apply."""

    def before_turn(self, row: "Row", item: Generate) -> Spawn | None:
        """Before a committed ACT turn is sampled (its context is cached): e.g. B private rehearsals."""

    def before_response(self, row: "Row", item: Response) -> Spawn | None:
        """Before the real environment answers call number item.call: e.g. a discarded world-model probe."""

    def after_response(self, row: "Row", index: int, text: str) -> None:
        """After call number `index` got its real response `text` (compare it with a probe's prediction)."""


class Row:
    """One token sequence being generated: a trajectory, or a private branch of one (rehearse.py)."""

    def __init__(self, task: Task, ids: list[int], env=None, *, index: int = 0, task_idx: int = 0, stream: int = 0,
                 seed: int = 0, bucket: str = "act", counts: dict | None = None, hooks: RowHooks | None = None):
        self.task, self.env, self.index, self.task_idx, self.stream = task, env, index, task_idx, stream
        self.ids = list(ids)
        self.roles = [int(Role.PROMPT)] * len(ids)
        self.logprobs = [0.0] * len(ids)
        self.spans = [Span(Role.PROMPT, 0, len(ids), 0)]
        self.n_cached = 0
        self.plan: deque = deque()         # Text / Response / Generate / Spawn, applied in order
        self.pending: list = []            # Text pieces not yet encoded (encoded together at the next segment)
        self.gen: Generate | None = None   # the segment being sampled
        self.gen_start = len(ids)
        self.turn = self.user_turn = 0
        self.traj = Trajectory(task_id=task.id, messages=[dict(m) for m in task.messages])
        self.defects: list[str] = []
        self.done = False
        self.spawn: Spawn | None = None    # children to fork at the next step
        self.spawn_then: Callable | None = None
        self.waiting = 0                   # children still running
        self.parent: Row | None = None
        self.record: dict = {}             # what a private branch found (rehearse.py)
        self.extra_len = 0                 # tokens allowed past max_total_len (a private memory block)
        self.rng = torch.Generator(device="cpu").manual_seed(seed)
        self.seed, self.bucket = seed, bucket
        self.counts = counts if counts is not None else {}   # tokens fed/sampled per bucket, shared by an episode
        self.hooks = hooks                 # RowHooks: test-time rehearsal's turn transitions (None in training)
        self.slot = -1                     # its row in the batch's KV cache (KVBatch), while it runs
        self.end_after_plan = "plan_exhausted"   # the end reason when its plan runs out

    @property
    def feed(self) -> list[int]:
        """The row's tokens not yet in the KV cache (what the next forward feeds)."""
        return self.ids[self.n_cached:]

    @property
    def ready(self) -> bool:
        """Samples at this step: generating, not waiting, and every token cached (its logits are current)."""
        return self.gen is not None and not self.waiting and not self.done and self.n_cached == len(self.ids)

    def append(self, ids, role, logprobs=None):
        """Append `ids` of one role (their sampling log-probs, else 0), extending the last span if it continues it."""
        if not ids:
            return
        start = len(self.ids)
        self.ids += ids
        self.roles += [int(role)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        last = self.spans[-1] if self.spans else None
        if last is not None and last.role == role and last.end == start and last.turn == self.turn:
            last.end += len(ids)
        else:
            self.spans.append(Span(Role(role), start, start + len(ids), self.turn))

    def append_text(self, fmt: ChatFormat, pieces: list):
        """Append Text pieces, encoded together; each token takes its piece's role."""
        ids, roles = fmt.encode([(p.text, p.role, p.trusted) for p in pieces])
        start = 0
        for k in range(1, len(ids) + 1):
            if k == len(ids) or roles[k] != roles[start]:
                self.append(ids[start:k], roles[start])
                start = k

    def fork(self, stream: int, seed: int, bucket: str) -> "Row":
        """A child that continues from this row's context (its trajectory is not the parent's)."""
        child = Row(self.task, [], self.env, index=self.index, task_idx=self.task_idx, stream=stream, seed=seed,
                    bucket=bucket, counts=self.counts)
        child.ids, child.roles, child.logprobs = list(self.ids), list(self.roles), list(self.logprobs)
        child.spans = [copy.copy(s) for s in self.spans]
        child.n_cached, child.turn, child.user_turn, child.parent = self.n_cached, self.turn, self.user_turn, self
        child.traj = None
        return child

    def truncate(self, n):
        """Cut appended (never sampled-then-cached) tokens past n, e.g. an observation that overflows."""
        del self.ids[n:], self.roles[n:], self.logprobs[n:]
        self.spans = [s for s in self.spans if s.start < n]
        self.spans[-1].end = min(self.spans[-1].end, n)

    def finish(self, reason):
        """End the row: nothing more is sampled; its trajectory (a private branch has none) records `reason`."""
        self.done = True
        self.gen = None
        if self.traj is not None:
            self.traj.end_reason = reason


class Lane:
    """One model's view of a batch: its KV cache, attention mask and each cache row's next-token logits."""

    def __init__(self, model, use_cache: bool):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = new_kv_cache() if use_cache else None
        self.mask = torch.zeros((0, 0), dtype=torch.bool, device=self.device)   # [cache rows, columns]
        self.logits: torch.Tensor | None = None   # [capacity, vocab]; row s: cache row s's latest logits


class KVBatch:
    """The rows being generated and their KV cache, with its attention mask (holes where ragged rows were
    padded) and each row's latest next-token logits.

    Each row holds one cache row (`Row.slot`) for as long as it runs: a fork copies its parent's cache row
    into a free one (the last child takes the parent's own while the parent waits, see `lend`), a row that
    ends frees its own (nothing else moves), and joining rows are prefilled apart (one prefill per distinct
    prompt, or per shared head) and written into free rows. All rows share the cache's columns: a forward
    appends its chunk's columns to every row (masked where a row fed nothing). So the longer feeds (an
    observation, a memory block, re-fed committed tokens) are fed apart, in forwards grouped by length over
    those rows only, and every row's last token in one [rows, 1] forward; when holes or free rows take
    over, the cache is packed (each row's tokens right-aligned, free rows dropped).

    With a world model (another model writing the WORLD segments: a frozen simulator or a separately trained
    world model), each model keeps its own cache of the same token sequence in a lane of its own: every
    token is fed to both, so each reads what the other wrote."""

    def __init__(self, model, pad_id: int, use_cache: bool = True, world_model=None):
        self.pad_id, self.use_cache = pad_id, use_cache
        self.device = next(model.parameters()).device
        self.rows: list[Row] = []
        self.slots = 0                 # cache rows in use, free ones included: every forward covers them
        self.free: list[int] = []      # cache rows no row holds (fed pads until reused or compacted away)
        self.lent: dict[int, tuple] = {}   # id(child) -> (parent, its cached count, its logits) (see lend)
        self.lanes = [Lane(model, use_cache)] + ([Lane(world_model, use_cache)] if world_model is not None else [])
        self.forward_calls = self.tokens_fed = self.compactions = 0

    # -- cache rows ----------------------------------------------------------------------------------------

    def _alloc(self) -> int:
        """The lowest free cache row, else a new one (its content is set by the caller)."""
        if self.free:
            self.free.sort()
            return self.free.pop(0)
        self.slots += 1
        for lane in self.lanes:
            if self.use_cache and lane.cache.layers:
                for layer in lane.cache.layers:
                    layer.resize_rows(self.slots)
            lane.mask = torch.cat([lane.mask, lane.mask.new_zeros((1, lane.mask.shape[1]))])
        return self.slots - 1

    def _logits_room(self, lane: Lane, vocab: int, like: torch.Tensor):
        if lane.logits is None or lane.logits.shape[-1] != vocab:
            lane.logits = like.new_zeros((max(self.slots, 8), vocab))
        elif lane.logits.shape[0] < self.slots:
            grown = lane.logits.new_zeros((max(self.slots, 2 * lane.logits.shape[0]), vocab))
            grown[:lane.logits.shape[0]] = lane.logits
            lane.logits = grown

    def _set_logits(self, lane: Lane, slots: list[int], logits: torch.Tensor):
        self._logits_room(lane, logits.shape[-1], logits)
        lane.logits[slots] = logits

    def fork(self, parent: Row, child: Row):
        """The child continues from the parent's cache row: copied into a free one, nothing recomputed."""
        child.slot = s = self._alloc()
        for lane in self.lanes:
            if self.use_cache:
                for layer in lane.cache.layers:
                    layer.copy_row(parent.slot, s)
                lane.mask[s] = lane.mask[parent.slot]
            if lane.logits is not None:
                self._logits_room(lane, lane.logits.shape[-1], lane.logits)
                lane.logits[s] = lane.logits[parent.slot]

    def lend(self, parent: Row, child: Row):
        """The child takes the parent's cache row while the parent waits for its children: nothing is copied,
        and no row is fed pads for the idle parent. The row goes back to the parent when the child leaves,
        cut back to the parent's tokens (the child only appended to them)."""
        saved = [None if lane.logits is None else lane.logits[parent.slot].clone() for lane in self.lanes]
        self.lent[id(child)] = (parent, parent.n_cached, saved)
        child.slot, parent.slot = parent.slot, -1

    def drop(self, rows: list[Row]):
        """Rows that ended leave: their cache rows are freed (trailing free rows are cut off), or given back
        to the parent that lent them."""
        gone = {id(r) for r in rows}
        self.rows = [r for r in self.rows if id(r) not in gone]
        # lent rows go back first (a parent that ends in the same step as its last child then frees the
        # row it got back; a row lent on again comes back to its lender before going further back)
        lent = [r for r in rows if id(r) in self.lent]
        while lent:
            r = next(r for r in lent if r.slot >= 0)
            lent.remove(r)
            parent, n_cached, saved = self.lent.pop(id(r))
            parent.slot, r.slot = r.slot, -1
            for lane, logits in zip(self.lanes, saved):
                if self.use_cache:   # keep the first n_cached tokens of the row: the parent's
                    mask = lane.mask[parent.slot]
                    lane.mask[parent.slot] = mask & (mask.cumsum(0) <= n_cached)
                if logits is not None:
                    lane.logits[parent.slot] = logits
        for r in rows:
            if r.slot >= 0:
                self.free.append(r.slot)
                r.slot = -1
        free = set(self.free)
        while self.slots and self.slots - 1 in free:
            free.discard(self.slots - 1)
            self.slots -= 1
        self.free = sorted(free)
        for lane in self.lanes:
            lane.mask = lane.mask[:self.slots]
            if self.use_cache:
                for layer in lane.cache.layers:
                    layer.resize_rows(self.slots)

    def _compact_if_sparse(self):
        """Pack the cache once its columns exceed the longest row's tokens by a third (packing costs about
        two decode steps' reads; measured on toy-world B=2 evaluation, a third reads least) or half its rows
        are free: every row's tokens right-aligned to the longest row's count, the rows renumbered in batch
        order, free rows dropped."""
        holders = [r for r in self.rows if r.slot >= 0]     # not the parents whose row is lent
        if not holders or not self.lanes[0].cache.layers:
            return
        width, longest = self.lanes[0].mask.shape[1], max(r.n_cached for r in holders)
        if width <= longest + longest // 3 + 32 and len(self.free) * 2 <= self.slots:
            return
        self.compactions += 1
        slots = torch.tensor([r.slot for r in holders], dtype=torch.long, device=self.device)
        for lane in self.lanes:
            mask = lane.mask[slots.to(lane.device)]
            # a stable sort of each mask row puts its holes first and its tokens after, in order
            keep, cols = torch.sort(mask.to(torch.int8), dim=1, stable=True)
            keep, cols = keep[:, width - longest:].bool(), cols[:, width - longest:]
            for layer in lane.cache.layers:
                layer.compact(slots.to(lane.device), cols)
            lane.mask = keep
            if lane.logits is not None:
                lane.logits = lane.logits[slots.to(lane.device)]
        for j, r in enumerate(holders):
            r.slot = j
        self.slots, self.free = len(holders), []

    @property
    def held(self) -> int:
        """Cache rows in use: what a forward computes over and memory holds (a waiting parent holds none)."""
        return self.slots - len(self.free)

    # -- model calls ---------------------------------------------------------------------------------------

    def logits_for(self, rows: list[Row]) -> torch.Tensor:
        """Next-token logits of `rows`, each from the model that writes its segment's role."""
        out = self.lanes[0].logits[[r.slot for r in rows]]
        if len(self.lanes) > 1:
            world = [k for k, r in enumerate(rows) if r.gen.role == Role.WORLD]
            if world:
                out = out.clone()
                out[world] = self.lanes[1].logits[[rows[k].slot for k in world]].to(out.dtype)
        return out

    def _forward(self, lane: Lane, ids, mask, pos, cache):
        out = lane.model(input_ids=ids.to(lane.device), attention_mask=mask, position_ids=pos.to(lane.device),
                         cache=cache, use_cache=True, logits_to_keep=1)
        self.forward_calls += 1
        return out.logits[:, -1].float()

    def admit(self, rows: list[Row]):
        """Add rows whose tokens are not cached yet; rows with the same prompt share one prefill, written
        into the rows' cache rows right-aligned at the current columns (widened if a prompt is longer).
        When the distinct prompts share a head (a system prompt with the tools), only the head is prefilled,
        once; the rest of each prompt is left uncached, for the next feed."""
        if not rows:
            return
        for r in rows:
            r.slot = self._alloc()
        self.rows += rows
        if not self.use_cache:                 # the reference path re-encodes everything at the next feed
            return
        prompts: dict[tuple, int] = {}
        for r in rows:
            prompts.setdefault(tuple(r.ids), len(prompts))
        heads = [list(p) for p in prompts]
        shared = common_prefix_length(heads)
        if len(heads) > 1 and shared >= 64:    # worth a forward of its own (and the suffixes' own)
            heads, prompts = [heads[0][:shared]], {p: 0 for p in prompts}
        counted = set()
        for r in rows:
            h = prompts[tuple(r.ids)]
            if h not in counted:
                counted.add(h)
                r.counts[f"{r.bucket}_fed"] = r.counts.get(f"{r.bucket}_fed", 0) + len(heads[h])
        for group in length_groups([len(h) for h in heads]):     # prompts of like lengths together
            at = {h: k for k, h in enumerate(group)}
            joining = [r for r in rows if prompts[tuple(r.ids)] in at]
            self._prefill([heads[h] for h in group], joining, [at[prompts[tuple(r.ids)]] for r in joining])
        for r in rows:
            r.n_cached = len(heads[prompts[tuple(r.ids)]])

    def _prefill(self, heads: list[list[int]], rows: list[Row], pick: list[int]):
        """Prefill `heads` apart and write head pick[i] into rows[i]'s cache row, right-aligned at the
        current columns (widened if a head is longer)."""
        ids, mask, pos = ragged_chunk(heads, [0] * len(heads), self.pad_id)
        slots, width = [r.slot for r in rows], ids.shape[1]
        for lane in self.lanes:
            cache = new_kv_cache()
            lane_mask = mask.to(lane.device).bool()
            logits = self._forward(lane, ids, lane_mask, pos, cache)
            have = lane.mask.shape[1]
            if width > have:                   # the other rows get masked columns on the right
                lane.mask = torch.cat([lane.mask, lane.mask.new_zeros((self.slots, width - have))], dim=1)
            start = max(have, width) - width
            lane_pick, lane_slots = torch.tensor(pick, device=lane.device), torch.tensor(slots, device=lane.device)
            while len(lane.cache.layers) < len(cache.layers):
                lane.cache.layers.append(PreallocatedKVLayer())
            for mine, theirs in zip(lane.cache.layers, cache.layers):
                mine.put(self.slots, lane_slots, start, theirs.keys[lane_pick], theirs.values[lane_pick])
            lane.mask[lane_slots] = False
            lane.mask[lane_slots, start:] = lane_mask[lane_pick]
            self._set_logits(lane, slots, logits[lane_pick])
        self.tokens_fed += int(mask.sum())

    def feed(self):
        """Feed every row's uncached tokens: all but the last token of the longer feeds first, over those
        rows only, then every row's last token in one [cache rows, 1] forward per model (rows with none and
        free rows are padded); update the logits of the rows fed."""
        fed = [r for r in self.rows if r.feed]
        if not fed:
            return
        if not self.use_cache:   # reference path: re-encode each row's whole sequence (right-padded, no cache)
            width = max(len(r.ids) for r in fed)
            ids = torch.full((len(fed), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(fed), width), dtype=torch.long)
            for k, r in enumerate(fed):
                ids[k, :len(r.ids)] = torch.tensor(r.ids)
                mask[k, :len(r.ids)] = 1
            last = torch.tensor([len(r.ids) - 1 for r in fed])
            for lane in self.lanes:
                all_logits = lane.model(input_ids=ids.to(lane.device), attention_mask=mask.to(lane.device)).logits
                last_logits = all_logits[torch.arange(len(fed)), last.to(lane.device)].float()
                self._set_logits(lane, [r.slot for r in fed], last_logits)
                self.forward_calls += 1
            for r in fed:
                self.tokens_fed += len(r.ids)
                r.n_cached = len(r.ids)
            return
        self._compact_if_sparse()
        for r in fed:
            r.counts[f"{r.bucket}_fed"] = r.counts.get(f"{r.bucket}_fed", 0) + len(r.feed)
            self.tokens_fed += len(r.feed)
        longer = [r for r in fed if len(r.feed) > 1]
        for group in length_groups([len(r.feed) - 1 for r in longer]):
            self._feed_prefixes([longer[k] for k in group])
        ids = torch.full((self.slots, 1), self.pad_id, dtype=torch.long)
        chunk_mask = torch.zeros((self.slots, 1), dtype=torch.bool)
        pos = torch.zeros((self.slots, 1), dtype=torch.long)
        slots = [r.slot for r in fed]
        ids[slots, 0] = torch.tensor([r.ids[-1] for r in fed])
        chunk_mask[slots, 0] = True
        pos[slots, 0] = torch.tensor([len(r.ids) - 1 for r in fed])
        for lane in self.lanes:
            lane.mask = torch.cat([lane.mask, chunk_mask.to(lane.device)], dim=1)
            logits = self._forward(lane, ids, lane.mask, pos, lane.cache)
            self._set_logits(lane, slots, logits[slots])
        for r in fed:
            r.n_cached = len(r.ids)

    def _feed_prefixes(self, rows: list[Row]):
        """Cache all but the last uncached token of `rows`: over those rows only when they are few (their cache
        rows are read as a copy; the others get masked columns), else over every cache row."""
        feeds = [r.feed[:-1] for r in rows]
        ids, chunk_mask, pos = ragged_chunk(feeds, [r.n_cached for r in rows], self.pad_id)
        chunk_mask = chunk_mask.bool()
        slots = [r.slot for r in rows]
        few = 2 * len(rows) < self.slots
        if not few:        # the whole cache: the other rows are fed pads
            full_ids = torch.full((self.slots, ids.shape[1]), self.pad_id, dtype=torch.long)
            full_mask = torch.zeros((self.slots, ids.shape[1]), dtype=torch.bool)
            full_pos = torch.zeros((self.slots, ids.shape[1]), dtype=torch.long)
            full_ids[slots], full_mask[slots], full_pos[slots] = ids, chunk_mask, pos
            ids, chunk_mask, pos = full_ids, full_mask, full_pos
        for lane in self.lanes:
            idx = torch.tensor(slots, dtype=torch.long, device=lane.device)
            if few:
                grown = torch.cat([lane.mask, lane.mask.new_zeros((self.slots, ids.shape[1]))], dim=1)
                grown[idx, lane.mask.shape[1]:] = chunk_mask.to(lane.device)
                self._forward(lane, ids, grown[idx], pos, row_subset_cache(lane.cache, idx))
                lane.mask = grown
            else:
                lane.mask = torch.cat([lane.mask, chunk_mask.to(lane.device)], dim=1)
                self._forward(lane, ids, lane.mask, pos, lane.cache)
        for r, f in zip(rows, feeds):
            r.n_cached += len(f)


class Engine:
    """Holds the model, tokenizer and the chat format derived from its template; `run` does the rollouts.

    One decode loop (`decode`) serves training rollouts, test-time rehearsal and evaluation: it feeds every
    row's uncached tokens in one forward, forks rows that asked to spawn children, samples every ready row,
    applies each ended segment's turn transition, and lets finished rows leave and new ones join."""

    def __init__(self, model, tok, template_kwargs: dict | None = None, call_format: str | None = None):
        """template_kwargs: extra variables for the chat template, e.g. {"enable_thinking": False} (Qwen3).
        call_format: a tool-call format name (chat_format.CALL_FORMATS); None infers it from the template."""
        self.model, self.tok = model, tok
        self.template_kwargs = dict(template_kwargs or {})
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        stop_ids = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        self.fmt: ChatFormat = derive_chat_format(tok, self.template_kwargs, call_format, stop_ids)
        self.memory_budget: int | None = None   # bytes for KV-cache rows; None: memory_budget_bytes()

    def prompt_ids(self, task: Task) -> list[int]:
        """A task's prompt ids (messages and tools) as the chat template encodes them, generation prompt included."""
        return self.fmt.prompt_ids(task.messages, task.tools)

    def max_len(self, cfg: SamplingConfig) -> int:
        """The most tokens a row may hold: cfg.max_total_len, capped by the model's max_position_embeddings."""
        return min(cfg.max_total_len, getattr(self.model.config, "max_position_embeddings", cfg.max_total_len))

    def rows_that_fit(self, cfg: SamplingConfig, budget_bytes: int | None = None) -> int:
        """How many KV-cache rows one batch may hold (memory_rows with this engine's model and limits)."""
        return memory_rows(self.model, self.max_len(cfg), budget_bytes)

    # -- turn transitions ----------------------------------------------------------------------------------

    def advance(self, row: Row):
        """Apply plan items until the next generated segment or spawn; an empty plan ends the row. Text
        between two segments is encoded in one piece, so the ids equal the template's own tokenization."""
        fmt, hooks = self.fmt, row.hooks
        while row.plan:
            item = row.plan.popleft()
            if isinstance(item, Text):
                row.pending.append(item)
            elif isinstance(item, Response):
                if item.call is not None and hooks is not None and not item.probed:
                    spawn = hooks.before_response(row, item)
                    if spawn is not None:          # a discarded probe first; the response is applied after it
                        item.probed = True
                        row.plan.appendleft(item)
                        row.spawn = spawn
                        return
                if item.call is None:
                    text = item.error.observation()
                    row.traj.messages.append({"role": "tool", "content": text})
                else:
                    text = self.execute_call(row, row.traj.calls[item.call])
                    self.record_response(row, item.call, text, rehearsed=False)
                    if hooks is not None:
                        hooks.after_response(row, item.call, text)
                row.pending += [Text(fmt.response_text(text), Role.OBS, False), Text(fmt.obs_end, Role.PROMPT)]
            elif isinstance(item, Spawn):
                row.spawn = item
                return
            else:
                row.append_text(fmt, row.pending)
                row.pending = []
                if item.role == Role.ACT and item.on_end is None and hooks is not None:
                    spawn = hooks.before_turn(row, item)
                    if spawn is not None:          # private rehearsals, then the committed turn
                        row.spawn = spawn
                        return
                row.gen, row.gen_start = item, len(row.ids)
                return
        row.append_text(fmt, row.pending)
        row.pending = []
        if not row.done:
            row.finish(row.end_after_plan)

    def execute_call(self, row: Row, call: ToolCall) -> str:
        """Run a call on the row's real environment and return its response; a missing environment or an
        exception becomes a JSON error observation instead of failing the batch."""
        if row.env is None:
            return json.dumps({"error": "no environment: a call was to be executed for real but the rollout "
                                        "was given no make_env"})
        try:
            return str(row.env.step(call.name, call.arguments))
        except Exception as exc:  # an environment bug becomes an observation, not a dead batch
            return json.dumps({"error": f"environment raised {type(exc).__name__}: {exc}"})

    def record_response(self, row: Row, index: int, text: str, rehearsed: bool):
        """Record call number `index`'s response in the row's trajectory: observation, rehearsed flag, tool message."""
        row.traj.observations[index] = text
        row.traj.rehearsed[index] = rehearsed
        row.traj.messages.append({"role": "tool", "name": row.traj.calls[index].name, "content": text})

    def end_act(self, row: Row, terminated: bool, cfg: SamplingConfig, rehearse: ResponseSwitch | None):
        """An assistant turn ended: parse it, record it, and plan what follows (tool turn, user turn, end)."""
        fmt, traj = self.fmt, row.traj
        gen_ids = row.ids[row.gen_start:]
        row.gen = None
        text = self.tok.decode(gen_ids[:-1] if terminated else gen_ids, skip_special_tokens=False)
        parsed = fmt.parse(text, current_tools(row))
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
                              "call_format": fmt.call_format,
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
            if ending := env_ending(row):   # the benchmark's own limit (tau2's Orchestrator), before the user answers
                return row.finish(ending)
            try:
                reply = row.env.user_turn(parsed.content) if row.env is not None else None
            except Exception as exc:  # a broken user simulator ends this row, not the batch
                traj.errors.append(f"user_error: {type(exc).__name__}: {exc}")
                return row.finish("user_error")
            if reply is None:
                if getattr(row.env, "last_user_tool_calls", None):   # tau2 telecom: the user acted, then stopped
                    traj.messages.append({"role": "user", "content": getattr(row.env, "last_user_text", ""),
                                          "user_tool_calls": list(row.env.last_user_tool_calls)})
                return row.finish("final_answer")
            if row.turn >= cfg.max_turns:
                return row.finish("max_turns")
            row.user_turn += 1
            user_msg = {"role": "user", "content": reply}
            if getattr(row.env, "last_user_tool_calls", None):  # tau2 telecom: the user acted on their device
                user_msg["user_tool_calls"] = list(row.env.last_user_tool_calls)
            traj.messages.append(user_msg)
            if ending := env_ending(row):
                return row.finish(ending)
            row.plan.extend(Text(text, Role.PROMPT, trusted) for text, trusted in fmt.user_turn_pieces(reply))
            row.plan.append(Generate(Role.ACT, cfg.max_new_tokens))
            return
        if ending := env_ending(row):   # e.g. tau2: this message's calls make the 10th tool error
            return row.finish(ending)
        limit = row.task.max_assistant_turns
        at_task_limit = limit is not None and row.turn >= limit
        if row.turn >= cfg.max_turns or (at_task_limit and not cfg.respond_at_turn_limit):
            return row.finish("max_turns")
        # one response per call item: rehearsed (WORLD), executed (OBS), or an error observation (OBS)
        for kind, value in fmt.tool_turn(len(parsed.items)):
            item = parsed.items[value] if kind == "response" else None
            if kind == "text":
                row.plan.append(Text(value, Role.PROMPT))
            elif isinstance(item, CallError):
                row.plan.append(Response(None, item))
            elif rehearse is not None and rehearse(row.index, item):
                row.plan.append(Generate(Role.WORLD, cfg.max_world_tokens, call=call_index[value]))
            else:
                row.plan.append(Response(call_index[value]))
        if at_task_limit:            # respond_at_turn_limit: the responses, then the end
            row.end_after_plan = "max_turns"
        else:
            row.plan.append(Generate(Role.ACT, cfg.max_new_tokens))

    def end_world(self, row: Row, stopped: bool):
        """A rehearsed response ended: record what the policy wrote; close it if it did not."""
        text, on_tag = self.rehearsal_text(row.ids[row.gen_start:], stopped)
        index, row.gen = row.gen.call, None
        row.defects += validate_rehearsal(text, on_tag)
        self.record_response(row, index, text, rehearsed=True)
        if not on_tag:  # close the response ourselves so the context stays well-formed
            row.traj.errors.append("rehearsal_unterminated: the rehearsed response did not end with its tag")
            row.plan.appendleft(Text(self.fmt.obs_end, Role.PROMPT))

    def rehearsal_text(self, gen_ids: list[int], stopped: bool) -> tuple[str, bool]:
        """(the observation a WORLD segment wrote, whether it ended on the closing tag)."""
        on_tag = stopped and self.fmt.ends_with_world_stop(gen_ids)
        text = self.tok.decode(gen_ids if on_tag or not stopped else gen_ids[:-1], skip_special_tokens=False)
        return self.fmt.rehearsed_text(text, on_tag), on_tag

    # -- the decode loop -----------------------------------------------------------------------------------

    def decode(self, batch: KVBatch, cfg: SamplingConfig, rehearse: ResponseSwitch | None = None,
               steer: Steer | None = None, admit: Callable[[int], list[Row]] | None = None, progress=None):
        """Generate until every row has ended. admit(n) -> new rows joins rows in as others leave; n is the
        number of cache rows in use (KVBatch.held)."""
        max_len = self._max_len = self.max_len(cfg)
        while True:
            t_step = time.perf_counter()
            if admit is not None:
                joining = admit(batch.held)
                for r in joining:
                    self._check_length(r, max_len, joining=True)
                batch.admit([r for r in joining if not r.done])
            if not batch.rows:
                return
            work = {id(r): len(r.feed) for r in batch.rows}    # tokens each row costs this step, for timing
            batch.feed()
            self._spawn(batch)
            ready = [r for r in batch.rows if r.ready]
            if ready:
                logits = batch.logits_for(ready)
                steered = None if steer is None else steer(
                    [r.stream for r in ready], [(r.gen.role, r.ids[r.gen_start:]) for r in ready], logits.clone())
                tokens, logps = sample_rows(logits, cfg, [r.rng for r in ready], steered)
                for r, tok_id, lp in zip(ready, tokens, logps):
                    r.counts[f"{r.bucket}_sampled"] = r.counts.get(f"{r.bucket}_sampled", 0) + 1
                    r.append([tok_id], r.gen.role, [lp])
                    self._after_token(r, tok_id, cfg, rehearse, max_len)
                if progress is not None:
                    progress.update(len(ready))
            for r in ready:
                work[id(r)] = work.get(id(r), 0) + 1
            self._attribute_time(batch.rows, work, time.perf_counter() - t_step)
            batch.drop([r for r in batch.rows if r.done])

    @staticmethod
    def _attribute_time(rows: list[Row], work: dict, seconds: float):
        """Split a step's wall time over the rows by the tokens each fed or sampled (per-bucket cost)."""
        total = sum(work.get(id(r), 0) for r in rows)
        for r in rows:
            if total and work.get(id(r)):
                key = f"{r.bucket}_seconds"
                r.counts[key] = r.counts.get(key, 0.0) + seconds * work[id(r)] / total

    def _after_token(self, r: Row, tok_id: int, cfg: SamplingConfig, rehearse, max_len: int):
        gen, n_gen = r.gen, len(r.ids) - r.gen_start
        if gen.role == Role.WORLD:
            stopped = tok_id in self.fmt.stop_ids or self.fmt.ends_with_world_stop(r.ids[r.gen_start:])
        else:
            stopped = tok_id in self.fmt.stop_ids
        too_long = len(r.ids) >= max_len + r.extra_len     # a private segment still reports what it wrote
        if stopped or n_gen >= gen.max_tokens or (too_long and gen.on_end is not None):
            if gen.on_end is not None:
                r.gen = None
                gen.on_end(r, stopped)
            elif gen.role == Role.ACT:
                self.end_act(r, stopped, cfg, rehearse)
            else:
                self.end_world(r, stopped)
            if not r.done:
                self.advance(r)
        self._check_length(r, max_len)
        if r.done:
            self._ended(r)

    def _check_length(self, r: Row, max_len: int, joining: bool = False):
        max_len += r.extra_len
        if not r.done and len(r.ids) >= max_len:
            if r.traj is not None:
                r.traj.errors.append(f"context_too_long: the prompt has {len(r.ids)} tokens, limit {max_len}"
                                     if joining else
                                     f"context_too_long: the trajectory reached max_total_len={max_len}")
            if not joining:
                r.truncate(max_len)
            r.plan.clear()
            r.finish("max_length")

    def _ended(self, r: Row):
        """A row finished: a waiting parent resumes once its last child has ended."""
        parent = r.parent
        if parent is None:
            return
        parent.waiting -= 1
        if parent.waiting == 0:
            self._resume(parent)

    def _resume(self, row: Row):
        """Children ended (or none were made): run the spawn's continuation, then the row's plan."""
        then, row.spawn_then = row.spawn_then, None
        if then is not None:
            then(row)
        if not row.done and row.gen is None and row.spawn is None:
            self.advance(row)
        self._check_length(row, self._max_len)
        if row.done:
            self._ended(row)

    def _spawn(self, batch: KVBatch):
        rows = []
        for r in batch.rows:
            rows.append(r)
            if r.spawn is None or r.feed:
                continue
            spawn, r.spawn = r.spawn, None
            children = spawn.make(r)
            r.spawn_then = spawn.then
            r.waiting = len(children)
            for child in children:
                child.parent = r
                rows.append(child)
                if child is not children[-1]:
                    batch.fork(r, child)       # a copy of the parent's cache row
            if children:
                batch.lend(r, children[-1])    # the parent's own, while it waits
            if not children:
                self._resume(r)
        if len(rows) != len(batch.rows):
            batch.rows = rows
            for child in rows:
                if child.parent is not None and child.gen is None and child.spawn is None and not child.done:
                    self.advance(child)

    # -- training rollouts -----------------------------------------------------------------------------------

    @torch.no_grad()  # not inference_mode: the returned tensors feed the trainer's autograd
    def run(self, tasks: list[Task], group_size: int = 1, cfg: SamplingConfig | None = None,
            make_env: Callable[[Task], object] | None = None, responses: str | ResponseSwitch = "rehearse",
            use_cache: bool = True, steer: Steer | None = None, progress=None, world_model=None) -> Rollout:
        """Roll out `group_size` trajectories per task.

        responses: "rehearse" (the policy writes every tool response), "real" (the environment executes every
        call), or a callable (row, call) -> bool choosing per call. make_env(task) gives a fresh environment
        per row; it is needed for real calls and for multi-turn user replies.
        use_cache=False re-encodes the whole sequence at every step (the reference the cache is tested against).
        steer(rows, segments, logits) -> logits changes which token is chosen (constrained decoding, scripted
        tests); `segments` holds each row's (role, ids generated so far in this segment). The recorded
        log-probs stay those of the model's own distribution. Row i samples with its own generator seeded
        from (cfg.seed, i), so a row's tokens do not depend on which rows share its batch.
        world_model: another model writes the WORLD segments (a frozen simulator, or a world model trained
        apart); it keeps its own cache of the same sequence, and each token's log-prob is recorded from the
        model that sampled it.
        """
        cfg = cfg or SamplingConfig()
        if responses == "rehearse":
            rehearse = lambda r, c: True  # noqa: E731
        elif responses == "real":
            rehearse = None
        elif callable(responses):
            rehearse = responses
        else:
            raise ValueError(f"responses must be 'rehearse', 'real' or a callable, not {responses!r}")
        t0 = time.perf_counter()
        rows = []
        for ti, task in enumerate(tasks):
            prompt = self.prompt_ids(task)
            for _ in range(group_size):
                env = make_env(task) if make_env is not None else None
                i = len(rows)
                row = Row(task, prompt, env, index=i, task_idx=ti, stream=i,
                          seed=cfg.seed if i == 0 else derive_seed(cfg.seed, i))
                row.plan.append(Generate(Role.ACT, cfg.max_new_tokens))
                rows.append(row)
        for r in rows:
            self.advance(r)
        batch = KVBatch(self.model, self.tok.pad_token_id, use_cache, world_model)
        queue = deque(rows)
        cap = self.rows_that_fit(cfg, self.memory_budget)   # rows beyond it join as others finish

        def admit(n_rows):
            return [queue.popleft() for _ in range(min(len(queue), max(cap - n_rows, 0 if n_rows else 1)))]
        self.decode(batch, cfg, rehearse, steer, admit=admit, progress=progress)
        stats = {"forward_calls": batch.forward_calls, "tokens_fed": batch.tokens_fed,
                 "tokens_sampled": sum(r.counts.get("act_sampled", 0) for r in rows),
                 "seconds": time.perf_counter() - t0}
        return self.collect(rows, stats)

    def collect(self, rows: list[Row], stats: dict) -> Rollout:
        """Pack ended rows into a Rollout (ids, roles, log-probs right-padded to the longest row); adds the ACT and
        WORLD token counts to `stats`."""
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


def common_prefix_length(seqs: list[list[int]]) -> int:
    """How many leading tokens all `seqs` share."""
    n = min(len(s) for s in seqs)
    for s in seqs[1:]:
        k = 0
        while k < n and s[k] == seqs[0][k]:
            k += 1
        n = k
    return n


def length_groups(lengths: list[int], overhead: int = 16) -> list[list[int]]:
    """Split ragged feeds into forwards so that padding costs little: their indices, longest feed first, cut
    into runs that minimise the positions fed (a run's rows x its longest feed) plus `overhead` positions per
    forward (a forward's fixed cost)."""
    order = sorted(range(len(lengths)), key=lambda k: -lengths[k])
    best, cut = [0] + [None] * len(order), [0] * (len(order) + 1)
    for i in range(1, len(order) + 1):
        for j in range(i):
            cost = best[j] + (i - j) * lengths[order[j]] + overhead
            if best[i] is None or cost < best[i]:
                best[i], cut[i] = cost, j
    groups, i = [], len(order)
    while i:
        groups.append(order[cut[i]:i])
        i = cut[i]
    return groups[::-1]


def ragged_chunk(feeds: list[list[int]], offsets: list[int], pad_id: int):
    """Left-pad each row's new tokens into one [B, W] chunk (so the last column is real for every row), with
    its attention-mask columns and explicit positions continuing each row's own count of cached tokens."""
    width = max(1, max(len(f) for f in feeds))
    ids = torch.full((len(feeds), width), pad_id, dtype=torch.long)
    chunk_mask = torch.zeros((len(feeds), width), dtype=torch.long)
    pos = torch.zeros((len(feeds), width), dtype=torch.long)
    for j, (f, start) in enumerate(zip(feeds, offsets)):
        if not f:
            continue
        ids[j, width - len(f):] = torch.tensor(f)
        chunk_mask[j, width - len(f):] = 1
        pos[j, width - len(f):] = torch.arange(start, start + len(f))
    return ids, chunk_mask, pos


def sample_rows(logits: torch.Tensor, cfg: SamplingConfig, gens: list[torch.Generator],
                steered: torch.Tensor | None = None, on_device: bool = False) -> tuple[list[int], list[float]]:
    """Sample one token per row ([rows, vocab] logits), row k with its own generator gens[k]; return the tokens
    and their log-probs under the temperature-scaled full distribution. The recorded log-prob ignores top-p
    truncation and steering on purpose: it is what the trainer recomputes. The softmaxes and the top-p cut
    run over all rows at once (each row's numbers are those of the row alone); only the draws are per row.
    On CPU a draw is torch.multinomial with the row's generator; on a GPU (or on_device=True) it is
    inverse_cdf_draw, so the distribution never leaves the device."""
    choose = logits if steered is None else steered
    if cfg.greedy or cfg.temperature <= 0:
        tokens = choose.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
    else:
        logp = torch.log_softmax(logits / cfg.temperature, dim=-1)
        probs = torch.softmax(choose / cfg.temperature, dim=-1)
        if cfg.top_p < 1.0:
            probs = top_p_cut(probs, cfg.top_p)
        if probs.device.type == "cpu" and not on_device:
            tokens = torch.tensor([int(torch.multinomial(probs[k], 1, generator=g)[0]) for k, g in enumerate(gens)])
        else:
            tokens = inverse_cdf_draw(probs, gens)
    return tokens.tolist(), logp.gather(-1, tokens[:, None])[:, 0].tolist()


def inverse_cdf_draw(probs: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
    """One token per row where the probabilities live (a GPU): row k's uniform comes from its own generator
    (a scalar, so rows stay independent of each other), the search runs on all rows at once. What crosses to
    the host per step is [rows] uniforms in and [rows] tokens out, never the [rows, vocab] distribution."""
    u = torch.tensor([float(torch.rand((), generator=g, dtype=torch.float64)) for g in gens], dtype=torch.float64)
    cdf = probs.double().cumsum(-1)                                            # [rows, vocab]
    target = (u.to(probs.device) * cdf[:, -1])[:, None]                        # unnormalised rows (top-p cut)
    tokens = torch.searchsorted(cdf, target, right=True)[:, 0]
    # a draw on a zero-probability tail token (float ties at the top) falls back to the last token with mass
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(tokens, last)


def top_p_cut(probs: torch.Tensor, top_p: float, head: int = 64) -> torch.Tensor:
    """Zero each row's tail beyond the smallest head of mass >= top_p (rows sorted by probability). The head
    is looked for among the `head` largest first (sorting many whole rows costs more than sampling them); a
    row whose head is longer is sorted whole, alone (so a row's result never depends on the other rows)."""
    def cut(vals, order, like):
        outside = vals.cumsum(-1) - vals > top_p    # keep the smallest head with mass >= top_p
        return torch.zeros_like(like).scatter(-1, order, vals.masked_fill(outside, 0.0)), outside
    out, outside = cut(*probs.topk(min(head, probs.shape[-1]), dim=-1), probs)   # sorted, largest first
    if outside.shape[-1] < probs.shape[-1]:
        for k in (~outside[:, -1]).nonzero().flatten().tolist():
            out[k] = cut(*probs[k].sort(descending=True), probs[k])[0]
    return out


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
    engine = Engine(engine.model, engine.tok, engine.template_kwargs)   # own state: runs while the agent's pauses
    calls = [0]

    def user_fn(messages, tools=None):
        calls[0] += 1
        task = Task(id=f"user-{calls[0]}", messages=messages, tools=tools or [], max_assistant_turns=1)
        run_cfg = SamplingConfig(**{**cfg.__dict__, "seed": cfg.seed + calls[0]})
        traj = engine.run([task], 1, run_cfg, responses="real").trajectories[0]
        last = next((m for m in reversed(traj.messages) if m["role"] == "assistant"), {"content": ""})
        if last.get("tool_calls"):
            return {"content": last.get("content", ""), "tool_calls": last["tool_calls"]}
        return last.get("content", "")

    return user_fn


def kv_bytes_per_token(model) -> int:
    """Bytes one token's keys and values take in the cache, over all layers (the cache keeps the compute dtype)."""
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dtype = next(model.parameters()).dtype      # the weights' dtype: under bf16 autocast an overestimate, safe
    return 2 * c.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8


def memory_budget_bytes(device: torch.device | None = None, fraction: float = 0.5) -> int:
    """The default budget for KV-cache rows: `fraction` of the memory free now (MemAvailable on CPU, the
    device's free memory on a GPU), leaving the rest to weights, activations and the prefill's transients."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * fraction)
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = 8 << 30
    return int(avail * fraction)


def memory_rows(model, max_len: int, budget_bytes: int | None = None) -> int:
    """The rule: rows = budget / (max_len x KV bytes per token x 2 + vocab x 4), at least 1. Every cache row is
    as wide as the longest row (right-aligned), so a row is budgeted at the full length it may reach; x 2 for
    the cache's growth copies and the attention over it; plus its float32 logits row."""
    return max(1, int(model_budget_bytes(model, budget_bytes) // memory_row_bytes(model, max_len)))


def model_budget_bytes(model, budget_bytes: int | None = None) -> int:
    """The memory budget for a model's cache rows: budget_bytes, or by default half the memory free on its device."""
    return memory_budget_bytes(next(model.parameters()).device) if budget_bytes is None else budget_bytes


def memory_row_bytes(model, max_len: int) -> int:
    """What memory_rows budgets for one row of up to max_len tokens."""
    return 2 * max_len * kv_bytes_per_token(model) + 4 * model.config.vocab_size


def current_tools(row) -> list[dict]:
    """The tools a row's calls are parsed against: its environment's list where it keeps one (BFCL miss_func
    adds the held-out function at a later user turn, announced in that user message), else the task's."""
    tools = getattr(row.env, "tools", None) if row.env is not None else None
    return tools if isinstance(tools, list) and tools else row.task.tools


def env_ending(row) -> str | None:
    """The reason a row's environment ends the episode now, from the trajectory so far (`env.ending(traj)`,
    e.g. tau2's Orchestrator limits: "too_many_errors", "max_steps"), or None; environments without it never do."""
    ending = getattr(row.env, "ending", None) if row.env is not None and row.traj is not None else None
    return ending(row.traj) if callable(ending) else None


def make_env_fn(bench, user_fn=None):
    """bench.make_env, given the simulated user where the benchmark takes one (tau2, vita)."""
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


def load_engine(name: str, chat_template: str | None = None, template_kwargs: dict | None = None,
                call_format: str | None = None, **load_kwargs) -> Engine:
    """policy.load_policy + Engine; template_kwargs None means the checkpoint's saved ones.
    Raises policy.PolicyLoadError or chat_format.TemplateError, each a one-line message naming the fix."""
    model, tok = policy.load_policy(name, chat_template=chat_template, **load_kwargs)
    return Engine(model, tok, policy.template_kwargs_for(name, template_kwargs), call_format or None)


def main(argv=None) -> int:
    """Demo: roll out a model (default: the tiny one) on a few tasks and print one trajectory with role labels."""
    ap = OneLineParser(prog="rollout.py", description=main.__doc__)
    ap.add_argument("--model", default="tiny", help="'tiny', a local HF folder or a .gguf file")
    add_template_args(ap)
    ap.add_argument("--bench", default="toyworld", choices=list(BENCHES))
    ap.add_argument("--env", default="rehearse", choices=["rehearse", "real"],
                    help="who writes tool responses, as train.py's --env: the policy's world role (rehearse) or "
                         "the environment (real)")
    ap.add_argument("--group-size", type=int_at_least(1), default=2)
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        bench = load_bench(args.bench)
        tasks = bench.load_tasks("test", limit=2)
        engine = load_engine(args.model, args.chat_template, args.chat_template_kwargs, args.tool_call_format)
    except (policy.PolicyLoadError, chat_format.TemplateError, BenchUnavailable, ImportError) as exc:
        ap.error(str(exc))
    cfg = SamplingConfig(seed=args.seed, max_new_tokens=args.max_new_tokens)
    out = engine.run(tasks, args.group_size, cfg, make_env=make_env_fn(bench), responses=args.env)
    print(describe_row(out, engine.tok, 0))
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.stats.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The KV-cache machinery of batched, ragged, multi-turn decoding: no project imports.

    PreallocatedKVLayer  a transformers cache layer writing into buffers reserved ahead ([rows, heads, cols, dim])
    RowSubsetLayer       a forward over some cache rows only, writing their new columns in place
    Lane / KVBatch       one model's cache, attention mask [rows, cols] and next-token logits [rows, vocab];
                         the rows being decoded, forked, fed and dropped
    length_groups, ragged_chunk, common_prefix_length   how uneven feeds become few forwards
    memory_rows ...      how many cache rows fit a memory budget
    rss_bytes, peak_rss_bytes, reset_peak_rss   what the process holds, to check a run against its budget

A row is any object with the fields of `CachedRow`; rollout.Row is the one the engine uses.
"""
from __future__ import annotations

import copy
import os
import resource
from typing import Protocol

import torch
from transformers.cache_utils import Cache, DynamicLayer


class CachedRow(Protocol):
    """What the cache asks of a row. ids: every token so far; n_cached: how many of them are in the cache;
    slot: its cache row (-1 while it holds none); feed: the tokens to feed next; counts: a dict the cache adds
    its fed-token count to, under the key f"{bucket}_fed"; on_world_lane: whether a separate world model writes its next tokens."""
    ids: list[int]
    n_cached: int
    slot: int
    feed: list[int]
    counts: dict
    bucket: str
    on_world_lane: bool


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

    Each row holds one cache row (`row.slot`) for as long as it runs: a fork copies its parent's cache row
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
        self.rows: list[CachedRow] = []
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

    def fork(self, parent: CachedRow, child: CachedRow):
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

    def lend(self, parent: CachedRow, child: CachedRow):
        """The child takes the parent's cache row while the parent waits for its children: nothing is copied,
        and no row is fed pads for the idle parent. The row goes back to the parent when the child leaves,
        cut back to the parent's tokens (the child only appended to them)."""
        saved = [None if lane.logits is None else lane.logits[parent.slot].clone() for lane in self.lanes]
        self.lent[id(child)] = (parent, parent.n_cached, saved)
        child.slot, parent.slot = parent.slot, -1

    def drop(self, rows: list[CachedRow]):
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

    def logits_for(self, rows: list[CachedRow]) -> torch.Tensor:
        """Next-token logits of `rows`, each from the model that writes its segment's role."""
        out = self.lanes[0].logits[[r.slot for r in rows]]
        if len(self.lanes) > 1:
            world = [k for k, r in enumerate(rows) if r.on_world_lane]
            if world:
                out = out.clone()
                out[world] = self.lanes[1].logits[[rows[k].slot for k in world]].to(out.dtype)
        return out

    def _forward(self, lane: Lane, ids, mask, pos, cache):
        out = lane.model(input_ids=ids.to(lane.device), attention_mask=mask, position_ids=pos.to(lane.device),
                         cache=cache, use_cache=True, logits_to_keep=1)
        self.forward_calls += 1
        return out.logits[:, -1].float()

    def admit(self, rows: list[CachedRow]):
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

    def _prefill(self, heads: list[list[int]], rows: list[CachedRow], pick: list[int]):
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

    def _feed_prefixes(self, rows: list[CachedRow]):
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


def rss_bytes() -> int:
    """The resident memory of this process now (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark to the current RSS (clear_refs 5); False where /proc refuses. Without
    it the peak starts at the parent's: a subprocess inherits ru_maxrss through fork+exec."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The most resident memory this process has held: VmHWM (resettable) where /proc has it, else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

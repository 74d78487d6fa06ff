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

The cache itself (preallocated layers, forks, ragged feeds, memory budget) is kvbatch.py; this module holds the
turns: rows, their generation segments, tool calls, environments and the decode loop.

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
from enum import Enum
from typing import Callable, Protocol

import torch

import chat_format
import policy
from bench import BENCHES, DEFAULT_BENCH, BenchUnavailable, Task, Trajectory, load_bench
from chat_format import CallError, ChatFormat, ToolCall, derive_chat_format, validate_rehearsal
from cli import OneLineParser, add_template_args, int_at_least
from kvbatch import KVBatch, memory_rows
from roles import Role


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


class RowState(Enum):
    """Where a row is in the decode loop; `Row.state` reads it off the row's fields. Each decode step feeds
    every FEEDING row, forks every cached SPAWNING row, samples every SAMPLING row; a segment's end applies
    the row's plan (Engine.advance) and lands it in the state its next item asks for."""
    FEEDING = "feeding"     # tokens appended (scaffolding, an observation, a user turn) that the cache lacks
    SAMPLING = "sampling"   # a segment (Generate) is open and every token cached: one token this step
    SPAWNING = "spawning"   # asked for child rows (Spawn): they fork its cache once its tokens are cached
    WAITING = "waiting"     # its children run; the last to end resumes it (Spawn.then, then its plan)
    DONE = "done"           # ended (Row.finish): it leaves the batch at the end of the step


# A row joins the batch FEEDING (its prompt), SPAWNING (a hook before its first turn asks for children) or, as
# a child, SAMPLING (its context is its parent's cache). From one decode step to the next it moves only so
# (from, to) -> the event; several events inside one step show as one change (fed, forked and waiting).
ROW_TRANSITIONS = {
    (RowState.FEEDING, RowState.SAMPLING): "fed: the forward cached its appended tokens; its open segment samples",
    (RowState.SAMPLING, RowState.SAMPLING): "a token that does not end the segment",
    (RowState.SAMPLING, RowState.FEEDING): "the segment ended; its plan appended what follows (scaffolding, a "
                                           "response, a user turn) and opened the next segment",
    (RowState.SAMPLING, RowState.DONE): "the segment ended the row (an answer, a limit, an error; a child's end)",
    (RowState.SPAWNING, RowState.WAITING): "cached: its children forked off its cache row",
    (RowState.WAITING, RowState.WAITING): "a child still runs",
    (RowState.WAITING, RowState.SPAWNING): "its last child ended; the continuation appended the chosen turn and the "
                                           "hook before the next turn asks for children again",
    (RowState.WAITING, RowState.DONE): "its last child ended and the continuation ended the row",
}


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
    def state(self) -> RowState:
        """Its RowState, read off the fields the loop acts on (done, waiting, spawn, uncached tokens, gen)."""
        if self.done:
            return RowState.DONE
        if self.waiting:
            return RowState.WAITING
        if self.spawn is not None:
            return RowState.SPAWNING
        # a sampled token waits for the next forward too; FEEDING is appended text the cache lacks
        return RowState.SAMPLING if self.gen is not None and self.n_cached >= self.gen_start else RowState.FEEDING

    @property
    def on_world_lane(self) -> bool:
        """Whether its next tokens are a rehearsed response (a separate world model, where one is set, writes them)."""
        return self.gen is not None and self.gen.role == Role.WORLD

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
                if getattr(row.env, "last_user_tool_calls", None):   # Env protocol: the user acted, then stopped
                    traj.messages.append({"role": "user", "content": getattr(row.env, "last_user_text", ""),
                                          "user_tool_calls": list(row.env.last_user_tool_calls)})
                return row.finish("final_answer")
            if row.turn >= cfg.max_turns:
                return row.finish("max_turns")
            row.user_turn += 1
            user_msg = {"role": "user", "content": reply}
            if getattr(row.env, "last_user_tool_calls", None):  # Env protocol: the user acted on their side
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
        def respond(k, item):
            if isinstance(item, CallError):
                return [Response(None, item)]
            if rehearse is not None and rehearse(row.index, item):
                return [Generate(Role.WORLD, cfg.max_world_tokens, call=call_index[k])]
            return [Response(call_index[k])]
        row.plan.extend(tool_turn_plan(fmt, parsed.items, respond))
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


def tool_turn_plan(fmt: ChatFormat, items: list, respond: Callable[[int, object], list]) -> list:
    """The plan of one tool turn, in the template's order: its scaffolding between the responses, and for each
    call item (a ToolCall or a CallError) the plan items respond(index, item) returns. The one tool-turn loop:
    committed rows (Engine.end_act) and private rehearsals (rehearse.py) differ only in `respond`."""
    plan = []
    for kind, value in fmt.tool_turn(len(items)):
        plan += [Text(value, Role.PROMPT)] if kind == "text" else respond(value, items[value])
    return plan


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
    ap.add_argument("--bench", default=DEFAULT_BENCH, choices=list(BENCHES))
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

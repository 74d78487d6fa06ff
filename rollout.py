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

import rehearse
from bench import Task, ToolCall, Trajectory


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
# The chat template's scaffolding, derived from the template itself


class TemplateError(ValueError):
    """The model's chat template cannot be driven turn by turn (it is not append-only, or lacks pieces)."""


@dataclass
class TurnFormat:
    """Text the template puts around turns, split where the engine appends or the policy generates."""
    after_eos: str     # what follows the assistant's end-of-turn token
    tool_open: str     # before the first response of a group of tool responses
    obs_end: str       # after each response (the closing tag)
    tool_sep: str      # after obs_end, before the next response of the same group
    tool_close: str    # after the last obs_end, through the next assistant header
    user_open: str
    user_close: str    # through the next assistant header
    eos_id: int


_PROBE_TOOLS = [{"type": "function", "function": {"name": "zqx_probe", "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}]


def derive_turn_format(tok, template_kwargs: dict | None = None) -> TurnFormat:
    """Render placeholder conversations with the model's own template and cut out the scaffolding.

    Checks that every context before the latest assistant message is a prefix of every longer rendering
    (append-only), and that a group of tool responses decomposes into open / response / sep / close pieces
    (templates that close the group only after the last response, as Qwen3's does, are handled this way).
    """
    eos = tok.eos_token
    if eos is None:
        raise TemplateError("the tokenizer has no eos_token: the engine cannot tell where an assistant turn ends")

    def render(messages, gen):
        try:
            return tok.apply_chat_template(messages, tools=_PROBE_TOOLS, tokenize=False, add_generation_prompt=gen,
                                           **(template_kwargs or {}))
        except Exception as exc:
            raise TemplateError(f"the chat template failed to render a probe conversation: {exc}") from exc

    system, user = {"role": "system", "content": "@@SYS@@"}, {"role": "user", "content": "@@USER@@"}
    call = {"type": "function", "function": {"name": "zqx_probe", "arguments": {}}}
    with_call = {"role": "assistant", "content": "", "tool_calls": [call]}
    final = {"role": "assistant", "content": "@@ANSWER@@"}
    prompt = render([system, user], True)

    def after_assistant(messages, marker):
        full = render(messages, True)
        if not full.startswith(prompt):
            raise TemplateError("chat template is not append-only: adding turns changes the rendering of the "
                                "system/user prompt before them, so cached tokens would no longer match")
        at = full.find(marker, len(prompt))
        end = full.find(eos, at)
        if at < 0 or end < 0:
            raise TemplateError(f"chat template does not end assistant turns with the eos token {eos!r}")
        return full[end + len(eos):]

    probe = "@@OBS1@@", "@@OBS2@@", "@@USER2@@"
    one = after_assistant([system, user, with_call, {"role": "tool", "content": probe[0]}], "zqx_probe\"")
    two = after_assistant([system, user, with_call, {"role": "tool", "content": probe[0]},
                           {"role": "tool", "content": probe[1]}], "zqx_probe\"")
    usr = after_assistant([system, user, final, {"role": "user", "content": probe[2]}], "@@ANSWER@@")
    after_eos_text = after_assistant([system, user, final], "@@ANSWER@@")
    open_, _, close = one.partition(probe[0])
    pre2, _, rest2 = two.partition(probe[0])
    between, _, close2 = rest2.partition(probe[1])
    if pre2 != open_ or close2 != close:
        raise TemplateError("chat template is not append-only for parallel tool responses: a second tool "
                            "message changes the text around the first")
    # obs_end: the longest common head of `between` and `close` (the closing tag and what precedes it)
    n = 0
    while n < min(len(between), len(close)) and between[n] == close[n]:
        n += 1
    obs_end = between[:n]
    if not obs_end.strip():
        raise TemplateError("chat template has no closing tag after a tool response; rehearsal needs one "
                            "to know where the rehearsed response ends")
    user_open, _, user_close = usr.partition(probe[2])
    gen_header = prompt[len(render([system, user], False)):]
    if not close.endswith(gen_header) or not user_close.endswith(gen_header):
        raise TemplateError("chat template's tool/user turns do not end with the generation prompt")
    after_eos = after_eos_text[: len(after_eos_text) - len(gen_header)] if after_eos_text.endswith(gen_header) \
        else after_eos_text
    if not open_.startswith(after_eos) or not user_open.startswith(after_eos):
        raise TemplateError("chat template puts different text after the end of an assistant turn "
                            "depending on what follows")
    return TurnFormat(after_eos=after_eos, tool_open=open_[len(after_eos):], obs_end=obs_end,
                      tool_sep=between[n:], tool_close=close[n:], user_open=user_open[len(after_eos):],
                      user_close=user_close, eos_id=tok.eos_token_id)


# ----------------------------------------------------------------------------------------------------------
# Parsing the agent's turn: strict and total (every input yields content, calls and typed errors)

CALL_ERRORS = ("malformed_json", "not_an_object", "missing_name", "bad_arguments", "unknown_tool",
               "missing_arguments", "unterminated_call", "stray_close_tag")


def _spans(text: str, open_tag: str, close_tag: str):
    """(start, end) of each open_tag ... nearest close_tag, left to right: `re.finditer(open.*?close)` in
    linear time (the regex rescans to the end from every unclosed tag, quadratic on degenerate turns)."""
    pos = 0
    while True:
        i = text.find(open_tag, pos)
        if i < 0:
            return
        j = text.find(close_tag, i + len(open_tag))
        if j < 0:
            return
        pos = j + len(close_tag)
        yield i, pos


def _no_duplicate_keys(pairs):
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise ValueError(f"duplicate key {k!r}")
        obj[k] = v
    return obj


def _reject_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text):
    v = float(text)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} overflows a float")
    return v


def strict_json(text: str):
    """json.loads without Python's extensions and ambiguities: NaN/Infinity, numbers that overflow to inf,
    duplicate keys (which one would the call mean?) and unpaired surrogate escapes raise ValueError, and so
    does nesting too deep to decode (instead of RecursionError)."""
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant,
                         parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode (an unpaired surrogate \\u escape)") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    return obj


@dataclass
class CallError:
    kind: str        # one of CALL_ERRORS
    message: str
    raw: str = ""

    def observation(self) -> str:
        return json.dumps({"error": f"{self.kind}: {self.message}"})


@dataclass
class ParsedTurn:
    content: str                                     # text outside tool calls and thinking
    items: list = field(default_factory=list)        # ToolCall or CallError, in the order they appear

    @property
    def calls(self) -> list[ToolCall]:
        return [c for c in self.items if isinstance(c, ToolCall)]


def _parse_call(raw: str, tools: dict[str, dict]) -> ToolCall | CallError:
    try:
        obj = strict_json(raw)
    except ValueError as exc:
        return CallError("malformed_json", f"tool call is not valid JSON ({exc})", raw)
    if not isinstance(obj, dict):
        return CallError("not_an_object", "tool call must be a JSON object with 'name' and 'arguments'", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return CallError("missing_name", "tool call has no string 'name'", raw)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = strict_json(args) if args.strip() else {}
        except ValueError:
            return CallError("bad_arguments", f"arguments of {name!r} are a string that is not JSON", raw)
    if not isinstance(args, dict):
        return CallError("bad_arguments", f"arguments of {name!r} must be a JSON object", raw)
    if name not in tools:
        return CallError("unknown_tool", f"no tool named {name!r}; available: {', '.join(sorted(tools)) or 'none'}",
                         raw)
    required = tools[name].get("parameters", {}).get("required", []) or []
    missing = [p for p in required if p not in args]
    if missing:
        return CallError("missing_arguments", f"{name!r} needs {', '.join(map(repr, missing))}", raw)
    return ToolCall(name=name, arguments=args)


def parse_turn(text: str, tools: list[dict]) -> ParsedTurn:
    """Split an assistant turn into its answer text, well-formed calls, and typed call errors."""
    by_name = {}
    for t in tools:
        fn = t.get("function", t)
        by_name[fn.get("name")] = fn
    kept, pos = [], 0
    for start, end in _spans(text, "<think>", "</think>"):
        kept.append(text[pos:start])
        pos = end
    body = "".join(kept) + text[pos:]
    items, pieces, pos = [], [], 0
    for start, end in _spans(body, "<tool_call>", "</tool_call>"):
        between = body[pos:start]
        if "</tool_call>" in between:   # e.g. after nested tags: an error, not answer text
            items.append(CallError("stray_close_tag", "</tool_call> without a matching <tool_call>", between))
            between = between.replace("</tool_call>", "")
        pieces.append(between)
        items.append(_parse_call(body[start + len("<tool_call>"):end - len("</tool_call>")].strip(), by_name))
        pos = end
    tail = body[pos:]
    if "<tool_call>" in tail:
        cut = tail.index("<tool_call>")
        items.append(CallError("unterminated_call", "a <tool_call> was opened but never closed", tail[cut:]))
        tail = tail[:cut]
    if "</tool_call>" in tail:
        items.append(CallError("stray_close_tag", "</tool_call> without a matching <tool_call>", tail))
        tail = tail.replace("</tool_call>", "")
    pieces.append(tail)
    return ParsedTurn(content="".join(pieces).strip(), items=items)


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
        self.plan: deque = deque()          # ("feed", ids, role) / ("gen", role, payload)
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

    def truncate(self, n):
        """Cut appended (never sampled-then-cached) tokens past n, e.g. an observation that overflows."""
        del self.ids[n:], self.roles[n:], self.logprobs[n:]
        self.spans = [s for s in self.spans if s.start < n]
        self.spans[-1].end = min(self.spans[-1].end, n)

    def finish(self, reason):
        self.done = True
        self.traj.end_reason = reason


class Engine:
    """Holds the model, tokenizer and derived template pieces; `run` does the rollouts."""

    def __init__(self, model, tok, template_kwargs: dict | None = None):
        """template_kwargs: extra variables for the chat template, e.g. {"enable_thinking": False} (Qwen3)."""
        self.model, self.tok = model, tok
        self.template_kwargs = dict(template_kwargs or {})
        self.fmt = derive_turn_format(tok, self.template_kwargs)
        self._piece = {}
        self.world_stop_ids = self.encode(rehearse.world_stop_text(self.fmt.obs_end), scaffold=True)
        stops = {self.fmt.eos_id}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        stops |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        self.act_stop_ids = stops

    def encode(self, text: str, scaffold: bool = False) -> list[int]:
        """Scaffolding may contain special tokens; content never becomes one (a tool printing '<|im_end|>')."""
        if scaffold:
            if text not in self._piece:
                self._piece[text] = self.tok(text, add_special_tokens=False)["input_ids"]
            return self._piece[text]
        return self.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def prompt_ids(self, task: Task) -> list[int]:
        return self.tok.apply_chat_template(task.messages, tools=task.tools or None, add_generation_prompt=True,
                                            tokenize=True, return_dict=False, **self.template_kwargs)

    # -- host logic run when a row's generated segment ends --------------------------------------------

    def _start_next(self, row: _Row, execute: Callable[[_Row, int], str] | None = None):
        """Apply plan items in order until the next generation segment; an empty plan ends the row.

        execute(row, call_index) -> observation replaces the plain real execution (rehearse.py wraps it with a
        discarded fidelity probe)."""
        fmt = self.fmt
        while row.plan:
            kind, a, b = row.plan.popleft()
            if kind == "feed":
                row.append(a, b)
            elif kind == "obs":  # a = call index or None for a call error, b = CallError or None
                if a is None:
                    text = b.observation()
                else:
                    text = execute(row, a) if execute else self._execute(row, row.traj.calls[a])
                if a is None:
                    row.traj.messages.append({"role": "tool", "content": text})
                else:
                    self._record_response(row, a, text, rehearsed=False)
                row.append(self.encode(text), Role.OBS)
                row.append(self.encode(fmt.obs_end, True), Role.PROMPT)
            else:
                row.gen_role, row.gen_payload, row.gen_start = a, b, len(row.ids)
                return
        if not row.done:
            row.finish("plan_exhausted")

    def _execute(self, row: _Row, call: ToolCall) -> str:
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
        parsed = parse_turn(text, row.task.tools)
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
            row.plan.extend([("feed", self.encode(fmt.after_eos + fmt.user_open, True), Role.PROMPT),
                             ("feed", self.encode(reply), Role.PROMPT),
                             ("feed", self.encode(fmt.user_close, True), Role.PROMPT),
                             ("gen", Role.ACT, None)])
            return
        limit = row.task.max_assistant_turns
        if row.turn >= self.cfg.max_turns or (limit is not None and row.turn >= limit):
            return row.finish("max_turns")
        # one response per call item: rehearsed (WORLD), executed (OBS), or an error observation (OBS)
        row.plan.append(("feed", self.encode(fmt.after_eos + fmt.tool_open, True), Role.PROMPT))
        for k, item in enumerate(parsed.items):
            if k:
                row.plan.append(("feed", self.encode(fmt.tool_sep, True), Role.PROMPT))
            if isinstance(item, CallError):
                row.plan.append(("obs", None, item))
            elif world is not None and world(row.index, item):
                row.plan.append(("gen", Role.WORLD, call_index[k]))
            else:
                row.plan.append(("obs", call_index[k], None))
        row.plan.append(("feed", self.encode(fmt.tool_close, True), Role.PROMPT))
        row.plan.append(("gen", Role.ACT, None))

    def _end_world(self, row: _Row, stopped: bool):
        gen_ids = row.ids[row.gen_start:]
        on_tag = stopped and gen_ids[-len(self.world_stop_ids):] == self.world_stop_ids
        text = self.tok.decode(gen_ids if on_tag or not stopped else gen_ids[:-1], skip_special_tokens=False)
        check = rehearse.parse_rehearsal(text, self.fmt.obs_end, on_tag)
        row.defects += check.defects
        self._record_response(row, row.gen_payload, check.text, rehearsed=True)
        if not on_tag:  # close the response ourselves so the context stays well-formed
            row.traj.errors.append("rehearsal_unterminated: the rehearsed response did not end with its tag")
            row.plan.appendleft(("feed", self.encode(self.fmt.obs_end, True), Role.PROMPT))

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
                    stopped = tok_id in self.act_stop_ids
                    if stopped or n_gen >= cfg.max_new_tokens:
                        self._end_act(r, stopped, world_fn)
                        self._start_next(r)
                else:
                    tail_ok = r.ids[-len(self.world_stop_ids):] == self.world_stop_ids
                    stopped = tail_ok or tok_id in self.act_stop_ids
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


def encode_conversation(engine: Engine, task: Task, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids and roles of a finished chat (e.g. a reference trajectory), laid out exactly as a rehearsal
    rollout would: assistant text + eos is ACT, each tool response + its closing tag is WORLD, the rest PROMPT.

    Assistant text is cut from the template's own rendering, so any template's call format is respected.
    """
    tok, fmt = engine.tok, engine.fmt
    ids = engine.prompt_ids(task)
    roles = [int(Role.PROMPT)] * len(ids)
    history = [dict(m) for m in task.messages]

    def add(text, role, scaffold=False):
        piece = engine.encode(text, scaffold)
        ids.extend(piece)
        roles.extend([int(role)] * len(piece))

    rest = messages[len(task.messages):]
    i = 0
    while i < len(rest):
        m = rest[i]
        if m["role"] == "assistant":
            before = tok.apply_chat_template(history, tools=task.tools or None, tokenize=False,
                                             add_generation_prompt=True, **engine.template_kwargs)
            history.append(m)
            after = tok.apply_chat_template(history, tools=task.tools or None, tokenize=False,
                                            **engine.template_kwargs)
            body = after[len(before):]
            body = body[: body.rfind(tok.eos_token)]
            add(body, Role.ACT, scaffold=True)
            ids.append(fmt.eos_id)
            roles.append(int(Role.ACT))
            i += 1
        elif m["role"] == "tool":
            add(fmt.after_eos + fmt.tool_open, Role.PROMPT, True)
            first = True
            while i < len(rest) and rest[i]["role"] == "tool":
                if not first:
                    add(fmt.tool_sep, Role.PROMPT, True)
                add(rest[i]["content"], Role.WORLD)
                add(fmt.obs_end, Role.WORLD, True)
                history.append(rest[i])
                first, i = False, i + 1
            add(fmt.tool_close, Role.PROMPT, True)
        elif m["role"] == "user":
            add(fmt.after_eos + fmt.user_open, Role.PROMPT, True)
            add(m["content"], Role.PROMPT)
            add(fmt.user_close, Role.PROMPT, True)
            history.append(m)
            i += 1
        else:
            raise ValueError(f"cannot encode a {m['role']!r} message after the opening messages")
    return ids, roles


def main(argv=None) -> int:
    """Demo: roll out a model (default: the tiny one) on a few tasks and print one trajectory with role labels."""
    import policy
    import rollout   # not this file's names: run as a script, this module is __main__ and the engine's is `rollout`
    from bench import BENCHES, BenchUnavailable, load_bench
    from cli import OneLineParser, add_template_args, int_at_least, load_engine

    ap = OneLineParser(prog="rollout.py", description=main.__doc__)
    ap.add_argument("--model", default="tiny", help="'tiny', a local HF folder or a .gguf file")
    add_template_args(ap)
    ap.add_argument("--bench", default="toyworld", choices=list(BENCHES))
    ap.add_argument("--world", default="rehearse", choices=["rehearse", "real"])
    ap.add_argument("--group-size", type=int_at_least(1), default=2)
    ap.add_argument("--max-new-tokens", type=int_at_least(1), default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        bench = load_bench(args.bench)
        tasks = bench.load_tasks("test", limit=2)
        engine = load_engine(args.model, args.chat_template, args.chat_template_kwargs)
    except (policy.PolicyLoadError, rollout.TemplateError, BenchUnavailable, ImportError) as exc:
        ap.error(str(exc))
    cfg = rollout.SamplingConfig(seed=args.seed, max_new_tokens=args.max_new_tokens)
    out = engine.run(tasks, args.group_size, cfg, make_env=rollout.make_env_fn(bench), world=args.world)
    print(rollout.describe_row(out, engine.tok, 0))
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.stats.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

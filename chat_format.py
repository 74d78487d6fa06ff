"""Chat formats: everything that depends on how a model's chat template lays out turns and tool calls.

One concern, one module; it imports nothing else of the project (rollout.py, rehearse.py, train.py and the
benchmarks import it). It owns:

- deriving the scaffolding the engine appends between turns from the model's own template
  (`derive_chat_format`), with a specific `TemplateError` when a template cannot be driven turn by turn;
- the tool-call formats, chosen by name like vLLM's `--tool-call-parser` (`hermes`, `llama3_json`,
  `qwen3_coder`): parsing an assistant turn into answer text, calls and typed call errors;
- encoding text into token ids so the engine's ids equal the template's own tokenization
  (`ChatFormat.encode`), with tool output never able to forge a tag of the format;
- encoding finished conversations (`encode_conversation`, for the warm start);
- the text that ends a rehearsed tool response, and the fixed texts of test-time rehearsal.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

# ----------------------------------------------------------------------------------------------------------
# Calls and call errors


@dataclass
class ToolCall:
    """A parsed tool call: its name and arguments, and the assistant and user turns it belongs to."""
    name: str
    arguments: dict
    turn: int = 0          # index of the assistant turn that emitted it
    user_turn: int = 0     # index of the user turn it answers (BFCL multi-turn scores per user turn)


CALL_ERRORS = ("malformed_json", "not_an_object", "missing_name", "bad_arguments", "unknown_tool",
               "missing_arguments", "unterminated_call", "stray_close_tag")


@dataclass
class CallError:
    """A call that could not be parsed or checked: its kind (one of CALL_ERRORS), a message and the raw text."""
    kind: str        # one of CALL_ERRORS
    message: str
    raw: str = ""

    def observation(self) -> str:
        """The JSON error the policy sees as this call's response."""
        return json.dumps({"error": f"{self.kind}: {self.message}"})


@dataclass
class ParsedTurn:
    """An assistant turn parsed: its answer text and its calls and call errors in order."""
    content: str                                     # text outside tool calls and thinking
    items: list = field(default_factory=list)        # ToolCall or CallError, in the order they appear

    @property
    def calls(self) -> list[ToolCall]:
        """The well-formed calls only (items without the CallErrors)."""
        return [c for c in self.items if isinstance(c, ToolCall)]


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


def _tool_index(tools: list[dict]) -> dict[str, dict]:
    return {(t.get("function", t)).get("name"): t.get("function", t) for t in tools}


def _checked_call(name, args, tools: dict[str, dict], raw: str) -> ToolCall | CallError:
    """The checks every format shares once it has a name and an arguments object."""
    if not isinstance(name, str) or not name:
        return CallError("missing_name", "tool call has no string 'name'", raw)
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


def _json_call(raw: str, tools: dict[str, dict]) -> ToolCall | CallError:
    """{"name": ..., "arguments": {...}} (Hermes) or {"name": ..., "parameters": {...}} (Llama 3)."""
    try:
        obj = strict_json(raw)
    except ValueError as exc:
        return CallError("malformed_json", f"tool call is not valid JSON ({exc})", raw)
    if not isinstance(obj, dict):
        return CallError("not_an_object", "tool call must be a JSON object with 'name' and 'arguments'", raw)
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = strict_json(args) if args.strip() else {}
        except ValueError:
            return CallError("bad_arguments", f"arguments of {name!r} are a string that is not JSON", raw)
    return _checked_call(name, args, tools, raw)


def _without_thinking(text: str) -> str:
    kept, pos = [], 0
    for start, end in _spans(text, "<think>", "</think>"):
        kept.append(text[pos:start])
        pos = end
    return "".join(kept) + text[pos:]


def _tagged_calls(text: str, tools: dict, open_tag: str, close_tag: str, parse_one) -> ParsedTurn:
    """Calls wrapped in open_tag ... close_tag anywhere in the turn; every leftover tag is a typed error."""
    body = _without_thinking(text)
    items, pieces, pos = [], [], 0
    for start, end in _spans(body, open_tag, close_tag):
        between = body[pos:start]
        if close_tag in between:   # e.g. after nested tags: an error, not answer text
            items.append(CallError("stray_close_tag", f"{close_tag} without a matching {open_tag}", between))
            between = between.replace(close_tag, "")
        pieces.append(between)
        items.append(parse_one(body[start + len(open_tag):end - len(close_tag)].strip(), tools))
        pos = end
    tail = body[pos:]
    if open_tag in tail:
        cut = tail.index(open_tag)
        items.append(CallError("unterminated_call", f"a {open_tag} was opened but never closed", tail[cut:]))
        tail = tail[:cut]
    if close_tag in tail:
        items.append(CallError("stray_close_tag", f"{close_tag} without a matching {open_tag}", tail))
        tail = tail.replace(close_tag, "")
    pieces.append(tail)
    return ParsedTurn(content="".join(pieces).strip(), items=items)


# ----------------------------------------------------------------------------------------------------------
# Tool-call formats (names as vLLM's --tool-call-parser)


def parse_hermes(text: str, tools: list[dict]) -> ParsedTurn:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number per turn (Qwen2.5/3, QwQ, Hermes)."""
    return _tagged_calls(text, _tool_index(tools), "<tool_call>", "</tool_call>", _json_call)


LLAMA_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, tools: list[dict]) -> ParsedTurn:
    """Llama 3.1-3.3 with their own templates: the whole turn is {"name": ..., "parameters": {...}}, optionally
    after <|python_tag|>; several calls are separated by ';'. A turn that does not start with '{' is an answer."""
    by_name = _tool_index(tools)
    body = _without_thinking(text).strip()
    if body.startswith(LLAMA_PYTHON_TAG):
        body = body[len(LLAMA_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return ParsedTurn(content=body)
    items, decoder, pos = [], json.JSONDecoder(), 0
    while pos < len(body):
        try:
            _, end = decoder.raw_decode(body, pos)
        except ValueError:
            end = len(body)           # the rest is one malformed call
        items.append(_json_call(body[pos:end], by_name))
        pos = end
        rest = body[pos:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            items.append(CallError("malformed_json", "text after a JSON call (calls are separated by ';')", rest))
            break
        pos = len(body) - len(rest) + 1
        while pos < len(body) and body[pos].isspace():
            pos += 1
    return ParsedTurn(content="", items=items)


_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.S)


_PY_CONSTANTS = {"True": True, "False": False, "None": None}   # what jinja's `| string` makes of JSON's constants


def _coder_value(raw: str, schema: dict):
    """A Qwen3-Coder parameter value, typed by the tool's schema as Qwen's own parser does: the template
    writes every value with `| string`, so strings come bare, true/false/null as Python's True/False/None and
    objects as Python reprs. A string-typed parameter keeps its text (also "5" or "None"); boolean, integer,
    number, null, object and array are read as JSON, else as the Python literal the template wrote; a value
    that reads as neither stays a string (the call is then judged by its schema like any other)."""
    import ast
    kind = schema.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind} if kind else set()
    if kinds == {"string"}:
        return raw
    text = raw.strip()
    if "null" in kinds and text in ("None", "null"):
        return None
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return strict_json(text)
    except ValueError:
        pass
    if text in _PY_CONSTANTS:
        return _PY_CONSTANTS[text]
    if kinds & {"object", "array"} or text[:1] in "[{(":
        try:
            return json.loads(json.dumps(ast.literal_eval(text)))   # Python repr -> the JSON value it denotes
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return raw


def _coder_call(raw: str, tools: dict[str, dict]) -> ToolCall | CallError:
    m = _FUNCTION.fullmatch(raw.strip())
    if not m:
        return CallError("malformed_json", "tool call is not <function=NAME><parameter=...>...</parameter>"
                                           "</function>", raw)
    name = m.group(1).strip()
    props = (tools.get(name) or {}).get("parameters", {}).get("properties", {}) or {}
    args = {}
    for pm in _PARAMETER.finditer(m.group(2)):
        key = pm.group(1).strip()
        if key in args:
            return CallError("bad_arguments", f"parameter {key!r} of {name!r} given twice", raw)
        args[key] = _coder_value(pm.group(2), props.get(key, {}))
    leftover = _PARAMETER.sub("", m.group(2)).strip()
    if leftover:
        return CallError("bad_arguments", f"text outside <parameter> tags in a call of {name!r}", raw)
    return _checked_call(name, args, tools, raw)


def parse_qwen3_coder(text: str, tools: list[dict]) -> ParsedTurn:
    """<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call> (Qwen3-Coder, 3.5)."""
    return _tagged_calls(text, _tool_index(tools), "<tool_call>", "</tool_call>", _coder_call)


CALL_FORMATS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "qwen3_coder": parse_qwen3_coder}
# Text a tool's output must not be able to forge, per format (the engine escapes it; see encode).
FORMAT_TAGS = {"hermes": ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
               "llama3_json": (LLAMA_PYTHON_TAG,),
               "qwen3_coder": ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")}


def parse_turn(text: str, tools: list[dict], call_format: str = "hermes") -> ParsedTurn:
    """Split an assistant turn into its answer text, well-formed calls, and typed call errors."""
    return CALL_FORMATS[call_format](text, tools)


# ----------------------------------------------------------------------------------------------------------
# Deriving the scaffolding from the template


class TemplateError(ValueError):
    """The chat template cannot be driven turn by turn; `reason` names why, the message what to pass."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


TEMPLATE_REASONS = ("render_failed", "ignores_tools", "ignores_tool_calls", "call_format", "no_end_of_turn",
                    "not_append_only", "no_closing_tag", "world_stop")
FIX_TEMPLATE = ("pass --chat-template FILE with a template that supports it (chat_templates/chatml-tools.jinja "
                "is a ChatML/Hermes tool template)")
_TAG = re.compile(r"<[^<>\s]{1,64}>|\[/?[A-Z_]{2,32}\]")


@dataclass
class ChatFormat:
    """Text the template puts around turns, split where the engine appends or the policy generates."""
    after_eos: str        # what follows the assistant's end-of-turn token
    tool_open: str        # before the first response of a group of tool responses
    obs_end: str          # after each response, through its closing tag
    tool_sep: str         # after obs_end, before the next response of the same group
    tool_close: str       # after the last obs_end, through the next assistant header
    user_open: str
    user_close: str       # through the next assistant header
    eos_id: int           # the token that ends an assistant turn
    stop_ids: frozenset   # every token that ends an assistant turn (eos_id and generation_config's)
    call_format: str      # a key of CALL_FORMATS
    world_stop: str       # the text that ends a rehearsed response (the closing tag)
    quote_responses: bool = False   # the template writes a tool response as a JSON string (Llama 3's tojson)
    template_kwargs: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)   # accepted, but worth knowing (e.g. history rewriting)
    dropped_opener: str = ""    # an empty think block the generation prompt adds and history drops (Qwen3,
                                # enable_thinking=false): kept in the engine's tokens, cut from re-rendered turns
    tok: object = field(default=None, repr=False, compare=False)

    # -- parsing -----------------------------------------------------------------------------------------
    def parse(self, text: str, tools: list[dict]) -> ParsedTurn:
        """Split an assistant turn's text into content, calls and call errors with this format's call parser."""
        return CALL_FORMATS[self.call_format](text, tools)

    # -- rendering -----------------------------------------------------------------------------------------
    def render(self, messages, tools=None, generation_prompt=False) -> str:
        """Messages (and tools) rendered as text by the tokenizer's chat template, with the template kwargs."""
        return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                            add_generation_prompt=generation_prompt, **self.template_kwargs)

    def prompt_ids(self, messages, tools=None) -> list[int]:
        """Messages (and tools) as the chat template tokenizes them, with the generation prompt appended."""
        return self.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                            tokenize=True, return_dict=False, **self.template_kwargs)

    # -- encoding ----------------------------------------------------------------------------------------
    def encode(self, pieces) -> tuple[list[int], list]:
        """Token ids and a label per token for text pieces (text, label, trusted), encoded together.

        Consecutive pieces are tokenized as one text, so a token may span two pieces (Qwen's '}\\n' joins an
        observation to the newline before its closing tag) exactly as the template's own tokenization does;
        a token takes the label of its first character. Trusted pieces (the template's scaffolding) may hold
        added tokens such as '<|im_end|>'; in untrusted pieces (tool output, user text) every added token's
        text and every tag of the call format is split after its first character, so a tool that prints
        '</tool_response>' or '<|im_end|>' cannot forge a tag, whether those are special tokens or not."""
        runs, cur, cur_labels = [], [], []   # runs: ("text", str, [(label, trusted) per char]) / ("id", id, label)

        def flush():
            if cur:
                runs.append(("text", "".join(cur), list(cur_labels)))
                cur.clear()
                cur_labels.clear()

        for text, label, trusted in pieces:
            if not text:
                continue
            pos = 0
            for m in (self._added_re if trusted else self._forgeable_re).finditer(text):
                cut = m.end() if trusted else m.start() + 1
                cur.append(text[pos:m.start()] if trusted else text[pos:cut])
                cur_labels.extend([(label, trusted)] * ((m.start() if trusted else cut) - pos))
                flush()
                if trusted:
                    runs.append(("id", self._added[m.group(0)], label))
                pos = cut
            cur.append(text[pos:])
            cur_labels.extend([(label, trusted)] * (len(text) - pos))
        flush()
        ids, labels = [], []
        for run in runs:
            if run[0] == "id":
                ids.append(run[1])
                labels.append(run[2])
                continue
            _, text, chars = run
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
            for tid, (start, end) in zip(enc["input_ids"], enc["offset_mapping"]):
                span = chars[min(start, len(chars) - 1):max(end, start + 1)]
                # a token holding tool or user text belongs to that text (Qwen's '}\n' is observation)
                labels.append(next((lab for lab, trusted in span if not trusted), span[0][0]))
                ids.append(tid)
        return ids, labels

    def encode_text(self, text: str, trusted: bool = False) -> list[int]:
        """Token ids of one text (untrusted by default: it cannot forge added tokens or tags; see encode)."""
        return self.encode([(text, None, trusted)])[0]

    # -- rehearsal -----------------------------------------------------------------------------------------
    def ends_with_world_stop(self, ids: list[int]) -> bool:
        """Did generation just write the closing tag? Compared as text: where the tag is not one token, the
        model may write it with other tokens than the canonical ones (e.g. '}\\n</' then 'tool_response>')."""
        if ids[-len(self._world_stop_ids):] == self._world_stop_ids:
            return True
        if self._world_stop_single:
            return False
        tail = self.tok.decode(ids[-(len(self._world_stop_ids) + 2):], skip_special_tokens=False)
        return tail.endswith(self.world_stop)

    def response_text(self, observation: str) -> str:
        """A tool response as the template writes it between tool_open and obs_end."""
        return json.dumps(observation, ensure_ascii=False) if self.quote_responses else observation

    def rehearsed_text(self, generated: str, terminated: bool) -> str:
        """The observation a rehearsal wrote: its text without the closing tag and the whitespace before it
        (and unquoted, where the template quotes responses; a broken quote is left as written)."""
        text = generated
        if terminated and text.endswith(self.world_stop):
            text = text[: -len(self.world_stop)]
            head = self.obs_end[: self.obs_end.rfind(self.world_stop)]
            if head and text.endswith(head):
                text = text[: -len(head)]
        if self.quote_responses:
            try:
                value = json.loads(text)
                text = value if isinstance(value, str) else text
            except (ValueError, RecursionError):
                pass
        return text

    # -- turn plans: the pieces that follow an assistant turn --------------------------------------------------
    def tool_turn(self, n_responses: int) -> list:
        """What follows an assistant turn with n calls: text pieces, and ("response", k) where response k goes
        (written by the environment or rehearsed by the policy) followed by obs_end."""
        plan = [("text", self.after_eos + self.tool_open)]
        for k in range(n_responses):
            if k:
                plan.append(("text", self.tool_sep))
            plan.append(("response", k))
        plan.append(("text", self.tool_close))
        return plan

    def user_turn_pieces(self, text: str) -> list:
        """(text, trusted) pieces of a user turn after an assistant turn, through the next assistant header."""
        return [(self.after_eos + self.user_open, True), (text, False), (self.user_close, True)]

    def _setup(self, tok):
        self.tok = tok
        self._added = {t: i for t, i in tok.get_added_vocab().items() if t}
        names = sorted(self._added, key=len, reverse=True)
        self._added_re = re.compile("|".join(map(re.escape, names))) if names else re.compile(r"(?!x)x")
        forgeable = sorted(set(names) | set(FORMAT_TAGS[self.call_format]) | {self.world_stop}, key=len,
                           reverse=True)
        self._forgeable_re = re.compile("|".join(re.escape(t) for t in forgeable if len(t) > 1))
        self._world_stop_ids = self.encode_text(self.world_stop, trusted=True)
        self._world_stop_single = len(self._world_stop_ids) == 1


_PROBE_TOOL = {"type": "function", "function": {
    "name": "zqx_probe", "description": "probe",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
_PROBE_ARGS = {"city": "Paris", "days": 3}


def _probe_call(name="zqx_probe", args=None, call_id="zqx000001"):
    # a 9-character alphanumeric id: Mistral's templates refuse any other
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": dict(args or _PROBE_ARGS)}}


def _where(a: str, b: str) -> str:
    """Where two renderings first differ, as a short quote of each."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return f"at character {n}: {a[max(0, n - 30):n + 30]!r} became {b[max(0, n - 30):n + 30]!r}"


def _stop_candidates(tok, stop_ids) -> dict[str, int]:
    out = {}
    for i in ([tok.eos_token_id] if tok.eos_token_id is not None else []) + list(stop_ids or []):
        text = tok.convert_ids_to_tokens(int(i))
        if text:
            out[text] = int(i)
    return out


def derive_chat_format(tok, template_kwargs: dict | None = None, call_format: str | None = None,
                       stop_ids=()) -> ChatFormat:
    """Render probe conversations with the model's own template and cut out the scaffolding.

    stop_ids: further ids that end a turn (the model's generation_config.eos_token_id). call_format: a key of
    CALL_FORMATS, or None to infer it from how the template renders a call. Refuses (TemplateError with a
    reason) a template that ignores tools or tool calls, renders calls in an unsupported format, does not
    end assistant turns with a stop token, or is not append-only over a whole episode.
    """
    kwargs = dict(template_kwargs or {})
    if call_format is not None and call_format not in CALL_FORMATS:
        raise TemplateError("call_format", f"unknown tool-call format {call_format!r}; choose one of "
                                           f"{', '.join(CALL_FORMATS)}")

    def render(messages, gen, tools=(_PROBE_TOOL,)):
        try:
            return tok.apply_chat_template(messages, tools=list(tools) or None, tokenize=False,
                                           add_generation_prompt=gen, **kwargs)
        except Exception as exc:
            raise TemplateError("render_failed", f"the chat template failed to render a probe conversation "
                                                 f"({type(exc).__name__}: {exc}); {FIX_TEMPLATE}") from exc

    system, user = {"role": "system", "content": "@@SYS@@"}, {"role": "user", "content": "@@USER@@"}
    call_turn = {"role": "assistant", "content": "", "tool_calls": [_probe_call()]}
    final = {"role": "assistant", "content": "@@ANSWER@@"}

    def tool_msg(text, i=1):
        return {"role": "tool", "tool_call_id": f"zqx00000{i}", "name": "zqx_probe", "content": text}

    prompt = render([system, user], True)
    gen_header = prompt[len(render([system, user], False)):]
    if "zqx_probe" not in prompt:
        raise TemplateError("ignores_tools", "the chat template ignores `tools`: the tool schemas never reach "
                                             f"the prompt; {FIX_TEMPLATE}")
    stops = _stop_candidates(tok, stop_ids)
    answered = render([system, user, final], False)
    if not answered.startswith(prompt[: len(prompt) - len(gen_header)]):
        raise TemplateError("not_append_only", "the chat template is not append-only: an assistant turn changes "
                                               f"the prompt before it ({_where(prompt, answered)}); {FIX_TEMPLATE}")
    after_answer = answered[answered.find("@@ANSWER@@") + len("@@ANSWER@@"):]
    eos_text = _first_stop(after_answer, stops)
    if eos_text is None:
        followed = render([system, user, final, {"role": "user", "content": "@@USER2@@"}], False)
        between = followed[followed.find("@@ANSWER@@") + len("@@ANSWER@@"):followed.find("@@USER2@@")]
        closing = _TAG.search(between)
        header = prompt[:prompt.find("@@USER@@")]                 # a tag that opens a user turn is no end
        is_header = closing is not None and header.rstrip().endswith(between[closing.start():].strip())
        if closing is not None and not between[:closing.start()].strip() and not after_answer.strip() \
                and not is_header:
            raise TemplateError("no_end_of_turn", f"the chat template writes the end of an assistant turn "
                                                  f"({closing.group(0)!r}) only when another message follows, never "
                                                  "after the last one, so the engine cannot tell a finished turn "
                                                  f"from the history it renders; {FIX_TEMPLATE}")
        tag = _TAG.search(after_answer)
        if tag is None and after_answer.strip():
            end = after_answer.split()[0]
            raise TemplateError("no_end_of_turn", f"the chat template ends an assistant answer with {end!r}, which "
                                                  "is no token of this tokenizer's (neither its eos nor an added "
                                                  "token), so no generated token can end a turn; add it to the "
                                                  "tokenizer as its eos, or pass --chat-template FILE with a "
                                                  "template that supports it")
        if tag is None or after_answer[:tag.start()].strip():
            raise TemplateError("no_end_of_turn", "the chat template puts no end-of-turn token after an assistant "
                                                  f"answer (it is followed by {after_answer[:30]!r}); the engine "
                                                  f"needs one to know where a turn ends; {FIX_TEMPLATE}")
        raise TemplateError("no_end_of_turn", f"the chat template ends assistant turns with {tag.group(0)!r}, "
                                              f"which is neither the tokenizer's eos {tok.eos_token!r} nor in "
                                              "generation_config's eos_token_id: add that token's id to "
                                              "eos_token_id in the model folder's generation_config.json")
    eos_id = stops[eos_text]

    opener = _generation_opener(answered, prompt, gen_header)
    # Qwen3 with enable_thinking=false opens every generated turn with an empty think block and drops it from
    # the turns it re-renders: the one deviation accepted (noted), because the engine keeps the tokens it
    # generated (token in, token out) and never re-renders history
    tail_think = EMPTY_THINK_AT_END.search(gen_header)
    droppable = gen_header[tail_think.start():] if tail_think else ""
    dropped = []

    def after_assistant(messages, marker):
        full = render(messages, True)
        base = prompt
        if not full.startswith(prompt):
            if droppable and full.startswith(prompt[:-len(droppable)]):
                base = prompt[:-len(droppable)]
                dropped.append(True)
            else:
                why = (f"its generation prompt opens the assistant turn with {opener!r}, which it drops from "
                       "earlier turns" if opener and full.startswith(prompt[:-len(opener)]) else _where(prompt, full))
                raise TemplateError("not_append_only", "the chat template is not append-only: adding turns changes "
                                                       f"the prompt before them ({why}); {FIX_TEMPLATE}")
        at = full.find(marker, len(base))
        end = full.find(eos_text, at) if at >= 0 else -1
        if at < 0:
            raise TemplateError("ignores_tool_calls", "the chat template ignores assistant `tool_calls`: a call "
                                                      f"never appears in the rendered turn; {FIX_TEMPLATE}")
        if end < 0:
            raise TemplateError("no_end_of_turn", f"the chat template does not end a tool-calling assistant turn "
                                                  f"with {eos_text!r}; {FIX_TEMPLATE}")
        return full[end + len(eos_text):]

    # the call format: the rendered call must parse back to the same name and arguments
    call_text = render([system, user, call_turn], False)
    if "zqx_probe" not in call_text[len(prompt) - len(gen_header):]:
        raise TemplateError("ignores_tool_calls", "the chat template ignores assistant `tool_calls`: a call never "
                                                  f"appears in the rendered turn; {FIX_TEMPLATE}")
    body = call_text[len(prompt):] if call_text.startswith(prompt) else call_text[len(prompt) - len(gen_header):]
    body = body[: body.find(eos_text)] if eos_text in body else body
    if not body.strip():
        raise TemplateError("call_format", "the chat template writes a tool call outside the assistant turn: "
                                           "nothing of the call comes between the generation prompt and the "
                                           f"turn's end {eos_text!r} (it follows as a separate section or "
                                           f"message); {FIX_TEMPLATE}")
    fmt_name = _infer_call_format(body, call_format)

    probe = "@@OBS1@@", "@@OBS2@@", "@@USER2@@"
    one = after_assistant([system, user, call_turn, tool_msg(probe[0])], "zqx_probe")
    two = after_assistant([system, user, call_turn, tool_msg(probe[0]), tool_msg(probe[1], 2)], "zqx_probe")
    usr = after_assistant([system, user, final, {"role": "user", "content": probe[2]}], "@@ANSWER@@")
    after_eos_text = after_assistant([system, user, final], "@@ANSWER@@")
    quote = _quotes_responses(one, probe[0], lambda text: after_assistant(
        [system, user, call_turn, tool_msg(text)], "zqx_probe"))
    response = (lambda text: json.dumps(text, ensure_ascii=False)) if quote else (lambda text: text)
    open_, _, close = one.partition(response(probe[0]))
    pre2, _, rest2 = two.partition(response(probe[0]))
    between, _, close2 = rest2.partition(response(probe[1]))
    if pre2 != open_ or close2 != close:
        raise TemplateError("not_append_only", "the chat template is not append-only for parallel tool responses: "
                                               "a second tool message changes the text around the first "
                                               f"({_where(one, two)}); {FIX_TEMPLATE}")
    common = 0
    while common < min(len(between), len(close)) and between[common] == close[common]:
        common += 1
    tag = _TAG.search(between[:common])
    if tag is None:
        raise TemplateError("no_closing_tag", "the chat template puts no closing tag after a tool response; "
                                              "rehearsal needs one to know where the rehearsed response ends; "
                                              f"{FIX_TEMPLATE}")
    obs_end = between[:tag.end()]
    world_stop = obs_end.strip()
    for stop_text in stops:
        if stop_text in world_stop and stop_text != world_stop:
            raise TemplateError("world_stop", f"the closing text of a tool response {world_stop!r} contains the "
                                              f"end-of-turn token {stop_text!r}: a rehearsal would stop before "
                                              f"its end; {FIX_TEMPLATE}")
    user_open, _, user_close = usr.partition(probe[2])
    if not close.endswith(gen_header) or not user_close.endswith(gen_header):
        raise TemplateError("not_append_only", "the chat template's tool/user turns do not end with the "
                                               f"generation prompt {gen_header!r}; {FIX_TEMPLATE}")
    after_eos = after_eos_text[: len(after_eos_text) - len(gen_header)] if after_eos_text.endswith(gen_header) \
        else after_eos_text
    if not open_.startswith(after_eos) or not user_open.startswith(after_eos):
        raise TemplateError("not_append_only", "the chat template puts different text after the end of an "
                                               f"assistant turn depending on what follows; {FIX_TEMPLATE}")
    fmt = ChatFormat(after_eos=after_eos, tool_open=open_[len(after_eos):], obs_end=obs_end,
                     tool_sep=between[tag.end():], tool_close=close[tag.end():],
                     user_open=user_open[len(after_eos):], user_close=user_close, eos_id=eos_id,
                     stop_ids=frozenset(stops.values()), call_format=fmt_name, world_stop=world_stop,
                     quote_responses=quote, template_kwargs=kwargs, dropped_opener=droppable)
    fmt._setup(tok)
    _check_episode(fmt, render, system)
    if dropped or fmt.notes and droppable:
        fmt.notes.insert(0, f"opens each generated turn with an empty think block {droppable!r} that it drops "
                            "when it re-renders history; the engine keeps the generated tokens (training sees "
                            "what the model saw), so a server that re-renders history gives later turns a "
                            "slightly different context")
    return fmt


EMPTY_THINK_AT_END = re.compile(r"<think>\s*</think>\s*$")


def _quotes_responses(rendered: str, marker: str, render_with) -> bool:
    """Does the template write a tool response as a JSON string literal? (Llama 3.x pipes every string
    content through tojson.) Then the engine must do the same, byte for byte, or refuse."""
    if f'"{marker}"' not in rendered:
        return False
    probe = 'zqx "q" \\ \n é'
    if json.dumps(probe, ensure_ascii=False) not in render_with(probe):
        raise TemplateError("not_append_only", "the chat template transforms tool responses in a way the engine "
                                               f"cannot reproduce; {FIX_TEMPLATE}")
    return True


def _generation_opener(answered: str, prompt: str, gen_header: str) -> str:
    """Text the generation prompt puts after the assistant header (QwQ's '<think>\n'), '' if none."""
    base = prompt[: len(prompt) - len(gen_header)]
    turn = answered[len(base):answered.find("@@ANSWER@@")] if answered.startswith(base) else ""
    return gen_header[len(turn):] if turn and gen_header.startswith(turn) else ""


def _first_stop(text: str, stops: dict) -> str | None:
    """The stop token that ends the turn: the first one in `text`, with nothing but spaces before it."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and not text[:i].strip() and (best is None or i < text.find(best)):
            best = s
    return best


def _infer_call_format(body: str, wanted: str | None) -> str:
    names = [wanted] if wanted else list(CALL_FORMATS)
    tools = [_PROBE_TOOL]
    for name in names:
        parsed = CALL_FORMATS[name](body, tools)
        calls = parsed.calls
        if len(parsed.items) == 1 and calls and calls[0].name == "zqx_probe" and calls[0].arguments == _PROBE_ARGS:
            return name
    if wanted:
        raise TemplateError("call_format", f"the chat template renders a call as {body.strip()[:120]!r}, which the "
                                           f"{wanted!r} tool-call format does not parse back to the same call; "
                                           f"choose another with --tool-call-format ({', '.join(CALL_FORMATS)}) or "
                                           f"{FIX_TEMPLATE}")
    raise TemplateError("call_format", f"unsupported tool-call format: the chat template renders a call as "
                                       f"{body.strip()[:120]!r}; supported formats are {', '.join(CALL_FORMATS)}; "
                                       f"{FIX_TEMPLATE}")


def _check_episode(fmt: ChatFormat, render, system):
    """Append-only over a whole episode: every context the engine would have built before an assistant turn
    must be a prefix of the rendering of the finished episode. Thinking is left out here (a template that
    drops earlier turns' thinking is noted, not refused: the engine keeps the sampled tokens)."""
    first = {"role": "user", "content": "@@U1@@"}
    call_a = {"role": "assistant", "content": "", "tool_calls": [_probe_call("zqx_probe", {"city": "Oslo"})]}
    call_b = {"role": "assistant", "content": "", "tool_calls": [_probe_call("zqx_probe", {"city": "Rome", "days": 1},
                                                                             "zqx000002")]}
    episode = [system, first, call_a, {"role": "tool", "tool_call_id": "zqx000001", "name": "zqx_probe",
                                        "content": "@@R1@@"},
               {"role": "assistant", "content": "@@A1@@"}, {"role": "user", "content": "@@U2@@"}, call_b,
               {"role": "tool", "tool_call_id": "zqx000002", "name": "zqx_probe", "content": "@@R2@@"},
               {"role": "assistant", "content": "@@A2@@"}]
    full = render(episode, False)
    drop = fmt.dropped_opener
    for k, m in enumerate(episode):
        if m["role"] != "assistant":
            continue
        before = render(episode[:k], True)
        if drop and not full.startswith(before) and before.endswith(drop) and full.startswith(before[:-len(drop)]):
            continue    # the empty think block of the generation prompt, dropped from history (noted)
        if not full.startswith(before):
            raise TemplateError("not_append_only", "the chat template is not append-only over an episode: the "
                                                   f"context before assistant turn {k} is rendered differently once "
                                                   f"the episode goes on ({_where(before, full)}); {FIX_TEMPLATE}")
    thinking = {"role": "assistant", "content": "<think>\n@@T1@@\n</think>\n\n@@A0@@"}
    rendered = render([system, first, thinking, {"role": "user", "content": "@@U2@@"}], True)
    if "@@A0@@" in rendered and "@@T1@@" not in rendered:
        fmt.notes.append("drops earlier turns' thinking when it re-renders history; the engine keeps the "
                         "sampled tokens, so serve the trained model with a template that keeps thinking")


# ----------------------------------------------------------------------------------------------------------
# Finished conversations (warm-start data)


def encode_conversation(fmt: ChatFormat, task_messages: list[dict], tools: list[dict], messages: list[dict],
                        rehearsed: bool = True):
    """Token ids and a label per token of a finished chat, laid out exactly as a rollout would: "act" for
    assistant text + its end token; each tool response + its closing text "world", encoded apart as the
    policy writes it (rehearsed=True), or the response "obs" encoded with the text around it as the engine
    appends a real one (rehearsed=False); "prompt" for the rest. Assistant text is cut from the template's
    own rendering, so any call format is respected."""
    ids = fmt.prompt_ids(task_messages, tools)
    labels = ["prompt"] * len(ids)
    history = [dict(m) for m in task_messages]
    pending = []

    def flush():
        new_ids, new_labels = fmt.encode(pending)
        ids.extend(new_ids)
        labels.extend(new_labels)
        pending.clear()

    rest = messages[len(task_messages):]
    i = 0
    while i < len(rest):
        m = rest[i]
        if m["role"] == "assistant":
            flush()
            before = fmt.render(history, tools, True)
            history.append(m)
            after = fmt.render(history, tools)
            eos_text = fmt.tok.convert_ids_to_tokens(fmt.eos_id)
            drop = fmt.dropped_opener
            if drop and not after.startswith(before) and before.endswith(drop):
                before = before[:-len(drop)]     # history dropped the empty think block; the layout keeps it
            body = after[len(before):]
            if drop and body.startswith(drop):   # ... and a last turn may keep it: it is scaffolding either way
                body = body[len(drop):]
            body = body[: body.rfind(eos_text)]
            pending.append((body, "act", True))
            flush()
            ids.append(fmt.eos_id)
            labels.append("act")
            i += 1
        elif m["role"] == "tool":
            group = []
            while i < len(rest) and rest[i]["role"] == "tool":
                group.append(rest[i])
                history.append(rest[i])
                i += 1
            for kind, value in fmt.tool_turn(len(group)):
                if kind == "text":
                    pending.append((value, "prompt", True))
                elif rehearsed:   # the policy writes this stretch: encoded apart, as generated
                    flush()
                    pending += [(fmt.response_text(group[value]["content"]), "world", False),
                                (fmt.obs_end, "world", True)]
                    flush()
                else:
                    pending += [(fmt.response_text(group[value]["content"]), "obs", False),
                                (fmt.obs_end, "prompt", True)]
        elif m["role"] == "user":
            pending += [(text, "prompt", trusted) for text, trusted in fmt.user_turn_pieces(m["content"])]
            history.append(m)
            i += 1
        else:
            raise ValueError(f"cannot encode a {m['role']!r} message after the opening messages")
    flush()
    return ids, labels


# ----------------------------------------------------------------------------------------------------------
# Rehearsed responses

REHEARSAL_DEFECTS = ("empty", "unterminated", "invalid_json")


def validate_rehearsal(text: str, terminated: bool, expect_json: bool = True) -> list[str]:
    """Defects of a rehearsed observation (tools in our benchmarks answer JSON; expect_json=False otherwise)."""
    defects = []
    if not terminated:
        defects.append("unterminated")
    if not text.strip():
        defects.append("empty")
    elif expect_json:
        try:
            json.loads(text)
        except (ValueError, RecursionError):   # RecursionError: nesting too deep to decode
            defects.append("invalid_json")
    return defects


# ----------------------------------------------------------------------------------------------------------
# The fixed texts of test-time rehearsal (rehearse.py); the tiny tokenizer is trained on them too

MEMORY_HEAD = "Rehearsal memory (private notes; these responses are my own predictions, nothing was executed):\n"
MEMORY_TAIL = "Committed turn, revised by the notes above:\n"
ASSESS_PREFIX = ("Self-assessment (private; the response above is my prediction, not a real result): does this "
                 "call move the task forward, and what should I revise? ")
ASSESS_OK = "ok: this call is right; commit it."
ASSESS_ERROR = "revise: it fails with an error."
ASSESS_WRONG = "revise: the arguments look wrong."


def assessment_verdict(text: str) -> str | None:
    """The verdict of a self-assessment, read in the warm start's vocabulary (ASSESS_OK, ASSESS_ERROR,
    ASSESS_WRONG): "ok" (commit it), "fails" (revise: it errors), "wrong" (revise: the arguments look wrong);
    None when the text starts with neither "ok" nor "revise"."""
    t = " ".join(str(text).split()).lower()
    if re.match(r"ok\b", t):
        return "ok"
    if t.startswith("revise"):
        return "fails" if "fail" in t or "error" in t else "wrong"
    return None

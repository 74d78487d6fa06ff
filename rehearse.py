"""Rehearsal at test time: private rehearsals before each committed turn, and the world model's fidelity.

(While training, rollout.py lets the policy write tool responses itself; the text that ends a rehearsed
response and the check of what was written live in chat_format.py, with the rest of the chat format.)
"""
from __future__ import annotations

import copy
import json
import time
from collections import deque
from dataclasses import dataclass, field

import torch

import rollout
from chat_format import (ASSESS_ERROR, ASSESS_OK, ASSESS_PREFIX, ASSESS_WRONG, MEMORY_HEAD, MEMORY_TAIL, CallError,
                         ChatFormat, validate_rehearsal)
from rollout import Role, SamplingConfig, encode_conversation, new_kv_cache, ragged_chunk, sample

# ==========================================================================================================
# Test-time private rehearsal (evaluate.py)
#
# Before each committed assistant turn the policy may rehearse privately, up to `budget` times:
#
#   proposal    an assistant turn sampled from the committed context (role ACT, private)
#   rehearsal   for each call in it, the template's tool-response opening, then the policy writes the
#               response itself (role WORLD) up to the closing tag; malformed calls get the parser's error
#   assessment  the template's tool-turn close (through the next assistant header), the fixed prefix
#               ASSESS_PREFIX, then a short assistant text (ACT, at most max_assess_tokens) judging the
#               predicted outcome and suggesting a revision
#
# parallel:   `budget` proposals from the same committed context at once (the committed KV cache is
#             deep-copied and batch_repeat_interleave'd to `budget` rows, ragged rows masked as in rollout.py).
# sequential: one proposal at a time on the committed cache itself; proposal k starts from the committed
#             context plus the memory of rehearsals 1..k-1 (so it sees the earlier predictions and
#             assessments); afterwards the cache is cropped back to the committed length.
#
# The rehearsal memory (memory_text) is a short plain-text block that the committed assistant turn STARTS
# with: the engine feeds it after the assistant header and the policy continues with its committed turn.
# Why there and not as a user-role note: (1) the committed context already ends with the generation header,
# so the branch point is exactly the committed length and needs no template surgery; (2) the model reads
# the notes as its own (like a thinking block), which conditions the next tokens most directly; (3) removal
# is a cache.crop(n) back to the committed length followed by feeding only the committed turn's sampled
# tokens, so the kept context is token-for-token what plain acting with that turn would hold.
# The memory is removed: the committed token sequence never contains it, nor any WORLD token; the
# environment executes only committed calls, and user_turn sees only the committed turn's text.
# (The committed tokens' recorded log-probs are those under the memory-conditioned context.)
#
# A proposal without any call is an answer, not a rehearsal: if no proposal of the first round (parallel)
# or the latest proposal (sequential) calls a tool, that proposal is committed as is (it was sampled from
# the committed context, plus the memory so far in sequential mode). Budget 0 is plain acting, token for
# token what Engine.run(world="real") produces for the same seed.
#
# Costs are counted per bucket: "act" (committed), "private" (proposals, rehearsals, assessments, the
# memory and the re-fed committed tokens) and "fidelity" (the discarded world-model probes).

MODES = ("parallel", "sequential")


@dataclass
class RehearsalConfig:
    budget: int = 0                 # private rehearsals before each committed turn; 0 = plain acting
    mode: str = "parallel"          # "parallel" or "sequential"
    max_assess_tokens: int = 48
    memory_chars: int = 240         # each predicted response / assessment is cut to this many characters
    fidelity: bool = False          # probe the world model on every real call (a discarded WORLD branch)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"rehearsal mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.budget < 0:
            raise ValueError(f"rehearsal budget must be >= 0, not {self.budget}")


def _short(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def memory_text(records: list[dict], memory_chars: int = 240) -> str:
    """Condense private rehearsals into the block the committed turn starts with ('' when there are none)."""
    if not records:
        return ""
    lines = [MEMORY_HEAD]
    for i, rec in enumerate(records, 1):
        if not rec["items"]:
            lines.append(f"[{i}] answer without a call: {_short(rec['content'], memory_chars)}\n")
        for item in rec["items"]:
            if "error" in item:
                lines.append(f"[{i}] invalid call ({_short(item['error'], memory_chars)})\n")
            else:
                args = json.dumps(item["arguments"], ensure_ascii=False)
                lines.append(f"[{i}] {item['name']}({args}) -> predicted "
                             f"{_short(item['predicted'], memory_chars)}\n")
        if rec["assessment"]:
            lines.append(f"    assessment: {_short(rec['assessment'], memory_chars)}\n")
    lines.append(MEMORY_TAIL)
    return "".join(lines)


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

def assessment_for(call_is_reference: bool, response: str) -> str:
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


def warm_start_examples(eng, task, messages: list[dict], make_env, rng, budgets=(1, 2, 4)) -> list:
    """One assessment example and one memory example (token ids, role ids) from a reference chat.

    A call turn of the reference is picked at random; `make_env(task)` replays the reference calls before it
    to get the real responses of the proposals. Returns [] when the chat has no single-call turn."""
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

    # assessment: the proposal's body as the template renders it, then the rehearsal and the judgement, each
    # stretch encoded as `act` encodes it (text between two generated segments in one piece)
    prop, first = rehearsal()
    obs = first["items"][0]["predicted"]
    ids, roles = encode_conversation(eng, task, messages[:t] + [_call_turn(prop)])
    for pieces in ([(fmt.after_eos + fmt.tool_open, Role.PROMPT, True)],
                   [(fmt.response_text(obs), Role.WORLD, False), (fmt.obs_end, Role.WORLD, True)],
                   [(fmt.tool_close, Role.PROMPT, True), (ASSESS_PREFIX, Role.PROMPT, False)],
                   [(first["assessment"], Role.ACT, False)]):
        p, r = fmt.encode(pieces)
        ids += p
        roles += [int(x) for x in r]
    examples = [(ids + [fmt.eos_id], roles + [int(Role.ACT)])]
    # memory: that rehearsal and up to 3 more in front of the reference turn
    records = [first] + [rehearsal()[1] for _ in range(rng.choice(list(budgets)) - 1)]
    mem = fmt.encode_text(memory_text(records))
    mem_roles = [int(Role.PROMPT)] * len(mem)
    examples.append((full_ids[:n] + mem + full_ids[n:], full_roles[:n] + mem_roles + full_roles[n:]))
    return examples


# -- fidelity of the world model -----------------------------------------------------------------------------

def _json(text: str):
    try:
        return True, json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return False, None


def is_error_text(text: str) -> bool:
    """An error observation: JSON with an "error" key, or text starting with "Error"."""
    ok, obj = _json(text)
    if ok:
        return isinstance(obj, dict) and "error" in obj
    return text.strip().startswith("Error")


def fidelity(predicted: str, real: str) -> dict:
    """Compare a rehearsed (predicted) tool response with the real one.

    exact: equal after stripping whitespace, or equal as parsed JSON. kv_agreement: the fraction of the real
    JSON object's top-level keys whose value the prediction got right (1/0 for a non-object JSON value; None
    when the real response is not JSON). error_correct: predicted-is-error == real-is-error.
    """
    p_ok, p = _json(predicted)
    r_ok, r = _json(real)
    exact = predicted.strip() == real.strip() or (p_ok and r_ok and p == r)
    if not r_ok:
        kv = None
    elif isinstance(r, dict):
        kv = (sum(1 for k, v in r.items() if isinstance(p, dict) and k in p and p[k] == v) / len(r)) if r else \
            float(p == r)
    else:
        kv = float(p_ok and p == r)
    pe, re_ = is_error_text(predicted), is_error_text(real)
    return {"exact": bool(exact), "predicted_json": p_ok, "kv_agreement": kv, "real_error": re_,
            "predicted_error": pe, "error_correct": pe == re_}


# -- a KV cache shared by ragged rows ------------------------------------------------------------------------

class _KV:
    """A KV cache (rollout.new_kv_cache) with its attention mask (holes where ragged rows were left-padded)."""

    def __init__(self, eng, cache=None, mask=None):
        self.eng = eng
        self.device = next(eng.model.parameters()).device
        self.cache = cache if cache is not None else new_kv_cache()
        self.mask = mask if mask is not None else torch.zeros((1, 0), dtype=torch.long, device=self.device)

    def feed(self, lines, stats, bucket) -> "torch.Tensor":
        """Feed each line's uncached tokens (line.ids[line.n_cached:], at least one each); next-token logits."""
        feeds = [ln.ids[ln.n_cached:] for ln in lines]
        assert all(feeds), "every row needs an uncached token to get next-token logits"
        ids, chunk, pos = ragged_chunk(feeds, [ln.n_cached for ln in lines], self.eng.tok.pad_token_id)
        self.mask = torch.cat([self.mask, chunk.to(self.device)], dim=1)
        out = self.eng.model(input_ids=ids.to(self.device), attention_mask=self.mask, position_ids=pos.to(self.device),
                             cache=self.cache, use_cache=True, logits_to_keep=1)
        stats[f"{bucket}_fed"] = stats.get(f"{bucket}_fed", 0) + sum(len(f) for f in feeds)
        stats["forward_calls"] = stats.get("forward_calls", 0) + 1
        for ln in lines:
            ln.n_cached = len(ln.ids)
        return out.logits[:, -1].float()

    def select(self, keep: list[int]):
        idx = torch.tensor(keep, device=self.device)
        self.cache.batch_select_indices(idx)
        self.mask = self.mask[idx]

    def crop(self, n: int):
        """Back to the first n tokens (batch 1 without holes: the committed context)."""
        assert self.mask.shape[0] == 1 and bool(self.mask.all()), "crop is only exact for the hole-free batch-1 cache"
        extra = self.cache.get_seq_length() - n
        if extra > 0:   # a negative argument removes that many tokens, in old and new transformers alike
            self.cache.crop(-extra)
        self.mask = self.mask[:, :n]

    def fork(self, k: int) -> "_KV":
        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(k)
        return _KV(self.eng, cache, self.mask.repeat_interleave(k, dim=0))


class _Line:
    """A token sequence being extended on a _KV row: the committed turn, a private branch, or a probe."""

    def __init__(self, fmt: ChatFormat, stream, ids, n_cached):
        self.fmt = fmt
        self.stream = stream        # the row id the steering hook sees: 0 committed, 1.. private, -1 fidelity
        self.ids = list(ids)
        self.roles = [None] * len(ids)
        self.logprobs = [0.0] * len(ids)
        self.n_cached = n_cached
        self.plan = deque()          # ("text", text, role, trusted) / ("gen", role, max_tokens, on_end)
        self.gen_role, self.gen_start, self.gen_max, self.on_end = None, len(ids), 0, None
        self.done = False
        self.rec = None

    def append(self, ids, role, logprobs=None):
        self.ids += ids
        self.roles += [role] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def advance(self):
        """Append plan text up to the next generation segment (encoded in one piece, as the engine does)."""
        pending = []
        while self.plan:
            item = self.plan.popleft()
            if item[0] == "text":
                pending.append(item[1:])
                continue
            ids, roles = self.fmt.encode(pending)
            self.ids += ids
            self.roles += roles
            self.logprobs += [0.0] * len(ids)
            _, self.gen_role, self.gen_max, self.on_end = item
            self.gen_start = len(self.ids)
            return
        ids, roles = self.fmt.encode(pending)
        self.ids += ids
        self.roles += roles
        self.logprobs += [0.0] * len(ids)
        self.done = True


def _drive(eng, kv: _KV, lines: list[_Line], logits, cfg, gen, steer, stats, bucket, max_len):
    """Sample every line (the rows of kv, in order) until its plan is exhausted; rows leave as they finish.

    logits: next-token logits of each line, or None when each line has uncached tokens to feed first.
    """
    active = [ln for ln in lines if not ln.done]
    if not active:
        return
    if len(active) < len(lines):
        kv.select([j for j, ln in enumerate(lines) if not ln.done])
        logits = None if logits is None else logits[[j for j, ln in enumerate(lines) if not ln.done]]
    if active and logits is None:
        logits = kv.feed(active, stats, bucket)
    while active:
        steered = None if steer is None else steer(
            [ln.stream for ln in active], [(ln.gen_role, ln.ids[ln.gen_start:]) for ln in active], logits.clone())
        tokens, logps = sample(logits, cfg, gen, steered)
        stats[f"{bucket}_sampled"] = stats.get(f"{bucket}_sampled", 0) + len(active)
        for ln, t, lp in zip(active, tokens.tolist(), logps.tolist()):
            ln.append([t], ln.gen_role, [lp])
            stopped = t in eng.fmt.stop_ids or (ln.gen_role == Role.WORLD
                                                and eng.fmt.ends_with_world_stop(ln.ids[ln.gen_start:]))
            too_long = len(ln.ids) >= max_len
            if stopped or too_long or len(ln.ids) - ln.gen_start >= ln.gen_max:
                if ln.on_end is not None:
                    ln.on_end(ln, stopped)
                ln.advance()
                if too_long:
                    ln.plan.clear()
                    ln.done = True
        keep = [j for j, ln in enumerate(active) if not ln.done]
        if len(keep) < len(active) and keep:
            kv.select(keep)
        active = [active[j] for j in keep]
        if active:
            logits = kv.feed(active, stats, bucket)


# -- one episode ---------------------------------------------------------------------------------------------

@dataclass
class Episode:
    rollout: object                  # rollout.Rollout with the single committed row
    rehearsals: list = field(default_factory=list)   # per committed turn: list of private records
    fidelity: list = field(default_factory=list)     # per real call: {"call", "predicted", "real", **fidelity()}
    stats: dict = field(default_factory=dict)

    @property
    def trajectory(self):
        return self.rollout.trajectories[0]


class _Rehearser:
    def __init__(self, eng, task, cfg, rcfg, steer, max_len, stats):
        self.eng, self.task, self.cfg, self.rcfg, self.steer = eng, task, cfg, rcfg, steer
        self.max_len, self.stats = max_len, stats

    def _decode(self, ids):
        return self.eng.tok.decode(ids, skip_special_tokens=False)

    def private_line(self, stream, ids, n_cached, seen_memory: str = "") -> _Line:
        """A branch that proposes a turn, rehearses each call's response and assesses the outcome."""
        eng, fmt, cfg = self.eng, self.eng.fmt, self.cfg
        line = _Line(fmt, stream, ids, n_cached)
        line.rec = {"content": "", "raw": "", "items": [], "assessment": "", "terminated": False, "tokens": [],
                    "seen_memory": seen_memory}

        def on_world(index):
            def end(ln, stopped):
                text, on_tag = eng.rehearsal_text(ln.ids[ln.gen_start:], stopped)
                ln.rec["items"][index].update(predicted=text, defects=validate_rehearsal(text, on_tag))
                if not on_tag:
                    ln.plan.appendleft(("text", fmt.obs_end, Role.PROMPT, True))
            return end

        def on_assess(ln, stopped):
            gen_ids = ln.ids[ln.gen_start:]
            ln.rec["assessment"] = self._decode(gen_ids[:-1] if stopped else gen_ids).strip()

        def on_proposal(ln, stopped):
            gen_ids = ln.ids[ln.gen_start:]
            ln.rec["tokens"], ln.rec["logprobs"] = list(gen_ids), list(ln.logprobs[ln.gen_start:])
            ln.rec["terminated"] = stopped
            text = self._decode(gen_ids[:-1] if stopped else gen_ids)
            parsed = fmt.parse(text, self.task.tools)
            ln.rec["raw"], ln.rec["content"] = text, parsed.content
            if not stopped or not parsed.items:
                return                                   # an answer (or a cut-off turn): nothing to rehearse
            for kind, value in fmt.tool_turn(len(parsed.items)):
                item = parsed.items[value] if kind == "response" else None
                if kind == "text":
                    ln.plan.append(("text", value, Role.PROMPT, True))
                elif isinstance(item, CallError):
                    obs = item.observation()
                    ln.rec["items"].append({"error": f"{item.kind}: {item.message}", "predicted": obs})
                    ln.plan.append(("text", fmt.response_text(obs), Role.OBS, False))
                    ln.plan.append(("text", fmt.obs_end, Role.PROMPT, True))
                else:
                    ln.rec["items"].append({"name": item.name, "arguments": item.arguments, "predicted": ""})
                    ln.plan.append(("gen", Role.WORLD, cfg.max_world_tokens, on_world(len(ln.rec["items"]) - 1)))
            ln.plan.append(("text", ASSESS_PREFIX, Role.PROMPT, False))
            ln.plan.append(("gen", Role.ACT, self.rcfg.max_assess_tokens, on_assess))

        line.plan.append(("gen", Role.ACT, cfg.max_new_tokens, on_proposal))
        line.advance()
        return line

    def rehearse_turn(self, kv: _KV, ids: list[int], ctx_logits, gen):
        """Private rehearsals from the committed context `ids` (all cached in kv, batch 1).

        Returns (records, memory_ids, direct): direct is (tokens, logprobs) of a proposal to commit as is,
        or None when the committed turn must be generated from the memory. kv is left at len(ids).
        """
        rcfg, n = self.rcfg, len(ids)
        if rcfg.mode == "parallel":
            branch = kv.fork(rcfg.budget)
            lines = [self.private_line(1 + j, ids, n) for j in range(rcfg.budget)]
            _drive(self.eng, branch, lines, ctx_logits.repeat(rcfg.budget, 1), self.cfg, gen, self.steer,
                   self.stats, "private", self.max_len)
            del branch
            records = [ln.rec for ln in lines]
            if not any(r["items"] for r in records):
                return records, [], (records[0]["tokens"], records[0]["logprobs"])
            return records, self.eng.fmt.encode_text(memory_text(records, rcfg.memory_chars)), None
        records, memory_ids = [], []
        for _ in range(rcfg.budget):
            memory = memory_text(records, rcfg.memory_chars)
            memory_ids = self.eng.fmt.encode_text(memory) if memory else []
            line = self.private_line(1, ids + memory_ids, n, memory)
            _drive(self.eng, kv, [line], None if memory_ids else ctx_logits, self.cfg, gen, self.steer,
                   self.stats, "private", self.max_len)
            kv.crop(n)
            records.append(line.rec)
            if not line.rec["items"]:          # an answer, sampled from the context + the memory so far
                return records, memory_ids, (line.rec["tokens"], line.rec["logprobs"])
        return records, self.eng.fmt.encode_text(memory_text(records, rcfg.memory_chars)), None

    def probe(self, kv: _KV, row, pending: list, gen) -> str:
        """Let the policy write the response of the call about to be executed, on a branch then discarded.

        pending: the scaffolding text the engine will append before the response (not yet in row.ids)."""
        committed = len(row.ids)
        logits = kv.feed([row], self.stats, "act") if row.n_cached < committed else None   # committed tokens
        line = _Line(self.eng.fmt, -1, row.ids, committed)
        out = {}

        def end(ln, stopped):
            out["text"] = self.eng.rehearsal_text(ln.ids[ln.gen_start:], stopped)[0]

        line.plan.extend(("text", *piece) for piece in pending)
        line.plan.append(("gen", Role.WORLD, self.cfg.max_world_tokens, end))
        line.advance()
        fresh = len(line.ids) > committed          # the scaffolding before the response, fed on the branch
        _drive(self.eng, kv, [line], None if fresh else logits, self.cfg, gen, self.steer, self.stats, "fidelity",
               self.max_len)
        kv.crop(committed)
        row.n_cached = committed
        return out.get("text", "")


@torch.inference_mode()
def act(eng, task, cfg=None, env=None, rcfg: RehearsalConfig | None = None, steer=None) -> Episode:
    """One committed trajectory on the real environment `env`, with private rehearsal before each turn."""

    cfg = eng.cfg = cfg or SamplingConfig()
    rcfg = rcfg or RehearsalConfig()
    max_len = min(cfg.max_total_len, getattr(eng.model.config, "max_position_embeddings", cfg.max_total_len))
    stats = {"seconds": 0.0, "private_seconds": 0.0, "fidelity_seconds": 0.0, "committed_turns": 0,
             "rehearsed_turns": 0, "rehearsals": 0, "memory_tokens": 0, "refed_tokens": 0}
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)               # committed turns: as Engine.run
    pgen = torch.Generator(device="cpu").manual_seed(cfg.seed + 7919)       # private branches
    fgen = torch.Generator(device="cpu").manual_seed(cfg.seed + 104729)     # fidelity probes
    t_start = time.perf_counter()
    row = rollout._Row(0, 0, task, env, eng.prompt_ids(task))
    helper = _Rehearser(eng, task, cfg, rcfg, steer, max_len, stats)
    episode = Episode(rollout=None, stats=stats)
    kv = _KV(eng)
    if len(row.ids) >= max_len:
        row.traj.errors.append(f"context_too_long: the prompt has {len(row.ids)} tokens, limit {max_len}")
        row.finish("max_length")
    else:
        row.n_cached = 0
        ctx_logits = kv.feed([row], stats, "act")
    while not row.done:
        n = len(row.ids)                        # committed length; everything is cached, ctx_logits is next
        memory_ids, direct = [], None
        if rcfg.budget > 0:
            t0 = time.perf_counter()
            records, memory_ids, direct = helper.rehearse_turn(kv, row.ids, ctx_logits, pgen)
            stats["private_seconds"] += time.perf_counter() - t0
            episode.rehearsals.append(records)
            n_reh = sum(1 for r in records if r["items"])
            stats["rehearsals"] += n_reh
            stats["rehearsed_turns"] += bool(n_reh)
            stats["memory_tokens"] += len(memory_ids)
        if direct is not None:
            tokens, lps = direct               # kv holds the committed context only: the tokens are fed next
            stats["refed_tokens"] += max(len(tokens) - 1, 0)
        else:
            line = _Line(eng.fmt, 0, row.ids + memory_ids, n)
            line.plan.append(("gen", Role.ACT, cfg.max_new_tokens, None))
            line.advance()
            _drive(eng, kv, [line], None if memory_ids else ctx_logits, cfg, gen, steer, stats, "act",
                   max_len + len(memory_ids))
            tokens, lps = line.ids[line.gen_start:], line.logprobs[line.gen_start:]
            if memory_ids:                     # drop the memory: back to the committed length
                kv.crop(n)
                stats["refed_tokens"] += max(len(tokens) - 1, 0)
            else:
                row.n_cached = n + len(tokens) - 1
        if memory_ids or direct is not None:
            row.n_cached = n
        stats["committed_turns"] += 1
        row.append(tokens, Role.ACT, lps)
        stopped = tokens[-1] in eng.fmt.stop_ids
        if stopped or len(tokens) >= cfg.max_new_tokens:
            eng._end_act(row, stopped, None)
            _advance(eng, helper, kv, row, rcfg, fgen, episode)
        if not row.done and len(row.ids) >= max_len:
            row.traj.errors.append(f"context_too_long: the trajectory reached max_total_len={max_len}")
            row.truncate(max_len)
            row.finish("max_length")
        if not row.done:
            ctx_logits = kv.feed([row], stats, "act")
    stats["seconds"] = time.perf_counter() - t_start
    for key in ("act_sampled", "act_fed", "private_sampled", "private_fed", "fidelity_sampled", "fidelity_fed"):
        stats.setdefault(key, 0)
    stats["committed_calls"] = len(row.traj.calls)
    # extra work over plain acting on the same committed sequence, which samples each ACT token once and
    # feeds each cached committed token once (fidelity probes are reported apart)
    stats["extra_sampled"] = stats["act_sampled"] + stats["private_sampled"] - row.roles.count(int(Role.ACT))
    stats["extra_fed"] = stats["act_fed"] + stats["private_fed"] - row.n_cached
    stats["extra_tokens"] = stats["extra_sampled"] + stats["extra_fed"]
    episode.rollout = eng._collect([row], {k: v for k, v in stats.items()})
    return episode


def _advance(eng, helper, kv, row, rcfg, fgen, episode):
    """rollout.Engine._start_next for real calls, with a discarded fidelity probe before each execution."""

    def probe_then_execute(row, index, pending):
        predicted = None
        if rcfg.fidelity:
            t0 = time.perf_counter()
            predicted = helper.probe(kv, row, pending, fgen)
            helper.stats["fidelity_seconds"] += time.perf_counter() - t0
        text = eng.execute_call(row, row.traj.calls[index])
        if predicted is not None:
            call = row.traj.calls[index]
            episode.fidelity.append({"call": {"name": call.name, "arguments": call.arguments},
                                     "predicted": predicted, "real": text, **fidelity(predicted, text)})
        return text

    eng._start_next(row, execute=probe_then_execute)

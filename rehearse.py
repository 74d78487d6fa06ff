"""Rehearsal at test time: private rehearsals before each committed turn (the world model's fidelity and the
rehearsal diagnostics are diagnostics.py; the warm-start examples that teach the formats, warm_start.py).

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

from chat_format import ASSESS_PREFIX, MEMORY_HEAD, MEMORY_TAIL, CallError, assessment_verdict, validate_rehearsal
from diagnostics import fidelity, is_error_text, replay_call, replayed_env
from kvbatch import KVBatch
from rollout import (Generate, Response, Role, Row, SamplingConfig, Spawn, Text, current_tools, derive_seed,
                     tool_turn_plan)

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
# Every private sequence is a child row of the committed row in the engine's one decode loop (rollout.Spawn):
# a child starts from the committed context's cache (its batch row is repeated, nothing is recomputed),
# runs its own plan, and leaves the batch when done; the committed row waits meanwhile.
# parallel:   `budget` proposals from the same committed context at once (`budget` child rows).
# sequential: one proposal at a time; proposal k starts from the committed context plus the memory of
#             rehearsals 1..k-1 (so it sees the earlier predictions and assessments).
#
# The rehearsal memory (memory_text) is a short plain-text block that the committed assistant turn STARTS
# with: a last child row holds the committed context + the memory and samples the committed turn; only those
# sampled tokens are appended to the committed row (fed to it next step). Why there and not as a user-role
# note: (1) the committed context already ends with the generation header, so the branch point is exactly
# the committed length and needs no template surgery; (2) the model reads the notes as its own (like a
# thinking block), which conditions the next tokens most directly; (3) the committed row never holds the
# memory, so the kept context is token-for-token what plain acting with that turn would hold.
# The memory is removed: the committed token sequence never contains it, nor any WORLD token; the
# environment executes only committed calls, and user_turn sees only the committed turn's text.
# (The committed tokens' recorded log-probs are those under the memory-conditioned context.)
#
# What is committed (RehearsalConfig.commit): "checked" (the default) commits the first proposal judged ok
# (RehearsalConfig.judge), its own tokens (parallel: the first such of the round; sequential: the rounds stop at
# the first ok), and regenerates under the memory only when every proposal is judged to fail; "memory" always
# regenerates (the behaviour before, kept for comparison: it changed the committed call on about half the
# rehearsed turns of the tiny model and halved its success at B=1).
#
# A proposal without any call is an answer, not a rehearsal: nothing of it can be rehearsed or fail in the
# world, so "checked" treats it as passing. Parallel: the first proposal in order that is an answer or judged
# ok is committed (an answer ahead of a checked call keeps B=0's answer; committing the call instead replaced
# right answers with extra calls); "memory" commits an answer only when no proposal calls a tool. Sequential:
# the latest proposal, if an answer, is committed as is (sampled from the committed context plus the memory). Budget 0 is plain acting, token for
# token what Engine.run(responses="real") produces for the same seed. The first proposal of a turn samples
# from the committed row's own stream (its rehearsal and assessment from one of their own), so where it is
# committed the episode stays B=0's token for token: B vs B=0 differs only on the turns rehearsal changed
# (with proposals from streams of their own, every rehearsed turn was a fresh draw, and the paired
# difference carried that sampling noise on every task).
#
# Costs are counted per bucket: "act" (the committed row, the memory and the re-fed committed tokens),
# "private" (proposals, rehearsals, assessments) and "fidelity" (the discarded world-model probes); a
# step's wall time is split over its rows by the tokens each fed or sampled.
#
# Many tasks run as rows of one batch (act_many, used by evaluate.py): rows sample from generators seeded
# by their own task's seed, turn and branch, so every episode equals its run alone.

MODES = ("parallel", "sequential")
WORLDS = ("model", "oracle")      # who writes a private rehearsal's responses: the world model | the real
                                  # environment on a rebuilt copy (evaluation only: the headroom of B > 0)
JUDGES = ("assessment", "prediction")   # what judges a proposal for commit "checked": the policy's own
                                        # assessment text | the rehearsed response (ok unless it is an error)
COMMITS = ("checked", "memory")   # what a rehearsed turn commits: the proposal judged ok | a turn regenerated
                                  # under the rehearsal memory (every time: the behaviour before "checked")


@dataclass
class RehearsalConfig:
    """Test-time rehearsal settings: the budget of private rehearsals per committed turn, parallel or sequential,
    assessment and memory lengths, the fidelity probe, and what a rehearsed turn commits."""
    budget: int = 0                 # private rehearsals before each committed turn; 0 = plain acting
    mode: str = "parallel"          # "parallel" or "sequential"
    max_assess_tokens: int = 48
    memory_chars: int = 240         # each predicted response / assessment is cut to this many characters
    fidelity: bool = False          # probe the world model on every real call (a discarded WORLD branch)
    commit: str = "checked"         # checked: commit the first proposal judged ok (judge), token for
                                    # token; regenerate under the memory only when none does. memory: always
                                    # regenerate under the memory
    judge: str = "prediction"       # "checked"'s test: the rehearsed responses hold no error (the world model's
                                    # prediction alone) | "assessment": the policy's own assessment says ok
    world: str = "model"            # oracle: a real environment, rebuilt to the committed state, answers the
                                    # rehearsed calls instead of the world model (needs act_many's oracle_env)

    def __post_init__(self):
        if self.judge not in JUDGES:
            raise ValueError(f"rehearsal judge must be one of {', '.join(JUDGES)}, not {self.judge!r}")
        if self.world not in WORLDS:
            raise ValueError(f"rehearsal world must be one of {', '.join(WORLDS)}, not {self.world!r}")
        if self.mode not in MODES:
            raise ValueError(f"rehearsal mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.commit not in COMMITS:
            raise ValueError(f"rehearsal commit must be one of {', '.join(COMMITS)}, not {self.commit!r}")
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


# -- one committed episode per task, its private rehearsals as child rows of the one decode loop -------------

@dataclass
class Episode:
    """One committed episode: its single-row rollout, the private rehearsal records per committed turn, the
    fidelity probes per real call, its stats and every private row's final token ids."""
    rollout: object                  # rollout.Rollout with the single committed row
    rehearsals: list = field(default_factory=list)   # per committed turn: list of private records
    fidelity: list = field(default_factory=list)     # per real call: {"call", "predicted", "real", **fidelity()}
    stats: dict = field(default_factory=dict)
    private_contexts: list = field(default_factory=list)  # every private row's token ids as it ended, in order

    @property
    def trajectory(self):
        """The committed row's trajectory."""
        return self.rollout.trajectories[0]


class Rehearser:
    """The hooks of one committed row (rollout.RowHooks, set as Row.hooks): private rehearsals before each committed turn and
    a discarded world-model probe before each real call. Each is a Spawn of child rows in the engine's decode
    loop: branches fork the committed context's cache, run their own plans, and leave the batch when done."""

    def __init__(self, eng, task, cfg: SamplingConfig, rcfg: RehearsalConfig, episode: Episode, oracle_env=None):
        self.eng, self.task, self.cfg, self.rcfg, self.episode = eng, task, cfg, rcfg, episode
        self.oracle_env = oracle_env    # make_env(task) of a fresh real environment (rcfg.world == "oracle")
        # committed turns sample as Engine.run's row 0 does; probes from a stream of their own
        self.fidelity_rng = torch.Generator(device="cpu").manual_seed(cfg.seed + 104729)
        self.predicted: dict[int, str] = {}

    # -- private rehearsal before a committed turn ------------------------------------------------------------

    def before_turn(self, row: Row, item: Generate) -> Spawn | None:
        """RowHooks.before_turn: at budget B > 0, B private branches (parallel) or one at a time (sequential),
        each proposing a call, rehearsing its response and assessing it; then the committed turn."""
        self.episode.stats["committed_turns"] += 1
        if self.rcfg.budget == 0:
            return None
        records: list[dict] = []
        self.episode.rehearsals.append(records)
        turn = len(self.episode.rehearsals)
        if self.rcfg.mode == "parallel":
            return Spawn(lambda r: [self.private_branch(r, turn, k, 1 + k, "") for k in range(self.rcfg.budget)],
                         lambda r: self._after_parallel(r, records))
        return self._sequential(records, turn)

    def _sequential(self, records, turn) -> Spawn:
        memory = memory_text(records, self.rcfg.memory_chars)
        return Spawn(lambda r: [self.private_branch(r, turn, len(records), 1, memory)],
                     lambda r: self._after_sequential(r, records, turn))

    def _children(self, row: Row) -> list[Row]:
        children = row.record.pop("children")
        self.episode.private_contexts += [list(c.ids) for c in children]
        return children

    def _after_parallel(self, row: Row, records: list[dict]):
        records += [c.record for c in self._children(row)]
        self._count(records)
        if not any(r["items"] for r in records):     # no proposal calls a tool: commit the first answer as is
            return self._commit(row, records[0]["tokens"], records[0]["logprobs"])
        if self.rcfg.commit == "checked":            # the first proposal, in order, that is an answer (nothing
            first = next((r for r in records if not r["items"] or self._judged_ok(r)), None)   # to rehearse)
            if first is not None and not first["items"]:          # or was judged ok, token for token
                return self._commit(row, first["tokens"], first["logprobs"])
            if first is not None:
                return self._commit_checked(row, first)
        row.spawn = self._commit_from_memory(memory_text(records, self.rcfg.memory_chars))

    def _after_sequential(self, row: Row, records: list[dict], turn: int):
        records += [c.record for c in self._children(row)]
        if not records[-1]["items"]:                 # an answer, sampled from the context + the memory so far
            self._count(records)
            return self._commit(row, records[-1]["tokens"], records[-1]["logprobs"])
        if self._judged_ok(records[-1]):             # stop at the first proposal judged ok and commit it
            self._count(records)
            return self._commit_checked(row, records[-1])
        if len(records) < self.rcfg.budget:
            row.spawn = self._sequential(records, turn)
            return
        self._count(records)
        row.spawn = self._commit_from_memory(memory_text(records, self.rcfg.memory_chars))

    def _judged_ok(self, record: dict) -> bool:
        """A proposal that called a tool, ended on its own and is judged ok (commit "checked"): judge "prediction",
        none of its calls is malformed and no rehearsed response is an error; "assessment", its assessment says ok."""
        if not (self.rcfg.commit == "checked" and bool(record["items"]) and record["terminated"]):
            return False
        if self.rcfg.judge == "prediction":
            return not any("error" in item or is_error_text(item["predicted"]) for item in record["items"])
        return assessment_verdict(record["assessment"]) == "ok"

    def _commit_checked(self, row: Row, record: dict):
        self.episode.stats["committed_checked"] += 1
        self._commit(row, record["tokens"], record["logprobs"])

    def _count(self, records):
        stats, n_reh = self.episode.stats, sum(1 for r in records if r["items"])
        stats["rehearsals"] += n_reh
        stats["rehearsed_turns"] += bool(n_reh)

    def private_branch(self, parent: Row, turn: int, k: int, stream: int, memory: str) -> Row:
        """A branch that proposes a turn, rehearses each call's response and assesses the outcome."""
        eng, fmt, cfg = self.eng, self.eng.fmt, self.cfg
        line = parent.fork(stream, derive_seed(cfg.seed, "private", turn, k), "private")
        first = k == 0 and not memory
        if first:      # the first proposal is the turn B=0 samples: the committed stream, so committing it
            line.rng = parent.rng          # leaves the episode token for token as without rehearsal
        parent.record.setdefault("children", []).append(line)
        line.record = {"content": "", "raw": "", "items": [], "assessment": "", "terminated": False, "tokens": [],
                       "seen_memory": memory}

        def on_world(index):
            def end(ln, stopped):
                text, on_tag = eng.rehearsal_text(ln.ids[ln.gen_start:], stopped)
                ln.record["items"][index].update(predicted=text, defects=validate_rehearsal(text, on_tag))
                if not on_tag:
                    ln.plan.appendleft(Text(fmt.obs_end, Role.PROMPT))
            return end

        def on_assess(ln, stopped):
            gen_ids = ln.ids[ln.gen_start:]
            ln.record["assessment"] = self._decode(gen_ids[:-1] if stopped else gen_ids).strip()

        def on_proposal(ln, stopped):
            if first:                      # its rehearsal and assessment draw from a stream of their own
                ln.rng = torch.Generator(device="cpu").manual_seed(derive_seed(cfg.seed, "private", turn, k))
            gen_ids = ln.ids[ln.gen_start:]
            ln.record["tokens"], ln.record["logprobs"] = list(gen_ids), list(ln.logprobs[ln.gen_start:])
            ln.record["terminated"] = stopped
            text = self._decode(gen_ids[:-1] if stopped else gen_ids)
            parsed = fmt.parse(text, current_tools(parent))     # the tools revealed so far (BFCL miss_func)
            ln.record["raw"], ln.record["content"] = text, parsed.content
            if not stopped or not parsed.items:
                return                                   # an answer (or a cut-off turn): nothing to rehearse
            oracle = self._oracle(parent) if self.rcfg.world == "oracle" else None

            def respond(_, item):
                if isinstance(item, CallError):
                    obs = item.observation()
                    ln.record["items"].append({"error": f"{item.kind}: {item.message}", "predicted": obs})
                    return [Text(fmt.response_text(obs), Role.OBS, False), Text(fmt.obs_end, Role.PROMPT)]
                if oracle is not None:                   # the real response on the rebuilt copy, in order
                    obs = replay_call(oracle, item.name, item.arguments)
                    ln.record["items"].append({"name": item.name, "arguments": item.arguments, "predicted": obs,
                                               "oracle": True})
                    return [Text(fmt.response_text(obs), Role.OBS, False), Text(fmt.obs_end, Role.PROMPT)]
                ln.record["items"].append({"name": item.name, "arguments": item.arguments, "predicted": ""})
                return [Generate(Role.WORLD, cfg.max_world_tokens, on_end=on_world(len(ln.record["items"]) - 1))]
            ln.plan.extend(tool_turn_plan(fmt, parsed.items, respond))
            ln.plan.append(Text(ASSESS_PREFIX, Role.PROMPT, False))
            ln.plan.append(Generate(Role.ACT, self.rcfg.max_assess_tokens, on_end=on_assess))

        if memory:
            line.plan.append(Text(memory, Role.PROMPT, False))
        line.plan.append(Generate(Role.ACT, cfg.max_new_tokens, on_end=on_proposal))
        return line

    def _oracle(self, row: Row):
        """A real environment in the committed row's current state (the executed calls replayed on a fresh
        one), or None where it cannot be rebuilt: the world model writes that proposal's responses then, and
        stats["oracle_unavailable"] counts it."""
        env = replayed_env(self.oracle_env, self.task, row.traj, turn=10**9) if self.oracle_env else None
        if env is None:
            self.episode.stats["oracle_unavailable"] = self.episode.stats.get("oracle_unavailable", 0) + 1
        return env

    def _commit_from_memory(self, memory: str) -> Spawn:
        """The committed turn, generated after the memory on a branch; the committed row gets its tokens only
        (the memory never enters the committed sequence)."""
        def make(parent):
            line = parent.fork(0, 0, "act")
            line.rng = parent.rng                       # the committed stream, as without rehearsal
            line.extra_len = len(self.eng.fmt.encode_text(memory))
            parent.record.setdefault("children", []).append(line)
            line.plan += [Text(memory, Role.PROMPT, False), Generate(Role.ACT, self.cfg.max_new_tokens,
                                                                     on_end=lambda ln, stopped: None)]
            return [line]

        def then(parent):
            line = self._children(parent)[0]
            self.episode.stats["memory_tokens"] += line.gen_start - len(parent.ids)
            self._commit(parent, line.ids[line.gen_start:], line.logprobs[line.gen_start:])
        return Spawn(make, then)

    def _commit(self, row: Row, tokens: list[int], logprobs: list[float]):
        """Append a committed turn sampled elsewhere (its tokens are fed to the committed row next step) and
        apply the turn transition exactly as if the row had sampled it."""
        self.episode.stats["refed_tokens"] += max(len(tokens) - 1, 0)
        row.gen, row.gen_start = Generate(Role.ACT, self.cfg.max_new_tokens), len(row.ids)
        row.append(tokens, Role.ACT, logprobs)
        stopped = tokens[-1] in self.eng.fmt.stop_ids
        if stopped or len(tokens) >= self.cfg.max_new_tokens:
            self.eng.end_act(row, stopped, self.cfg, None)
        else:
            row.gen = None

    # -- the world-model probe before a real call --------------------------------------------------------------

    def before_response(self, row: Row, item: Response) -> Spawn | None:
        """RowHooks.before_response: with fidelity on, a discarded probe writes the world model's prediction of
        the call's response before the real one is applied."""
        if not self.rcfg.fidelity:
            return None

        def end(probe, stopped):    # the engine says whether the segment stopped; nothing re-derives it
            self.predicted[item.call] = self.eng.rehearsal_text(probe.ids[probe.gen_start:], stopped)[0]

        def make(parent):
            probe = parent.fork(-1, 0, "fidelity")
            probe.rng = self.fidelity_rng
            parent.record.setdefault("children", []).append(probe)
            probe.plan += [copy.copy(t) for t in parent.pending]
            probe.plan.append(Generate(Role.WORLD, self.cfg.max_world_tokens, on_end=end))
            return [probe]

        return Spawn(make, lambda parent: self._children(parent))

    def after_response(self, row: Row, index: int, text: str):
        """RowHooks.after_response: the probe's prediction against the real response (episode.fidelity)."""
        if index in self.predicted:
            call = row.traj.calls[index]
            predicted = self.predicted.pop(index)
            self.episode.fidelity.append({"call": {"name": call.name, "arguments": call.arguments},
                                          "predicted": predicted, "real": text, **fidelity(predicted, text)})

    def _decode(self, ids):
        return self.eng.tok.decode(ids, skip_special_tokens=False)


@dataclass
class EpisodeSpec:
    """One committed trajectory to run: its task, sampling config (seed included) and real environment
    (`env`, or `make_env(task)` called when the episode starts)."""
    task: object
    cfg: SamplingConfig
    env: object = None
    make_env: object = None


@torch.inference_mode()
def act_many(eng, specs, rcfg: RehearsalConfig | None = None, steer=None, max_rows: int = 64, on_done=None,
             progress=None, world_model=None, memory_budget: int | None = None, oracle_env=None) -> list[Episode]:
    """Committed trajectories for many tasks in one engine batch: each task's committed row and its private
    branches are rows of the same decode loop; tasks join as rows leave, holding at most ~max_rows
    KV-cache rows (a task holds up to max(1, budget) at once in parallel mode, 1 in sequential mode: the
    committed row lends its own to a branch while it waits). Results equal running each spec alone (greedy:
    the same tokens; sampled: each row samples from generators seeded by its own spec). on_done(i, episode)
    as each one ends.
    world_model: another model writes every WORLD segment (private rehearsals, fidelity probes), as a
    per-role run's trained world model (Engine.run's argument of the same name).
    oracle_env: make_env(task) of the benchmark (no simulated user), for rcfg.world == "oracle".
    memory_budget: bytes for KV-cache rows (None: kvbatch.memory_budget_bytes, half the free memory); max_rows
    is lowered to the rows that fit (kvbatch.memory_rows), so a large batch waits instead of running out."""
    rcfg = rcfg or RehearsalConfig()
    if rcfg.world == "oracle" and oracle_env is None:
        raise ValueError("rehearsal world 'oracle' needs oracle_env (the benchmark's make_env)")
    specs = list(specs)
    if specs:
        max_rows = min(max_rows, eng.rows_that_fit(specs[0].cfg, memory_budget))
    if len({json.dumps({**s.cfg.__dict__, "seed": 0}, sort_keys=True) for s in specs}) > 1:
        raise ValueError("act_many runs specs whose sampling configs differ only in their seeds")
    episodes: list[Episode | None] = [None] * len(specs)
    queue = deque(range(len(specs)))
    live: dict[int, tuple] = {}
    per_task = max(1, rcfg.budget) if rcfg.mode == "parallel" else 1

    def start(i):
        spec = specs[i]
        stats = {"seconds": 0.0, "act_seconds": 0.0, "private_seconds": 0.0, "fidelity_seconds": 0.0,
                 "committed_turns": 0, "rehearsed_turns": 0, "rehearsals": 0, "memory_tokens": 0, "refed_tokens": 0,
                 "committed_checked": 0}
        ep = Episode(rollout=None, stats=stats)
        env = spec.make_env(spec.task) if spec.make_env is not None else spec.env
        row = Row(spec.task, eng.prompt_ids(spec.task), env, task_idx=i, stream=0, seed=spec.cfg.seed,
                  counts=stats)
        row.hooks = Rehearser(eng, spec.task, spec.cfg, rcfg, ep, oracle_env)
        row.plan.append(Generate(Role.ACT, spec.cfg.max_new_tokens))
        eng.advance(row)
        live[i] = (row, ep, time.perf_counter())
        return row

    def admit(n_rows):
        joining = []
        while queue and (n_rows + len(joining) * per_task + per_task <= max(max_rows, per_task) or not n_rows
                         and not joining):
            joining.append(start(queue.popleft()))
        return joining

    def finished():
        for i, (row, ep, t0) in list(live.items()):
            if row.done:
                del live[i]
                episodes[i] = _close(eng, row, ep, time.perf_counter() - t0)
                if on_done is not None:
                    on_done(i, episodes[i])

    cfg = specs[0].cfg if specs else SamplingConfig()
    batch = KVBatch(eng.model, eng.tok.pad_token_id, world_model=world_model)
    eng.decode(batch, cfg, None, steer, admit=lambda n: (finished(), admit(n))[1], progress=progress)
    finished()
    return episodes


def _close(eng, row: Row, ep: Episode, seconds: float) -> Episode:
    stats = ep.stats
    for key in ("act_sampled", "act_fed", "private_sampled", "private_fed", "fidelity_sampled", "fidelity_fed"):
        stats.setdefault(key, 0)
    # seconds: this episode's share of the batch's step times (the steps split by tokens fed or sampled), so
    # the episodes of one batch add up to its wall time; wall_seconds: from its start to its end (overlapping)
    stats["wall_seconds"] = seconds
    stats["seconds"] = stats["act_seconds"] + stats["private_seconds"] + stats["fidelity_seconds"]
    stats["committed_calls"] = len(row.traj.calls)
    # extra work over plain acting on the same committed sequence, which samples each ACT token once and
    # feeds each committed token once (fidelity probes are reported apart): the private branches' tokens, the
    # memory fed before a regenerated turn and the committed tokens fed again after it. A prompt head shared
    # by several tasks is prefilled once and charged once, to the first task's act bucket: never extra.
    stats["extra_sampled"] = max(0, stats["act_sampled"] + stats["private_sampled"] - row.roles.count(int(Role.ACT)))
    stats["extra_fed"] = stats["private_fed"] + stats["memory_tokens"] + stats["refed_tokens"]
    stats["extra_tokens"] = stats["extra_sampled"] + stats["extra_fed"]
    ep.rollout = eng.collect([row], {k: v for k, v in stats.items()})
    return ep


def act(eng, task, cfg=None, env=None, rcfg: RehearsalConfig | None = None, steer=None) -> Episode:
    """One committed trajectory on the real environment `env`, with private rehearsal before each turn."""
    return act_many(eng, [EpisodeSpec(task, cfg or SamplingConfig(), env)], rcfg, steer)[0]

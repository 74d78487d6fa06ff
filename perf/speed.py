"""Speed and memory of the pieces that make agentic RL fast: one run, reported as ratios.

    python -m perf.speed                 # CPU default (~13 minutes on 2 cores), writes runs/speed/speed.json
    python -m perf.speed --workloads toyworld   # without the tau2 workload (~3 minutes)
    python -m perf.speed --targets       # only the targets' cells (8 tasks x G=4, 8 turns; ~30 min on 2 cores)
    python -m perf.speed --quick         # CPU, under a minute
    python -m perf.speed --smoke --arch qwen3-test   # seconds: the test suite's run of the --gpu code path
    python -m perf.speed --gpu           # bf16, real-size random-weight Qwen3 config, SDPA vs flash-attn
    bash perf/speed_gpu.sh               # the same, the way it is meant to run on one H200-class GPU

1. rollout   Multi-turn rollout throughput at 1/4/8/16 turns and several group sizes (one task), plus the
             row counts training uses (8 tasks x G=4 = 32 rows, 8 turns), four ways, on the same model and the
             same sampled token ids (greedy + a scripted steering hook, perf/steering.Script):
               cached   rollout.Engine: the KV cache is kept across turns, only new tokens are ever fed
               hf       HF `model.generate` once per turn on the re-encoded full context, then the turn's
                        tokens and the observation are appended (what TRL's transformers path does)
               rowcache HF `model.generate` once per row and turn, each row keeping its DynamicCache between
                        turns and passing its full ids, so only new tokens are prefilled; each task's prompt
                        prefilled once and its cache copied to the group (what an informed HF user writes for
                        ragged rows: the strongest CPU peer here)
               nocache  Engine.run(use_cache=False): every sampling step re-encodes every row
             --compile adds the engine with its decode forwards through torch.compile (DecodeCompiled).
             Two workloads, every call executed by the real environment:
               toyworld the embedded toy world: ~100-token prompts, ~20-token observations; each assistant
                        turn is get_balance with a model-chosen account (free slots), the last a short answer
               tau2     a real tau2 airline task: the package's agent prompt (policy + 14 tool schemas, ~20k
                        characters, ~8.4k tokens of the tiny tokenizer), each turn two model-chosen tokens then
                        the task's next reference call with its real arguments, executed by the package's
                        environment (observations of ~50-730 tokens): the context sizes the paper trains on
             `hf` appends exactly the scaffolding + observation tokens the cached run produced (no parsing or
             environment work is timed for it, which favours it) and we check that the ids it generates
             itself are identical to the cached run's.
             Counted for every method: wall seconds, sampled tokens/s, positions processed (every position of
             every forward, padding included) and forward FLOPs (every nn.Linear, plus dense attention
             4 * layers * B * Q * K * heads * head_dim).
             The limit: every decode step (one new token per row) is timed and set against the weight-streaming
             bound, weight bytes read per forward / memory bandwidth, the bandwidth measured in the same run
             (best of 5 sums and copies of a 512 MiB tensor; 4 GiB on GPU). bound w = that bound's share of the
             measured decode time (1.0 = at the limit); w+kv also counts the KV cache each step reads.
             Targets (TARGETS) are printed as this run's ratios, met / not met.
2. logprob   Peak memory of grpo.token_logprobs (chunked, role-masked, checkpointed LM head) vs a naive full
             log_softmax over [T, V], forward + backward, vocab 32k and 152k, sequence 4k-16k, a 2-layer model
             with small hidden. Each measurement runs in a fresh subprocess: on CPU the peak is
             ru_maxrss(after) - ru_maxrss(before the measured step); on GPU torch.cuda.max_memory_allocated
             minus what was allocated before. Values and gradients of the two are compared (max abs diff).
             Naive cases that would not fit in memory are skipped with a note.
3. grpo      One GRPO step on toyworld split into rollout / reward / log-prob / backward / optimizer, written
             inline with train.py's and reward.py's functions.

Tables are printed; everything is written as JSON (--out). No number here is asserted anywhere.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import policy
import reward
from kvbatch import peak_rss_bytes, reset_peak_rss, rss_bytes
from grpo import LossConfig, group_advantages, grpo_loss, token_logprobs
from bench import toyworld
from perf.steering import Script, call_text
from grpo import role_mask
from roles import Role
from rollout import Engine, SamplingConfig

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------------------------------------
# Run sizes

# ~11M parameters (hidden 384, 6 layers, vocab 4096): the small end of the 10-50M range, which is the
# conservative end for the cached/hf ratio (a bigger model makes re-encoding relatively more expensive).
# Positions up to 32k: the tau2 workload's contexts reach ~13k tiny-tokenizer tokens at 8 turns.
CPU_MODEL = policy.TinyConfig(hidden_size=384, intermediate_size=1152, num_hidden_layers=6,
                              num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                              max_position_embeddings=32768)
QUICK_MODEL = policy.TinyConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=64, corpus_tasks=300,
                                vocab_size=2048, max_position_embeddings=32768)

# Real Qwen3 architectures (random weights: nothing is downloaded), vocab 151936.
ARCHS = {
    # a toy of the same construction, so the CPU smoke test runs the --gpu code path (random weights, vocab 151936)
    "qwen3-test": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
}
QWEN3_VOCAB = 151936

PRESETS = {
    # rollout: per workload, the turns and group sizes measured (rows = tasks * group) and the (turns, group)
    # cells also run without a cache; logprob: (vocab, seq) cells; arch_vocab: the smoke test runs the --gpu
    # construction with a smaller vocab, to stay fast on CPU
    "smoke": dict(rollout={"toyworld": dict(turns=[1, 2], groups=[2], nocache=[(1, 2)],
                                            cells=[dict(tasks=2, group=2, turns=2)]),
                           "tau2": dict(turns=[2], groups=[2], nocache=[])},
                  tasks=1, logprob=[(4096, 512)], logprob_hidden=64, arch_vocab=8192, bandwidth_mib=64, matmul_n=256,
                  grpo_tasks=1, grpo_group=2, grpo_steps=1, grpo_warmup=0),
    "quick": dict(rollout={"toyworld": dict(turns=[1, 4], groups=[4], nocache=[(1, 4)])},
                  tasks=1, logprob=[(32768, 2048)], logprob_hidden=64,
                  grpo_tasks=2, grpo_group=2, grpo_steps=1, grpo_warmup=0),
    # nocache re-encodes every row at every step: 4 turns already cost ~100x the cached run, so it stops there.
    # tau2's HF baseline re-encodes ~9-13k tokens per row and turn (~25-45 s a turn at G=4 on 2 cores): G=4 only.
    # + the targets' cells (TARGET_CELLS), at the row counts training uses: 8 tasks x G=4
    "default": dict(rollout={"toyworld": dict(turns=[1, 4, 8, 16], groups=[4, 16], nocache=[(1, 4), (4, 4)],
                                              cells=[dict(tasks=8, group=4, turns=8)]),
                             "tau2": dict(turns=[1, 4, 8], groups=[4], nocache=[],
                                          cells=[dict(tasks=8, group=4, turns=8, hf=False)])},
                    tasks=1, logprob=[(32768, 4096), (32768, 16384), (QWEN3_VOCAB, 4096), (QWEN3_VOCAB, 16384)],
                    logprob_hidden=128, grpo_tasks=4, grpo_group=4, grpo_steps=3, grpo_warmup=1),
    "gpu": dict(rollout={"toyworld": dict(turns=[1, 4, 8, 16], groups=[8, 32], nocache=[(1, 8), (4, 8), (8, 8)],
                                          cells=[dict(tasks=8, group=4, turns=8)]),
                         # no nocache cell: its full-sequence logits would be [8, ~9k, 151936]
                         "tau2": dict(turns=[1, 4, 8, 16], groups=[8], nocache=[],
                                      cells=[dict(tasks=8, group=4, turns=8)])},
                tasks=1, logprob=[(QWEN3_VOCAB, 4096), (QWEN3_VOCAB, 8192), (QWEN3_VOCAB, 16384)],
                logprob_hidden=None, grpo_tasks=4, grpo_group=8, grpo_steps=3, grpo_warmup=1),
}

# --targets: only the targets' cells (TARGETS), rollout only. tau2 at 32 rows skips the re-encoding baseline
# on CPU (32 re-encodes of ~9-13k tokens a turn: most of an hour on 2 cores) -- no target is stated against it.
TARGET_ROLLOUT = {"toyworld": dict(cells=[dict(tasks=8, group=4, turns=8)]),
                  "tau2": dict(cells=[dict(tasks=8, group=4, turns=8, hf=False)])}


@dataclasses.dataclass
class Setup:
    """The device, dtype and attention implementation a measurement runs with."""
    device: torch.device
    dtype: torch.dtype
    attn: str


def sync(device):
    """Wait for queued CUDA work (a no-op on CPU), so wall-clock timings are complete."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def reset_peak(device):
    """Reset CUDA's peak-memory counter (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_mib(device):
    """Peak CUDA memory allocated since the last reset, MiB; None on CPU."""
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None


# ----------------------------------------------------------------------------------------------------------
# Models


def build_tiny_model(tmp: Path, cfg: policy.TinyConfig, setup: Setup):
    """Build the tiny model of `cfg` under `tmp` and load it with the setup's dtype, device and attention."""
    path = policy.build_tiny(tmp / "tiny", cfg)
    model, tok = policy.load_policy(str(path), dtype=setup.dtype, device=setup.device,
                                    attn_implementation=setup.attn)
    return model.eval(), tok


def build_arch_model(arch: str, tok, setup: Setup, vocab_size: int = QWEN3_VOCAB, num_hidden_layers=None):
    """A Qwen3 model of a real architecture with random weights, built directly on the device."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    spec = dict(ARCHS[arch])
    if num_hidden_layers is not None:
        spec["num_hidden_layers"] = num_hidden_layers
    config = Qwen3Config(vocab_size=vocab_size, max_position_embeddings=40960, tie_word_embeddings=True,
                         rope_theta=1e6, bos_token_id=None, eos_token_id=tok.eos_token_id if tok else None,
                         pad_token_id=tok.pad_token_id if tok else 0, **spec)
    torch.manual_seed(0)
    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(config, dtype=setup.dtype, attn_implementation=setup.attn)
    if tok is not None:
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
    return model.eval()


def n_params(model, embeddings=True):
    """Parameter count, without the input embedding when `embeddings` is False."""
    total = sum(p.numel() for p in model.parameters())
    if not embeddings:
        total -= model.get_input_embeddings().weight.numel()
    return total


# ----------------------------------------------------------------------------------------------------------
# Counting what every forward pass processes


class Meter:
    """Forward hooks: positions fed (padding included), forward calls, and FLOPs (linears + dense attention)."""

    def __init__(self, model, linears=True):
        c = model.config
        self.attn_per_qk = 4 * c.num_hidden_layers * c.num_attention_heads * getattr(
            c, "head_dim", c.hidden_size // c.num_attention_heads)
        self.model, self.handles, self.linears = model, [], linears
        self.reset()

    def reset(self):
        """Zero the counts (forward calls, positions, FLOPs) and the recorded decode steps."""
        self.calls = self.positions = 0
        self.flops = 0.0
        self.decode_steps = []   # (seconds, rows, key length, FLOPs) of each forward feeding one token per row
        self._t0 = None

    def _top(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        b, q = ids.shape
        mask = kwargs.get("attention_mask")
        past = kwargs.get("past_key_values", kwargs.get("cache"))
        k = mask.shape[-1] if mask is not None else q + (past.get_seq_length() if past is not None else 0)
        self.calls += 1
        self.positions += b * q
        self.flops += self.attn_per_qk * b * q * k
        self._step = (b, k, self.flops) if q == 1 else None
        sync(ids.device)
        self._t0 = time.perf_counter()

    def _top_done(self, module, args, kwargs, output):
        if self._t0 is not None and self._step is not None:
            sync(next(module.parameters()).device)
            b, k, flops0 = self._step
            self.decode_steps.append((time.perf_counter() - self._t0, b, k, self.flops - flops0))
        self._t0 = None

    def _linear(self, module, args, output):
        x = args[0]
        self.flops += 2.0 * module.in_features * module.out_features * (x.numel() // module.in_features)

    def __enter__(self):
        self.handles.append(self.model.register_forward_pre_hook(self._top, with_kwargs=True))
        self.handles.append(self.model.register_forward_hook(self._top_done, with_kwargs=True))
        for m in self.model.modules() if self.linears else ():
            if isinstance(m, torch.nn.Linear):
                self.handles.append(m.register_forward_hook(self._linear))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []


class DecodeCompiled(torch.nn.Module):
    """The model for Engine(...), with its decode forwards (one new token per row) run through
    torch.compile(model.forward, mode=...); prefill and observation chunks stay eager. With
    mode="reduce-overhead" on CUDA, inductor replays CUDA graphs; they are recorded per distinct shape (rows,
    cache length), which the engine's growing cache changes at every step: the measured time includes every
    recording a rollout needs. On CPU the same mode compiles inductor C++ code and has no graphs to replay.
    dynamic=True: the rows and cache length are symbolic, so a rollout compiles a couple of graphs, not one per
    step (checked in tests/test_speed.py with backend="eager")."""

    def __init__(self, model, mode: str | None = "reduce-overhead", backend: str | None = None):
        super().__init__()
        self.inner = model
        self.config = model.config
        kw = {"backend": backend} if backend else {"mode": mode}
        self.compiled = torch.compile(model.forward, dynamic=True, **kw)

    def forward(self, input_ids=None, **kwargs):
        """Compiled forward for decode steps (one token per row), the eager model for anything longer."""
        fn = self.compiled if input_ids is not None and input_ids.shape[1] == 1 else self.inner
        return fn(input_ids=input_ids, **kwargs)

    def get_input_embeddings(self):
        """The wrapped model's input embedding."""
        return self.inner.get_input_embeddings()

    def get_output_embeddings(self):
        """The wrapped model's LM head."""
        return self.inner.get_output_embeddings()


def compile_counters() -> dict:
    """What dynamo compiled so far (graphs, captured calls, graph breaks, recompiles), for the JSON."""
    from torch._dynamo.utils import counters
    return {k: dict(counters[k]) for k in ("stats", "graph_break", "recompiles", "inductor") if counters[k]}


# ----------------------------------------------------------------------------------------------------------
# 1. Multi-turn rollout throughput


class FastScript(Script):
    """perf/steering.Script with its segment plans tokenized once, not at every step (the steering hook's
    own cost is then negligible for every method, so the timings are about the engines)."""

    _allowed_cache: dict = {}

    def __init__(self, tok, act, world=None, eos_after=True):
        self.tok, self.act, self.world, self.eos_after = tok, act, world or {}, eos_after
        self.segment_no = {}
        key = id(tok)
        if key not in self._allowed_cache:
            self._allowed_cache[key] = torch.tensor([i for i in range(len(tok)) if tok.decode([i]).isalnum()])
        self.allowed = self._allowed_cache[key]
        self._plans = {}

    def plan(self, items):
        """Script.plan, memoised per segment script."""
        key = tuple(items)
        if key not in self._plans:
            self._plans[key] = super().plan(items)
        return self._plans[key]


@dataclasses.dataclass
class Workload:
    """What the scripted rollouts run on: tasks, their real environment, and the script of each assistant turn
    (items as in perf/steering.Script: str forced text, int model-chosen alphanumeric tokens)."""
    name: str
    about: str
    tasks: list            # with no assistant-turn limit of their own: the sampling config sets the turns
    make_env: object       # task -> a fresh environment; every call is executed for real
    calls: list            # the tool-call turns' scripts, cycled
    answer: list           # the last turn's script

    def script(self, tok, n_rows: int, turns: int) -> Script:
        """turns-1 tool-call turns, then the answer, the same for every row."""
        plan = [self.calls[k % len(self.calls)] for k in range(turns - 1)] + [self.answer]
        return FastScript(tok, {r: plan for r in range(n_rows)})

    def longest_turn(self, tok) -> int:
        """Tokens of the longest scripted assistant turn."""
        return max(len(FastScript(tok, {}).plan(items)) for items in self.calls + [self.answer])


def toyworld_workload(n_tasks: int) -> Workload:
    """Toy-world test tasks whose every tool turn calls get_balance with a model-chosen account, then an answer."""
    tasks = [dataclasses.replace(t, max_assistant_turns=None) for t in toyworld.load_tasks("test", limit=n_tasks)]
    return Workload("toyworld", "toy world: ~100-token prompt, get_balance with a model-chosen account, "
                    "~20-token observations", tasks, toyworld.make_env,
                    calls=[[call_text("get_balance", '{"account": "'), 3, '"}}\n</tool_call>']],
                    answer=["The balance is ", 2])


def tau2_workload(n_tasks: int) -> Workload:
    """Real tau2 airline tasks: the package's agent prompt (policy + 14 tool schemas, ~20k characters) and, as
    the assistant's calls, the task's reference calls with their real arguments, executed by the package's
    environment (observations of a few hundred tokens). Each turn opens with two model-chosen tokens."""
    from bench import tau2
    picked = []
    for task in tau2.load_tasks("test", domain="airline"):
        if len(tau2.ground_truth_trajectory(task).calls) >= 3:
            picked.append(dataclasses.replace(task, max_assistant_turns=None))
        if len(picked) == n_tasks:
            break
    reference = tau2.ground_truth_trajectory(picked[0]).calls
    calls = [[2, "\n" + call_text(c.name, json.dumps(c.arguments)) + "}\n</tool_call>"] for c in reference]

    def make_env(task):   # the simulated user ends the episode after the answer
        return tau2.make_env(task, user_fn=lambda messages, tools=None: "###STOP###")

    return Workload("tau2", f"tau2 airline ({picked[0].id}): the package's ~20k-character agent prompt, the "
                    "reference calls executed for real (observations of ~50-730 tokens)", picked, make_env,
                    calls=calls, answer=["Your request is done. ", 2])


WORKLOADS = {"toyworld": toyworld_workload, "tau2": tau2_workload}


class ScriptProcessor:
    """The same Script as a LogitsProcessor for HF generate: the turn's tokens are input_ids[:, start:]."""

    def __init__(self, script: Script, start: int, eos: int):
        self.script, self.start, self.eos = script, start, eos

    def __call__(self, input_ids, scores):
        segments = []
        for row in input_ids[:, self.start:].tolist():
            segments.append((Role.ACT, row[:row.index(self.eos) + 1] if self.eos in row else row))
        return self.script(list(range(input_ids.shape[0])), segments, scores)


def act_spans(rollout, b):
    """Row b's ACT spans (its assistant turns) in a rollout."""
    return [s for s in rollout.spans[b] if s.role == Role.ACT]


def hf_per_turn(model, tok, engine, workload, group, ref, cfg, script_rows):
    """Per turn: model.generate on the whole re-encoded context, then append the turn and the observation.

    The observation (and scaffolding) tokens between two assistant turns are taken from `ref` (the cached
    run) so that both methods see the same contexts; the turn's own tokens are generated here and compared.
    """
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    pad, eos = tok.pad_token_id, tok.eos_token_id
    prompts = [engine.prompt_ids(t) for t in workload.tasks for _ in range(group)]   # task-major, like Engine.run
    seqs = [list(p) for p in prompts]
    spans = [act_spans(ref, b) for b in range(len(seqs))]
    ref_ids = [ref.ids[b].tolist() for b in range(len(seqs))]
    script = workload.script(tok, len(seqs), script_rows)
    n_turns = max(len(s) for s in spans)
    sampled, mismatched, compared = 0, 0, 0
    for t in range(n_turns):
        rows = [b for b in range(len(seqs)) if t < len(spans[b])]
        width = max(len(seqs[b]) for b in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, b in enumerate(rows):   # left-padded, as HF generation expects
            ids[j, width - len(seqs[b]):] = torch.tensor(seqs[b])
            mask[j, width - len(seqs[b]):] = 1
        # the script's row numbers are this batch's rows; keep its per-row segment counters aligned
        script.segment_no = {(j, "ACT"): t for j in range(len(rows))}
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=cfg.max_new_tokens, do_sample=False, pad_token_id=pad,
                             eos_token_id=eos, logits_processor=LogitsProcessorList(
                                 [ScriptProcessor(script, width, eos)]))
        new = out[:, width:].tolist()
        for j, b in enumerate(rows):
            gen = new[j][:new[j].index(eos) + 1] if eos in new[j] else new[j]
            span = spans[b][t]
            want = ref_ids[b][span.start:span.end]
            compared += 1
            mismatched += gen != want
            sampled += len(gen)
            nxt = spans[b][t + 1].start if t + 1 < len(spans[b]) else span.end
            seqs[b] += gen + ref_ids[b][span.end:nxt]
    return {"sampled_tokens": sampled, "turns_compared": compared, "turns_mismatched": mismatched}


@torch.no_grad()
def hf_row_cache(model, tok, engine, workload, group, ref, cfg, script_rows):
    """What an informed HF user writes for ragged multi-turn rollouts: one `model.generate` call per row and
    turn, each row keeping its own DynamicCache between turns. generate gets the row's full ids and its cache,
    so only the tokens the cache lacks (the previous turn's last token, the scaffolding, the observation) are
    prefilled. Each task's prompt is prefilled once and its cache copied to the group's rows (as the engine
    does). Observation and scaffolding tokens come from `ref` (the engine's run); the generated ids are
    compared with the engine's, as in hf_per_turn."""
    import copy

    from transformers import DynamicCache, LogitsProcessorList

    device = next(model.parameters()).device
    eos = tok.eos_token_id
    prompts = [engine.prompt_ids(t) for t in workload.tasks]
    n_rows = len(prompts) * group
    seqs, caches = [], []
    for p in prompts:   # task-major, like Engine.run
        shared = DynamicCache()
        if len(p) > 1:
            model(input_ids=torch.tensor([p[:-1]], device=device), cache=shared, use_cache=True, logits_to_keep=1)
        for g in range(group):
            seqs.append(list(p))
            caches.append(shared if g == group - 1 else copy.deepcopy(shared))
    spans = [act_spans(ref, b) for b in range(n_rows)]
    ref_ids = [ref.ids[b].tolist() for b in range(n_rows)]
    script = workload.script(tok, 1, script_rows)   # every row runs the same script: row 0's, one row a call
    sampled, mismatched, compared = 0, 0, 0
    for t in range(max(len(s) for s in spans)):
        for b in range(n_rows):
            if t >= len(spans[b]):
                continue
            ids = torch.tensor([seqs[b]], device=device)
            script.segment_no = {(0, "ACT"): t}
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=caches[b],
                                 max_new_tokens=cfg.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                                 eos_token_id=eos, logits_processor=LogitsProcessorList(
                                     [ScriptProcessor(script, len(seqs[b]), eos)]))
            new = out[0, len(seqs[b]):].tolist()
            gen = new[:new.index(eos) + 1] if eos in new else new
            span = spans[b][t]
            compared += 1
            mismatched += gen != ref_ids[b][span.start:span.end]
            sampled += len(gen)
            nxt = spans[b][t + 1].start if t + 1 < len(spans[b]) else span.end
            seqs[b] += gen + ref_ids[b][span.end:nxt]
    return {"sampled_tokens": sampled, "turns_compared": compared, "turns_mismatched": mismatched}


def run_engine(model, tok, workload, group, turns, cfg, use_cache):
    """One scripted rollout of the workload by the engine, every call executed for real, `turns` assistant turns."""
    engine = Engine(model, tok)
    n_rows = len(workload.tasks) * group
    return engine.run(workload.tasks, group, cfg=dataclasses.replace(cfg, max_turns=turns),
                      make_env=workload.make_env, responses="real", use_cache=use_cache,
                      steer=workload.script(tok, n_rows, turns))


@dataclasses.dataclass
class Bound:
    """The weight-streaming bound of a decode step: every weight is read once per forward, at the memory
    bandwidth measured in this run. kv_per_token: the bytes of K and V of one cached position (all layers),
    for the bound that also counts the cache every decode step reads."""
    weight_bytes: int
    kv_per_token: int
    bandwidth: float       # bytes/s
    flops_per_s: float | None = None   # measured matmul throughput, for the roofline (bytes or FLOPs, the larger)

    def seconds(self, rows=0, keys=0, kv=False):
        """Time to read the weights once (with kv, also the KV cache of `rows` x `keys` positions) at the bandwidth."""
        return (self.weight_bytes + (self.kv_per_token * rows * keys if kv else 0)) / self.bandwidth

    def roofline(self, rows, keys, flops):
        """The larger of the bytes bound (weights and KV cache) and `flops` at the measured matmul throughput."""
        return max(self.seconds(rows, keys, kv=True), flops / self.flops_per_s if self.flops_per_s else 0.0)


def weight_bytes(model) -> int:
    """Bytes of the weights one forward reads: every distinct parameter, except an input embedding that is not
    also the LM head (only the fed rows of it are read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    if head is None or head.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V of one cached position over all layers, in the model's dtype."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    elt = next(model.parameters()).element_size()
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * elt


def memory_bandwidth(device, dtype, mib=None, repeats=5) -> dict:
    """Memory bandwidth measured here and now: the best of `repeats` sums (bytes read) and copies (bytes read +
    written) of a tensor far larger than the caches (512 MiB on CPU, 4 GiB on GPU, unless `mib`). GB/s."""
    mib = mib or (4096 if device.type == "cuda" else 512)
    x = torch.rand(mib * 2**20 // torch.empty((), dtype=dtype).element_size(), device=device).to(dtype)
    y = torch.empty_like(x)
    n = x.numel() * x.element_size()
    best = {"sum": float("inf"), "copy": float("inf")}
    for _ in range(repeats + 1):   # the first round warms up
        for kind, fn in (("sum", x.sum), ("copy", lambda: y.copy_(x))):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            best[kind] = min(best[kind], time.perf_counter() - t0)
    read, copy = n / best["sum"] / 1e9, 2 * n / best["copy"] / 1e9
    del x, y
    return {"mib": mib, "read_gbs": read, "copy_gbs": copy, "gbs": max(read, copy)}


def matmul_flops(device, dtype, n=None, repeats=3) -> float:
    """Dense matmul throughput measured here and now (best of `repeats` n x n products), FLOP/s."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a, b = torch.rand(n, n, device=device).to(dtype), torch.rand(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(repeats + 1):   # the first one warms up
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def decode_summary(steps, bound: Bound | None, flops_counted=True) -> dict:
    """Pure decode steps (one new token per row): their time, and the weight-streaming bound as a fraction of
    it (1.0 = the step takes no longer than reading the weights once at the measured bandwidth); _kv: the
    weights and the KV cache the step reads; roofline: the larger of that and FLOPs / measured matmul FLOP/s
    (on CPU a 32-row step is compute-, not bandwidth-bound)."""
    if not steps:
        return {"steps": 0}
    seconds = sum(s[0] for s in steps)
    out = {"steps": len(steps), "median_ms": 1e3 * statistics.median(s[0] for s in steps),
           "mean_rows": sum(s[1] for s in steps) / len(steps), "seconds": seconds}
    if bound is not None:
        out["bound_fraction"] = len(steps) * bound.seconds() / seconds
        out["bound_fraction_kv"] = sum(bound.seconds(b, k, kv=True) for _, b, k, _ in steps) / seconds
        if flops_counted and bound.flops_per_s:
            out["roofline_fraction"] = sum(bound.roofline(b, k, f) for _, b, k, f in steps) / seconds
    return out


def measure(model, fn, bound: Bound | None = None, linears=True):
    """Run fn() under a Meter: its result and wall and CPU seconds, forward calls, positions, TFLOPs (None
    without linears), peak memory and the decode-step summary."""
    device = next(model.parameters()).device
    reset_peak(device)
    with Meter(model, linears) as meter:
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        sync(device)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return result, {"seconds": seconds, "cpu_seconds": cpu_seconds, "forward_calls": meter.calls,
                    "positions": meter.positions, "tflops": meter.flops / 1e12 if linears else None,
                    "peak_mib": peak_mib(device),
                    "decode": decode_summary(meter.decode_steps, bound, linears)}


# The throughput targets: (workload, tasks, group, turns, baseline, ratio). Each is the engine's wall-time
# speedup over a baseline in one cell of the same run.
TARGETS = [("toyworld", 8, 4, 8, "hf", 3.0), ("toyworld", 8, 4, 8, "rowcache", 2.0),
           ("tau2", 8, 4, 8, "rowcache", 2.0)]
METHODS = {"hf": "HF generate re-encoding every turn", "rowcache": "HF generate per row reusing its cache",
           "nocache": "the engine without a cache"}


def rollout_cells(spec, tasks):
    """A workload's cells: the turns x groups grid at the preset's task count, then the spec's extra cells
    (dicts of tasks, group, turns, and hf=False to skip the re-encoding baseline)."""
    nocache = set(map(tuple, spec.get("nocache", [])))
    cells = [dict(tasks=tasks, group=g, turns=t, hf=True, nocache=(t, g) in nocache)
             for g in spec.get("groups", []) for t in spec.get("turns", [])]
    for extra in spec.get("cells", []):
        cells.append(dict(dict(hf=True, nocache=False), **extra))
    return cells


def bench_rollout(model, tok, preset, log, info: dict | None = None, bandwidth: dict | None = None,
                  compiled: DecodeCompiled | None = None):
    """Every workload of the preset's cells (returned); a workload whose benchmark package is missing is
    skipped with a note. `info` receives the bandwidth, the bound's byte counts and the targets' outcomes."""
    from bench import BenchUnavailable
    device = next(model.parameters()).device
    if bandwidth is None:
        bandwidth = memory_bandwidth(device, next(model.parameters()).dtype, preset.get("bandwidth_mib"))
    if "matmul_gflops" not in bandwidth:
        bandwidth["matmul_gflops"] = matmul_flops(device, next(model.parameters()).dtype,
                                                  preset.get("matmul_n")) / 1e9
    bound = Bound(weight_bytes(model), kv_bytes_per_token(model), bandwidth["gbs"] * 1e9,
                  bandwidth["matmul_gflops"] * 1e9)
    log(f"memory bandwidth {bandwidth['gbs']:.1f} GB/s (sum {bandwidth['read_gbs']:.1f}, copy "
        f"{bandwidth['copy_gbs']:.1f}, {bandwidth['mib']} MiB); weights read per forward "
        f"{bound.weight_bytes / 2**20:.1f} MiB -> weight-streaming bound {1e3 * bound.seconds():.2f} ms a step; "
        f"matmul {bandwidth['matmul_gflops']:.0f} GFLOP/s (for the roofline column)")
    cells = []
    for name, spec in preset["rollout"].items():
        specs = rollout_cells(spec, preset["tasks"])
        try:
            workload = WORKLOADS[name](max(c["tasks"] for c in specs))
        except BenchUnavailable as exc:
            log(f"workload {name} skipped: {exc}")
            continue
        log(f"\n{workload.about}")
        log(ROLLOUT_HEADER)
        cells += bench_workload(model, tok, workload, specs, bound, log, compiled)
    if compiled is not None:
        counters = compile_counters()
        log(f"torch.compile counters: {counters}")
        if info is not None:
            info["compile_counters"] = counters
    if info is not None:
        info.update(bandwidth=bandwidth, weight_bytes=bound.weight_bytes, kv_bytes_per_token=bound.kv_per_token,
                    targets=targets(cells, log))
    return cells


def targets(cells, log):
    """The targets' ratios, measured in this run: met or not met (missing where the cell was not run)."""
    out = []
    lines = []
    for workload, n_tasks, group, turns, base, want in TARGETS:
        cell = next((c for c in cells if (c["workload"], c["tasks"], c["group"], c["turns"]) ==
                     (workload, n_tasks, group, turns) and base in c), None)
        what = f"{workload} {n_tasks} tasks x G={group}, {turns} turns: engine / {METHODS[base]} >= {want:g}x"
        if cell is None:
            out.append({"target": what, "measured": None, "met": None})
            lines.append(f"  {what}: not run in this preset")
            continue
        got = cell[f"speedup_vs_{base}"]
        met = got >= want and cell[base]["identical_ids"]
        out.append({"target": what, "measured": got, "met": met})
        lines.append(f"  {what}: {got:.2f}x  {'met' if met else 'NOT MET'}")
    if cells:
        log("\ntargets (wall-time ratios of this run):")
        for line in lines:
            log(line)
    return out


def bench_workload(model, tok, workload, specs, bound, log, compiled: DecodeCompiled | None = None):
    """Measure each cell of a workload: the cached engine, the HF baselines (checked token for token against it),
    the engine without a cache where asked and, given `compiled`, the compiled decode; the cells' results."""
    cfg = SamplingConfig(greedy=True, max_new_tokens=max(48, workload.longest_turn(tok) + 8),
                         max_total_len=model.config.max_position_embeddings, seed=0)
    engine = Engine(model, tok)
    warm = dataclasses.replace(workload, tasks=workload.tasks[:1])
    run_engine(model, tok, warm, 2, 2, cfg, True)      # warm-up (first-call overheads)
    compile_seconds = None
    if compiled is not None:
        # compiling, then (seen with inductor on CPU) a stretch of slow calls before the steady state: two warm-up
        # runs, both timed; what is still new in a cell (CUDA graph recordings of unseen shapes) is paid there
        compile_seconds = []
        try:
            for _ in range(2):
                t0 = time.perf_counter()
                run_engine(compiled, tok, warm, 2, 3, cfg, True)
                compile_seconds.append(time.perf_counter() - t0)
        except Exception as exc:   # on GPU keep the eager cells; on CPU a failure is a bug
            if next(model.parameters()).device.type != "cuda":
                raise
            log(f"compiled decode failed, the cells run without it: {type(exc).__name__}: {exc}"[:2000])
            compiled = None
        if compile_seconds and compiled is not None:
            log(f"(compiled decode: warm-up runs incl. compiling {' + '.join(f'{x:.1f}' for x in compile_seconds)} s)")
    cells = []
    for spec in specs:
        group, turns = spec["group"], spec["turns"]
        wl = dataclasses.replace(workload, tasks=workload.tasks[:spec["tasks"]])
        ref, a = measure(model, lambda: run_engine(model, tok, wl, group, turns, cfg, True), bound)
        a["sampled_tokens"] = ref.stats["tokens_sampled"]
        cell = {"workload": workload.name, "tasks": len(wl.tasks), "turns": turns, "group": group,
                "rows": len(wl.tasks) * group,
                "turns_done": min(len(act_spans(ref, b)) for b in range(len(ref.spans))),
                "end_reasons": sorted(set(ref.end_reasons)),
                "context_tokens": int(ref.lengths.float().mean()), "cached": a}
        baselines = [("hf", hf_per_turn)] if spec["hf"] else []
        baselines.append(("rowcache", hf_row_cache))
        for key, fn in baselines:
            out, m = measure(model, lambda: fn(model, tok, engine, wl, group, ref, cfg, turns), bound)
            m.update(out)
            m["identical_ids"] = out["turns_mismatched"] == 0
            cell[key] = m
        if spec["nocache"]:
            nc, c = measure(model, lambda: run_engine(model, tok, wl, group, turns, cfg, False), bound)
            c["sampled_tokens"] = nc.stats["tokens_sampled"]
            c["identical_ids"] = bool(torch.equal(nc.ids, ref.ids))
            cell["nocache"] = c
        for k in ("cached", *METHODS):
            if k in cell:
                cell[k]["tokens_per_s"] = cell[k]["sampled_tokens"] / cell[k]["seconds"]
        for k in METHODS:
            if k in cell:
                cell[f"speedup_vs_{k}"] = cell[k]["seconds"] / a["seconds"]
                cell[f"cpu_speedup_vs_{k}"] = cell[k]["cpu_seconds"] / a["cpu_seconds"]
                cell[f"flops_ratio_{k}"] = cell[k]["tflops"] / a["tflops"]
        cell["identical_ids"] = all(cell[k]["identical_ids"] for k in METHODS if k in cell)
        if compiled is not None:   # the engine again, decode forwards compiled; FLOPs are not counted inside it
            try:
                co, m = measure(compiled, lambda: run_engine(compiled, tok, wl, group, turns, cfg, True), bound,
                                linears=False)
            except Exception as exc:   # on GPU keep the eager numbers (e.g. graphs out of memory)
                if next(model.parameters()).device.type != "cuda":
                    raise
                cell["compiled_error"] = f"{type(exc).__name__}: {exc}"[:2000]
                log(f"compiled decode failed in this cell: {cell['compiled_error']}")
                torch.cuda.empty_cache()
            else:
                m.update(sampled_tokens=co.stats["tokens_sampled"], warmup_seconds=compile_seconds,
                         identical_ids=bool(torch.equal(co.ids, ref.ids)))
                m["tokens_per_s"] = m["sampled_tokens"] / m["seconds"]
                cell["compiled"] = m
                cell["compiled_speedup"] = a["seconds"] / m["seconds"]
        cells.append(cell)
        log(rollout_row(cell))
    return cells


ROLLOUT_HEADER = (f"{'tasks':>5} {'G':>3} {'turns':>5} {'ctx':>5} | {'tok/s cached':>12} {'hf':>7} {'row':>7} "
                  f"{'nocache':>7} | {'x hf':>5} {'x row':>5} {'x nc':>5} | {'decode ms':>9} "
                  f"{'bound w/w+kv/roof':>20} | "
                  f"{'TFLOP cached/hf/row/nc':>26} | {'positions cached/hf/row/nc':>30} | same ids")


def rollout_row(c):
    """One cell: tokens/s, the engine's wall-time speedups, its median decode step and the weight-streaming
    bound's fraction of it (weights only / weights + the KV cache read / roofline), FLOPs, positions, id
    checks."""
    g = lambda x: f"{x:.3g}"  # noqa: E731
    has = [k for k in METHODS if k in c]
    tps = " ".join(f"{c[k]['tokens_per_s']:>7.1f}" if k in c else f"{'-':>7}" for k in METHODS)
    xs = " ".join(f"{c['speedup_vs_' + k]:>5.2f}" if k in c else f"{'-':>5}" for k in METHODS)
    d = c["cached"]["decode"]
    dec = (f"{d['median_ms']:>9.2f} {d['bound_fraction']:>6.3f}/{d['bound_fraction_kv']:.3f}/"
           f"{d.get('roofline_fraction', float('nan')):<6.3f}"
           if d.get("bound_fraction") is not None else f"{'-':>9} {'-':>20}")
    flops = "/".join(g(c[k]["tflops"]) if k in c else "-" for k in ("cached", *METHODS))
    pos = "/".join(str(c[k]["positions"]) if k in c else "-" for k in ("cached", *METHODS))
    same = " ".join(f"{k}:{'yes' if c[k]['identical_ids'] else 'NO'}" for k in has)
    row = (f"{c['tasks']:>5} {c['group']:>3} {c['turns']:>5} {c['context_tokens']:>5} | "
           f"{c['cached']['tokens_per_s']:>12.1f} {tps} | {xs} | {dec} | {flops:>26} | {pos:>30} | {same}")
    if "compiled" in c:
        m, d = c["compiled"], c["compiled"]["decode"]
        row += (f"\n{'':>21}compiled decode: {m['tokens_per_s']:.1f} tok/s, {c['compiled_speedup']:.2f}x the eager "
                f"engine, decode {d.get('median_ms', float('nan')):.2f} ms, bound "
                f"{d.get('bound_fraction', float('nan')):.3f}/{d.get('bound_fraction_kv', float('nan')):.3f}, "
                f"same ids: {'yes' if m['identical_ids'] else 'NO'}")
    return row


# ----------------------------------------------------------------------------------------------------------
# 2. Log-prob memory (each measurement in a fresh subprocess)


def naive_logprobs(model, ids, loss_mask, attention_mask):
    """The full [B, T, V] logits, a full log_softmax, then the gather: what chunking avoids."""
    logits = model(input_ids=ids, attention_mask=attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(logp * loss_mask[:, 1:], (1, 0))


def logprob_worker(spec: dict) -> dict:
    """Build the model, measure one forward+backward of one method, save values and grads for comparison."""
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    torch.set_num_threads(spec["threads"])
    setup = Setup(device, dtype, spec["attn"])
    model = build_arch_model(spec["arch"], None, setup, vocab_size=spec["vocab"], num_hidden_layers=spec["layers"]) \
        if spec["arch"] else None
    if model is None:
        from transformers import AutoModelForCausalLM, Qwen3Config
        h = spec["hidden"]
        config = Qwen3Config(vocab_size=spec["vocab"], hidden_size=h, intermediate_size=2 * h,
                             num_hidden_layers=spec["layers"], num_attention_heads=max(1, h // 64),
                             num_key_value_heads=1, head_dim=64, max_position_embeddings=spec["seq"] + 8,
                             tie_word_embeddings=True, pad_token_id=0)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=spec["attn"])
    model.train()
    g = torch.Generator().manual_seed(1)
    T = spec["seq"]
    ids = torch.randint(0, spec["vocab"], (1, T), generator=g).to(device)
    attention_mask = torch.ones_like(ids)
    # role mask: the first 10% is prompt, then alternating trained (ACT) / untrained (OBS) spans of 256
    roles = torch.full((1, T), int(Role.ACT))
    roles[:, : T // 10] = int(Role.PROMPT)
    for s in range(T // 10, T, 512):
        roles[:, s + 256: s + 512] = int(Role.OBS)
    loss_mask = role_mask(roles, (Role.ACT,)).to(device)
    gc.collect()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    # CPU: peak RSS during the step minus the RSS right before it. The kernel's high-water mark is reset to
    # the current RSS first (clear_refs 5): ru_maxrss alone would start at the *parent's* peak, which a
    # subprocess inherits through fork+exec. Without that reset the number is an upper bound (flagged).
    rss_before = rss_bytes()
    hwm_reset = reset_peak_rss()
    peak_before = peak_rss_bytes()
    t0 = time.perf_counter()
    if spec["method"] == "chunked":
        logp = token_logprobs(model, ids, loss_mask, attention_mask, chunk_size=spec["chunk_size"])
    else:
        logp = naive_logprobs(model, ids, loss_mask, attention_mask)
    loss = -(logp * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    sync(device)
    seconds = time.perf_counter() - t0
    peak_after = peak_rss_bytes()
    out = {"seconds": seconds, "trained_tokens": int(loss_mask.sum())}
    if device.type == "cuda":
        out["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        out["peak_mib"] = (peak_after - rss_before) / 2**20
        out["upper_bound"] = not hwm_reset and peak_after <= peak_before
    if spec.get("save"):
        torch.save({"logp": logp.detach().float().cpu()[loss_mask.cpu()],
                    "grads": {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}},
                   spec["save"])
    return out


def naive_bytes(vocab, seq, dtype_bytes):
    # logits in the model dtype, its fp32 copy, the log_softmax output and, in backward, two [T, V] fp32 grads
    """Estimated peak bytes of naive_logprobs: logits, their fp32 copy, log_softmax and two fp32 grads of [T, V]."""
    return seq * vocab * (dtype_bytes + 4 * 4)


def available_bytes(device):
    """Free memory: CUDA's free bytes on a GPU, MemAvailable from /proc/meminfo on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return free
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def bench_logprob(preset, setup: Setup, args, log):
    """Peak memory and time of chunked vs naive log-probs per (vocab, seq) and chunk size, each in a fresh
    subprocess, with their log-prob and gradient differences; naive is skipped where it would not fit."""
    cells = []
    tmp = Path(tempfile.mkdtemp(prefix="speed-lp-"))
    budget = 0.8 * available_bytes(setup.device)
    dtype_bytes = torch.finfo(setup.dtype).bits // 8

    def worker(vocab, seq, method, chunk_size):
        spec = {"device": str(setup.device), "dtype": str(setup.dtype).split(".")[-1], "attn": setup.attn,
                "threads": torch.get_num_threads(), "arch": args.arch,
                "hidden": preset["logprob_hidden"], "layers": 2, "vocab": vocab, "seq": seq,
                "method": method, "save": str(tmp / f"{method}.pt"), "chunk_size": chunk_size}
        proc = subprocess.run([sys.executable, __file__, "--logprob-worker", json.dumps(spec)],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            return {"error": (proc.stderr or proc.stdout)[-800:]}
        return json.loads(proc.stdout.strip().splitlines()[-1])

    for vocab, seq in preset["logprob"]:
        need = naive_bytes(vocab, seq, dtype_bytes)
        naive = worker(vocab, seq, "naive", 0) if need <= budget else {
            "skipped": f"needs about {need / 2**30:.0f} GiB, {budget / 2**30:.0f} GiB available"}
        for chunk_size in args.chunk_sizes:   # naive once per shape, chunked at every chunk size
            cell = {"vocab": vocab, "seq": seq, "chunk_size": chunk_size, "naive": naive,
                    "chunked": worker(vocab, seq, "chunked", chunk_size)}
            if "peak_mib" in cell["chunked"] and "peak_mib" in naive:
                a = torch.load(tmp / "chunked.pt")
                b = torch.load(tmp / "naive.pt")
                cell["memory_ratio"] = cell["chunked"]["peak_mib"] / naive["peak_mib"]
                cell["logp_max_abs_diff"] = float((a["logp"] - b["logp"]).abs().max())
                cell["grad_max_abs_diff"] = max(float((a["grads"][k] - b["grads"][k]).abs().max())
                                                for k in a["grads"])
                cell["grad_max_abs"] = max(float(b["grads"][k].abs().max()) for k in b["grads"])
            cells.append(cell)
            log(logprob_row(cell))
        for f in tmp.glob("*.pt"):
            f.unlink()
    tmp.rmdir()
    return cells


LOGPROB_HEADER = (f"{'vocab':>7} {'seq':>6} {'chunk':>5} | {'chunked MiB':>11} {'naive MiB':>10} {'ratio':>6} | "
                  f"{'chunked s':>9} {'naive s':>8} | {'logp diff':>9} {'grad diff':>9}")


def logprob_row(c):
    """One log-prob cell as a table line (or the reason it has no numbers)."""
    ch, nv = c["chunked"], c.get("naive", {})
    if "peak_mib" not in ch:
        return f"{c['vocab']:>7} {c['seq']:>6} {c['chunk_size']:>5} | chunked failed: {ch.get('error', '')[-200:]}"
    if "peak_mib" not in nv:
        note = nv.get("skipped") or nv.get("error", "")[-200:]
        return (f"{c['vocab']:>7} {c['seq']:>6} {c['chunk_size']:>5} | {ch['peak_mib']:>11.0f} {'-':>10} {'-':>6} | "
                f"{ch['seconds']:>9.1f} {'-':>8} | naive skipped: {note}")
    mib = lambda m: f"{m['peak_mib']:.0f}" + ("*" if m.get("upper_bound") else "")  # noqa: E731
    return (f"{c['vocab']:>7} {c['seq']:>6} {c['chunk_size']:>5} | {mib(ch):>11} {mib(nv):>10} "
            f"{c['memory_ratio']:>6.3f} | {ch['seconds']:>9.1f} {nv['seconds']:>8.1f} | "
            f"{c['logp_max_abs_diff']:>9.2e} {c['grad_max_abs_diff']:>9.2e}")


# ----------------------------------------------------------------------------------------------------------
# 3. One GRPO step on toyworld, timed by phase


def grpo_script(tok, n_rows):
    """Two assistant turns with a rehearsed response in between, free slots sampled from the model."""
    call = [call_text("get_balance", '{"account": "'), 2, '"}}\n</tool_call>']
    world = ['{"balance": ', 2, '}\n</tool_response>']
    answer = ["The balance is ", 3]
    return FastScript(tok, {r: [call, answer] for r in range(n_rows)}, {r: [world] for r in range(n_rows)})


def bench_grpo(model, tok, preset, setup: Setup, log):
    """Time the phases of GRPO steps on toy-world tasks (scripted rehearsal rollout, reward, log-probs,
    backward, optimizer); every step and the medians of the steps after warm-up."""
    device = setup.device
    tasks = toyworld.load_tasks("train", limit=preset["grpo_tasks"] * (preset["grpo_steps"] + preset["grpo_warmup"]))
    engine = Engine(model, tok)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=48, max_world_tokens=32, max_turns=2, seed=0)
    loss_cfg = LossConfig()
    train_roles = (Role.ACT, Role.WORLD)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    G = preset["grpo_group"]
    steps = []
    for step in range(preset["grpo_warmup"] + preset["grpo_steps"]):
        batch = tasks[step * preset["grpo_tasks"]:(step + 1) * preset["grpo_tasks"]]
        t = {}
        reset_peak(device)

        def phase(name, t0):
            sync(device)
            t[name] = time.perf_counter() - t0
            return time.perf_counter()

        model.eval()
        t0 = time.perf_counter()
        ro = engine.run(batch, G, cfg=cfg, responses="rehearse", steer=grpo_script(tok, len(batch) * G))
        t0 = phase("rollout", t0)
        scores = [reward.trajectory_reward("toyworld", batch[ti], traj, defects, defect_penalty=0.1)
                  for ti, traj, defects in zip(ro.task_index, ro.trajectories, ro.rehearsal_defects)]
        rewards = torch.tensor([s.reward for s in scores])
        adv, flat = group_advantages(rewards, torch.tensor(ro.task_index))
        t0 = phase("reward", t0)
        model.train()
        ids, roles = ro.ids.clone().to(device), ro.roles.clone().to(device)   # out of inference mode
        attention_mask = (roles != Role.PAD).long()
        logp = token_logprobs(model, ids, role_mask(roles, train_roles), attention_mask, cfg.temperature)
        loss, stats = grpo_loss(logp, ro.logprobs.clone().to(device), adv.to(device), roles, train_roles, loss_cfg)
        t0 = phase("logprob", t0)
        loss.backward()
        t0 = phase("backward", t0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        phase("optimizer", t0)
        t["total"] = sum(t.values())
        t.update(rows=len(ro.trajectories), tokens=int(ro.lengths.sum()), trained_tokens=stats["tokens"],
                 mean_reward=float(rewards.mean()), flat_groups=flat, warmup=step < preset["grpo_warmup"],
                 peak_mib=peak_mib(device))
        steps.append(t)
    model.eval()
    timed = [s for s in steps if not s["warmup"]]
    summary = {k: statistics.median(s[k] for s in timed)
               for k in ("rollout", "reward", "logprob", "backward", "optimizer", "total")}
    summary["fractions"] = {k: summary[k] / summary["total"] for k in ("rollout", "reward", "logprob", "backward",
                                                                       "optimizer")}
    result = {"steps": steps, "median": summary, "tasks_per_step": preset["grpo_tasks"], "group": G}
    log(grpo_table(result))
    return result


def grpo_table(r):
    """The GRPO step's median seconds and share per phase, as a table."""
    m = r["median"]
    head = f"{'phase':>10} | {'seconds':>8} | {'share':>6}"
    lines = [head, "-" * len(head)]
    for k in ("rollout", "reward", "logprob", "backward", "optimizer"):
        lines.append(f"{k:>10} | {m[k]:>8.3f} | {100 * m['fractions'][k]:>5.1f}%")
    lines.append(f"{'total':>10} | {m['total']:>8.3f} |")
    s = r["steps"][-1]
    lines.append(f"({r['tasks_per_step']} tasks x G={r['group']} = {s['rows']} rows, {s['tokens']} tokens, "
                 f"{s['trained_tokens']} trained; median of {sum(not x['warmup'] for x in r['steps'])} steps)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------


def summarize(result):
    """The headline numbers: the ratios the run exists for."""
    out = {}
    cells = result.get("rollout", [])
    for k in METHODS:
        for c in cells:
            if f"speedup_vs_{k}" in c:
                n = "" if c["tasks"] == 1 else f"_n{c['tasks']}"   # names of the one-task cells as before
                out[f"rollout_speedup_vs_{k}_{c['workload']}{n}_t{c['turns']}_g{c['group']}"] = round(
                    c[f"speedup_vs_{k}"], 3)
    for c in cells:
        if c["cached"]["decode"].get("bound_fraction") is not None:
            n = "" if c["tasks"] == 1 else f"_n{c['tasks']}"
            out[f"decode_bound_fraction_{c['workload']}{n}_t{c['turns']}_g{c['group']}"] = round(
                c["cached"]["decode"]["bound_fraction"], 4)
    for c in cells:
        if "compiled_speedup" in c:
            n = "" if c["tasks"] == 1 else f"_n{c['tasks']}"
            out[f"compiled_decode_speedup_{c['workload']}{n}_t{c['turns']}_g{c['group']}"] = round(
                c["compiled_speedup"], 3)
    for t in result.get("rollout_bound", {}).get("targets", []):
        out[f"target: {t['target']}"] = "not run" if t["met"] is None else \
            f"{t['measured']:.2f}x {'met' if t['met'] else 'NOT MET'}"
    for c in result.get("logprob", []):
        if "memory_ratio" in c:
            out[f"logprob_memory_ratio_v{c['vocab']}_t{c['seq']}_chunk{c['chunk_size']}"] = round(c["memory_ratio"], 4)
    if "grpo" in result:
        out["grpo_step_seconds"] = round(result["grpo"]["median"]["total"], 3)
    return out


def main(argv=None):
    """Parse the flags, run the chosen parts per attention implementation, print the tables and write the JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small run (under a minute on CPU)")
    p.add_argument("--gpu", action="store_true", help="cuda, bf16, a real-size random-weight Qwen3 config")
    p.add_argument("--arch", default=None, choices=sorted(ARCHS),
                   help="a random-weight Qwen3 architecture instead of the tiny model (default qwen3-1.7b with --gpu)")
    p.add_argument("--attn", default=None, help="comma list of attention implementations "
                   "(default: sdpa on CPU; sdpa and flash_attention_2 if installed on GPU)")
    p.add_argument("--parts", default=None,
                   help="comma list of: rollout, logprob, grpo (default: all three; rollout with --targets)")
    p.add_argument("--targets", action="store_true",
                   help="only the targets' rollout cells (toy world and tau2, 8 tasks x G=4, 8 turns) and their "
                        "met / not met lines")
    p.add_argument("--workloads", default=None,
                   help=f"comma list of rollout workloads ({', '.join(WORKLOADS)}; default: the preset's)")
    p.add_argument("--compile", nargs="?", const="reduce-overhead", default=None, metavar="MODE",
                   help="also run the engine with its decode forwards through torch.compile(mode=MODE), default "
                        "reduce-overhead (CUDA graphs; on CPU inductor C++ code without graphs, and minutes of "
                        "compiling)")
    p.add_argument("--out", default="runs/speed/speed.json")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--smoke", action="store_true", help="the smallest run (the test suite's smoke test)")
    p.add_argument("--chunk-sizes", default="256,1024",
                   help="comma list of token_logprobs chunk sizes measured in the log-prob part")
    p.add_argument("--logprob-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # grpo.grpo_loss reads float() of a grad-carrying tensor for its stats; harmless, and noisy here
    warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True to a scalar")

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.logprob_worker:
        print(json.dumps(logprob_worker(json.loads(args.logprob_worker))))
        return None
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device; torch.cuda.is_available() is False")
    text = args.chunk_sizes
    try:
        args.chunk_sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        args.chunk_sizes = []
    if not args.chunk_sizes or min(args.chunk_sizes) <= 0:
        raise SystemExit(f"--chunk-sizes must be a comma list of positive integers, not {text!r}")
    if args.parts is None:
        args.parts = "rollout" if args.targets else "rollout,logprob,grpo"
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in ("rollout", "logprob", "grpo")]
    if bad:
        raise ValueError(f"unknown part(s) {bad}; choose from rollout, logprob, grpo")
    if args.compile is not None:
        modes = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
        if args.compile not in modes:
            raise SystemExit(f"--compile takes a torch.compile mode ({', '.join(modes)}), not {args.compile!r}")
        if "rollout" not in parts:
            print("note: --compile compiles the rollout engine's decode forward; without the rollout part it does "
                  "nothing", flush=True)
        if not args.gpu and args.compile in ("reduce-overhead", "max-autotune"):
            print(f"note: --compile {args.compile} on CPU: torch.compile has no CUDA graphs here, so this measures "
                  "inductor's C++ code for the decode forward (compiling takes a minute or more)", flush=True)
    name = "gpu" if args.gpu else "smoke" if args.smoke else "quick" if args.quick else "default"
    preset = PRESETS[name]
    if args.gpu and not args.arch:
        args.arch = "qwen3-1.7b"
    if args.gpu and (args.quick or args.smoke):
        preset = dict(preset, rollout={"toyworld": dict(turns=[1, 4], groups=[8], nocache=[(1, 8)]),
                                       "tau2": dict(turns=[4], groups=[8], nocache=[])},
                      logprob=[(QWEN3_VOCAB, 4096)],
                      grpo_steps=1, grpo_warmup=1)
    if args.targets:
        if args.smoke or args.quick:
            raise SystemExit("--targets runs the targets' own cells; it does not combine with --smoke or --quick")
        name += "+targets"
        preset = dict(preset, rollout=TARGET_ROLLOUT if not args.gpu else
                      {k: dict(cells=[dict(c, hf=True) for c in v["cells"]]) for k, v in TARGET_ROLLOUT.items()})
    if args.workloads is not None:
        chosen = [x for x in args.workloads.split(",") if x]
        bad = [x for x in chosen if x not in WORKLOADS]
        if bad or not chosen:
            raise ValueError(f"unknown workload(s) {bad or args.workloads!r}; choose from {', '.join(WORKLOADS)}")
        # a workload the preset does not size runs with the toy world's cells
        preset = dict(preset, rollout={x: preset["rollout"].get(x, preset["rollout"]["toyworld"]) for x in chosen})
    device = torch.device("cuda" if args.gpu else "cpu")
    dtype = torch.bfloat16 if args.gpu else torch.float32
    if args.attn:
        attns = args.attn.split(",")
    else:
        attns = ["sdpa"]
        if args.gpu and policy.default_attn_implementation(device) == "flash_attention_2":
            attns.append("flash_attention_2")

    t_start = time.perf_counter()
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    result = {"preset": name,
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__, "threads": torch.get_num_threads(),
                          "cpus": os.cpu_count(), "device": torch.cuda.get_device_name() if args.gpu else "cpu",
                          "dtype": str(dtype)},
              "runs": {}}
    import transformers
    result["machine"]["transformers"] = transformers.__version__
    with tempfile.TemporaryDirectory(prefix="speed-") as tmp:
        tmp = Path(tmp)
        tiny_cfg = QUICK_MODEL if args.quick or args.smoke else CPU_MODEL
        for attn in attns:
            setup = Setup(device, dtype, attn)
            run = result["runs"][attn] = {}

            def attempt(part, fn):
                # on CPU a failure is a bug: raise. On GPU keep the other parts' results (e.g. flash-attn
                # installed but unusable for one of them) and record the error in the JSON.
                try:
                    run[part] = fn()
                except Exception as exc:
                    if not args.gpu:
                        raise
                    run.setdefault("errors", {})[part] = f"{type(exc).__name__}: {exc}"
                    log(f"{part} with {attn} failed: {run['errors'][part]}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()

            def make_model():
                if args.arch:
                    tok = policy.build_tokenizer(tiny_cfg)
                    vocab = preset.get("arch_vocab", QWEN3_VOCAB)
                    return build_arch_model(args.arch, tok, setup, vocab_size=vocab), tok, \
                        f"{args.arch} (random weights, vocab {vocab})"
                model, tok = build_tiny_model(tmp, tiny_cfg, setup)
                return model, tok, f"tiny qwen3 {dataclasses.asdict(tiny_cfg)}"

            built = []
            attempt("model", lambda: built.append(make_model()))
            if built:
                model, tok, model_name = built.pop()
                run["model"] = {"name": model_name, "params_m": n_params(model) / 1e6,
                                "params_m_no_embedding": n_params(model, False) / 1e6,
                                "vocab": model.config.vocab_size, "attn": attn}
                log(f"\n== {model_name}: {n_params(model) / 1e6:.1f}M params, {attn}, {dtype}, {device}")
                if "rollout" in parts:
                    log("\n-- 1. multi-turn rollout: sampled tokens/s; x hf / x row / x nc = the engine's speedup "
                        "(wall time); decode ms = the engine's median decode step, bound = the weight-streaming "
                        "bound / its decode time (weights only / + KV read / roofline: the larger of bytes and "
                        "FLOPs at the measured matmul rate)")
                    info = run["rollout_bound"] = {}
                    compiled = DecodeCompiled(model, args.compile) if args.compile else None
                    attempt("rollout", lambda: bench_rollout(model, tok, preset, log, info, compiled=compiled))
                if "grpo" in parts:
                    log("\n-- 3. one GRPO step on toyworld (rehearsal rollout), median seconds per phase")
                    attempt("grpo", lambda: bench_grpo(model, tok, preset, setup, log))
                del model
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if "logprob" in parts:
                log("\n-- 2. log-prob forward+backward peak memory: chunked token_logprobs vs naive log_softmax")
                log(LOGPROB_HEADER)
                attempt("logprob", lambda: bench_logprob(preset, setup, args, log))
            run["summary"] = summarize(run)
    result["summary"] = {attn: run.get("summary") for attn, run in result["runs"].items()}
    result["seconds"] = time.perf_counter() - t_start
    result["table"] = "\n".join(lines)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    log(f"\nwrote {out} ({result['seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()

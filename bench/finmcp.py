"""FinMCP-Bench (Qwen DianJin + Yingmi, CC-BY-NC-SA-4.0): financial MCP tool calling, replayed offline.

Data: published only on a model hub (DianJin/FinMCP-Bench on Hugging Face, tongyi_dianjin/FinMCP-Bench on
ModelScope); nothing is bundled or downloaded. Point `data=PATH` (`--data PATH`) at one of the JSON files or
at the folder holding them. File names accepted: benchmark_{all,single_tool,multi_tool,multi_turn}.json and
the names of the DianJin-TIR repository (benchmark_final / benchmark_stss / benchmark_stms /
benchmark_multi_turn.json). A file is a JSON list of records (JSON Lines and {"data": [...]} are tolerated):

    {"id", "scenery": "level1-level2-level3", "diff_level": {"turns", "tool_number", "para_tool_call_number",
     "level"}, "tool_list": [["ToolA"], ["ToolB", "ToolC"]] (tool names per turn), "question", "answer",
     "messages": [user, assistant{tool_calls: [{id, type, function: {name, arguments: JSON string}}]},
                  tool{content, tool_call_id}, ..., assistant{content}, user, ...], "task"}

Assumptions where the format is not pinned down: `task` may read single_step/multi_step/multi_turn (or
single_tool/multi_tool, spaces or dashes); without it the category comes from the file name, else from
diff_level (turns > 1: multi_turn; tool_number > 1: multi_tool). Tool arguments may be a JSON string or an
object. tool_list entries may be names or schemas (OpenAI or MCP `inputSchema` style).

Tools: the real MCP schemas (qieman.com) are not public data, so schemas are inferred from the logged calls:
every tool called anywhere in the loaded records, parameters = union of argument keys, JSON type from the
logged values, required = keys present in every logged call. By default every task offers all tools of the
loaded set (as the official runs offer the whole MCP tool list); `tools="task"` restricts to the record's own.

Episode: Task.messages = the record's system messages (if any) + its first user message; `user_turn` returns
the record's next user message (multi-turn), then None. The official inference instead conditions each later
turn on the reference history; here the agent keeps its own history.

Env: replays the recorded tool responses. Matching rule for step(name, args): (1) an unused recorded call
with the same name and the same arguments after normalisation (JSON with sorted keys, strings stripped);
(2) an already used one with the same name and arguments (a repeated call); (3) the next unused recorded call
of that name, in order (arguments differ); otherwise an error observation. Unknown tools and argument types
that contradict the inferred schema are error observations too.

Score (as the official evaluation.py): tool names of traj.calls vs the reference calls as multisets:
precision = TP/(TP+FP), recall = TP/(TP+FN), F1 (0 when a denominator is 0), exact_match = the ordered name
lists are equal. reward = F1. Components also report arg_exact_recall (reference calls matched with equal
normalised arguments), for analysis only. score() uses only traj.calls and the ground truth, so rehearsed
rollouts (no environment called) are scored exactly like real ones.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

from bench import BenchUnavailable, Score, Task, Trajectory

NAME = "finmcp"
CATEGORIES = ("all", "single_tool", "multi_tool", "multi_turn")
FILES = {
    "all": ("benchmark_all.json", "benchmark_final.json"),
    "single_tool": ("benchmark_single_tool.json", "benchmark_stss.json"),
    "multi_tool": ("benchmark_multi_tool.json", "benchmark_stms.json"),
    "multi_turn": ("benchmark_multi_turn.json",),
}
_TASK_ALIASES = {"single_step": "single_tool", "single_tool": "single_tool", "stss": "single_tool",
                 "multi_step": "multi_tool", "multi_tool": "multi_tool", "stms": "multi_tool",
                 "multi_turn": "multi_turn"}
WHERE = ("FinMCP-Bench data is not bundled: download it from the model hub (DianJin/FinMCP-Bench on Hugging Face, "
         "or tongyi_dianjin/FinMCP-Bench on ModelScope; CC-BY-NC-SA-4.0) and pass --data PATH, a benchmark_*.json "
         "file or the folder holding benchmark_{all,single_tool,multi_tool,multi_turn}.json")


# ----------------------------------------------------------------------------------------------- data

def _read_records(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"FinMCP-Bench file {path} is neither JSON nor JSON Lines: {e}") from e
    if isinstance(data, dict):
        data = data.get("data", data.get("records", [data]))
    if not isinstance(data, list) or not all(isinstance(r, dict) and isinstance(r.get("messages"), list) for r in data):
        raise ValueError(f"FinMCP-Bench file {path}: expected a list of records with a 'messages' list")
    return data


def _category_from_name(path: Path) -> str | None:
    for cat, names in FILES.items():
        if path.name in names and cat != "all":
            return cat
    return None


def _category(rec: dict, default: str | None) -> str:
    raw = str(rec.get("task") or "").strip().lower().replace(" ", "_").replace("-", "_")
    if raw in _TASK_ALIASES:
        return _TASK_ALIASES[raw]
    if default:
        return default
    dl = rec.get("diff_level") if isinstance(rec.get("diff_level"), dict) else {}
    if (dl.get("turns") or 1) > 1 or sum(m.get("role") == "user" for m in rec["messages"]) > 1:
        return "multi_turn"
    return "multi_tool" if (dl.get("tool_number") or len(_reference_calls(rec))) > 1 else "single_tool"


def _resolve_files(data: Path, category: str) -> list[Path]:
    if data.is_file():
        return [data]
    if not data.is_dir():
        raise BenchUnavailable(f"FinMCP-Bench data path {data} does not exist. {WHERE}")
    for name in FILES[category]:
        if (data / name).is_file():
            return [data / name]
    if category == "all":
        parts = [data / n for cat in ("single_tool", "multi_tool", "multi_turn") for n in FILES[cat][:2]
                 if (data / n).is_file()]
        if parts:
            return parts
    raise BenchUnavailable(f"no FinMCP-Bench file for category {category!r} in {data} "
                           f"(looked for {', '.join(FILES[category])}). {WHERE}")


def load_tasks(split: str = "test", limit: int | None = None, data=None, category: str = "all",
               tools: str = "all", **_) -> list[Task]:
    """FinMCP-Bench records of one category (single_tool, multi_tool, multi_turn) or all. The benchmark is a
    test set: split must be "test" (or "all")."""
    if category not in CATEGORIES:
        raise ValueError(f"unknown FinMCP-Bench category {category!r}; choose one of: {', '.join(CATEGORIES)}")
    if split not in SPLITS:
        raise ValueError(f"unknown FinMCP-Bench split {split!r}; choose one of: {', '.join(SPLITS)}")
    if tools not in ("all", "task"):
        raise ValueError(f"unknown tools option {tools!r}; choose one of: all, task")
    if data is None:
        raise BenchUnavailable(WHERE)
    records = []
    for path in _resolve_files(Path(data), category):
        default = _category_from_name(path)
        for i, rec in enumerate(_read_records(path)):
            records.append((path, i, rec, _category(rec, default)))
    if category != "all":
        records = [r for r in records if r[3] == category]
    schemas = infer_schemas([r[2] for r in records])
    tasks = [_make_task(path, i, rec, cat, schemas, tools) for path, i, rec, cat in records]
    tasks = [t for t in tasks if _in_split(t.id, split)]
    return tasks[:limit] if limit is not None else tasks


SPLITS = ("test", "all", "train", "dev")


def _in_split(task_id: str, split: str) -> bool:
    """test/all: every record (the benchmark is a test set); train/dev: the project's own 80/20 partition by
    task id, so a run trained on FinMCP-Bench is scored on records it never saw."""
    if split in ("test", "all"):
        return True
    dev = int(hashlib.md5(task_id.encode()).hexdigest(), 16) % 5 == 0
    return dev if split == "dev" else not dev


def reference_messages(task: Task) -> list[dict]:
    """The record's own reference as a chat for the warm start: per user turn its recorded calls with their
    recorded responses, the next user message, and the record's answer at the end."""
    msgs = [dict(m) for m in task.messages]
    later = list(task.metadata["later_user_messages"])
    recorded = task.metadata["recorded"]
    turns = max([c["user_turn"] for c in recorded] + [len(later)]) + 1
    for u in range(turns):
        if u > 0:
            msgs.append({"role": "user", "content": later[u - 1] if u - 1 < len(later) else "Please go on."})
        for c in (c for c in recorded if c["user_turn"] == u):
            msgs.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": c["name"], "arguments": dict(c["arguments"])}}]})
            msgs.append({"role": "tool", "name": c["name"], "content": c["response"] or ""})
        answer = task.ground_truth.get("answer") if u == turns - 1 else None
        msgs.append({"role": "assistant", "content": str(answer) if answer else "Done."})
    return msgs


def _args(raw) -> dict:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return {"_raw": raw}
        return parsed if isinstance(parsed, dict) else {"_raw": parsed}
    return {}


def _reference_calls(rec: dict) -> list[dict]:
    """[{name, arguments, response, user_turn}] in message order, responses joined by tool_call_id or order."""
    calls, by_id, user_turn = [], {}, -1
    pending = []
    for m in rec["messages"]:
        role = m.get("role")
        if role == "user":
            user_turn += 1
        elif role == "assistant":
            for tc in m.get("tool_calls") or []:
                fn = tc.get("function") or tc
                c = {"name": str(fn.get("name")), "arguments": _args(fn.get("arguments")), "response": None,
                     "user_turn": max(user_turn, 0)}
                calls.append(c)
                pending.append(c)
                if tc.get("id"):
                    by_id[tc["id"]] = c
        elif role == "tool":
            c = by_id.get(m.get("tool_call_id")) or next((p for p in pending if p["response"] is None), None)
            if c is not None:
                c["response"] = m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content"), ensure_ascii=False)
    return calls


_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"), (dict, "object"))


def _json_type(v) -> str | None:
    return next((t for py, t in _JSON_TYPES if isinstance(v, py)), None)


def infer_schemas(records: list[dict]) -> dict[str, dict]:
    """OpenAI-style schemas for every tool seen: given ones from tool_list, else inferred from logged calls."""
    given, seen = {}, {}
    for rec in records:
        for entry in _flat(rec.get("tool_list") or []):
            if isinstance(entry, dict):
                fn = entry.get("function", entry)
                if fn.get("name"):
                    given[fn["name"]] = {"type": "function", "function": {
                        "name": fn["name"], "description": fn.get("description", ""),
                        "parameters": fn.get("parameters") or fn.get("inputSchema") or {"type": "object", "properties": {}}}}
            elif isinstance(entry, str):
                seen.setdefault(entry, [])
        for c in _reference_calls(rec):
            seen.setdefault(c["name"], []).append(c["arguments"])
    out = {}
    for name, arg_list in seen.items():
        if name in given:
            continue
        props, types = {}, {}
        for args in arg_list:
            for k, v in args.items():
                types.setdefault(k, set()).add(_json_type(v))
        for k, ts in types.items():
            ts.discard(None)
            if ts == {"integer", "number"}:
                ts = {"number"}
            props[k] = {"type": ts.pop()} if len(ts) == 1 else {}
            if props[k].get("type") == "array":
                props[k]["items"] = {}
            props[k]["description"] = f"(inferred from logged calls of {name})"
        required = sorted(k for k in types if arg_list and all(k in a for a in arg_list))
        out[name] = {"type": "function", "function": {
            "name": name, "description": f"Financial MCP tool {name} (schema inferred from the benchmark's logged calls).",
            "parameters": {"type": "object", "properties": props, "required": required}}}
    return {**out, **given}


def _flat(x):
    for e in x:
        if isinstance(e, list):
            yield from _flat(e)
        else:
            yield e


def _make_task(path: Path, i: int, rec: dict, cat: str, schemas: dict, tools: str) -> Task:
    msgs = rec["messages"]
    first_user = next((k for k, m in enumerate(msgs) if m.get("role") == "user"), None)
    if first_user is None:
        raise ValueError(f"FinMCP-Bench record {rec.get('id', i)} in {path} has no user message")
    opening = [{"role": "system", "content": m.get("content", "")} for m in msgs[:first_user] if m.get("role") == "system"]
    opening.append({"role": "user", "content": msgs[first_user].get("content", "")})
    later_users = [m.get("content", "") for m in msgs[first_user + 1:] if m.get("role") == "user"]
    ref = _reference_calls(rec)
    names = sorted({c["name"] for c in ref} | {e for e in _flat(rec.get("tool_list") or []) if isinstance(e, str)})
    offered = [schemas[n] for n in sorted(schemas)] if tools == "all" else [schemas[n] for n in names if n in schemas]
    dl = rec.get("diff_level") if isinstance(rec.get("diff_level"), dict) else {}
    return Task(
        id=f"finmcp/{cat}/{rec.get('id', i)}",
        messages=opening,
        tools=offered,
        ground_truth={"calls": [{"name": c["name"], "arguments": c["arguments"], "user_turn": c["user_turn"]} for c in ref],
                      "answer": rec.get("answer")},
        metadata={"category": cat, "scenery": rec.get("scenery", ""), "level": dl.get("level"), "diff_level": dl,
                  "question": rec.get("question"), "later_user_messages": later_users, "recorded": ref,
                  "source": str(path)},
    )


# ------------------------------------------------------------------------------------------ environment

def _norm(args: dict) -> str:
    def clean(v):
        if isinstance(v, str):
            return v.strip()
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v
    return json.dumps(clean(args), sort_keys=True, ensure_ascii=False)


def _type_ok(v, schema: dict) -> bool:
    t = schema.get("type")
    if t is None or v is None:
        return True
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == "integer":
        return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    return _json_type(v) == t


class FinMCPEnv:
    """Offline replay of one FinMCP-Bench task: a call is answered with the task's recorded response for it."""
    def __init__(self, task: Task, user_fn=None):
        self.task = task
        self.recorded = task.metadata["recorded"]
        self.used = [False] * len(self.recorded)
        self.schemas = {s["function"]["name"]: s["function"]["parameters"] for s in task.tools}
        self.later_users = list(task.metadata.get("later_user_messages") or [])
        self.user_fn = user_fn

    def step(self, name: str, arguments: dict) -> str:
        """The recorded response of the first unused logged call with the same name and arguments (else a used one,
        else an unused one of the same name); an unknown tool, a mistyped argument or no match is an error text."""
        if name not in self.schemas:
            return f"Error: unknown tool {name!r}; available tools: {', '.join(self.schemas)}"
        if not isinstance(arguments, dict):
            return f"Error: arguments for {name} must be a JSON object, got {type(arguments).__name__}"
        props = self.schemas[name].get("properties") or {}
        for k, v in arguments.items():
            if k in props and not _type_ok(v, props[k]):
                return f"Error: argument {k!r} of {name} must be of type {props[k].get('type')}, got {type(v).__name__} {v!r}"
        key = _norm(arguments)
        same = [i for i, c in enumerate(self.recorded) if c["name"] == name and _norm(c["arguments"]) == key]
        unused_same = [i for i in same if not self.used[i]]
        by_name = [i for i, c in enumerate(self.recorded) if c["name"] == name and not self.used[i]]
        pick = (unused_same or same or by_name or [None])[0]
        if pick is None:
            return (f"Error: no recorded response for {name} with arguments {json.dumps(arguments, ensure_ascii=False)} "
                    f"(offline replay of FinMCP-Bench: only calls logged in this task can be answered)")
        self.used[pick] = True
        resp = self.recorded[pick]["response"]
        return resp if resp is not None else "Error: the benchmark logged no response for this call"

    def user_turn(self, assistant_text: str) -> str | None:
        """The task's next logged user message, else the user simulator's reply (user_fn), else None (the end)."""
        if self.later_users:
            return self.later_users.pop(0)
        return self.user_fn(assistant_text, self.task) if self.user_fn else None


def make_env(task: Task, user_fn=None) -> FinMCPEnv:
    """A fresh replay environment for the task (user_fn: a simulator for user turns past the logged ones)."""
    return FinMCPEnv(task, user_fn=user_fn)


# -------------------------------------------------------------------------------------------- scoring

def _div(a, b):
    return a / b if b > 0 else 0.0


def tool_metrics(pred: list[str], gold: list[str]) -> dict:
    """Precision, recall, F1 and exact match of predicted vs gold tool names, compared as multisets."""
    p, g = Counter(pred), Counter(gold)
    tp, fp, fn = sum((p & g).values()), sum((p - g).values()), sum((g - p).values())
    precision, recall = _div(tp, tp + fp), _div(tp, tp + fn)
    return {"tp": tp, "fp": fp, "fn": fn, "precision": precision, "recall": recall,
            "f1": _div(2 * precision * recall, precision + recall), "exact_match": float(pred == gold)}


def score(task: Task, traj: Trajectory) -> Score:
    """Reward: tool-name F1 of the trajectory's calls vs the reference calls; components add arg_exact_recall."""
    gold = task.ground_truth["calls"]
    m = tool_metrics([c.name for c in traj.calls], [c["name"] for c in gold])
    pred_keys = Counter((c.name, _norm(c.arguments if isinstance(c.arguments, dict) else {})) for c in traj.calls)
    gold_keys = Counter((c["name"], _norm(c["arguments"])) for c in gold)
    m["arg_exact_recall"] = _div(sum((pred_keys & gold_keys).values()), len(gold))
    m.update(metric="tool_f1", n_pred=len(traj.calls), n_gold=len(gold), category=task.metadata["category"])
    return Score(reward=m["f1"], components=m)

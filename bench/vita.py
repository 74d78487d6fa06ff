"""VitaBench (meituan-longcat/vitabench): life-service agent tasks, delivery and in-store domains.

Data: the task files of the public repository (MIT), read from `../shared/data/vitabench/` next to the
project root by default, or from `data=DIR` (`--data DIR`) for a user with the full set. Each task carries
its own database (stores/shops, products, orders, books, reservations, user, time, locations, weather), a
user scenario (profile + instructions) and evaluation criteria (`expected_states[].required_orders`,
`state_rubrics`, `overall_rubrics`).

Environment (bench/vita_env.py): our own small deterministic re-implementation of the VitaBench domain tools over that
database, following the public tool names, arguments and semantics (search stores/products, store/product
info, create/pay/cancel/modify orders, book/reserve, time/location/weather/holiday queries). Differences
from upstream, on purpose: order ids are deterministic (`OT`/`OI` + a hash of a per-env counter) instead of
timestamp hashes; observations are JSON text instead of Python reprs; fuzzy matching (search ranking,
address and city lookup) uses difflib instead of thefuzz; the holiday tools use a small built-in table; a
failed precondition (an `assert` upstream, whose tool wrapper returns the bare message) reads `Error: ` + the
same message, like every refusal here; an empty product list is refused.

Argument types are treated as upstream's tools treat them: no JSON-type check of our own, the raw values reach
each tool, which coerces, accepts, refuses or raises at the point upstream does (a string count raises
`'>' not supported ...`, a string distance is refused by upstream's isinstance assert, 2.0 becomes 2 where
upstream's pydantic model validates, a float quantity is stored as given where upstream assigns without
validating). An exception comes back as upstream's `Environment.get_response` shows it: `Error: <exception
text>` (pydantic errors without their version-specific help links). Missing and unknown arguments, and a null
required one, are still refused before the tool runs (a null optional one means its default).

Episode: `mode="solo"` (default) gives VitaBench's solo-agent policy as the system prompt and the whole user
scenario (instructions + profile) as the first user message; `mode="chat"` gives the conversational policy
instead. `make_env(task, user_fn=None)`: `user_turn` asks `user_fn(assistant_text, task)` for the next user
message (an LLM user simulator the engine may plug in); with None the episode ends after the first
assistant turn without a call, as in solo mode.

Reward. The official score is an LLM judge over rubrics (1 only if every rubric is met). `score(task, traj,
judge_fn=None)`: with a `judge_fn(rubrics, messages, final_state) -> list[bool]` that official rule is used.
By default (no judge) the reward is a deterministic PROXY, labelled `"metric": "order_state_proxy"` in the
components: traj.calls are replayed on a fresh environment, and the final orders/books/reservations are
matched one-to-one (greedy on item score) with the task's required ones. An order item scores the mean of
[same store, product-id Jaccard, fraction of required quantities right, same status class]; a booking or
reservation the mean of [same shop, same time, same party size, same status class]. Status classes:
cancelled / unpaid / paid (processed, in-progress, delivered, consumed, unconsumed count as paid, since no
tool reaches them), and for reservations cancelled / active. Items the agent should not have produced (a new
order left active and unmatched, or an initial order it changed that was not required) are added to the
denominator. reward = sum(item scores) / (n_required + n_unwanted), in [0, 1]. Product attributes, notes
and delivery times are not compared (free text / rubric matters).

Training rule (rehearsal): score() never needs the environment that ran the rollout: it replays traj.calls
on a fresh, deterministic env. Ids the policy invented in rehearsed observations (an order id in a
rehearsed create_* result) are aliased to the ids the replay really created, so a later pay/cancel with the
invented id reaches the right order.

Data quirks handled: some required orders are nested inside another order's `products` list (flattened);
required order ids do not always match the initial ones (matching is by content, not id).
"""
from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime
from pathlib import Path

from bench import BenchUnavailable, Score, Task, ToolCall, Trajectory
from bench.vita_env import DOMAINS, ID_KEYS, TIME_FMT, VitaEnv, _item, tool_schemas

NAME = "vita"
PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = PROJECT_ROOT.parent / "shared" / "data" / "vitabench"
KNOWN_DOMAINS = ("delivery", "instore", "cross_domain", "ota")   # what a full data dir may hold
LANGS = {"en": "tasks_en.json", "zh": "tasks.json"}
SPLITS = ("test", "all", "train", "dev")


# ----------------------------------------------------------------------------------------------- data

def _domain_dir(data_dir: Path, domain: str) -> Path | None:
    for d in (data_dir / domain, data_dir / "domains" / domain, data_dir / "data" / "vita" / "domains" / domain):
        if d.is_dir():
            return d
    return None


def available_domains(data_dir=None) -> dict[str, list[str]]:
    """{domain: [langs found]} for every VitaBench domain folder with task files under data_dir."""
    data_dir = Path(data_dir) if data_dir is not None else DEFAULT_DATA
    found = {}
    for domain in KNOWN_DOMAINS:
        d = _domain_dir(data_dir, domain)
        if d is not None:
            langs = [lang for lang, fname in LANGS.items() if (d / fname).is_file()]
            if langs:
                found[domain] = langs
    return found


def _read_tasks(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"VitaBench task file {path} is not valid JSON: {e}") from e
    if not isinstance(data, list) or not all(isinstance(t, dict) and "id" in t and "environment" in t for t in data):
        raise ValueError(f"VitaBench task file {path} is not a list of tasks with 'id' and 'environment'")
    return data


def _in_split(task_id: str, split: str) -> bool:
    if split in ("test", "all"):
        return True
    dev = int(hashlib.md5(task_id.encode()).hexdigest(), 16) % 5 == 0   # our own 80/20 split; VitaBench has none
    return dev if split == "dev" else not dev


def load_tasks(split: str = "test", limit: int | None = None, domain: str = "all", lang: str = "en",
               data=None, mode: str = "solo", **_) -> list[Task]:
    """Tasks of one domain ("delivery", "instore") or "all" found, in one language ("en", "zh").

    split: "test"/"all" = every task (VitaBench has no splits); "train"/"dev" = our own deterministic 80/20
    partition by task id, for experiments that must not tune on the test tasks.
    """
    if domain not in DOMAINS + ("all",):
        raise ValueError(f"unknown VitaBench domain {domain!r}; choose one of: {', '.join(DOMAINS + ('all',))}")
    if lang not in LANGS:
        raise ValueError(f"unknown VitaBench language {lang!r}; choose one of: {', '.join(LANGS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown VitaBench split {split!r}; choose one of: {', '.join(SPLITS)}")
    if mode not in ("solo", "chat"):
        raise ValueError(f"unknown VitaBench mode {mode!r}; choose one of: solo, chat")
    data_dir = Path(data) if data is not None else DEFAULT_DATA
    if not data_dir.is_dir():
        raise BenchUnavailable(f"VitaBench data directory {data_dir} not found; pass --data DIR pointing at a folder "
                               f"with delivery/ and instore/ task files (from github.com/meituan-longcat/vitabench, "
                               f"data/vita/domains/)")
    found = available_domains(data_dir)
    wanted = DOMAINS if domain == "all" else (domain,)
    present = [d for d in wanted if lang in found.get(d, [])]
    if not present:
        raise BenchUnavailable(f"no VitaBench {lang} task file for domain {domain!r} under {data_dir} (found: "
                               f"{found or 'nothing'}); pass --data DIR with <domain>/{LANGS[lang]}")
    tasks = []
    for d in present:
        path = _domain_dir(data_dir, d) / LANGS[lang]
        for raw in _read_tasks(path):
            if _in_split(str(raw["id"]), split):
                tasks.append(_make_task(raw, d, lang, mode, path))
    return tasks[:limit] if limit is not None else tasks


def _flatten_orders(orders: list[dict]) -> list[dict]:
    """Required orders, with orders mistakenly nested inside another order's products lifted out."""
    out = []
    for o in orders:
        o = dict(o)
        if isinstance(o.get("products"), list):
            nested = [p for p in o["products"] if isinstance(p, dict) and "order_id" in p]
            o["products"] = [p for p in o["products"] if not (isinstance(p, dict) and "order_id" in p)]
            out.extend(_flatten_orders(nested))
        out.append(o)
    return out


def _required_items(raw: dict) -> list[dict]:
    """Required orders/books/reservations of the first expected state (all states of a task list the same
    ones). A new in-store order with k products is split into k one-product orders: the in-store order tool
    takes a single product, so that is how an agent can produce it."""
    states = (raw.get("evaluation_criteria") or {}).get("expected_states") or []
    items = _flatten_orders(states[0].get("required_orders") or []) if states else []
    initial = (raw.get("environment") or {}).get("orders") or {}
    out = []
    for o in items:
        if o.get("order_type") == "instore" and len(o.get("products") or []) > 1 and o.get("order_id") not in initial:
            out += [{**o, "order_id": f"{o['order_id']}#{k}", "products": [p]} for k, p in enumerate(o["products"])]
        else:
            out.append(o)
    return out


def _rubrics(raw: dict) -> list[str]:
    crit = raw.get("evaluation_criteria") or {}
    seen = []
    for st in crit.get("expected_states") or []:
        seen += [r for r in st.get("state_rubrics") or [] if r not in seen]
    seen += [r for r in crit.get("overall_rubrics") or [] if r not in seen]
    return seen


def _weekday(time: str, lang: str) -> str:
    wd = datetime.strptime(time, TIME_FMT).weekday()
    return ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"][wd] if lang == "en" \
        else "星期" + "一二三四五六日"[wd]


SYSTEM_SOLO = {
    "en": """# Environment
- Current time: {time}

# Tool use
- From the task description and the information given, decide which tools to call and with which arguments.
- Call the tools you need in a logical order; respect each tool's preconditions and postconditions.

# Task requirements
- Complete all of the user's requests, in order, in one go, from the full task description and user information given.
- If the task asks to place an order and then cancel or modify it, do exactly that, in that order.
- Everything you need (preferences, constraints) is in the task description; you cannot ask the user anything.
- Treat every step that needs the user's confirmation as confirmed.
- When all requests are done, write '###STOP###' to end the conversation.""",
    "zh": """# 环境
- 当前时间：{time}

# 工具使用
- 根据任务描述和已给信息，确定要调用的工具及参数
- 按合理顺序调用所需工具，遵守各工具的前置与后置条件

# 任务要求
- 根据完整的任务描述和用户信息，按顺序一次性完成用户的全部需求
- 如任务要求先下单再取消或修改订单，请严格按该顺序执行
- 所需信息（偏好、约束等）都已在任务描述中给出，执行中不能询问用户
- 需要用户确认的步骤一律视为已确认
- 完成全部需求后，输出 '###STOP###' 结束对话""",
}
SYSTEM_CHAT = {
    "en": """# Environment
- Current time: {time}

# Tool use
- When a request needs tools, first check whether you know every argument; extract the known ones and ask the user for the rest.
- When the user cannot provide some information, get it through the tools first.
- Follow each tool's preconditions and postconditions.

# Conversation
- Only use information from the conversation so far; never make up information.
- Aim at completing the user's request; do not steer the user towards new requests.
- When the request is done, ask whether the user needs anything else; if not, write '###STOP###' to end the conversation.""",
    "zh": """# 环境
- 当前时间：{time}

# 工具使用
- 用户需求需要调用工具时，先判断参数是否齐全，齐全则抽取参数，否则询问用户
- 用户无法提供相关信息时，先通过工具获取
- 遵守各工具的前置与后置条件

# 对话
- 只利用上文已有信息，不得无根据地编造信息
- 以完成用户需求为目标，不要引导用户提出新需求
- 完成需求后询问用户是否还有其他需求，如没有，输出 '###STOP###' 结束对话""",
}


def _first_user_message(raw: dict, lang: str) -> str:
    profile = (raw.get("user_scenario") or {}).get("user_profile") or {}
    lines = "\n".join(f"- {k}: {v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                      for k, v in profile.items())
    if lang == "zh":
        return f"任务描述：\n{raw.get('instructions', '')}\n\n用户信息：\n{lines}"
    return f"Task description:\n{raw.get('instructions', '')}\n\nUser information:\n{lines}"


def _make_task(raw: dict, domain: str, lang: str, mode: str, path: Path) -> Task:
    env = raw["environment"]
    time = f"{env['time']} {_weekday(env['time'], lang)}" if env.get("time") else ""
    system = (SYSTEM_SOLO if mode == "solo" else SYSTEM_CHAT)[lang].format(time=time)
    return Task(
        id=f"vita/{domain}/{lang}/{raw['id']}",
        messages=[{"role": "system", "content": system},
                  {"role": "user", "content": _first_user_message(raw, lang)}],
        tools=tool_schemas(domain),
        ground_truth={"required_orders": _required_items(raw), "rubrics": _rubrics(raw)},
        metadata={"domain": domain, "lang": lang, "raw_id": str(raw["id"]), "mode": mode, "source": str(path),
                  "environment": env, "instructions": raw.get("instructions", ""),
                  "user_scenario": raw.get("user_scenario") or {}},
    )


def make_env(task: Task, user_fn=None) -> VitaEnv:
    """A fresh VitaEnv on a copy of the task's database (user_fn: the simulated user)."""
    return VitaEnv(task, user_fn=user_fn)


def _item_score(req: dict, got: dict) -> float:
    if req["kind"] != got["kind"]:
        return 0.0
    if req["kind"] == "order":
        r, g = req["products"], got["products"]
        union = set(r) | set(g)
        jac = len(set(r) & set(g)) / len(union) if union else 1.0
        qty = sum(g.get(p) == q for p, q in r.items()) / len(r) if r else float(not g)
        parts = [req["store"] == got["store"], jac, qty, req["status"] == got["status"]]
    else:
        parts = [req["store"] == got["store"], req["time"] == got["time"], req["count"] == got["count"],
                 req["status"] == got["status"]]
    return sum(float(p) for p in parts) / 4


def order_state_proxy(task: Task, final: list[dict]) -> dict:
    """Match required items to final-state items one-to-one (greedy, best pairs first)."""
    required = [_item(x) for x in task.ground_truth["required_orders"]]
    pairs = sorted(((_item_score(r, f), i, j) for i, r in enumerate(required) for j, f in enumerate(final)),
                   key=lambda x: (-x[0], x[1], x[2]))
    match, used = {}, set()
    for s, i, j in pairs:
        if s > 0 and i not in match and j not in used:
            match[i] = (j, s)
            used.add(j)
    unwanted = [f["id"] for j, f in enumerate(final) if j not in used and
                ((not f["initial"] and f["status"] != "cancelled") or (f["initial"] and f["changed"]))]
    per_item = [{"required": r["id"], "kind": r["kind"], "matched": final[match[i][0]]["id"] if i in match else None,
                 "score": match[i][1] if i in match else 0.0} for i, r in enumerate(required)]
    total = sum(p["score"] for p in per_item)
    denom = len(required) + len(unwanted)
    reward = total / denom if denom else 1.0
    return {"metric": "order_state_proxy", "reward": reward, "n_required": len(required),
            "n_exact": sum(p["score"] == 1.0 for p in per_item), "unwanted": unwanted, "items": per_item}


_ID_RE = re.compile(r'"?(order_id|book_id|reservation_id)"?\s*[:=]\s*"?([A-Za-z0-9_#\-]+)')
_CREATES = {"create_delivery_order", "create_instore_product_order", "instore_book", "instore_reservation"}


def replay(task: Task, calls: list[ToolCall], observations: list[str] | None = None) -> tuple[VitaEnv, list[str]]:
    """Run calls on a fresh env; alias ids claimed in the given (possibly rehearsed) observations of create
    calls to the ids the replay really created."""
    env = make_env(task)
    outs = []
    for i, c in enumerate(calls):
        outs.append(env.step(c.name, c.arguments))
        if c.name in _CREATES and env.last_created and observations and i < len(observations):
            m = _ID_RE.search(observations[i] or "")
            if m and m.group(2) != env.last_created:
                env.aliases[m.group(2)] = env.last_created
    return env, outs


def score(task: Task, traj: Trajectory, judge_fn=None) -> Score:
    """Replay the trajectory's calls on a fresh environment and score the final state (order_state_proxy); with
    judge_fn, the reward is the official all-rubrics-met judgement instead."""
    env, outs = replay(task, traj.calls, traj.observations)
    proxy = order_state_proxy(task, env.final_items())
    components = {**proxy, "replay_errors": sum(o.startswith("Error") for o in outs), "n_calls": len(traj.calls)}
    if judge_fn is None:
        return Score(reward=float(proxy["reward"]), components=components)
    rubrics = task.ground_truth["rubrics"]
    met = list(judge_fn(rubrics, traj.messages, {k: env.db[k] for k in ("orders", "books", "reservations")}))
    rubric_score = sum(map(bool, met)) / len(rubrics) if rubrics else 1.0
    official = float(bool(rubrics) and len(met) == len(rubrics) and all(met)) if rubrics else 1.0
    components.update(metric="rubric_judge", proxy_reward=proxy["reward"], rubric_score=rubric_score, rubrics_met=met)
    return Score(reward=official, components=components)


# ------------------------------------------------------------------------------------------ reference

def reference_calls(task: Task) -> tuple[list[ToolCall], list[str]]:
    """A call sequence that produces the task's required orders, derived from the ground truth on a live env
    (so later calls can use the ids earlier ones created). Returns (calls, problems); problems lists why a
    required item could not be produced (data defects); empty means fully derived."""
    env = make_env(task)
    user = env.db.get("user_id")
    calls, problems = [], []
    initial = [i for i in env.final_items()]
    used = set()

    def call(name, **args):
        out = env.step(name, args)
        calls.append(ToolCall(name=name, arguments=args, turn=len(calls)))
        if out.startswith("Error"):
            problems.append(f"{name}: {out}")
        return out

    for raw in task.ground_truth["required_orders"]:
        req = _item(raw)
        kind, target = req["kind"], req["status"]
        same = [j for j, f in enumerate(initial) if j not in used and f["kind"] == kind and f["store"] == req["store"]
                and ((kind == "order" and f["products"] == req["products"]) or
                     (kind != "order" and f["time"] == req["time"] and f["count"] == req["count"]))]
        if same:
            j = same[0]
            used.add(j)
            f = initial[j]
            if f["status"] == target:
                continue
            if target == "cancelled":
                name = {"order": "cancel_delivery_order" if env.domain == "delivery" else "instore_cancel_order",
                        "book": "instore_cancel_book", "reservation": "instore_cancel_reservation"}[kind]
                call(name, **{ID_KEYS[("order", "book", "reservation").index(kind)]: f["id"]})
            elif f["status"] == "unpaid" and target == "paid":
                name = {"order": "pay_delivery_order" if env.domain == "delivery" else "pay_instore_order",
                        "book": "pay_instore_book"}[kind]
                call(name, **{"order_id" if kind == "order" else "book_id": f["id"]})
            else:
                problems.append(f"{req['id']}: cannot move {f['status']} -> {target}")
            continue
        if kind == "order" and env.domain == "delivery":
            loc = raw.get("location") or {}
            address = loc.get("address") or (env.db.get("location") or [{}])[0].get("address", "")
            prods = [p for p in raw.get("products") or [] if p.get("product_id")]
            call("create_delivery_order", user_id=user, store_id=raw["store_id"],
                 product_ids=[p["product_id"] for p in prods], product_cnts=[int(p.get("quantity") or 1) for p in prods],
                 address=address, dispatch_time=env.now,
                 attributes=[p.get("attributes") if isinstance(p.get("attributes"), str) else "" for p in prods],
                 note=raw.get("note") or "")
            oid, pay, cancel = env.last_created, "pay_delivery_order", "cancel_delivery_order"
        elif kind == "order":
            prods = raw.get("products") or []
            if len(prods) != 1:
                problems.append(f"{req['id']}: in-store orders hold one product, required has {len(prods)}")
                continue
            call("create_instore_product_order", user_id=user, shop_id=raw["store_id"],
                 product_id=prods[0]["product_id"], quantity=int(prods[0].get("quantity") or 1))
            oid, pay, cancel = env.last_created, "pay_instore_order", "instore_cancel_order"
        elif kind == "book":
            call("instore_book", user_id=user, shop_id=req["store"], time=req["time"] or "",
                 customer_count=int(req["count"] or 1))
            oid, pay, cancel = env.last_created, "pay_instore_book", "instore_cancel_book"
        elif kind == "reservation":
            call("instore_reservation", user_id=user, shop_id=req["store"], time=req["time"] or "",
                 customer_count=int(req["count"] or 1))
            oid, pay, cancel = env.last_created, None, "instore_cancel_reservation"
        else:
            problems.append(f"unknown required item {raw!r:.80}")
            continue
        if oid is None:
            continue
        key = {"order": "order_id", "book": "book_id", "reservation": "reservation_id"}[kind]
        table = {"order": "orders", "book": "books", "reservation": "reservations"}[kind]
        if target == "cancelled":
            call(cancel, **{key: oid})
        elif target == "paid" and pay and env.db[table][oid]["status"] == "unpaid":
            call(pay, **{key: oid})
    return calls, problems


def reference_messages(task: Task) -> list[dict]:
    """The derived reference (reference_calls) as a chat for the warm start: each call with its real response
    from a fresh environment, then a short closing text. Tasks whose ground truth cannot be fully derived
    (reference_calls' problems) still give the calls that could be."""
    calls, _ = reference_calls(task)
    env = make_env(task)
    msgs = [dict(m) for m in task.messages]
    for c in calls:
        msgs.append({"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}]})
        msgs.append({"role": "tool", "name": c.name, "content": env.step(c.name, c.arguments)})
    msgs.append({"role": "assistant", "content": "Done: the orders are placed as you asked."})
    return msgs

"""toyworld: a tiny procedurally generated bank-and-shop tool world (the embedded default benchmark).

Made for TINY models (a few million parameters, trained from scratch in minutes on a CPU) whose success
depends on predicting tool responses: every response follows a simple rule from the state printed in the
system prompt, and in the multi-step families the argument of the next call is computed from the last
response, so a wrong belief about a response (a wrong rehearsal) makes a wrong next call.

The world
---------
The system prompt shows 3-4 accounts with integer balances and a shop of 2-3 items, each with a price and a
stock, for example::

    You are a bank clerk. Act only through the tools, then answer in one short sentence.
    Accounts: ann 40, bob 12, cal 7
    Shop: pen costs 3 (5 left), cup costs 8 (2 left)

Tools and their rules (observations are compact JSON, `json.dumps` with default separators):

    get_balance(account)          -> {"balance": 40}
    transfer(src, dst, amount)    -> {"ann": 20, "bob": 32}        new balances of src then dst
    get_price(item)               -> {"price": 3, "stock": 5}
    buy(account, item, qty)       -> {"cost": 9, "balance": 31, "stock": 2}   cost = price * qty

Transfers and purchases change the state; lookups after them see the new values. Invalid calls change
nothing and return an error object, checked in this order:
    {"error": "unknown tool: NAME"}, {"error": "missing argument: X"}, {"error": "unexpected argument: X"},
    {"error": "X must be a string"}, {"error": "amount must be a positive integer"} (also qty; bools and
    floats are not integers), {"error": "unknown account: X"}, {"error": "unknown item: X"},
    {"error": "same account"}, {"error": "not enough stock"}, {"error": "insufficient funds"}.
`Env.step` never raises; `user_turn` returns None (one user turn per episode).

Families (`task.metadata["family"]`, gold number of calls in brackets)
    balance [1]  "How much money does ann have?"                      get_balance
    send    [1]  "Send 5 from ann to bob, then tell me bob's balance." transfer; 1 in 4 is more than the
                 source has, so the gold call gets the insufficient-funds error and the answer is unchanged
    buy     [1]  "Buy 2 cups for ann. How much money does ann have left?"  buy; 1 in 4 fails (stock/funds)
    half    [2]  "Move half of ann's money to bob. ..."     get_balance -> transfer(amount = balance / 2)
    total   [2]  "How much do ann and bob have together?"    get_balance x2, answer = sum
    afford  [3]  "Buy as many pens for ann as ann can afford ..."  get_balance, get_price,
                 buy(qty = min(balance // price, stock)), answer = qty
    chain   [4]  "Move half of ann's money to bob, then half of bob's money to cal. ..."
                 get_balance(ann), transfer, get_balance(bob) (sees the updated balance), transfer
    pool    [4]  "Move all of bob's and cal's money to ann. ..."  get_balance, transfer, get_balance, transfer
Costly-mistake families (`families=costly`; the default is the eight above). Here a mistake cannot be taken
back, as a wrong write in tau² cannot: the task fails if any call errors or any transfer or purchase is not
exactly a gold one (scored as `strict`), and the right next argument needs the previous call's effect:
    safe_send   [2]  "Send 25 from ann to bob, but never overdraw ann: if she has less, send all she has."
                     get_balance, transfer(amount = min(25, balance)); half the time 25 is more than she has
    topup_buy   [3]  "Send 6 from bob to ann, then buy as many pens for ann as she can afford ..."
                     transfer, get_price, buy(qty = min((balance + 6) // price, stock)): the transfer decides it
    exact_afford [3] afford's calls, strict: one purchase, of the affordable quantity, no failed attempt
Families are dealt round-robin, so any prefix of a split is balanced. Halves are always exact (the generator
draws even balances where needed).

Scoring (the rehearsal rule)
----------------------------
During EnvACE training no environment runs during the rollout: the policy writes the observations itself. So
`score` never trusts `traj.observations`. It replays `traj.calls` in order on a fresh environment (the
verifier) and checks:
    state_correct  the replayed final state (all balances and stocks) equals the gold final state
    answer_correct the LAST integer in the final answer equals the gold value (`traj.final_answer`, or the
                   last assistant message without tool calls when that is empty)
    reads_done     every gold lookup call (get_balance / get_price with the gold arguments) appears among the
                   calls, so lookups cannot be skipped by reading the prompt (off with require_reads=False)
reward = 1.0 if all three hold, else 0.0. Diagnostic components: n_calls, n_errors (error observations in
the replay), n_obs / n_obs_correct / obs_accuracy (how many of the trajectory's recorded observations equal
the real replayed ones, compared as parsed JSON; obs_accuracy is 1.0 when there are none, so aggregate the
counts), n_rehearsed / n_rehearsed_correct (the same, restricted to observations the policy wrote), and
calls_match_gold (the exact gold call sequence).

Train / test hold-out (`holdout=` option of load_tasks)
------------------------------------------------------
"pairs" (default): a fixed set of 12 of the 120 unordered account pairs and 32 of the 128 (account, item)
    pairs is held out (fixed, independent of `seed`; see HELD_PAIRS, HELD_BUYS). No train table ever shows
    two accounts of a held-out pair together and no train task has an account buy a held-out (account,
    item) pair. Every test table shows a held-out pair and the task is about it: the two principal accounts
    (src/dst, the two summed, a->b of a chain, the receiver and first giver of a pool) form the held-out
    pair; in balance/buy/afford the asked/buying account is one of the pair, and buy/afford use a held-out
    (account, item) pair. So no test prompt occurs in train. All names occur in training, only their
    combinations are new, so a tiny model has trained embeddings for every token.
"names": the last 4 of the 16 names and the last 2 of the 8 items never occur in train; in every test task
    the first principal account is one of those names (and buy/afford use a held-out item). Much harder
    for a model trained from scratch (unseen name tokens).
"none": both splits draw from everything (only the random streams differ).
Splits also use separate random streams. Default sizes: train 10000, test 1000 (`n=`); `limit` takes a
prefix. Same (split, seed, options) -> identical tasks.
"""
from __future__ import annotations

import itertools
import json
import random
import re

from bench import Task, ToolCall, Trajectory, Score

NAME = "toyworld"

NAMES = ["ann", "bob", "cal", "dee", "eve", "fay", "gus", "hal",
         "ivy", "jon", "kim", "lou", "max", "ned", "oli", "pam"]
ITEMS = ["pen", "cup", "hat", "jar", "mug", "bag", "map", "kit"]
FAMILIES = ["balance", "send", "buy", "half", "total", "afford", "chain", "pool"]
COSTLY_FAMILIES = ["safe_send", "topup_buy", "exact_afford"]      # scored strict: no errored or extra write
FAMILY_SETS = {"classic": FAMILIES, "costly": COSTLY_FAMILIES, "all": FAMILIES + COSTLY_FAMILIES}
N_CALLS = {"balance": 1, "send": 1, "buy": 1, "half": 2, "total": 2, "afford": 3, "chain": 4, "pool": 4,
           "safe_send": 2, "topup_buy": 3, "exact_afford": 3}
WRITE_TOOLS = ("transfer", "buy")
HOLDOUTS = ["pairs", "names", "none"]
DEFAULT_N = {"train": 10000, "test": 1000}

SYSTEM = "You are a bank clerk. Act only through the tools, then answer in one short sentence."


def _tool(name, description, **params):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object",
                       "properties": {k: {"type": t} for k, t in params.items()},
                       "required": list(params)}}}


TOOLS = [
    _tool("get_balance", "Balance of an account.", account="string"),
    _tool("transfer", "Move amount from src to dst.", src="string", dst="string", amount="integer"),
    _tool("get_price", "Price and stock of an item.", item="string"),
    _tool("buy", "Buy qty of item, paid by account.", account="string", item="string", qty="integer"),
]
_SIGNATURES = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in TOOLS}


# ----------------------------------------------------------------------------- the environment

def _err(msg):
    return json.dumps({"error": msg})


class ToyEnv:
    """The real world: executes the rules on a private copy of the state. Never raises."""

    def __init__(self, balances: dict, prices: dict, stock: dict):
        self.balances = dict(balances)
        self.prices = dict(prices)
        self.stock = dict(stock)

    def state(self) -> dict:
        """A copy of the mutable state (balances and stock), e.g. to compare with a task's final_state."""
        return {"balances": dict(self.balances), "stock": dict(self.stock)}

    def step(self, name, arguments) -> str:
        """Execute one call and return its JSON response; any failure, even an internal one, is an error response."""
        try:
            return self._step(name, arguments)
        except Exception as e:  # the rules above should cover everything; this is a last guard
            return _err(f"internal error: {type(e).__name__}")

    def _step(self, name, arguments):
        if not isinstance(name, str) or name not in _SIGNATURES:
            return _err(f"unknown tool: {name}")
        if not isinstance(arguments, dict):
            return _err("arguments must be an object")
        sig = _SIGNATURES[name]
        for k in sig:
            if k not in arguments:
                return _err(f"missing argument: {k}")
        for k in arguments:
            if k not in sig:
                return _err(f"unexpected argument: {k}")
        for k, spec in sig.items():
            v = arguments[k]
            if spec["type"] == "string" and not isinstance(v, str):
                return _err(f"{k} must be a string")
            if spec["type"] == "integer" and (type(v) is not int or v <= 0):
                return _err(f"{k} must be a positive integer")
        a = arguments
        for k in ("account", "src", "dst"):
            if k in a and a[k] not in self.balances:
                return _err(f"unknown account: {a[k]}")
        if "item" in a and a["item"] not in self.prices:
            return _err(f"unknown item: {a['item']}")

        if name == "get_balance":
            return json.dumps({"balance": self.balances[a["account"]]})
        if name == "get_price":
            return json.dumps({"price": self.prices[a["item"]], "stock": self.stock[a["item"]]})
        if name == "transfer":
            src, dst, amount = a["src"], a["dst"], a["amount"]
            if src == dst:
                return _err("same account")
            if amount > self.balances[src]:
                return _err("insufficient funds")
            self.balances[src] -= amount
            self.balances[dst] += amount
            return json.dumps({src: self.balances[src], dst: self.balances[dst]})
        # buy
        acct, item, qty = a["account"], a["item"], a["qty"]
        if qty > self.stock[item]:
            return _err("not enough stock")
        cost = self.prices[item] * qty
        if cost > self.balances[acct]:
            return _err("insufficient funds")
        self.balances[acct] -= cost
        self.stock[item] -= qty
        return json.dumps({"cost": cost, "balance": self.balances[acct], "stock": self.stock[item]})

    def user_turn(self, assistant_text: str):
        """No simulated user: None, so an answer without calls ends the episode."""
        return None


def make_env(task: Task) -> ToyEnv:
    """A fresh environment on a private copy of the task's world."""
    w = task.metadata["world"]
    return ToyEnv(w["balances"], w["prices"], w["stock"])


# ----------------------------------------------------------------------------- hold-out sets

def _holdout_sets():
    r = random.Random("toyworld-holdout-v1")  # fixed forever: independent of the seed option
    pairs = [frozenset(p) for p in itertools.combinations(NAMES, 2)]
    buys = list(itertools.product(NAMES, ITEMS))
    return set(r.sample(pairs, 12)), set(r.sample(buys, 32))


HELD_PAIRS, HELD_BUYS = _holdout_sets()
HELD_NAMES, HELD_ITEMS = NAMES[-4:], ITEMS[-2:]


# ----------------------------------------------------------------------------- the generator

class _Reject(Exception):
    pass


def _pick_accounts(r, split, holdout, k, fixed):
    """k distinct account names starting with `fixed` (the principal ones), obeying the hold-out rule."""
    pool = NAMES
    if holdout == "names" and split == "train":
        pool = [n for n in NAMES if n not in HELD_NAMES]
    rest = [n for n in pool if n not in fixed]
    names = list(fixed) + r.sample(rest, k - len(fixed))
    if holdout == "pairs" and split == "train":
        if any(frozenset(p) in HELD_PAIRS for p in itertools.combinations(names, 2)):
            raise _Reject
    return names


def _principals(r, split, holdout, n):
    """n distinct principal accounts; on test the first two form a held-out pair (or the first is a held name)."""
    if split == "test" and holdout == "pairs":
        first = sorted(r.choice(sorted(HELD_PAIRS, key=sorted)))  # sorted: set order varies per process
        r.shuffle(first)
        if n == 1:  # balance: the asked account, with its held-out partner shown in the same table
            return first[:1], first[1:]
        others = [x for x in NAMES if x not in first]
        return first + r.sample(others, n - 2), []
    if split == "test" and holdout == "names":
        a = r.choice(HELD_NAMES)
        return [a] + r.sample([x for x in NAMES if x != a], n - 1), []
    pool = NAMES if holdout != "names" else [x for x in NAMES if x not in HELD_NAMES]
    return r.sample(pool, n), []


def _pick_item(r, split, holdout, account):
    if holdout == "pairs":
        if split == "test":
            return r.choice([i for i in ITEMS if (account, i) in HELD_BUYS] or [None])
        return r.choice([i for i in ITEMS if (account, i) not in HELD_BUYS])
    if holdout == "names":
        return r.choice(HELD_ITEMS if split == "test" else ITEMS[:-2])
    return r.choice(ITEMS)


def _shop(r, split, holdout, principal_item):
    pool = ITEMS[:-2] if (holdout == "names" and split == "train") else ITEMS
    k = r.choice([2, 3])
    items = [principal_item] if principal_item else []
    items += r.sample([i for i in pool if i not in items], k - len(items))
    r.shuffle(items)
    return items


def _system_text(balances, prices, stock, show_state):
    if not show_state:
        return SYSTEM
    accts = ", ".join(f"{n} {v}" for n, v in balances.items())
    shop = ", ".join(f"{i} costs {prices[i]} ({stock[i]} left)" for i in prices)
    return f"{SYSTEM}\nAccounts: {accts}\nShop: {shop}"


def _one_task(r, family, split, holdout):
    """Draw one task: returns (balances, prices, stock, user text, gold calls, answer fn). May raise _Reject."""
    n_principal = {"balance": 1, "send": 2, "buy": 1, "half": 2, "total": 2,
                   "afford": 1, "chain": 3, "pool": 3, "safe_send": 2, "topup_buy": 2, "exact_afford": 1}[family]
    principal, partner = _principals(r, split, holdout, n_principal)
    n_accounts = max(r.choice([3, 4]), len(principal) + len(partner))
    names = _pick_accounts(r, split, holdout, n_accounts, principal + partner)
    r.shuffle(names)
    bal = {n: r.randint(1, 40) for n in names}
    item = None
    if family in ("buy", "afford", "topup_buy", "exact_afford"):
        item = _pick_item(r, split, holdout, principal[0])
        if item is None:
            raise _Reject
    items = _shop(r, split, holdout, item)
    prices = {i: r.randint(2, 9) for i in items}
    stock = {i: r.randint(1, 9) for i in items}

    a = principal[0]
    b = principal[1] if len(principal) > 1 else None
    c = principal[2] if len(principal) > 2 else None
    G = lambda acc: ("get_balance", {"account": acc})
    T = lambda s, d, n: ("transfer", {"src": s, "dst": d, "amount": n})

    if family == "balance":
        user = r.choice(["How much money does {a} have?", "What is {a}'s balance?"]).format(a=a)
        calls = [G(a)]
        answer = lambda st, obs: (st["balances"][a], f"{a} has {st['balances'][a]}.")
    elif family == "send":
        if r.random() < 0.25:
            n = bal[a] + r.randint(1, 10)
        else:
            n = r.randint(1, min(bal[a], 20))
        user = r.choice(["Send {n} from {a} to {b}, then tell me {b}'s balance.",
                         "Transfer {n} from {a} to {b}. What is {b}'s balance now?"]).format(n=n, a=a, b=b)
        calls = [T(a, b, n)]

        def answer(st, obs):
            v = st["balances"][b]
            if "error" in obs[0]:
                return v, f"The transfer failed: {json.loads(obs[0])['error']}. {b} has {v}."
            return v, f"{b} has {v}."
    elif family == "buy":
        if r.random() < 0.25:  # a failing purchase: not enough stock or not enough money
            q = stock[item] + r.randint(1, 3) if r.random() < 0.5 else None
            if q is None:
                q = min(stock[item], 9)
                bal[a] = r.randint(0, prices[item] * q - 1)
        else:
            q = r.randint(1, min(4, stock[item]))
            bal[a] = max(bal[a], prices[item] * q + r.randint(0, 10))
        user = f"Buy {q} {item}s for {a}. How much money does {a} have left?"
        calls = [("buy", {"account": a, "item": item, "qty": q})]

        def answer(st, obs):
            v = st["balances"][a]
            if "error" in obs[0]:
                return v, f"The purchase failed: {json.loads(obs[0])['error']}. {a} has {v} left."
            return v, f"{a} has {v} left."
    elif family == "half":
        bal[a] = 2 * r.randint(1, 20)
        user = f"Move half of {a}'s money to {b}. How much does {b} have now?"
        calls = [G(a), T(a, b, bal[a] // 2)]
        answer = lambda st, obs: (st["balances"][b], f"{b} has {st['balances'][b]}.")
    elif family == "total":
        user = f"How much do {a} and {b} have together?"
        calls = [G(a), G(b)]
        answer = lambda st, obs: (st["balances"][a] + st["balances"][b],
                                  f"Together they have {st['balances'][a] + st['balances'][b]}.")
    elif family == "safe_send":
        n = bal[a] + r.randint(1, 10) if r.random() < 0.5 else r.randint(1, bal[a])
        user = (f"Send {n} from {a} to {b}, but never overdraw {a}: if {a} has less than {n}, send all {a} has. "
                f"No failed call is allowed. How much does {b} have now?")
        calls = [G(a), T(a, b, min(n, bal[a]))]
        answer = lambda st, obs: (st["balances"][b], f"{b} has {st['balances'][b]}.")
    elif family == "topup_buy":        # b tops a up, then a buys what the new balance affords
        n = r.randint(1, min(bal[b], 20))
        q = min((bal[a] + n) // prices[item], stock[item])
        if q < 1 or bal[a] // prices[item] >= q:     # the transfer must decide the quantity
            raise _Reject
        user = (f"Send {n} from {b} to {a}, then buy as many {item}s for {a} as {a} can afford and the shop has, "
                f"in one purchase. No failed call is allowed. How many were bought?")
        calls = [T(b, a, n), ("get_price", {"item": item}), ("buy", {"account": a, "item": item, "qty": q})]
        answer = lambda st, obs: (q, f"{q} {item}s were bought.")
    elif family in ("afford", "exact_afford"):
        if bal[a] < prices[item]:
            bal[a] = prices[item] + r.randint(0, 20)
        q = min(bal[a] // prices[item], stock[item])
        user = f"Buy as many {item}s for {a} as {a} can afford and the shop has. How many were bought?"
        if family == "exact_afford":
            user = user.replace("the shop has. How many", "the shop has, in one purchase. No failed call is "
                                "allowed. How many")
        calls = [G(a), ("get_price", {"item": item}), ("buy", {"account": a, "item": item, "qty": q})]
        answer = lambda st, obs: (q, f"{q} {item}s were bought.")
    elif family == "chain":
        bal[a] = 2 * r.randint(1, 20)
        if (bal[b] + bal[a] // 2) % 2:
            bal[b] += 1
        mid = bal[b] + bal[a] // 2
        user = f"Move half of {a}'s money to {b}, then half of {b}'s money to {c}. How much does {c} have now?"
        calls = [G(a), T(a, b, bal[a] // 2), G(b), T(b, c, mid // 2)]
        answer = lambda st, obs: (st["balances"][c], f"{c} has {st['balances'][c]}.")
    elif family == "pool":
        b, a = a, b  # the first principal gives, the second receives: (a, b) stays the principal pair
        for x in (a, b, c):
            bal[x] = r.randint(1, 25)
        user = f"Move all of {b}'s and {c}'s money to {a}. How much does {a} have now?"
        calls = [G(b), T(b, a, bal[b]), G(c), T(c, a, bal[c])]
        answer = lambda st, obs: (st["balances"][a], f"{a} has {st['balances'][a]}.")
    else:
        raise AssertionError(family)
    # table order: the shuffled `names`, with the balances drawn/adjusted above
    bal = {n: bal[n] for n in names}
    return bal, prices, stock, user, calls, answer


def load_tasks(split: str, limit: int | None = None, seed: int = 0, n: int | None = None,
               families=None, holdout: str = "pairs", show_state: bool = True,
               require_reads: bool = True) -> list[Task]:
    """Generate the split deterministically. Options: n (split size; default 10000 train / 1000 test),
    families (subset of FAMILIES, dealt round-robin), holdout ("pairs" | "names" | "none"), show_state
    (print the state table in the system prompt), require_reads (score needs the gold lookups)."""
    if split not in DEFAULT_N:
        raise ValueError(f"unknown split {split!r}; choose one of: {', '.join(DEFAULT_N)}")
    if holdout not in HOLDOUTS:
        raise ValueError(f"unknown holdout {holdout!r}; choose one of: {', '.join(HOLDOUTS)}")
    if families is None:
        families = list(FAMILIES)
    elif isinstance(families, str):
        families = [f for f in families.split(",") if f]
    families = [x for f in families for x in FAMILY_SETS.get(f, [f])]      # a set name stands for its families
    bad = [f for f in families if f not in N_CALLS]
    if bad or not families:
        raise ValueError(f"unknown family {bad or families!r}; choose from: {', '.join(N_CALLS)} or a set: "
                         f"{', '.join(FAMILY_SETS)}")
    total = DEFAULT_N[split] if n is None else int(n)
    count = total if limit is None else min(int(limit), total)

    r = random.Random(f"toyworld|{split}|{seed}|{holdout}")
    tasks = []
    for i in range(count):
        family = families[i % len(families)]
        for _ in range(1000):
            try:
                bal, prices, stock, user, calls, answer = _one_task(r, family, split, holdout)
                break
            except _Reject:
                continue
        else:
            raise RuntimeError(f"toyworld: could not draw a {family} task")
        env = ToyEnv(bal, prices, stock)
        obs = [env.step(nm, args) for nm, args in calls]
        value, text = answer(env.state(), obs)
        tasks.append(Task(
            id=f"toyworld-{split}-{seed}-{i:05d}",
            messages=[{"role": "system", "content": _system_text(bal, prices, stock, show_state)},
                      {"role": "user", "content": user}],
            tools=TOOLS,
            ground_truth={"answer": value, "answer_text": text, "final_state": env.state(),
                          "calls": [{"name": nm, "arguments": args} for nm, args in calls]},
            metadata={"family": family, "n_gold_calls": len(calls), "split": split, "holdout": holdout,
                      "require_reads": require_reads, "strict": family in COSTLY_FAMILIES,
                      "world": {"balances": bal, "prices": prices, "stock": stock}},
            max_assistant_turns=8,
        ))
    return tasks


# ----------------------------------------------------------------------------- scoring

_INT = re.compile(r"-?\d+")


def _last_int(text):
    found = _INT.findall(text or "")
    return int(found[-1]) if found else None


def _same_obs(claimed, real):
    try:
        return json.loads(claimed) == json.loads(real)
    except (TypeError, ValueError):
        return str(claimed).strip() == real.strip()


def _final_text(traj):
    if traj.final_answer:
        return traj.final_answer
    for m in reversed(traj.messages):
        if m.get("role") == "assistant" and not m.get("tool_calls"):
            return m.get("content") or ""
    return ""


def _replay(task: Task, traj: Trajectory) -> tuple[ToyEnv, list[str]]:
    """traj.calls executed in order on a fresh env (the verifier): the env after them and the real responses."""
    env = make_env(task)
    return env, [env.step(c.name, c.arguments) for c in traj.calls]


def score(task: Task, traj: Trajectory) -> Score:
    """Replay traj.calls on a fresh env (never trusting traj.observations) and check state, answer, reads."""
    env, real = _replay(task, traj)
    gt = task.ground_truth
    state_ok = env.state() == gt["final_state"]
    answer_ok = _last_int(_final_text(traj)) == gt["answer"]
    made = [(c.name, c.arguments) for c in traj.calls]
    reads = [(g["name"], g["arguments"]) for g in gt["calls"] if g["name"] in ("get_balance", "get_price")]
    reads_ok = all(rd in made for rd in reads)
    need_reads = task.metadata.get("require_reads", True)

    n_obs = min(len(traj.observations), len(real))
    correct = [_same_obs(traj.observations[i], real[i]) for i in range(n_obs)]
    rehearsed = [i for i in range(n_obs) if i < len(traj.rehearsed) and traj.rehearsed[i]]
    no_mistake = no_costly_mistake(task, traj, real)
    ok = state_ok and answer_ok and (reads_ok or not need_reads) and (no_mistake or not task.metadata.get("strict"))
    return Score(reward=1.0 if ok else 0.0, components={
        "state_correct": float(state_ok),
        "answer_correct": float(answer_ok),
        "reads_done": float(reads_ok),
        "n_calls": len(traj.calls),
        "n_errors": sum('"error"' in o for o in real),
        "n_obs": n_obs,
        "n_obs_correct": sum(correct),
        "obs_accuracy": sum(correct) / n_obs if n_obs else 1.0,
        "n_rehearsed": len(rehearsed),
        "n_rehearsed_correct": sum(correct[i] for i in rehearsed),
        "calls_match_gold": float(made == [(g["name"], g["arguments"]) for g in gt["calls"]]),
        "no_costly_mistake": float(no_mistake),
    })


def no_costly_mistake(task: Task, traj: Trajectory, real: list[str]) -> bool:
    """No replayed call errored and the transfers and purchases that went through are exactly the gold ones,
    in order: what a strict (costly-mistake) task requires on top of state and answer."""
    if any('"error"' in o for o in real):
        return False
    writes = [(c.name, c.arguments) for c, o in zip(traj.calls, real) if c.name in WRITE_TOOLS]
    return writes == [(g["name"], g["arguments"]) for g in task.ground_truth["calls"] if g["name"] in WRITE_TOOLS]


def checklist(task: Task, traj: Trajectory) -> list[tuple[str, bool]]:
    """Rule-based checklist items checked exactly against the ground truth (the official EnvACE reward is a
    30B LLM judge scoring checklist items per turn; this rule stands in for it):
        call k        gold call k (name and arguments) was made after the calls matched to gold calls 1..k-1
                      (the gold calls in order, other calls allowed in between)
        final state   the calls replayed on a fresh env leave the gold final state
        answer        the last integer of the final answer is the gold value
    Observations, real or rehearsed, play no part. All items met implies score() == 1."""
    gt = task.ground_truth
    made = [(c.name, c.arguments) for c in traj.calls]
    items, nxt = [], 0
    for k, g in enumerate(gt["calls"]):
        hit = next((i for i in range(nxt, len(made)) if made[i] == (g["name"], g["arguments"])), None)
        nxt = hit + 1 if hit is not None else nxt
        items.append((f"call {k + 1}: {g['name']} {json.dumps(g['arguments'])}", hit is not None))
    env, real = _replay(task, traj)
    strict = [("no failed call, no extra write", no_costly_mistake(task, traj, real))] \
        if task.metadata.get("strict") else []
    return items + [("final state", env.state() == gt["final_state"]),
                    ("answer", _last_int(_final_text(traj)) == gt["answer"])] + strict


# ----------------------------------------------------------------------------- gold data and helpers

def reference_calls(task: Task) -> list[ToolCall]:
    """The calls a correct solution makes, in order: what rehearsal diagnostics judge a proposed call against
    (diagnostics.rehearsal_diagnostics, through evaluate.reference_calls)."""
    return [ToolCall(g["name"], dict(g["arguments"])) for g in task.ground_truth["calls"]]


def reference_messages(task: Task) -> list[dict]:
    """The full gold chat: opening messages, one assistant turn per call with the real tool response, answer."""
    env = make_env(task)
    msgs = [dict(m) for m in task.messages]
    for g in task.ground_truth["calls"]:
        msgs.append({"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function",
                                     "function": {"name": g["name"], "arguments": dict(g["arguments"])}}]})
        msgs.append({"role": "tool", "content": env.step(g["name"], g["arguments"])})
    msgs.append({"role": "assistant", "content": task.ground_truth["answer_text"]})
    return msgs


def _random_call(r: random.Random, env: ToyEnv) -> tuple[str, dict]:
    """One call the tool-call parser accepts (a known tool with its required arguments), valid or not: the
    right tool with valid arguments most of the time, else an unknown account or item, a wrong amount or
    quantity (zero, negative, a float, a string, more than the balance or the stock), the same account twice,
    a wrong type or an unexpected extra argument. Each then gets whatever the rules answer."""
    accounts, items = list(env.balances), list(env.prices)
    unknown_account = r.choice([n for n in NAMES if n not in env.balances])
    unknown_item = r.choice([i for i in ITEMS if i not in env.prices])
    name = r.choice(list(_SIGNATURES))
    a, b = r.sample(accounts, 2)
    item = r.choice(items)
    if name == "get_balance":
        args = {"account": a}
    elif name == "get_price":
        args = {"item": item}
    elif name == "transfer":
        args = {"src": a, "dst": b, "amount": r.randint(1, max(1, env.balances[a]))}
    else:
        args = {"account": a, "item": item, "qty": r.randint(1, max(1, env.stock[item]))}
    if r.random() < 0.5:   # half the calls are broken in one way
        amount_key = {"transfer": "amount", "buy": "qty"}.get(name)
        faults = ["extra_argument", "wrong_type"]
        faults += ["unknown_account"] if name != "get_price" else ["unknown_item"]
        faults += ["unknown_item"] if name == "buy" else []
        faults += ["bad_amount", "too_much"] if amount_key else []
        faults += ["same_account"] if name == "transfer" else []
        fault = r.choice(faults)
        if fault == "unknown_account":
            args[r.choice([k for k in ("account", "src", "dst") if k in args])] = unknown_account
        elif fault == "unknown_item":
            args["item"] = unknown_item
        elif fault == "bad_amount":
            args[amount_key] = r.choice([0, -r.randint(1, 9), r.randint(1, 9) + 0.5, str(r.randint(1, 9))])
        elif fault == "too_much":
            limit = env.balances[a] if name == "transfer" else env.stock[item]
            args[amount_key] = limit + r.randint(1, 10)
        elif fault == "same_account":
            args["dst"] = args["src"]
        elif fault == "wrong_type":
            key = r.choice(list(args))
            args[key] = r.randint(1, 9) if isinstance(args[key], str) else f"{args[key]}"
        else:
            args[r.choice(["note", "memo", "currency"])] = r.choice(["x", 1])
    return name, args


LOOKUP_TOOLS = ("get_balance", "get_price")   # read the state, change nothing


def _lookup_call(r: random.Random, env: ToyEnv, tools=LOOKUP_TOOLS) -> tuple[str, dict]:
    """A valid call of a lookup tool in `tools`: the balance of a known account or the price of a shop item."""
    if len(tools) == 1:
        tool = tools[0]
    else:   # both: one draw, the stream of earlier runs
        tool = "get_balance" if r.random() < 0.5 else "get_price"
    if tool == "get_balance":
        return "get_balance", {"account": r.choice(list(env.balances))}
    return "get_price", {"item": r.choice(list(env.prices))}


def valid_write_call(rng: random.Random, env: ToyEnv) -> tuple[str, dict]:
    """A transfer or purchase the rules accept (falls back to a lookup when none is possible)."""
    if rng.random() < 0.5:
        rich = [a for a, v in env.balances.items() if v >= 1]
        if len(env.balances) >= 2 and rich:
            src = rng.choice(rich)
            dst = rng.choice([a for a in env.balances if a != src])
            return "transfer", {"src": src, "dst": dst, "amount": rng.randint(1, env.balances[src])}
    options = [(a, i) for a in env.balances for i in env.prices
               if env.stock[i] >= 1 and env.balances[a] >= env.prices[i]]
    if options:
        acct, item = rng.choice(options)
        top = min(env.stock[item], env.balances[acct] // env.prices[item])
        return "buy", {"account": acct, "item": item, "qty": rng.randint(1, top)}
    return _lookup_call(rng, env)


def world_examples(task: Task, rng: random.Random, n: int, lookup_frac: float = 0.0,
                   skip_lookups=frozenset()) -> list[dict]:
    """A supervised WORLD example on the task's state: the task's opening messages, then n assistant turns
    with one random call each (`_random_call`: valid and invalid; with probability lookup_frac instead a valid
    lookup, `_lookup_call`, whose answer stands in the prompt or follows from the calls before), each followed
    by its real response from the task's environment (which keeps the state the earlier calls left). Chat
    messages, as reference_messages's; the chat ends with the last tool response. Lookups of the tools in
    skip_lookups are not drawn: their responses get no loss (--sft-world-skip), so they would teach nothing."""
    if n < 1:
        raise ValueError(f"world_examples needs n >= 1 calls, got {n}")
    if not 0 <= lookup_frac <= 1:
        raise ValueError(f"world_examples needs lookup_frac in [0, 1], got {lookup_frac}")
    lookup_tools = tuple(t for t in LOOKUP_TOOLS if t not in skip_lookups)
    if lookup_frac > 0 and not lookup_tools:
        raise ValueError(f"world_examples: lookup_frac {lookup_frac} but every lookup tool is skipped "
                         f"({', '.join(LOOKUP_TOOLS)})")
    env = make_env(task)
    msgs = [dict(m) for m in task.messages]
    for _ in range(n):
        # the lookup draw only when asked, so lookup_frac=0 keeps the random stream of earlier runs
        lookup = lookup_frac > 0 and rng.random() < lookup_frac
        name, args = _lookup_call(rng, env, lookup_tools) if lookup else _random_call(rng, env)
        msgs.append({"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]})
        msgs.append({"role": "tool", "content": env.step(name, args)})
    return msgs


def trajectory_from_messages(task: Task, messages: list[dict], rehearsed: bool = False) -> Trajectory:
    """Build a Trajectory (calls, observations, final answer) from chat messages like reference_messages's."""
    calls, obs, turn, pending = [], [], 0, 0
    final = ""
    for m in messages[len(task.messages):]:
        if m["role"] == "assistant":
            for tc in m.get("tool_calls") or []:
                f = tc["function"]
                args = f["arguments"]
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass
                calls.append(ToolCall(f["name"], args, turn=turn))
                pending += 1
            if not m.get("tool_calls"):
                final = m.get("content") or ""
            turn += 1
        elif m["role"] == "tool" and pending:
            obs.append(m["content"])
            pending -= 1
    return Trajectory(task_id=task.id, messages=list(messages), calls=calls, observations=obs,
                      rehearsed=[rehearsed] * len(obs), final_answer=final, end_reason="answer")


def corpus_text(n_tasks: int = 2000, seed: int = 0) -> list[str]:
    """Plain text lines for training a tokenizer on this world: tool schemas, every error message, and for
    n_tasks train tasks the prompts, the calls as JSON, the observations and the answers."""
    lines = [json.dumps(t) for t in TOOLS]
    lines += [json.dumps(t["function"]) for t in TOOLS]
    for msg in ["unknown tool: x", "missing argument: amount", "unexpected argument: x",
                "account must be a string", "amount must be a positive integer", "qty must be a positive integer",
                "unknown account: x", "unknown item: x", "same account", "not enough stock",
                "insufficient funds", "arguments must be an object"]:
        lines.append(_err(msg))
    for task in load_tasks("train", limit=n_tasks, seed=seed):
        for m in reference_messages(task):
            if m.get("content"):
                lines.extend(m["content"].split("\n"))
            for tc in m.get("tool_calls") or []:
                lines.append(json.dumps({"name": tc["function"]["name"],
                                         "arguments": tc["function"]["arguments"]}))
    return lines

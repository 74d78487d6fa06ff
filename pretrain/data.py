"""Synthetic pretraining documents for the tiny model: keyed recall, copying and small arithmetic.

The toy world's world model must answer `get_balance(bob)` with bob's balance from the system prompt: a keyed
lookup, which needs an induction-style circuit (a head that finds the earlier `bob` and copies what follows it).
A model trained only on the toy world's chats (3-4 accounts a table) settles on a one-hop shortcut instead:
copy *some* balance from the table, right ~30% of the time. These documents make that shortcut pay little and
repetition frequent (the two levers the literature names: many key-value pairs per sequence, Zoology; frequent
reliable repetitions, Aoyama et al. 2025):

    world   the toy world's own chat format on a random table of 3-14 accounts and 2-7 items: system prompt
            (the full tools block, ~200 tokens, in 15% of them), then 4-10 calls, most of them lookups, each with
            its real response from toyworld.ToyEnv (transfers and purchases change the state, errors included).
            Loss on the calls and the responses.
    copy    a random string of names and digits, then the same string again: loss on the repeat.
    arith   lines like `40 - 5 = 35`, `3 * 4 = 12`, `40 / 2 = 20`: loss on the results.

Held-out rule: a training table never equals the table of a toy-world test task (HeldOut). Each document is
drawn from `random.Random((seed, step, row))` only, so a resumed run sees exactly the documents an
uninterrupted one would.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

import chat_format
from bench import toyworld

KINDS = ("world", "copy", "arith")
# user turns in the toy world's own phrasing (the calls that follow are random: only the responses are learned)
QUESTIONS = ["How much money does {a} have?", "What is {a}'s balance?",
             "Send {n} from {a} to {b}, then tell me {b}'s balance.", "How much do {a} and {b} have together?",
             "Buy {n} {item}s for {a}. How much money does {a} have left?",
             "Move half of {a}'s money to {b}. How much does {b} have now?"]


@dataclass
class DataConfig:
    """Mixture and shape of the documents."""
    world_frac: float = 0.7
    copy_frac: float = 0.2                 # arith takes the rest
    min_accounts: int = 3
    max_accounts: int = 14                # leaves names for the unknown-account errors
    min_items: int = 2
    max_items: int = 7
    min_calls: int = 4
    max_calls: int = 10
    lookup_frac: float = 0.75              # share of world calls that are valid lookups (the rest toyworld's
                                           # random calls: transfers, purchases, invalid calls)
    tools_block_frac: float = 0.15         # share of world documents whose system prompt lists the tools
    user_turn_frac: float = 0.5            # share of world documents with a user question after the system turn
    max_len: int = 512                     # tokens; longer documents are cut (never happens at the defaults)
    write_frac: float = 0.0                # share of world calls that are VALID transfers or purchases (the
                                           # world's arithmetic); drawn before lookup_frac, which then takes
                                           # its share of the rest
    followup_frac: float = 0.0             # after a valid write, chance the next call looks up an account or
                                           # item it changed (the state update, in the world's own format)


# Named mixtures, switched at a step by pretrain/run.py (--stage): "recall" made the keyed lookups (steps
# 0-11,000 of the committed run); "arithmetic" keeps them in the mix and makes transfers and purchases, their
# follow-up lookups and bare arithmetic on the same operand ranges common (valid writes were ~3% of calls);
# "writes" (from step 20,000) has more world documents and more valid writes in them: at 20,000 the purchases'
# remaining stock was the one field the world model still got wrong.
STAGES = {
    "recall": {},
    "arithmetic": {"world_frac": 0.65, "copy_frac": 0.05, "write_frac": 0.45, "lookup_frac": 0.6,
                   "followup_frac": 0.6},
    "writes": {"world_frac": 0.75, "copy_frac": 0.05, "write_frac": 0.6, "lookup_frac": 0.6,
               "followup_frac": 0.6},
}


def stage_config(name: str) -> DataConfig:
    """The DataConfig of a named stage; a one-line error for an unknown name."""
    if name not in STAGES:
        raise ValueError(f"unknown pretraining stage {name!r}; choose from: {', '.join(STAGES)}")
    return DataConfig(**STAGES[name])


def table_key(balances: dict, prices: dict, stock: dict) -> tuple:
    """A table's identity, independent of the order it is printed in."""
    return (tuple(sorted(balances.items())), tuple(sorted(prices.items())), tuple(sorted(stock.items())))


class HeldOut:
    """The tables of the toy world's test tasks (first n): no training document shows one of them."""

    def __init__(self, n: int = 1000):
        self.keys = set()
        for t in toyworld.load_tasks("test", limit=n):
            w = t.metadata["world"]
            self.keys.add(table_key(w["balances"], w["prices"], w["stock"]))

    def __contains__(self, key) -> bool:
        return key in self.keys


def random_table(rng: random.Random, cfg: DataConfig) -> tuple[dict, dict, dict]:
    """Balances of k accounts (1-99, in random order), prices (2-9) and stock (1-9) of m items."""
    k = rng.randint(cfg.min_accounts, min(cfg.max_accounts, len(toyworld.NAMES)))
    m = rng.randint(cfg.min_items, min(cfg.max_items, len(toyworld.ITEMS)))
    names = rng.sample(toyworld.NAMES, k)
    items = rng.sample(toyworld.ITEMS, m)
    top = rng.choice([40, 99])             # the toy world's own range, and a wider one
    balances = {n: rng.randint(1, top) for n in names}
    prices = {i: rng.randint(2, 9) for i in items}
    stock = {i: rng.randint(1, 9) for i in items}
    return balances, prices, stock


def world_document(rng: random.Random, cfg: DataConfig, held: HeldOut) -> tuple[list[dict], list[dict] | None]:
    """(chat messages, tools or None): a random table, then calls each followed by its real response."""
    while True:
        balances, prices, stock = random_table(rng, cfg)
        if table_key(balances, prices, stock) not in held:
            break
    env = toyworld.ToyEnv(balances, prices, stock)
    messages = [{"role": "system", "content": toyworld._system_text(balances, prices, stock, True)}]
    if rng.random() < cfg.user_turn_frac:
        a, b = rng.sample(list(balances), 2)
        messages.append({"role": "user", "content": rng.choice(QUESTIONS).format(
            a=a, b=b, n=rng.randint(1, 20), item=rng.choice(list(prices)))})
    touched: tuple = ()
    for _ in range(rng.randint(cfg.min_calls, cfg.max_calls)):
        # the write and follow-up draws only when enabled, so the "recall" stage keeps its random stream
        if touched and cfg.followup_frac and rng.random() < cfg.followup_frac:
            name, args = rng.choice(touched)
        elif cfg.write_frac and rng.random() < cfg.write_frac:
            name, args = toyworld.valid_write_call(rng, env)
        elif rng.random() < cfg.lookup_frac:
            name, args = toyworld._lookup_call(rng, env)
        else:
            name, args = toyworld._random_call(rng, env)
        touched = followups(name, args) if cfg.followup_frac else ()
        messages.append({"role": "assistant", "content": "",
                         "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]})
        messages.append({"role": "tool", "content": env.step(name, args)})
    tools = toyworld.TOOLS if rng.random() < cfg.tools_block_frac else None
    return messages, tools


def followups(name: str, args: dict) -> tuple:
    """The lookups whose answers a valid write just changed."""
    if name == "transfer":
        return (("get_balance", {"account": args["src"]}), ("get_balance", {"account": args["dst"]}))
    if name == "buy":
        return (("get_balance", {"account": args["account"]}), ("get_price", {"item": args["item"]}))
    return ()


def copy_text(rng: random.Random) -> tuple[str, str]:
    """(context, target): a random run of names, items and numbers, then the same run again."""
    words = [rng.choice(toyworld.NAMES + toyworld.ITEMS) if rng.random() < 0.6 else str(rng.randint(0, 99))
             for _ in range(rng.randint(6, 30))]
    run = " ".join(words)
    return f"copy: {run}\nagain: ", run + "\n"


def arith_lines(rng: random.Random, cfg: DataConfig) -> list[tuple[str, str]]:
    """[(question, answer)]: the arithmetic the world's responses need (transfers, purchases, halves, sums)."""
    out = []
    for _ in range(rng.randint(4, 10)):
        op = rng.choice("+-*/m")
        a, b = rng.randint(1, 99), rng.randint(1, 99 if cfg.write_frac else 40)
        if op == "+":
            q, r = f"{a} + {b} = ", a + b
        elif op == "-":
            a, b = max(a, b), min(a, b)
            q, r = f"{a} - {b} = ", a - b
        elif op == "*":
            a, b = rng.randint(2, 9), rng.randint(1, 9)
            q, r = f"{a} * {b} = ", a * b
        elif op == "/":
            a = 2 * rng.randint(1, 49)
            q, r = f"{a} / 2 = ", a // 2
        else:
            a, b, c = rng.randint(1, 99), rng.randint(2, 9), rng.randint(1, 9)
            q, r = f"min({a} // {b}, {c}) = ", min(a // b, c)
        out.append((q, f"{r}\n"))
    return out


def encode_world(fmt, messages: list[dict], tools) -> tuple[list[int], list[int]]:
    """(ids, loss mask): the chat laid out token for token as a rollout lays it out
    (chat_format.encode_conversation, the warm start's and the lookup probe's encoding); loss on what the
    policy writes in either role (calls and responses), none on the prompt (the table's random numbers:
    nothing to learn) or the template's scaffolding."""
    opening = [m for m in messages if m["role"] in ("system", "user")]
    ids, labels = chat_format.encode_conversation(fmt, opening, tools, messages)
    return ids, [int(label != "prompt") for label in labels]


def encode_pairs(tok, pairs: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """(ids, mask) of text pieces; loss on the second of each (context, target) pair."""
    ids, mask = [], []
    for context, target in pairs:
        c = tok(context, add_special_tokens=False).input_ids
        t = tok(target, add_special_tokens=False).input_ids
        ids += c + t
        mask += [0] * len(c) + [1] * len(t)
    return ids, mask


def document(fmt, seed: int, step: int, row: int, cfg: DataConfig, held: HeldOut) -> tuple[list[int], list[int], str]:
    """(ids, loss mask, kind) of training row `row` of step `step`: a pure function of its arguments."""
    rng = random.Random(f"pretrain/{seed}/{step}/{row}")
    u = rng.random()
    if u < cfg.world_frac:
        ids, mask = encode_world(fmt, *world_document(rng, cfg, held))
        kind = "world"
    elif u < cfg.world_frac + cfg.copy_frac:
        ids, mask = encode_pairs(fmt.tok, [copy_text(rng)])
        kind = "copy"
    else:
        ids, mask = encode_pairs(fmt.tok, arith_lines(rng, cfg))
        kind = "arith"
    return ids[:cfg.max_len], mask[:cfg.max_len], kind


def describe(cfg: DataConfig) -> dict:
    """The DataConfig as a plain JSON-ready dict (recorded with exported weights)."""
    return json.loads(json.dumps(cfg.__dict__))

"""World-model fidelity per tool after a supervised warm start, with and without toy-world world examples.

    python -m experiments.warm_start_world --sft-steps 300                       # the three arms below, seed 0
    python -m experiments.warm_start_world --sft-steps 300 --arms plain,world
    python -m experiments.warm_start_world --curve runs/ws-skip-price     # every checkpoint of one warm start
    python -m experiments.warm_start_world --lookup runs/ws/ckpt/step_001000   # only: does it read the call's argument?

Each arm is one `train.py --steps 0` warm start (same seed, so the same task draws), then `evaluate.py`
on held-out test tasks with the fidelity probe on (every real call is also rehearsed in a discarded fork and
compared with the real response). Arms: `plain` (reference chats only, the default recipe), `world`
(`--sft-world-frac` of the sequences are world examples), `world-skip-price` (the same, but get_price
responses get no loss anywhere: the mechanism test, its get_price fidelity should stay near chance).
Then two fixed-call probes on the same held-out tasks, independent of how the policy acts (`probe_fidelity`):
the reference chat's gold calls, and random valid and invalid calls (toyworld.world_examples), each response
written greedily given the real responses before it. Writes one JSON per arm to --results: commands, wall
seconds, success, fidelity per tool on the policy's own calls and on the probes. `--probe-only` adds the
probes to existing results. `--curve RUN` measures the same for every checkpoint of an existing warm start
(fidelity against warm-start steps), one JSON per checkpoint, skipping those already written.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from intervals import wilson

ROOT = Path(__file__).resolve().parent.parent

ARMS = {"plain": [], "world": ["--sft-world-frac", "{frac}"],
        "world-skip-price": ["--sft-world-frac", "{frac}", "--sft-world-skip", "get_price"]}


def run(cmd: list[str]) -> float:
    """Run a command in the repository root (raises on failure); its wall seconds."""
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    return time.perf_counter() - t0


def per_tool(trajectories: Path) -> dict:
    """Fidelity per tool of the probes recorded in an evaluate.py trajectories JSONL."""
    import reward
    pairs = [(f["call"]["name"], f) for line in trajectories.read_text().splitlines()
             for f in json.loads(line)["fidelity"]]
    return reward.fidelity_by_tool(reward.fidelity_sums(pairs))


def probe_fidelity(checkpoint: str, tasks, kind: str, seed: int) -> dict:
    """Fidelity per tool on fixed calls, independent of how the policy acts: for each held-out task, every
    call of a fixed chat (kind "gold": the reference chat; "random": toyworld.world_examples, valid and
    invalid calls) is given with the real responses before it, and the policy writes that call's response
    greedily, up to the closing tag; compared with the real one (diagnostics.fidelity). Per tool, and split by
    whether the real response is an error; and for get_balance calls with a real value, exact beside the chance
of naming one of the prompt's balances at random (balance_chance)."""
    import random

    import torch

    import policy
    import reward
    import rollout
    from bench import toyworld
    from diagnostics import fidelity
    model, tok = policy.load_policy(checkpoint)
    eng = rollout.Engine(model.eval(), tok)
    fmt, pairs, balance_values = eng.fmt, [], []
    for i, task in enumerate(tasks):
        chat = toyworld.reference_messages(task)[:-1] if kind == "gold" else \
            toyworld.world_examples(task, random.Random(seed * 100_003 + i), 3)
        for k, m in enumerate(chat):
            if m["role"] != "tool":
                continue
            ids, _ = rollout.encode_conversation(eng, task, chat[:k])
            ids += fmt.encode([(fmt.after_eos + fmt.tool_open, "prompt", True)])[0]
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)
            text = tok.decode(out[0, len(ids):], skip_special_tokens=False)
            terminated = fmt.world_stop in text
            text = text[:text.index(fmt.world_stop) + len(fmt.world_stop)] if terminated else text
            call = chat[k - 1]["tool_calls"][0]["function"]["name"]
            f = fidelity(fmt.rehearsed_text(text, terminated), m["content"])
            pairs.append((call, f))
            if call == "get_balance" and not f["real_error"]:
                balance_values.append((f["exact"], balance_chance(task, m["content"])))
    by_outcome = [("real error" if f["real_error"] else "real value", f) for _, f in pairs]
    return {"by_tool": reward.fidelity_by_tool(reward.fidelity_sums(pairs)),
            "by_real_outcome": reward.fidelity_by_tool(reward.fidelity_sums(by_outcome)),
            "get_balance_value": {"calls": len(balance_values),
                                  "exact": sum(e for e, _ in balance_values) / max(1, len(balance_values)),
                                  "chance": sum(c for _, c in balance_values) / max(1, len(balance_values))}}


# per lookup tool: where the task keeps the answers, the call's argument, the response key holding the answer
LOOKUPS = {"get_balance": ("balances", "account", "balance"), "get_price": ("prices", "item", "price")}


def lookup_probe(checkpoint: str, tasks, tools=tuple(LOOKUPS)) -> dict:
    """Does the world model read the call's argument? For each task and lookup tool, a call for every account
    (get_balance) or shop item (get_price) in the prompt, right after the task's opening messages (nothing has
    moved yet: the answer stands in the prompt), its response written greedily. Per tool: exact (the answer
    value right), chance (1/entries on average), argument_blind (of the tasks whose real answers differ, the
    share where every entry got the same answer: the argument was ignored), rows (per task: argument, real, predicted)."""
    import torch

    import policy
    import rollout
    model, tok = policy.load_policy(checkpoint)
    eng = rollout.Engine(model.eval(), tok)
    fmt, result = eng.fmt, {}
    for tool in tools:
        table, arg, key = LOOKUPS[tool]
        rows = []
        for task in tasks:
            row = []
            for name, real in task.metadata["world"][table].items():
                call = {"type": "function", "function": {"name": tool, "arguments": {arg: name}}}
                ids, _ = rollout.encode_conversation(eng, task, [*task.messages, {"role": "assistant", "content": "",
                                                                                  "tool_calls": [call]}])
                ids += fmt.encode([(fmt.after_eos + fmt.tool_open, "prompt", True)])[0]
                with torch.no_grad():
                    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                         max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
                text = tok.decode(out[0, len(ids):], skip_special_tokens=False).split(fmt.world_stop)[0]
                try:
                    predicted = json.loads(text.strip()).get(key)
                except (ValueError, AttributeError):
                    predicted = None
                row.append({"argument": name, "real": real, "predicted": predicted})
            rows.append(row)
        cells = [c for row in rows for c in row]
        telling = [row for row in rows if len({c["real"] for c in row}) > 1] or [[]]   # answers differ
        result[tool] = {"tasks": len(rows), "calls": len(cells),
                        "exact": sum(c["predicted"] == c["real"] for c in cells) / len(cells),
                        "chance": sum(1 / len(row) for row in rows for _ in row) / len(cells),
                        "argument_blind": sum(len({c["predicted"] for c in row}) == 1 for row in telling) / len(telling),
                        "telling_tasks": len(telling), "rows": rows}
    return result


def write_probe(checkpoint: str, tasks, writes: int = 3, seed: int = 0) -> dict:
    """Does the world model compute the world's arithmetic? For each task, after its opening messages,
    `writes` random VALID transfers or purchases (toyworld.valid_write_call), each followed by a lookup of an
    account it changed (the state update), every call with the real responses before it. The policy writes
    each response greedily; exact = equal to the real response as parsed JSON. Per tool: transfer, buy, and
    "lookup after write" (get_balance right after a write that changed that account); rows: per call
    (tool, arguments, real, predicted)."""
    import random

    import torch

    import policy
    import rollout
    from bench import toyworld
    model, tok = policy.load_policy(checkpoint)
    eng = rollout.Engine(model.eval(), tok)
    fmt, counts, rows = eng.fmt, {}, []
    for i, task in enumerate(tasks):
        rng = random.Random(seed * 100_003 + i)
        env = toyworld.make_env(task)
        chat = [dict(m) for m in task.messages]
        for _ in range(writes):
            name, args = toyworld.valid_write_call(rng, env)
            account = args.get("src") or args.get("account") or ""
            steps = [(name, name, args)]
            if name in ("transfer", "buy"):
                steps.append(("lookup after write", "get_balance", {"account": account}))
            for label, tool, arguments in steps:
                chat.append({"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": tool, "arguments": arguments}}]})
                real = env.step(tool, arguments)
                ids, _ = rollout.encode_conversation(eng, task, chat)
                ids += fmt.encode([(fmt.after_eos + fmt.tool_open, "prompt", True)])[0]
                with torch.no_grad():
                    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                         max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)
                text = tok.decode(out[0, len(ids):], skip_special_tokens=False).split(fmt.world_stop)[0]
                try:
                    exact = json.loads(text.strip()) == json.loads(real)
                except ValueError:
                    exact = False
                c = counts.setdefault(label, [0, 0])
                c[0] += 1
                c[1] += exact
                rows.append({"tool": label, "arguments": arguments, "real": real, "predicted": text.strip()})
                chat.append({"role": "tool", "content": real})
    return {**{label: {"calls": n, "exact": hits / n} for label, (n, hits) in counts.items()}, "rows": rows}


def balance_chance(task, real: str) -> float:
    """How often naming one of the prompt's balances at random gets a get_balance value right: the share of
    the task's starting balances equal to the real one (after a transfer it can be 0)."""
    balances = list(task.metadata["world"]["balances"].values())
    return sum(b == json.loads(real)["balance"] for b in balances) / len(balances)


def wilson_interval(rate: dict) -> list[float]:
    """The 95% Wilson interval of a probe's exact share (rate: calls, exact)."""
    return [round(x, 4) for x in wilson(round(rate["exact"] * rate["calls"]), rate["calls"])]


def measure(ckpt: Path, out: Path, probe_tasks, args) -> dict:
    """Held-out success and fidelity of one checkpoint: evaluate.py with the probe, then the fixed-call probes."""
    eval_cmd = [sys.executable, "evaluate.py", "--model", str(ckpt), "--limit", str(args.limit), "--fidelity",
                "--seed", str(args.seed), "--out", str(out)]
    t_eval = run(eval_cmd)
    summary = json.loads((out / "summary.json").read_text())
    (trajs,) = sorted(out.glob("trajectories_B0_*.jsonl"))
    b0 = summary["runs"]["B=0"]
    return {"eval_command": " ".join(eval_cmd[1:]), "eval_seconds": round(t_eval, 1),
            "host": f"{platform.machine()}, 2 cores of a shared host, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
            "success_B0": b0["overall"]["success"], "fidelity": b0.get("fidelity"), "fidelity_by_tool": per_tool(trajs),
            "probe_fidelity": {k: probe_fidelity(str(ckpt), probe_tasks, k, args.seed) for k in ("gold", "random")},
            "lookup": lookup_probe(str(ckpt), probe_tasks)}


def curve(run_dir: Path, probe_tasks, args):
    """Every checkpoint of one warm start, measured once: fidelity against warm-start steps."""
    config = json.loads((run_dir / "config.json").read_text())
    for ckpt in sorted((run_dir / "ckpt").glob("step_*")):
        path = Path(args.results) / f"{run_dir.name}-{ckpt.name}.json"
        if path.exists() or not (ckpt / "state.json").exists():
            continue
        result = {"run": str(run_dir), "checkpoint": str(ckpt), "sft_steps": int(ckpt.name.split("_")[1]),
                  "sft_world_frac": config.get("sft_world_frac"), "sft_world_skip": config.get("sft_world_skip"),
                  "seed": args.seed, "tasks": args.limit, **measure(ckpt, run_dir / "eval" / ckpt.name, probe_tasks, args)}
        path.write_text(json.dumps(result, indent=1) + "\n")
        tools = {t: f"{v['exact']:.2f}/{v['calls']}" for t, v in result["probe_fidelity"]["random"]["by_tool"].items()}
        print(f"{ckpt.name}: success {result['success_B0']:.3f}, random-call exact fidelity {tools}", flush=True)


def main(argv=None):
    """Run the chosen mode: --lookup, --curve, or per arm train and evaluate (with --probe-only: only add the
    fixed-call probes to the arm's results); writes the JSONs."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--world-frac", type=float, default=0.25)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=32, help="held-out test tasks evaluated")
    ap.add_argument("--runs", default="runs/warm_start_world")
    ap.add_argument("--results", default="results/warm_start_world")
    ap.add_argument("--continue-from", type=int, default=0,
                    help="continue each arm's run of this many warm-start steps (copied) up to --sft-steps")
    ap.add_argument("--probe-only", action="store_true",
                    help="skip training and evaluation; add the fixed-call probes to the arms' existing results")
    ap.add_argument("--curve", default="", help="measure every checkpoint of this warm-start run folder instead")
    ap.add_argument("--lookup", nargs="+", default=[], metavar="CHECKPOINT",
                    help="only the fixed-call probes of these checkpoints (lookup_probe: get_balance, get_price; "
                         "write_probe: transfer, buy, lookup after write), one JSON each")
    args = ap.parse_args(argv)
    if args.lookup:
        from bench import toyworld
        tasks = toyworld.load_tasks("test", limit=args.limit)
        Path(args.results).mkdir(parents=True, exist_ok=True)
        for ckpt in args.lookup:
            writes = {tool: {**r, "interval_95": wilson_interval(r)} for tool, r in write_probe(ckpt, tasks).items()
                      if tool != "rows"}
            result = {"checkpoint": ckpt, "tasks_split": "test", "tasks": len(tasks), **lookup_probe(ckpt, tasks),
                      "writes": writes}
            name = "lookup-" + "-".join(Path(ckpt).parts[-3:]).replace("/", "-")
            (Path(args.results) / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
            print(ckpt + f" on {len(tasks)} test tables: " + "; ".join(
                f"{tool} exact {r['exact']:.2f} (chance {r['chance']:.2f}), argument-blind "
                f"on {r['argument_blind']:.0%} of {r['telling_tasks']} tasks"
                for tool, r in result.items() if tool in LOOKUPS) + "; " + "; ".join(
                f"{tool} exact {r['exact']:.3f} [{r['interval_95'][0]:.3f}, {r['interval_95'][1]:.3f}] of {r['calls']} calls"
                for tool, r in writes.items()), flush=True)
        return
    if args.curve:
        from bench import toyworld
        Path(args.results).mkdir(parents=True, exist_ok=True)
        return curve(Path(args.curve), toyworld.load_tasks("test", limit=args.limit), args)
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"unknown arm(s) {', '.join(bad)}; choose from {', '.join(ARMS)}")
    Path(args.results).mkdir(parents=True, exist_ok=True)
    from bench import toyworld
    probe_tasks = toyworld.load_tasks("test", limit=args.limit)
    for arm in arms:
        out = Path(args.runs) / f"{arm}-{args.sft_steps}"
        path = Path(args.results) / f"{arm}-{args.sft_steps}.json"
        if args.probe_only:
            result = json.loads(path.read_text())
            ckpt = out / (out / "latest").read_text().strip()
            t0 = time.perf_counter()
            result["probe_fidelity"] = {k: probe_fidelity(str(ckpt), probe_tasks, k, args.seed)
                                                for k in ("gold", "random")}
            result["probe_seconds"] = round(time.perf_counter() - t0, 1)
            path.write_text(json.dumps(result, indent=1) + "\n")
            print(json.dumps(result["probe_fidelity"], indent=1))
            continue
        if args.continue_from:   # the same warm start, longer: a copy of the shorter run, resumed
            import shutil
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(Path(args.runs) / f"{arm}-{args.continue_from}", out, ignore=shutil.ignore_patterns("eval"))
            train_cmd = [sys.executable, "train.py", "--resume", str(out), "--sft-steps", str(args.sft_steps),
                         "--save-every", str(args.sft_steps - args.continue_from)]
        else:
            train_cmd = [sys.executable, "train.py", "--steps", "0", "--sft-steps", str(args.sft_steps), "--seed",
                         str(args.seed), "--out", str(out), "--overwrite", "--save-every", str(args.sft_steps),
                         *[a.format(frac=args.world_frac) for a in ARMS[arm]]]
        t_train = run(train_cmd)
        ckpt = out / (out / "latest").read_text().strip()
        eval_cmd = [sys.executable, "evaluate.py", "--model", str(ckpt), "--limit", str(args.limit), "--fidelity",
                    "--seed", str(args.seed), "--out", str(out / "eval")]
        t_eval = run(eval_cmd)
        summary = json.loads((out / "eval" / "summary.json").read_text())
        (trajs,) = sorted((out / "eval").glob("trajectories_B0_*.jsonl"))
        b0 = summary["runs"]["B=0"]
        result = {"arm": arm, "sft_steps": args.sft_steps, "continued_from": args.continue_from or None, "seed": args.seed, "tasks": args.limit,
                  "train_command": " ".join(train_cmd[1:]), "eval_command": " ".join(eval_cmd[1:]),
                  "train_seconds": round(t_train, 1), "eval_seconds": round(t_eval, 1),
                  "host": f"{platform.machine()}, 2 cores of a shared host, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
                  "success_B0": b0["overall"]["success"], "fidelity": b0.get("fidelity"),
                  "fidelity_by_tool": per_tool(trajs)}
        result["probe_fidelity"] = {k: probe_fidelity(str(ckpt), probe_tasks, k, args.seed)
                                            for k in ("gold", "random")}
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""The method's smallest end-to-end claim, run for real: a shortened `python train.py` (supervised warm start,
then EnvACE GRPO steps) on the embedded tiny model and toy world teaches held-out tasks the tool-use protocol
the untrained model does not follow: the gold tools, in the gold order, with the gold argument names, then a
final answer.

Why not task success: success needs the tiny model's copy transition (names and numbers copied from the
prompt and observations), whose timing is chaotic and CPU-dependent: step ~280 and ~575 on one machine,
not yet by step 660 in two runs on another (results/README.md). A success threshold at a fixed budget would pass or fail
with the CI machine's float kernels. Trained on the two evaluated families, the protocol was learned by step
60 in every run we measured (all eight families need more: none by step 120); the test gives 120 steps."""
import json

import checkpoint
import evaluate
from bench import toyworld
from tests.scripted import run_train

SFT_STEPS, GRPO_STEPS = 120, 2
LIMIT, FAMILIES = 16, "balance,send"
# held-out test tasks (the test split's account pairs never appear together in training)
EVAL = ["--bench", "toyworld", "--greedy", "--limit", str(LIMIT), "--task-opts", f"families={FAMILIES}", "--no-fidelity"]


def follows_protocol(row, task) -> bool:
    gold = task.ground_truth["calls"]
    calls = row["calls"]
    return (row["end_reason"] == "final_answer" and [c["name"] for c in calls] == [g["name"] for g in gold]
            and all(set(c["arguments"]) == set(g["arguments"]) for c, g in zip(calls, gold)))


def evaluate_model(tmp_path, name, model):
    out = tmp_path / name
    assert evaluate.main(["--model", str(model), "--out", str(out), *EVAL]) in (0, None)
    tasks = {t.id: t for t in toyworld.load_tasks("test", limit=LIMIT, families=FAMILIES)}
    rows = [json.loads(line) for line in (out / "trajectories_B0_parallel.jsonl").read_text().splitlines()]
    assert sorted(r["task_id"] for r in rows) == sorted(tasks)
    protocol = sum(follows_protocol(r, tasks[r["task_id"]]) for r in rows) / len(rows)
    success = json.loads((out / "summary.json").read_text())["runs"]["B=0"]["overall"]["success"]
    return protocol, success


def test_follows_protocol_only_when_gold_calls_match():
    task = toyworld.load_tasks("test", limit=2, families="send")[0]
    gold = task.ground_truth["calls"]
    assert len(gold) == 1 and gold[0]["name"] == "transfer"
    row = {"end_reason": "final_answer", "calls": [dict(gold[0])]}
    assert follows_protocol(row, task)
    assert not follows_protocol(dict(row, end_reason="max_new_tokens"), task)
    assert not follows_protocol(dict(row, calls=[{"name": "get_balance", "arguments": {"account": "x"}}]), task)
    assert not follows_protocol(dict(row, calls=[{"name": "transfer", "arguments": {"src": "a", "dst": "b"}}]), task)
    assert not follows_protocol(dict(row, calls=[]), task)


def test_training_teaches_the_held_out_tool_protocol(tmp_path):
    run = tmp_path / "run"
    res = run_train(["--out", str(run), "--sft-steps", str(SFT_STEPS), "--steps", str(GRPO_STEPS),
                     "--save-every", str(SFT_STEPS + GRPO_STEPS), "--task-opts", f"families={FAMILIES}"])
    assert res.returncode == 0, res.stderr[-2000:]
    trained = checkpoint.latest_checkpoint(run)
    assert trained.name == f"step_{SFT_STEPS + GRPO_STEPS:06d}"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["phase"] for m in metrics].count("grpo") == GRPO_STEPS
    sft = [m["loss"] for m in metrics if m["phase"] == "sft"]
    assert sum(sft[-20:]) / 20 < 0.5 * sum(sft[:5]) / 5, "the warm-start loss did not fall"
    (before, success_before), (after, success_after) = evaluate_model(tmp_path, "untrained", "tiny"), \
        evaluate_model(tmp_path, "trained", trained)
    print(f"held-out (balance, send; {LIMIT} tasks, greedy): protocol {before:.3f} -> {after:.3f}, "
          f"success {success_before:.3f} -> {success_after:.3f}")
    assert before <= 0.1 and after >= 0.9, (before, after)

"""experiments/experiment.py without training anything: the report from hand-made piece JSONs (numbers, the computed
ordering sentence, plots), and the piece runner with train.py / evaluate.py replaced by fakes (a written piece
is skipped, a missing one is trained from the warm start or resumed, and its JSON has the promised layout)."""
import json
import sys
from pathlib import Path

import pytest

from experiments import experiment

STEPS = 30


def curve(price_exact):
    """A made-up training curve: success rises, get_price fidelity follows `price_exact(step)`, 2 calls a step."""
    return [{"step": s, "reward_mean": 0.5, "success_rate": s / STEPS, "flat_group_share": 0.25,
             "fidelity_exact/get_price": price_exact(s), "fidelity_n/get_price": 2,
             "fidelity_exact/get_balance": 0.5, "fidelity_n/get_balance": 4} for s in range(STEPS)]


TASKS = 100


def piece(arm, seed, b0, price_exact=lambda s: 0.2, held_out_price=0.3, per_task=True):
    """A made-up piece; with per_task, its first round(success x 100) held-out tasks succeed at each budget."""
    held_out = {}
    for i, label in enumerate(experiment.BUDGET_LABELS):
        rate = b0 + 0.01 * i
        held_out[label] = {"overall": {"success": rate}}
        if per_task:
            held_out[label]["per_task"] = {f"t{k}": [float(k < round(rate * TASKS))] for k in range(TASKS)}
    by_tool = {"get_price": {"calls": 10, "exact": held_out_price}, "get_balance": {"calls": 20, "exact": 0.5}}
    return {"piece": f"{arm}-s{seed}", "arm": arm, "seed": seed, "warm_start": "runs/ws/ckpt/step_004000",
            "grpo_steps": STEPS, "lr": 3e-4, "tasks_per_step": 8, "group_size": 4, "eval_tasks": 32,
            "host": "test", "wall_seconds": 600.0, "cpu_seconds": 1200.0, "training_curve": curve(price_exact),
            "held_out": held_out, "fidelity_by_tool": by_tool}


def write_pieces(results: Path, b0: dict, per_task=True):
    """3 arms x 2 seeds; envace's get_price fidelity rises from 0 to 1 over training, the others stay flat."""
    results.mkdir(parents=True, exist_ok=True)
    rising = lambda s: s / (STEPS - 1)  # noqa: E731
    for arm, values in b0.items():
        for seed, value in enumerate(values):
            p = piece(arm, seed, value, rising if arm == "envace" else (lambda s: 0.2),
                      held_out_price=[0.5, 0.7][seed] if arm == "envace" else 0.3, per_task=per_task)
            (results / f"{arm}-s{seed}.json").write_text(json.dumps(p))


def row(table: str, arm: str) -> list[str]:
    (line,) = [ln for ln in table.splitlines() if ln.startswith(f"| {arm} |")]
    return [c.strip() for c in line.strip("|").split("|")]


def test_report_numbers_and_paper_ordering_holds(tmp_path):
    from intervals import paired_difference, success_interval
    write_pieces(tmp_path, {"frozen-sim": [0.1, 0.2], "per-role": [0.2, 0.3], "envace": [0.3, 0.5]})
    text = experiment.write_report(tmp_path, plots=False).read_text()
    success_table = text.split("## Held-out success")[1].split("##")[0]
    # the interval over tasks, the two seeds pooled per task; the sample std over seeds |a - b| / sqrt(2)
    pooled = success_interval({f"t{k}": [float(k < 10), float(k < 20)] for k in range(TASKS)})
    assert row(success_table, "frozen-sim")[:3] == [
        "frozen-sim", "2", f"0.150 [{pooled.lo:.3f}, {pooled.hi:.3f}] sd 0.071"]
    assert row(success_table, "envace")[2].startswith("0.400 [") and row(success_table, "envace")[2].endswith("sd 0.141")
    assert row(success_table, "envace")[6].startswith("0.440 [")       # seq B=2, the fifth budget column
    assert row(success_table, "envace")[7] == "10"                     # minutes per piece
    assert ("By mean held-out success at B=0: envace (0.400) > per-role (0.250) > frozen-sim (0.150); "
            "the paper's ordering frozen-sim < per-role < envace holds in the means; paired on the same tasks and "
            "seeds: per-role − frozen-sim +0.100") in text
    paired = text.split("## Paired differences")[1].split("##")[0]
    d = paired_difference({f"t{k}": [float(k < 30), float(k < 50)] for k in range(TASKS)},
                          {f"t{k}": [float(k < 10), float(k < 20)] for k in range(TASKS)})
    assert (f"| envace − frozen-sim | B=0 | 2 | +0.250 [{d.lo:+.3f}, {d.hi:+.3f}] (40 better, 0 worse) |"
            in paired)
    assert "| envace: B=1 − B=0 | | 2 | +0.010 [+0.000, +0.025] (2 better, 0 worse) no difference |" in paired


def test_pieces_without_per_task_rewards_report_mean_and_std(tmp_path):
    write_pieces(tmp_path, {"frozen-sim": [0.1, 0.2], "per-role": [0.2, 0.3], "envace": [0.3, 0.5]},
                 per_task=False)
    text = experiment.write_report(tmp_path, plots=False).read_text()
    success_table = text.split("## Held-out success")[1].split("##")[0]
    assert row(success_table, "frozen-sim")[2] == "0.150 ± 0.071 (no interval)"
    assert "holds in the means (no per-task rewards to pair)." in text
    fidelity_table = text.split("## Held-out world-model fidelity")[1].split("##")[0]
    assert row(fidelity_table, "envace")[1:3] == ["0.500 ± 0.000", "0.600 ± 0.141"]   # get_balance, get_price
    assert row(fidelity_table, "envace")[3] == "-"                           # transfer: no calls
    training = text.split("## Training-time fidelity")[1]
    # get_price: steps 0-9 average 4.5/29, steps 20-29 average 24.5/29
    assert row(training, "envace")[2] == "0.155 → 0.845"
    assert row(training, "frozen-sim")[2] == "0.200 → 0.200"
    assert "envace +0.690" in training and "frozen-sim +0.000" in training


def test_ordering_sentence_does_not_hold_and_missing_arm(tmp_path):
    write_pieces(tmp_path, {"frozen-sim": [0.1, 0.2], "per-role": [0.45, 0.55], "envace": [0.3, 0.5]})
    text = experiment.write_report(tmp_path, plots=False).read_text()
    assert ("By mean held-out success at B=0: per-role (0.500) > envace (0.400) > frozen-sim (0.150); "
            "the paper's ordering frozen-sim < per-role < envace does not hold in the means") in text
    # equal means are no strict ordering
    groups = experiment.load_pieces(tmp_path)
    for p in groups["per-role"]:
        p["held_out"]["B=0"]["overall"]["success"] = 0.4
    assert "per-role (0.400) = envace (0.400)" in experiment.ordering_sentence(groups)
    assert "does not hold in the means" in experiment.ordering_sentence(groups)
    del groups["frozen-sim"]
    assert experiment.ordering_sentence(groups).endswith("cannot be checked (frozen-sim missing).")


def test_diagnostics_table_pools_the_seeds_counts(tmp_path):
    write_pieces(tmp_path, {"frozen-sim": [0.1], "envace": [0.3, 0.5]})
    assert "## Test-time rehearsal diagnosed" not in experiment.write_report(tmp_path, plots=False).read_text()
    counts = [{"rehearsed_turns": 10, "changed": 4, "helped": 1, "hurt": 2, "neutral": 1, "assess_agree": 6,
               "assess_disagree": 2, "assess_unmeasured": 5},
              {"rehearsed_turns": 30, "changed": 6, "helped": 3, "hurt": 0, "neutral": 3, "assess_agree": 9,
               "assess_disagree": 3}]
    for seed, c in enumerate(counts):
        path = tmp_path / f"envace-s{seed}.json"
        p = json.loads(path.read_text())
        p["rehearsal_diagnostics"] = {"B=2": c} if seed else {"B=2": c, "seq B=2": c}
        path.write_text(json.dumps(p))
    text = experiment.write_report(tmp_path, plots=False).read_text().split("## Test-time rehearsal diagnosed")[1]
    rows = [ln for ln in text.splitlines() if ln.startswith("| envace |")]
    # B=2: 10 of 40 turns changed, agreement 15 of 20 (unmeasured assessments left out); seq B=2: seed 0 only
    assert [c.strip() for c in rows[0].strip("|").split("|")] == [
        "envace", "B=2", "2", "40", "25% (10)", "4", "2", "4", "75% (15 of 20)"]
    assert [c.strip() for c in rows[1].strip("|").split("|")][1:5] == ["seq B=2", "1", "10", "40% (4)"]
    assert not [ln for ln in text.splitlines() if ln.startswith("| frozen-sim |")]


def test_training_fidelity_window_is_weighted_by_calls():
    points = [{"fidelity_exact/buy": 1.0, "fidelity_n/buy": 3}, {"fidelity_exact/buy": 0.0, "fidelity_n/buy": 1}]
    assert experiment.window_fidelity(points, "buy", last=False) == pytest.approx(0.75)
    assert experiment.window_fidelity(points, "transfer", last=True) is None


def test_plots_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    write_pieces(tmp_path, {"frozen-sim": [0.1, 0.2], "per-role": [0.2, 0.3], "envace": [0.3, 0.5]})
    text = experiment.write_report(tmp_path).read_text()
    for name in ("training_success.png", "training_fidelity.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in text


def test_without_matplotlib_the_tables_are_still_written(tmp_path, monkeypatch, capsys):
    write_pieces(tmp_path, {"envace": [0.3]})
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # `import matplotlib` raises ImportError
    text = experiment.write_report(tmp_path).read_text()
    assert "| envace | 1 | 0.300 [" in text and ".png" not in text
    assert "plots skipped" in capsys.readouterr().out
    assert not (tmp_path / "training_success.png").exists()


def test_moving_average_skips_missing_points():
    assert experiment.moving_average([1.0, None, 3.0, 5.0], 2) == [1.0, 1.0, 3.0, 4.0]
    assert experiment.moving_average([None], 10) == [None]


# ----------------------------------------------------------------------------------------------------------
# The piece runner, with fake commands


class Ran(Exception):
    """Raised by a fake runner: a command would have run."""


def setup_run(tmp_path):
    warm = tmp_path / "ws" / "ckpt" / "step_004000"
    warm.mkdir(parents=True)
    (warm / "config.json").write_text("{}")
    return warm, tmp_path / "runs", tmp_path / "results"


def argv(warm, runs, results, *extra):
    return ["--warm-start", str(warm), "--runs", str(runs), "--results", str(results), *extra]


def test_a_written_piece_is_skipped_and_a_missing_one_runs(tmp_path, monkeypatch):
    warm, runs, results = setup_run(tmp_path)
    write_pieces(results, {"envace": [0.3]})
    (results / "warm-start.json").write_text(json.dumps(piece("warm-start", 0, 0.1)))
    calls = []

    def fake(cmd, log):
        calls.append(cmd)
        raise Ran()

    monkeypatch.setattr(experiment, "run_command", fake)
    assert experiment.main(argv(warm, runs, results, "--arms", "envace", "--seeds", "0")) == 0
    assert calls == []
    (results / "envace-s0.json").unlink()
    with pytest.raises(Ran):
        experiment.main(argv(warm, runs, results, "--arms", "envace", "--seeds", "0"))
    (cmd,) = calls
    assert cmd[:3] == ["train.py", "--model", str(warm)]
    assert cmd[cmd.index("--steps") + 1] == "100" and cmd[cmd.index("--sft-steps") + 1] == "0"
    assert cmd[-2:] == ["--config", "configs/arms/envace.toml"]


def fake_checkpoint(run: Path, warm: Path, steps: int):
    ckpt = run / "ckpt" / f"step_{steps:06d}"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "state.json").write_text(json.dumps({"step": steps}))
    (run / "latest").write_text(f"ckpt/{ckpt.name}\n")
    (run / "config.json").write_text(json.dumps({"model": str(warm)}))


def test_a_shorter_run_is_resumed(tmp_path):
    warm, runs, results = setup_run(tmp_path)
    args = experiment.parse_args(argv(warm, runs, results))
    run = runs / "envace-s0"
    fake_checkpoint(run, warm, 40)
    assert experiment.train_command("envace", 0, run, args) == ["train.py", "--resume", str(run), "--steps", "100"]
    fake_checkpoint(run, warm, 100)
    assert experiment.train_command("envace", 0, run, args) is None
    (run / "config.json").write_text(json.dumps({"model": "another/warm/start"}))
    with pytest.raises(SystemExit, match="started from another/warm/start"):
        experiment.train_command("envace", 0, run, args)


def fake_commands(warm: Path):
    """train.py writes a checkpoint and 3 GRPO steps of metrics; evaluate.py a summary and one trajectory."""
    def run(cmd, log):
        out = Path(cmd[cmd.index("--out") + 1])
        if cmd[0] == "train.py":
            fake_checkpoint(out, warm, 100)
            records = [{"step": s, "phase": "grpo", "reward_mean": 0.5, "success_rate": 0.25, "flat_group_share": 0.5,
                        "loss": 0.1, "fidelity_exact/buy": 0.5, "fidelity_n/buy": 2, "fidelity_kv/buy": 0.5}
                       for s in range(3)]
            (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        else:
            out.mkdir(parents=True)
            flag = "--compare" if "--compare" in cmd else "--rehearsal-budget"
            budgets = cmd[cmd.index(flag) + 1]
            fid = [{"call": {"name": "get_price"}, "exact": True, "kv_agreement": 1.0, "error_correct": True}]
            lines = [{"task_id": f"t{i}", "trial": 0, "reward": float(i == 0), "fidelity": fid} for i in range(4)]
            (out / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
            runs = {f"B={b}": {"overall": {"success": 0.25}, "jsonl": "t.jsonl"} for b in budgets.split(",")}
            (out / "summary.json").write_text(json.dumps({"runs": runs, "rehearsal_diagnostics": {"x": 1}}))
        return {"cmd": "python " + " ".join(cmd), "wall_seconds": 1.0, "cpu_seconds": 2.0}
    return run


def test_piece_json_layout(tmp_path, monkeypatch):
    warm, runs, results = setup_run(tmp_path)
    monkeypatch.setattr(experiment, "run_command", fake_commands(warm))
    assert experiment.main(argv(warm, runs, results, "--arms", "frozen-sim", "--seeds", "1")) == 0
    p = json.loads((results / "frozen-sim-s1.json").read_text())
    assert p["arm"] == "frozen-sim" and p["seed"] == 1 and p["mirrors"] == "run_checklist_caller_only.sh"
    assert [c["cmd"].split()[1] for c in p["commands"]] == ["train.py"] + ["evaluate.py"] * 5
    assert p["wall_seconds"] == 6.0 and p["cpu_seconds"] == 12.0 and p["grpo_steps"] == 100
    assert list(p["training_curve"][0]) == ["step", "reward_mean", "success_rate", "flat_group_share",
                                            "fidelity_exact/buy", "fidelity_n/buy"]
    assert list(p["held_out"]) == experiment.BUDGET_LABELS
    assert p["fidelity_by_tool"]["get_price"]["exact"] == 1.0
    assert p["held_out"]["B=0"]["per_task"] == {"t0": [1.0], "t1": [0.0], "t2": [0.0], "t3": [0.0]}
    assert p["rehearsal_diagnostics"] == {label: {"x": 1} for label in experiment.BUDGET_LABELS}
    assert json.loads((results / "warm-start.json").read_text())["training_curve"] == []
    assert (results / "table.md").exists()


def test_a_piece_gains_the_budgets_it_lacks_without_retraining(tmp_path, monkeypatch):
    warm, runs, results = setup_run(tmp_path)
    calls = []
    fake = fake_commands(warm)
    monkeypatch.setattr(experiment, "run_command", lambda cmd, log: calls.append(cmd) or fake(cmd, log))
    assert experiment.main(argv(warm, runs, results, "--arms", "envace", "--seeds", "0", "--budgets", "0",
                                "--seq-budgets", "")) == 0
    assert list(json.loads((results / "envace-s0.json").read_text())["held_out"]) == ["B=0"]
    calls.clear()
    assert experiment.main(argv(warm, runs, results, "--arms", "envace", "--seeds", "0", "--budgets", "0,2")) == 0
    assert [(c[0], c[c.index("--rehearsal-budget") + 1] if "--rehearsal-budget" in c else None) for c in calls] \
        == [("evaluate.py", "2")] * 4          # B=2 and seq B=2 of the warm start, then of envace
    p = json.loads((results / "envace-s0.json").read_text())
    assert sorted(p["held_out"]) == ["B=0", "B=2", "seq B=2"] and p["training_curve"]
    assert len(p["commands"]) == 4          # train, B=0, then the two added


def test_per_role_checkpoints_are_evaluated_with_their_world_model(tmp_path):
    ckpt = tmp_path / "ck"
    (ckpt / "world_model").mkdir(parents=True)
    cmd = experiment.eval_command("B=2", str(ckpt), 0, tmp_path / "o", 8)
    assert cmd[cmd.index("--world-model") + 1].endswith("ck/world_model") and "--no-fidelity" in cmd
    assert "--world-model" not in experiment.eval_command("B=0", str(tmp_path), 0, tmp_path / "o", 8)


def test_balance_chance_is_the_share_of_starting_balances_equal_to_the_real_one():
    from bench import toyworld
    from experiments.warm_start_world import balance_chance
    task = toyworld.load_tasks("train", limit=2, seed=0)[1]
    balances = task.metadata["world"]["balances"]   # bob 2, ned 4, oli 17
    name = next(iter(balances))
    same = sum(v == balances[name] for v in balances.values())
    assert balance_chance(task, toyworld.make_env(task).step("get_balance", {"account": name})) == same / len(balances)
    assert balance_chance(task, '{"balance": 999}') == 0.0   # a value no account started with


@pytest.mark.parametrize("reads_argument", [True, False])
def test_lookup_probe_scores_a_model_that_reads_the_argument_and_one_that_ignores_it(reads_argument, micro_path,
                                                                                      monkeypatch):
    """A stand-in model answers each lookup from the prompt: by the call's argument, or always the first entry."""
    import re

    import torch

    import policy
    from bench import toyworld
    from experiments import warm_start_world as wsw
    model, tok = policy.load_policy(str(micro_path))
    tasks = toyworld.load_tasks("test", limit=4)

    def generate(input_ids, max_new_tokens, **_):
        text = tok.decode(input_ids[0])
        world = next(t for t in tasks if t.messages[0]["content"] in text).metadata["world"]
        tool, arg = re.findall(r'"name": "(\w+)", "arguments": \{"\w+": "(\w+)"', text)[-1]
        table, _, key = wsw.LOOKUPS[tool]
        entry = arg if reads_argument else next(iter(world[table]))
        answer = f'{{"{key}": {world[table][entry]}}}\n</tool_response>'
        return torch.cat([input_ids, torch.tensor([tok(answer, add_special_tokens=False)["input_ids"]])], dim=1)

    monkeypatch.setattr(model, "generate", generate)
    monkeypatch.setattr(policy, "load_policy", lambda path: (model, tok))
    result = wsw.lookup_probe("stand-in", tasks)
    assert set(result) == {"get_balance", "get_price"}
    for tool, (table, _, _) in wsw.LOOKUPS.items():
        r, n = result[tool], [len(t.metadata["world"][table]) for t in tasks]
        assert r["calls"] == sum(n) and r["tasks"] == 4 and r["chance"] == pytest.approx(len(tasks) / sum(n))
        # tasks whose entries all hold the same answer cannot tell reading from ignoring: left out of argument_blind
        assert r["telling_tasks"] == sum(len(set(t.metadata["world"][table].values())) > 1 for t in tasks) > 0
        assert [[c["argument"] for c in row] for row in r["rows"]] == [list(t.metadata["world"][table]) for t in tasks]
        if reads_argument:
            assert r["exact"] == 1.0 and r["argument_blind"] == 0.0
        else:
            assert r["argument_blind"] == 1.0
            assert r["exact"] == pytest.approx(sum(sum(c["real"] == row[0]["real"] for c in row)
                                                   for row in r["rows"]) / r["calls"])


def test_the_report_sets_an_earlier_experiment_beside_this_one(tmp_path):
    write_pieces(tmp_path / "old", {"frozen-sim": [0.1, 0.2], "envace": [0.3, 0.5]})
    write_pieces(tmp_path / "new", {"frozen-sim": [0.3, 0.3], "envace": [0.6, 0.8], "per-role": [0.4, 0.4]})
    text = experiment.write_report(tmp_path / "new", plots=False, compare_with=tmp_path / "old").read_text()
    beside = text.split("## Beside the earlier experiment")[1]
    assert row(beside, "envace")[1] == "0.400 → 0.700" and row(beside, "frozen-sim")[1] == "0.150 → 0.300"
    assert row(beside, "envace")[-1] == "0.600 → 0.600"          # get_price held-out fidelity, both means
    assert "| per-role |" not in beside                           # only arms both experiments ran


def test_task_options_reach_training_and_the_held_out_set_of_their_own(tmp_path):
    cmd = experiment.eval_command("B=1", str(tmp_path), 0, tmp_path / "o", 8, "families=costly")
    assert cmd[cmd.index("--task-opts") + 1] == "families=costly"
    assert "--task-opts" not in experiment.eval_command("B=1", str(tmp_path), 0, tmp_path / "o", 8)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "config.json").write_text("{}")
    args = experiment.parse_args(["--warm-start", str(ws), "--task-opts", "families=all", "--runs", str(tmp_path)])
    assert args.eval_task_opts == "families=all" and args.limit == 256
    train = experiment.train_command("envace", 0, tmp_path / "envace-s0", args)
    assert train[train.index("--task-opts") + 1] == "families=all"
    args = experiment.parse_args(["--warm-start", str(ws), "--task-opts", "families=all",
                                  "--eval-task-opts", "families=classic"])
    assert args.task_opts == "families=all" and args.eval_task_opts == "families=classic"


def test_grpo_step_size_report_pairs_each_run_with_the_warm_start(tmp_path):
    from experiments import grpo_step_size as g
    tasks = [f"t{i}" for i in range(40)]

    def piece(path, wins):
        p = tmp_path / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"held_out": {"B=0": {"per_task": {t: [float(i < wins)] for i, t in enumerate(tasks)}}}}))
    piece(g.WARM_START, 10)
    for k, (lr, path) in enumerate(g.PIECES.items()):
        piece(path, 10 + 5 * k)            # each lr wins 5 more of the same tasks than the one before
        m = tmp_path / f"results/grpo_lr/lr{lr}/metrics.jsonl"
        m.parent.mkdir(parents=True, exist_ok=True)
        m.write_text("\n".join(json.dumps({"success_rate": s / 20, "kl": 0.1, "entropy": 1.0}) for s in range(20)))
    s = g.summarize(tmp_path)
    diffs = [r["minus_warm_start"] for r in s["runs"].values()]
    assert [round(d["diff"], 3) for d in diffs] == [0.0, 0.125, 0.25] and diffs[2]["better"] == 10
    t = s["runs"]["3e-5"]["training"]
    assert t["success_rate"] == {"first": 4.5 / 20, "last": 14.5 / 20} and t["reward_std"] is None
    assert "+0.250" in g.table(s)

"""Training outside the toy world: per-benchmark run settings, the no-op guard, warm starts on every benchmark with
references, train/held-out splits, device-side sampling. (Real weights on real benchmarks: test_real_model.py.)"""
import json
import os
from pathlib import Path

import pytest
import torch

import distributed
import evaluate
import grpo
import policy
import rollout
import train
from bench import load_bench, settings
from tests.scripted import run_train

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
FIXTURE = Path(__file__).parent / "fixtures" / "finmcp_synthetic.json"


def available(name):
    try:
        mod = load_bench(name)
        opts = {"data": FIXTURE} if name == "finmcp" else {}
        mod.load_tasks(settings.settings_for(name).train_split, limit=1, **opts)
        return mod
    except Exception as exc:   # package or data missing here
        pytest.skip(f"{name} is not available: {exc}")


@pytest.mark.parametrize("bench", list(settings.SETTINGS))
def test_train_and_evaluate_resolve_the_same_limits_under_the_paper_protocol(bench):
    cfg = train.TrainConfig(bench=bench).resolved()
    args = evaluate.resolve_config(evaluate.build_parser().parse_args(["--bench", bench, "--protocol", "paper"]),
                                   context=40960)
    for key in settings.LIMIT_FIELDS:
        assert getattr(cfg, key) == getattr(args, key) == getattr(settings.settings_for(bench), key), key
    cfg = train.TrainConfig(bench=bench, max_total_len=999).resolved()
    args = evaluate.resolve_config(evaluate.build_parser().parse_args(["--bench", bench, "--max-total-len", "999"]),
                                   context=40960)
    assert cfg.max_total_len == args.max_total_len == 999
    assert cfg.split == settings.settings_for(bench).train_split


def test_the_official_protocol_is_the_default_and_lifts_the_papers_caps_where_a_harness_has_its_own():
    def resolved(bench, *flags):
        return evaluate.resolve_config(evaluate.build_parser().parse_args(["--bench", bench, *flags]), context=40960)
    tau2, bfcl, toy = resolved("tau2"), resolved("bfcl"), resolved("toyworld")
    assert tau2.protocol == "official" and tau2.max_turns == 200 and tau2.max_total_len == 40960
    assert bfcl.max_turns == settings.NO_EPISODE_CAP and bfcl.max_total_len == 40960
    assert (toy.max_turns, toy.max_total_len) == (8, 2048)                 # no official harness: its own limits
    assert resolved("tau2", "--max-turns", "12").max_turns == 12          # a limit the user sets wins
    no_context = evaluate.resolve_config(evaluate.build_parser().parse_args(["--bench", "bfcl"]), context=None)
    assert no_context.max_total_len == settings.settings_for("bfcl").max_total_len
    with pytest.raises(ValueError, match="unknown protocol"):
        settings.eval_limits("tau2", "leaderboard", None)


def test_real_benchmarks_get_limits_sized_for_their_prompts():
    toy, tau2 = settings.settings_for("toyworld"), settings.settings_for("tau2")
    assert toy.max_total_len == 2048 and toy.max_turns == 8
    assert tau2.max_total_len >= 16384 and tau2.max_turns == 30 and tau2.max_new_tokens >= 256
    with pytest.raises(ValueError, match="known: toyworld"):
        settings.settings_for("nope")


def test_help_says_what_each_flag_means_with_choices_and_no_sentinels():
    text = train.build_parser().format_help()
    for expected in ("{rehearse,real,sim}", "{shared,separate}", "{toyworld,bfcl,tau2,vita,finmcp}",
                     "--tool-call-format", "bench/settings.py", "runs/MODEL-BENCH"):
        assert expected in " ".join(text.split()), expected
    assert "-1" not in text and "(default -1" not in text
    for action in train.build_parser()._actions:
        assert action.help, action.option_strings


def test_out_defaults_from_model_and_benchmark():
    assert train.TrainConfig().resolved().out == "runs/tiny-toyworld" == str(evaluate.TRAIN_RUN)
    assert train.default_out("/ckpt/Qwen3-4B/", "tau2") == "runs/Qwen3-4B-tau2"
    assert train.default_out("models/SmolLM2-135M-Instruct.Q4_1.gguf", "bfcl") == "runs/SmolLM2-135M-Instruct.Q4_1-bfcl"


def small(out, *extra):
    return ["--out", str(out), "--sft-steps", "0", "--steps", "1", "--tasks-per-step", "1", "--group-size", "2",
            *extra]


def test_a_prompt_over_the_limit_stops_the_run_with_one_line_naming_the_flag(tmp_path):
    res = run_train(small(tmp_path / "r", "--max-total-len", "40"))
    lines = [x for x in res.stderr.splitlines() if "error:" in x]
    assert res.returncode == 1 and len(lines) == 1, res.stderr[-2000:]
    assert "no row wrote an action" in lines[0] and "--max-total-len (now 40)" in lines[0]
    assert "the prompt has" in lines[0]


def test_a_run_that_never_updates_says_so_and_exits_non_zero(tmp_path, monkeypatch):
    import reward
    from bench import Score
    monkeypatch.setattr(reward, "trajectory_reward", lambda *a, **k: Score(reward=0.0))   # every group flat
    run = tmp_path / "flat"
    res = run_train(small(run, "--steps", "2"))
    assert res.returncode == 1 and "never updated" in res.stderr and "all 2 GRPO steps" in res.stderr, res.stderr
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["no_signal"] for r in recs] == [True, True] and recs[-1]["no_signal_steps"] == 2
    assert all(r["flat_group_share"] == 1.0 and r["signal_tokens"] == 0 and r["trained_tokens"] > 0 for r in recs)
    assert (run / "latest").exists()                                # what it did is still saved


def test_a_step_with_signal_counts_none_as_idle(tmp_path, monkeypatch):
    import reward
    from tests.scripted import alternating_rewards
    monkeypatch.setattr(reward, "trajectory_reward", alternating_rewards())
    run = tmp_path / "ok"
    res = run_train(small(run))
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["no_signal"] is False and rec["signal_tokens"] > 0 and rec["no_signal_steps"] == 0


@pytest.mark.parametrize("bench", ["toyworld", "bfcl", "tau2", "vita", "finmcp"])
def test_every_loader_gives_reference_messages_as_chat_messages(bench):
    mod = available(bench)
    opts = {"data": FIXTURE} if bench == "finmcp" else {}
    tasks = mod.load_tasks("train", limit=3, **opts)
    engine = rollout.Engine(*policy.load_policy("tiny"))
    with_calls = 0
    for task in tasks:
        msgs = mod.reference_messages(task)
        assert isinstance(msgs, list) and all(isinstance(m, dict) and "role" in m for m in msgs)
        assert msgs[:len(task.messages)] == task.messages and msgs[-1]["role"] == "assistant"
        with_calls += any(m["role"] == "assistant" and m.get("tool_calls") for m in msgs)   # some refuse (tau2)
        ids, roles = rollout.encode_conversation(engine, task, msgs)
        assert int(rollout.Role.ACT) in roles
        if any(m["role"] == "tool" for m in msgs):
            assert int(rollout.Role.WORLD) in roles
    assert with_calls >= 1


def test_bfcl_single_turn_reference_is_one_message_with_every_call():
    bfcl = available("bfcl")
    (task,) = bfcl.load_tasks("parallel", limit=1)
    msgs = bfcl.reference_messages(task)
    assert len(msgs) == len(task.messages) + 1 and len(msgs[-1]["tool_calls"]) == len(bfcl.reference_calls(task)) > 1
    (irr,) = bfcl.load_tasks("irrelevance", limit=1)
    assert bfcl.reference_messages(irr)[-1] == {"role": "assistant", "content": bfcl.REFERENCE_NO_CALL,
                                                 "tool_calls": []}


@pytest.mark.parametrize("bench,extra", [("bfcl", []), ("tau2", ["--task-opts", "domain=airline"]),
                                         ("vita", []), ("finmcp", ["--task-opts", f"data={FIXTURE}"])])
def test_a_warm_start_step_runs_on_every_benchmark_with_references(bench, extra, tmp_path):
    available(bench)
    run = tmp_path / bench
    res = run_train(["--bench", bench, "--out", str(run), "--sft-steps", "1", "--steps", "0", "--sft-batch", "1",
                     *extra])
    assert res.returncode == 0, res.stderr[-2000:]
    (rec,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rec["phase"] == "sft" and rec["tokens"] > 0 and rec["loss"] > 0 and rec["grad_norm"] > 0


def test_a_benchmark_without_references_is_refused_in_one_line(monkeypatch):
    from bench import finmcp
    monkeypatch.delattr(finmcp, "reference_messages")
    with pytest.raises(train.ConfigError, match="no reference solutions to warm-start on; use --sft-steps 0"):
        train.validate(train.TrainConfig(bench="finmcp", sft_steps=5))
    train.validate(train.TrainConfig(bench="finmcp", sft_steps=0))


def test_bfcl_train_and_dev_are_disjoint_halves_of_the_multi_turn_entries():
    bfcl = available("bfcl")
    tr, dev = bfcl.load_tasks("train"), bfcl.load_tasks("dev")
    assert not {t.id for t in tr} & {t.id for t in dev}
    assert {t.metadata["category"] for t in tr} == {t.metadata["category"] for t in dev} == set(bfcl.MULTI_TURN_CATEGORIES)
    every = bfcl.load_tasks(",".join(bfcl.MULTI_TURN_CATEGORIES))
    assert {t.id for t in every} == {t.id for t in tr} | {t.id for t in dev}
    assert 0.35 < len(tr) / len(every) < 0.65
    assert [t.id for t in bfcl.load_tasks("train", ids="multi_turn_miss_func_146")] == ["multi_turn_miss_func_146"]


def test_tau2_trains_on_its_own_train_split_and_evaluates_on_test():
    tau2 = available("tau2")
    tr, te = tau2.load_tasks("train", domain="airline"), tau2.load_tasks("test", domain="airline")
    assert tr and te and not {t.id for t in tr} & {t.id for t in te}
    assert train.TrainConfig(bench="tau2").resolved().split == "train"
    both = tau2.load_tasks("train", domain="airline,retail")
    assert {t.metadata["domain"] for t in both} == {"airline", "retail"}
    assert len(both) == len(tr) + len(tau2.load_tasks("train", domain="retail"))
    with pytest.raises(ValueError, match="comma list"):
        tau2.load_tasks("train", domain="airline,mars")


# ------------------------------------------------------------------------------------------ sampling on the device

def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_cpu_sampling_is_the_row_generators_multinomial_as_before():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    cfg = rollout.SamplingConfig(temperature=0.8, top_p=0.9)
    tokens, _ = rollout.sample_rows(logits, cfg, _gens([1, 2, 3]))
    probs = rollout.top_p_cut(torch.softmax(logits / 0.8, -1), 0.9)
    expected = [int(torch.multinomial(probs[k], 1, generator=g)[0]) for k, g in enumerate(_gens([1, 2, 3]))]
    assert tokens == expected


def test_device_draws_keep_each_row_independent_of_the_batch():
    torch.manual_seed(1)
    logits = torch.randn(4, 300)
    cfg = rollout.SamplingConfig(temperature=1.0, top_p=0.95)
    batch = [rollout.sample_rows(logits, cfg, _gens([10, 11, 12, 13]), on_device=True)[0] for _ in range(1)][0]
    alone = [rollout.sample_rows(logits[k:k + 1], cfg, _gens([10 + k]), on_device=True)[0][0] for k in range(4)]
    assert batch == alone
    # the same draws whatever sits beside a row: swap the other rows' logits
    other = logits.clone()
    other[1:] = torch.randn(3, 300)
    assert rollout.sample_rows(other, cfg, _gens([10, 11, 12, 13]), on_device=True)[0][0] == batch[0]


def test_device_draws_follow_the_distribution_and_never_pick_a_cut_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]])
    logits = probs.clamp_min(1e-30).log()
    cfg = rollout.SamplingConfig(temperature=1.0, top_p=0.8)      # keeps tokens 0 and 1 (mass 0.8)
    gen = _gens([0])
    counts = torch.zeros(5)
    for _ in range(4000):
        (tok,), _ = rollout.sample_rows(logits, cfg, gen, on_device=True)
        counts[tok] += 1
    freq = counts / counts.sum()
    assert freq[2:].sum() == 0
    assert abs(freq[0] - 0.5 / 0.8) < 0.03 and abs(freq[1] - 0.3 / 0.8) < 0.03


def test_activation_checkpointing_gives_the_same_log_probs_and_gradients():
    import copy
    model, tok = policy.load_policy("tiny")
    ckpt = copy.deepcopy(model)
    distributed.enable_activation_checkpointing(ckpt)
    torch.manual_seed(0)
    ids = torch.randint(0, len(tok), (2, 40))
    mask = torch.rand(2, 40) < 0.5
    grads = []
    for m in (model.train(), ckpt.train()):
        logp = grpo.token_logprobs(m, ids, mask)
        (logp.sum()).backward()
        grads.append((logp.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for n in grads[0][1]:
        torch.testing.assert_close(grads[0][1][n], grads[1][1][n], atol=1e-6, rtol=1e-5)
    assert train.TrainConfig().resolved().activation_checkpointing == "off"
    assert train.TrainConfig(model="/ckpt/Qwen3-8B").resolved().activation_checkpointing == "on"

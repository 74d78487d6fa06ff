"""The tiny model's pretraining data (pretrain/data.py) and its resumable loop (pretrain/run.py)."""
import json
import random

import pytest
import torch

import chat_format
import policy
from bench import toyworld
from pretrain import data, run


@pytest.fixture(scope="module")
def fmt():
    _, tok = policy.load_policy("tiny")
    return chat_format.derive_chat_format(tok)


@pytest.fixture(scope="module")
def held():
    return data.HeldOut()


def test_documents_are_a_pure_function_of_seed_step_and_row(fmt, held):
    cfg = data.DataConfig()
    a = [data.document(fmt, 0, 5, r, cfg, held) for r in range(6)]
    b = [data.document(fmt, 0, 5, r, cfg, held) for r in range(6)]
    assert a == b and a != [data.document(fmt, 1, 5, r, cfg, held) for r in range(6)]
    assert {k for _, _, k in (data.document(fmt, 0, s, 0, cfg, held) for s in range(60))} == set(data.KINDS)


def test_world_documents_carry_the_real_responses_of_their_calls(held):
    cfg = data.DataConfig()
    for i in range(200):
        messages, _ = data.world_document(random.Random(i), cfg, held)
        table = messages[0]["content"].split("\n")[1:]
        balances = dict((n, int(v)) for n, v in (x.split() for x in table[0][len("Accounts: "):].split(", ")))
        shop = [x.split(" costs ") for x in table[1][len("Shop: "):].split(", ")]
        prices = {name: int(rest.split(" ")[0]) for name, rest in shop}
        stock = {name: int(rest.split("(")[1].split(" ")[0]) for name, rest in shop}
        env = toyworld.ToyEnv(balances, prices, stock)
        calls = [m for m in messages if m["role"] == "assistant"]
        responses = [m["content"] for m in messages if m["role"] == "tool"]
        assert len(calls) == len(responses) >= cfg.min_calls
        for call, response in zip(calls, responses):
            f = call["tool_calls"][0]["function"]
            assert env.step(f["name"], f["arguments"]) == response
        assert cfg.min_accounts <= len(balances) <= cfg.max_accounts


def test_no_training_table_is_a_held_out_test_table(held, monkeypatch):
    test_task = toyworld.load_tasks("test", limit=1)[0]
    w = test_task.metadata["world"]
    assert data.table_key(w["balances"], w["prices"], w["stock"]) in held
    draws = iter([(w["balances"], w["prices"], w["stock"])])
    real = data.random_table
    monkeypatch.setattr(data, "random_table", lambda rng, cfg: next(draws, None) or real(rng, cfg))
    messages, _ = data.world_document(random.Random(0), data.DataConfig(), held)
    assert not messages[0]["content"].endswith(toyworld._system_text(w["balances"], w["prices"], w["stock"], True)
                                               .split("\n", 1)[1])
    monkeypatch.undo()
    for i in range(3000):
        assert data.table_key(*data.random_table(random.Random(i), data.DataConfig())) not in held


def test_the_loss_falls_on_what_the_policy_writes_never_on_the_table(fmt, held):
    messages, tools = data.world_document(random.Random(3), data.DataConfig(), held)
    ids, mask = data.encode_world(fmt, messages, tools)
    tok = fmt.tok
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    for m in messages:
        if m["role"] == "tool":
            assert m["content"] in trained
    assert "Accounts:" not in trained and "Accounts:" in tok.decode(ids)
    ids, mask = data.encode_pairs(tok, data.arith_lines(random.Random(0), data.DataConfig()))
    assert "=" not in tok.decode([i for i, m in zip(ids, mask) if m])


def test_the_arithmetic_stage_writes_valid_transfers_and_purchases_and_looks_at_what_they_changed(held):
    cfg = data.stage_config("arithmetic")
    writes = followed = 0
    for i in range(200):
        messages, _ = data.world_document(random.Random(i), cfg, held)
        calls = [m["tool_calls"][0]["function"] for m in messages if m["role"] == "assistant"]
        responses = [m["content"] for m in messages if m["role"] == "tool"]
        for k, (call, response) in enumerate(zip(calls, responses)):
            if call["name"] in ("transfer", "buy") and "error" not in response:
                writes += 1
                nxt = calls[k + 1] if k + 1 < len(calls) else None
                followed += nxt is not None and (nxt["name"], nxt["arguments"]) in data.followups(
                    call["name"], call["arguments"])
    assert writes > 300 and followed > writes / 3, (writes, followed)
    with pytest.raises(ValueError, match="unknown pretraining stage"):
        data.stage_config("nope")


def test_a_valid_write_call_is_accepted_by_the_world():
    for i in range(300):
        task = toyworld.load_tasks("train", limit=300)[i]
        env = toyworld.make_env(task)
        rng = random.Random(i)
        for _ in range(4):
            name, args = toyworld.valid_write_call(rng, env)
            assert "error" not in env.step(name, args), (name, args)


def test_a_stage_switch_is_recorded_and_kept_by_later_pieces(tmp_path):
    common = ["--steps", "6", "--save-every", "2", "--probe-tasks", "0", "--batch", "2"]
    assert run.main(["--out", str(tmp_path / "a"), *common, "--until", "2"]) == 0
    assert run.main(["--out", str(tmp_path / "a"), "--stage", "arithmetic", "--until", "4"]) == 0
    assert run.main(["--out", str(tmp_path / "a")]) == 0
    state = json.loads((tmp_path / "a" / "ckpt" / "state.json").read_text())
    assert state["step"] == 6 and state["config"]["stages"] == [[0, "recall"], [2, "arithmetic"]]
    cfg = run.PretrainConfig(stages=state["config"]["stages"])
    assert [run.stage_at(s, cfg) for s in (0, 1, 2, 5)] == ["recall", "recall", "arithmetic", "arithmetic"]


def test_an_extension_restarts_the_lr_and_is_kept_by_later_pieces(tmp_path):
    common = ["--steps", "4", "--save-every", "2", "--probe-tasks", "0", "--batch", "2"]
    assert run.main(["--out", str(tmp_path / "a"), *common, "--until", "2"]) == 0
    with pytest.raises(SystemExit):                  # the first schedule has not ended
        run.main(["--out", str(tmp_path / "a"), "--extend-to", "8"])
    assert run.main(["--out", str(tmp_path / "a")]) == 0
    assert run.main(["--out", str(tmp_path / "a"), "--extend-to", "8", "--extend-lr", "5e-4", "--until", "6"]) == 0
    assert run.main(["--out", str(tmp_path / "a")]) == 0          # the recorded extension continues to 8
    state = json.loads((tmp_path / "a" / "ckpt" / "state.json").read_text())
    assert state["step"] == 8 and state["config"]["extensions"] == [[4, 8, 5e-4]]
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    cfg = run.PretrainConfig(**state["config"])
    assert lrs[4] == pytest.approx(5e-4) and lrs[3] < lrs[4]            # a warm restart at step 4
    assert lrs == pytest.approx([run.lr_at(s, cfg) for s in range(8)])
    assert lrs[5] > lrs[6] > lrs[7] > cfg.min_lr_frac * cfg.lr          # cosine down over the extension


def test_targets_are_the_next_token_where_the_mask_is_set():
    ids, attn, targets = run.collate([([5, 6, 7, 8], [0, 0, 1, 1], "x"), ([9, 10], [0, 1], "y")], 0, "cpu")
    assert targets.tolist() == [[-100, 7, 8, -100], [10, -100, -100, -100]]
    assert attn.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


def test_a_resumed_piece_equals_the_uninterrupted_run(tmp_path):
    common = ["--steps", "6", "--save-every", "2", "--probe-tasks", "0", "--batch", "2"]
    assert run.main(["--out", str(tmp_path / "full"), *common]) == 0
    assert run.main(["--out", str(tmp_path / "part"), *common, "--until", "4"]) == 0
    assert run.main(["--out", str(tmp_path / "part")]) == 0          # the saved config continues to 6
    full = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    part = [json.loads(x) for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in part] == list(range(1, 7))
    for a, b in zip(full, part):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4) and a["tokens"] == b["tokens"]
    from safetensors.torch import load_file
    wa = load_file(str(tmp_path / "full" / "ckpt" / "model.safetensors"))
    wb = load_file(str(tmp_path / "part" / "ckpt" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=0)


def test_a_committed_state_folder_continues_the_run_on_a_new_machine(tmp_path):
    import shutil
    common = ["--steps", "4", "--save-every", "2", "--probe-tasks", "0", "--batch", "2"]
    assert run.main(["--out", str(tmp_path / "full"), *common]) == 0
    assert run.main(["--out", str(tmp_path / "a"), *common, "--until", "2"]) == 0
    state = tmp_path / "state"                      # what a session commits: the checkpoint and the metrics
    shutil.copytree(tmp_path / "a" / "ckpt", state)
    shutil.copy(tmp_path / "a" / "metrics.jsonl", state / "metrics.jsonl")
    assert run.main(["--out", str(tmp_path / "b"), "--resume-from", str(state)]) == 0
    full = [json.loads(x)["loss"] for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(x)["loss"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert resumed == pytest.approx(full, abs=1e-4)
    with pytest.raises(SystemExit):
        run.main(["--out", str(tmp_path / "c"), "--resume-from", str(tmp_path / "nothing")])


def test_the_shipped_weights_read_their_context():
    """weights/tiny-recall (what `--model tiny` loads): keyed lookups right on held-out tables, never blind."""
    from experiments.warm_start_world import lookup_probe
    assert policy.resolve_model_path("tiny") == policy.TINY_WEIGHTS
    result = lookup_probe("tiny", toyworld.load_tasks("test", limit=4))
    for tool in ("get_balance", "get_price"):
        assert result[tool]["exact"] >= 0.9 and result[tool]["argument_blind"] == 0, (tool, result[tool])
    untrained = lookup_probe("tiny-init", toyworld.load_tasks("test", limit=4))
    assert untrained["get_balance"]["exact"] < 0.5          # the probe can fail: the random init does


def test_missing_or_stale_shipped_weights_are_refused_in_one_line(tmp_path):
    import shutil
    with pytest.raises(policy.PolicyLoadError, match="missing"):
        policy.shipped_tiny(tmp_path / "nothing")
    stale = tmp_path / "stale"
    shutil.copytree(policy.TINY_WEIGHTS, stale)
    meta = json.loads((stale / "pretrain.json").read_text())
    meta["tiny_recipe"]["hidden_size"] += 64
    (stale / "pretrain.json").write_text(json.dumps(meta))
    with pytest.raises(policy.PolicyLoadError, match="pretrain them again"):
        policy.shipped_tiny(stale)


def test_the_probe_table_has_a_row_per_probe_with_the_losses_since_the_last(tmp_path):
    lines = [{"step": 1, "loss_world": 2.0}, {"step": 2, "loss_world": 1.0, "probe": {"get_balance": {
        "exact": 0.5, "argument_blind": 1.0}}}, {"step": 3, "loss_arith": 0.5},
        {"step": 4, "loss_world": 0.25, "probe": {"transfer": {"exact": 0.25}}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"torn')
    (tmp_path / "state.json").write_text(json.dumps({"config": {"stages": [[0, "recall"], [2, "arithmetic"]]}}))
    rows = [r.strip("|").split("|") for r in run.probe_table(tmp_path / "metrics.jsonl").splitlines()[2:]]
    rows = [[c.strip() for c in r] for r in rows]
    assert rows[0][:4] == ["2", "recall", "0.50", "1.00"] and rows[0][-3:] == ["1.50", "-", "-"]
    assert rows[1][:2] == ["4", "arithmetic"] and rows[1][6] == "0.25" and rows[1][-3:] == ["0.25", "-", "0.50"]
    assert len(run.probe_table(tmp_path / "metrics.jsonl", first_step=3).splitlines()) == 3

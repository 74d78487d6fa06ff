import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import distributed
import grpo
import policy
import rollout
import train
import warm_start
from rollout import Role
from tests.launch import child_env, torchrun
from tests.scripted import run_train, tasks

ROOT = Path(__file__).resolve().parent.parent
ACT_WORLD = [Role.ACT, Role.WORLD]


def random_batch(B=4, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 400, (B, T), generator=g)
    roles = torch.randint(1, 5, (B, T), generator=g)
    roles[0, 18:] = Role.PAD
    return ids, roles


def test_chunked_logprobs_equal_naive_log_softmax(micro64):
    model, _ = micro64
    ids, roles = random_batch()
    mask = grpo.role_mask(roles, ACT_WORLD)
    attn = (roles != Role.PAD).long()
    for chunk in (1, 5, 1000):
        for temp in (1.0, 0.7):
            got = grpo.token_logprobs(model, ids, mask, attn, temperature=temp, chunk_size=chunk)
            logits = model(input_ids=ids, attention_mask=attn).logits / temp
            naive = torch.zeros_like(got)
            naive[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
            naive = naive * mask
            naive[:, 0] = 0
            torch.testing.assert_close(got, naive, atol=1e-12, rtol=0)
            assert torch.all(got[~mask] == 0)


def group_batch(prompt_len=24, G=4, seed=1):
    """G rows sharing a prompt, each with its own suffix length (right-padded), as a GRPO group arrives."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 400, (prompt_len,), generator=g)
    lengths = [prompt_len + n for n in (9, 3, 14, 1)[:G]]
    T = max(lengths)
    ids = torch.zeros(G, T, dtype=torch.long)
    roles = torch.full((G, T), int(Role.PAD))
    for b, n in enumerate(lengths):
        ids[b, :prompt_len] = prompt
        ids[b, prompt_len:n] = torch.randint(3, 400, (n - prompt_len,), generator=g)
        roles[b, :prompt_len] = Role.PROMPT
        roles[b, prompt_len:n] = torch.randint(1, 5, (n - prompt_len,), generator=g)
    return ids, roles


def test_shared_prompt_forward_equals_full_forward_in_value_and_gradient(micro64):
    model, _ = micro64
    ids, roles = group_batch()
    mask, attn = grpo.role_mask(roles, ACT_WORLD), (roles != Role.PAD).long()
    assert grpo.shared_prefix_len(ids, attn) == 24
    results = []
    for share in (True, False):
        model.zero_grad()
        logp = grpo.token_logprobs(model, ids, mask, attn, share_prefix=share)
        (logp * torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)).sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (shared, g_shared), (full, g_full) = results
    torch.testing.assert_close(shared, full, atol=1e-10, rtol=0)
    assert torch.all(shared[~mask] == 0)
    # Qwen3's RMSNorm computes in float32 even for a float64 model, so gradients summed over the rows in a
    # different order agree to float32 rounding, not float64's
    for name in g_full:
        torch.testing.assert_close(g_shared[name], g_full[name], atol=1e-6, rtol=1e-4)
    # two groups and a row of its own in one micro-batch: each group's prompt runs once, the lone row whole
    a, _ = group_batch(seed=2)
    b, _ = group_batch(prompt_len=30, G=2, seed=3)
    lone = torch.randint(3, 400, (1, 40))
    width = max(x.shape[1] for x in (a, b, lone))
    mixed = torch.cat([F.pad(x, (0, width - x.shape[1])) for x in (a, lone, b)])
    attn = (mixed != 0).long()
    assert grpo.prefix_runs(mixed, attn) == [(0, 4, 24), (5, 7, 30)]
    mask = attn.bool() & (torch.arange(width) >= 24)
    torch.testing.assert_close(grpo.token_logprobs(model, mixed, mask, attn),
                               grpo.token_logprobs(model, mixed, mask, attn, share_prefix=False), atol=1e-10, rtol=0)
    # rows that share nothing, or one row alone, take the plain forward
    assert grpo.shared_prefix_len(ids[:1], attn[:1]) == 0
    assert grpo.shared_prefix_len(torch.tensor([[5, 6, 7], [5, 6, 7]]), torch.ones(2, 3)) == 2
    assert grpo.shared_prefix_len(torch.tensor([[5, 6], [8, 6]]), torch.ones(2, 2)) == 0


def test_masked_positions_get_exactly_zero_gradient(micro64):
    model, _ = micro64
    ids, roles = random_batch()
    for train_roles in (ACT_WORLD, [Role.ACT]):
        mask = grpo.role_mask(roles, train_roles)
        logp = grpo.token_logprobs(model, ids, mask, (roles != Role.PAD).long()).detach().requires_grad_(True)
        old = torch.randn_like(logp)           # garbage everywhere, masked positions included
        adv = torch.randn(ids.shape)
        loss, _ = grpo.grpo_loss(logp, old, adv, roles, train_roles, grpo.LossConfig(kl_coef=0.1),
                                  ref_logp=torch.randn_like(logp))
        loss.backward()
        assert torch.all(logp.grad[~mask] == 0)
        assert torch.count_nonzero(logp.grad[mask]) > 0
    # and the model's own gradient does not depend on what sits at masked positions
    mask = grpo.role_mask(roles, ACT_WORLD)
    grads = []
    for fill in (0.0, 123.0):
        model.zero_grad()
        old = torch.where(mask, torch.full(ids.shape, -1.0, dtype=torch.float64), torch.full(ids.shape, fill, dtype=torch.float64))
        adv = torch.where(mask, torch.ones(ids.shape, dtype=torch.float64), torch.full(ids.shape, fill, dtype=torch.float64))
        logp = grpo.token_logprobs(model, ids, mask, (roles != Role.PAD).long())
        loss, _ = grpo.grpo_loss(logp, old, adv, roles, ACT_WORLD, grpo.LossConfig())
        loss.backward()
        grads.append(model.lm_head.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_group_advantages_on_hand_computed_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.7])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv, flat = grpo.group_advantages(rewards, groups, scale_std=True, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 0.0]))
    assert flat == 2                        # the all-equal group and the single-sample group
    adv, _ = grpo.group_advantages(rewards, groups, scale_std=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]))
    adv, _ = grpo.group_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 0, 0]), eps=0.0)
    std = torch.tensor([3.0, 1.0, 2.0]).std(unbiased=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0]) / std)


def test_per_role_advantages_use_rows_that_have_the_role():
    rewards = torch.tensor([1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0])
    roles = torch.tensor([[2, 3], [2, 3], [2, 2]])         # row 2 has no WORLD tokens
    adv, _ = grpo.role_advantages(rewards, groups, roles, ACT_WORLD, scale_std=False, per_role=True)
    assert adv[0, 0] == pytest.approx(2 / 3) and adv[2, 0] == pytest.approx(-1 / 3)   # ACT: over 3 rows
    assert adv[0, 1] == pytest.approx(0.5) and adv[1, 1] == pytest.approx(-0.5)       # WORLD: over rows 0, 1


def test_loss_at_ratio_one_is_the_plain_policy_gradient_and_clipping_engages():
    torch.manual_seed(0)
    roles = torch.tensor([[1, 2, 2, 3, 4, 2, 0]])
    mask = grpo.role_mask(roles, ACT_WORLD)
    base = torch.randn(roles.shape, dtype=torch.float64)
    adv = torch.tensor([0.7], dtype=torch.float64)
    logp = base.clone().requires_grad_(True)
    loss, st = grpo.grpo_loss(logp, base.clone(), adv, roles, ACT_WORLD, grpo.LossConfig())
    loss.backward()
    pg = base.clone().requires_grad_(True)
    (-(adv * pg * mask).sum() / mask.sum()).backward()
    torch.testing.assert_close(logp.grad, pg.grad)
    assert loss.item() == pytest.approx(-0.7) and st["clip_frac"] == 0
    # ratio 1.5 with a positive advantage: clipped at 1.2, no gradient
    logp = (base + torch.log(torch.tensor(1.5))).requires_grad_(True)
    loss, st = grpo.grpo_loss(logp, base, adv, roles, ACT_WORLD, grpo.LossConfig())
    loss.backward()
    assert st["clip_frac"] == 1.0 and torch.all(logp.grad == 0)
    assert loss.item() == pytest.approx(-0.7 * 1.2)
    # ratio 0.5 with a negative advantage: clipped at 0.8
    logp = (base + torch.log(torch.tensor(0.5))).requires_grad_(True)
    loss, st = grpo.grpo_loss(logp, base, -adv, roles, ACT_WORLD, grpo.LossConfig())
    assert st["clip_frac"] == 1.0 and loss.item() == pytest.approx(0.7 * 0.8)
    # ratio 10 with a negative advantage: dual clip bounds the loss at 3 * |A|
    logp = (base + torch.log(torch.tensor(10.0))).requires_grad_(True)
    loss, _ = grpo.grpo_loss(logp, base, -adv, roles, ACT_WORLD, grpo.LossConfig(dual_clip=3.0))
    assert loss.item() == pytest.approx(3 * 0.7)
    loss, _ = grpo.grpo_loss(logp, base, -adv, roles, ACT_WORLD, grpo.LossConfig(dual_clip=0.0))
    assert loss.item() == pytest.approx(10 * 0.7)


def test_grpo_raises_the_reward_of_a_trivially_learnable_target(micro_path):
    """Reward 1 when the first sampled token is even: a few GRPO updates must move the policy."""
    torch.manual_seed(0)
    model, tok = policy.load_policy(str(micro_path))
    engine = rollout.Engine(model, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    cfg = rollout.SamplingConfig(max_new_tokens=3, temperature=1.0)
    d = distributed.Dist()

    def rollout_and_reward(seed):
        ro = engine.run(tasks(2), 16, rollout.SamplingConfig(**{**cfg.__dict__, "seed": seed}), responses="rehearse")
        first = [int(ro.ids[b][ro.roles[b] == Role.ACT][0]) for b in range(ro.ids.shape[0])]
        return ro, torch.tensor([float(f % 2 == 0) for f in first])

    before = torch.cat([rollout_and_reward(1000 + s)[1] for s in range(3)]).mean()
    for step in range(24):
        ro, r = rollout_and_reward(step)
        adv, _ = grpo.role_advantages(r, torch.tensor(ro.task_index), ro.roles, [Role.ACT], True, False)
        train.policy_gradient(model, train.Batch(ro.ids, ro.roles, ro.logprobs, adv), [Role.ACT],
                              grpo.LossConfig(), d, micro_batch=32, temperature=1.0, chunk_size=256)
        train.optimizer_step(model, opt, 1.0)
    after = torch.cat([rollout_and_reward(1000 + s)[1] for s in range(3)]).mean()
    print(f"first-token-even reward: {float(before):.3f} -> {float(after):.3f}")
    assert after > before + 0.2, (before, after)


def test_fsdp_two_processes_match_one(micro_path, tmp_path):
    script = str(ROOT / "tests" / "fsdp_check.py")
    one_proc = subprocess.run([sys.executable, script, str(micro_path), str(tmp_path / "one.json")], env=child_env(),
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert one_proc.returncode == 0, one_proc.stderr[-4000:]
    torchrun([script, str(micro_path), str(tmp_path / "two.json")], timeout=300)
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert one["losses"] == pytest.approx(two["losses"], abs=1e-6)
    for k in one["params"]:
        assert one["params"][k] == pytest.approx(two["params"][k], abs=1e-5), k
    assert one["gen"] == two["gen"]          # generation with the unsharded FSDP model is the same


def small_run(micro_path, out, steps, extra=()):
    return ["--model", str(micro_path), "--out", str(out), "--sft-steps", "2", "--steps", str(steps),
            "--sft-batch", "4", "--tasks-per-step", "2", "--group-size", "2", "--max-new-tokens", "24",
            "--max-world-tokens", "12", "--max-turns", "3", "--lr", "1e-3", "--save-every", "1", "--no-require-update",
            *extra]


def params_of(ckpt):
    from safetensors.torch import load_file
    return load_file(str(Path(ckpt) / "model.safetensors"))


def test_resume_reproduces_the_uninterrupted_run(micro_path, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_train(small_run(micro_path, full, 2)).returncode == 0
    assert run_train(small_run(micro_path, part, 1)).returncode == 0
    assert (part / "latest").read_text().strip() == "ckpt/step_000003"
    res = run_train(["--resume", str(part), "--steps", "2"])
    assert res.returncode == 0, res.stderr
    a = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ("loss", "reward_mean", "act_tokens", "world_tokens", "grad_norm"):
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    pa, pb = params_of(full / "ckpt" / "step_000004"), params_of(part / "ckpt" / "step_000004")
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=1e-6, rtol=0)
    # the KL reference (on by default) is the policy as GRPO began, kept in the run for the resumed half
    ref_full, ref_part = params_of(full / "reference"), params_of(part / "reference")
    warm = params_of(part / "ckpt" / "step_000002")
    for k in warm:
        assert torch.equal(ref_full[k], warm[k]) and torch.equal(ref_part[k], warm[k]), k
    state = json.loads((part / "ckpt" / "step_000004" / "state.json").read_text())
    assert state["step"] == 4 and "config" in state
    metrics = json.loads((full / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("reward_mean", "success_rate", "loss", "kl", "clip_frac", "grad_norm", "tokens_per_s",
                "act_tokens", "world_tokens", "flat_groups", "flat_group_share", "evaluator_errors",
                "reward_std", "entropy", "response_tokens"):
        assert key in metrics
    assert metrics["response_tokens"] == metrics["act_tokens"] / metrics["rows"] and metrics["entropy"] > 0


def test_sampled_neg_logp_estimates_the_exact_entropy(micro_path):
    """The logged entropy (mean -log p of the sampled action tokens) agrees with the exact entropy of the
    policy's next-token distributions at the same positions, averaged over many samples."""
    model, tok = policy.load_policy(str(micro_path))
    ro = rollout.Engine(model, tok).run(tasks(2), 64, rollout.SamplingConfig(max_new_tokens=6, temperature=1.0,
                                                                            seed=3), responses="rehearse")
    total, n = train.sampled_neg_logp(ro.logprobs, ro.roles)
    with torch.no_grad():
        logits = model(input_ids=ro.ids, attention_mask=(ro.roles != Role.PAD).long()).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1)                       # predicts token t+1 from state t
    exact = -(logp.exp() * logp).sum(-1)                               # [B, T-1]
    sampled = ((ro.roles == Role.ACT) & (ro.logprobs != 0))[:, 1:]
    want = float(exact[sampled].mean())
    print(f"entropy: sampled estimate {total / n:.3f}, exact {want:.3f}, {n} tokens")
    assert n == int(sampled.sum()) > 300 and total / n == pytest.approx(want, rel=0.1)


def test_bad_input_exits_2_with_one_clear_line_and_overwrites_nothing(micro_path, tmp_path):
    cases = [
        (["--bench", "nope"], "argument --bench: invalid choice: 'nope'"),
        (["--model", str(tmp_path / "missing")], "does not exist"),
        (["--group-size", "0"], "--group-size must be positive"),
        (["--train-roles", "act,dream"], "roles must be"),
        (["--top-p", "1.5"], "--top-p"),
        (["--lr", "nan"], "--lr"),
    ]
    for args, msg in cases:
        res = run_train(["--out", str(tmp_path / "r"), *args])
        assert res.returncode == 2, (args, res.stderr)
        lines = [l for l in res.stderr.splitlines() if l.startswith("train.py: error:")]
        assert len(lines) == 1 and msg in lines[0], (args, res.stderr)
    res = run_train(["--group-size", "x"])
    assert res.returncode == 2 and "invalid int value" in res.stderr
    # an existing run is never overwritten without --resume/--overwrite
    run = tmp_path / "existing"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    res = run_train(small_run(micro_path, run, 1))
    assert res.returncode == 2 and "already exists" in res.stderr
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'
    # a corrupt checkpoint on resume
    good = tmp_path / "good"
    assert run_train(small_run(micro_path, good, 1)).returncode == 0
    (good / "ckpt" / "step_000003" / "state.json").write_text("{not json")
    res = run_train(["--resume", str(good)])
    assert res.returncode == 2 and "corrupt" in res.stderr
    (good / "ckpt" / "step_000003" / "model.safetensors").write_bytes(b"garbage")
    (good / "ckpt" / "step_000003" / "state.json").write_text('{"step": 3, "world_size": 1}')
    res = run_train(["--resume", str(good)])
    assert res.returncode == 2 and "cannot load model weights" in res.stderr
    assert run_train(["--resume", str(tmp_path / "nowhere")]).returncode == 2


# ----------------------------------------------------------------------------------------------------------
# Warm start: world examples and tools whose responses get no loss


def afford_task():
    from bench import toyworld as tw
    return next(t for t in tw.load_tasks("train", limit=16) if t.metadata["family"] == "afford")


def test_world_response_tools_name_every_world_stretch_in_every_warm_start_layout(micro_path):
    import random as _random

    from bench import toyworld as tw
    model, tok = policy.load_policy(str(micro_path))
    engine = rollout.Engine(model, tok)
    task = afford_task()
    ref = tw.reference_messages(task)
    world = tw.world_examples(task, _random.Random(3), 4)
    layouts = [(rollout.encode_conversation(engine, task, m), m) for m in (ref, world)]
    layouts += [(ex, None) for ex in warm_start.warm_start_examples(engine, task, ref, tw.make_env, _random.Random(1))]
    assert int(Role.WORLD) in layouts[2][0][1]   # the assessment example holds its proposal's response
    for (ids, roles), messages in layouts:
        spans = warm_start.world_response_tools(engine, task, ids, roles)
        assert all(name in tw._SIGNATURES for _, _, name in spans)
        assert spans or messages is None   # a memory example before the first call has no response yet
        for start, end, name in spans:
            text = tok.decode(ids[start:end], skip_special_tokens=False)
            assert text.endswith(engine.fmt.world_stop) and set(roles[start:end]) == {int(Role.WORLD)}
        if messages is not None:   # a whole chat: the k-th stretch is the k-th tool message, named by its call
            calls = [m["tool_calls"][0]["function"]["name"] for m in messages if m.get("tool_calls")]
            responses = [m["content"] for m in messages if m["role"] == "tool"]
            assert [name for _, _, name in spans] == calls
            for (start, end, _), resp in zip(spans, responses):
                assert tok.decode(ids[start:end], skip_special_tokens=False).startswith(resp)


def test_skipped_tools_responses_carry_no_warm_start_loss(micro_path):
    import random as _random

    from bench import toyworld as tw
    model, tok = policy.load_policy(str(micro_path))
    engine = rollout.Engine(model, tok)
    task = afford_task()
    ids, roles = rollout.encode_conversation(engine, task, tw.reference_messages(task))
    mask = warm_start.trained_role_mask(roles, ACT_WORLD)
    skipped = warm_start.without_world_loss(engine, task, ids, roles, mask, frozenset({"get_price"}))
    price = next((s, e) for s, e, n in warm_start.world_response_tools(engine, task, ids, roles) if n == "get_price")
    assert '"price"' in tok.decode(ids[price[0]:price[1]])
    changed = [i for i in range(len(ids)) if skipped[i] != mask[i]]
    assert changed == list(range(*price)) and not any(skipped[i] for i in changed)
    assert all(skipped[i] for i in range(len(ids)) if roles[i] == Role.ACT)   # acting on it is still learned
    # the loss is the mean NLL over exactly the other trained tokens; no gradient reaches the skipped ones
    d = distributed.Dist()
    loss, n_tok = warm_start.sft_loss(model, [(ids, roles, skipped)], d, tok.pad_token_id, 64)
    full_mask = grpo.role_mask(torch.tensor([roles]), ACT_WORLD)
    with torch.no_grad():
        logp = grpo.token_logprobs(model, torch.tensor([ids]), full_mask, chunk_size=64)[0]
    keep = [i for i in range(len(ids)) if full_mask[0, i] and not price[0] <= i < price[1]]
    assert n_tok == len(keep)
    assert loss == pytest.approx(float(-logp[keep].sum() / len(keep)), rel=1e-5)
    # every response skipped and only WORLD trained: nothing is left to learn from the sequence
    model.zero_grad()
    world_only = warm_start.trained_role_mask(roles, [Role.WORLD])
    all_skipped = warm_start.without_world_loss(engine, task, ids, roles, world_only,
                                                frozenset({"get_balance", "get_price", "buy"}))
    assert warm_start.sft_loss(model, [(ids, roles, all_skipped)], d, tok.pad_token_id, 64)[1] == 0
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    # a world example: its random calls stay ACT (roles say who wrote a token) but are not imitated (no loss);
    # only its responses (WORLD) train
    ids_w, roles_w, mask_w = warm_start.sft_sequence(engine, tw, task, ACT_WORLD, 0.0, _random.Random(0),
                                                     world_frac=1.0)
    assert Role.ACT in roles_w and mask_w == [r == Role.WORLD for r in roles_w] and any(mask_w)
    every_tool = frozenset({"get_balance", "get_price", "buy", "transfer"})
    ids_s, roles_s, mask_s = warm_start.sft_sequence(engine, tw, task, ACT_WORLD, 0.0, _random.Random(0),
                                                     world_frac=1.0, world_skip=every_tool)
    assert ids_s == ids_w and roles_s == roles_w and not any(mask_s)
    # lookups are never drawn for a skipped tool: every world-example call is a get_balance
    ids_l, _, _ = warm_start.sft_sequence(engine, tw, task, ACT_WORLD, 0.0, _random.Random(0), world_frac=1.0,
                                          world_skip=frozenset({"get_price"}), world_lookup=1.0)
    text = tok.decode(ids_l[len(rollout.encode_conversation(engine, task, task.messages)[0]):])
    assert "get_balance" in text and "get_price" not in text


def test_progress_bar_shows_reward_success_flat_share_and_exact_fidelity_over_the_steps_rehearsals():
    record = {"step": 5, "phase": "grpo", "loss": 0.12345, "reward_mean": 0.5, "success_rate": 0.25,
              "flat_group_share": 0.75, "fidelity_n/get_balance": 3, "fidelity_exact/get_balance": 1 / 3,
              "fidelity_n/buy": 1, "fidelity_exact/buy": 1.0}
    assert train.progress_fields(record) == {"loss": 0.123, "reward": 0.5, "success": 0.25, "flat": 0.75,
                                             "fid": 0.5}   # (1 + 1) exact of 4 rehearsed calls
    assert train.progress_fields({"step": 0, "phase": "sft", "loss": 2.0}) == {"loss": 2.0}


def test_role_weights_and_subconfigs_follow_the_config():
    """Per-role loss weights come from one function beside role_mask; sub-configs are filled by field name."""
    import rollout
    roles = torch.tensor([[Role.PROMPT, Role.ACT, Role.WORLD, Role.OBS, Role.ACT, Role.PAD]])
    w = grpo.role_weights(roles, [Role.ACT, Role.WORLD], {"act": 1.0, "world": 0.5})
    assert w.tolist() == [[0.0, 1.0, 0.5, 0.0, 1.0, 0.0]]
    assert torch.equal(w > 0, grpo.role_mask(roles, [Role.ACT, Role.WORLD]))
    cfg = train.TrainConfig(clip_high=0.28, temperature=0.7, max_turns=5, kl_coef=0.01)
    loss_cfg = train.subconfig(grpo.LossConfig, cfg, role_weights={"act": 2.0})
    assert (loss_cfg.clip_high, loss_cfg.kl_coef, loss_cfg.role_weights) == (0.28, 0.01, {"act": 2.0})
    sampling = train.subconfig(rollout.SamplingConfig, cfg, max_turns=9)
    assert (sampling.temperature, sampling.max_turns, sampling.seed) == (0.7, 9, cfg.seed)


def test_sft_memory_self_builds_memory_lines_with_the_model(micro_path, tmp_path, monkeypatch):
    """--sft-memory self: the warm start's memory examples are built from the model's own predictions
    (diagnostics.predict_responses, sampled with the rollout config); real (default) never generates."""
    import diagnostics
    calls = []
    real_predict = diagnostics.predict_responses

    def counting(eng, task, contexts, cfg, steer=None):
        calls.append((len(contexts), cfg.max_world_tokens, cfg.temperature))
        return real_predict(eng, task, contexts, cfg, steer)
    monkeypatch.setattr(warm_start, "predict_responses", counting)
    base = ["--model", str(micro_path), "--steps", "0", "--sft-steps", "2", "--sft-batch", "4",
            "--sft-rehearsal-frac", "1", "--max-world-tokens", "6", "--save-every", "10"]
    res = run_train(base + ["--out", str(tmp_path / "real")])
    assert res.returncode == 0, res.stderr
    assert calls == [] and json.loads((tmp_path / "real" / "config.json").read_text())["sft_memory"] == "real"
    res = run_train(base + ["--out", str(tmp_path / "self"), "--sft-memory", "self"])
    assert res.returncode == 0, res.stderr
    assert calls and all(1 <= n <= 4 and w == 6 and temp == 1.0 for n, w, temp in calls)
    assert json.loads((tmp_path / "self" / "config.json").read_text())["sft_memory"] == "self"

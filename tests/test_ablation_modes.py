"""The paper's ablation arms as training modes: a frozen simulator (--env sim) and per-role policies
(--world-model separate). The rollouts are scripted (tests/scripted.Script) so every row makes a tool call
whose response the simulator or world model writes; rewards are a deterministic function of the trajectory,
so GRPO groups are not flat and updates really happen."""
import json
import random
from pathlib import Path

import pytest
import torch

import grpo
import policy
import reward
import rollout
import train
from bench import Score
from rollout import Role
from tests.launch import torchrun
from tests.scripted import Script, call_text, run_train

ACT_SCRIPT = [[call_text("get_balance", '{"account": "'), 2, '"}}\n</tool_call>'], ["done ", 2]]


@pytest.fixture
def scripted(monkeypatch):
    """Every rollout row calls get_balance once (free argument tokens), then answers; the WORLD segments are
    free. Reward: parity of the trajectory's text length (deterministic, so a resumed run sees the same)."""
    real_run = rollout.Engine.run

    def run(self, tasks, group_size=1, cfg=None, *args, **kwargs):
        acts = {i: ACT_SCRIPT for i in range(len(tasks) * group_size)}
        return real_run(self, tasks, group_size, cfg, *args, steer=Script(self.tok, acts), **kwargs)

    def parity_reward(bench, task, traj, defects, penalty, kind="success"):
        text = traj.final_answer + "".join(traj.observations)
        return Score(reward=float(len(text) % 2), components={"success": float(len(text) % 2)})

    monkeypatch.setattr(rollout.Engine, "run", run)
    monkeypatch.setattr(reward, "trajectory_reward", parity_reward)


def config(micro_path, out, **kw):
    base = dict(model=str(micro_path), out=str(out), sft_steps=0, steps=2, tasks_per_step=2, group_size=4,
                max_new_tokens=32, max_world_tokens=10, max_turns=3, lr=5e-2, save_every=1, kl_coef=0.0)
    return train.TrainConfig(**{**base, **kw})


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def other_weights(micro_path, folder):
    """The micro model's tokenizer with other weights: a simulator that is not the policy."""
    model, tok = policy.load_policy(str(micro_path))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_frozen_simulator_writes_the_world_tokens_never_changes_and_carries_no_loss(micro_path, tmp_path, scripted):
    sim_path = other_weights(micro_path, tmp_path / "sim")
    t, _ = train.setup(config(micro_path, tmp_path / "run", env="sim", sim_model=str(sim_path)), None)
    assert t.train_roles == [Role.ACT]                  # the default train roles of --env sim
    sim_before, policy_before = state(t.sim_model), state(t.model)
    records = [train.grpo_step(t, step, random.Random(step))[0] for step in range(2)]
    assert all(r["world_tokens"] > 0 and r["flat_groups"] < 2 for r in records), records
    assert changed(policy_before, state(t.model))       # the actor learned ...
    assert not changed(sim_before, state(t.sim_model))  # ... the simulator did not
    assert all(not p.requires_grad for p in t.sim_model.parameters())

    # a rollout as in training: WORLD tokens carry the simulator's log-probs, ACT tokens the policy's
    ro = t.engine.run(t.tasks[:2], 2, t.sampling, make_env=t.make_env, world_model=t.sim_model)
    mask_all = ro.roles != Role.PAD
    world, act = ro.roles == Role.WORLD, ro.roles == Role.ACT
    assert world.any() and act.any()
    with torch.no_grad():
        by_sim = grpo.token_logprobs(t.sim_model, ro.ids, world, mask_all.long(), 1.0, 256)
        by_policy = grpo.token_logprobs(t.model, ro.ids, act | world, mask_all.long(), 1.0, 256)
    torch.testing.assert_close(by_sim[world], ro.logprobs[world], atol=1e-4, rtol=0)
    torch.testing.assert_close(by_policy[act], ro.logprobs[act], atol=1e-4, rtol=0)
    assert (by_policy[world] - ro.logprobs[world]).abs().max() > 1e-2     # not the policy's own

    # no loss on the simulator's tokens: advantages on WORLD tokens only give the policy no gradient at all
    adv = torch.where(world, 1.0, 0.0)
    t.model.zero_grad(set_to_none=True)
    train.policy_gradient(t.model, train.Batch(ro.ids, ro.roles, ro.logprobs, adv), t.train_roles, t.loss_cfg,
                          t.d, 8, 1.0, 256)
    assert all(p.grad is None or not p.grad.any() for p in t.model.parameters())


def test_the_default_simulator_is_the_policy_as_grpo_began(micro_path, tmp_path, scripted):
    t, _ = train.setup(config(micro_path, tmp_path / "run", env="sim", kl_coef=1e-4), None)
    start = state(t.model)
    for step in range(2):
        train.grpo_step(t, step, random.Random(step))
    assert t.sim_model is t.ref_model                   # one frozen copy serves both
    assert not changed(start, state(t.sim_model)) and changed(start, state(t.model))


@pytest.mark.parametrize("only", [Role.ACT, Role.WORLD])
def test_per_role_updates_change_only_the_model_of_the_role_with_a_signal(micro_path, tmp_path, scripted,
                                                                           monkeypatch, only):
    """Advantages on one role's tokens only: its model moves, the other stays bit for bit (AdamW sees a zero
    gradient), so no gradient crosses from one role's tokens into the other role's model."""
    real_adv = grpo.role_advantages

    def one_role(rewards, groups, roles, train_roles, scale_std, per_role):
        adv, flat = real_adv(rewards, groups, roles, train_roles, scale_std, per_role)
        return torch.where(roles == int(only), adv, torch.zeros_like(adv)), flat

    monkeypatch.setattr(train, "role_advantages", one_role)
    t, _ = train.setup(config(micro_path, tmp_path / "run", world_model="separate", steps=1), None)
    train.begin_grpo(t)
    actor0, world0 = state(t.model), state(t.world)
    assert not changed(actor0, world0)                  # both start from the same checkpoint
    record, ok = train.grpo_step(t, 0, random.Random(0))
    assert ok and record["world_tokens"] > 0
    moved, still = (t.model, t.world) if only == Role.ACT else (t.world, t.model)
    assert changed(actor0 if moved is t.model else world0, state(moved))
    assert not changed(world0 if still is t.world else actor0, state(still))
    assert record["world_grad_norm" if only == Role.ACT else "grad_norm"] == 0.0


def test_per_role_rollouts_record_each_token_under_the_model_that_wrote_it(micro_path, tmp_path, scripted):
    t, _ = train.setup(config(micro_path, tmp_path / "run", world_model="separate", steps=3), None)
    for step in range(2):
        train.grpo_step(t, step, random.Random(step))
    assert changed(state(t.model), state(t.world))      # trained apart, they now differ
    rec = train.grpo_step(t, 2, random.Random(2))[0]
    # each model's recomputed log-probs of its own tokens equal the sampling ones (before its update)
    assert rec["logp_mismatch"] < 1e-4 and rec["world_logp_mismatch"] < 1e-4, rec


def small_run(micro_path, out, steps):
    return ["--model", str(micro_path), "--out", str(out), "--sft-steps", "1", "--sft-batch", "4",
            "--steps", str(steps), "--tasks-per-step", "2", "--group-size", "4", "--max-new-tokens", "32",
            "--max-world-tokens", "10", "--max-turns", "3", "--lr", "5e-2", "--save-every", "1",
            "--world-model", "separate", "--no-require-update"]


def params_of(folder):
    from safetensors.torch import load_file
    return load_file(str(Path(folder) / "model.safetensors"))


def test_resume_of_a_per_role_run_equals_the_uninterrupted_run(micro_path, tmp_path, scripted):
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_train(small_run(micro_path, full, 3)).returncode == 0
    assert run_train(small_run(micro_path, part, 2)).returncode == 0
    res = run_train(["--resume", str(part), "--steps", "3"])
    assert res.returncode == 0, res.stderr
    a = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert any(r.get("world_grad_norm", 0) > 0 for r in a)            # the world model really trained
    for ra, rb in zip(a, b):
        for key in ("loss", "world_loss", "reward_mean", "world_tokens", "grad_norm", "world_grad_norm"):
            if key in ra:
                assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    last = "ckpt/step_000004"
    for sub in ("", "world_model"):
        pa, pb = params_of(full / last / sub), params_of(part / last / sub)
        for k in pa:
            torch.testing.assert_close(pa[k], pb[k], atol=1e-6, rtol=0)
    # the two models differ at the end: the world model is not a copy of the actor
    assert changed(params_of(full / last), params_of(full / last / "world_model"))


@pytest.mark.parametrize("flags, message", [
    (["--env", "sim", "--train-roles", "act,world"], "--env sim: the frozen simulator's WORLD tokens are never"),
    (["--sim-model", "x"], "--sim-model is the frozen simulator of --env sim"),
    (["--env", "sim", "--sim-model", "/no/such/folder"], "--sim-model /no/such/folder: no such file"),
    (["--world-model", "separate", "--env", "real"], "--world-model separate trains a second model"),
    (["--world-model", "separate", "--train-roles", "act"], "--world-model separate trains a second model"),
    (["--world-model", "twin"], "argument --world-model: invalid choice: 'twin'"),
    (["--env", "simulated"], "argument --env: invalid choice: 'simulated'"),
])
def test_bad_mode_flags_exit_2_with_one_line(micro_path, tmp_path, flags, message):
    res = run_train(["--model", str(micro_path), "--out", str(tmp_path / "r"), *flags])
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert not (tmp_path / "r").exists()


def test_a_simulator_with_another_vocabulary_is_refused(micro_path, tmp_path):
    res = run_train(["--model", str(micro_path), "--out", str(tmp_path / "r"), "--env", "sim", "--sim-model",
                     str(policy.ensure_tiny())])
    assert res.returncode == 2 and "another tokenizer than the policy" in res.stderr, res.stderr


@pytest.mark.parametrize("mode", ["sim", "separate"])
def test_both_modes_run_under_fsdp_with_two_processes(micro_path, tmp_path, mode):
    """torchrun, 2 ranks (gloo): scripted GRPO steps on sharded models; the simulator stays frozen, the
    separate world model trains, and the checkpoint holds each rank's optimizer state of both models."""
    out = tmp_path / "seen.json"
    torchrun(["tests/fsdp_modes_check.py", str(micro_path), mode, str(out)], timeout=300)   # run from the repo root
    seen = json.loads(out.read_text())
    assert all(n > 0 for n in seen["world_tokens"])
    assert seen["other_changed"] == (mode == "separate")
    ckpt = tmp_path / f"run-{mode}" / "ckpt" / "step_000002"
    has_world = [(ckpt / f"optim_world_rank{r}.pt").exists() for r in (0, 1)] + [(ckpt / "world_model").is_dir()]
    assert all(has_world) if mode == "separate" else not any(has_world)


def test_evaluate_finds_a_per_role_checkpoints_world_model(micro_path, tmp_path, scripted):
    """A --world-model separate checkpoint holds world_model/; evaluate.py uses it ('auto') or not ('shared')."""
    import evaluate
    assert run_train(small_run(micro_path, tmp_path / "run", 2)).returncode == 0
    ckpt = tmp_path / "run" / "ckpt" / "step_000003"
    for world, expect in (("auto", str(ckpt / "world_model")), ("shared", "shared")):
        out = tmp_path / f"eval-{world}"
        assert evaluate.main(["--model", str(ckpt), "--limit", "2", "--greedy", "--max-new-tokens", "8",
                              "--max-turns", "1", "--world-model", world, "--out", str(out)]) == 0
        assert json.loads((out / "summary.json").read_text())["world_model"] == expect


def test_test_time_rehearsals_and_probes_are_written_by_the_world_model(micro_path, tmp_path):
    import rehearse
    from tests.scripted import EchoEnv, tasks
    model, tok = policy.load_policy(str(micro_path))
    other, _ = policy.load_policy(str(other_weights(micro_path, tmp_path / "w")))
    twin, _ = policy.load_policy(str(micro_path))
    eng = rollout.Engine(model.eval(), tok)
    lookup = [call_text("lookup", '{"key": "'), 2, '"}}\n</tool_call>']
    cfg = rollout.SamplingConfig(greedy=True, max_new_tokens=32, max_world_tokens=12, max_turns=3)

    def probes(world_model):
        spec = rehearse.EpisodeSpec(tasks(1)[0], cfg, EchoEnv())
        ep = rehearse.act_many(eng, [spec], rehearse.RehearsalConfig(budget=1, fidelity=True),
                               steer=Script(tok, {0: [lookup, ["done"]], 1: [lookup]}), world_model=world_model)[0]
        return ep.fidelity, [r.get("predicted") for turn in ep.rehearsals for r in turn]

    own, by_twin, by_other = probes(None), probes(twin.eval()), probes(other.eval())
    assert own[0] and own == by_twin                  # the same weights in a lane of their own: same tokens
    assert by_other != own                            # another world model: other rehearsed responses

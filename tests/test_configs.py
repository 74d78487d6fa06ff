"""configs/*.toml: the presets a user copies. The default preset is the default run, each arm's preset is the arm
the experiments run, the paper's recipe says what the docs say; a bad preset is one line, exit 2."""
from pathlib import Path

import pytest

import train
from experiments import experiment
from tests.scripted import run_train

ROOT = Path(__file__).resolve().parent.parent


def config_of(*presets, **flags) -> train.TrainConfig:
    return train.TrainConfig(**{**train.load_config_files([str(ROOT / p) for p in presets]), **flags})


def test_the_default_preset_is_the_default_run():
    assert config_of("configs/default.toml").resolved() == train.TrainConfig().resolved()


@pytest.mark.parametrize("arm,flags", [
    ("envace", {"env": "rehearse", "train_roles": "act,world"}),
    ("frozen-sim", {"env": "sim", "train_roles": "act"}),
    ("per-role", {"env": "rehearse", "world_model": "separate", "train_roles": "act,world"}),
    ("real", {"env": "real", "train_roles": "act"}),
    ("act-only", {"env": "rehearse", "train_roles": "act"}),
])
def test_each_arm_preset_is_the_arm_and_the_experiment_runs_it(arm, flags):
    assert config_of(f"configs/arms/{arm}.toml").resolved() == train.TrainConfig(**flags).resolved()
    assert experiment.ARMS[arm].flags == ["--config", f"configs/arms/{arm}.toml"]
    assert experiment.arm_config(arm) == {k: v for k, v in config_of(f"configs/arms/{arm}.toml").__dict__.items()
                                          if k in experiment.arm_config(arm)}
    assert set(experiment.DEFAULT_ARMS) <= set(experiment.ARMS)


def test_presets_layer_and_a_flag_wins():
    c = config_of("configs/default.toml", "configs/arms/real.toml", lr=1e-4)
    assert (c.env, c.train_roles, c.lr, c.steps) == ("real", "act", 1e-4, 30)


def test_the_paper_recipe_preset():
    c = config_of("configs/qwen3-8b-tau2.toml", model="/ckpt/Qwen3-8B")
    assert (c.bench, c.tasks_per_step, c.group_size, c.lr, c.steps, c.reward, c.kl_coef) == \
        ("tau2", 16, 4, 1e-6, 200, "checklist", 1e-4)
    assert c.resolved().max_turns == 30 and c.resolved().max_total_len == 32768


@pytest.mark.parametrize("text,needle", [
    ("stepz = 3\n", "unknown key(s) stepz"),
    ("steps = 'many'\n", "steps = 'many' is not a int"),
    ("steps = [\n", "not valid TOML"),
])
def test_a_bad_preset_is_one_line_exit_2(tmp_path, text, needle):
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    res = run_train(["--config", str(bad), "--out", str(tmp_path / "run")])
    assert res.returncode == 2 and needle in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_missing_preset_and_a_preset_on_resume_are_refused(tmp_path):
    res = run_train(["--config", str(tmp_path / "none.toml")])
    assert res.returncode == 2 and "cannot read it" in res.stderr
    res = run_train(["--config", str(ROOT / "configs/default.toml"), "--resume", str(tmp_path)])
    assert res.returncode == 2 and "do not go together" in res.stderr


def test_none_is_the_one_unset_and_old_saved_configs_read_the_same():
    """Every field that is resolved at start defaults to None (no '', 'auto' or -1 sentinels); a config saved
    with the old sentinels resolves to the same run."""
    import dataclasses
    for f in dataclasses.fields(train.TrainConfig):
        assert f.default not in ("", "auto", -1), f.name
    old = {**dataclasses.asdict(train.TrainConfig()), "lr": -1, "sft_steps": -1, "reward": "auto",
           "train_roles": "auto", "activation_checkpointing": "auto", "split": "", "out": "", "task_opts": ""}
    assert train.TrainConfig(**train.legacy_unset_to_none(old)).resolved() == train.TrainConfig().resolved()

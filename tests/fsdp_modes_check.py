"""Run by tests/test_ablation_modes.py under `torchrun --nproc_per_node 2`: two scripted GRPO steps of the
frozen-simulator or per-role mode on FSDP-sharded models, then a checkpoint. Writes what it saw to argv[3]."""
import json
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpoint  # noqa: E402
import reward  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from bench import Score  # noqa: E402
from tests.scripted import Script, call_text  # noqa: E402

ACT_SCRIPT = [[call_text("get_balance", '{"account": "'), 2, '"}}\n</tool_call>'], ["done ", 2]]


def scripted_run(real_run):
    def run(self, tasks, group_size=1, cfg=None, *args, **kwargs):
        acts = {i: ACT_SCRIPT for i in range(len(tasks) * group_size)}
        return real_run(self, tasks, group_size, cfg, *args, steer=Script(self.tok, acts), **kwargs)
    return run


def parity_reward(bench, task, traj, defects, penalty, kind="success"):
    text = traj.final_answer + "".join(traj.observations)
    return Score(reward=float(len(text) % 2), components={"success": float(len(text) % 2)})


def full_state(model, d):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main(model_path, mode, out_path):
    rollout.Engine.run = scripted_run(rollout.Engine.run)
    reward.trajectory_reward = parity_reward
    flags = {"sim": dict(env="sim"), "separate": dict(world_model="separate")}[mode]
    cfg = train.TrainConfig(model=model_path, out=str(Path(out_path).parent / f"run-{mode}"), sft_steps=0, steps=2,
                            tasks_per_step=2, group_size=4, max_new_tokens=32, max_world_tokens=10, max_turns=3,
                            lr=5e-2, overwrite=True, **flags)
    t, _ = train.setup(cfg, None)
    train.begin_grpo(t)
    other = t.sim_model if mode == "sim" else t.world
    before = {k: v.clone() for k, v in full_state(other, t.d).items()}
    records = [train.grpo_step(t, step, random.Random(step))[0] for step in range(2)]
    after = full_state(other, t.d)
    checkpoint.save_checkpoint(t.run, 2, t.model, t.engine.tok, t.optimizer, t.cfg, t.d, {"phase": "grpo"},
                          world=t.world_parts())
    if t.d.main:
        json.dump({"world_tokens": [r["world_tokens"] for r in records],
                   "other_changed": any(not torch.equal(before[k], after[k]) for k in before),
                   "world_grad_norm": [r.get("world_grad_norm") for r in records]}, open(out_path, "w"))
    import torch.distributed as dist
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""Run by tests/test_train.py, under `torchrun --nproc_per_node 2` and as one plain process: the same fixed
batch, three GRPO updates, a greedy rollout, then one more update. Writes losses, parameters and tokens to argv[2]."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import distributed  # noqa: E402
import grpo  # noqa: E402
import policy  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from rollout import Role  # noqa: E402
from tests.scripted import tasks  # noqa: E402


def main(model_path, out_path):
    d = distributed.setup_dist()
    torch.manual_seed(0)
    model, tok = policy.load_policy(model_path)
    engine = rollout.Engine(model, tok)
    model = distributed.shard(model, d)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    B, T = 8, 40
    ids = torch.randint(3, 500, (B, T), generator=g)
    roles = torch.randint(1, 5, (B, T), generator=g)
    roles[:, :5] = Role.PROMPT
    roles[1, 30:] = Role.PAD
    batch = train.Batch(ids, roles, -torch.rand(B, T, generator=g), torch.randn(B, T, generator=g))
    mine = batch.rows(slice(d.rank, None, d.world_size))
    lcfg = grpo.LossConfig()
    losses = []
    for _ in range(3):
        st = train.policy_gradient(model, mine, [Role.ACT, Role.WORLD], lcfg, d, micro_batch=2, temperature=1.0,
                                   chunk_size=16)
        train.optimizer_step(model, opt, 1.0)
        losses.append(st["loss"])
    model.eval()
    with distributed.gathered_for_generation(model) if d.world_size > 1 else torch.no_grad():
        ro = engine.run(tasks(2)[d.rank::d.world_size] if d.world_size > 1 else tasks(2), 1,
                        rollout.SamplingConfig(greedy=True, max_new_tokens=12), responses="rehearse")
    # an update after a rollout, as every GRPO step does: the root must again keep its parameters after forward
    model.train()
    st = train.policy_gradient(model, mine, [Role.ACT, Role.WORLD], lcfg, d, micro_batch=2, temperature=1.0,
                               chunk_size=16)
    train.optimizer_step(model, opt, 1.0)
    losses.append(st["loss"])
    if d.world_size > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        sd = model.state_dict()
    gen = {tr.task_id: ro.ids[i, :int(ro.lengths[i])].tolist() for i, tr in enumerate(ro.trajectories)}
    if d.main:
        json.dump({"losses": losses, "params": {k: v.float().flatten()[:64].tolist() for k, v in sd.items()},
                   "param_sums": {k: float(v.double().sum()) for k, v in sd.items()}, "gen": gen},
                  open(out_path, "w"))
    if d.world_size > 1:
        import torch.distributed as dist
        gens = [None] * d.world_size
        dist.all_gather_object(gens, gen)
        if d.main:
            rec = json.load(open(out_path))
            rec["gen"] = {k: v for g_ in gens for k, v in g_.items()}
            json.dump(rec, open(out_path, "w"))
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

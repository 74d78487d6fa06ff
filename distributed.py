"""Processes and devices: one plain process, or FSDP2 under torchrun (NCCL on CUDA, gloo on CPU).

`Dist` says which process this is; `shard` wraps a model in FSDP2; `all_sum`/`gather_sums` add numbers over the
processes; `autocast` is the compute precision. With one process every function here is a no-op or a
pass-through, so the rest of the code has no special cases for it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@dataclass
class Dist:
    """This process's place in the run: its rank, the number of processes, and its device."""
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        """Rank 0: the process that writes files and logs."""
        return self.rank == 0


def setup_dist() -> Dist:
    """Join the torchrun process group (WORLD_SIZE > 1) and pick this rank's device; one plain process otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world_size == 1:
        return Dist(device=torch.device("cuda" if cuda else "cpu"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(rank=dist.get_rank(), world_size=world_size, device=torch.device(f"cuda:{local}" if cuda else "cpu"))


def shard(model, d: Dist):
    """FSDP2: each decoder layer, then the root; bf16 compute with fp32 reduction on GPU."""
    if d.world_size == 1:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard   # heavy (~0.5 s), only under torchrun
    mesh = init_device_mesh(d.device.type, (d.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if d.device.type == "cuda" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def enable_activation_checkpointing(model):
    """Recompute each decoder layer in backward (non-reentrant) instead of keeping its activations; active in
    train mode only."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


class gathered_for_generation:
    """Unshard every FSDP module once for a whole rollout (no per-token all-gathers; ranks may generate
    different numbers of tokens), then reshard. A no-op without FSDP."""

    def __init__(self, model):
        from torch.distributed.fsdp import FSDPModule   # heavy (~0.5 s), only under torchrun
        self.root = model
        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def __enter__(self):
        for m in self.modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()

    def __exit__(self, *exc):
        for m in self.modules:
            m.reshard()
            # back to fully_shard's defaults: the root keeps its parameters after forward (token_logprobs then
            # uses the unsharded LM-head weight; resharded, it would be a DTensor and the matmul fails)
            m.set_reshard_after_forward(m is not self.root, recurse=False)


def all_sum(values: list[float], d: Dist) -> list[float]:
    """The element-wise sum of `values` over all processes (float64, so counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    if d.world_size > 1:
        dist.all_reduce(t)
    return t.tolist()


def gather_sums(sums: dict[str, list[float]], d: Dist) -> dict[str, list[float]]:
    """Per-key lists of sums added over ranks (keys may differ between ranks)."""
    if d.world_size == 1:
        return sums
    parts = [None] * d.world_size
    dist.all_gather_object(parts, sums)
    out: dict[str, list[float]] = {}
    for part in parts:
        for key, vals in part.items():
            out[key] = [a + b for a, b in zip(out.get(key, [0.0] * len(vals)), vals)]
    return out


def autocast(d: Dist):
    """bf16 autocast on one GPU (FSDP's mixed-precision policy does it on many); full precision on CPU."""
    if d.device.type == "cuda" and d.world_size == 1:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)

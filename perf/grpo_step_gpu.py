"""One EnvACE GRPO step through train.py at the paper's settings, on a real-size Qwen3 architecture with random
weights (nothing is downloaded), for step time and tokens/s on a GPU (perf/speed_gpu.sh, GRPO=1).

    python -m perf.grpo_step_gpu --arch qwen3-4b --build runs/grpo_step_gpu/qwen3-4b     # write the model once
    torchrun --standalone --nproc_per_node 8 -m perf.grpo_step_gpu --model runs/grpo_step_gpu/qwen3-4b \
        -- --bench tau2 --task-opts domain=airline --tasks-per-step 16 --group-size 4

Random weights call no tool and solve nothing, so (as in the tests) each row's first turn is steered into a
call of the task's first tool, the world role then writes the response freely (max_world_tokens), and rewards
alternate 1, 0 so every group carries a gradient: the step costs what a real one does at the same lengths.
Everything after `--` goes to train.py (defaults: the paper's settings, --steps 1, --kl-coef 1e-4). Rank 0
prints the step's metrics (t_rollout, t_update, tokens/s) and the peak GPU memory, and writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

import policy
import reward
import rollout
import train
from perf.speed import Setup, build_arch_model
from perf.steering import alternating_rewards, first_call_script, placeholder_call

PAPER = ["--sft-steps", "0", "--steps", "1", "--group-size", "4", "--lr", "1e-6", "--clip-low", "0.2",
         "--clip-high", "0.2", "--dual-clip", "3", "--kl-coef", "1e-4", "--temperature", "1.0", "--save-every", "1000"]


def build(arch: str, folder: Path, vocab_size: int):
    """A random-weight Qwen3 of a real architecture with the tiny model's tokenizer and tool template."""
    tok = AutoTokenizer.from_pretrained(policy.ensure_tiny())
    model = build_arch_model(arch, tok, Setup(torch.device("cpu"), torch.bfloat16, "sdpa"), vocab_size=vocab_size)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    print(f"wrote {arch} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters) to {folder}")


def steered_step(model: str, train_args: list[str], out: Path) -> int:
    """One GRPO step of train.py on `model`, every row's first turn steered into a well-formed call (a random-weight
    model calls nothing by itself) and rewards alternating so no group is flat; writes OUT/grpo_step.json."""
    real_run = rollout.Engine.run

    def run(self, tasks, group_size=1, cfg=None, *args, **kwargs):
        name, arguments = placeholder_call(tasks[0])
        steer = first_call_script(self.tok, len(tasks) * group_size, name, arguments, free_tokens=4)
        return real_run(self, tasks, group_size, cfg, *args, steer=steer, **kwargs)
    rollout.Engine.run = run
    reward.trajectory_reward = alternating_rewards()
    code = train.main(["--model", model, "--out", str(out), "--overwrite", *PAPER, *train_args])
    if int(os.environ.get("RANK", "0")) == 0 and (out / "metrics.jsonl").exists():
        rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        keep = {k: rec.get(k) for k in ("rows", "act_tokens", "world_tokens", "trained_tokens", "t_rollout",
                                         "t_update", "t_step", "tokens_per_s", "loss", "grad_norm")}
        keep["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        keep["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
        keep["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        print(json.dumps(keep, indent=1))
        (out / "grpo_step.json").write_text(json.dumps({"train_args": train_args, **keep}, indent=1) + "\n")
    return code


def main(argv=None) -> int:
    """--build FOLDER writes the random-weight model; --model FOLDER runs one steered train.py step on it, with
    the arguments after `--`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m perf.grpo_step_gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3-4b", help="a perf/speed.py architecture")
    ap.add_argument("--vocab", type=int, default=151936, help="embedding rows (Qwen3's 151936)")
    ap.add_argument("--build", default="", metavar="FOLDER", help="only write the random-weight model here")
    ap.add_argument("--model", default="", metavar="FOLDER", help="the folder --build wrote")
    ap.add_argument("--out", default="runs/grpo_step_gpu/run")
    args = ap.parse_args(argv)
    if args.build:
        build(args.arch, Path(args.build), args.vocab)
        return 0
    if not args.model:
        ap.error("pass --build FOLDER first, then --model FOLDER")
    return steered_step(args.model, rest, Path(args.out))


if __name__ == "__main__":
    sys.exit(main())

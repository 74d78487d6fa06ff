"""What running a GRPO group's shared prompt once saves in the policy update (grpo.token_logprobs, share_prefix).

    python -m perf.shared_prompt --model PATH                # a BFCL-sized group: 500-token prompt, G=4 x 60
    python -m perf.shared_prompt --prompt 200 --suffix 40    # the embedded tiny model, another shape

Times forward + backward of the masked log-probs over G rows that share a prompt, with the prompt run once
(its KV cache repeated for the rows' suffixes) and with every row run whole, in one process, alternating,
and prints the ratio and the largest log-prob difference. Measure with one job per core (OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import grpo
import policy
from roles import Role


def group(prompt: int, suffix: int, G: int, vocab: int, seed: int = 0):
    """ids, loss mask and attention mask [G, prompt + suffix] of G rows sharing a prompt (suffixes trained)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (G, prompt + suffix), generator=g)
    ids[:, :prompt] = ids[0, :prompt]
    roles = torch.full(ids.shape, int(Role.ACT))
    roles[:, :prompt] = Role.PROMPT
    return ids, grpo.role_mask(roles, [Role.ACT]), torch.ones_like(ids)


def timed(model, ids, mask, attn, share: bool) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    logp = grpo.token_logprobs(model, ids, mask, attn, share_prefix=share)
    logp.sum().backward()
    return time.perf_counter() - t0, logp.detach()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="a model path (HF folder or GGUF); default the embedded tiny")
    p.add_argument("--prompt", type=int, default=500, help="shared prompt tokens")
    p.add_argument("--suffix", type=int, default=60, help="tokens each row adds after the prompt")
    p.add_argument("--group", type=int, default=4, help="rows per group (G)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the measurement here (JSON)")
    args = p.parse_args(argv)
    model, _ = policy.load_policy(args.model)
    model.train()
    ids, mask, attn = group(args.prompt, args.suffix, args.group, model.config.vocab_size)
    times = {True: [], False: []}
    diff = 0.0
    for _ in range(args.repeats):
        for share in (True, False):
            sec, logp = timed(model, ids, mask, attn, share)
            times[share].append(sec)
            if share:
                shared = logp
            else:
                diff = max(diff, float((shared - logp).abs().max()))
    best = {k: min(v) for k, v in times.items()}
    record = {"model": args.model if args.model == "tiny" else "given", "prompt": args.prompt,
              "suffix": args.suffix, "group": args.group, "threads": torch.get_num_threads(),
              "machine": platform.machine(), "seconds_whole_rows": best[False], "seconds_shared_prompt": best[True],
              "speedup": best[False] / best[True], "max_logp_diff": diff}
    print(f"G={args.group} rows of {args.prompt} shared + {args.suffix} own tokens, forward+backward, "
          f"best of {args.repeats}: whole rows {best[False]:.2f} s, shared prompt {best[True]:.2f} s, "
          f"x{record['speedup']:.2f}; largest log-prob difference {diff:.1e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

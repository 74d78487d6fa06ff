#!/usr/bin/env bash
# perf/speed.py on one GPU: bf16, a real-size Qwen3 architecture with random weights (vocab 151936, the tiny
# tokenizer drives it: nothing is downloaded), SDPA and, if flash-attn is installed, flash_attention_2.
# Sized for a few minutes on one H200-class GPU (80+ GiB). Prints the tables (tokens/s, peak
# torch.cuda.max_memory_allocated) and writes runs/speed/speed_gpu.json.
#
#   bash perf/speed_gpu.sh                      # qwen3-1.7b
#   ARCH=qwen3-4b bash perf/speed_gpu.sh        # or qwen3-0.6b
#   QUICK=1 bash perf/speed_gpu.sh              # about a minute: 1 and 4 turns, one log-prob cell
#   COMPILE=0 bash perf/speed_gpu.sh            # without the compiled-decode variant (see below)
#
# Every rollout cell also runs the engine with its decode forwards through
# torch.compile(mode="reduce-overhead") (CUDA graphs; speed.py --compile, speed.DecodeCompiled): same ids
# checked, tokens/s, its speedup over the eager engine, its decode step against the weight-streaming bound.
# COMPILE=<mode> picks another torch.compile mode. Two warm-up runs per workload pay the compiling; CUDA graphs
# of shapes first seen in a cell are recorded (and timed) there.
#   PYTHON=/path/to/python bash perf/speed_gpu.sh
#   GRPO=1 ARCH=qwen3-4b bash perf/speed_gpu.sh  # then one EnvACE GRPO step through train.py on tau2 airline
#                                                 # (perf/grpo_step_gpu.py; NPROC=8 for FSDP over 8 GPUs)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
ARCH=${ARCH:-qwen3-1.7b}
OUT=${OUT:-runs/speed/speed_gpu.json}
export PYTHONUNBUFFERED=1
"$PYTHON" - <<'PY'
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device: run perf/speed.py (CPU) instead"
print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
try:
    import flash_attn
    print(f"flash-attn {flash_attn.__version__}: SDPA and flash_attention_2 will both run")
except ImportError:
    print("flash-attn not installed: SDPA only (pip install flash-attn to compare)")
PY
extra=()
if [ -n "${QUICK:-}" ]; then extra+=(--quick); fi
COMPILE=${COMPILE:-reduce-overhead}
if [ "$COMPILE" != "0" ]; then extra+=(--compile "$COMPILE"); fi
"$PYTHON" -m perf.speed --gpu --arch "$ARCH" --out "$OUT" "${extra[@]}" "$@"
if [ -n "${GRPO:-}" ]; then
  # one GRPO step at the paper's settings on tau2 airline: 16 tasks x G=4 (TASKS, GROUP to change), bf16 autocast
  MODEL_DIR=${MODEL_DIR:-runs/grpo_step_gpu/$ARCH}
  [ -f "$MODEL_DIR/config.json" ] || "$PYTHON" -m perf.grpo_step_gpu --arch "$ARCH" --build "$MODEL_DIR"
  "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-1}" -m perf.grpo_step_gpu \
    --model "$MODEL_DIR" --out "runs/grpo_step_gpu/run-$ARCH" -- --bench tau2 --task-opts domain=airline \
    --tasks-per-step "${TASKS:-16}" --group-size "${GROUP:-4}" --micro-batch "${MICRO:-4}"
fi

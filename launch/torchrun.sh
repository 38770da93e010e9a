#!/usr/bin/env bash
# Multi-node bigtrain with torchrun and c10d rendezvous. Run the same command on every node.
#
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node01:29400 launch/torchrun.sh configs/tiny.yaml parallel.backend=fsdp
#
# Variables (defaults): NNODES (1), NPROC_PER_NODE (GPUs on this node, else 1), RDZV_ENDPOINT
# (localhost:29400; host:port of any one node, reachable by all), RDZV_ID (bigtrain), MAX_RESTARTS
# (0; torchrun restarts every worker when one dies, and bigtrain resumes from its last checkpoint).
# Exits with the code of the worker that failed first (README, Exit codes), where torchrun says 1.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" || $# -eq 0 ]]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
# torchrun itself (torch.distributed.run), but a failed worker's exit code is passed through and
# torchrun's traceback left out: torchrun exits 1 whatever the worker's code, which hides
# bigtrain's codes 2-8 (a bad config, an abort, a preemption to requeue, ...). A worker killed by
# a signal exits 128 + its number, as in a shell.
torchrun_passing_codes='
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

MEANING = {2: "bad config or input", 3: "gave up after anomalies", 4: "preempted", 5: "a hang",
           6: "repeated faults on one host", 7: "ranks ended with different weights",
           8: "out of memory"}
try:
    main(sys.argv[1:])
except ChildFailedError as e:
    rank, failure = e.get_first_failure()
    if failure.exitcode < 0:
        code, what = 128 - failure.exitcode, f"killed by {failure.signal_name()}"
    else:
        code = failure.exitcode
        what = f"exit code {code}" + (f": {MEANING[code]}, its message above" if code in MEANING else "")
    print(f"launch/torchrun.sh: rank {rank} failed first ({what}); README (Exit codes) and "
          "events.jsonl in the run directory say more", file=sys.stderr)
    sys.exit(code)
'
exec "${PYTHON:-python}" -c "$torchrun_passing_codes" \
  --nnodes "${NNODES:-1}" \
  --nproc-per-node "${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}" \
  --rdzv-backend c10d \
  --rdzv-endpoint "${RDZV_ENDPOINT:-localhost:29400}" \
  --rdzv-id "${RDZV_ID:-bigtrain}" \
  --max-restarts "${MAX_RESTARTS:-0}" \
  -m bigtrain train "$@"

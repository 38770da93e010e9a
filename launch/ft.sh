#!/usr/bin/env bash
# Fault-tolerant replica groups on one node: a torchft lighthouse and G groups, each its own
# torchrun with restarts, so that one group's failure restarts that group alone while the others
# keep training (docs/fault-tolerance.md).
#
#   bash launch/ft.sh --groups 3 --nproc-per-group 1 configs/tiny.yaml parallel.backend=fsdp
#
# Options: --groups G (replica groups, >= 2), --nproc-per-group R (ranks per group: FSDP2/HSDP/tp
# inside), --max-restarts N (per group; 3), --port P (the lighthouse's; 0: any free one).
# The run directory is train.out_dir when given on this command line, else runs/ft-<config>
# (a train.out_dir in the YAML is not used: an FT job's directory is kept apart).
# Exits 0 when every group finished with the same weights (the groups compare them at the end;
# REPLICAS_DIFFER in the run directory names the groups that differed); otherwise 1 and the
# groups that failed. Logs of the lighthouse and of each group go to FT_LOG_DIR (default: a new
# directory under /tmp).
set -uo pipefail
usage="usage: bash launch/ft.sh --groups G [--nproc-per-group R] [--max-restarts N] [--port P]"
usage+=" CONFIG [KEY=VALUE ...]"
# A bad option ends the script here, before a lighthouse or a group starts: one line, exit 2.
fail() { echo "launch/ft.sh: $*" >&2; exit 2; }
needs_value() { [[ $# -ge 2 ]] || fail "$1 needs a value ($usage)"; }
# integer OPTION VALUE MIN MAX EXPECTED: VALUE is a whole number in MIN..MAX.
integer() {
  [[ "$2" =~ ^[0-9]{1,9}$ ]] && (( 10#$2 >= $3 && 10#$2 <= $4 )) \
    || fail "$1 got '$2', expected $5"
}
groups="" nproc=1 restarts=3 port=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --groups) needs_value "$@"; groups=$2; shift 2 ;;
    --nproc-per-group) needs_value "$@"; nproc=$2; shift 2 ;;
    --max-restarts) needs_value "$@"; restarts=$2; shift 2 ;;
    --port) needs_value "$@"; port=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) fail "unknown option '$1' ($usage)" ;;
    *) break ;;
  esac
done
if [[ -z "$groups" || $# -eq 0 ]]; then
  echo "$usage" >&2
  exit 2
fi
integer --groups "$groups" 2 999999999 \
  "a number of replica groups >= 2 (one group needs no lighthouse: use torchrun)"
integer --nproc-per-group "$nproc" 1 999999999 "a number of ranks per group >= 1"
integer --max-restarts "$restarts" 0 999999999 "a number of restarts per group >= 0"
integer --port "$port" 0 65535 "a TCP port 0..65535 (0: any free one)"
groups=$((10#$groups)) nproc=$((10#$nproc)) restarts=$((10#$restarts)) port=$((10#$port))
python=${PYTHON:-python}
logs=${FT_LOG_DIR:-$(mktemp -d /tmp/bigtrain-ft.XXXXXX)}
mkdir -p "$logs"
args=("$@" "fault_tolerance.groups=$groups")
# An FT job's directory holds every group's logs and events: unless train.out_dir is given here,
# it is runs/ft-<config>, apart from the plain runs of the same config (a plain run's checkpoint
# would otherwise be resumed, with another global batch).
given=$(printf '%s\n' "$@" | grep -c '^train\.out_dir=')
if [[ "$given" -eq 0 ]]; then
  config=$(basename "$1")
  [[ "$config" == *.yaml || "$config" == *.yml ]] && name=${config%.*} || name=run
  args=("$@" "train.out_dir=runs/ft-$name" "fault_tolerance.groups=$groups")
fi

# The lighthouse reads its settings (min_groups, heartbeat and join timeouts) from the config.
"$python" -m bigtrain lighthouse "${args[@]}" --port "$port" >"$logs/lighthouse.log" 2>&1 &
lighthouse=$!
trap 'kill "$lighthouse" 2>/dev/null' EXIT
for _ in $(seq 300); do
  address=$(grep -o '^lighthouse http[^ ]*' "$logs/lighthouse.log" | head -1 | cut -d' ' -f2)
  [[ -n "$address" ]] && break
  if ! kill -0 "$lighthouse" 2>/dev/null; then
    wait "$lighthouse"
    # exit 2: the config is wrong, and the log's one line names the key
    [[ $? -eq 2 ]] || echo "launch/ft.sh: the lighthouse did not start:" >&2
    cat "$logs/lighthouse.log" >&2
    exit 2
  fi
  sleep 0.1
done
if [[ -z "$address" ]]; then
  echo "launch/ft.sh: the lighthouse printed no address in 30 s ($logs/lighthouse.log)" >&2
  exit 2
fi
out=$(printf '%s\n' "${args[@]}" | grep '^train\.out_dir=' | tail -n 1 | cut -d= -f2-)
echo "launch/ft.sh: lighthouse $address, $groups groups x $nproc ranks, run directory $out," \
  "launcher logs in $logs" >&2

pids=()
# Stopped (Ctrl-C, SIGTERM, a scheduler): each torchrun stops its workers, then the lighthouse.
stop() {
  if [[ ${#pids[@]} -gt 0 ]]; then
    kill -TERM "${pids[@]}" 2>/dev/null
    wait "${pids[@]}" 2>/dev/null
  fi
  exit "$1"
}
trap 'stop 130' INT
trap 'stop 143' TERM
for ((g = 0; g < groups; g++)); do
  BIGTRAIN_FT_GROUP=$g TORCHFT_LIGHTHOUSE=$address \
    torchrun --standalone --nproc-per-node "$nproc" --max-restarts "$restarts" \
    -m bigtrain train "${args[@]}" >"$logs/group$g.log" 2>&1 &
  pids+=($!)
done
failed=()
for ((g = 0; g < groups; g++)); do
  if ! wait "${pids[$g]}"; then
    failed+=("$g")
  fi
done
if [[ -n "$out" && -f "$out/REPLICAS_DIFFER" ]]; then
  echo "launch/ft.sh: the groups ended with different weights: $(cat "$out/REPLICAS_DIFFER")" >&2
fi
if [[ ${#failed[@]} -gt 0 ]]; then
  for g in "${failed[@]}"; do
    echo "launch/ft.sh: group $g failed; the end of $logs/group$g.log:" >&2
    tail -n 20 "$logs/group$g.log" >&2
  done
  exit 1
fi
echo "launch/ft.sh: all $groups groups finished" >&2

#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for tests and for trying slurm/train.sbatch.
#
#   launch/local-slurm.sh up      # install (Debian packages) if needed, configure, start
#   launch/local-slurm.sh down    # stop the daemons started by `up`
#   export SLURM_CONF=${BIGTRAIN_SLURM_DIR:-/tmp/bigtrain-slurm}/slurm.conf   # for sbatch & co
#
# Variables: BIGTRAIN_SLURM_DIR (state, logs, pids; default /tmp/bigtrain-slurm),
# BIGTRAIN_SLURM_INSTALL=0 to never run apt-get. Needs root (munge and slurmd run as root here).
set -euo pipefail

DIR=${BIGTRAIN_SLURM_DIR:-/tmp/bigtrain-slurm}
CMD=${1:-}

if [[ "$CMD" == "-h" || "$CMD" == "--help" || -z "$CMD" ]]; then
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi

stop() {
    for name in slurmd slurmctld munged; do
        if [[ -f "$DIR/$name.pid" ]]; then
            kill "$(cat "$DIR/$name.pid")" 2>/dev/null || true
            rm -f "$DIR/$name.pid"
        fi
    done
}

if [[ "$CMD" == "down" ]]; then
    stop
    exit 0
fi
[[ "$CMD" == "up" ]] || { echo "usage: $0 up|down" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    if [[ "${BIGTRAIN_SLURM_INSTALL:-1}" == "0" ]]; then
        echo "local-slurm: slurmctld/munged not installed and BIGTRAIN_SLURM_INSTALL=0" >&2
        exit 3
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
fi

stop
mkdir -p "$DIR"/{state,spool,log}
host=$(hostname)
getent hosts "$host" >/dev/null || { echo "local-slurm: hostname '$host' does not resolve" >&2; exit 3; }
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc would report OMP_NUM_THREADS
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))

cat > "$DIR/slurm.conf" <<CONF
ClusterName=bigtrain-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
ReturnToService=2
MinJobAge=300
KillWait=10
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF

# munge: key 0400 owned by munge, runtime dir owned by munge, daemon as user munge.
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
[[ -s /etc/munge/munge.key ]] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 0400 /etc/munge/munge.key
su -s /bin/sh munge -c "munged -F" >"$DIR/log/munged.out" 2>&1 &
echo $! > "$DIR/munged.pid"
for _ in $(seq 50); do [[ -S /run/munge/munge.socket.2 ]] && break; sleep 0.1; done

export SLURM_CONF="$DIR/slurm.conf"
slurmctld -D -f "$SLURM_CONF" >"$DIR/log/slurmctld.out" 2>&1 &
echo $! > "$DIR/slurmctld.pid"
slurmd -D -f "$SLURM_CONF" >"$DIR/log/slurmd.out" 2>&1 &
echo $! > "$DIR/slurmd.pid"
for _ in $(seq 100); do
    if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
        echo "local-slurm: up ($host, $cpus CPUs); export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.1
done
echo "local-slurm: the node did not come up; logs in $DIR/log" >&2
exit 1

#!/usr/bin/env bash
# A real one-node SLURM on localhost, for the `slurm` test tier and for trying the sbatch templates
# and `python -m grpo.launch` on one machine:
#
#   slurm/dev-cluster.sh install   # apt-get the Debian packages (slurmctld slurmd slurm-client munge)
#   slurm/dev-cluster.sh up        # start munged, slurmctld and slurmd; wait until the node is idle
#   export SLURM_CONF=/tmp/grpo-slurm/slurm.conf    # (`up` prints this line) then sbatch, srun...
#   slurm/dev-cluster.sh down      # stop the daemons this script started
#
# Runs as root, without systemd or cgroups (proctrack/linuxproc, task/none). Everything it writes
# (slurm.conf, state, spool, logs, pids) lives in $GRPO_SLURM_DIR (default /tmp/grpo-slurm). There is
# no slurmdbd, so `sacct` is off and submitit reports job states as UNKNOWN; results still come back.
# One partition, `debug`, holds the node with all its CPUs (`nproc`) and memory.
set -euo pipefail

DIR=${GRPO_SLURM_DIR:-/tmp/grpo-slurm}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)

install() {
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
}

write_conf() {
    mkdir -p "$DIR"/{state,spool,log}
    local cpus mem
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))  # MB, leave 20% to the OS
    cat > "$CONF" <<EOF
ClusterName=grpo-dev
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again after cred_expire seconds (default 120); short, for tests
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobRequeue=1
ReturnToService=2
MpiDefault=none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SchedulerParameters=nohold_on_prolog_fail
# fast turnaround for tests: short waits between SIGTERM and SIGKILL, and before a requeued job runs again
KillWait=10
MinJobAge=300
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
}

running() {  # pid file $1 names a live process
    [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

up() {
    for bin in munged slurmctld slurmd sbatch; do
        command -v "$bin" >/dev/null || { echo "error: $bin not found; run: $0 install" >&2; exit 1; }
    done
    write_conf
    export SLURM_CONF=$CONF
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    if ! running /run/munge/munged.pid; then
        [[ -f /etc/munge/munge.key ]] || { mungekey --create && chown munge:munge /etc/munge/munge.key; }
        runuser -u munge -- munged
    fi
    running "$DIR/slurmctld.pid" || slurmctld -i   # -i: ignore (and drop) state from an earlier run
    running "$DIR/slurmd.pid" || slurmd
    for _ in $(seq 60); do
        state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null || true)
        if [[ $state == idle* || $state == mixed* || $state == allocated* ]]; then
            echo "SLURM is up: node $HOST ($(nproc) CPUs), partition debug."
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        [[ $state == down* || $state == drain* ]] && scontrol update nodename="$HOST" state=resume 2>/dev/null || true
        sleep 1
    done
    echo "error: the node did not become idle in 60 s (state: ${state:-none}); see $DIR/log/" >&2
    exit 1
}

down() {
    export SLURM_CONF=$CONF
    for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid"; do
        if running "$pidfile"; then
            pid=$(cat "$pidfile")
            kill "$pid"
            for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        fi
    done
    # munged may serve other SLURM users on this machine; stop it only if we started it alone
    if running /run/munge/munged.pid && [[ ${GRPO_SLURM_STOP_MUNGE:-1} == 1 ]]; then
        kill "$(cat /run/munge/munged.pid)"
    fi
    echo "SLURM is down."
}

case ${1:-} in
    install) install ;;
    up) up ;;
    down) down ;;
    *) echo "usage: $0 install|up|down" >&2; exit 2 ;;
esac

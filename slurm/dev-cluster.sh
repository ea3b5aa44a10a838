#!/usr/bin/env bash
# A real one-node SLURM on localhost, with accounting, CPU binding and preemption, for the `slurm`
# test tier and for trying the sbatch templates and `python -m grpo.launch` on one machine:
#
#   slurm/dev-cluster.sh install   # apt-get the Debian packages (slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
#   slurm/dev-cluster.sh up        # start MariaDB, slurmdbd, munged, slurmctld and slurmd; wait until the node is idle
#   export SLURM_CONF=/tmp/grpo-slurm/slurm.conf    # (`up` prints this line) then sbatch, srun, sacct...
#   slurm/dev-cluster.sh down      # stop the daemons this script started
#
# Each command is idempotent: `up` on a running cluster starts nothing twice, `down` on a stopped
# one does nothing. Runs as root, without systemd. Everything it writes (slurm.conf, slurmdbd.conf,
# the MariaDB data folder, state, spool, logs, pids) lives in $GRPO_SLURM_DIR (default /tmp/grpo-slurm).
#
# What it sets up, as a production cluster has it:
#   - Accounting: a private MariaDB (socket and 127.0.0.1:$GRPO_SLURM_DB_PORT, data in $DIR/db)
#     holds slurm_acct_db; slurmdbd writes to it, so `sacct` answers and submitit tracks job states.
#     The cluster, an account `grpo` and user root are added with sacctmgr. If MariaDB or slurmdbd
#     cannot start, one line says so and the cluster runs without accounting (sacct off).
#   - CPU binding: TaskPlugin=task/affinity pins each task to the CPUs it was given (--cpus-per-task).
#     No cgroups (proctrack/linuxproc): a job's processes are found through /proc, its memory is
#     not limited.
#   - Preemption: partition `debug` (default, PriorityTier=1) and `urgent` (PriorityTier=2) share
#     the node; a job in `urgent` preempts `debug` jobs (PreemptType=preempt/partition_prio,
#     PreemptMode=REQUEUE): SLURM requeues them and sends SIGTERM; they have KillWait (30 s) to checkpoint.
set -euo pipefail

DIR=${GRPO_SLURM_DIR:-/tmp/grpo-slurm}
CONF=$DIR/slurm.conf
DBD_CONF=$DIR/slurmdbd.conf
DB_DIR=$DIR/db      # owned by the mysql user: data/, socket, pid and log
DB_SOCK=$DB_DIR/mariadb.sock
DB_PORT=${GRPO_SLURM_DB_PORT:-3307}
CLUSTER=grpo-dev
HOST=$(hostname -s)

install() {
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge slurmdbd mariadb-server
}

running() {  # pid file $1 names a live process
    [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

# ---- accounting: MariaDB, then slurmdbd ----

db() {  # run SQL through the private server's socket as its root (unix_socket authentication)
    mariadb --no-defaults --socket="$DB_SOCK" -u root "$@"
}

start_mariadb() {
    mkdir -p "$DB_DIR"
    chown mysql:mysql "$DB_DIR"
    if [[ ! -d $DB_DIR/data/mysql ]]; then
        mariadb-install-db --no-defaults --user=mysql --datadir="$DB_DIR/data" --auth-root-authentication-method=socket \
            > "$DB_DIR/install.log" 2>&1 || return 1
    fi
    if ! running "$DB_DIR/mariadb.pid"; then
        setsid runuser -u mysql -- mariadbd --no-defaults --datadir="$DB_DIR/data" --socket="$DB_SOCK" \
            --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$DB_DIR/mariadb.pid" \
            --log-error="$DB_DIR/mariadb.log" --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 < /dev/null > /dev/null 2>&1 &
    fi
    for _ in $(seq 60); do
        db -e "SELECT 1" > /dev/null 2>&1 && return 0
        sleep 0.5
    done
    return 1
}

write_dbd_conf() {
    [[ -f $DIR/db.pass ]] || (umask 077; head -c 24 /dev/urandom | base64 | tr -d '/+=' > "$DIR/db.pass")
    local pass
    pass=$(cat "$DIR/db.pass")
    db <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pass';
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
    (umask 077; cat > "$DBD_CONF" <<EOF
# slurmdbd reads this file only when it is private (mode 600): it holds the database password.
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
AuthType=auth/munge
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$pass
StorageLoc=slurm_acct_db
EOF
    )
    chmod 600 "$DBD_CONF"
}

start_slurmdbd() {
    running "$DIR/slurmdbd.pid" || SLURM_CONF=$CONF slurmdbd || return 1  # reads slurmdbd.conf beside slurm.conf
    for _ in $(seq 60); do
        sacctmgr -n show cluster > /dev/null 2>&1 && return 0
        sleep 0.5
    done
    return 1
}

register() {  # cluster, account and user in the accounting database (sacctmgr -i: no prompt)
    [[ -n $(sacctmgr -n -P show cluster "$CLUSTER" format=cluster) ]] || sacctmgr -i add cluster "$CLUSTER" > /dev/null
    [[ -n $(sacctmgr -n -P show account grpo format=account) ]] || sacctmgr -i add account grpo cluster="$CLUSTER" \
        description="grpo dev" organization=grpo > /dev/null
    [[ -n $(sacctmgr -n -P show assoc user=root account=grpo format=user) ]] || sacctmgr -i add user root account=grpo \
        cluster="$CLUSTER" > /dev/null
    return 0
}

# ---- slurm.conf ----

write_conf() {  # $1: the AccountingStorageType line
    local cpus mem
    cpus=$(nproc)
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))  # MB, leave 20% to the OS
    cat > "$CONF" <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again after cred_expire seconds (default 120); short, for tests
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
# each task is pinned to the CPUs it was given (no cgroups: see the top of dev-cluster.sh)
TaskPlugin=task/affinity
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
$1
JobAcctGatherType=jobacct_gather/linux
SchedulerParameters=nohold_on_prolog_fail
# a job in a higher PriorityTier partition preempts lower ones: requeued at once, its processes get
# SIGTERM and KillWait to checkpoint. No GraceTime: with one, SLURM requeues only when it ends, and
# a job whose batch script exits earlier on the SIGTERM is recorded as FAILED and not requeued.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# fast turnaround for tests: 30 s between SIGTERM and SIGKILL (SLURM's default), short job records
KillWait=30
MinJobAge=300
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes=$HOST MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
}

up() {
    for bin in munged slurmctld slurmd sbatch; do
        command -v "$bin" >/dev/null || { echo "error: $bin not found; run: $0 install" >&2; exit 1; }
    done
    mkdir -p "$DIR"/{state,spool,log}
    export SLURM_CONF=$CONF
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    if ! running /run/munge/munged.pid; then
        [[ -f /etc/munge/munge.key ]] || { mungekey --create && chown munge:munge /etc/munge/munge.key; }
        runuser -u munge -- munged
    fi

    local accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost"
    write_conf "$accounting"  # slurmdbd and sacctmgr read ClusterName and AuthType from it
    if ! command -v mariadbd >/dev/null || ! command -v slurmdbd >/dev/null; then
        echo "note: accounting is off (sacct does not answer): mariadb-server or slurmdbd is not installed; run: $0 install"
        accounting="AccountingStorageType=accounting_storage/none"
    elif ! start_mariadb; then
        echo "note: accounting is off (sacct does not answer): MariaDB did not start; see $DB_DIR/mariadb.log"
        accounting="AccountingStorageType=accounting_storage/none"
    elif ! { write_dbd_conf && start_slurmdbd && register; }; then
        echo "note: accounting is off (sacct does not answer): slurmdbd did not start; see $DIR/log/slurmdbd.log"
        accounting="AccountingStorageType=accounting_storage/none"
    fi
    write_conf "$accounting"

    running "$DIR/slurmctld.pid" || slurmctld -i   # -i: ignore (and drop) state from an earlier run
    running "$DIR/slurmd.pid" || slurmd
    for _ in $(seq 60); do
        state=$(sinfo -h -n "$HOST" -p debug -o %T 2>/dev/null || true)
        if [[ $state == idle* || $state == mixed* || $state == allocated* ]]; then
            echo "SLURM is up: node $HOST ($(nproc) CPUs), partitions debug (default) and urgent (preempts debug)," \
                 "$([[ $accounting == *slurmdbd* ]] && echo "accounting in slurmdbd" || echo "no accounting")."
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        [[ $state == down* || $state == drain* ]] && scontrol update nodename="$HOST" state=resume 2>/dev/null || true
        sleep 1
    done
    echo "error: the node did not become idle in 60 s (state: ${state:-none}); see $DIR/log/" >&2
    exit 1
}

stop_pid() {  # stop the process in pid file $1, waiting up to 10 s
    if running "$1"; then
        local pid
        pid=$(cat "$1")
        kill "$pid"
        for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    fi
}

down() {
    export SLURM_CONF=$CONF
    for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/slurmdbd.pid" "$DB_DIR/mariadb.pid"; do
        stop_pid "$pidfile"
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

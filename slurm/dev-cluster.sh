#!/usr/bin/env bash
# A real one-node SLURM on localhost, with accounting, CPU binding and preemption, for the `slurm`
# test tier and for trying the sbatch templates and `python -m grpo.launch` on one machine:
#
#   slurm/dev-cluster.sh install   # apt-get the Debian packages (slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
#   slurm/dev-cluster.sh up        # start MariaDB, slurmdbd, munged, slurmctld and slurmd; wait until the node is idle
#   slurm/dev-cluster.sh up --nodes 2   # two compute nodes on this machine (see "Several nodes" below)
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
#
# Several nodes (`up --nodes N`, N >= 2): N compute nodes grpo-n1..grpo-nN, each its own host as SLURM
# sees it: its own slurmd (`slurmd -N grpo-nI`), address 127.0.0.(I+1) and port 6830+I (slurmdbd holds 6819), its names in
# /etc/hosts (so MASTER_ADDR=grpo-n1 resolves; the lines are marked and `down` removes them), its
# share of this machine's CPUs (slurmd and every task it starts pinned to them by `taskset`, which
# the tasks inherit: TaskPlugin=task/none). Each node offers at least 2 task slots
# (SlurmdParameters=config_overrides), so a 2-task node fits on a 2-core machine, its tasks then
# sharing its one core. Every address is in 127.0.0.0/8. `up` with another N restarts slurmctld and
# the slurmds on the new layout.
set -euo pipefail

DIR=${GRPO_SLURM_DIR:-/tmp/grpo-slurm}
CONF=$DIR/slurm.conf
DBD_CONF=$DIR/slurmdbd.conf
DB_DIR=$DIR/db      # owned by the mysql user: data/, socket, pid and log
DB_SOCK=$DB_DIR/mariadb.sock
DB_PORT=${GRPO_SLURM_DB_PORT:-3307}
CLUSTER=grpo-dev
HOST=$(hostname -s)
HOSTS_MARK="# grpo dev-cluster"
NODES=1  # `up --nodes N`

node_names() {  # the compute nodes' names, one per line
    if (( NODES == 1 )); then echo "$HOST"; else seq -f "grpo-n%g" 1 "$NODES"; fi
}

node_cpus() {  # $1: node index from 1: this node's CPUs as a taskset list (its share of this machine's)
    local all per first
    mapfile -t all < <(taskset -pc $$ | sed 's/.*: //' | tr ',' '\n' | while IFS=- read -r a b; do seq "$a" "${b:-$a}"; done)
    per=$(( ${#all[@]} / NODES )); (( per >= 1 )) || per=1
    first=$(( ($1 - 1) * per % ${#all[@]} ))
    echo "${all[@]:first:per}" | tr ' ' ','
}

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

node_lines() {  # $1 CPUs, $2 MB of this machine: the NodeName and PartitionName lines
    local i cpus mem list
    if (( NODES == 1 )); then
        echo "NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$1 RealMemory=$2 State=UNKNOWN"
        list=$HOST
    else
        mem=$(( $2 / NODES ))
        for i in $(seq "$NODES"); do
            cpus=$(node_cpus "$i" | tr ',' '\n' | wc -l); (( cpus >= 2 )) || cpus=2
            echo "NodeName=grpo-n$i NodeAddr=127.0.0.$((i + 1)) Port=$((6830 + i)) CPUs=$cpus RealMemory=$mem State=UNKNOWN"
        done
        list="grpo-n[1-$NODES]"
    fi
    echo "PartitionName=debug Nodes=$list Default=YES MaxTime=INFINITE State=UP PriorityTier=1"
    echo "PartitionName=urgent Nodes=$list MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF"
}

multi_node_lines() {  # what several slurmds on one machine need: their own spool, pid and log; no binding plugin
    if (( NODES > 1 )); then
        echo "SlurmdParameters=config_overrides"
        echo "TaskPlugin=task/none"
    else
        echo "TaskPlugin=task/affinity"
    fi
}

write_hosts() {  # the nodes' names -> their loopback addresses, marked, replacing earlier marked lines
    local tmp i
    tmp=$(mktemp)
    grep -v "$HOSTS_MARK" /etc/hosts > "$tmp" || true
    if (( NODES > 1 )); then
        for i in $(seq "$NODES"); do echo "127.0.0.$((i + 1)) grpo-n$i $HOSTS_MARK" >> "$tmp"; done
    fi
    cat "$tmp" > /etc/hosts  # in place: /etc/hosts may be a bind mount
    rm -f "$tmp"
}

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
# one node: each task is pinned to the CPUs it was given (no cgroups: see the top of dev-cluster.sh);
# several: each slurmd and its tasks keep to the node's share of the CPUs (taskset)
$(multi_node_lines)
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobRequeue=1
ReturnToService=2
MpiDefault=none
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
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
# a node whose slurmd stopped is marked down* (not responding) within about this long; SLURM's default is 300 s
SlurmdTimeout=30
MinJobAge=300
$(node_lines "$cpus" "$mem")
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

    if [[ -f $DIR/nodes && $(cat "$DIR/nodes") != "$NODES" ]]; then  # another layout: restart on this one
        stop_slurm
    fi
    write_hosts
    echo "$NODES" > "$DIR/nodes"
    running "$DIR/slurmctld.pid" || slurmctld -i   # -i: ignore (and drop) state from an earlier run
    local i name names=()
    mapfile -t names < <(node_names)
    for i in "${!names[@]}"; do
        name=${names[i]}
        mkdir -p "$DIR/spool/$name"
        running "$DIR/slurmd-$name.pid" && continue
        if (( NODES == 1 )); then
            slurmd -N "$name"
        else
            taskset -c "$(node_cpus $((i + 1)))" slurmd -N "$name"
        fi
    done
    local want=${#names[@]} ready state
    for _ in $(seq 60); do
        state=$(sinfo -h -N -p debug -o "%N %T" 2>/dev/null || true)
        ready=$(grep -cE " (idle|mixed|allocated)" <<< "$state" || true)
        if (( ready == want )); then
            echo "SLURM is up: $(describe_nodes), partitions debug (default) and urgent (preempts debug)," \
                 "$([[ $accounting == *slurmdbd* ]] && echo "accounting in slurmdbd" || echo "no accounting")."
            echo "export SLURM_CONF=$CONF"
            return 0
        fi
        for name in "${names[@]}"; do
            [[ $(grep "^$name " <<< "$state") =~ (down|drain) ]] && scontrol update nodename="$name" state=resume 2>/dev/null || true
        done
        sleep 1
    done
    echo "error: $ready of $want node(s) became idle in 60 s (states: ${state:-none}); see $DIR/log/" >&2
    exit 1
}

describe_nodes() {
    if (( NODES == 1 )); then
        echo "node $HOST ($(nproc) CPUs)"
    else
        local i out=""
        for i in $(seq "$NODES"); do out+="grpo-n$i (127.0.0.$((i + 1)), CPUs $(node_cpus "$i")) "; done
        echo "$NODES nodes: ${out% }"
    fi
}

stop_pid() {  # stop the process in pid file $1, waiting up to 10 s
    if running "$1"; then
        local pid
        pid=$(cat "$1")
        kill "$pid"
        for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    fi
}

stop_slurm() {  # slurmctld and every slurmd this script started, on any layout
    local pidfile
    for pidfile in "$DIR"/slurmd-*.pid "$DIR/slurmd.pid" "$DIR/slurmctld.pid"; do
        [[ -e $pidfile ]] && stop_pid "$pidfile"
    done
    return 0
}

down() {
    export SLURM_CONF=$CONF
    stop_slurm
    for pidfile in "$DIR/slurmdbd.pid" "$DB_DIR/mariadb.pid"; do
        stop_pid "$pidfile"
    done
    # munged may serve other SLURM users on this machine; stop it only if we started it alone
    if running /run/munge/munged.pid && [[ ${GRPO_SLURM_STOP_MUNGE:-1} == 1 ]]; then
        kill "$(cat /run/munge/munged.pid)"
    fi
    NODES=1 write_hosts  # the nodes' /etc/hosts lines, if any
    rm -f "$DIR/nodes"
    echo "SLURM is down."
}

case ${1:-} in
    install) install ;;
    up)
        if [[ ${2:-} == --nodes ]]; then NODES=${3:?--nodes takes a count}; fi
        [[ $NODES =~ ^[1-9][0-9]?$ ]] && (( NODES <= 253 )) || { echo "error: --nodes takes 1 to 253, not '$NODES'" >&2; exit 2; }
        up ;;
    down) down ;;
    *) echo "usage: $0 install | up [--nodes N] | down" >&2; exit 2 ;;
esac

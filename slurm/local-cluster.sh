#!/usr/bin/env bash
# A throw-away single-node Slurm on this machine, for trying the sbatch templates and for
# tests/test_slurm.py.  Needs the Debian packages `slurm-wlm munge` and root (the daemons run
# as root: SlurmUser=root keeps the setup free of service accounts and spool permissions).
#
#   slurm/local-cluster.sh start    # idempotent; waits (bounded) until the node is idle
#   slurm/local-cluster.sh stop     # stops the daemons this script started
#   slurm/local-cluster.sh status
#   eval "$(slurm/local-cluster.sh env)"   # SLURM_CONF for sbatch/sinfo/squeue in this shell
#
# The configuration lives in $ROCMOE_SLURM_DIR (default /tmp/rocmoe-slurm), never in
# /etc/slurm, so the machine's own Slurm setup (if any) is left alone; clients find it through
# SLURM_CONF, which `env` prints.
set -euo pipefail

DIR="${ROCMOE_SLURM_DIR:-/tmp/rocmoe-slurm}"
CONF="$DIR/slurm.conf"
WAIT_S="${ROCMOE_SLURM_WAIT_S:-60}"

die() { echo "local-cluster: $*" >&2; exit 1; }

need_tools() {
    local t
    for t in munged slurmctld slurmd sinfo; do
        command -v "$t" >/dev/null 2>&1 || [ -x "/usr/sbin/$t" ] ||
            die "$t not found: apt-get install -y slurm-wlm munge"
    done
    [ "$(id -u)" = 0 ] || die "run as root (the local cluster's daemons run as root)"
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
    mkdir -p "$DIR/state" "$DIR/spool"
    local node_line
    # slurmd -C describes this machine exactly (sockets, cores, memory): a node configured with
    # more than it has would be drained at registration.
    node_line="$(/usr/sbin/slurmd -C | head -n 1)"
    [ -n "$node_line" ] || die "slurmd -C printed nothing"
    local node
    node="$(hostname -s)"
    # slurmd -C names the node after `hostname -s` too; keep it explicit so both agree.
    node_line="$(echo "$node_line" | sed -E "s/^NodeName=[^ ]+/NodeName=$node/")"
    cat >"$CONF" <<EOF
# written by slurm/local-cluster.sh: a single-node test cluster
ClusterName=rocmoe-local
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=${ROCMOE_SLURMCTLD_PORT:-6817}
SlurmdPort=${ROCMOE_SLURMD_PORT:-6818}
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
# No cgroups in containers/CI: track processes by parent pid and do no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# A node that was down (daemons restarted) comes back by itself.
ReturnToService=2
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
# Short timeouts: a broken test job should fail fast, not hold CI.
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
$node_line State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=60 State=UP
EOF
}

start_munge() {
    # munge's client talks to the daemon over this socket; a live one means munged runs.
    if [ -S /run/munge/munge.socket.2 ] && pgrep -x munged >/dev/null 2>&1; then return; fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing (reinstall munge)"
    if id munge >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged
    else
        /usr/sbin/munged --force
    fi
}

node_state() {
    SLURM_CONF="$CONF" sinfo -h -N -o '%T' 2>/dev/null | head -n 1
}

start() {
    need_tools
    write_conf
    start_munge
    if ! pid_alive "$DIR/slurmctld.pid"; then
        # -i: ignore state files of an earlier run (jobs from a previous container are gone).
        /usr/sbin/slurmctld -f "$CONF" -i
    fi
    if ! pid_alive "$DIR/slurmd.pid"; then
        /usr/sbin/slurmd -f "$CONF"
    fi
    local deadline=$((SECONDS + WAIT_S)) state=""
    while [ "$SECONDS" -lt "$deadline" ]; do
        state="$(node_state || true)"
        case "$state" in
            idle|mixed|allocated) echo "local-cluster: node $(hostname -s) is $state ($CONF)"; return 0 ;;
            down*|drain*)
                # A node left down by an earlier run: resume it (ReturnToService covers most cases).
                SLURM_CONF="$CONF" scontrol update NodeName="$(hostname -s)" State=RESUME \
                    >/dev/null 2>&1 || true ;;
        esac
        sleep 1
    done
    echo "local-cluster: node did not become idle within ${WAIT_S}s (state '${state}')" >&2
    tail -n 20 "$DIR/slurmctld.log" "$DIR/slurmd.log" >&2 2>/dev/null || true
    return 1
}

stop_daemon() {
    local pidfile="$1" name="$2" i
    pid_alive "$pidfile" || return 0
    kill "$(cat "$pidfile")" 2>/dev/null || true
    for i in $(seq 1 50); do
        pid_alive "$pidfile" || { echo "local-cluster: stopped $name"; return 0; }
        sleep 0.2
    done
    echo "local-cluster: $name did not stop within 10 s" >&2
    return 1
}

stop() {
    # Only the daemons whose pid files this script's config names: never another Slurm's.
    stop_daemon "$DIR/slurmd.pid" slurmd
    stop_daemon "$DIR/slurmctld.pid" slurmctld
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status)
        if pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid"; then
            echo "running: node $(node_state) ($CONF)"
        else
            echo "not running"; exit 1
        fi ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac

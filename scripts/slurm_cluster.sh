#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for tests and for trying examples/slurm/.
#
#   scripts/slurm_cluster.sh start DIR    # write config under DIR, start munged, slurmctld, slurmd n1 + n2
#   scripts/slurm_cluster.sh status DIR   # daemons, controller and node states
#   scripts/slurm_cluster.sh stop DIR     # cancel jobs, stop the daemons recorded in DIR
#
# Needs root and the Debian packages (scripts/install_slurm.sh installs them; this script installs
# nothing). Everything lives under DIR: munge key and socket, slurm.conf, state, spool, logs and one
# PID file per daemon. `stop` only signals the PIDs recorded there, never processes found by name.
#
# Each slurmd runs in its own UTS and mount namespace with host name n1 or n2 and a bind-mounted
# /etc/hosts in which n1 and n2 are 127.0.0.1, so jobs see two distinct nodes exactly as on a real
# cluster (Lightning takes MASTER_ADDR from the first node of SLURM_NODELIST).
#
# After `start`, point every client command at the cluster with the printed line:
#   export SLURM_CONF=DIR/slurm.conf
set -euo pipefail

NODES=(n1 n2)
START_TIMEOUT_S=${SLURM_CLUSTER_START_TIMEOUT_S:-60}
STOP_TIMEOUT_S=${SLURM_CLUSTER_STOP_TIMEOUT_S:-30}

die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }

usage() { die "usage: $0 {start|stop|status} DIR"; }

# Prints N ports that are free right now, below the kernel's ephemeral range: the daemons bind them
# seconds later, and a port the kernel hands out (port 0) could meanwhile go to any process's outgoing
# connection (gloo opens many), which once left a slurmd with "Address already in use".
free_ports() {
    python3 - "$1" <<'PY'
import random, socket, sys
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
socks = []
for port in random.sample(range(max(1024, low - 12000), low), 400):
    if len(socks) == int(sys.argv[1]):
        break
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        continue
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

pid_of() { [ -f "$DIR/pids/$1" ] && cat "$DIR/pids/$1" || true; }

# The recorded PID of a daemon if that process is still the daemon (not a recycled PID).
daemon_pid() {
    local pid expected=${1%%-*}   # slurmd-n1 -> slurmd
    pid=$(pid_of "$1")
    alive "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$expected" ] && echo "$pid" || true
}

log_tails() {
    for f in "$DIR"/log/*; do
        [ -f "$f" ] || continue
        echo "---- tail of $f" >&2
        tail -n 15 "$f" >&2
    done
}

# Runs a command in the background, detached from our stdio, and records its PID under a name.
spawn() {
    local name=$1; shift
    setsid "$@" </dev/null >>"$DIR/log/$name.out" 2>&1 &
    echo $! >"$DIR/pids/$name"
}

wait_until() {  # wait_until DESCRIPTION COMMAND...: polls COMMAND until it succeeds or times out
    local what=$1; shift
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until "$@" >/dev/null 2>&1; do
        if [ $SECONDS -ge $deadline ]; then
            echo "slurm_cluster.sh: timed out after ${START_TIMEOUT_S}s waiting for $what" >&2
            log_tails
            return 1
        fi
        for name in "$DIR"/pids/*; do
            [ -f "$name" ] || continue
            if ! alive "$(cat "$name")"; then
                echo "slurm_cluster.sh: $(basename "$name") exited while waiting for $what" >&2
                log_tails
                return 1
            fi
        done
        sleep 0.3
    done
}

controller_up() { [[ "$(scontrol ping 2>/dev/null)" == *"is UP"* ]]; }

nodes_idle() {
    local states
    states=$(sinfo -h -N -o %t | sort -u)
    [ "$states" = "idle" ] && [ "$(sinfo -h -N -o %N | wc -l)" -eq ${#NODES[@]} ]
}

write_config() {
    local host=$1 ctld_port=$2; shift 2
    local node_ports=("$@")
    mkdir -p "$DIR"/{munge,state,log,pids} "${NODES[@]/#/$DIR/spool/}"
    chmod 755 "$DIR" "$DIR/munge"   # munged refuses a socket folder others cannot enter

    if [ ! -f "$DIR/munge/munge.key" ]; then
        mungekey --create --keyfile="$DIR/munge/munge.key"
    fi
    chmod 600 "$DIR/munge/munge.key"

    printf '127.0.0.1 localhost %s %s\n::1 localhost ip6-localhost\n' "$host" "${NODES[*]}" >"$DIR/hosts"

    {
        echo "# Written by scripts/slurm_cluster.sh: a two-node cluster on one host."
        echo "ClusterName=pipeckpt-local"
        echo "SlurmctldHost=$host(127.0.0.1)"
        echo "SlurmctldPort=$ctld_port"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        # cred_expire also delays the restart of a requeued job (default 120 s), and a pending job
        # whose begin time has come waits for the next scheduling pass (default every 30 to 60 s).
        echo "AuthInfo=socket=$DIR/munge/munge.socket.2,cred_expire=5"
        echo "SchedulerType=sched/backfill"
        echo "SchedulerParameters=sched_interval=2,bf_interval=2"
        echo "StateSaveLocation=$DIR/state"
        echo "SlurmdSpoolDir=$DIR/spool/%n"
        echo "SlurmctldPidFile=$DIR/state/slurmctld.pid"
        echo "SlurmdPidFile=$DIR/spool/%n/slurmd.pid"
        echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
        echo "SlurmdLogFile=$DIR/log/slurmd.%n.log"
        echo "SlurmctldDebug=info"
        echo "SlurmdDebug=info"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "SlurmdParameters=config_overrides"
        echo "ReturnToService=2"
        echo "MpiDefault=none"
        echo "SwitchType=switch/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "JobCompType=jobcomp/none"
        echo "MailProg=/bin/true"
        echo "MinJobAge=4"
        echo "KillWait=5"
        echo "InactiveLimit=0"
        echo "SlurmdTimeout=60"
        echo "Waittime=0"
        local i
        for i in "${!NODES[@]}"; do
            echo "NodeName=${NODES[$i]} NodeHostname=${NODES[$i]} NodeAddr=127.0.0.1 Port=${node_ports[$i]}" \
                 "CPUs=2 RealMemory=4000 State=UNKNOWN"
        done
        echo "PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
    } >"$DIR/slurm.conf"
}

abort_start() {
    echo "slurm_cluster.sh: start failed; stopping what was started" >&2
    cmd_stop >&2
    exit 1
}

cmd_start() {
    [ "$(id -u)" -eq 0 ] || die "needs root (slurmd runs jobs as any user and uses namespaces)"
    local tool
    for tool in munged mungekey slurmctld slurmd scontrol sinfo unshare; do
        command -v "$tool" >/dev/null || die "'$tool' not found; run scripts/install_slurm.sh first"
    done
    local name
    for name in munged slurmctld "${NODES[@]/#/slurmd-}"; do
        if [ -n "$(daemon_pid "$name")" ]; then
            die "$name is already running in $DIR (PID $(pid_of "$name")); run: $0 stop $DIR"
        fi
    done
    local socket="$DIR/munge/munge.socket.2"
    [ ${#socket} -lt 100 ] || die "DIR is too long for a unix socket path (${#socket} chars): $socket"

    local host ports
    host=$(hostname -s)
    read -r -a ports <<<"$(free_ports $((1 + ${#NODES[@]})))"
    write_config "$host" "${ports[@]}"
    export SLURM_CONF="$DIR/slurm.conf"

    # --force: munged otherwise refuses a socket under a folder others cannot enter (pytest's
    # temporary folders are mode 700); every client here runs as root.
    spawn munged munged -F --force --socket="$socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/munged.seed" \
        --log-file="$DIR/log/munged.log"
    wait_until "munged's socket" test -S "$socket" || abort_start

    spawn slurmctld slurmctld -D -i -f "$SLURM_CONF"
    wait_until "slurmctld to answer 'scontrol ping'" controller_up || abort_start

    for name in "${NODES[@]}"; do
        spawn "slurmd-$name" unshare --uts --mount sh -c \
            "mount --bind '$DIR/hosts' /etc/hosts && hostname $name && exec slurmd -D -N $name -f '$SLURM_CONF'"
    done
    wait_until "nodes ${NODES[*]} to be idle (sinfo -h -N -o %t)" nodes_idle || abort_start

    echo "export SLURM_CONF=$SLURM_CONF"
}

# Cancels every job of this cluster and waits until none is running or completing, so that no
# slurmstepd or job process outlives the daemons.
drain_jobs() {
    local deadline=$((SECONDS + STOP_TIMEOUT_S))
    scancel --quiet --full --partition=debug >/dev/null 2>&1 || true
    while [ -n "$(squeue -h -t PD,CF,R,CG,S,RQ,RH,RF,RS,SO,ST,SI -o %i 2>/dev/null)" ]; do
        if [ $SECONDS -ge $deadline ]; then
            echo "slurm_cluster.sh: jobs still active after ${STOP_TIMEOUT_S}s; stopping anyway" >&2
            return 0
        fi
        scancel --quiet --full --partition=debug >/dev/null 2>&1 || true
        sleep 0.5
    done
}

cmd_stop() {
    [ -d "$DIR/pids" ] || { echo "slurm_cluster.sh: no cluster recorded in $DIR"; return 0; }
    export SLURM_CONF="$DIR/slurm.conf"
    if [ -n "$(daemon_pid slurmctld)" ] && controller_up; then
        drain_jobs
    fi
    local name pid order=("${NODES[@]/#/slurmd-}" slurmctld munged)
    declare -A pids=()
    for name in "${order[@]}"; do
        pid=$(daemon_pid "$name")
        pids[$name]=$pid
        [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null || true
    done
    local deadline=$((SECONDS + STOP_TIMEOUT_S))
    for name in "${order[@]}"; do
        pid=${pids[$name]}
        while alive "$pid"; do
            if [ $SECONDS -ge $deadline ]; then
                echo "slurm_cluster.sh: $name (PID $pid) ignored SIGTERM; sending SIGKILL" >&2
                kill -KILL "$pid" 2>/dev/null || true
                sleep 0.2
                break
            fi
            sleep 0.2
        done
        rm -f "$DIR/pids/$name"
    done
    echo "slurm_cluster.sh: stopped the cluster in $DIR"
}

cmd_status() {
    [ -d "$DIR/pids" ] || die "no cluster recorded in $DIR"
    export SLURM_CONF="$DIR/slurm.conf"
    local name pid rc=0
    for name in munged slurmctld "${NODES[@]/#/slurmd-}"; do
        pid=$(daemon_pid "$name")
        if [ -n "$pid" ]; then echo "$name: running (PID $pid)"; else echo "$name: not running"; rc=1; fi
    done
    if [ -n "$(daemon_pid slurmctld)" ]; then
        scontrol ping || rc=1
        sinfo -N -o "%N %t" || rc=1
    fi
    echo "export SLURM_CONF=$SLURM_CONF"
    return $rc
}

[ $# -eq 2 ] || usage
[ "$1" = start ] && mkdir -p "$2"
if [ ! -d "$2" ]; then
    [ "$1" = stop ] && { echo "slurm_cluster.sh: no cluster in $2 (no such folder)"; exit 0; }
    die "no such folder: $2"
fi
DIR=$(cd "$2" && pwd)
case $1 in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) usage ;;
esac

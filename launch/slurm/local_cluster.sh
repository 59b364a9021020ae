#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for tests and for trying the sbatch scripts.
#
#   launch/slurm/local_cluster.sh up     [DIR]   install (if needed) and start munged, slurmctld, slurmd
#   launch/slurm/local_cluster.sh status [DIR]   print daemon PIDs and `sinfo`; exit 1 if not up
#   launch/slurm/local_cluster.sh down   [DIR]   cancel all jobs, stop the daemons this script started
#
# Exit status: 0 ok, 1 error, 3 the packages are missing and cannot be installed (tests skip on 3).
# DIR (default $FPA_SLURM_DIR or /tmp/fpa-slurm) holds etc/slurm.conf, state/, spool/, log/ and pids/.
# Clients find the cluster through SLURM_CONF: `source DIR/env.sh` (or export SLURM_CONF=DIR/etc/slurm.conf).
# Needs root (SlurmUser=root, munged runs as user munge). No systemd: daemons are started directly and
# stopped by the PIDs recorded under DIR/pids, never by name.
# Knobs: FPA_SLURM_CPUS (CPUs the node advertises, default 8; config_overrides lets it exceed the real
# count so multi-task jobs fit on 2 cores), FPA_SLURM_PORT (slurmctld port, default 6817; slurmd uses +1).
set -euo pipefail

cmd=${1:-status}
dir=${2:-${FPA_SLURM_DIR:-/tmp/fpa-slurm}}
cpus=${FPA_SLURM_CPUS:-8}
port=${FPA_SLURM_PORT:-6817}
conf="$dir/etc/slurm.conf"
pids="$dir/pids"

log() { echo "local_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }
no_packages() { log "error: $*"; exit 3; } # exit 3: the Slurm packages cannot be installed here

alive() { # alive PIDFILE: the process recorded there is running
    [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
    local missing=()
    command -v munged >/dev/null || [[ -x /usr/sbin/munged ]] || missing+=(munge)
    command -v slurmctld >/dev/null || [[ -x /usr/sbin/slurmctld ]] || missing+=(slurmctld)
    command -v slurmd >/dev/null || [[ -x /usr/sbin/slurmd ]] || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null || no_packages "missing ${missing[*]} and no apt-get to install them"
    log "installing ${missing[*]}"
    # `apt-get update` once per boot: the marker lives in /tmp.
    if [[ ! -e /tmp/.fpa-slurm-apt-updated ]]; then
        apt-get update -qq >"$dir/log/apt.log" 2>&1 || no_packages "apt-get update failed (see $dir/log/apt.log)"
        touch /tmp/.fpa-slurm-apt-updated
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
        >>"$dir/log/apt.log" 2>&1 || no_packages "apt-get install ${missing[*]} failed (see $dir/log/apt.log)"
}

start_munge() {
    # A munged that already answers (ours or the system's) is reused and not recorded, so `down`
    # leaves it alone.
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
    install -d -o munge -g munge -m 0755 /run/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged --force
    local i
    for i in $(seq 50); do
        if [[ -s /run/munge/munged.pid ]] && munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
            cp /run/munge/munged.pid "$pids/munged.pid"
            return 0
        fi
        sleep 0.1
    done
    die "munged did not come up (see /var/log/munge/munged.log)"
}

write_conf() {
    local host mem
    host=$(hostname -s)
    mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    [[ -n "$mem" ]] || die "cannot read RealMemory from 'slurmd -C'"
    cat >"$conf" <<EOF
# Written by launch/slurm/local_cluster.sh: a single-node cluster for tests.
ClusterName=fpa-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$pids/slurmctld.pid
SlurmdPidFile=$pids/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
# The node may advertise more CPUs than it has, so --ntasks=4 runs on 2 cores.
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    echo "export SLURM_CONF=$conf" >"$dir/env.sh"
}

wait_idle() {
    local i state
    for i in $(seq 100); do
        state=$(SLURM_CONF="$conf" sinfo -h -o '%T' 2>/dev/null | head -n1 || true)
        case "$state" in
            idle* | mixed* | allocated*) return 0 ;;
        esac
        sleep 0.3
    done
    die "node did not become idle (state '${state:-?}'; see $dir/log/slurmctld.log, slurmd.log)"
}

up() {
    [[ $EUID -eq 0 ]] || die "must run as root (SlurmUser=root, munged as user munge)"
    mkdir -p "$dir/etc" "$dir/state" "$dir/spool" "$dir/log" "$pids"
    install_packages
    start_munge
    if alive "$pids/slurmctld.pid" && alive "$pids/slurmd.pid"; then
        log "already up in $dir"
    else
        write_conf
        if ! alive "$pids/slurmctld.pid"; then
            # -c: start from a clean job state, not jobs left by an earlier cluster in this dir.
            /usr/sbin/slurmctld -c -f "$conf" || die "slurmctld failed to start (see $dir/log/slurmctld.log)"
        fi
        if ! alive "$pids/slurmd.pid"; then
            /usr/sbin/slurmd -f "$conf" || die "slurmd failed to start (see $dir/log/slurmd.log)"
        fi
    fi
    wait_idle
    log "up: SLURM_CONF=$conf"
    echo "$conf"
}

status() {
    local name ok=0
    for name in munged slurmctld slurmd; do
        if alive "$pids/$name.pid"; then
            echo "$name: running (pid $(cat "$pids/$name.pid"))"
        else
            echo "$name: not running (or not started by this script)"
            [[ $name == munged ]] || ok=1
        fi
    done
    if ((ok == 0)); then
        SLURM_CONF="$conf" sinfo || ok=1
    fi
    return $ok
}

stop_pid() { # stop_pid NAME: SIGTERM the recorded PID, wait, then SIGKILL
    local f="$pids/$1.pid" pid i
    alive "$f" || { rm -f "$f"; return 0; }
    pid=$(cat "$f")
    kill "$pid" 2>/dev/null || true
    for i in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$f"; return 0; }
        sleep 0.2
    done
    log "$1 (pid $pid) ignored SIGTERM; killing"
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$f"
}

down() {
    local i
    if alive "$pids/slurmctld.pid"; then
        # Cancel every job of this private cluster first so no slurmstepd outlives its slurmd.
        SLURM_CONF="$conf" scancel --full --quiet --state=PENDING 2>/dev/null || true
        SLURM_CONF="$conf" scancel --full --quiet --state=RUNNING 2>/dev/null || true
        for i in $(seq 50); do
            [[ -z "$(SLURM_CONF="$conf" squeue -h -t RUNNING,COMPLETING,PENDING 2>/dev/null)" ]] && break
            sleep 0.2
        done
    fi
    stop_pid slurmd
    stop_pid slurmctld
    stop_pid munged
    log "down ($dir)"
}

case "$cmd" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) die "unknown command '$cmd' (use up, down or status)" ;;
esac

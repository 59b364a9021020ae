#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for tests and for trying the sbatch scripts.
#
#   launch/slurm/local_cluster.sh up     [DIR]   install (if needed) and start munged, slurmctld, slurmd
#   launch/slurm/local_cluster.sh status [DIR]   print daemon PIDs and `sinfo`; exit 1 if not up
#   launch/slurm/local_cluster.sh down   [DIR]   cancel all jobs, stop the daemons this script started
#
#   launch/slurm/local_cluster.sh up --nodes N [DIR]    N >= 2: N hosts, each a network namespace
#   launch/slurm/local_cluster.sh kill-node NAME [DIR]  lose a node: SIGKILL every process in its namespace
#   launch/slurm/local_cluster.sh start-node NAME [DIR] start that node's slurmd again
#
# With --nodes N (N >= 2) each node is a network namespace (ip netns) joined to a bridge by a veth pair,
# with its own address, its own host name (a UTS namespace; slurmd -N) and its own /etc/hosts
# (/etc/netns/NS/hosts bound over it in a mount namespace), all named with a prefix derived from DIR.
# slurmctld and a private munged (its own socket and key in /run/<prefix>-munge) run on the host side. The namespaces
# share the file system, so DIR and every run directory are visible from all nodes, as on a cluster
# with a shared /home.
# `down` stops exactly the recorded PIDs and every process left in its own namespaces, and removes the
# namespaces, links, /etc/netns entries and the munge dir listed in DIR/created. Traffic stays on the
# bridge subnet (FPA_SLURM_SUBNET, default 10.211.<port % 250>: the host side .1, the nodes .2, .3, ...).
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
shift || true
nodes=1
node_arg=""
args=()
while (($#)); do
    case "$1" in
        --nodes) nodes=${2:?--nodes needs a number}; shift 2 ;;
        --nodes=*) nodes=${1#--nodes=}; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
if [[ $cmd == kill-node || $cmd == start-node ]]; then
    node_arg=${args[0]:-}
    args=("${args[@]:1}")
fi
dir=${args[0]:-${FPA_SLURM_DIR:-/tmp/fpa-slurm}}
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


# -- several nodes, one network namespace each -----------------------------------------------------

multi() { [[ -s "$dir/nodes" ]]; } # this DIR holds a multi-node cluster (one "NAME NS ADDR" per line)

prefix() { # a short name prefix per cluster DIR: interface names are limited to 15 characters
    echo "fpa$(realpath -m "$dir" | md5sum | cut -c1-6)"
}

created() { echo "$*" >>"$dir/created"; } # record a resource the moment it exists, for `down`

# The private munged's files live outside DIR: user munge cannot enter a root-only temp dir.
munge_dir() { echo "/run/$(prefix)-munge"; }
munge_sock() { echo "$(munge_dir)/munge.socket"; }

start_private_munge() {
    # Its own munged (own socket and key): no other cluster's `down` can take it away.
    local m i
    m=$(munge_dir)
    [[ -d "$m" ]] || { install -d -o munge -g munge -m 0700 "$m" && created etcdir "$m"; }
    if [[ ! -s "$m/munge.key" ]]; then
        dd if=/dev/urandom of="$m/munge.key" bs=1024 count=1 status=none
        chown munge:munge "$m/munge.key"
        chmod 0400 "$m/munge.key"
    fi
    alive "$pids/munged.pid" && return 0
    runuser -u munge -- /usr/sbin/munged --force --socket="$m/munge.socket" --key-file="$m/munge.key" \
        --pid-file="$m/munged.pid" --log-file="$m/munged.log" --seed-file="$m/munged.seed" ||
        die "munged did not start (see $m/munged.log)"
    for i in $(seq 50); do
        if [[ -s "$m/munged.pid" ]] && munge -S "$m/munge.socket" -n 2>/dev/null |
            unmunge -S "$m/munge.socket" >/dev/null 2>&1; then
            cp "$m/munged.pid" "$pids/munged.pid"
            return 0
        fi
        sleep 0.1
    done
    die "munged did not come up (see $m/munged.log)"
}

write_conf_multi() { # write_conf_multi SUBNET
    local net=$1 host mem names=() name addr
    host=$(hostname -s)
    mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
    [[ -n "$mem" ]] || die "cannot read RealMemory from 'slurmd -C'"
    mem=$((mem / nodes))
    cat >"$conf" <<EOF
# Written by launch/slurm/local_cluster.sh: a $nodes-node cluster, one network namespace per node.
ClusterName=fpa-multi
SlurmctldHost=$host($net.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$(munge_sock)
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$pids/slurmctld.pid
SlurmdPidFile=$pids/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
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
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=600
InactiveLimit=0
# A lost node is declared DOWN after SlurmdTimeout seconds; its jobs then end (NODE_FAIL) or requeue.
SlurmdTimeout=${FPA_SLURM_NODE_TIMEOUT:-20}
EOF
    while read -r name _ addr; do
        names+=("$name")
        echo "NodeName=$name NodeHostname=$name NodeAddr=$addr CPUs=$cpus Boards=1 SocketsPerBoard=1" \
            "CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN" >>"$conf"
    done <"$dir/nodes"
    echo "PartitionName=debug Nodes=$(IFS=,; echo "${names[*]}") Default=YES MaxTime=INFINITE State=UP" \
        "OverSubscribe=NO" >>"$conf"
    echo "export SLURM_CONF=$conf" >"$dir/env.sh"
}

start_slurmd_in() { # start_slurmd_in NAME NS: slurmd in the node's namespace, under the node's host name
    mkdir -p "$dir/spool/$1"
    # nsenter, not `ip netns exec` (which remounts /sys without the cgroup tree slurmd wants); the
    # node's /etc/hosts is bound in a private mount namespace instead.
    nsenter --net="/run/netns/$2" unshare --mount --uts sh -c \
        'mount --bind "/etc/netns/$2/hosts" /etc/hosts && hostname "$1" && exec /usr/sbin/slurmd -f "$3" -N "$1"' \
        fpa-node "$1" "$2" "$conf" || die "slurmd $1 failed to start (see $dir/log/slurmd-$1.log)"
}

wait_idle_all() {
    local i idle want
    want=$(wc -l <"$dir/nodes")
    for i in $(seq 100); do
        idle=$(SLURM_CONF="$conf" sinfo -h -N -o '%T' 2>/dev/null | grep -cE '^(idle|mixed|allocated)' || true)
        ((idle == want)) && return 0
        sleep 0.3
    done
    die "not every node became idle ($(SLURM_CONF="$conf" sinfo -h -N -o '%N=%T' | paste -sd' '); see $dir/log/)"
}

up_multi() {
    [[ $EUID -eq 0 ]] || die "must run as root (network namespaces, SlurmUser=root)"
    command -v ip >/dev/null || no_packages "ip (iproute2) is missing"
    mkdir -p "$dir/etc" "$dir/state" "$dir/spool" "$dir/log" "$pids"
    install_packages
    local pre net br i name ns addr names
    pre=$(prefix)
    net=${FPA_SLURM_SUBNET:-10.211.$((port % 250))}
    br="${pre}br"
    if multi && alive "$pids/slurmctld.pid"; then
        log "already up in $dir"
        wait_idle_all
        echo "$conf"
        return 0
    fi
    [[ ! -s "$dir/created" ]] || die "$dir holds a half-made cluster: run 'down $dir' first"
    ! ip netns list | grep -q "^${pre}-" || die "namespaces ${pre}-* exist already: run 'down $dir' first"
    ! ip -4 addr | grep -q " inet $net\." || die "subnet $net.0/24 is in use on this machine: set FPA_SLURM_SUBNET"
    : >"$dir/created"
    : >"$dir/nodes"
    ip link add "$br" type bridge || die "cannot create bridge $br"
    created link "$br"
    ip addr add "$net.1/24" dev "$br"
    ip link set "$br" up
    for i in $(seq "$nodes"); do
        name=${FPA_SLURM_NODE_PREFIX:-fpanode}$i
        ns="${pre}-n$i"
        addr="$net.$((i + 1))"
        ip netns add "$ns" || die "cannot create network namespace $ns"
        created netns "$ns"
        ip link add "${pre}h$i" type veth peer name "${pre}c$i" || die "cannot create veth ${pre}h$i"
        created link "${pre}h$i"
        ip link set "${pre}c$i" netns "$ns"
        ip link set "${pre}h$i" master "$br"
        ip link set "${pre}h$i" up
        ip -n "$ns" addr add "$addr/24" dev "${pre}c$i"
        ip -n "$ns" link set "${pre}c$i" up
        ip -n "$ns" link set lo up
        echo "$name $ns $addr" >>"$dir/nodes"
    done
    # Each namespace's /etc/hosts (bound over /etc/hosts for its slurmd): the machine's lines
    # without our node names, then every node's name and address.
    names=$(cut -d' ' -f1 "$dir/nodes" | paste -sd' ')
    for ns in $(cut -d' ' -f2 "$dir/nodes"); do
        mkdir -p "/etc/netns/$ns"
        created etcdir "/etc/netns/$ns"
        {
            awk -v names="$names" 'BEGIN { n = split(names, a, " "); for (i = 1; i <= n; i++) skip[a[i]] = 1 }
                { for (i = 2; i <= NF; i++) if ($i in skip) next; print }' /etc/hosts
            awk '{ print $3, $1 }' "$dir/nodes"
        } >"/etc/netns/$ns/hosts"
    done
    start_private_munge
    write_conf_multi "$net"
    /usr/sbin/slurmctld -c -f "$conf" || die "slurmctld failed to start (see $dir/log/slurmctld.log)"
    while read -r name ns _; do start_slurmd_in "$name" "$ns"; done <"$dir/nodes"
    wait_idle_all
    log "up: $nodes nodes, SLURM_CONF=$conf"
    echo "$conf"
}

node_ns() { awk -v n="$1" '$1 == n { print $2 }' "$dir/nodes"; }

kill_ns() { # kill_ns NS: SIGKILL every process in that namespace (all ours: this script made it)
    local ns=$1 i p
    for i in $(seq 25); do
        p=$(ip netns pids "$ns" 2>/dev/null | paste -sd' ')
        [[ -z "$p" ]] && return 0
        # shellcheck disable=SC2086
        kill -9 $p 2>/dev/null || true
        sleep 0.2
    done
    log "processes still in $ns: $p"
}

kill_node() {
    multi || die "$dir holds no multi-node cluster"
    local ns
    ns=$(node_ns "$node_arg")
    [[ -n "$ns" ]] || die "no node '$node_arg' in $dir/nodes"
    kill_ns "$ns"
    rm -f "$pids/slurmd-$node_arg.pid"
    log "node $node_arg lost (every process in $ns killed)"
}

start_node() {
    multi || die "$dir holds no multi-node cluster"
    local ns
    ns=$(node_ns "$node_arg")
    [[ -n "$ns" ]] || die "no node '$node_arg' in $dir/nodes"
    alive "$pids/slurmd-$node_arg.pid" || start_slurmd_in "$node_arg" "$ns"
}

status_multi() {
    local ok=0 name
    for name in munged slurmctld $(cut -d' ' -f1 "$dir/nodes" | sed 's/^/slurmd-/'); do
        if alive "$pids/$name.pid"; then
            echo "$name: running (pid $(cat "$pids/$name.pid"))"
        else
            echo "$name: not running"
            ok=1
        fi
    done
    SLURM_CONF="$conf" sinfo -N || ok=1
    return $ok
}

down_multi() {
    local i name kind what
    if alive "$pids/slurmctld.pid"; then
        SLURM_CONF="$conf" scancel --full --quiet --state=PENDING 2>/dev/null || true
        SLURM_CONF="$conf" scancel --full --quiet --state=RUNNING 2>/dev/null || true
        for i in $(seq 25); do
            [[ -z "$(SLURM_CONF="$conf" squeue -h -t RUNNING,PENDING 2>/dev/null)" ]] && break
            sleep 0.2
        done
    fi
    if [[ -s "$dir/nodes" ]]; then
        for name in $(cut -d' ' -f1 "$dir/nodes"); do stop_pid "slurmd-$name"; done
    fi
    # Whatever is left in our namespaces (the job steps of a lost node) was started there by us.
    while read -r kind what; do [[ $kind == netns ]] && kill_ns "$what"; done <"$dir/created"
    stop_pid slurmctld
    stop_pid munged
    # Remove what was made, newest first: the hosts files, the namespaces (their veth ends go with
    # them), then the links left on the host side.
    tac "$dir/created" | while read -r kind what; do
        case "$kind" in
            netns) ip netns del "$what" 2>/dev/null || log "could not delete namespace $what" ;;
            link) ! ip link show "$what" >/dev/null 2>&1 || ip link del "$what" ;;
            etcdir) rm -rf -- "$what" ;;
        esac
    done
    rm -f "$dir/created" "$dir/nodes"
    log "down ($dir)"
}

case "$cmd" in
    up)
        [[ $nodes =~ ^[0-9]+$ ]] && ((nodes >= 1 && nodes <= 8)) || die "--nodes must be 1..8; got '$nodes'"
        if ((nodes > 1)); then up_multi; else up; fi
        ;;
    down) if [[ -s "$dir/created" ]]; then down_multi; else down; fi ;;
    status) if multi; then status_multi; else status; fi ;;
    kill-node) kill_node ;;
    start-node) start_node ;;
    *) die "unknown command '$cmd' (use up, down, status, kill-node or start-node)" ;;
esac

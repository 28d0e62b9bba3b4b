#!/usr/bin/env bash
# A whole Slurm cluster on one machine, for the demo and the cluster tests.
#
#   cluster.sh up     munge, a TLS registry standing in for Harbor, slurmctld, and
#                     slurmd n1..nN (TFIMAGE_NODES=N, 2 by default, up to 32),
#                     each in its own network, UTS and mount
#                     namespace (and its own /dev, with four fake GPUs in it);
#                     tfimage installed and wired in; images pushed.
#                     With 4 nodes or more, a rack mirror for the upper half
#                     (mirror.sh; TFIMAGE_MIRROR=0: none).  TFIMAGE_BURST=B adds
#                     cloud nodes c1..cB, powered by Slurm, with their region's
#                     mirror and an image the role baked (cloud.sh).
#   cluster.sh down   stops all of it: no process, mount, namespace or link left.
#   cluster.sh status
#   cluster.sh daemon N  start node N's (or `login`: this host's) tfimage daemon
#
# TFIMAGE_STAGE=0 leaves out the controller's stage hook (PrologSlurmctld: one pull
# per multi-node job, sent to the nodes with sbcast); on by default here.
#
# SLURM_FLAVOR=host (default) runs this machine's Slurm; SLURM_FLAVOR=other runs the
# other Debian generation's Slurm (22.05 <-> 24.11) from a cached chroot built by
# other-slurm.sh, with the same node names, user, registry and build/cluster.env.
#
# `up` is a clean restart when the cluster is already up.  Spool directories live
# under /var/lib, outside /tmp, so nothing is visible in a container by accident.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=deploy/local/err-trap.sh
. "$REPO/deploy/local/err-trap.sh" cluster
STATE=${TFIMAGE_LOCAL_STATE:-/var/lib/tfimage-local}
ETC=$STATE/etc
RUN=$STATE/run
LOGS=$STATE/log
PREFIX=${TFIMAGE_PREFIX:-/opt/tfimage}
BRIDGE=tfbr0
NET=10.203.0
CTL_ADDR=$NET.1
NODE_COUNT=${TFIMAGE_NODES:-2}
STAGE_ON=${TFIMAGE_STAGE:-1}
# The registry's egress to the nodes, shaped (TFIMAGE_REGISTRY_RATE=200mbit: tc's
# rate syntax) so that, as at a real site, the registry's link is what a cold pull
# waits for and not this machine's memory bandwidth; empty: unshaped.
REGISTRY_RATE=${TFIMAGE_REGISTRY_RATE:-}
REG_PORT=5443
REGISTRY=$CTL_ADDR:$REG_PORT
TEST_USER=${TFIMAGE_TEST_USER:-tfuser}
# A second team's user: not in group team-a, whose private images TEST_USER may run.
TEST_USER2=${TFIMAGE_TEST_USER2:-tfuser2}
ROBOT='robot$tfimage+ci'
ENV_FILE=$REPO/build/cluster.env
FLAVOR=${SLURM_FLAVOR:-host}
ROOT=""   # the other Slurm's chroot, when FLAVOR=other
DAEMON_ARGS=()  # more arguments for `tfimage daemon` (cluster.sh daemon NODE ARGS...)

# shellcheck source=deploy/local/proxy.sh
. "$REPO/deploy/local/proxy.sh"
# shellcheck source=deploy/local/accounting.sh
. "$REPO/deploy/local/accounting.sh"
# shellcheck source=deploy/local/mirror.sh
. "$REPO/deploy/local/mirror.sh"
# shellcheck source=deploy/local/cloud.sh
. "$REPO/deploy/local/cloud.sh"

# Run a Slurm or munge program of the selected flavor.
in_root() { if [ -n "$ROOT" ]; then chroot "$ROOT" "$@"; else "$@"; fi; }

log() { printf 'cluster: %s\n' "$*" >&2; }
die() { printf 'cluster: error: %s\n' "$*" >&2; exit 1; }

case "$NODE_COUNT" in
    "" | *[!0-9]* | 0*) die "TFIMAGE_NODES must be a number of nodes from 2 to 32, not '$NODE_COUNT'" ;;
esac
[ "$NODE_COUNT" -ge 2 ] && [ "$NODE_COUNT" -le 32 ] \
    || die "TFIMAGE_NODES must be a number of nodes from 2 to 32, not '$NODE_COUNT'"
case "$STAGE_ON" in 0 | 1) ;; *) die "TFIMAGE_STAGE must be 0 or 1, not '$STAGE_ON'" ;; esac
case "$ACCOUNTING_ON" in 0 | 1) ;; *) die "TFIMAGE_ACCOUNTING must be 0 or 1, not '$ACCOUNTING_ON'" ;; esac
case "$MIRROR_ON" in 0 | 1) ;; *) die "TFIMAGE_MIRROR must be 0 or 1, not '$MIRROR_ON'" ;; esac
case "$BURST_COUNT" in [0-8]) ;; *) die "TFIMAGE_BURST must be a number of cloud nodes from 0 to 8, not '$BURST_COUNT'" ;; esac
[ "$BURST_COUNT" = 0 ] || [ "$FLAVOR" = host ] \
    || die "TFIMAGE_BURST needs SLURM_FLAVOR=host: slurmctld runs the power programs in the other Slurm's tree"
# Half the nodes behind the rack mirror, half not (the cloud nodes have their region's).
[ "$NODE_COUNT" -ge 4 ] || MIRROR_ON=0
[ -z "$REGISTRY_RATE" ] || [[ $REGISTRY_RATE =~ ^[1-9][0-9]{0,5}[kmg]?bit$ ]] \
    || die "TFIMAGE_REGISTRY_RATE must be a rate like 200mbit, not '$REGISTRY_RATE'"
NODES=()
for ((i = 1; i <= NODE_COUNT; i++)); do NODES+=("n$i"); done

node_addr() { # n1 -> .11, c1 (a cloud node) -> .101
    case "$1" in
        c*) echo "$NET.$((100 + ${1#c}))" ;;
        *) echo "$NET.$((10 + ${1#n}))" ;;
    esac
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
# running PIDFILE: alive and not a zombie (a killed daemon whose parent, the other
# host's pid 1 say, has not reaped it yet): what a restart asks.
running() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [ -r "/proc/$pid/stat" ] && [ "$(cut -d' ' -f3 "/proc/$pid/stat")" != Z ]
}

# ---------------------------------------------------------------------------- down

kill_listed() { # WHY CMD...: SIGKILL the pids CMD prints until it prints none
    # (2 s at most); WHY, when not empty, is logged with how many there were.
    local why=$1 pids
    shift
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        mapfile -t pids < <("$@" 2>/dev/null)
        [ ${#pids[@]} -eq 0 ] && break
        [ -z "$why" ] || log "killing ${#pids[@]} process(es) $why"
        kill -KILL "${pids[@]}" 2>/dev/null || true
        sleep 0.2
    done
}

mntns_pids() { # NS: the pids whose mount namespace is NS
    local p
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/ns/mnt" 2>/dev/null)" = "$1" ] && echo "${p#/proc/}"
    done
    return 0
}

kill_ns_procs() { # every process sharing NODE's recorded mount namespace
    local nsfile=$RUN/$1.mntns ns
    [ -f "$nsfile" ] || return 0
    ns=$(cat "$nsfile")
    # Never the machine's own mount namespace: that would be every process.
    if [ "$ns" != "$(readlink /proc/self/ns/mnt)" ] && [ "$ns" != "$(readlink /proc/1/ns/mnt)" ]; then
        kill_listed "" mntns_pids "$ns"
    fi
    rm -f "$nsfile"
}

kill_netns_procs() { # what is still in NODE's network namespace (a container's
    # processes have their own mount namespace, so kill_ns_procs misses them)
    ip netns list 2>/dev/null | grep -qw "^$1" || return 0
    kill_listed "left in $1's network namespace" ip netns pids "$1"
}

stop_pid() { # PIDFILE: TERM, then KILL after 5 s; by PID, never by name
    local f=$1 pid
    [ -f "$f" ] || return 0
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

# The nodes the running cluster was brought up with (an `up` of another size first
# takes down all of those), else this run's.
up_nodes() { # the on-premises nodes, then the cloud nodes (cloud.sh), up or not
    if [ -s "$RUN/nodes" ]; then cat "$RUN/nodes"; else printf '%s\n' "${NODES[@]}"; fi
    cat "$RUN/cloud-nodes" 2>/dev/null || true
}

down() {
    local was
    mapfile -t was < <(up_nodes)
    for n in "${was[@]}"; do
        stop_pid "$RUN/slurmd-$n.pid"
        kill_ns_procs "$n"
    done
    stop_pid "$RUN/daemon-login.pid"
    # What the login node's daemon left in this host's (or the chroot's) /run/tfimage.
    local login_run=/run/tfimage
    [ ! -f "$RUN/chroot.root" ] || login_run=$(cat "$RUN/chroot.root")/run/tfimage
    rm -f "$login_run/daemon.sock" "$login_run/pin.sock" "$login_run/resolve.sock" "$login_run/last-seen.json"
    stop_pid "$RUN/slurmctld.pid"
    stop_accounting
    stop_mirror
    stop_region
    stop_proxy
    stop_pid "$RUN/registry.pid"
    stop_pid "$RUN/munged.pid"
    if [ -f "$RUN/chroot.root" ]; then
        local r
        r=$(cat "$RUN/chroot.root")
        for m in "$STATE" /home /sys /dev /proc; do
            umount -R -l "$r$m" 2>/dev/null || true
        done
        rm -f "$RUN/chroot.root"
    fi
    for n in "${was[@]}"; do node_network_gone "$n"; done
    ip link del "$BRIDGE" 2>/dev/null || true  # and its qdisc (shape_registry)
    if [ -f "$RUN/lo-shaped" ]; then
        tc qdisc del dev lo root 2>/dev/null || true
        rm -f "$RUN/lo-shaped"
    fi
    hosts_entries remove
    rm -f "$ENV_FILE" "$RUN/nodes" "$RUN/cloud-nodes"
    log "down"
}

# ------------------------------------------------------------------------------ up

hosts_entries() { # add|remove the cluster's names in /etc/hosts, in place
    local tmp
    tmp=$(mktemp)
    grep -v '# tfimage-local$' /etc/hosts >"$tmp" || true
    if [ "$1" = add ]; then
        echo "$CTL_ADDR tfctl # tfimage-local" >>"$tmp"
        for n in "${NODES[@]}" $(burst_nodes); do echo "$(node_addr "$n") $n # tfimage-local" >>"$tmp"; done
    fi
    cat "$tmp" >/etc/hosts   # /etc/hosts may be a bind mount: rewrite, don't rename
    rm -f "$tmp"
}

setup_user() {
    getent group "$TEAM" >/dev/null || groupadd "$TEAM"
    id "$TEST_USER" >/dev/null 2>&1 || useradd -m -s /bin/bash "$TEST_USER"
    id -nG "$TEST_USER" | tr ' ' '\n' | grep -qx "$TEAM" || usermod -aG "$TEAM" "$TEST_USER"
    id "$TEST_USER2" >/dev/null 2>&1 || useradd -m -s /bin/bash "$TEST_USER2"
    # charliecloud needs allow_other on the root-made squashfuse mounts
    grep -q '^user_allow_other' /etc/fuse.conf 2>/dev/null || echo user_allow_other >>/etc/fuse.conf
}

net() { "$@" || die "network: '$*' failed"; }

node_network() { # NODE: its namespace, on the bridge at node_addr
    local n=$1
    net ip netns add "$n"
    ip link del "veth-$n" 2>/dev/null || true
    net ip link add "veth-$n" type veth peer name eth0 netns "$n"
    net ip link set "veth-$n" master "$BRIDGE" up
    net ip -n "$n" addr add "$(node_addr "$n")/24" dev eth0
    net ip -n "$n" link set lo up
    net ip -n "$n" link set eth0 up
    net ip -n "$n" route add default via "$CTL_ADDR"
}

node_network_gone() { # NODE: what is left in its namespace killed, and the namespace
    kill_netns_procs "$1"
    ip netns del "$1" 2>/dev/null || true
    # The host end goes with the namespace, but asynchronously; the next
    # `up` must not find it ("RTNETLINK answers: File exists").
    for _ in $(seq 50); do ip link show "veth-$1" >/dev/null 2>&1 || break; sleep 0.1; done
    ip link del "veth-$1" 2>/dev/null || true
}

setup_network() {
    net ip link add "$BRIDGE" type bridge
    net ip addr add "$CTL_ADDR/24" dev "$BRIDGE"
    net ip link set "$BRIDGE" up
    for n in "${NODES[@]}"; do node_network "$n"; done
    printf '%s\n' "${NODES[@]}" >"$RUN/nodes"
    burst_nodes >"$RUN/cloud-nodes"
    hosts_entries add
    shape_registry
}

# The registry's egress (what this host sends from its port into the bridge) gets
# REGISTRY_RATE; everything else on the bridge, and node-to-node traffic (which
# the bridge forwards port to port, never through this qdisc), stays unshaped.
# So does what it sends to this host itself over loopback, where the controller's
# stage hook pulls: a real controller has a link too.  (Loopback's qdisc is this
# machine's; down removes it only if up added it.)
shape_registry() {
    [ -n "$REGISTRY_RATE" ] || return 0
    local dev
    for dev in "$BRIDGE" lo; do
        if [ "$dev" = lo ]; then
            tc qdisc show dev lo | grep -q '^qdisc htb' && { log "lo has an htb qdisc already: the controller's pulls stay unshaped"; continue; }
            : >"$RUN/lo-shaped"
        fi
        net tc qdisc add dev "$dev" root handle 1: htb default 10 r2q 1000
        net tc class add dev "$dev" parent 1: classid 1:20 htb rate "$REGISTRY_RATE" ceil "$REGISTRY_RATE"
        net tc filter add dev "$dev" protocol ip parent 1: prio 1 u32 \
            match ip src "$CTL_ADDR/32" match ip sport "$REG_PORT" 0xffff flowid 1:20
    done
    # What the rack mirror fetches (from nginx's site-robot view, proxy.sh) crosses
    # the same link: the registry's uplink, one class for both.
    [ ! -f "$RUN/lo-shaped" ] || net tc filter add dev lo protocol ip parent 1: prio 1 u32 \
        match ip src 127.0.0.1/32 match ip sport "${AS_SITE##*:}" 0xffff flowid 1:20
    log "registry egress shaped to $REGISTRY_RATE (to the nodes and to the controller)"
}

start_munge() {
    local r=$ROOT
    mkdir -p "$r/run/munge" "$r/var/lib/munge" "$r/var/log/munge"
    [ -s /etc/munge/munge.key ] || mungekey -c -k /etc/munge/munge.key
    [ -z "$r" ] || install -D -m 0400 /etc/munge/munge.key "$r/etc/munge/munge.key"
    in_root chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
    chmod 0700 "$r/etc/munge"
    chmod 0400 "$r/etc/munge/munge.key"
    chmod 0755 "$r/run/munge"
    rm -f "$r/run/munge/munged.pid"
    in_root su -s /bin/sh munge -c munged
    for _ in $(seq 50); do [ -f "$r/run/munge/munged.pid" ] && break; sleep 0.1; done
    cp "$r/run/munge/munged.pid" "$RUN/munged.pid"
    in_root sh -c 'munge -n | unmunge >/dev/null' || die "munge does not work"
}

setup_root() { # the other flavor's chroot: kernel filesystems, /home, the state, names
    ROOT=$(bash "$REPO/deploy/local/other-slurm.sh" root)
    echo "$ROOT" >"$RUN/chroot.root"
    mount -t proc proc "$ROOT/proc"
    mount --rbind /dev "$ROOT/dev"
    mount --rbind /sys "$ROOT/sys"   # the cgroup mounts must come along
    mount --bind /home "$ROOT/home"
    mkdir -p "$ROOT$STATE"
    mount --bind "$STATE" "$ROOT$STATE"
    cat /etc/hosts >"$ROOT/etc/hosts"
    local uid gid
    uid=$(id -u "$TEST_USER"); gid=$(id -g "$TEST_USER")
    chroot "$ROOT" getent group "$TEST_USER" >/dev/null || chroot "$ROOT" groupadd -g "$gid" "$TEST_USER"
    chroot "$ROOT" id "$TEST_USER" >/dev/null 2>&1 \
        || chroot "$ROOT" useradd -M -u "$uid" -g "$gid" -d "/home/$TEST_USER" -s /bin/sh "$TEST_USER"
    uid=$(id -u "$TEST_USER2"); gid=$(id -g "$TEST_USER2")
    chroot "$ROOT" getent group "$TEST_USER2" >/dev/null || chroot "$ROOT" groupadd -g "$gid" "$TEST_USER2"
    chroot "$ROOT" id "$TEST_USER2" >/dev/null 2>&1 \
        || chroot "$ROOT" useradd -M -u "$uid" -g "$gid" -d "/home/$TEST_USER2" -s /bin/sh "$TEST_USER2"
    chroot "$ROOT" getent group "$TEAM" >/dev/null \
        || chroot "$ROOT" groupadd -g "$(getent group "$TEAM" | cut -d: -f3)" "$TEAM"
    chroot "$ROOT" usermod -aG "$TEAM" "$TEST_USER"
    grep -q '^user_allow_other' "$ROOT/etc/fuse.conf" 2>/dev/null || echo user_allow_other >>"$ROOT/etc/fuse.conf"
    mkdir -p "$ROOT/var/cache/tfimage" "$ROOT/run/tfimage" "$ROOT/var/log/tfimage" "$ROOT/.oldroot"
}

make_pki() {
    local d=$STATE/pki
    [ -s "$d/server.crt" ] && return 0
    mkdir -p "$d"
    chmod 0700 "$d"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=tfimage local CA" \
        -keyout "$d/ca.key" -out "$d/ca.crt" \
        -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=tfctl" \
        -keyout "$d/server.key" -out "$d/server.csr" 2>/dev/null
    printf 'subjectAltName=IP:%s,IP:127.0.0.1,DNS:tfctl,DNS:localhost\nextendedKeyUsage=serverAuth\n' \
        "$CTL_ADDR" >"$d/ext.cnf"
    openssl x509 -req -in "$d/server.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
        -days 3650 -extfile "$d/ext.cnf" -out "$d/server.crt" 2>/dev/null
    openssl rand -hex 16 >"$d/robot.password"
    chmod 0600 "$d"/*
}

start_registry() {
    local d=$STATE/registry
    mkdir -p "$d/data"
    rm -f "$d/htpasswd"  # its auth is the proxy's now (proxy.sh)
    # An upload's Location names the host the client asked (the proxy passes Host
    # and X-Forwarded-Proto on).
    cat >"$d/config.yml" <<YML
version: 0.1
log: {level: warn}
storage:
  filesystem: {rootdirectory: $d/data}
  delete: {enabled: true}
http:
  addr: $UPSTREAM
YML
    : >"$LOGS/registry.log"
    run_registry
    start_proxy
    start_mirror
    start_region
}

# run_registry: the registry's own process, on the config start_registry wrote
# (alone: `cluster.sh registry start` after a crash, the fronts still up).
run_registry() {
    local code
    ! running "$RUN/registry.pid" || die "the registry is already running"
    setsid docker-registry serve "$STATE/registry/config.yml" >>"$LOGS/registry.log" 2>&1 </dev/null &
    echo $! >"$RUN/registry.pid"
    for _ in $(seq 100); do
        code=$(curl -s -o /dev/null -w '%{http_code}' "http://$UPSTREAM/v2/" || true)
        [ "$code" = 200 ] && return 0
        sleep 0.1
    done
    tail -5 "$LOGS/registry.log" >&2
    die "registry did not come up on $UPSTREAM"
}

install_tfimage() {
    # The wheel the role installs; the same sources give the same bytes.
    WHEEL=$(bash "$REPO/deploy/local/role.sh" wheel)
    [ -n "$ROOT" ] || return 0
    # The other flavor's nodes get tfimage from the role, inside the chroot; this
    # machine keeps its own copy for the harness (pushing images, the tests' helpers).
    [ -x "$PREFIX/bin/python3" ] || /usr/bin/python3 -m venv "$PREFIX"
    "$PREFIX/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps "$WHEEL" \
        >"$LOGS/pip.log" 2>&1 && "$PREFIX/bin/pip" install -q --disable-pip-version-check "$WHEEL" \
        >>"$LOGS/pip.log" 2>&1 || { tail -20 "$LOGS/pip.log" >&2; die "installing tfimage into $PREFIX failed"; }
    bash "$REPO/deploy/local/other-slurm.sh" wheels
}

write_credentials() { # FILE OWNER: the robot account's credentials, mode 0600
    # JSON, which is YAML too (tfimage parses it without a YAML parser on srun's path).
    (umask 077; cat >"$1" <<JSON
{"registries": {"$REGISTRY": {"username": "$ROBOT", "password": "$(cat "$STATE/pki/robot.password")"}}}
JSON
    )
    chown "$2" "$1"
}

# What a site has before tfimage: slurm.conf with its own Prolog and Epilog, a
# plugstack.conf that includes plugstack.conf.d (as Debian's does) and loads a site
# plugin.  The Ansible role adds tfimage beside them; the tests check they survive.
write_site() {
    install -m 0755 "$REPO/deploy/local/site/prolog" "$ETC/site-prolog"
    install -m 0755 "$REPO/deploy/local/site/epilog" "$ETC/site-epilog"
    mkdir -p "$STATE/lib"
    if [ -n "$ROOT" ]; then
        cp "$REPO/deploy/local/site/site_hello.c" "$ROOT/usr/src/site_hello.c"
        chroot "$ROOT" gcc -shared -fPIC -O2 -o /usr/src/site_hello.so /usr/src/site_hello.c
        install -m 0755 "$ROOT/usr/src/site_hello.so" "$STATE/lib/site_hello.so"
    else
        gcc -shared -fPIC -O2 -o "$STATE/lib/site_hello.so" "$REPO/deploy/local/site/site_hello.c"
    fi
    rm -rf "$ETC/plugstack.conf.d" "$ETC/prolog.d" "$ETC/epilog.d" "$ETC/logrotate.d" "$ETC/cli_filter.lua"
    mkdir -p "$ETC/logrotate.d"
    cat >"$ETC/plugstack.conf" <<CONF
# The site's plugstack.conf (local cluster stand-in)
optional $STATE/lib/site_hello.so
include $ETC/plugstack.conf.d/*.conf
CONF
    mkdir -p "$STATE/data"
    echo "site data" >"$STATE/data/README"
    chmod 0755 "$STATE/data"; chmod 0644 "$STATE/data/README" "$ETC/plugstack.conf"
    # The test user's own pull credentials, for pinning tags at submit (as the user).
    local home
    home=$(getent passwd "$TEST_USER" | cut -d: -f6)
    install -d -o "$TEST_USER" -m 0700 "$home/.config" "$home/.config/tfimage"
    write_credentials "$home/.config/tfimage/credentials.yaml" "$TEST_USER"

    local nodes="" gres
    for n in "${NODES[@]}"; do
        gres=$(node_gres "$n")
        nodes+="NodeName=$n NodeAddr=$(node_addr "$n") CPUs=4 RealMemory=4000 Gres=$gres State=UNKNOWN"$'\n'
    done
    write_gpus
    cat >"$ETC/slurm.conf" <<CONF
# Local tfimage test cluster (written by deploy/local/cluster.sh)
ClusterName=tfimage
SlurmctldHost=$(hostname -s)($CTL_ADDR)
MailProg=/bin/true
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
# Per node: slurmd kills whatever the pid file names, and both nodes share /run.
SlurmdPidFile=$RUN/slurmd.%n.daemon.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/cgroup
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MpiParams=ports=20000-20999
# Four GPUs per node (node_dev and write_gpus: /dev/nvidia0..3 in each node's own
# /dev and a fake NVML; no real GPU here).
GresTypes=gpu,shard,mps
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
# The site's own hooks; the role turns these into prolog.d/epilog.d globs.
Prolog=$ETC/site-prolog
Epilog=$ETC/site-epilog
PrologEpilogTimeout=1200
PlugStackConfig=$ETC/plugstack.conf
KillWait=5
InactiveLimit=0
MinJobAge=300
$(slurm_conf_accounting)
$nodes
$(slurm_conf_cloud)
# debug: the first two nodes whatever TFIMAGE_NODES is, so that a -N2 job lands on n1
# and n2 as the tests expect; all: every node (jobs on more, the fleet's benches).
PartitionName=debug Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
PartitionName=all Nodes=$(IFS=,; echo "${NODES[*]}") MaxTime=INFINITE State=UP OverSubscribe=YES
# The seed's two queues on n1 and n2; tfimage_partitions (the role's vars) says which
# images each runs.
PartitionName=prod Nodes=${NODES[0]},${NODES[1]} MaxTime=INFINITE State=UP OverSubscribe=YES Priority=1000
PartitionName=dev Nodes=${NODES[0]},${NODES[1]} MaxTime=12:00:00 State=UP OverSubscribe=YES Priority=100
# A job here that names no --tf-image runs in tiny:1.0 (tfimage_partitions' default_image).
PartitionName=train Nodes=${NODES[0]},${NODES[1]} MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
    chmod 0644 "$ETC/slurm.conf"
    # A job's cgroup may open only its own GPUs' device files (gres.conf's File=), as
    # on a real site: NVML inside the job lists those alone (the fake does as NVML).
    printf 'ConstrainDevices=yes\n' >"$ETC/cgroup.conf"
    chmod 0644 "$ETC/cgroup.conf"
}

# The first node shares its GPUs as gres/shard (8, two per GPU), the second through
# gres/mps (100 per GPU); both also hand out whole GPUs.
node_gres() {
    case "$1" in
        "${NODES[0]}") echo "gpu:4,shard:8" ;;
        "${NODES[1]}") echo "gpu:4,mps:400" ;;
        *) echo "gpu:4" ;;
    esac
}

# GPUs without hardware, what tests/cluster/test_gpus.py runs on:
#   /dev/nvidia0..3, nvidiactl  where a real node has them, in each node's own /dev
#                               alone (node_dev, not this host's): character devices
#                               (major 195, no driver behind) for gres.conf's
#                               File=/dev/nvidia[0-3]. A job's device cgroup
#                               (ConstrainDevices) opens its own GPUs' alone, ch-run
#                               binds the node's /dev into the container, and the
#                               fake NVML lists only the GPUs it may open
#   $STATE/gpu/lib/             the fake libnvidia-ml.so.1 (tests/fakenvml), found by
#                               the node daemons and slurmd through LD_LIBRARY_PATH
#   $STATE/gpu/state-nN.json    each node's NVML state (the fake reads its hostname's)
#   $STATE/gpu/kmsg             the kernel log the GPU gate reads for XIDs (config)
write_gpus() {
    local g=$STATE/gpu src=$REPO/tests/fakenvml/fakenvml.c n
    rm -rf "$g"
    mkdir -p "$g/lib"
    chmod 0755 "$g" "$g/lib"
    : >"$g/kmsg"
    # The fake looks for the device files in /dev, as NVML does.
    local cc=(gcc -shared -fPIC -O2 -Wall -DFAKE_NVML_DIR="\"$g\"")
    if [ -n "$ROOT" ]; then  # built by the tree that loads it (its glibc)
        cp "$src" "$ROOT/usr/src/fakenvml.c"
        chroot "$ROOT" "${cc[@]}" -o /usr/src/libnvidia-ml.so.1 /usr/src/fakenvml.c
        install -m 0755 "$ROOT/usr/src/libnvidia-ml.so.1" "$g/lib/libnvidia-ml.so.1"
    else
        "${cc[@]}" -o "$g/lib/libnvidia-ml.so.1" "$src"
    fi
    for n in "${NODES[@]}"; do
        python3 -c 'import json, sys
sys.path.insert(0, sys.argv[1])
from gpus import healthy_node
print(json.dumps(healthy_node(sys.argv[2])))' "$REPO/tests" "$n" >"$g/state-$n.json"
    done
    : >"$ETC/gres.conf"
    for n in "${NODES[@]}"; do
        echo "NodeName=$n Name=gpu File=/dev/nvidia[0-3]" >>"$ETC/gres.conf"
        case "$(node_gres "$n")" in
            *shard:8) echo "NodeName=$n Name=shard Count=8" >>"$ETC/gres.conf" ;;
            *mps:400) echo "NodeName=$n Name=mps Count=400 File=/dev/nvidia[0-3]" >>"$ETC/gres.conf" ;;
        esac
    done
    chmod 0644 "$ETC/gres.conf"
}

# Each node's own /dev, made in its mount namespace before slurmd starts, so that its
# GPUs' device files lie where a real node's do and this host's /dev never gets them:
# a small tmpfs (nosuid, as a node's devtmpfs is) holding
#   - what this host's /dev holds: cp -a copies each device node as a node (same
#     numbers, mode and owner), and its mounts (pts, shm) are bound in, as they are;
#   - loop0..255 (block, major 7) for the kernel's squashfs mounts: the kernel adds
#     loop devices to the host's devtmpfs when it needs them, after the copy, and
#     opening a node of one it has not made yet makes it;
#   - the fake GPUs (write_gpus): nvidia0..3 (major 195, the minor their index, as
#     gres.conf's File= and the NVML states say) and nvidiactl (minor 255), 0666 as
#     NVIDIA's driver makes them.  No driver is behind them: an open the job's device
#     cgroup allows fails with ENXIO, one it refuses with EPERM.
# Staged on STAGE (an empty directory) and moved onto DEV, the tree's /dev; for the
# other flavor the rbind of its tree carries it into the root slurmd pivots into.
node_dev() { # STAGE DEV: the shell lines that make it
    printf 'stage=%s dev=%s\n' "$1" "$2"
    cat <<'SH'
mount -t tmpfs -o nosuid,mode=0755,size=64k tfimage-dev "$stage"
cp -a -x "$dev/." "$stage/"
for m in $(findmnt -l -n -o TARGET -R "$dev" | sort -u); do
    case ${m#"$dev"/} in "$m" | */*) ;; *) mount --rbind "$m" "$stage/${m#"$dev"/}" ;; esac
done
i=0
while [ "$i" -lt 256 ]; do
    [ -e "$stage/loop$i" ] || mknod -m 0600 "$stage/loop$i" b 7 "$i"
    i=$((i + 1))
done
for i in 0 1 2 3; do mknod -m 0666 "$stage/nvidia$i" c 195 "$i"; done
mknod -m 0666 "$stage/nvidiactl" c 195 255
mount --move "$stage" "$dev"
SH
}

# The role's inventory and variables: this machine, Slurm's config under $ETC.
write_role_vars() {
    local a=$ETC/ansible wheel src build pipargs=""
    mkdir -p "$a"
    chmod 0700 "$a"
    echo "$FLAVOR" >"$a/flavor"
    if [ -n "$ROOT" ]; then
        wheel=/usr/src/tfimage-src/dist/$(basename "$WHEEL")
        src=/usr/src/tfimage-src
        build=/usr/src/tfimage-spank
        pipargs="--no-index --find-links /usr/src/tfimage-wheels"
    else
        wheel=$WHEEL; src=$REPO; build=$STATE/spank-build
    fi
    printf '[compute]\nlocalhost ansible_connection=local ansible_python_interpreter=/usr/bin/python3 ansible_become=false\n' \
        >"$a/inventory.ini"
    (umask 077; cat >"$a/vars.yml" <<YML
# Written by deploy/local/cluster.sh for deploy/local/role.sh
tfimage_wheel: "$wheel"
tfimage_source_dir: "$src"
tfimage_spank_build_dir: "$build"
tfimage_pip_extra_args: "$pipargs"
tfimage_prefix: $PREFIX
tfimage_slurm_conf_dir: $ETC
tfimage_plugin_dir: $STATE/lib
tfimage_config_dir: $ETC/tfimage
# This machine's own PATH and man pages stay as they are.
tfimage_bin_dir: $STATE/bin
tfimage_man_dir: $STATE/man
# Slurm starts after the role here: nothing to reconfigure.
tfimage_slurm_reconfigure: false
tfimage_registry: "$REGISTRY"
tfimage_project: library
# The local registry stands in for Harbor's Docker Hub proxy cache: docker://ubuntu
# is \$REGISTRY/dockerhub/library/ubuntu, pushed there by the tests.
tfimage_dockerhub_project: dockerhub
tfimage_ca_pem: |
$(sed 's/^/  /' "$STATE/pki/ca.crt")
tfimage_registry_credentials:
  "$REGISTRY":
    username: "$ROBOT"
    password: "$(cat "$STATE/pki/robot.password")"
  "$REGISTRY/$TEAM":
    username: "$TEAM_ROBOT"
    password: "$(cat "$STATE/pki/team-a.password")"
$(mirror_credentials)
$(mirror_role_vars)
$(cloud_role_vars)
# team-a's project is team-a's: only Unix group team-a runs it (TEST_USER is in it,
# TEST_USER2 is not).
tfimage_access: {"$TEAM/*": ["@$TEAM"]}
# prod runs only what can be traced: by digest, from this registry's library/ and
# team-a/, SIF images only; dev runs any image (the debug and all partitions too).
tfimage_partitions:
  prod: {registries: ["$REGISTRY"], repositories: ["library/*", "$TEAM/*"], require_digest: true, allow_conversion: false}
  dev: {}
  train: {default_image: "tiny:1.0"}
# ...checked at submit too (cli_filter/lua: -p and #SBATCH -p, which SPANK never sees).
tfimage_cli_filter: true
tfimage_runtime: charliecloud
tfimage_cache_dir: /var/cache/tfimage
# The controller's one pull per multi-node job (TFIMAGE_STAGE=0: off), its staging
# cache emptied with the controller's state (start_slurm).
tfimage_stage: $([ "$STAGE_ON" = 0 ] && echo false || echo true)
tfimage_stage_dir: $STATE/stage
# This machine is slurmctld's host too: the compute pass wires the stage hook.
tfimage_controller: true
tfimage_state_dir: /run/tfimage
# The seed's default mount, with the site's data at $STATE/data standing in for /data
# (the fake GPUs' device files need none: they are in the node's /dev, which ch-run binds)
tfimage_default_binds: ["$STATE/data:/mnt"]
tfimage_bind_prefixes: [/home, /data, "$STATE/data"]
tfimage_maintenance: cron
# Each node's usage log is its own /var/log/tfimage (start_slurm binds it), and so is
# node_exporter's textfile directory: \$STATE/nodes/NODE/log and .../metrics here.
tfimage_logrotate_dir: $ETC/logrotate.d
# The fake GPUs' kernel log, and their driver for charliecloud steps (write_gpus)
tfimage_gpu: {kmsg: "$STATE/gpu/kmsg", driver_libs: ["$STATE/gpu/lib/libnvidia-ml.so.1"], shared: [n1]}
# The role's HealthCheckProgram, run by test_gpus.py as slurmd runs it (interval 0:
# never on its own, so that no test's GPU state is judged behind its back).
tfimage_gpu_health_check: true
tfimage_gpu_health_check_interval: 0
tfimage_gpu_health_check_env: {LD_LIBRARY_PATH: "$STATE/gpu/lib"}
YML
    )
}

deploy_role() {
    local t0=$SECONDS
    bash "$REPO/deploy/local/role.sh" apply >"$LOGS/ansible.log" 2>&1 \
        || { tail -40 "$LOGS/ansible.log" >&2; die "the Ansible role failed (log: $LOGS/ansible.log)"; }
    log "role applied in $((SECONDS - t0)) s: $(grep -E '^localhost +:' "$LOGS/ansible.log" | tr -s ' ')"
}

# The node's tfimage daemon (what the role's systemd unit runs on a real node), in
# the node's own namespaces: its /run/tfimage, its /opt/tfimage.  Stopped with the
# node (kill_ns_procs).  TFIMAGE_DAEMON=0 leaves it out: the plugin then runs the
# helper for every step, as on a node where the daemon is down.
start_daemon() { # NODE [DAEMON ARGS...]
    local n=$1
    shift
    [ "${TFIMAGE_DAEMON:-1}" = 1 ] || return 0
    DAEMON_ARGS=("$@")
    run_daemon "$n" "the tfimage daemon on $n" nsenter -t "$(cat "$RUN/slurmd-$n.pid")" -m -u -n --
}

# The login node's daemon (this host, or the other Slurm's tree): srun, sbatch and
# salloc here pin through its pin socket instead of starting Python.
# TFIMAGE_DAEMON=0 leaves it out too.
start_login_daemon() { # [DAEMON ARGS...]
    local pre=() args=("$@")
    [ "${TFIMAGE_DAEMON:-1}" = 1 ] || return 0
    [ -z "$ROOT" ] || pre=(chroot "$ROOT")
    stop_pid "$RUN/daemon-login.pid"
    mkdir -p "$ROOT/run/tfimage"
    DAEMON_ARGS=("${args[@]}")
    run_daemon login "the login node's tfimage daemon" "${pre[@]}"
}

# run_daemon NAME WHAT [PREFIX...]: `tfimage daemon ${DAEMON_ARGS[@]}` under PREFIX
# (nsenter, chroot), logged to daemon-NAME.log, its pid in daemon-NAME.pid; waits
# until it listens.
run_daemon() {
    local name=$1 what=$2
    shift 2
    : >"$LOGS/daemon-$name.log"
    env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin SLURM_CONF="$ETC/slurm.conf" \
        LD_LIBRARY_PATH="$STATE/gpu/lib" setsid "$@" \
        "$PREFIX/bin/tfimage" --config "$ETC/tfimage/config.yaml" daemon "${DAEMON_ARGS[@]}" \
        >>"$LOGS/daemon-$name.log" 2>&1 </dev/null &
    echo $! >"$RUN/daemon-$name.pid"
    for _ in $(seq 100); do
        grep -q "daemon pinning" "$LOGS/daemon-$name.log" 2>/dev/null && return 0
        sleep 0.1
    done
    tail -5 "$LOGS/daemon-$name.log" >&2
    die "$what did not start"
}

# start_node NODE: its slurmd, in the namespaces node_network made, and its daemon.
start_node() {
    local n=$1
    local nd=$STATE/nodes/$n
    # node_exporter's textfile directory: this cluster's metrics alone
    rm -rf "$nd/metrics"
    mkdir -p "$STATE/spool/$n" "$nd/cache" "$nd/run" "$nd/log" "$nd/metrics" "$nd/dev"
    # As the role makes it: the controller's sbcast writes there as the job's user.
    mkdir -p "$nd/cache/staged"
    chown root:root "$nd/cache/staged"
    chmod 1733 "$nd/cache/staged"
    # Own network, hostname and mounts: cache, /run state and /dev (with the
    # node's GPUs: node_dev) really are per node.
    : >"$LOGS/slurmd-$n.log"
    # In the foreground under setsid: nsenter, unshare and sh all exec, so $! is
    # slurmd itself, known at once whatever the Slurm version does with pid files.
    # A step that fails stops it there: no slurmd on a half-made node.
    local script="set -e
hostname $n
$(node_dev "$nd/dev" "$ROOT/dev")
mount --bind $nd/cache $ROOT/var/cache/tfimage
mount -t tmpfs -o mode=0755 tmpfs $ROOT/run/tfimage
mount --bind $nd/log $ROOT/var/log/tfimage
mount --bind $nd/metrics $ROOT/var/lib/prometheus/node-exporter"
    case "$n" in c[0-9]*)  # a cloud node (cloud.sh): tfimage from its image, and the
        # site's images before it registers
        script+="
$(cloud_image_mounts "$nd")
$PREFIX/bin/tfimage --config $ETC/tfimage/config.yaml cache warm >>$LOGS/power.log 2>&1 \\
    || echo 'warm: $n: some kept images could not be fetched; the jobs pull them' >>$LOGS/power.log" ;;
    esac
    if [ -n "$ROOT" ]; then
        # The other Slurm's tree becomes the real root of this node's mount
        # namespace (pivot_root, not chroot): the kernel refuses user namespaces,
        # which ch-run needs, to a chrooted process.
        script+="
mount --rbind $ROOT $ROOT
cd $ROOT
pivot_root . .oldroot
exec chroot . sh -c 'umount -l /.oldroot && exec slurmd -D -N $n'"
    else
        script+="
exec slurmd -D -N $n"
    fi
    # A cloud node boots when resumed: slurmctld takes its registration only with a
    # boot time after the resume request ("Still waiting for boot of node"), so it
    # gets a clock of its own that booted just now (a time namespace; unshare then
    # forks, and takes slurmd with it).
    local boot=()
    case "$n" in c[0-9]*) boot=(--time --boottime "-$(cut -d. -f1 /proc/uptime)" --kill-child) ;; esac
    SLURM_CONF=$ETC/slurm.conf LD_LIBRARY_PATH=$STATE/gpu/lib setsid nsenter --net="/run/netns/$n" \
        unshare --uts --mount --propagation private "${boot[@]}" sh -c "$script" \
        >>"$LOGS/slurmd-$n.out" 2>&1 </dev/null &
    echo $! >"$RUN/slurmd-$n.pid"
    for _ in $(seq 100); do
        grep -q "slurmd version .* started" "$LOGS/slurmd-$n.log" 2>/dev/null && break
        alive "$RUN/slurmd-$n.pid" || break
        sleep 0.1
    done
    alive "$RUN/slurmd-$n.pid" || {
        tail -n 5 "$LOGS/slurmd-$n.out" "$LOGS/slurmd-$n.log" >&2
        die "slurmd $n did not start"
    }
    local ns
    ns=$(readlink "/proc/$(cat "$RUN/slurmd-$n.pid")/ns/mnt")
    [ "$ns" != "$(readlink /proc/self/ns/mnt)" ] || die "slurmd $n is not in a mount namespace of its own"
    echo "$ns" >"$RUN/$n.mntns"
    start_daemon "$n"
}

# restart_slurmd NODE: slurmd again in the node's namespaces after it died, as
# systemd's Restart= would (the node's other processes, its daemon or its jobs'
# steps, keep its mount namespace; with none left, only `up` can make it again).
restart_slurmd() {
    local n=$1 ns holder="" p
    ! running "$RUN/slurmd-$n.pid" || die "slurmd $n is running"
    ns=$(cat "$RUN/$n.mntns")
    for p in /proc/[0-9]*; do
        [ "$(readlink "$p/ns/mnt" 2>/dev/null)" = "$ns" ] || continue
        holder=${p#/proc/}
        break
    done
    [ -n "$holder" ] || die "node $n has no process left in its namespaces: cluster.sh up"
    SLURM_CONF=$ETC/slurm.conf LD_LIBRARY_PATH=$STATE/gpu/lib setsid nsenter -t "$holder" -m -u -n -- \
        slurmd -D -N "$n" >>"$LOGS/slurmd-$n.out" 2>&1 </dev/null &
    echo $! >"$RUN/slurmd-$n.pid"
    sleep 0.5
    alive "$RUN/slurmd-$n.pid" || { tail -n 5 "$LOGS/slurmd-$n.out" >&2; die "slurmd $n did not start again"; }
}

start_slurm() {
    # A fresh controller state each time: the two Slurm generations write it differently.
    # Job ids start again at 1 with a fresh slurmctld state: the nodes' spools must go
    # too, or a slurmd that remembers job 4's credential from the last cluster skips
    # the new job 4's prolog ("reissued job credential for job 4").
    rm -rf "$STATE/ctld" "$STATE/spool"
    # The staging cache's contents go with the controller's state; the directory is
    # the role's (root's, 0700), made before this runs.
    [ ! -d "$STATE/stage" ] || find "$STATE/stage" -mindepth 1 -delete
    mkdir -p "$STATE/ctld" "$ROOT/var/cache/tfimage" "$ROOT/run/tfimage" "$ROOT/var/log/tfimage" \
        "$ROOT/var/lib/prometheus/node-exporter"
    start_accounting
    SLURM_CONF=$ETC/slurm.conf in_root slurmctld -i \
        || die "slurmctld did not start: $(tail -1 "$LOGS/slurmctld.log" 2>/dev/null)"
    for n in "${NODES[@]}"; do start_node "$n"; done
    export SLURM_CONF=$ETC/slurm.conf
    for _ in $(seq 150); do
        # The on-premises nodes: cloud ones stay powered down (idle~) until a job.
        if [ "$(in_root sinfo -h -n "$(IFS=,; echo "${NODES[*]}")" -o '%t' 2>/dev/null \
            | sort -u | tr -d '\n')" = idle ]; then
            return 0
        fi
        sleep 0.2
    done
    in_root sinfo >&2 || true
    die "nodes did not become idle"
}

push_images() {
    local out=$REPO/build/images
    bash "$REPO/deploy/local/images/build.sh" "$out"
    export TFIMAGE_CONFIG=$ETC/tfimage/config.yaml
    "$PREFIX/bin/tfimage" push "$out/tiny.sif" "tiny:1.0" >/dev/null
    "$PREFIX/bin/tfimage" push "$out/team-a-tiny.sif" "$TEAM/tiny:1.0" >/dev/null
    "$PREFIX/bin/tfimage" push "$out/tf-custom.sif" "tf-custom:2.0" >/dev/null
}

write_env() {
    mkdir -p "$(dirname "$ENV_FILE")"
    cat >"$ENV_FILE" <<ENV
export SLURM_CONF=$ETC/slurm.conf
export TFIMAGE_CONFIG=$ETC/tfimage/config.yaml
export TFIMAGE_REGISTRY=$REGISTRY
export TFIMAGE_TEST_USER=$TEST_USER
export TFIMAGE_TEST_USER2=$TEST_USER2
export TFIMAGE_LOCAL_STATE=$STATE
export TFIMAGE_CA=$ETC/tfimage/ca.pem
export PATH=$PREFIX/bin:\$PATH
export TFIMAGE_SLURM_FLAVOR=$FLAVOR
export TFIMAGE_CHROOT=$ROOT
export TFIMAGE_NODE_NAMES="${NODES[*]}"
export TFIMAGE_REGISTRY_RATE=$REGISTRY_RATE
export TFIMAGE_STAGE=$([ "$STAGE_ON" = 0 ] && echo 0 || echo 1)
export TFIMAGE_MIRROR=$([ "$MIRROR_ON" = 1 ] && echo "$MIRROR" || true)
export TFIMAGE_MIRROR_NODES=$([ "$MIRROR_ON" = 1 ] && [ "$NODE_COUNT" -ge 4 ] && mirror_nodes || true)
export TFIMAGE_REGION=$([ "$BURST_COUNT" = 0 ] || echo "$REGION")
export TFIMAGE_BURST_NODES="$(burst_nodes | tr '\n' ' ' | sed 's/ $//')"
ENV
}

up() {
    [ "$(id -u)" = 0 ] || die "run as root"
    bash "$REPO/deploy/local/packages.sh"
    down || true  # its log says what it had to kill
    mkdir -p "$STATE" "$ETC" "$RUN" "$LOGS"
    chmod 0755 "$STATE" "$ETC"
    setup_user
    setup_network
    case "$FLAVOR" in
        host) ;;
        other) setup_root ;;
        *) die "SLURM_FLAVOR must be host or other, not '$FLAVOR'" ;;
    esac
    start_munge
    make_pki
    start_registry
    install_tfimage
    write_site
    write_power_programs
    write_role_vars
    deploy_role
    # Beside the rest: nothing resumes a cloud node before up has returned.
    bake_cloud_image &
    local bake=$!
    start_slurm
    start_login_daemon
    push_images
    wait "$bake" || die "the cloud image was not baked"
    write_env
    log "up: slurm $(SLURM_CONF=$ETC/slurm.conf in_root sinfo -V | awk '{print $2}') ($FLAVOR)," \
        "nodes ${NODES[*]}, registry $REGISTRY"
    log "environment: . $ENV_FILE"
}

status() {
    local was
    mapfile -t was < <(up_nodes)
    for f in munged registry proxy mirror region mariadb slurmdbd slurmctld daemon-login "${was[@]/#/slurmd-}"; do
        if alive "$RUN/$f.pid"; then echo "$f: running"; else echo "$f: stopped"; fi
    done
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    slurmdbd)  # stop|start the running cluster's slurmdbd (accounting.sh), as an
        # outage of the accounting database's host would
        [ ! -f "$RUN/chroot.root" ] || ROOT=$(cat "$RUN/chroot.root")
        case "${2:-}" in
            stop) stop_slurmdbd ;;
            start) start_slurmdbd ;;
            *) echo "usage: cluster.sh slurmdbd stop|start" >&2; exit 2 ;;
        esac ;;
    resume|suspend)  # HOSTLIST: Slurm's ResumeProgram and SuspendProgram (cloud.sh)
        [ ! -f "$RUN/chroot.root" ] || ROOT=$(cat "$RUN/chroot.root")
        "${1}_nodes" "${2:?hostlist}" ;;
    mirror)  # stop|start the running cluster's rack mirror (mirror.sh), as a
        # rack switch's failure would
        case "${2:-}" in
            stop) stop_mirror ;;
            start) NODE_COUNT=$(wc -l <"$RUN/nodes") MIRROR_ON=1 start_mirror ;;
            *) echo "usage: cluster.sh mirror stop|start" >&2; exit 2 ;;
        esac ;;
    registry)  # stop|start the running cluster's registry process (its fronts stay
        # up), as a crash and a service manager's restart would
        case "${2:-}" in
            stop) stop_pid "$RUN/registry.pid" ;;
            start) run_registry ;;
            *) echo "usage: cluster.sh registry stop|start" >&2; exit 2 ;;
        esac ;;
    slurmd)  # NODE: start the node's slurmd again after it died (restart_slurmd;
        # in the other flavor its mount namespace's root is that Slurm's tree already)
        restart_slurmd "${2:?node}" ;;
    daemon)  # (re)start one node's tfimage daemon, or the login node's, with any
        # further arguments for `tfimage daemon` (e.g. --trace FILE).
        # In the running cluster's tree, whatever SLURM_FLAVOR says now.
        [ ! -f "$RUN/chroot.root" ] || ROOT=$(cat "$RUN/chroot.root")
        if [ "${2:?node}" = login ]; then start_login_daemon "${@:3}"; else start_daemon "$2" "${@:3}"; fi ;;
    *) echo "usage: cluster.sh up|down|status|daemon NODE|login [DAEMON ARGS...]|slurmd NODE|registry stop|start|slurmdbd stop|start|mirror stop|start|resume|suspend HOSTLIST" >&2; exit 2 ;;
esac

# shellcheck shell=bash
# The local cluster's cloud nodes, the way Slurm bursts: TFIMAGE_BURST=N adds c1..cN,
# State=CLOUD in partition `burst`.  slurmctld runs ResumeProgram when a job needs
# them and SuspendProgram when they have been idle SuspendTime seconds; the
# on-premises nodes are never suspended (SuspendExcNodes).  Sourced by cluster.sh.
#
#   resume c1     a fresh network namespace and slurmd for c1, its cache empty, its
#                 tfimage from the cloud image the role baked (below); its first
#                 mirror is the region's ($REGION, mirror.sh's second instance)
#   suspend c1    slurmd stopped, the namespace gone, and its cache with it, as a
#                 cloud instance's disk goes
#
# Both take Slurm's hostlist, log to $LOGS/power.log, and are safe to call twice or
# for a node already in the state asked.  A file $STATE/cloud/fail-NODE makes the
# resume of NODE fail, as a cloud that has no capacity would (the tests' switch).

BURST_COUNT=${TFIMAGE_BURST:-0}  # checked by cluster.sh
# Short here, for the tests; a site's is minutes (a cloud bills by the hour).
SUSPEND_TIME=${TFIMAGE_SUSPEND_TIME:-10}
RESUME_TIMEOUT=${TFIMAGE_RESUME_TIMEOUT:-30}
# The cloud region's registry replica: a pull-through mirror of its own (mirror.sh),
# so that a burst of B nodes costs the site's registry one copy of an image, and
# the rack mirror none.
REGION=$CTL_ADDR:5447
REGION_UPSTREAM=127.0.0.1:5448

burst_nodes() {
    local i
    for ((i = 1; i <= BURST_COUNT; i++)); do echo "c$i"; done
}

burst_hostlist() {
    if [ "$BURST_COUNT" = 1 ]; then echo c1; else echo "c[1-$BURST_COUNT]"; fi
}

# slurm.conf's power saving lines and the cloud nodes (nothing without them).
slurm_conf_cloud() {
    [ "$BURST_COUNT" -gt 0 ] || return 0
    local n
    cat <<CONF
# Cloud nodes (deploy/local/cloud.sh): resumed for a job, suspended when idle.
ResumeProgram=$STATE/bin/tfimage-resume
SuspendProgram=$STATE/bin/tfimage-suspend
SuspendTime=$SUSPEND_TIME
SuspendTimeout=30
ResumeTimeout=$RESUME_TIMEOUT
SuspendExcNodes=$(IFS=,; echo "${NODES[*]}")
# Powered-down cloud nodes in sinfo and scontrol (22.05 hides them otherwise).
PrivateData=cloud
CONF
    for n in $(burst_nodes); do
        echo "NodeName=$n NodeAddr=$(node_addr "$n") CPUs=4 RealMemory=4000 State=CLOUD"
    done
    echo "PartitionName=burst Nodes=$(burst_hostlist) MaxTime=INFINITE State=UP OverSubscribe=YES"
}

start_region() {
    [ "$BURST_COUNT" -gt 0 ] || return 0
    start_pull_through region "$REGION" "$REGION_UPSTREAM" "region mirror"
}

stop_region() { stop_pull_through region; }

# The programs slurmctld runs: a clean environment, this harness, one log.
write_power_programs() {
    [ "$BURST_COUNT" -gt 0 ] || return 0
    mkdir -p "$STATE/bin" "$STATE/cloud"
    rm -f "$STATE/cloud"/fail-*
    local what
    for what in resume suspend; do
        cat >"$STATE/bin/tfimage-$what" <<SH
#!/bin/sh
# Slurm's $(echo "${what:0:1}" | tr a-z A-Z)${what:1}Program for the local cluster's cloud nodes (deploy/local/cloud.sh).
exec env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin TFIMAGE_LOCAL_STATE=$STATE \\
    bash $REPO/deploy/local/cluster.sh $what "\$1" >>$LOGS/power.log 2>&1
SH
        chmod 0755 "$STATE/bin/tfimage-$what"
    done
}

# The cloud image: what a site bakes once (Packer, or its cloud's image builder) with
# the role its other nodes get, and every cloud node boots from.  Here the role runs
# in a mount namespace of its own where tfimage's prefix, its config directory, the
# plugin's directory and its build directory are the image's, empty at first: the
# image has nothing of the on-premises nodes' install.  Resuming a node copies the
# image onto its disk ($STATE/nodes/NODE/image), which start_node mounts over those
# paths in the node's own mount namespace.
# Each of the image's directories, and the path it stands in for.
declare -A CLOUD_IMAGE=([prefix]=$PREFIX [config]=$ETC/tfimage [plugin]=$STATE/lib
    [build]=$STATE/spank-build)

bake_cloud_image() {
    [ "$BURST_COUNT" -gt 0 ] || return 0
    local img=$STATE/cloud/image t0=$SECONDS d mounts=""
    rm -rf "$img"
    for d in "${!CLOUD_IMAGE[@]}"; do
        mkdir -p "$img/$d" "${CLOUD_IMAGE[$d]}"
        mounts+="mount --bind $img/$d ${CLOUD_IMAGE[$d]}; "
    done
    unshare --mount --propagation private sh -ec "${mounts}exec bash $REPO/deploy/local/role.sh apply" \
        >"$LOGS/cloud-image.log" 2>&1 </dev/null \
        || { tail -40 "$LOGS/cloud-image.log" >&2; die "baking the cloud image failed (log: $LOGS/cloud-image.log)"; }
    [ -x "$img/prefix/bin/tfimage" ] && [ -f "$img/plugin/spank_tfimage.so" ] \
        || die "the cloud image has no tfimage or no plugin (log: $LOGS/cloud-image.log)"
    log "cloud image baked by the role in $((SECONDS - t0)) s: $(grep -E '^localhost +:' "$LOGS/cloud-image.log" | tr -s ' ')"
}

# start_node's lines for a cloud node: its copy of the image over the paths it
# stands in for (a plugin file at a time: the site's plugins stay beside it).
cloud_image_mounts() { # NODE_DIR
    local nd=$1 d f
    for d in "${!CLOUD_IMAGE[@]}"; do
        case "$d" in
            build) ;;  # only the bake builds
            plugin)
                for f in "$nd/image/plugin"/*; do
                    echo "mount --bind $f ${CLOUD_IMAGE[$d]}/${f##*/}"
                done ;;
            *) echo "mount --bind $nd/image/$d ${CLOUD_IMAGE[$d]}" ;;
        esac
    done
}

# The role's line for them: what a new cloud node warms before it takes jobs.
cloud_role_vars() {
    [ "$BURST_COUNT" -gt 0 ] || return 0
    echo 'tfimage_keep_images: ["tiny:1.0"]'
}

power_log() { printf '%s %s\n' "$(date -u +%FT%TZ)" "$*"; }

resume_nodes() { # HOSTLIST
    local n status=0
    for n in $(SLURM_CONF=$ETC/slurm.conf in_root scontrol show hostnames "$1"); do
        case "$n" in c[0-9]*) ;; *) power_log "resume $n: not a cloud node; left alone"; continue ;; esac
        if alive "$RUN/slurmd-$n.pid"; then
            power_log "resume $n: already up"
            continue
        fi
        if [ -e "$STATE/cloud/fail-$n" ]; then
            power_log "resume $n: the cloud has no capacity ($STATE/cloud/fail-$n)"
            status=1
            continue
        fi
        local started=$SECONDS
        # An instance boots after it is asked for: slurmctld compares the two to
        # the second (cluster.sh's start_node gives it a clock that boots now).
        sleep 2
        if ! ip netns list | grep -qw "^$n"; then
            (node_network "$n") || { power_log "resume $n: no network"; status=1; continue; }
        fi
        # A new instance's disk: nothing cached, nothing kept, tfimage as the image has it.
        rm -rf "$STATE/nodes/$n/cache" "$STATE/nodes/$n/image"
        mkdir -p "$STATE/nodes/$n/image"
        cp -a "$STATE/cloud/image/prefix" "$STATE/cloud/image/config" "$STATE/cloud/image/plugin" \
            "$STATE/nodes/$n/image/" \
            || { power_log "resume $n: its disk could not be made"; status=1; continue; }
        (start_node "$n") || { power_log "resume $n: slurmd did not start"; status=1; continue; }
        power_log "resume $n: up in $((SECONDS - started)) s"
    done
    exit "$status"  # the whole command's status: slurmctld logs it
}

suspend_nodes() { # HOSTLIST
    local n
    for n in $(SLURM_CONF=$ETC/slurm.conf in_root scontrol show hostnames "$1"); do
        case "$n" in c[0-9]*) ;; *) power_log "suspend $n: not a cloud node; left alone"; continue ;; esac
        if ! alive "$RUN/slurmd-$n.pid" && ! ip netns list | grep -qw "^$n"; then
            power_log "suspend $n: already down"
            continue
        fi
        stop_pid "$RUN/daemon-$n.pid"
        stop_pid "$RUN/slurmd-$n.pid"
        kill_ns_procs "$n"
        node_network_gone "$n"
        # Its disk goes with the instance.
        rm -rf "$STATE/nodes/$n/cache" "$STATE/nodes/$n/image"
        power_log "suspend $n: down, its cache removed"
    done
}

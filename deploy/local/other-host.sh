#!/usr/bin/env bash
# The other Debian generation as a whole host: the README's two commands, run as a
# new user runs them, on the generation this machine is not (Debian 12 <-> 13).
#
#   other-host.sh run     a fresh copy of that generation's root filesystem, entered
#                         with its own mount and PID namespaces and pivot_root, the
#                         network being this machine's.  Inside, from a fresh `git
#                         clone` of this repository's HEAD: `bash deploy/local/demo.sh`,
#                         then `bash tests/run-all.sh` on that host's own Slurm
#                         (SLURM_FLAVOR=host).  Its last line is the summary, also in
#                         build/other-host/summary.txt; logs in build/other-host/.
#   other-host.sh root    print the cached root's path, building it if needed
#   other-host.sh clean   remove the cached roots and the caches shared across runs
#
# The other host's cluster has the same bridge, veth and address names as this
# machine's, in the same network namespace: this machine's cluster is stopped first.
# Where several people share a machine, take turns as for cluster.sh (e.g. flock
# /var/lock/tfimage-cluster.lock bash deploy/local/other-host.sh run).
#
# The root is debootstrap --variant=minbase with git, python3, python3-venv, make, gcc
# and ca-certificates, and the sources a Debian install has (main, updates,
# security); it is cached under /var/cache/tfimage-build, keyed by that list, and
# copied for each run, so every run starts from the same fresh machine.  Shared with
# earlier runs are downloads (apt's .deb archive and pip's cache) and that host's own
# image build cache (its /var/cache/tfimage-build, keyed by recipe as on any machine),
# as a CI machine of that generation keeps them: a warm run does not build its
# TensorFlow image again, and with this machine's cache emptied, it does.
#
# Nothing is left behind: the PID namespace takes every process with it when the run
# ends, however it ends (unshare --kill-child), its mounts go with its mount
# namespace, and the other host's `cluster.sh down` runs before it is left; what it
# would still leave (processes, mounts, the bridge or a veth) is listed and fails the
# run.
#
#   TFIMAGE_OTHER_HOST_STEPS    what runs inside: "demo tests" (default), or one of them;
#                               "soak" brings its cluster up and runs the short soak
#                               alone (tests/cluster/test_soak.py), its logs kept;
#                               "reverse" also runs this script from inside, towards this
#                               machine's generation (what a machine of the other runs)
#   TFIMAGE_OTHER_HOST_FLAVORS  the Slurm flavors of the cluster tier inside ("host";
#                               "host other" also runs this generation's Slurm there)
#   TFIMAGE_OTHER_HOST_TIMEOUT  seconds before the whole inner run is killed (1800;
#                               it takes about 10 min on 2 cores)
#   TFIMAGE_OTHER_HOST_KEEP=1   keep the run's copy of the root, to look at it after
#   TFIMAGE_STRICT=1            strict mode inside too (run-all.sh sets it for CI): the
#                               inner run is otherwise started with an empty environment
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# shellcheck source=deploy/local/err-trap.sh
. "$REPO/deploy/local/err-trap.sh" other-host
# shellcheck source=deploy/local/other-release.sh
. "$REPO/deploy/local/other-release.sh"
SECURITY=${TFIMAGE_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
PKGS="git,python3,python3-venv,make,gcc,ca-certificates"
KEY=$(printf '%s\n' 1 "$OTHER" "$MIRROR" "$SECURITY" "$PKGS" | sha256sum | cut -c1-12)
ROOT=$CACHE/host-$OTHER-$KEY
RUNROOT=$CACHE/other-host-run
HARNESS=/usr/local/lib/tfimage-other-host
DEBS=$CACHE/other-host-debs-$OTHER
PIPCACHE=$CACHE/other-host-pip
BUILDCACHE=$CACHE/other-host-build-$OTHER
OUT=$REPO/build/other-host
STEPS=${TFIMAGE_OTHER_HOST_STEPS:-demo tests}
FLAVORS=${TFIMAGE_OTHER_HOST_FLAVORS:-host}
LIMIT=${TFIMAGE_OTHER_HOST_TIMEOUT:-1800}
# The local cluster's names in the shared network namespace (cluster.sh).
LINKS=(tfbr0 veth-n1 veth-n2)

log() { printf 'other-host: %s\n' "$*" >&2; }
die() { printf 'other-host: error: %s\n' "$*" >&2; exit 1; }

debian_number() { case $1 in bookworm) echo 12 ;; trixie) echo 13 ;; *) echo "$1" ;; esac; }
OTHER_NAME="Debian $(debian_number "$OTHER") ($OTHER)"

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
}

# ------------------------------------------------------------------------- the root

build_root() {
    [ -f "$ROOT/.complete" ] && return 0
    local t0=$SECONDS log=$CACHE/debootstrap-host-$OTHER.log
    log "debootstrap $OTHER_NAME: minbase with ${PKGS//,/, } into $ROOT (once; cached)"
    mkdir -p "$CACHE"
    rm -rf "$ROOT"
    debootstrap --variant=minbase --include="$PKGS" "$OTHER" "$ROOT" "$MIRROR" >"$log" 2>&1 \
        || { tail -20 "$log" >&2; die "debootstrap of $OTHER failed (log: $log)"; }
    # The sources an installed Debian has; debootstrap writes only the release's main.
    rm -f "$ROOT/etc/apt/sources.list"
    cat >"$ROOT/etc/apt/sources.list.d/debian.sources" <<SRC
Types: deb
URIs: $MIRROR
Suites: $OTHER $OTHER-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY
Suites: $OTHER-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
    touch "$ROOT/.complete"
    # Roots of an older package list are of no use any more.
    local old
    for old in "$CACHE"/host-"$OTHER"-*; do
        [ "$old" = "$ROOT" ] || [ ! -d "$old" ] || rm -rf "$old"
    done
    log "$OTHER_NAME root built in $((SECONDS - t0)) s"
}

# ------------------------------------------------------------- what must not remain

links_left() { # the cluster's links in this network namespace
    local l
    for l in "${LINKS[@]}"; do ip link show "$l" >/dev/null 2>&1 && echo "$l"; done
    return 0
}

mounts_under() { # DIR: mount points at or below DIR in this mount namespace
    awk -v d="$1" '$5 == d || index($5, d "/") == 1 {print $5}' /proc/self/mountinfo
}

# This machine's cluster would share the other host's names: stop it first.
stop_local_cluster() {
    if [ -n "$(links_left)" ] || [ -f "$REPO/build/cluster.env" ]; then
        log "stopping this machine's local cluster (the other host's uses the same names)"
    fi
    bash "$REPO/deploy/local/cluster.sh" down 2>&1 | sed 's/^/other-host: /' >&2
    [ -z "$(links_left)" ] || die "this machine's cluster left $(links_left | xargs) behind"
}

remove_run_root() {
    [ -d "$RUNROOT" ] || return 0
    [ -z "$(mounts_under "$RUNROOT")" ] || die "still mounted under $RUNROOT: $(mounts_under "$RUNROOT" | xargs)"
    rm -rf "$RUNROOT"
}

# After the run, however it ended.  Whatever is found is removed, and named: the
# other host's own `cluster.sh down` should have left nothing.
LEFT=()
sweep() {
    local l m
    # A netns dies with its last process and mount, and its veth with it, but not at
    # once: give the kernel a moment.
    for _ in $(seq 50); do [ -z "$(links_left)" ] && break; sleep 0.1; done
    for l in $(links_left); do
        LEFT+=("link $l")
        ip link del "$l" 2>/dev/null || true
    done
    for m in $(mounts_under "$RUNROOT" | sort -r); do
        LEFT+=("mount $m")
        umount -l "$m" 2>/dev/null || true
    done
}

# -------------------------------------------------------------------------- the run

prepare() { # a fresh machine: the cached root copied, a fresh clone of HEAD in /root
    local t0=$SECONDS head branch dest=$RUNROOT/root/tfimage
    remove_run_root
    mkdir -p "$RUNROOT"
    cp -a "$ROOT/." "$RUNROOT/"
    rm -f "$RUNROOT/.complete"
    head=$(git -C "$REPO" rev-parse HEAD)
    branch=$(git -C "$REPO" symbolic-ref -q --short HEAD || true)
    git clone -q --no-hardlinks ${branch:+-b "$branch"} "$REPO" "$dest"
    # HEAD itself, even when detached or when the branch moved since.
    if [ "$(git -C "$dest" rev-parse HEAD)" != "$head" ]; then
        git -C "$dest" fetch -q origin "$head"
        git -C "$dest" checkout -q --detach "$head"
    fi
    if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no)" ]; then
        log "note: this working tree has uncommitted changes; the other host runs HEAD ($(git -C "$REPO" log --oneline -1 HEAD))"
    fi
    # What an installed machine has and a debootstrap root lacks.
    cat /etc/resolv.conf >"$RUNROOT/etc/resolv.conf"
    hostname >"$RUNROOT/etc/hostname"
    printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' \
        "$(hostname)" >"$RUNROOT/etc/hosts"
    # This machine's CA bundle, so pip there reaches the index as pip here does.
    mkdir -p "$RUNROOT/usr/local/share/tfimage"
    cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$RUNROOT/usr/local/share/tfimage/host-ca.pem"
    mkdir -p "$DEBS/partial" "$PIPCACHE" "$BUILDCACHE" "$RUNROOT/root/.cache/pip" \
        "$RUNROOT/var/cache/apt/archives" "$RUNROOT/var/cache/tfimage-build"
    # This script, for its part inside (the harness, not what is tested: that is the clone).
    mkdir -p "$RUNROOT$HARNESS/deploy/local"
    cp "$REPO/deploy/local/other-host.sh" "$REPO/deploy/local/err-trap.sh" \
        "$REPO/deploy/local/other-release.sh" "$RUNROOT$HARNESS/deploy/local/"
    log "fresh $OTHER_NAME machine ready in $((SECONDS - t0)) s: clone of $(git -C "$dest" log --oneline -1)"
}

# PID 1 of the new mount and PID namespaces: the kernel filesystems, the shared
# download caches, then pivot_root into the copy.  Not chroot: the kernel refuses
# user namespaces, which ch-run needs, to a chrooted process.
enter() {
    local new=$RUNROOT
    mount --bind "$new" "$new"
    mount -t proc -o nosuid,nodev,noexec proc "$new/proc"
    mount --rbind /sys "$new/sys"
    mount --rbind /dev "$new/dev"
    mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs "$new/dev/shm"
    mount -t tmpfs -o nosuid,nodev,mode=0755 tmpfs "$new/run"
    # /tmp as each generation has it: a tmpfs on Debian 13, the root's disk on 12.
    if [ "$OTHER" = trixie ]; then
        mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs "$new/tmp"
    fi
    mount --bind "$DEBS" "$new/var/cache/apt/archives"
    mount --bind "$PIPCACHE" "$new/root/.cache/pip"
    mount --bind "$BUILDCACHE" "$new/var/cache/tfimage-build"
    cd "$new"
    mkdir -p oldroot
    pivot_root . oldroot
    cd /
    umount -l /oldroot
    rmdir /oldroot
    local pass=() v
    # TFIMAGE_STRICT: a CI run's skip budget holds inside too (tests/skipbudget.py).
    for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY PIP_DEFAULT_TIMEOUT \
        TFIMAGE_DEBIAN_MIRROR TFIMAGE_DEBIAN_SECURITY_MIRROR TFIMAGE_STRICT; do
        [ -z "${!v:-}" ] || pass+=("$v=${!v}")
    done
    exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
        PIP_CERT=/usr/local/share/tfimage/host-ca.pem "${pass[@]}" \
        TFIMAGE_OTHER_HOST_STEPS="$STEPS" TFIMAGE_OTHER_HOST_FLAVORS="$FLAVORS" \
        bash "$HARNESS/deploy/local/other-host.sh" inside
}

# Inside the other host, as PID 1, in /root/tfimage: what a new user runs.
inside() {
    local logs=/root/other-host-logs rc=0 t0 step
    mkdir -p "$logs"
    awk '{print $5}' /proc/self/mountinfo | sort >"$logs/mounts.before"
    local this
    this="Debian $(. /etc/os-release && echo "$VERSION_ID ($VERSION_CODENAME)")"
    echo "host=$this" >"$logs/result"
    trap inside_down EXIT
    cd /root/tfimage
    for step in $STEPS; do
        t0=$SECONDS
        case $step in
            demo)
                printf '\n=== %s: bash deploy/local/demo.sh\n' "$this"
                bash deploy/local/demo.sh 2>&1 | tee "$logs/demo.log" || rc=${PIPESTATUS[0]} ;;
            tests)
                printf '\n=== %s: bash tests/run-all.sh (SLURM_FLAVOR=%s)\n' "$this" "$FLAVORS"
                TFIMAGE_OTHER_HOST=inside TFIMAGE_FLAVORS=$FLAVORS bash tests/run-all.sh 2>&1 \
                    | tee "$logs/run-all.log" || rc=${PIPESTATUS[0]}
                cp build/test-summary.txt "$logs/" 2>/dev/null || true ;;
            soak)
                # The soak's short form alone, on that generation's cluster (the
                # cluster tier's test_soak): a soak failure seen in CI, reproduced in
                # minutes; the cluster's logs are kept beside (cluster-log/).
                printf '\n=== %s: the short soak (tests/cluster/test_soak.py)\n' "$this"
                { bash deploy/local/packages.sh && make -s venv spank \
                    && TFIMAGE_NODES=4 TFIMAGE_BURST=0 bash deploy/local/cluster.sh up \
                    && TFIMAGE_REQUIRE_CLUSTER=1 .venv/bin/pytest -q -p no:cacheprovider -s \
                        tests/cluster/test_crashed_slurmd.py tests/cluster/test_soak.py; } 2>&1 | tee "$logs/soak.log" \
                    || rc=${PIPESTATUS[0]}
                cp -r /var/lib/tfimage-local/log "$logs/cluster-log" 2>/dev/null || true ;;
            reverse)
                # What a machine of this generation runs: this script, towards the
                # generation outside (nested namespaces, a root built in here).
                printf '\n=== %s: bash deploy/local/other-host.sh run (steps: demo)\n' "$this"
                TFIMAGE_OTHER_HOST_STEPS=demo bash deploy/local/other-host.sh run 2>&1 \
                    | tee "$logs/reverse.log" || rc=${PIPESTATUS[0]} ;;
            *) echo "other-host: unknown step '$step' in TFIMAGE_OTHER_HOST_STEPS" >&2; rc=2 ;;
        esac
        echo "$step=$rc $((SECONDS - t0))" >>"$logs/result"
        if ! grep -q '^slurm=' "$logs/result" && dpkg-query -W slurm-client >/dev/null 2>&1; then
            echo "slurm=$(dpkg-query -W -f '${Version}' slurm-client | sed 's/^[0-9]*://; s/-[^-]*$//')" \
                >>"$logs/result"
        fi
        [ "$rc" = 0 ] || exit "$rc"
    done
}

inside_down() { # the other host's cluster down; then what would be left behind
    local rc=$? logs=/root/other-host-logs p left=()
    trap - EXIT
    cd /root/tfimage
    bash deploy/local/cluster.sh down >"$logs/cluster-down.log" 2>&1 \
        || { cat "$logs/cluster-down.log" >&2; left+=("cluster.sh down failed"); }
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$p" = 1 ] || [ "$p" = "$$" ] || [ "$p" = "$BASHPID" ] && continue
        # Zombies are already gone but for PID 1's reaping; anything else is left.
        [ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" = Z ] && continue
        [ -e "/proc/$p" ] || continue
        left+=("process $p ($(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-80))")
    done
    # /run/netns itself is iproute2's, made once and kept; a namespace under it is not.
    awk '$5 != "/run/netns" {print $5}' /proc/self/mountinfo | sort >"$logs/mounts.after"
    while read -r m; do left+=("mount $m"); done < <(comm -13 "$logs/mounts.before" "$logs/mounts.after")
    for p in tfbr0 veth-n1 veth-n2; do ip link show "$p" >/dev/null 2>&1 && left+=("link $p"); done
    if [ ${#left[@]} -gt 0 ]; then
        printf 'left=%s\n' "${left[*]}" >>"$logs/result"
        printf 'other-host: left behind inside: %s\n' "${left[@]}" >&2
        [ "$rc" != 0 ] || rc=1
    fi
    exit "$rc"
}

run() {
    [ "$(id -u)" = 0 ] || die "run as root"
    command -v debootstrap >/dev/null || bash "$REPO/deploy/local/packages.sh"
    local t0=$SECONDS rc=0 this
    this="Debian $(. /etc/os-release && echo "$VERSION_ID ($VERSION_CODENAME)")"
    log "$this machine; the other host: $OTHER_NAME"
    stop_local_cluster
    build_root
    trap 'sweep; remove_after' EXIT
    prepare
    rm -rf "$OUT"
    mkdir -p "$OUT"
    log "entering $OTHER_NAME (mount and PID namespaces, pivot_root); steps: $STEPS"
    # The inner run's output, prefixed so that a CI log tells the two hosts apart.
    timeout -k 30 "$LIMIT" unshare --mount --propagation private --pid --fork --kill-child \
        bash "$0" enter 2>&1 | sed -u "s/^/[$OTHER] /" || rc=${PIPESTATUS[0]}
    sweep
    cp -r "$RUNROOT/root/other-host-logs/." "$OUT/" 2>/dev/null || true
    report "$rc" $((SECONDS - t0)) || die "the $OTHER_NAME host did not pass (logs: $OUT)"
}

remove_after() {
    [ "${TFIMAGE_OTHER_HOST_KEEP:-0}" = 1 ] && { log "kept $RUNROOT (TFIMAGE_OTHER_HOST_KEEP=1)"; return 0; }
    remove_run_root
}

report() { # RC SECONDS: the summary line; status 0 only if all passed, nothing left
    local rc=$1 secs=$2 result=$OUT/result line step st sec log
    touch "$result"
    line=$(sed -n 's/^host=//p' "$result")
    line=${line:-$OTHER_NAME}" host"
    if grep -q '^slurm=' "$result"; then line+=": Slurm $(sed -n 's/^slurm=//p' "$result")"; fi
    if grep -q '^tests=0 ' "$result" && [ -s "$OUT/test-summary.txt" ]; then
        line=$(cat "$OUT/test-summary.txt")   # run-all's own line: versions and counts
    fi
    for step in $STEPS; do
        st=$(sed -n "s/^$step=\([0-9]*\) .*/\1/p" "$result")
        sec=$(sed -n "s/^$step=[0-9]* //p" "$result")
        log=build/other-host/$(case $step in tests) echo run-all ;; *) echo "$step" ;; esac).log
        if [ -z "$st" ] && [ "$rc" = 124 ]; then line+=", $step killed after ${LIMIT} s"; rc=killed
        elif [ -z "$st" ]; then line+=", $step not run"
        elif [ "$st" = 0 ]; then line+=", $step passed ($(fmt "$sec"))"
        else line+=", $step FAILED (exit $st; $log)"
        fi
    done
    [ "$rc" != 124 ] || line+=", killed after ${LIMIT} s"   # after its steps: in the teardown
    [ ${#LEFT[@]} -eq 0 ] || line+=", left behind: ${LEFT[*]}"
    ! grep -q '^left=' "$result" || line+=", left behind inside: $(sed -n 's/^left=//p' "$result")"
    line+="; $(fmt "$secs") in all"
    echo "$line" >"$OUT/summary.txt"
    echo "other-host: $line"
    [ "$rc" = 0 ] && [ ${#LEFT[@]} -eq 0 ]
}

fmt() { # SECONDS -> "N min S s"
    if [ "$1" -ge 60 ]; then echo "$(($1 / 60)) min $(($1 % 60)) s"; else echo "$1 s"; fi
}

clean() {
    remove_run_root
    rm -rf "$CACHE"/host-bookworm-* "$CACHE"/host-trixie-* "$CACHE"/other-host-debs-* "$PIPCACHE" \
        "$CACHE"/other-host-build-*
    log "removed the cached other-host roots and the caches shared across runs"
}

# Sourced (tests/unit/deploy/test_readme_sample.py renders report's line): functions only.
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0
case "${1:-}" in
    run) run ;;
    root) [ "$(id -u)" = 0 ] || die "run as root"; build_root; echo "$ROOT" ;;
    clean) clean ;;
    enter) enter ;;     # internal: PID 1 of the new namespaces (from run)
    inside) inside ;;   # internal: inside the other host (from enter)
    -h | --help | help) usage ;;
    *) echo "usage: other-host.sh run|root|clean   (--help for more)" >&2; exit 2 ;;
esac

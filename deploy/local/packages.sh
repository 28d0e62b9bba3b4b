#!/usr/bin/env bash
# Install the Debian packages the local cluster, the images and the tests need.
# Idempotent: only missing packages are installed.
set -euo pipefail
# shellcheck source=deploy/local/err-trap.sh
. "$(dirname "$0")/err-trap.sh" packages
PKGS=(
    munge slurmd slurmctld slurm-client libslurm-dev gcc make libc6-dev
    slurmdbd mariadb-server  # accounting (accounting.sh): sacct, sshare, fair share
    docker-registry apache2-utils openssl curl ca-certificates
    charliecloud squashfuse fuse3 squashfs-tools siftool skopeo umoci
    debootstrap busybox-static iproute2 util-linux procps psmisc
    python3 python3-venv python3-dev python3-pip
    e2fsprogs  # mkfs.ext4: where /tmp is a tmpfs, a test makes an ext4 that refuses O_DIRECT
    strace     # a test sees the download's writeback hint reach the kernel
    logrotate  # the usage log survives both ways of rotating it
    prometheus prometheus-node-exporter  # the metrics tests scrape a real node_exporter
    nginx      # a per-project auth proxy in front of the registry (project_proxy.py)
    man-db     # the tests render tfimage(1) and tfimage-spank(8) with man -l
)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "packages: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

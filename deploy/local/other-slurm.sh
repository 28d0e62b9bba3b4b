#!/usr/bin/env bash
# The other Debian generation's Slurm, in a chroot, for SLURM_FLAVOR=other:
#   Debian 12 host (Slurm 22.05) -> a Debian 13 chroot (Slurm 24.11), and back.
# Built once with debootstrap and cached, keyed by its package list.  tfimage itself
# is deployed into it by the Ansible role (deploy/local/role.sh, run in the chroot):
# its own /opt/tfimage, the plugin compiled against that Slurm's headers, so nothing
# of one generation leaks into the other.
#
#   other-slurm.sh root      print the chroot's path, building it if needed
#   other-slurm.sh wheels    stage tfimage's dependency wheels for the role
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=deploy/local/err-trap.sh
. "$REPO/deploy/local/err-trap.sh" other-slurm
# shellcheck source=deploy/local/other-release.sh
. "$REPO/deploy/local/other-release.sh"
# The node side of tfimage: Slurm (debootstrap), then the runtime and the OCI-to-SIF
# converters with apt, which resolves virtual dependencies and debootstrap does not
# (bookworm's charliecloud -> charliecloud-builders -> buildah -> ... -> the virtual
# container-network-stack stops a debootstrap of bookworm).  `charliecloud` itself,
# not only its runtime: it is what the role installs on a compute node.
PKGS="slurmd,slurmctld,slurmdbd,slurm-client,munge,libslurm-dev,gcc,libc6-dev,make,python3,python3-venv,squashfuse,fuse3,iproute2,procps,util-linux,ca-certificates"
MORE="charliecloud skopeo umoci squashfs-tools siftool"
KEY=$(printf '%s\n' 1 "$OTHER" "$PKGS" "$MORE" | sha256sum | cut -c1-12)
ROOT=$CACHE/chroot-$OTHER-$KEY

log() { printf 'other-slurm: %s\n' "$*" >&2; }

build_root() {
    [ -f "$ROOT/.complete" ] && return 0
    log "debootstrap $OTHER with Slurm into $ROOT (once; cached)"
    rm -rf "$ROOT"
    debootstrap --variant=minbase --include="$PKGS" "$OTHER" "$ROOT" "$MIRROR" \
        >"$CACHE/debootstrap-$OTHER.log" 2>&1 || { tail -20 "$CACHE/debootstrap-$OTHER.log" >&2; exit 1; }
    # shellcheck disable=SC2086
    chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
        sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends $MORE" \
        >>"$CACHE/debootstrap-$OTHER.log" 2>&1 || { tail -20 "$CACHE/debootstrap-$OTHER.log" >&2; exit 1; }
    touch "$ROOT/.complete"
}

# tfimage's dependencies, downloaded on the host for the chroot's Python and staged at
# /usr/src/tfimage-wheels; the Ansible role installs tfimage from there (--no-index).
stage_wheels() {
    local pyver wheels whl
    whl=$(ls "$REPO"/build/dist/tfimage-*.whl)
    pyver=$(chroot "$ROOT" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    wheels=$CACHE/chroot-wheels-py$pyver
    mkdir -p "$wheels"
    PIP_CONSTRAINT='' python3 -m pip download -q --only-binary=:all: --python-version "$pyver" \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_28_x86_64 --platform any -d "$wheels" "$whl" >"$CACHE/pip-download.log" 2>&1 \
        || { tail -20 "$CACHE/pip-download.log" >&2; exit 1; }
    rm -f "$wheels"/tfimage-*.whl  # only its dependencies are cached
    rm -rf "$ROOT/usr/src/tfimage-wheels"
    mkdir -p "$ROOT/usr/src/tfimage-wheels"
    cp "$wheels"/*.whl "$ROOT/usr/src/tfimage-wheels/"
}

case "${1:-}" in
    root) build_root; echo "$ROOT" ;;
    wheels) build_root; stage_wheels ;;
    *) echo "usage: other-slurm.sh root|wheels" >&2; exit 2 ;;
esac

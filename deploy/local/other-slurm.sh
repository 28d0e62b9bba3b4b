#!/usr/bin/env bash
# The other Debian generation's Slurm, in a chroot, for SLURM_FLAVOR=other:
#   Debian 12 host (Slurm 22.05) -> a Debian 13 chroot (Slurm 24.11), and back.
# Built once with debootstrap and cached, keyed by its package list; the tfimage
# wheel and its dependencies (downloaded on the host for the chroot's Python) are
# installed into the chroot's own /opt/tfimage, and the plugin is compiled there
# against that Slurm's headers, so nothing of one generation leaks into the other.
#
#   other-slurm.sh root      print the chroot's path, building it if needed
#   other-slurm.sh install   (re)install tfimage and build the plugin in it
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=deploy/local/other-release.sh
. "$REPO/deploy/local/other-release.sh"
# The node side of tfimage: Slurm and the runtime (debootstrap), then the OCI-to-SIF
# converters (apt, which resolves their virtual dependencies; debootstrap does not).
PKGS="slurmd,slurmctld,slurm-client,munge,libslurm-dev,gcc,libc6-dev,make,python3,python3-venv,charliecloud,squashfuse,fuse3,iproute2,procps,util-linux,ca-certificates"
MORE="skopeo umoci squashfs-tools siftool"
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

install_tfimage() {
    local pyver wheels src
    pyver=$(chroot "$ROOT" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    wheels=$CACHE/chroot-wheels-py$pyver
    src=$(mktemp -d)
    trap 'rm -rf "$src"' RETURN
    # A pure-Python wheel of this checkout, built on the host.
    python3 -m pip wheel -q --no-deps --no-build-isolation -w "$src" "$REPO" >/dev/null 2>&1 \
        || python3 -m pip wheel -q --no-deps -w "$src" "$REPO" >/dev/null
    mkdir -p "$wheels"
    PIP_CONSTRAINT= python3 -m pip download -q --only-binary=:all: --python-version "$pyver" \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_28_x86_64 --platform any -d "$wheels" "$src"/tfimage-*.whl >/dev/null
    rm -f "$wheels"/tfimage-*.whl  # only its dependencies are cached
    rm -rf "$ROOT/usr/src/tfimage-wheels"
    mkdir -p "$ROOT/usr/src/tfimage-wheels"
    cp "$wheels"/*.whl "$src"/tfimage-*.whl "$ROOT/usr/src/tfimage-wheels/"
    local whl
    whl=/usr/src/tfimage-wheels/$(basename "$src"/tfimage-*.whl)
    [ -x "$ROOT/opt/tfimage/bin/python3" ] || chroot "$ROOT" python3 -m venv /opt/tfimage
    chroot "$ROOT" /usr/bin/env -i PATH=/usr/bin:/bin /opt/tfimage/bin/pip install -q \
        --disable-pip-version-check --no-index --find-links /usr/src/tfimage-wheels \
        --force-reinstall --no-deps "$whl"
    chroot "$ROOT" /usr/bin/env -i PATH=/usr/bin:/bin /opt/tfimage/bin/pip install -q \
        --disable-pip-version-check --no-index --find-links /usr/src/tfimage-wheels "$whl"
    rm -rf "$ROOT/usr/src/tfimage-spank"
    cp -r "$REPO/spank" "$ROOT/usr/src/tfimage-spank"
    rm -rf "$ROOT/usr/src/tfimage-spank/build"
    chroot "$ROOT" make -s -C /usr/src/tfimage-spank OBJDIR=build all check-exports >/dev/null
}

case "${1:-}" in
    root) build_root; echo "$ROOT" ;;
    install) build_root; install_tfimage ;;
    *) echo "usage: other-slurm.sh root|install" >&2; exit 2 ;;
esac

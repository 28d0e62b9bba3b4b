#!/usr/bin/env bash
# Build the local test images as real SIF files and cache them on disk, keyed by
# their recipe, so a second build takes seconds.  Usage: build.sh OUTDIR
#   OUTDIR/tiny.sif       busybox-static only
#   OUTDIR/team-a-tiny.sif  the same, marked as team-a's private team-a/tiny:1.0
#   OUTDIR/tf-custom.sif  debootstrap minbase + python3 + tensorflow-cpu + tf_keras
set -euo pipefail

OUT=${1:?usage: build.sh OUTDIR}
CACHE=${TFIMAGE_BUILD_CACHE:-/var/cache/tfimage-build}
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=deploy/local/err-trap.sh
. "$HERE/../err-trap.sh" images
TF_PINS="tensorflow-cpu==2.21.0 tf_keras==2.21.0"
CODENAME=$(. /etc/os-release && echo "$VERSION_CODENAME")
MIRROR=${TFIMAGE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$OUT" "$CACHE"

log() { printf 'images: %s\n' "$*" >&2; }

# Bump when a recipe below changes what ends up in an image.
RECIPE_VERSION=2

key_of() { # cache key: the recipe version plus the inputs named on the command line
    printf '%s\n' "$RECIPE_VERSION" "$@" | sha256sum | cut -c1-16
}

publish() { # CACHED OUT: a hard link when possible, the cache stays the source
    ln -f "$1" "$2" 2>/dev/null || cp "$1" "$2"
}

WORK=""
cleanup() { [ -z "$WORK" ] || { umount "$WORK/wheels" 2>/dev/null || true; rm -rf "$WORK"; }; }
trap cleanup EXIT

# Every image carries /etc/hosts and /etc/resolv.conf (ch-run only binds the
# host's over existing files) and a marker naming the image.
finish_rootfs() { # ROOTFS NAME
    local r=$1
    mkdir -p "$r/etc" "$r/tmp" "$r/home" "$r/proc" "$r/sys" "$r/dev"
    chmod 1777 "$r/tmp"
    : >"$r/etc/hosts"
    : >"$r/etc/resolv.conf"
    printf '%s\n' "$2" >"$r/etc/tfimage-test-image"
}

make_sif() { # ROOTFS SIF COMP
    local r=$1 sif=$2 tmp
    tmp=$(mktemp -d "$CACHE/sif.XXXXXX")
    mksquashfs "$r" "$tmp/root.sqfs" -all-root -comp "$3" -quiet -noappend >/dev/null
    siftool new "$tmp/img.sif"
    # parttype 2: the primary system partition, as `apptainer build` writes it.
    siftool add --datatype 4 --parttype 2 --partfs 1 --partarch 2 "$tmp/img.sif" "$tmp/root.sqfs"
    mv "$tmp/img.sif" "$sif"
    rm -rf "$tmp"
}

build_tiny() { # [FILE-NAME MARKER]
    local name=${1:-tiny} marker=${2:-tiny:1.0} key sif
    key=$(key_of "$name" "$marker" "$(dpkg-query -W -f '${Version}' busybox-static)")
    sif="$CACHE/$name-$key.sif"
    if [ ! -s "$sif" ]; then
        log "building $marker ($key)"
        local r
        r=$(mktemp -d "$CACHE/tiny-root.XXXXXX")
        WORK=$r
        mkdir -p "$r/bin"
        cp /bin/busybox "$r/bin/busybox"
        for app in $("$r/bin/busybox" --list); do
            [ -e "$r/bin/$app" ] || ln -s busybox "$r/bin/$app"
        done
        finish_rootfs "$r" "$marker"
        make_sif "$r" "$sif" lz4
        rm -rf "$r"
        WORK=""
    fi
    publish "$sif" "$OUT/$name.sif"
    log "$marker -> $OUT/$name.sif"
}

build_tf() {
    local key sif
    key=$(key_of tf "$CODENAME" "$TF_PINS")
    sif="$CACHE/tf-custom-$key.sif"
    if [ ! -s "$sif" ]; then
        log "building tf-custom:2.0 ($key): debootstrap $CODENAME, $TF_PINS"
        local r
        r="$CACHE/tf-root.$key"
        rm -rf "$r"
        WORK=$r
        debootstrap --variant=minbase --include=python3,python3-pip "$CODENAME" "$r" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
        local pyver
        pyver=$(chroot "$r" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        # pip inside the chroot cannot verify the index's TLS: download on the
        # host for the chroot's Python, install there with --no-index.
        local wheels="$CACHE/wheels-py$pyver"
        mkdir -p "$wheels"
        # The root's glibc minor version bounds the manylinux tags pip may take.  Not
        # `ldd --version | head -1`: ldd then dies of SIGPIPE, which pipefail makes fatal.
        local glibc plats=()
        glibc=$(chroot "$r" getconf GNU_LIBC_VERSION)   # "glibc 2.36"
        glibc=${glibc##*.}
        for n in $(seq 17 "$glibc"); do plats+=(--platform "manylinux_2_${n}_x86_64"); done
        # shellcheck disable=SC2086
        PIP_CONSTRAINT= python3 -m pip download -q --only-binary=:all: --python-version "$pyver" \
            --implementation cp "${plats[@]}" --platform manylinux2014_x86_64 \
            --platform linux_x86_64 --platform any -d "$wheels" $TF_PINS
        mkdir -p "$r/wheels"
        mount --bind "$wheels" "$r/wheels"
        # shellcheck disable=SC2086
        if ! chroot "$r" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
                python3 -m pip install -q --no-cache-dir --break-system-packages \
                --no-index --find-links /wheels $TF_PINS; then
            umount "$r/wheels"; exit 1
        fi
        umount "$r/wheels"
        rmdir "$r/wheels"
        rm -rf "$r/var/cache/apt/archives/"*.deb "$r/var/lib/apt/lists/"*
        finish_rootfs "$r" "tf-custom:2.0"
        make_sif "$r" "$sif" lz4
        rm -rf "$r"
        WORK=""
    fi
    publish "$sif" "$OUT/tf-custom.sif"
    log "tf-custom:2.0 -> $OUT/tf-custom.sif"
}

case "${2:-all}" in
    tiny) build_tiny ;;
    tf) build_tf ;;
    all) build_tiny; build_tiny team-a-tiny team-a/tiny:1.0; build_tf ;;
    *) echo "build.sh: unknown image '$2'" >&2; exit 2 ;;
esac

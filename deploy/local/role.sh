#!/usr/bin/env bash
# Deploy tfimage onto the local cluster's nodes with the Ansible role, the way a
# site would (`-c local`, the machine is its own inventory).
#
#   role.sh wheel                 build the tfimage wheel (reproducible) into build/dist
#   role.sh apply [OPTIONS...]    run deploy/ansible/site.yml; OPTIONS go to
#                                 ansible-playbook, e.g. --check --diff
#
# Variables come from $STATE/etc/ansible/vars.yml, written by cluster.sh.  With
# SLURM_FLAVOR=other (recorded in $STATE/etc/ansible/flavor) the playbook runs inside
# the other Slurm's chroot, so the plugin is built against that Slurm and the
# Debian 13 (or 12) packages are that release's.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=deploy/local/err-trap.sh
. "$REPO/deploy/local/err-trap.sh" role
STATE=${TFIMAGE_LOCAL_STATE:-/var/lib/tfimage-local}
CONF=$STATE/etc/ansible
VENV=$REPO/build/ansible
REQS=$REPO/deploy/ansible/requirements.txt
# shellcheck source=deploy/local/other-release.sh
. "$REPO/deploy/local/other-release.sh"

log() { printf 'role: %s\n' "$*" >&2; }
die() { printf 'role: error: %s\n' "$*" >&2; exit 1; }

ansible_venv() { # the pinned ansible-core and ansible-lint, once per requirements change
    local key
    key=$(sha256sum "$REQS" | cut -c1-12)
    [ -f "$VENV/.done-$key" ] && return 0
    rm -rf "$VENV"
    /usr/bin/python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check -r "$REQS" >"$REPO/build/ansible-pip.log" 2>&1 \
        || { tail -20 "$REPO/build/ansible-pip.log" >&2; die "installing ansible failed"; }
    touch "$VENV/.done-$key"
}

wheel() {
    mkdir -p "$REPO/build/dist"
    rm -f "$REPO"/build/dist/tfimage-*.whl
    # A fixed date: the same sources give the same bytes, so a re-run changes nothing.
    SOURCE_DATE_EPOCH=315532800 /usr/bin/python3 -m pip wheel -q --disable-pip-version-check \
        --no-deps -w "$REPO/build/dist" "$REPO" >"$REPO/build/wheel.log" 2>&1 \
        || { tail -20 "$REPO/build/wheel.log" >&2; die "building the wheel failed"; }
    rm -rf "$REPO/build/lib" "$REPO"/*.egg-info "$REPO"/src/*.egg-info
    ls "$REPO"/build/dist/tfimage-*.whl
}

# The other flavor: ansible-core in the chroot's own venv (wheels fetched on the host
# for the chroot's Python), and the role, the plugin's sources and the wheel copied in.
chroot_ansible() {
    local root=$1 pyver wheels
    pyver=$(chroot "$root" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    wheels=$CACHE/chroot-ansible-wheels-py$pyver-$(sha256sum "$REQS" | cut -c1-12)
    if [ ! -f "$wheels/.complete" ]; then
        mkdir -p "$wheels"
        PIP_CONSTRAINT='' /usr/bin/python3 -m pip download -q --disable-pip-version-check \
            --only-binary=:all: --python-version "$pyver" --implementation cp \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 --platform any \
            -d "$wheels" "$(grep '^ansible-core' "$REQS")" >"$CACHE/pip-download.log" 2>&1 \
            || { tail -20 "$CACHE/pip-download.log" >&2; die "downloading ansible-core for the chroot failed"; }
        touch "$wheels/.complete"
    fi
    if [ ! -x "$root/opt/ansible/bin/ansible-playbook" ]; then
        rm -rf "$root/usr/src/ansible-wheels"
        cp -r "$wheels" "$root/usr/src/ansible-wheels"
        chroot "$root" python3 -m venv /opt/ansible
        chroot "$root" /usr/bin/env -i PATH=/usr/bin:/bin /opt/ansible/bin/pip install -q \
            --disable-pip-version-check --no-index --find-links /usr/src/ansible-wheels \
            "$(grep '^ansible-core' "$REQS")"
    fi
    local src=$root/usr/src/tfimage-src
    mkdir -p "$src/spank" "$src/deploy" "$src/dist" "$src/docs/man"
    rm -rf "$src/deploy/ansible"
    cp -r "$REPO/deploy/ansible" "$src/deploy/ansible"
    # Only what changed, so the role's copy tasks see unchanged files as unchanged.
    for f in "$REPO"/spank/*.c "$REPO"/spank/*.h "$REPO/spank/Makefile" "$REPO/spank/tfimage.lds"; do
        cmp -s "$f" "$src/spank/$(basename "$f")" || cp "$f" "$src/spank/"
    done
    # The role installs tfimage-spank(8) from the sources too.
    for f in "$REPO"/docs/man/*; do
        cmp -s "$f" "$src/docs/man/$(basename "$f")" || cp "$f" "$src/docs/man/"
    done
    for f in "$REPO"/build/dist/tfimage-*.whl; do
        cmp -s "$f" "$src/dist/$(basename "$f")" || cp "$f" "$src/dist/"
    done
}

apply() {
    [ -f "$CONF/vars.yml" ] || die "no $CONF/vars.yml: run cluster.sh up first"
    local flavor
    flavor=$(cat "$CONF/flavor" 2>/dev/null || echo host)
    if [ "$flavor" = other ]; then
        local root
        root=$(cat "$STATE/run/chroot.root")
        chroot_ansible "$root"
        chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
            ANSIBLE_CONFIG=/usr/src/tfimage-src/deploy/ansible/ansible.cfg \
            ANSIBLE_LOCAL_TEMP=/root/.ansible/tmp \
            /opt/ansible/bin/ansible-playbook -i "$CONF/inventory.ini" \
            /usr/src/tfimage-src/deploy/ansible/site.yml -e "@$CONF/vars.yml" "$@"
    else
        ansible_venv
        ANSIBLE_CONFIG=$REPO/deploy/ansible/ansible.cfg "$VENV/bin/ansible-playbook" \
            -i "$CONF/inventory.ini" "$REPO/deploy/ansible/site.yml" -e "@$CONF/vars.yml" "$@"
    fi
}

case "${1:-}" in
    wheel) wheel ;;
    venv) ansible_venv ;;
    apply) shift; apply "$@" ;;
    *) echo "usage: role.sh wheel|venv|apply [ansible-playbook options]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Compile the plugin against the *other* Debian generation's Slurm headers, so the
# code path this machine's Slurm does not take still compiles on every CI run:
#   Debian 12 (Slurm 22.05, exec from task_init) -> Debian 13's 24.11 headers
#   Debian 13 (Slurm 24.11, spank_prepend_task_argv) -> Debian 12's 22.05 headers
# The headers come from that release's libslurm-dev, fetched with apt-get download
# through a private sources list and unpacked with dpkg -x (nothing is installed).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=deploy/local/err-trap.sh
. "$HERE/../deploy/local/err-trap.sh" build-other
# shellcheck source=deploy/local/other-release.sh
. "$HERE/../deploy/local/other-release.sh"
DIR=$CACHE/slurm-headers-$OTHER
if [ ! -f "$DIR/usr/include/slurm/spank.h" ]; then
    APT=$CACHE/apt-$OTHER
    mkdir -p "$APT/lists/partial" "$APT/archives/partial" "$DIR"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR $OTHER main" \
        >"$APT/sources.list"
    opts=(-o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache::Archives=$APT/archives"
          -o "APT::Get::List-Cleanup=0" -o "APT::Sandbox::User=root")
    apt-get "${opts[@]}" update -qq
    # By release, not by name: apt's candidate is the installed version when it is the
    # newer one (a Debian 13 host asking bookworm's list), and that list cannot serve it.
    rm -f "$APT"/libslurm-dev_*.deb
    (cd "$APT" && apt-get "${opts[@]}" download "libslurm-dev/$OTHER" >/dev/null)
    dpkg -x "$APT"/libslurm-dev_*.deb "$DIR"
fi
hex=$(awk '/define SLURM_VERSION_NUMBER/ {print $3}' "$DIR/usr/include/slurm/slurm_version.h")
version=$(printf '%d.%02d.%d' $((hex >> 16)) $(((hex >> 8) & 255)) $((hex & 255)))
echo "build-other: compiling spank_tfimage.so against Slurm $version headers ($OTHER)" >&2
make -s -C "$HERE" OBJDIR="build/other-$OTHER" SLURM_INCLUDE="$DIR/usr/include" all check-exports

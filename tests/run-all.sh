#!/usr/bin/env bash
# The whole test suite, as root on a fresh Debian 12 or 13 machine:
# packages, a dev venv, lint and types, the plugin against both Slurm generations'
# headers, the unit tests, then the local cluster and the cluster tier.
# The cluster is stopped at the end unless TFIMAGE_KEEP_CLUSTER=1.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
[ "$(id -u)" = 0 ] || { echo "tests: run as root" >&2; exit 1; }

step() { printf '\n=== %s\n' "$*"; }
fail() { echo "tests: FAILED: $*" >&2; exit 1; }

step "packages and venv"
bash deploy/local/packages.sh || fail "packages"
command -v make >/dev/null || { apt-get install -y -qq make >/dev/null || fail "make"; }
make -s venv || fail "venv"

step "lint: ruff, mypy, shell syntax"
make -s lint || fail "lint"

step "SPANK plugin: this machine's Slurm, and the other generation's headers"
make -s spank || fail "plugin build (host Slurm)"
make -s spank-other || fail "plugin build (other Slurm)"

step "pytest: unit tier"
.venv/bin/pytest -q -p no:cacheprovider tests/unit
rc=$?
[ $rc -eq 5 ] && fail "pytest collected no unit tests"
[ $rc -eq 0 ] || fail "unit tests: pytest exit $rc"

if [ "${TFIMAGE_KEEP_CLUSTER:-0}" != 1 ]; then
    trap 'step "stopping the local cluster"; bash deploy/local/cluster.sh down' EXIT
fi
# The cluster tier twice: on this machine's Slurm, and on the other Debian
# generation's (22.05 <-> 24.11) from a cached chroot, so both plugin paths run.
export TFIMAGE_REQUIRE_CLUSTER=1
for flavor in ${TFIMAGE_FLAVORS:-host other}; do
    step "local cluster: SLURM_FLAVOR=$flavor"
    start=$(date +%s)
    SLURM_FLAVOR=$flavor bash deploy/local/cluster.sh up || fail "cluster up ($flavor)"
    # shellcheck disable=SC1091
    version=$(. build/cluster.env && ${TFIMAGE_CHROOT:+chroot "$TFIMAGE_CHROOT"} sinfo -V)
    echo "tests: $version ($flavor) up in $(( $(date +%s) - start )) s"
    step "pytest: cluster tier on $version"
    start=$(date +%s)
    .venv/bin/pytest -q -p no:cacheprovider tests/cluster
    rc=$?
    [ $rc -eq 5 ] && fail "pytest collected no cluster tests"
    [ $rc -eq 0 ] || fail "cluster tier on $version: pytest exit $rc"
    echo "tests: cluster tier on $version passed in $(( $(date +%s) - start )) s"
done
echo "tests: all passed"

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

step "local cluster"
if [ "${TFIMAGE_KEEP_CLUSTER:-0}" != 1 ]; then
    trap 'step "stopping the local cluster"; bash deploy/local/cluster.sh down' EXIT
fi
start=$(date +%s)
bash deploy/local/cluster.sh up || fail "cluster up"
echo "tests: cluster up in $(( $(date +%s) - start )) s"

step "pytest: unit and cluster tiers"
export TFIMAGE_REQUIRE_CLUSTER=1
.venv/bin/pytest -q -p no:cacheprovider tests
rc=$?
[ $rc -eq 5 ] && fail "pytest collected no tests"
[ $rc -eq 0 ] || fail "pytest exit $rc"
echo "tests: all passed"

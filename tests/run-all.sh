#!/usr/bin/env bash
# The whole test suite, as root on a fresh Debian 12 or 13 machine:
# packages, a dev venv, lint and types, the plugin against both Slurm generations'
# headers, the unit tests, and meanwhile the other Debian generation as a whole host
# (its own root filesystem, where a fresh clone runs the demo and this suite:
# other-host.sh), then the local cluster and the cluster tier on this machine's
# Slurm.  The last lines name both host generations, their Slurm and counts.
# The cluster is stopped at the end unless TFIMAGE_KEEP_CLUSTER=1.
#
#   TFIMAGE_FLAVORS="host other"  the cluster tier's Slurm flavors: "host" is this
#                                 machine's Slurm, "other" the other generation's in a
#                                 chroot (a quick try of that generation without a
#                                 whole host).  Default "host" where the other host
#                                 runs (it proves the other generation), "host other"
#                                 where it is skipped; in strict mode always "host"
#   TFIMAGE_OTHER_HOST=0          skip the other host generation (says so; refused
#                                 in strict mode, where every run proves both)
#   TFIMAGE_STRICT=1              strict mode, as .ci/run always sets it (CI=true
#                                 too): any skip outside the budget
#                                 (tests/skipbudget.py) fails the run, here and on
#                                 the other host, and so does a missing generation
#
# Each step's time is printed as it ends, and at the end the slowest ten tests of
# each pytest tier.
# It brings the local cluster up and down, and one machine holds one at a time: where
# several people share a machine, take turns, e.g.
#   flock /var/lock/tfimage-cluster.lock bash tests/run-all.sh
set -uo pipefail
case "${1:-}" in
    -h | --help) sed -n '2,/^set -/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "usage: $(basename "$0") [--help]" >&2; exit 2 ;;
esac
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
[ "$(id -u)" = 0 ] || { echo "tests: run as root" >&2; exit 1; }

T_ALL=$SECONDS
STEP="" T_STEP=0 TIMES=()
step() { # NAME [WHAT]: a new step (none: the end); the last one's time is kept
    [ -z "$STEP" ] || TIMES+=("$STEP $(fmt $((SECONDS - T_STEP)))")
    STEP=$1 T_STEP=$SECONDS
    [ -z "$1" ] || printf '\n=== %s\n' "${2:-$1}"
}
fail() {
    [ -z "$STEP" ] || TIMES+=("$STEP $(fmt $((SECONDS - T_STEP))) (failed)")
    if [ -n "${OTHER_PID:-}" ] && kill -0 "$OTHER_PID" 2>/dev/null; then
        echo "tests: stopping the other host's run (build/other-host.out)" >&2
        kill -TERM -- "-$OTHER_PID" 2>/dev/null
        wait "$OTHER_PID" 2>/dev/null
    fi
    echo "tests: times: $(IFS=,; echo "${TIMES[*]}" | sed 's/,/, /g')" >&2
    echo "tests: FAILED: $*" >&2
    exit 1
}
# fmt, debian, host_summary: the summary's words, shared with the README's test.
# shellcheck source=tests/summary.sh
. tests/summary.sh

SLOWEST=()
pytest_tier() { # NAME LOG ARGS...: pytest, its output kept; exit 5 (nothing collected) fails
    local name=$1 log=$2 rc=0
    shift 2
    .venv/bin/pytest -q -p no:cacheprovider --durations=10 "$@" 2>&1 | tee "$log" \
        || rc=${PIPESTATUS[0]}
    SLOWEST+=("$name" "$log")
    [ "$rc" -eq 5 ] && fail "pytest collected no $name tests"
    [ "$rc" -eq 0 ] || fail "$name tests: pytest exit $rc (log: $log)"
    return 0
}
count() { # WHAT LOG: how many tests pytest's last line says were WHAT (passed, skipped)
    grep -E '[0-9]+ (passed|failed|skipped)' "$2" | tail -1 | grep -oE "[0-9]+ $1" \
        | cut -d' ' -f1 | grep . || echo 0
}
slowest() { # NAME LOG: the slowest tests pytest's --durations section lists
    echo "tests: slowest $1 tests:"
    sed -n '/slowest 10 durations/,/^$/p' "$2" | grep -E '^[0-9.]+s +(setup|call|teardown) ' \
        | sed 's/^/  /'
}
THIS=$(. /etc/os-release && echo "$VERSION_CODENAME")

mkdir -p build
rm -f build/test-summary.txt build/figures.txt
# Strict mode reaches every pytest run, and the other host's run (other-host.sh).
STRICT=0
if [ "${TFIMAGE_STRICT:-}" = 1 ] || [ "${CI:-}" = true ]; then
    STRICT=1
    export TFIMAGE_STRICT=1
    echo "tests: strict mode: skips outside tests/skipbudget.py fail, both generations must run"
fi

step "packages and venv"
bash deploy/local/packages.sh || fail "packages"
command -v make >/dev/null || { apt-get install -y -qq make >/dev/null || fail "make"; }
make -s venv || fail "venv"
# The package's version: `sinfo -V` on 24.11 wants a configuration before it answers.
HOST_SLURM=$(dpkg-query -W -f '${Version}' slurm-client | sed 's/^[0-9]*://; s/-[^-]*$//')
echo "tests: $(debian "$THIS"), Slurm $HOST_SLURM"

# The other Debian generation as a whole host (its own root, a fresh clone, the demo
# and this suite there: other-host.sh) starts now, beside lint, the plugin and the
# unit tier here, which touch no cluster: its own root, build and demo come before
# its cluster tier, which meets nothing of this machine's but the CPUs (the tier
# mostly waits: 13-50 % of two cores).  Its output is replayed when it is waited for.
OTHER_PID=""
if [ "${TFIMAGE_OTHER_HOST:-1}" = 1 ]; then
    rm -f build/other-host.out
    # A session of its own: a failure here stops all of it (fail).
    setsid bash deploy/local/other-host.sh run >build/other-host.out 2>&1 </dev/null &
    OTHER_PID=$!
    echo "tests: the other host generation started beside lint, the plugin and the unit tier (build/other-host.out)"
fi

step "lint" "lint: ruff, mypy, shell syntax"
make -s lint || fail "lint"

step "plugin" "SPANK plugin: this machine's Slurm, and the other generation's headers"
make -s spank || fail "plugin build (host Slurm)"
make -s spank-other || fail "plugin build (other Slurm)"

step "unit" "pytest: unit tier"
# On every core, up to four (pytest-xdist): the tier mostly waits on its own servers
# and subprocesses; on CI's two cores it takes 2 min instead of 3.5.
pytest_tier unit build/pytest-unit.log --numprocesses=auto --maxprocesses=4 tests/unit
UNIT_PASSED=$(count passed build/pytest-unit.log) UNIT_SKIPPED=$(count skipped build/pytest-unit.log)

# The other host's run, started after the packages, is waited for before this
# machine's cluster tier: its cluster and the other host's share names in one network
# namespace, and the one kept up at the end (TFIMAGE_KEEP_CLUSTER=1) is this machine's.
OTHER_LINE="" OTHER_RAN=0
case "${TFIMAGE_OTHER_HOST:-1}" in
    1)
        step "other host" "the other Debian generation as a host (deploy/local/other-host.sh run, started with lint)"
        rc=0
        wait "$OTHER_PID" || rc=$?
        cat build/other-host.out
        [ "$rc" = 0 ] \
            || fail "the other host generation: $(cat build/other-host/summary.txt 2>/dev/null || echo 'see above')"
        OTHER_LINE=$(cat build/other-host/summary.txt)
        OTHER_RAN=1
        other_slurm=$(sed -n 's/^slurm=//p' build/other-host/result)
        [ -n "$other_slurm" ] || fail "the other host did not say which Slurm it ran"
        [ "${other_slurm%.*}" != "${HOST_SLURM%.*}" ] \
            || fail "the other host ran Slurm $other_slurm, the generation of this host's ($HOST_SLURM)"
        # Its run must have been strict too: env -i there keeps only what is passed.
        [ "$STRICT" = 0 ] || grep -q '^tests: strict mode' build/other-host/run-all.log \
            || fail "the other host's run was not in strict mode (build/other-host/run-all.log)" ;;
    0)
        [ "$STRICT" = 0 ] \
            || fail "TFIMAGE_OTHER_HOST=0 in strict mode: every CI run proves both host generations"
        # shellcheck source=deploy/local/other-release.sh
        OTHER_LINE="$(debian "$(. deploy/local/other-release.sh && echo "$OTHER")") host: SKIPPED (TFIMAGE_OTHER_HOST=0)"
        echo "tests: the other host generation is SKIPPED (TFIMAGE_OTHER_HOST=0)" ;;
    inside) ;;  # this run is the other host's own (other-host.sh): nothing nested
    *) fail "TFIMAGE_OTHER_HOST must be 1 (the default) or 0, not '${TFIMAGE_OTHER_HOST}'" ;;
esac

if [ "${TFIMAGE_KEEP_CLUSTER:-0}" != 1 ]; then
    trap 'printf "\n=== stopping the local cluster\n"; bash deploy/local/cluster.sh down' EXIT
fi
# The cluster tier on this machine's Slurm; on the other generation's from a cached
# chroot (22.05 <-> 24.11) only where the other host did not prove that generation.
export TFIMAGE_REQUIRE_CLUSTER=1
TIERS=() VERSIONS=()
if [ "$OTHER_RAN" = 1 ]; then DEFAULT_FLAVORS="host"; else DEFAULT_FLAVORS="host other"; fi
FLAVORS=${TFIMAGE_FLAVORS:-$DEFAULT_FLAVORS}
if [ "$STRICT" = 1 ] && [ "$OTHER_RAN" = 1 ] && [ "$FLAVORS" != host ]; then
    echo "tests: strict mode: the other host ran Slurm $other_slurm; the cluster tier runs on this host's alone, whatever TFIMAGE_FLAVORS says ($FLAVORS)"
    FLAVORS=host
fi
for flavor in $FLAVORS; do
    step "cluster $flavor" "local cluster: SLURM_FLAVOR=$flavor"
    # Four nodes: the stage hook's multi-node jobs (partition all); -N2 jobs keep
    # landing on n1 and n2 (debug, the default partition).  Two would save no time:
    # the tier's other 124 tests took 9 min 14 s on two nodes, all 128 as long on four.
    # And two cloud nodes (cloud.sh: Slurm's power saving) where the flavor allows.
    burst=0
    [ "$flavor" != host ] || burst=${TFIMAGE_BURST:-2}
    TFIMAGE_NODES=${TFIMAGE_NODES:-4} TFIMAGE_BURST=$burst SLURM_FLAVOR=$flavor bash deploy/local/cluster.sh up \
        || fail "cluster up ($flavor)"
    # shellcheck disable=SC1091
    version=$(. build/cluster.env && ${TFIMAGE_CHROOT:+chroot "$TFIMAGE_CHROOT"} sinfo -V | awk '{print $2}')
    echo "tests: Slurm $version ($flavor) up in $(fmt $((SECONDS - T_STEP)))"
    for seen in "${VERSIONS[@]}"; do  # 22.05.8 and 24.11.5: compare the generation
        [ "${seen%.*}" != "${version%.*}" ] \
            || fail "the $flavor tier runs Slurm $version, the generation a tier before it ran ($seen)"
    done
    VERSIONS+=("$version")
    printf '\n=== %s\n' "pytest: cluster tier on Slurm $version ($flavor)"
    pytest_tier "cluster ($flavor, Slurm $version)" "build/pytest-cluster-$flavor.log" tests/cluster
    on=$version
    [ "$flavor" != other ] || on+=" in a chroot"
    TIERS+=("$(count passed "build/pytest-cluster-$flavor.log")" \
        "$(count skipped "build/pytest-cluster-$flavor.log")" "$on")
    echo "tests: cluster tier on Slurm $version passed"
done
step ""

echo
for ((i = 0; i < ${#SLOWEST[@]}; i += 2)); do slowest "${SLOWEST[i]}" "${SLOWEST[i + 1]}"; done
line=$(host_summary "$THIS" "$HOST_SLURM" "$UNIT_PASSED" "$UNIT_SKIPPED" "${TIERS[@]}")
echo "$line" >build/test-summary.txt
echo
echo "tests: times: $(IFS=,; echo "${TIMES[*]}" | sed 's/,/, /g'); $(fmt $((SECONDS - T_ALL))) in all"
# What tests measured for the closing notes (tests/support.py's report_figure).
[ ! -s build/figures.txt ] || sed 's/^/tests: figure: /' build/figures.txt
[ "$OTHER_RAN" = 0 ] || grep '^tests: figure: ' build/other-host/run-all.log | sed 's/^tests: figure: /tests: other host figure: /'
echo "tests: $line"
[ -z "$OTHER_LINE" ] || echo "tests: $OTHER_LINE"
echo "tests: all passed"

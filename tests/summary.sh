# Sourced by tests/run-all.sh (and by tests/unit/deploy/test_readme_sample.py, which
# renders the README's sample closing lines with it): the words of a run's summary.
# shellcheck shell=bash

fmt() { # SECONDS -> "N min S s"
    if [ "$1" -ge 60 ]; then echo "$(($1 / 60)) min $(($1 % 60)) s"; else echo "$1 s"; fi
}

debian() { # CODENAME: "Debian 12 (bookworm)"
    case $1 in bookworm) echo "Debian 12 ($1)" ;; trixie) echo "Debian 13 ($1)" ;; *) echo "$1" ;; esac
}

# CODENAME SLURM UNIT_PASSED UNIT_SKIPPED [CLUSTER_PASSED CLUSTER_SKIPPED ON]...: one
# host's line, e.g. "Debian 12 (bookworm) host: Slurm 22.05.8: 714 unit (2 skipped),
# 89 cluster passed"; ON is the Slurm a cluster tier ran ("24.11.5 in a chroot"), named
# only where there are several tiers.
host_summary() {
    local line="$(debian "$1") host: Slurm $2: $3 unit" passed=() skipped=() on=()
    [ "$4" = 0 ] || line+=" ($4 skipped)"
    shift 4
    while [ $# -ge 3 ]; do passed+=("$1") skipped+=("$2") on+=("$3"); shift 3; done
    if [ ${#passed[@]} -gt 0 ]; then
        line+=", $(IFS=+; echo "${passed[*]}") cluster"
        [ -z "$(echo "${skipped[@]}" | tr -d '0 ')" ] || line+=" ($(IFS=+; echo "${skipped[*]}") skipped)"
        line+=" passed"
        [ ${#passed[@]} -eq 1 ] || line+=" (Slurm $(IFS=+; echo "${on[*]}" | sed 's/+/ + /g'))"
    else
        line+=" passed"
    fi
    echo "$line"
}

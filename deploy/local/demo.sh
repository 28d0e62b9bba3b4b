#!/usr/bin/env bash
# The demo: a real local cluster running a real --tf-image job.
# Starts the cluster (packages, munge, registry, slurmctld, n1 and n2, images),
# then submits an ordinary sbatch script as the unprivileged test user.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
[ "$(id -u)" = 0 ] || { echo "demo: run as root" >&2; exit 1; }

bash "$REPO/deploy/local/cluster.sh" up
# shellcheck disable=SC1091
. "$REPO/build/cluster.env"

home=$(getent passwd "$TFIMAGE_TEST_USER" | cut -d: -f6)
dir=$home/tfimage-demo
install -d -o "$TFIMAGE_TEST_USER" "$dir"
cat >"$dir/train.sbatch" <<'JOB'
#!/bin/bash
#SBATCH --job-name=tfimage-demo
#SBATCH --tf-image=tf-custom:2.0
#SBATCH --nodes=2
#SBATCH --output=demo-%j.out
#SBATCH --error=demo-%j.err
# An ordinary batch script: the only tfimage line is the #SBATCH above.
export TF_CPP_MIN_LOG_LEVEL=3
echo "batch script on $(hostname) (host side, so srun works)"
srun python3 -c '
import os, tensorflow as tf
node = os.environ["SLURMD_NODENAME"]
image = open("/etc/tfimage-test-image").read().strip()
print(f"{node}: TensorFlow {tf.__version__} inside {image} as uid {os.getuid()}")
'
JOB
chown "$TFIMAGE_TEST_USER" "$dir/train.sbatch"

echo "demo: submitting $dir/train.sbatch as $TFIMAGE_TEST_USER"
cd "$dir"
out=$(setpriv --reuid "$TFIMAGE_TEST_USER" --regid "$TFIMAGE_TEST_USER" --init-groups \
      env HOME="$home" USER="$TFIMAGE_TEST_USER" sbatch --parsable --wait train.sbatch) || {
    echo "demo: the job failed" >&2; cat "$dir"/demo-*.out "$dir"/demo-*.err >&2 || true; exit 1; }
job=${out%%;*}
echo "demo: job $job finished; its output:"
echo "-----------------------------------------------------------------"
cat "$dir/demo-$job.out"
echo "-----------------------------------------------------------------"
echo "demo: the cluster is still up (. build/cluster.env to use it; make cluster-down to stop)"

#!/usr/bin/env bash
# The demo: a real local cluster running a real --tf-image job.
# Starts the cluster (packages, munge, registry, slurmctld, n1 and n2, images),
# then submits an ordinary sbatch script as the unprivileged test user.  As root:
#   bash deploy/local/demo.sh        (the cluster stays up; make cluster-down stops it)
set -euo pipefail
case "${1:-}" in
    -h | --help) sed -n '2,/^set -/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "usage: $(basename "$0") [--help]" >&2; exit 2 ;;
esac
REPO=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=deploy/local/err-trap.sh
. "$REPO/deploy/local/err-trap.sh" demo
[ "$(id -u)" = 0 ] || { echo "demo: run as root" >&2; exit 1; }

bash "$REPO/deploy/local/cluster.sh" up
# shellcheck disable=SC1091
. "$REPO/build/cluster.env"

home=$(getent passwd "$TFIMAGE_TEST_USER" | cut -d: -f6)
dir=$home/tfimage-demo
install -d -o "$TFIMAGE_TEST_USER" "$dir"
install -m 0644 -o "$TFIMAGE_TEST_USER" "$REPO/deploy/local/examples/mwms_train.py" "$dir/"
cat >"$dir/train.sbatch" <<'JOB'
#!/bin/bash
#SBATCH --job-name=tfimage-demo
#SBATCH --tf-image=tf-custom:2.0
#SBATCH --nodes=2 --ntasks-per-node=1
#SBATCH --output=demo-%j.out
#SBATCH --error=demo-%j.err
# An ordinary batch script: the only tfimage line is the #SBATCH above. No TF_CONFIG here.
export TF_CPP_MIN_LOG_LEVEL=3
echo "batch script on $(hostname) (host side, so srun works)"
srun python3 -c '
import os, tensorflow as tf
node = os.environ["SLURMD_NODENAME"]
image = open("/etc/tfimage-test-image").read().strip()
print(f"{node}: TensorFlow {tf.__version__} inside {image} as uid {os.getuid()}")
'
# Real MultiWorkerMirroredStrategy training across both nodes; SIGKILL guard, since
# a worker whose peer never starts ignores SIGTERM.
srun --kill-on-bad-exit=1 timeout -s KILL 300 python3 mwms_train.py
JOB
chown "$TFIMAGE_TEST_USER" "$dir/train.sbatch"

echo "demo: submitting $dir/train.sbatch as $TFIMAGE_TEST_USER"
cd "$dir"
failed() { echo "demo: $*" >&2; cat "$dir"/demo-*.out "$dir"/demo-*.err >&2 || true; exit 1; }
out=$(setpriv --reuid "$TFIMAGE_TEST_USER" --regid "$TFIMAGE_TEST_USER" --init-groups \
      env HOME="$home" USER="$TFIMAGE_TEST_USER" sbatch --parsable train.sbatch) \
    || failed "the submission failed"
job=${out%%;*}
# Its end, looked at every half second (sbatch --wait sleeps 2, 8, then 32 s between
# looks: it would see a 15 s job end at 42 s); the epilog's end too.
for ((i = 0; ; i++)); do
    shown=$(scontrol -o show job "$job") || failed "job $job: scontrol show job failed"
    case " $shown " in
        *" JobState=COMPLETED "*) break ;;
        *" JobState=PENDING "* | *" JobState=CONFIGURING "* | *" JobState=RUNNING "* \
            | *" JobState=COMPLETING "*) ;;
        *) failed "job $job failed: $(grep -oE 'JobState=[A-Z_]+|ExitCode=[0-9:]+|Reason=[^ ]+' <<<"$shown" | xargs)" ;;
    esac
    [ "$i" -lt 1200 ] || failed "job $job did not end within 10 minutes"
    sleep 0.5
done
echo "demo: job $job finished; its output:"
echo "-----------------------------------------------------------------"
cat "$dir/demo-$job.out"
echo "-----------------------------------------------------------------"
weights=$(grep -o 'weights [0-9a-f]*' "$dir/demo-$job.out" | sort -u)
if [ "$(grep -c '^WORKER ' "$dir/demo-$job.out")" = 2 ] && [ "$(echo "$weights" | wc -l)" = 1 ]; then
    echo "demo: both workers agree on the trained weights ($weights)"
else
    echo "demo: the workers do not agree" >&2; exit 1
fi
echo "demo: the cluster is still up (. build/cluster.env to use it; make cluster-down to stop)"

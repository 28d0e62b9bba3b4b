"""Walking skeleton: --tf-image puts real jobs into real SIF images on two nodes."""

from __future__ import annotations

import json
import os
import pwd
import re
import time
from pathlib import Path

import pytest
from conftest import Cluster

pytestmark = pytest.mark.cluster
# Every mount tfimage makes: a job's own, and the images jobs share (none once no job
# that uses one runs).
TFIMAGE_MOUNTS = ("/run/tfimage/jobs/", "/run/tfimage/images/")


def test_srun_two_nodes_inside_image(cluster: Cluster, workdir: Path) -> None:
    r = cluster.run(
        [
            "srun",
            "-N2",
            "--tf-image=tiny:1.0",
            "sh",
            "-c",
            'echo "$(cat /etc/tfimage-test-image) $SLURMD_NODENAME $(id -u) $(pwd)"',
        ],
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    uid = pwd.getpwnam(cluster.user).pw_uid
    lines = sorted(r.stdout.split("\n")[:-1])
    assert lines == [f"tiny:1.0 n1 {uid} {workdir}", f"tiny:1.0 n2 {uid} {workdir}"]


def test_sbatch_single_task_script_runs_inside_image(cluster: Cluster, workdir: Path) -> None:
    r, out = cluster.sbatch(
        workdir,
        "job.sh",
        (
            "#!/bin/sh\n#SBATCH --tf-image=tiny:1.0\n#SBATCH -o out.txt\n"
            'echo "marker=$(cat /etc/tfimage-test-image) pwd=$(pwd) uid=$(id -u)"\n'
            "echo written-in-image > result.txt\n"
        ),
        "out.txt",
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    uid = pwd.getpwnam(cluster.user).pw_uid
    assert f"marker=tiny:1.0 pwd={workdir} uid={uid}" in out
    # The job wrote through the bind into the user's real directory, as the user.
    assert (workdir / "result.txt").read_text() == "written-in-image\n"
    assert (workdir / "result.txt").stat().st_uid == uid


def test_srun_in_a_one_task_script_in_the_image_says_what_to_do(
    cluster: Cluster, workdir: Path
) -> None:
    r, out = cluster.sbatch(
        workdir,
        "job.sh",
        (
            "#!/bin/sh\n#SBATCH --tf-image=tiny:1.0\n#SBATCH -o out.txt\n"
            'srun hostname\necho "srun=$?"\nscontrol show job\necho "scontrol=$?"\n'
        ),
        "out.txt",
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tfimage: srun: this batch script runs inside the image" in out, out
    assert "--tf-batch=host" in out and "srun=127" in out and "scontrol=127" in out, out
    assert "not found" not in out


def test_multi_node_batch_runs_on_host_and_srun_inherits_image(
    cluster: Cluster, workdir: Path
) -> None:
    r, out = cluster.sbatch(
        workdir,
        "job.sh",
        (
            "#!/bin/sh\n#SBATCH --tf-image=tiny:1.0\n#SBATCH -N2\n#SBATCH -o out.txt\n"
            'echo "batch marker=$(cat /etc/tfimage-test-image 2>/dev/null || echo host)"\n'
            "srun sh -c 'echo \"step $SLURMD_NODENAME $(cat /etc/tfimage-test-image)\"'\n"
        ),
        "out.txt",
        timeout=180,
    )
    assert r.returncode == 0, out
    assert "batch marker=host" in out
    assert sorted(re.findall(r"step (n\d) (\S+)", out)) == [("n1", "tiny:1.0"), ("n2", "tiny:1.0")]


def test_job_without_option_is_untouched(cluster: Cluster, workdir: Path) -> None:
    r = cluster.run(
        [
            "srun",
            "-N2",
            "sh",
            "-c",
            'echo "$(test -e /etc/tfimage-test-image && echo image || echo host)'
            ' $(grep -c /run/tfimage/jobs/ /proc/self/mountinfo) $(stat -c %i /)"',
        ],
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    # The node's own root: the machine's, or the other Slurm's tree.
    host_root_inode = str(Path(cluster.chroot or "/").stat().st_ino)
    assert r.stdout.split("\n")[:-1] == [f"host 0 {host_root_inode}"] * 2


@pytest.mark.parametrize("cmd", ["srun", "sbatch"])
@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ("Bad Ref", "whitespace"),
        ("tiny@sha256:xyz", "digest"),
        ("evil.example/x/y:1", "not allowed"),
        # what users type from habit: a file, pyxis's registry#image
        ("/home/tfuser/tf.sif", "is a file; --tf-image takes an image in the registry"),
        ("./tf.sif", r"push it first \(tfimage push FILE NAME:TAG\)"),
        ("nvcr.io#nvidia/tensorflow:24.01", "tfimage's is registry/image: nvcr.io/nvidia/"),
    ],
)
def test_invalid_reference_rejected_before_queueing(
    cluster: Cluster, workdir: Path, cmd: str, ref: str, why: str
) -> None:
    before = cluster.job_ids()
    argv = [cmd, f"--tf-image={ref}"] + (["--wrap", "true"] if cmd == "sbatch" else ["true"])
    r = cluster.run(argv, cwd=workdir, timeout=60)
    assert r.returncode != 0
    assert re.search(rf"tfimage: submit: .*{why}", r.stderr), r.stderr
    assert "Traceback" not in r.stderr
    assert cluster.job_ids() <= before  # nothing queued (old ones may age out)


def test_root_tasks_are_refused_with_a_message(cluster: Cluster, workdir: Path) -> None:
    r = cluster.run(["srun", "-N1", "--tf-image=tiny:1.0", "true"], cwd=workdir, as_root=True)
    assert r.returncode != 0
    assert "refusing to run a container task as root" in r.stderr


def test_an_image_that_is_not_there_is_rejected_at_submit(cluster: Cluster, workdir: Path) -> None:
    before = cluster.job_ids()
    r = cluster.run(["srun", "-N1", "--tf-image=no-such-image:1.0", "true"], cwd=workdir)
    assert r.returncode != 0
    registry = cluster.env["TFIMAGE_REGISTRY"]
    said = f"tfimage: submit: {registry}/library/no-such-image: no such repository, or not"
    assert said in r.stderr, r.stderr  # test_adoption.py: the tag typo's "did you mean"
    assert cluster.job_ids() <= before  # nothing queued (old ones may age out)


def test_image_that_cannot_be_pulled_fails_job_and_node_stays_up(
    cluster: Cluster, workdir: Path
) -> None:
    # Already pinned, so submit asks no registry; the pull on the node then fails.
    missing = "tiny@sha256:" + "0" * 64
    r = cluster.run(["srun", "-N1", "-w", "n1", f"--tf-image={missing}", "true"], cwd=workdir)
    assert r.returncode != 0
    assert f"tfimage: prepare {missing}" in r.stderr and "not found" in r.stderr, r.stderr
    cluster.assert_never_drained("n1")


def test_epilog_leaves_no_mounts_and_no_holds(cluster: Cluster, workdir: Path) -> None:
    r = cluster.run(
        [
            "srun",
            "-N2",
            "--tf-image=tiny:1.0",
            "sh",
            "-c",
            'echo "$SLURM_JOB_ID $(ls /run 2>/dev/null | wc -l)"',
        ],
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    job = r.stdout.split()[0]
    for node in ("n1", "n2"):
        cache = cluster.state / "nodes" / node / "cache" / "images"
        for _ in range(50):
            left = [m for m in cluster.node_mounts(node) if m.startswith(TFIMAGE_MOUNTS)]
            held = [
                p.name
                for p in cache.glob("*.json")
                if job in json.loads(p.read_text()).get("holders", [])
            ]
            if not left and not held:
                break
            time.sleep(0.2)
        assert left == [], f"{node} still has {left}"
        assert held == [], f"job {job} still holds {held} on {node}"


def test_tensorflow_job_prints_version_on_both_nodes(cluster: Cluster, workdir: Path) -> None:
    r, out = cluster.sbatch(
        workdir,
        "tf.sh",
        (
            "#!/bin/bash\n#SBATCH --tf-image=tf-custom:2.0\n#SBATCH -N2\n#SBATCH -o out.txt\n"
            "export TF_CPP_MIN_LOG_LEVEL=3\n"
            "srun python3 -c 'import os, tensorflow as tf; "
            'print("TF", os.environ["SLURMD_NODENAME"], tf.__version__, '
            'open("/etc/tfimage-test-image").read().strip())\'\n'
        ),
        "out.txt",
        timeout=600,
    )
    assert r.returncode == 0, out
    found = sorted(re.findall(r"^TF (n\d) (\d+\.\d+\.\d+) tf-custom:2.0$", out, re.M))
    assert [n for n, _ in found] == ["n1", "n2"], out
    assert found[0][1] == found[1][1]


def test_chdir_elsewhere_than_pwd_is_honoured(cluster: Cluster, workdir: Path) -> None:
    """The task's real working directory wins over a stale $PWD (srun -D)."""
    sub = workdir / "elsewhere"
    sub.mkdir()
    pw = pwd.getpwnam(cluster.user)
    os.chown(sub, pw.pw_uid, pw.pw_gid)
    r = cluster.run(
        [
            "srun",
            "-N1",
            "-D",
            str(sub),
            "--tf-image=tiny:1.0",
            "sh",
            "-c",
            "pwd; cat /etc/tfimage-test-image",
        ],
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(sub), "tiny:1.0"]


def test_tf_mount_or_tf_batch_without_an_image_is_said_once_not_ignored(
    cluster: Cluster, workdir: Path
) -> None:
    r = cluster.run(["srun", "-N1", "--tf-mount=/home:/mnt", "--tf-batch=host", "true"],
                    cwd=workdir)  # fmt: skip
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stderr.splitlines() if "tfimage:" in line]
    assert len(said) == 1 and said[0].endswith(
        "tfimage: --tf-mount and --tf-batch: no effect without --tf-image; add --tf-image=NAME:TAG"
    ), r.stderr
    plain = cluster.run(["srun", "-N1", "true"], cwd=workdir)
    assert plain.returncode == 0 and "tfimage" not in plain.stderr, plain.stderr

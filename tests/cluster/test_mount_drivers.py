"""Image mount drivers on the cluster: the site's policy picks the kernel's squashfs for
trusted repositories alone, FUSE elsewhere; every mount nosuid,nodev; nothing (no
mount, no loop device) outlives the job, even one cancelled mid-step."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from conftest import Cluster

pytestmark = pytest.mark.cluster
POLICY = {
    "image_mount": ["kernel", "squashfuse_ll", "squashfuse"],
    "image_mount_kernel": ["library/tf-*"],
}


def _image_mounts(cluster: Cluster, node: str, job: str) -> list[tuple[str, set[str]]]:
    """(fstype, options) of the job's image mounts inside the node's namespace."""
    out = []
    with open(f"/proc/{cluster.node_pid(node)}/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4].startswith(f"/run/tfimage/jobs/{job}/img-"):
                out.append((fields[fields.index("-") + 1], set(fields[5].split(","))))
    return out


def _loops(cluster: Cluster, node: str) -> str:
    return cluster.on_node(node, ["losetup", "-a"]).stdout


def _waiting_job(cluster: Cluster, workdir: Path, image: str) -> tuple[subprocess.Popen[str], str]:
    go = workdir / "go"
    p = cluster.start(["srun", "-N1", "-w", "n1", f"--tf-image={image}", "sh", "-c",
                       f'echo "job $SLURM_JOB_ID"; while [ ! -e {go} ]; do sleep 0.2; done'],
                      workdir)  # fmt: skip
    assert p.stdout is not None
    return p, p.stdout.readline().split()[1]


def _forget(cluster: Cluster, image: str) -> None:
    ref = cluster.run(["tfimage", "resolve", image], as_root=True).stdout.strip()
    tfimage = ["/opt/tfimage/bin/tfimage", "--config", cluster.env["TFIMAGE_CONFIG"]]
    cluster.on_node("n1", [*tfimage, "cache", "rm", ref.rpartition("@")[2], "--force"])


def _gone(cluster: Cluster, job: str) -> tuple[list[tuple[str, set[str]]], str]:
    for _ in range(100):
        mounts, loops = _image_mounts(cluster, "n1", job), _loops(cluster, "n1")
        if not mounts and "sha256-" not in loops:
            break
        time.sleep(0.2)
    return mounts, loops


@pytest.mark.parametrize(
    ("image", "fstype"), [("tf-custom:2.0", "squashfs"), ("tiny:1.0", "fuse.squashfuse_ll")]
)
def test_the_policy_mounts_trusted_images_with_the_kernel_and_others_with_fuse(
    cluster: Cluster, workdir: Path, image: str, fstype: str
) -> None:
    # Trust goes by where the cached bytes came from: an entry cached before tfimage
    # kept that (a cluster's cache outlives it) is pulled again to know.
    _forget(cluster, image)
    with cluster.config_with(**POLICY):
        p, job = _waiting_job(cluster, workdir, image)
        try:
            mounts = _image_mounts(cluster, "n1", job)
            loops = _loops(cluster, "n1")
        finally:
            (workdir / "go").touch()
            _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert [m[0] for m in mounts] == [fstype], mounts
    assert {"ro", "nosuid", "nodev"} <= mounts[0][1]
    assert ("sha256-" in loops) == (fstype == "squashfs"), loops  # the SIF's loop device
    mounts, loops = _gone(cluster, job)
    assert mounts == [] and "sha256-" not in loops, (mounts, loops)


def test_a_job_cancelled_mid_step_leaves_no_mount_and_no_loop_device(
    cluster: Cluster, workdir: Path
) -> None:
    _forget(cluster, "tf-custom:2.0")
    with cluster.config_with(**POLICY):
        p, job = _waiting_job(cluster, workdir, "tf-custom:2.0")
        assert [m[0] for m in _image_mounts(cluster, "n1", job)] == ["squashfs"]
        r = cluster.run(["scancel", job], as_root=True)
        assert r.returncode == 0, r.stderr
        p.communicate(timeout=120)
    mounts, loops = _gone(cluster, job)
    assert mounts == [] and "sha256-" not in loops, (mounts, loops)
    cluster.assert_never_drained("n1")


def test_the_default_is_fuse_for_every_image(cluster: Cluster, workdir: Path) -> None:
    p, job = _waiting_job(cluster, workdir, "tf-custom:2.0")
    try:
        mounts = _image_mounts(cluster, "n1", job)
    finally:
        (workdir / "go").touch()
        p.communicate(timeout=120)
    assert [m[0] for m in mounts] == ["fuse.squashfuse_ll"]

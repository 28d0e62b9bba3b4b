"""Image mounts on the cluster: the site's policy picks the kernel's squashfs for
trusted repositories alone, FUSE elsewhere; every mount nosuid,nodev; jobs on a node
share one mount per image; nothing (no mount, no loop device) outlives the last job
using it, even one cancelled mid-step."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from conftest import Cluster

from support import wait_for

pytestmark = pytest.mark.cluster
POLICY = {
    "image_mount": ["kernel", "squashfuse_ll", "squashfuse"],
    "image_mount_kernel": ["library/tf-*"],
}


def _image_mounts(cluster: Cluster, node: str, job: str) -> dict[str, tuple[str, set[str]]]:
    """{mount point: (fstype, options)} of the image mounts the job's steps run on."""
    return {
        target: how
        for target, how in cluster.job_mounts(node, job).items()
        if target.startswith("/run/tfimage/images/") or "/img-" in target
    }


def _loops(cluster: Cluster, node: str) -> str:
    return cluster.on_node(node, ["losetup", "-a"]).stdout


def _waiting_job(
    cluster: Cluster, workdir: Path, image: str, go_name: str = "go"
) -> tuple[subprocess.Popen[str], str]:
    go = workdir / go_name
    p = cluster.start(["srun", "-N1", "-w", "n1", f"--tf-image={image}", "sh", "-c",
                       f'echo "job $SLURM_JOB_ID"; while [ ! -e {go} ]; do sleep 0.2; done'],
                      workdir)  # fmt: skip
    assert p.stdout is not None
    return p, p.stdout.readline().split()[1]


def _forget(cluster: Cluster, image: str) -> None:
    ref = cluster.run(["tfimage", "resolve", image], as_root=True).stdout.strip()
    tfimage = ["/opt/tfimage/bin/tfimage", "--config", cluster.env["TFIMAGE_CONFIG"]]
    cluster.on_node("n1", [*tfimage, "cache", "rm", ref.rpartition("@")[2], "--force"])


def _gone(cluster: Cluster, targets: Iterable[str]) -> tuple[list[str], str]:
    """The mounts of ``targets`` still on n1 and its loop devices, once gone (20 s)."""
    for _ in range(100):
        mounts = [m for m in cluster.node_mounts("n1") if m in set(targets)]
        loops = _loops(cluster, "n1")
        if not mounts and "sha256-" not in loops:
            break
        time.sleep(0.2)
    return mounts, loops


def _mounted_under_policy(
    cluster: Cluster, workdir: Path, image: str
) -> tuple[dict[str, tuple[str, set[str]]], str]:
    """A job of ``image`` on n1 under POLICY: its image mounts and n1's loop devices
    while it ran (it must end well)."""
    with cluster.config_with(**POLICY):
        p, job = _waiting_job(cluster, workdir, image)
        try:
            mounts = _image_mounts(cluster, "n1", job)
            loops = _loops(cluster, "n1")
        finally:
            (workdir / "go").touch()
            _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    return mounts, loops


def _holders(cluster: Cluster, node: str) -> set[str]:
    cache = cluster.state / "nodes" / node / "cache" / "images"
    return {h for p in cache.glob("*.json") for h in json.loads(p.read_text()).get("holders", [])}


@pytest.mark.parametrize(
    ("image", "fstype"), [("tf-custom:2.0", "squashfs"), ("tiny:1.0", "fuse.squashfuse_ll")]
)
def test_the_policy_mounts_trusted_images_with_the_kernel_and_others_with_fuse(
    cluster: Cluster, workdir: Path, image: str, fstype: str
) -> None:
    # Trust goes by where the cached bytes came from: an entry cached before tfimage
    # kept that (a cluster's cache outlives it) is pulled again to know.
    _forget(cluster, image)
    mounts, loops = _mounted_under_policy(cluster, workdir, image)
    assert [m[0] for m in mounts.values()] == [fstype], mounts
    assert {"ro", "nosuid", "nodev"} <= next(iter(mounts.values()))[1]
    assert ("sha256-" in loops) == (fstype == "squashfs"), loops  # the SIF's loop device
    left, loops = _gone(cluster, mounts)
    assert left == [] and "sha256-" not in loops, (left, loops)


def test_a_trusted_name_with_an_untrusted_images_digest_is_mounted_by_fuse(
    cluster: Cluster, workdir: Path
) -> None:
    """The real path: tiny:1.0's bytes, cached on n1 from library/tiny (not trusted),
    named by a job as library/tf-custom@<their digest> (a trusted name).  Trust
    follows where the bytes came from, so the kernel never parses them."""
    _forget(cluster, "tiny:1.0")
    cached = cluster.run(["srun", "-N1", "-w", "n1", "--tf-image=tiny:1.0", "true"], cwd=workdir)
    assert cached.returncode == 0, cached.stderr
    ref = cluster.run(["tfimage", "resolve", "tiny:1.0"], as_root=True).stdout.strip()
    digest = ref.rpartition("@")[2]
    assert digest.startswith("sha256:"), ref
    mounts, loops = _mounted_under_policy(cluster, workdir, f"library/tf-custom@{digest}")
    assert [m[0] for m in mounts.values()] == ["fuse.squashfuse_ll"], mounts
    assert "sha256-" not in loops, loops  # no loop device: the kernel never read it


def test_a_job_cancelled_mid_step_leaves_no_mount_and_no_loop_device(
    cluster: Cluster, workdir: Path
) -> None:
    _forget(cluster, "tf-custom:2.0")
    with cluster.config_with(**POLICY):
        p, job = _waiting_job(cluster, workdir, "tf-custom:2.0")
        mounts = _image_mounts(cluster, "n1", job)
        assert [m[0] for m in mounts.values()] == ["squashfs"]
        r = cluster.run(["scancel", job], as_root=True)
        assert r.returncode == 0, r.stderr
        p.communicate(timeout=120)
    left, loops = _gone(cluster, mounts)
    assert left == [] and "sha256-" not in loops, (left, loops)
    cluster.assert_never_drained("n1")


def test_the_default_is_fuse_for_every_image(cluster: Cluster, workdir: Path) -> None:
    p, job = _waiting_job(cluster, workdir, "tf-custom:2.0")
    try:
        mounts = _image_mounts(cluster, "n1", job)
    finally:
        (workdir / "go").touch()
        p.communicate(timeout=120)
    assert [m[0] for m in mounts.values()] == ["fuse.squashfuse_ll"]


def test_jobs_on_a_node_share_one_image_mount_until_the_last_one_ends(
    cluster: Cluster, workdir: Path
) -> None:
    first, a = _waiting_job(cluster, workdir, "tiny:1.0", "go-a")
    second, b = _waiting_job(cluster, workdir, "tiny:1.0", "go-b")
    try:
        shared = _image_mounts(cluster, "n1", a)
        assert len(shared) == 1 and shared == _image_mounts(cluster, "n1", b), (shared, b)
        (target,) = shared
        assert cluster.node_mounts("n1").count(target) == 1  # mounted once, for both
        # The first job ends: its epilog leaves the image to the second.
        (workdir / "go-a").touch()
        _, err = first.communicate(timeout=120)
        assert first.returncode == 0, err
        wait_for(lambda: a not in _holders(cluster, "n1") and not cluster.job_mounts("n1", a),
                 what=f"job {a}'s epilog", interval=0.2)  # fmt: skip
        assert cluster.node_mounts("n1").count(target) == 1
        assert _image_mounts(cluster, "n1", b) == shared
        r = cluster.run(["srun", f"--jobid={b}", "--overlap", "-w", "n1", "--tf-image=tiny:1.0",
                         "cat", "/etc/tfimage-test-image"], cwd=workdir)  # fmt: skip
        assert r.returncode == 0, r.stderr  # a new step of the second job still runs on it
    finally:
        (workdir / "go-a").touch()
        (workdir / "go-b").touch()
        _, err = second.communicate(timeout=120)
        first.communicate(timeout=120)
    assert second.returncode == 0, err
    left, _ = _gone(cluster, shared)
    assert left == [], left  # the last job gone, so is the mount

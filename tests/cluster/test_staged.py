"""A copy staged on the job's nodes before their prologs run (as the controller's
sbcast leaves it: test_stage.py), on the real cluster: adopted when it is exactly
the pinned image, so a registry stopped meanwhile is never missed; a corrupt copy
refused and the image pulled; a node that holds the image discards the copy."""

from __future__ import annotations

import json
import os
import pwd
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import Cluster, busybox_sif, push, site_registry, write_script
from test_promises import registry_stopped

from support import wait_for
from tfimage.agent.core import layout

pytestmark = pytest.mark.cluster
NODES = ("n1", "n2")


def _stage(
    cluster: Cluster,
    node: str,
    digest: str,
    job: str,
    manifest: bytes,
    sif: bytes,
    owner: str = "",
) -> None:
    """Both files in the node's staged/, owned by the job's user as Slurm 22.05's
    sbcast writes them (it refuses a broadcast to a job from anyone else), or by
    ``owner``: root's, the controller's own broadcast cannot replace them."""
    cache = cluster.state / "nodes" / node / "cache"
    user = pwd.getpwnam(owner or cluster.user)
    for path, data in zip(layout.cache_staged(cache, digest, job), (manifest, sif), strict=True):
        path.write_bytes(data)
        os.chown(path, user.pw_uid, user.pw_gid)
        path.chmod(0o600)


@contextmanager
def _held_job(cluster: Cluster, workdir: Path, image: str, name: str) -> Iterator[str]:
    """A two-node job submitted held (pinned already), released by the caller's
    block's end, waited for to its end."""
    write_script(
        workdir,
        f"{name}.sh",
        f"#!/bin/sh\n#SBATCH -N2 -n2 --tf-image={image} -o {name}.out\n"
        "srun cat /etc/tfimage-test-image\n",
        cluster.user,
    )
    job = cluster.submit(workdir, "--hold", f"{name}.sh")
    try:
        yield job
    finally:
        _release(cluster, job)


def _release(cluster: Cluster, job: str) -> None:
    """Release the held ``job`` and wait for its end (again: a no-op)."""
    cluster.run(["scontrol", "release", job], as_root=True)
    wait_for(
        lambda: not cluster.run(["squeue", "-h", "-j", job], as_root=True).stdout.strip(),
        timeout=240,
        what=f"job {job} to end",
        interval=0.5,
    )


def _record(cluster: Cluster, node: str, job: str) -> dict[str, object]:
    """The node's usage record of ``job`` (its epilog writes it as the job ends)."""
    path = cluster.state / "nodes" / node / "log" / "usage.jsonl"

    def found() -> list[dict[str, object]]:
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(x) for x in lines if json.loads(x)["job_id"] == job]

    wait_for(lambda: bool(found()), timeout=30, what=f"job {job}'s record on {node}")
    return found()[-1]


@pytest.fixture
def image(cluster: Cluster, tmp_path: Path) -> tuple[str, str, bytes, bytes]:
    """A fresh image (on no node yet): its name, digest, manifest bytes and SIF."""
    marker = f"staged-{os.urandom(4).hex()}"
    sif = busybox_sif(tmp_path, marker)
    name = f"{marker}:1"
    digest = push(cluster, sif, name)
    manifest = site_registry(cluster).manifest_bytes(f"library/{marker}", "1")
    return name, digest, manifest, sif.read_bytes()


def test_staged_copies_are_adopted_and_the_registry_is_not_needed(
    cluster: Cluster, workdir: Path, image: tuple[str, str, bytes, bytes]
) -> None:
    name, digest, manifest, sif = image
    marker = name.split(":")[0]
    with _held_job(cluster, workdir, name, "adopt") as job:
        for node in NODES:
            _stage(cluster, node, digest, job, manifest, sif)
        # From here no node could fetch a byte: a pull would fail the job.
        with cluster.config_with(connect_timeout=1, read_timeout=2), registry_stopped(cluster):
            _release(cluster, job)
    assert (workdir / "adopt.out").read_text().split() == [marker, marker]
    for node in NODES:
        rec = _record(cluster, node, job)
        assert (rec["cache"], rec["source"], rec["pull_bytes"]) == ("staged", "staged", 0), rec
        assert any(
            f"job {job}: " in line and "adopted the copy staged for the job" in line
            for line in cluster.hooks_log(node)
        )
        cache = cluster.state / "nodes" / node / "cache"
        assert not any(p.exists() for p in layout.cache_staged(cache, digest, job))
        cluster.assert_never_drained(node)


def test_a_corrupt_staged_copy_is_refused_and_the_node_pulls(
    cluster: Cluster, workdir: Path, image: tuple[str, str, bytes, bytes]
) -> None:
    name, digest, manifest, sif = image
    evil = bytearray(sif)
    evil[-1] ^= 0xFF
    with _held_job(cluster, workdir, name, "corrupt") as job:
        _stage(cluster, "n2", digest, job, manifest, bytes(evil), owner="root")
    assert (workdir / "corrupt.out").read_text().split() == [name.split(":")[0]] * 2
    rec = _record(cluster, "n2", job)
    assert rec["cache"] == "miss" and rec["source"] == cluster.env["TFIMAGE_REGISTRY"], rec
    log = [line for line in cluster.hooks_log("n2") if f"job {job}: " in line]
    assert any("staged copy refused: SIF: its sha256 is not the layer's" in x for x in log), log
    cluster.assert_never_drained("n2")


def test_a_node_that_holds_the_image_discards_the_staged_copy(
    cluster: Cluster, workdir: Path, image: tuple[str, str, bytes, bytes]
) -> None:
    name, digest, manifest, sif = image
    with _held_job(cluster, workdir, name, "first"):
        pass  # both nodes pull and hold it
    with _held_job(cluster, workdir, name, "again") as job:
        _stage(cluster, "n2", digest, job, manifest, sif)
    rec = _record(cluster, "n2", job)
    assert rec["cache"] == "hit", rec
    cache = cluster.state / "nodes" / "n2" / "cache"
    assert not any(p.exists() for p in layout.cache_staged(cache, digest, job))

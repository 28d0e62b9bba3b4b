"""One pull per multi-node job, on the real cluster's four nodes: slurmctld's
PrologSlurmctld (the stage hook) pulls the image once and sbcast carries it down
Slurm's tree; the registry's own access log is the witness of what it served."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from conftest import Cluster, busybox_sif, push, site_registry, tfimage_here, write_script
from test_promises import registry_stopped

from support import wait_for
from tfimage.agent.core import layout
from tfimage.agent.core.hostlist import expand_hostlist

pytestmark = pytest.mark.cluster
NODES = ("n1", "n2", "n3", "n4")


@pytest.fixture(autouse=True)
def four_nodes_staging(cluster: Cluster) -> None:
    names = cluster.env.get("TFIMAGE_NODE_NAMES", "").split()
    if len(names) < len(NODES):
        pytest.skip("needs a cluster of 4 nodes (TFIMAGE_NODES=4 make cluster-up; CI's is)")
    if cluster.env.get("TFIMAGE_STAGE") != "1":
        pytest.skip("the cluster runs without the stage hook (TFIMAGE_STAGE=0)")


class Image:
    """A fresh image (on no node, in no staging cache): its name, digest and layer."""

    def __init__(self, cluster: Cluster, tmp_path: Path, what: str) -> None:
        self.marker = f"{what}-{os.urandom(4).hex()}"
        self.name = f"{self.marker}:1"
        self.digest = push(cluster, busybox_sif(tmp_path, self.marker), self.name)
        raw = site_registry(cluster).manifest_bytes(f"library/{self.marker}", "1")
        layer = json.loads(raw)["layers"][0]
        self.blob, self.size = str(layer["digest"]), int(layer["size"])


def _blob_gets(cluster: Cluster, blob: str) -> list[tuple[int, int]]:
    """Each GET of ``blob`` the registry served to tfimage itself (no User-Agent; the
    rack mirror's Go client sends one: test_rack_mirror.py counts those), from its
    access log: (status, bytes).  A 206 is a Range read of the SIF's head (the pin
    at submit checks it)."""
    log = (cluster.state / "log" / "registry.log").read_text(errors="replace")
    pat = re.compile(
        rf'"GET /v2/[^ ]*/blobs/{re.escape(blob)} HTTP/[0-9.]+" (\d+) (\d+) "[^"]*" ""'
    )
    return [(int(m[1]), int(m[2])) for m in pat.finditer(log) if m[1] in ("200", "206")]


def _direct(cluster: Cluster) -> int:
    """How many of NODES pull from the registry itself, not through the rack mirror."""
    behind = cluster.env.get("TFIMAGE_MIRROR_NODES", "")
    return len(NODES) - (len(expand_hostlist(behind)) if behind else 0)


def _whole(gets: list[tuple[int, int]]) -> int:
    return sum(1 for status, _ in gets if status == 200)


def _stage_log(cluster: Cluster, job: str, image: Image) -> list[str]:
    """The controller's hook log lines for ``job`` and ``image`` (this host's, or the
    chroot's; it outlives the cluster, and job ids start again at 1 with it)."""
    path = Path(cluster.chroot or "/") / "var/log/tfimage/hooks.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return [
        x
        for x in lines
        if "tfimage-stage:" in x and f" job {job}: stage: " in x and image.marker in x
    ]


def _node_line(cluster: Cluster, node: str, job: str) -> str:
    lines = [x for x in cluster.hooks_log(node) if "tfimage-prolog:" in x and f"job {job}: " in x]
    return lines[-1] if lines else ""


def _run_job(cluster: Cluster, workdir: Path, image: Image, name: str) -> str:
    """A 4-node job printing the image's marker from each node; its id (it passed)."""
    write_script(
        workdir,
        f"{name}.sh",
        f"#!/bin/sh\n#SBATCH -p all -N4 -n4 --tf-image={image.name} -o {name}.out\n"
        "srun cat /etc/tfimage-test-image\n",
        cluster.user,
    )
    r, job = cluster.sbatch_wait(workdir, f"{name}.sh")
    assert r.returncode == 0, r.stderr
    assert (workdir / f"{name}.out").read_text().split() == [image.marker] * 4
    return job


def _cached(cluster: Cluster, node: str, digest: str) -> bool:
    return layout.cache_sif(cluster.state / "nodes" / node / "cache", digest).exists()


def test_a_cold_four_node_job_is_pulled_once_and_a_warm_one_pays_nothing(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    image = Image(cluster, tmp_path, "stage-cold")
    job = _run_job(cluster, workdir, image, "cold")
    served = _blob_gets(cluster, image.blob)
    assert _whole(served) == 1 and sum(n for _, n in served) <= 1.1 * image.size, served
    assert all(_cached(cluster, n, image.digest) for n in NODES)
    [line] = _stage_log(cluster, job, image)
    assert "sent to 4 of 4 nodes" in line and "(pulled once)" in line, line
    for node in NODES:
        assert "adopted the copy staged for the job" in _node_line(cluster, node, job), node
        cluster.assert_never_drained(node)

    again = _run_job(cluster, workdir, image, "warm")
    # No fetch of the blob since the first job's (the pin at submit reads its head again).
    assert _whole(_blob_gets(cluster, image.blob)) == 1
    assert _stage_log(cluster, again, image) == [], "the warm job's stage hook logged (or sent)"
    for node in NODES:
        assert "cache hit" in _node_line(cluster, node, again), node


def test_a_corrupt_staging_copy_is_refused_by_every_node_and_each_pulls(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    image = Image(cluster, tmp_path, "stage-corrupt")
    staging = cluster.state / "stage"
    pulled = tfimage_here(cluster, "cache", "--stage", "pull", f"{image.marker}@{image.digest}")
    assert pulled.returncode == 0, pulled.stderr
    sif = layout.cache_sif(staging, image.digest)
    sif.chmod(0o644)
    with sif.open("r+b") as f:  # its last byte flipped, its size the same
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    job = _run_job(cluster, workdir, image, "corrupt")
    [line] = _stage_log(cluster, job, image)
    assert "sent to 4 of 4 nodes" in line and "(from the staging cache)" in line, line
    # the staging pull, then each node (those behind the rack mirror, through it)
    assert _whole(_blob_gets(cluster, image.blob)) == 1 + _direct(cluster)
    for node in NODES:
        refused = [
            x
            for x in cluster.hooks_log(node)
            if f"job {job}: staged copy refused: SIF: its sha256 is not the layer's" in x
        ]
        assert refused, node
        assert "pulled from" in _node_line(cluster, node, job), node
        cluster.assert_never_drained(node)


def test_a_refused_broadcast_is_one_line_and_every_node_pulls(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    """staged/ made root's 0755 on every node: slurmd, writing as the job's user, is
    refused (the node's own prolog puts the mode back before it looks)."""
    image = Image(cluster, tmp_path, "stage-refused")
    for node in NODES:
        (cluster.state / "nodes" / node / "cache" / "staged").chmod(0o755)
    job = _run_job(cluster, workdir, image, "refused")
    [line] = _stage_log(cluster, job, image)
    assert "stage: sbcast:" in line and "each node without a good copy pulls" in line, line
    for node in NODES:
        assert "pulled from" in _node_line(cluster, node, job), node
        staged = cluster.state / "nodes" / node / "cache" / "staged"
        assert staged.stat().st_mode & 0o7777 == layout.STAGED_MODE
        cluster.assert_never_drained(node)
    # The ledger records only what was sent: the next job is sent it from the staging
    # cache, and each node, which pulled it, counts a hit and drops the copy.
    again = _run_job(cluster, workdir, image, "after")
    [line] = _stage_log(cluster, again, image)
    assert "sent to 4 of 4 nodes" in line and "(from the staging cache)" in line, line
    for node in NODES:
        assert "cache hit" in _node_line(cluster, node, again), node
        assert layout.cache_staged_of_job(cluster.state / "nodes" / node / "cache", again) == []


def test_a_job_cancelled_while_it_configures_leaves_nothing_behind(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    image = Image(cluster, tmp_path, "stage-cancel")
    write_script(
        workdir,
        "cancel.sh",
        f"#!/bin/sh\n#SBATCH -p all -N4 -n4 --tf-image={image.name} -o cancel.out\nsrun true\n",
        cluster.user,
    )
    job = cluster.submit(workdir, "--hold", "cancel.sh")  # pinned while the registry answers
    with cluster.config_with(connect_timeout=1, read_timeout=3), registry_stopped(cluster):
        assert cluster.run(["scontrol", "release", job], as_root=True).returncode == 0

        def configuring() -> bool:
            r = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"], as_root=True)
            return r.stdout.strip() == "CONFIGURING"

        wait_for(configuring, timeout=60, what=f"job {job} to configure", interval=0.2)
        assert cluster.run(["scancel", job], as_root=True).returncode == 0
    wait_for(
        lambda: not cluster.run(["squeue", "-h", "-j", job], as_root=True).stdout.strip(),
        timeout=120,
        what=f"job {job} to end",
        interval=0.5,
    )
    wait_for(
        lambda: bool(_stage_log(cluster, job, image)), timeout=60, what="the stage hook's line"
    )
    time.sleep(1)
    with cluster.config_with(cache_min_age=1):
        for node in NODES:
            r = cluster.on_node(node, ["/opt/tfimage/bin/tfimage", "cache", "prune"])
            assert r.returncode == 0, r.stderr
        r = tfimage_here(cluster, "cache", "--stage", "prune")
        assert r.returncode == 0, r.stderr
    for node in NODES:
        cache = cluster.state / "nodes" / node / "cache"
        assert layout.cache_staged_of_job(cache, job) == [], node
        assert layout.cache_leftovers(cache) == [], node
        cluster.assert_never_drained(node)
    staging = cluster.state / "stage"
    assert layout.cache_leftovers(staging) == []
    for entry in (staging / "images").glob("*.json"):
        assert job not in json.loads(entry.read_text()).get("holders", []), entry

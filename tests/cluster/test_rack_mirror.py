"""The rack mirror on the real cluster (deploy/local/mirror.sh): the upper half of
the nodes ask it first, a cold image crosses the registry's link once however many
of the rack ask at once, and a mirror that is down costs a job nothing.  The
registry's own access log and the mirror's are the witnesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO, Cluster, busybox_sif, push, site_registry, write_script

pytestmark = pytest.mark.cluster


@pytest.fixture(autouse=True)
def mirror(cluster: Cluster) -> str:
    if not cluster.env.get("TFIMAGE_MIRROR"):
        pytest.skip("the cluster runs no rack mirror (it needs 4 nodes: TFIMAGE_NODES=4, as CI's)")
    assert cluster.env["TFIMAGE_MIRROR_NODES"] == "n[3-4]"
    return cluster.env["TFIMAGE_MIRROR"]


def fresh_image(cluster: Cluster, tmp_path: Path, what: str) -> tuple[str, str]:
    """A new image on no node and in no mirror: its name and its layer's digest."""
    marker = f"{what}-{os.urandom(4).hex()}"
    push(cluster, busybox_sif(tmp_path, marker), f"{marker}:1")
    raw = site_registry(cluster).manifest_bytes(f"library/{marker}", "1")
    return f"{marker}:1", str(json.loads(raw)["layers"][0]["digest"])


def registry_blob_gets(cluster: Cluster, blob: str) -> tuple[int, int]:
    """Whole GETs of ``blob`` the registry served: (to the nodes themselves, to the
    mirror).  Our client sends no User-Agent; the mirror's Go client does."""
    log = (cluster.state / "log" / "registry.log").read_text(errors="replace")
    pat = re.compile(
        rf'"GET /v2/[^ ]*/blobs/{re.escape(blob)} HTTP/[0-9.]+" 200 \d+ "[^"]*" "([^"]*)"'
    )
    agents = [m[1] for m in pat.finditer(log)]
    return sum(1 for a in agents if not a), sum(1 for a in agents if a)


def mirror_blob_gets(cluster: Cluster, blob: str, name: str = "mirror") -> list[tuple[str, str]]:
    """(client address, nginx's cache status) of each GET of ``blob`` the mirror
    served: the rack's (mirror.sh), or the cloud region's (``name="region"``)."""
    path = cluster.state / "log" / f"{name}.log"
    log = path.read_text(errors="replace") if path.exists() else ""
    pat = re.compile(rf'^(\S+) "GET /v2/[^ ]*/blobs/{re.escape(blob)} [^"]*" 200 \d+ (\S+)$', re.M)
    return [(m[1], m[2]) for m in pat.finditer(log)]


def run_on(cluster: Cluster, workdir: Path, node: str, image: str) -> str:
    """A one-node job on ``node`` printing the image's marker; its id (it passed)."""
    name = f"on-{node}-{os.urandom(3).hex()}"
    write_script(
        workdir,
        f"{name}.sh",
        # One task: the script itself runs in the image (--tf-batch=auto).
        f"#!/bin/sh\n#SBATCH -p all -w {node} -N1 --tf-image={image} -o {name}.out\n"
        "cat /etc/tfimage-test-image\n",
        cluster.user,
    )
    r, job = cluster.sbatch_wait(workdir, f"{name}.sh")
    assert r.returncode == 0 and job, (r.stderr, (workdir / f"{name}.out").read_text())
    return job


def pulled_from(cluster: Cluster, node: str, job: str) -> str:
    lines = [x for x in cluster.hooks_log(node) if "tfimage-prolog:" in x and f"job {job}: " in x]
    said = re.search(r" pulled from (\S+) in ", lines[-1] if lines else "")
    assert said, lines
    return said[1]


def test_a_rack_asking_at_once_costs_the_registry_one_copy_and_other_nodes_none(
    cluster: Cluster, workdir: Path, tmp_path: Path, mirror: str
) -> None:
    image, blob = fresh_image(cluster, tmp_path, "rack")
    with ThreadPoolExecutor(2) as pool:
        jobs = dict(
            zip(
                ("n3", "n4"),
                pool.map(lambda n: run_on(cluster, workdir, n, image), ("n3", "n4")),
                strict=True,
            )
        )
    for node, job in jobs.items():
        assert pulled_from(cluster, node, job) == mirror, node
    # nginx let one request through to the mirror's registry; the other waited for it
    statuses = sorted(status for _, status in mirror_blob_gets(cluster, blob))
    assert statuses == ["HIT", "MISS"], statuses
    direct, via_mirror = registry_blob_gets(cluster, blob)
    assert direct == 0
    # docker-registry 2.8's proxy fetches a cold blob twice even for one request
    # (its storeLocal beside its copyContent): one or two, never one per node.
    assert 1 <= via_mirror <= 2, via_mirror
    job = run_on(cluster, workdir, "n1", image)  # outside the rack: the registry
    assert pulled_from(cluster, "n1", job) == cluster.env["TFIMAGE_REGISTRY"]
    assert registry_blob_gets(cluster, blob) == (1, via_mirror)
    assert len(mirror_blob_gets(cluster, blob)) == 2


def test_a_rack_mirror_that_is_down_costs_a_job_nothing(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    image, blob = fresh_image(cluster, tmp_path, "rackdown")
    cluster_sh = ["bash", str(REPO / "deploy/local/cluster.sh"), "mirror"]
    subprocess.run([*cluster_sh, "stop"], check=True, timeout=60)
    try:
        job = run_on(cluster, workdir, "n4", image)
    finally:
        subprocess.run([*cluster_sh, "start"], check=True, timeout=60)
    assert pulled_from(cluster, "n4", job) == cluster.env["TFIMAGE_REGISTRY"]
    assert registry_blob_gets(cluster, blob) == (1, 0)
    cluster.assert_never_drained("n4")

"""Cloud bursting as Slurm does it (deploy/local/cloud.sh): a job sent to `burst`
makes slurmctld resume a CLOUD node, which comes up with an empty disk and the
cloud image the role baked, warms the site's images, pulls the job's through its
region's own mirror, and is suspended (its
cache gone) once idle; a cloud that cannot resume a node leaves the job waiting
with Slurm's reason and no on-premises node drained."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Cluster, write_script
from test_rack_mirror import fresh_image, mirror_blob_gets, pulled_from, registry_blob_gets

from support import report_figure, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module", autouse=True)
def c2_without_capacity(cluster: Cluster) -> Iterator[str]:
    """A job for c2, whose resume fails (cloud.sh's switch), submitted first: its
    ResumeTimeout runs out while the other test runs."""
    names = cluster.env.get("TFIMAGE_BURST_NODES", "").strip('"').split()
    if len(names) < 2:
        pytest.skip("the cluster has no cloud nodes (TFIMAGE_BURST=2 make cluster-up; CI's has)")
    fail = cluster.state / "cloud" / "fail-c2"
    fail.write_text("the test: no capacity\n")
    r = cluster.run(
        ["sbatch", "--parsable", "-p", "burst", "-w", "c2", "-N1", "--tf-image=tiny:1.0",
         "-o", "/dev/null", "--wrap", "true"],
        cwd=Path("/tmp"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    try:
        yield job
    finally:
        cluster.run(["scancel", job], as_root=True)
        fail.unlink(missing_ok=True)


def state(cluster: Cluster, node: str) -> str:
    r = cluster.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], as_root=True)
    return r.stdout.strip()


def power_log(cluster: Cluster) -> list[str]:
    path = cluster.state / "log" / "power.log"
    return path.read_text(errors="replace").splitlines() if path.exists() else []


def burst_job(cluster: Cluster, workdir: Path, node: str, image: str, name: str) -> str:
    write_script(
        workdir,
        f"{name}.sh",
        f"#!/bin/sh\n#SBATCH -p burst -w {node} -N1 --tf-image={image} -o {name}.out\n"
        "cat /etc/tfimage-test-image\n",
        cluster.user,
    )
    r, job = cluster.sbatch_wait(workdir, f"{name}.sh", timeout=240)
    out = workdir / f"{name}.out"
    assert r.returncode == 0 and job, (r.stderr, out.read_text() if out.exists() else "")
    return job


def test_a_burst_job_resumes_a_cold_node_pulls_through_the_region_and_it_is_suspended_after(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    node = "c1"
    region = cluster.env["TFIMAGE_REGION"]
    assert "~" in state(cluster, node), state(cluster, node)  # powered down, as it starts
    image, blob = fresh_image(cluster, tmp_path, "burst")
    submitted = time.time()
    job = burst_job(cluster, workdir, node, image, "burst1")
    resumed = [x for x in power_log(cluster) if f"resume {node}: up in " in x]
    assert resumed, power_log(cluster)
    assert pulled_from(cluster, node, job) == region
    shown = cluster.run(["scontrol", "-o", "show", "job", job], as_root=True).stdout
    times = dict(re.findall(r"\b(SubmitTime|StartTime)=(\S+)", shown))
    waited = time.mktime(time.strptime(times["StartTime"], "%Y-%m-%dT%H:%M:%S")) - time.mktime(
        time.strptime(times["SubmitTime"], "%Y-%m-%dT%H:%M:%S")
    )
    prolog = [x for x in cluster.hooks_log(node) if f"job {job}: " in x and "pulled from" in x]
    pull = re.search(r" in ([0-9.]+) s$", prolog[-1])
    # Nothing straight from the registry; the region's mirror fetched it once (twice:
    # distribution 2.8's proxy fetches a cold blob twice, test_rack_mirror.py).
    direct, via_mirror = registry_blob_gets(cluster, blob)
    assert direct == 0 and 1 <= via_mirror <= 2, (direct, via_mirror)
    assert [status for _, status in mirror_blob_gets(cluster, blob, "region")] == ["MISS"]
    assert mirror_blob_gets(cluster, blob) == []  # the rack mirror is not the region's
    marker = image.split(":")[0]
    assert (workdir / "burst1.out").read_text().split() == [marker]  # it ran in the image
    # The site's image (keep_images) was warmed before the node took the job, and kept.
    r = cluster.on_node(node, ["/opt/tfimage/bin/tfimage", "cache", "ls", "--json"])
    assert r.returncode == 0, r.stderr
    entries = json.loads(r.stdout)
    assert any(e["kept"] and any("/library/tiny:1.0" in ref for ref in e["refs"]) for e in entries)
    assert any(any(image.split(":")[0] in ref for ref in e["refs"]) for e in entries)
    cache = cluster.state / "nodes" / node / "cache"
    # Its tfimage is the cloud image's, which the role baked: its own files, not the
    # on-premises nodes'.
    disk = cluster.state / "nodes" / node / "image"
    for path, own in (
        ("/opt/tfimage/bin/tfimage", disk / "prefix" / "bin" / "tfimage"),
        (f"{cluster.state}/etc/tfimage/config.yaml", disk / "config" / "config.yaml"),
        (f"{cluster.state}/lib/spank_tfimage.so", disk / "plugin" / "spank_tfimage.so"),
    ):
        seen = cluster.on_node(node, ["stat", "-L", "-c", "%d:%i", path]).stdout.strip()
        st = own.stat()
        assert seen == f"{st.st_dev}:{st.st_ino}", (path, seen)
        assert seen != cluster.run(["stat", "-L", "-c", "%d:%i", path], as_root=True).stdout.strip()

    again = burst_job(cluster, workdir, node, image, "burst2")  # while it is up
    line = [x for x in cluster.hooks_log(node) if "tfimage-prolog:" in x and f"job {again}: " in x]
    assert line and "cache hit" in line[-1], line

    # Idle for SuspendTime: Slurm suspends it, and its disk goes.
    wait_for(lambda: "~" in state(cluster, node), timeout=120, what=f"{node} to be suspended")
    wait_for(lambda: not cache.exists(), timeout=30, what=f"{node}'s cache to go")
    assert not disk.exists()
    assert any(f"suspend {node}: down" in x for x in power_log(cluster))
    r = cluster.run(["ip", "netns", "list"], as_root=True)
    assert not re.search(rf"^{node}\b", r.stdout, re.M), r.stdout
    slurm = cluster.run(["sinfo", "-V"], as_root=True).stdout.strip()
    report_figure(
        f"burst ({slurm}): submit to start {waited:.0f} s (Slurm's seconds); "
        f"{resumed[-1].split(' ', 1)[-1]}; the job's pull {pull[1] if pull else '?'} s; "
        f"whole test {time.time() - submitted:.0f} s"
    )


def test_a_cloud_that_cannot_resume_a_node_leaves_the_job_waiting_and_drains_nothing_here(
    cluster: Cluster, c2_without_capacity: str
) -> None:
    job = c2_without_capacity
    wait_for(
        lambda: any("resume c2: the cloud has no capacity" in x for x in power_log(cluster)),
        timeout=60,
        what="the resume program's refusal",
    )

    def waiting_with_a_reason() -> bool:
        r = cluster.run(["squeue", "-h", "-j", job, "-o", "%T %r"], as_root=True)
        st, _, reason = r.stdout.strip().partition(" ")
        return st == "PENDING" and reason not in ("", "None", "Resources", "Priority")

    # Once ResumeTimeout passes Slurm marks c2 down, and the job waits (requeued, or
    # pending) saying why.
    wait_for(waiting_with_a_reason, timeout=180, what=f"job {job} to wait with a reason")
    for onprem in cluster.env["TFIMAGE_NODE_NAMES"].strip('"').split():
        cluster.assert_never_drained(onprem)

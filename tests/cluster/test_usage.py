"""After every job: a clean node, a usage record per node, and metrics Prometheus scrapes.

On the real local cluster, both Slurm generations: the record's fields are what
Slurm gave the epilog and what the node held while the job ran (seen first, then
seen gone); Debian's own node_exporter and Prometheus read the metrics.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import Cluster, site_registry, write_script

from support import need

pytestmark = pytest.mark.cluster
NODES = ("n1", "n2")


def records(
    cluster: Cluster, node: str, job: str, since: float, timeout: float = 30
) -> list[dict[str, Any]]:
    """The node's usage records of ``job``, once its epilog wrote one (the log outlives
    the cluster, and job ids repeat: only records that ended after ``since`` count)."""
    path = cluster.state / "nodes" / node / "log" / "usage.jsonl"
    deadline = time.monotonic() + timeout
    while True:
        found = []
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                end = datetime.fromisoformat(rec["end"]).timestamp()
                if rec["job_id"] == job and end >= since:
                    found.append(rec)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def traces(cluster: Cluster, node: str, job: str) -> dict[str, list[str]]:
    """What ``job`` has on ``node``: mounts, holds on cached images, per-job state."""
    run = Path(f"/proc/{cluster.node_pid(node)}/root/run/tfimage")
    state = [
        str(p.relative_to(run))
        for p in (
            *run.glob(f"jobs/{job}*"),
            *run.glob(f"usage/{job}.*"),
            *run.glob(f"gpu/jobs/{job}.*"),
        )
    ]
    # The job's own, and every shared image mount: none is left once no job runs.
    shared = {m for m in cluster.node_mounts(node) if m.startswith("/run/tfimage/images/")}
    mounts = sorted(set(cluster.job_mounts(node, job)) | shared)
    cache = cluster.state / "nodes" / node / "cache" / "images"
    holds = [
        p.stem for p in cache.glob("*.json") if job in json.loads(p.read_text()).get("holders", [])
    ]
    return {"state": sorted(state), "mounts": mounts, "holds": holds}


def gone(cluster: Cluster, node: str, job: str) -> dict[str, list[str]]:
    for _ in range(100):
        left = traces(cluster, node, job)
        if not any(left.values()):
            break
        time.sleep(0.2)
    return {k: v for k, v in left.items() if v}


def test_an_array_tasks_usage_record_names_its_array_on_every_slurm(
    cluster: Cluster, workdir: Path
) -> None:
    """The soak's finding (bench/soak): 22.05's slurmd gives Prolog and Epilog no
    SLURM_ARRAY_*, and every array task's record said null; the step now hands
    Slurm's own ids to the record (spank/node.c, step/plan.py)."""
    since = time.time()
    r = cluster.run(
        ["sbatch", "--parsable", "-p", "all", "-w", "n1", "--array=0-1", "--tf-image=tiny:1.0",
         "-o", "/dev/null", "--wrap", "true"],
        cwd=workdir,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    array = r.stdout.strip().split(";")[0]
    shown = ""
    for _ in range(300):  # both tasks ended, their epilogs run
        shown = cluster.run(["squeue", "-h", "-r", "-j", array, "-o", "%i"], as_root=True).stdout
        if not shown.strip():
            break
        time.sleep(0.2)
    assert not shown.strip(), shown
    tasks: dict[str, str] = {}
    for _ in range(150):  # slurmctld sends the ends to slurmdbd after the jobs end
        raw = cluster.run(
            ["sacct", "-n", "-P", "-X", "-j", array, "-o", "JobIDRaw,JobID"], as_root=True
        ).stdout
        tasks = dict(line.split("|") for line in raw.split())  # 208 -> 207_1
        if len(tasks) == 2:
            break
        time.sleep(0.2)
    assert sorted(tasks.values()) == [f"{array}_0", f"{array}_1"], raw
    for job, name in tasks.items():
        recs = records(cluster, "n1", job, since)
        assert len(recs) == 1, (job, recs)
        assert (recs[0]["array_job_id"], recs[0]["array_task_id"]) == tuple(name.split("_"))


def test_array_ids_a_user_exports_for_a_plain_job_never_reach_its_record(
    cluster: Cluster, workdir: Path
) -> None:
    """The array's ids come from Slurm (spank_get_item), never from the job's
    environment: a user who exports SLURM_ARRAY_* into a plain job cannot make its
    record claim an array, on either submit path."""
    since = time.time()
    lies = "ALL,SLURM_ARRAY_JOB_ID=999,SLURM_ARRAY_TASK_ID=7,SLURM_ARRAY_TASK_COUNT=9"
    r = cluster.run(
        ["sbatch", "--parsable", "-p", "all", "-w", "n1", "--tf-image=tiny:1.0",
         f"--export={lies}", "-o", "batch.out", "--wrap", "echo $SLURM_ARRAY_JOB_ID"],
        cwd=workdir,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    batch = r.stdout.strip().split(";")[0]
    s = cluster.run(
        ["srun", "-p", "all", "-w", "n1", "--tf-image=tiny:1.0", f"--export={lies}",
         "sh", "-c", "echo $SLURM_JOB_ID $SLURM_ARRAY_JOB_ID"],
        cwd=workdir,
    )  # fmt: skip
    assert s.returncode == 0, s.stderr
    step, seen = s.stdout.split()
    assert seen == "999"  # the lie reached the job: what it must not reach is the record
    for job in (batch, step):
        recs = records(cluster, "n1", job, since)
        assert len(recs) == 1, (job, recs)
        assert (recs[0]["array_job_id"], recs[0]["array_task_id"]) == (None, None), recs[0]
    assert (workdir / "batch.out").read_text().split() == ["999"]


def test_a_two_node_job_leaves_nothing_and_is_recorded_on_each_node(
    cluster: Cluster, workdir: Path
) -> None:
    # What the registry serves for the tag, asked without tfimage's client or cache.
    expected = site_registry(cluster).digest_of("library/tiny", "1.0")
    go = workdir / "go"
    since = time.time()
    p = cluster.start(
        ["srun", "-N2", "-n2", "--tf-image=tiny:1.0", "sh", "-c",
         f'echo "job $SLURM_JOB_ID"; while [ ! -e {go} ]; do sleep 0.2; done'],
        workdir,
    )  # fmt: skip
    try:
        assert p.stdout is not None
        job = p.stdout.readline().split()[1]
        during = {n: traces(cluster, n, job) for n in NODES}
        for _ in range(50):  # the second task may still be starting
            if all(t["mounts"] and t["holds"] for t in during.values()):
                break
            time.sleep(0.2)
            during = {n: traces(cluster, n, job) for n in NODES}
    finally:
        go.touch()
        _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    for node in NODES:
        # Proved first: while the job ran, it had all of this here.
        t = during[node]
        assert t["mounts"] and t["holds"], (node, t)
        assert f"jobs/{job}.images.json" in t["state"] and f"usage/{job}.json" in t["state"], t
        assert gone(cluster, node, job) == {}, node
        (rec,) = records(cluster, node, job, since)
        assert t["holds"] == [expected.replace("sha256:", "sha256-")], t
        assert rec["image"].endswith(f"/library/tiny:1.0@{expected}"), rec["image"]
        assert (rec["node"], rec["state"], rec["exit_code"], rec["signal"]) == (
            node,
            "COMPLETED",
            0,
            0,
        )
        assert rec["image_asked"] == "tiny:1.0" and rec["repository"] == "library/tiny"
        assert rec["user"] == cluster.user and rec["partition"] == "debug"
        assert rec["cache"] in ("hit", "miss") and rec["runtime"] == "charliecloud"
        assert rec["tf_workers"] == 2 and rec["wall_seconds"] > 0
        assert rec["image_error"] is None


def test_a_failing_job_is_recorded_as_failed_with_its_exit_code(
    cluster: Cluster, workdir: Path
) -> None:
    script = "#!/bin/sh\n#SBATCH -N1 -w n1 --tf-image=tiny:1.0 -o fail.out\nexit 7\n"
    write_script(workdir, "fail.sh", script, cluster.user)
    since = time.time()
    r, job = cluster.sbatch_wait(workdir, "fail.sh")
    assert r.returncode == 7, r.stdout + r.stderr
    (rec,) = records(cluster, "n1", job, since)
    assert (rec["state"], rec["exit_code"], rec["signal"]) == ("FAILED", 7, 0)
    assert rec["tf_workers"] is None  # one task: no TF_CONFIG unless the site asks
    assert gone(cluster, "n1", job) == {}


def test_a_job_whose_image_could_not_be_pulled_is_recorded_with_the_reason(
    cluster: Cluster, workdir: Path
) -> None:
    missing = "tiny@sha256:" + "0" * 64  # pinned already: the node's pull fails
    script = f"#!/bin/sh\n#SBATCH -N1 -w n2 --tf-image={missing} -o missing.out\ntrue\n"
    write_script(workdir, "missing.sh", script, cluster.user)
    since = time.time()
    r, job = cluster.sbatch_wait(workdir, "missing.sh")
    assert r.returncode != 0, r.stdout + r.stderr
    (rec,) = records(cluster, "n2", job, since)
    assert rec["image_asked"] == missing and rec["cache"] is None
    assert "not found" in rec["image_error"] and rec["state"] != "COMPLETED"
    assert gone(cluster, "n2", job) == {}


# --- Prometheus ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def scraping(cluster: Cluster, tmp: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A node_exporter per node on its textfile directory, and Prometheus scraping them
    every second; yields Prometheus's URL and each node's instance label."""
    need("prometheus", "prometheus-node-exporter")
    procs: list[subprocess.Popen[bytes]] = []
    instances = {}
    try:
        for node in NODES:
            port = _free_port()
            instances[node] = f"127.0.0.1:{port}"
            procs.append(subprocess.Popen(
                ["prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{port}",
                 "--collector.disable-defaults", "--collector.textfile",
                 f"--collector.textfile.directory={cluster.state / 'nodes' / node / 'metrics'}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
        conf = tmp / "prometheus.yml"
        conf.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": "node", "static_configs": [{"targets": list(instances.values())}]}
            ],
        }))  # fmt: skip
        port = _free_port()
        procs.append(subprocess.Popen(
            ["prometheus", f"--config.file={conf}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        for _ in range(150):
            with contextlib.suppress(OSError, ValueError):
                targets = _get(f"{url}/api/v1/targets")["data"]["activeTargets"]
                if len(targets) == 2 and all(t["health"] == "up" for t in targets):
                    break
            time.sleep(0.2)
        else:
            pytest.fail("Prometheus never scraped both node_exporters")
        yield url, instances
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)


def _value(url: str, query: str) -> float | None:
    res = _get(f"{url}/api/v1/query?query={urllib.parse.quote(query)}")["data"]["result"]
    return float(res[0]["value"][1]) if res else None


def _until(url: str, query: str, want: float, timeout: float = 30) -> float | None:
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = _value(url, query)
        if got == want:
            break
        time.sleep(0.5)
    return got


def test_prometheus_scrapes_the_jobs_and_the_cache_from_each_node(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    need("prometheus")
    with scraping(cluster, tmp_path) as (url, inst):
        jobs = f'tfimage_jobs_total{{instance="{inst["n1"]}",repository="library/tiny"}}'
        fails = jobs.replace("tfimage_jobs_total", "tfimage_job_failures_total")
        before, failed_before = _value(url, jobs) or 0.0, _value(url, fails) or 0.0
        r = cluster.run(["srun", "-N1", "-w", "n1", "--tf-image=tiny:1.0", "true"], cwd=workdir)
        assert r.returncode == 0, r.stderr
        r = cluster.run(["srun", "-N1", "-w", "n1", "--tf-image=tiny:1.0", "false"], cwd=workdir)
        assert r.returncode != 0
        assert _until(url, jobs, before + 2) == before + 2
        assert _until(url, fails, failed_before + 1) == failed_before + 1
        images = len(list((cluster.state / "nodes/n1/cache/images").glob("*.sif")))
        q = f'tfimage_cache_images{{instance="{inst["n1"]}"}}'
        assert _until(url, q, images) == images > 0
        hits = f'tfimage_cache_hits_total{{instance="{inst["n1"]}",repository="library/tiny"}}'
        assert (_value(url, hits) or 0) >= 1  # the second job found the first one's image
        names = _get(f"{url}/api/v1/label/__name__/values")["data"]
        from tfimage.agent.usage.metrics import EXPORTED

        exported = {n for n in names if n.startswith("tfimage_")}
        assert {n.removesuffix("_total") for n in exported} <= set(EXPORTED)
        assert "tfimage_jobs_total" in exported and "tfimage_cache_size_bytes" in exported

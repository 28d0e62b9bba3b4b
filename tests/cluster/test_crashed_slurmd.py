"""A slurmd that crashes under a prolog (hooks/orphan.py), on the real cluster.

Twice on Slurm 23.11 and later, whose ``scontrol reconfigure`` re-executes slurmd:
as the daemon first started, and after a reconfigure, when Debian's daemon is
named ``slurmd-wlm`` (its real program's name; the CI run at c5c63bf failed there,
with test_deployment.py's reconfigure run before).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, Cluster

from support import children

pytestmark = pytest.mark.cluster


def _reexecuted_since_23_11(cluster: Cluster) -> bool:
    said = cluster.run(["scontrol", "--version"], as_root=True).stdout
    found = re.search(r"(\d+)\.(\d+)\.\d+", said)
    assert found, said
    return (int(found[1]), int(found[2])) >= (23, 11)


def _reconfigured(cluster: Cluster, node: str) -> None:
    """``scontrol reconfigure``, and the node's slurmd through it: 24.11's execs a
    new slurmd, which takes over once started (10 s here); a prolog launched before
    then is the old one's, the case the first run of the test has."""
    log = cluster.state / "log" / f"slurmd-{node}.log"
    seen = log.stat().st_size
    r = cluster.run(["scontrol", "reconfigure"], as_root=True)
    assert r.returncode == 0, r.stderr
    said = ""
    for _ in range(600):
        with log.open("rb") as f:
            f.seek(seen)
            said = f.read().decode(errors="replace")
        if "reconfigure" in said and "slurmd started on" in said.split("reconfigure", 1)[1]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"{node}'s slurmd after the reconfigure said: {said[-600:]!r}")
    for _ in range(300):  # and back in service, taking jobs
        state = cluster.run(["sinfo", "-h", "-n", node, "-o", "%T"], as_root=True).stdout
        if state.split() and set(state.split()) <= {"idle", "mixed"}:
            return
        time.sleep(0.1)
    raise AssertionError(f"{node} after the reconfigure: {state!r}")


@pytest.mark.parametrize("slurmd_since", ["its start", "a reconfigure"])
def test_a_slurmd_killed_under_a_prolog_has_its_job_requeued_recorded_once_never_lost(
    cluster: Cluster, workdir: Path, slurmd_since: str
) -> None:
    """The soak's finding on 24.11 (CI, task 136_0 lost): a slurmd killed while a
    job's prolog ran comes back knowing nothing of the job, and Slurm kept it in
    its prolog with no end (22.05 too).  The prolog, which outlives its slurmd, now
    requeues it (hooks/orphan.py): the job is pending again (121 s: CredExpire and a
    second), the try is recorded once, as REQUEUED, nothing of it stays on the
    node, and the node is never drained."""
    if cluster.chroot:
        pytest.skip("the host flavor's slurmd is killed (the other host runs it there)")
    node = "n2"
    if slurmd_since == "a reconfigure":
        if not _reexecuted_since_23_11(cluster):
            pytest.skip("before Slurm 23.11 a reconfigure leaves slurmd as it was: the first")
        _reconfigured(cluster, node)
    # Straight from the registry: the prolog's pull is a second or more.
    gone = cluster.on_node(node, ["/opt/tfimage/bin/tfimage", "cache", "rm", "tf-custom:2.0"])
    assert gone.returncode == 0 or "names no cached image" in gone.stderr, gone.stderr
    since = time.time()
    job = cluster.submit(
        workdir, "-p", "all", "-w", node, "--tf-image=tf-custom:2.0", "-o", "/dev/null",
        "--wrap", "true",
    )  # fmt: skip
    slurmd = cluster.node_pid(node)

    tmp = cluster.state / "nodes" / node / "cache" / "tmp"
    for _ in range(1500):  # the prolog's pull under way: it knows its slurmd by now
        if children(slurmd) and any(tmp.glob("*.partial")):
            break
        time.sleep(0.01)
    assert children(slurmd) and any(tmp.glob("*.partial")), "no prolog pulled"
    os.kill(slurmd, signal.SIGKILL)
    try:
        time.sleep(2)  # the unit's RestartSec
    finally:
        subprocess.run(
            ["bash", str(REPO / "deploy/local/cluster.sh"), "slurmd", node], check=True, timeout=60
        )
    try:
        shown = ""
        # At the prolog's end: its pull of 1 GB takes 2-3 s here, longer on a busy
        # machine (hook_deadline bounds it at 600 s).
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            shown = cluster.run(["scontrol", "-o", "show", "job", job], as_root=True).stdout
            if "Restarts=1" in shown and "JobState=PENDING" in shown:
                break
            time.sleep(0.5)
        said = [line for line in cluster.hooks_log(node) if f"job {job}:" in line]
        assert "Restarts=1" in shown and "JobState=PENDING" in shown, (shown, said[-5:])
        cluster.assert_never_drained(node)
        tries = cluster.run(
            ["sacct", "-n", "-P", "-X", "-D", "-j", job, "-o", "State,NodeList"], as_root=True
        ).stdout.split()
        assert tries[0] == f"REQUEUED|{node}", tries  # the prolog's requeue, not Slurm's
        log = cluster.state / "nodes" / node / "log" / "usage.jsonl"
        recs: list[dict[str, Any]] = []
        for _ in range(150):  # the epilog of the first try, after the requeue
            recs = [
                r
                for r in map(json.loads, log.read_text().splitlines())
                if r["job_id"] == job and datetime.fromisoformat(r["end"]).timestamp() >= since
            ]
            if recs:
                break
            time.sleep(0.2)
        assert [(r["state"], r["node"]) for r in recs] == [("REQUEUED", node)], recs
        assert not cluster.job_mounts(node, job)
        run = Path(f"/proc/{cluster.node_pid(node)}/root/run/tfimage")
        assert not [*run.glob(f"jobs/{job}*"), *run.glob(f"usage/{job}.*")]
    finally:
        cluster.run(["scancel", job], as_root=True)


def test_an_orphaned_array_task_with_the_arrays_id_requeues_itself_not_its_siblings(
    cluster: Cluster, workdir: Path
) -> None:
    """The soak on 24.11 (CI, 2026-12-07): slurmd killed under the prolog of array
    task 140_1, whose job id was the array's, 140; `scontrol requeue 140` was the
    whole array to slurmctld, and 140_0, running fine, was requeued too.  Here the
    prolog's requeue (hooks/orphan.py, as the orphaned prolog calls it) is asked for
    that task while its siblings run: they are left running."""
    array = cluster.submit(
        workdir, "-p", "all", "-a", "0-2", "-o", "/dev/null", "--wrap", "sleep 300"
    )
    try:
        listed: list[str] = []
        for _ in range(300):
            listed = cluster.run(
                ["squeue", "-h", "-j", array, "-o", "%A|%i|%T"], as_root=True
            ).stdout.split()
            if len(listed) == 3 and all(row.endswith("|RUNNING") for row in listed):
                break
            time.sleep(0.1)
        assert len(listed) == 3 and all(r.endswith("|RUNNING") for r in listed), listed
        # The task started last took the array's own record, and its id.
        [own] = [row.split("|")[1] for row in listed if row.split("|")[0] == array]
        asked = subprocess.run(
            [
                str(REPO / ".venv/bin/python"),
                "-c",
                "import logging, sys\n"
                "from tfimage.agent.core.config import load_config\n"
                "from tfimage.agent.hooks import orphan\n"
                "logging.basicConfig()\n"
                "cfg = load_config(sys.argv[1])\n"
                "ok = orphan.requeue(orphan.Process(1, 0), cfg, sys.argv[2], logging.getLogger())\n"
                "sys.exit(0 if ok else 1)\n",
                cluster.env["TFIMAGE_CONFIG"],
                array,
            ],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert asked.returncode == 0, asked.stderr
        time.sleep(2)  # anything else requeued would be pending by now
        after = cluster.run(
            ["squeue", "-h", "-j", array, "-o", "%i|%T"], as_root=True
        ).stdout.split()
        assert sorted(after) == sorted(
            f"{row.split('|')[1]}|{'PENDING' if row.split('|')[1] == own else 'RUNNING'}"
            for row in listed
        ), after
        assert f"requeued (scontrol requeue {own})" in asked.stderr, asked.stderr
    finally:
        cluster.run(["scancel", array], as_root=True)

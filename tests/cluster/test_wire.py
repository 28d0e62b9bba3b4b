"""What the plugin really exchanges with the Python side in a job, captured by the
daemons (``tfimage daemon --trace``) and checked against agent/core/wire.py both ways:
every flag the plugin sent is one the wire knows, and every flag the Python side
accepts was sent (or is an operator's, documented so)."""

from __future__ import annotations

import base64
import json
import os
import pwd
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, Cluster, daemon_pid

from tfimage.agent.core import wire

pytestmark = pytest.mark.cluster
CLUSTER_SH = REPO / "deploy/local/cluster.sh"


def _restart(node: str, *args: str) -> None:
    subprocess.run(["bash", str(CLUSTER_SH), "daemon", node, *args], check=True, timeout=60)


@pytest.fixture
def traced(cluster: Cluster) -> Iterator[tuple[Path, Path]]:
    """n1's daemon and the login node's, each tracing to a file of its own; both
    started again untraced afterwards."""
    name = uuid.uuid4().hex[:8]
    node_trace = cluster.state / "nodes" / "n1" / "log" / f"wire-{name}.jsonl"
    login_trace = cluster.state / "log" / f"wire-login-{name}.jsonl"
    old = daemon_pid(cluster, "n1")
    if old:
        os.kill(old, signal.SIGKILL)
    # Paths as each daemon sees them: n1's /var/log/tfimage is its log directory.
    _restart("n1", "--trace", f"/var/log/tfimage/{node_trace.name}")
    _restart("login", "--trace", str(login_trace))
    try:
        yield node_trace, login_trace
    finally:
        pid = daemon_pid(cluster, "n1")
        if pid:
            os.kill(pid, signal.SIGKILL)
        _restart("n1")
        _restart("login")
        for p in (node_trace, login_trace):
            p.unlink(missing_ok=True)


def _entries(path: Path) -> list[dict[str, object]]:
    for _ in range(50):  # the epilog's entry comes after the job returns
        if path.exists():
            break
        time.sleep(0.1)
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_plugin_speaks_exactly_the_wire_in_a_job(
    cluster: Cluster, workdir: Path, traced: tuple[Path, Path]
) -> None:
    node_trace, login_trace = traced
    data = workdir / "data"
    data.mkdir()
    pw = pwd.getpwnam(cluster.user)
    os.chown(data, pw.pw_uid, pw.pw_gid)
    # A step with every optional part: a --tf-mount, a GPU (the test cluster's are
    # fake: deploy/local/cluster.sh write_gpus), a layout...
    r = cluster.run(
        [
            "srun",
            "-N1",
            "-w",
            "n1",
            "--gres=gpu:1",
            f"--tf-mount={data}:/inputs",
            "--tf-image=tiny:1.0",
            "true",
        ],
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    # ...and a one-task batch script run in the image (--script), an array's task
    # (--array-job, --array-task: the batch step's alone carry them).
    r, _ = cluster.sbatch(
        workdir,
        "job.sh",
        "#!/bin/sh\n#SBATCH --tf-image=tiny:1.0\n#SBATCH -w n1\n#SBATCH --array=0\n"
        "#SBATCH -o out.txt\ntrue\n",
        "out.txt",
    )
    assert r.returncode == 0, r.stderr
    # ...and a job on two nodes, whose PrologSlurmctld the login host's daemon serves.
    r = cluster.run(["srun", "-N2", "--tf-image=tiny:1.0", "true"], cwd=workdir)
    assert r.returncode == 0, r.stderr
    entries = _entries(node_trace)
    seen: set[str] = set()
    hooks: set[str] = set()
    for e in entries:
        argv = [str(a) for a in e["argv"]]  # type: ignore[union-attr]
        assert e["socket"] == "root"
        if argv[0] in wire.HOOKS:
            hooks.add(argv[0])
            names = [a.partition("=")[0] for a in argv[1:]]
            assert names == ["--config", *(f.name for f in wire.HOOK_FLAGS[argv[0]])], argv
            assert all("=" in a for a in argv[1:]), argv
            continue
        assert argv[:3] == ["--config", cluster.env["TFIMAGE_CONFIG"], wire.STEP_PREPARE], argv
        seen.update(wire.step_prepare_flags(argv[3:]))  # raises on anything unknown
        assert e["status"] == 0, e
        answer = wire.decode_step_answer(base64.b64decode(str(e["stdout"])))
        assert answer.argv[0].endswith("/ch-run")
    assert hooks == set(wire.HOOKS) - {wire.STAGE_HOOK}
    staged = [e for e in _entries(login_trace) if e["socket"] == "root"]
    assert staged, "the two-node job's stage hook did not reach the login host's daemon"
    for e in staged:
        argv = [str(a) for a in e["argv"]]  # type: ignore[union-attr]
        names = [a.partition("=")[0] for a in argv[1:]]
        assert argv[0] == wire.STAGE_HOOK and e["status"] == 0, e
        assert names == ["--config", *(f.name for f in wire.HOOK_FLAGS[wire.STAGE_HOOK])], argv
    # Both ways: every flag the Python side accepts was sent in these two jobs.
    assert seen == {f.name for f in wire.STEP_PREPARE_FLAGS}, seen
    pins = [e for e in _entries(login_trace) if e["socket"] == "pin"]
    assert pins, "no submission reached the pin server"
    for e in pins:
        req = wire.decode_submit_check([str(a) for a in e["argv"]])  # type: ignore[union-attr]
        assert req.ref == "tiny:1.0" and e["status"] == 0

"""The node daemon on the job-launch path: it serves each step's preparation, and a
node whose daemon is down still runs the job (the plugin runs the helper itself)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import REPO, Cluster


def _daemon_pid(cluster: Cluster, node: str) -> int | None:
    ns = os.readlink(f"/proc/{cluster.node_pid(node)}/ns/mnt")
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
            ours = b"daemon" in cmd and any(c.endswith(b"/tfimage") for c in cmd)
            if ours and os.readlink(p / "ns" / "mnt") == ns:
                return int(p.name)
        except OSError:
            continue
    return None


def _log(cluster: Cluster, node: str) -> str:
    return (cluster.state / "log" / f"daemon-{node}.log").read_text()


def _steps(cluster: Cluster, node: str) -> int:
    """Steps the node's daemon prepared (hooks are logged too; the epilog runs late)."""
    return sum(
        "step-prepare" in line and " -> 0 in " in line for line in _log(cluster, node).splitlines()
    )


def test_the_daemon_serves_steps_and_a_node_without_it_still_runs(
    cluster: Cluster, workdir: Path
) -> None:
    before = {n: _steps(cluster, n) for n in ("n1", "n2")}
    r = cluster.run(
        ["srun", "-N2", "--tf-image=tiny:1.0", "cat", "/etc/tfimage-test-image"], cwd=workdir
    )
    assert r.returncode == 0 and r.stdout.split() == ["tiny:1.0", "tiny:1.0"], r.stderr
    for n in ("n1", "n2"):
        assert _steps(cluster, n) == before[n] + 1, _log(cluster, n)

    pid = _daemon_pid(cluster, "n2")
    assert pid, "no daemon runs on n2"
    os.kill(pid, signal.SIGKILL)
    try:
        served = _steps(cluster, "n2")
        r = cluster.run(
            ["srun", "-N2", "--tf-image=tiny:1.0", "cat", "/etc/tfimage-test-image"],
            cwd=workdir,
        )
        assert r.returncode == 0 and r.stdout.split() == ["tiny:1.0", "tiny:1.0"], r.stderr
        assert _steps(cluster, "n2") == served  # n2 ran the helper itself
        assert cluster.node_state("n2") == "idle"
    finally:
        subprocess.run(
            ["bash", str(REPO / "deploy/local/cluster.sh"), "daemon", "n2"], check=True, timeout=60
        )
        for _ in range(50):
            if _daemon_pid(cluster, "n2"):
                break
            time.sleep(0.1)

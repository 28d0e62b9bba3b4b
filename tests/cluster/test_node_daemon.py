"""The node daemon on the job-launch path: it serves each step's preparation, and a
node whose daemon is down still runs the job (the plugin runs the helper itself)."""

from __future__ import annotations

import os
import pwd
import re
import signal
import subprocess
import time
from pathlib import Path

from conftest import REPO, Cluster, daemon_pid


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

    pid = daemon_pid(cluster, "n2")
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
            if daemon_pid(cluster, "n2"):
                break
            time.sleep(0.1)


def _resolved(cluster: Cluster, log: str) -> int:
    """Submissions the test user's tag was pinned for (" -> 0") in a daemon log."""
    uid = pwd.getpwnam(cluster.user).pw_uid
    path = cluster.state / "log" / log
    return sum(f"pin uid {uid} -> 0 " in line for line in path.read_text().splitlines())


def test_submissions_pin_through_the_daemon_and_without_it(cluster: Cluster, workdir: Path) -> None:
    srun = ["srun", "-N2", "--tf-image=tiny:1.0", "cat", "/etc/tfimage-test-image"]
    before = _resolved(cluster, "daemon-login.log")
    r = cluster.run(srun, cwd=workdir)
    assert r.returncode == 0 and r.stdout.split() == ["tiny:1.0", "tiny:1.0"], r.stderr
    assert _resolved(cluster, "daemon-login.log") == before + 1  # the login node's daemon
    pinned = _held_pin(cluster, workdir)

    # An srun inside a job asks the node's daemon, which keeps the job's digest.
    n1 = _resolved(cluster, "daemon-n1.log")
    script = (
        "#!/bin/sh\n#SBATCH -w n1 -o slurm-inner.out\n"
        "#SBATCH --tf-image=tiny:1.0\n#SBATCH --tf-batch=host\n"
        'srun -N1 --tf-image=tiny:1.0 sh -c "cat /etc/tfimage-test-image; '
        'echo \\$SLURM_SPANK_TFIMAGE_IMAGE"\n'
    )
    r, out = cluster.sbatch(workdir, "inner.sh", script, "slurm-inner.out")
    assert r.returncode == 0 and out.split()[0] == "tiny:1.0", (r.stderr, out)
    assert "@sha256:" in out.split()[1]
    assert _resolved(cluster, "daemon-n1.log") == n1 + 1

    pid_file = cluster.state / "run" / "daemon-login.pid"
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    try:
        time.sleep(0.2)
        r = cluster.run(srun, cwd=workdir)  # the plugin pins by itself
        assert r.returncode == 0 and r.stdout.split() == ["tiny:1.0", "tiny:1.0"], r.stderr
        assert _held_pin(cluster, workdir) == pinned  # the same digest, by the helper
        bad = cluster.run(["srun", "--tf-image=Bad Name", "true"], cwd=workdir)
        assert bad.returncode != 0 and "tfimage: submit: " in bad.stderr
    finally:
        subprocess.run(
            ["bash", str(REPO / "deploy/local/cluster.sh"), "daemon", "login"],
            check=True,
            timeout=60,
        )
    # ...and with it back (in the same tree as the clients), it pins again, and a
    # rejected reference is rejected by it with the same words as by the helper.
    r = cluster.run(srun, cwd=workdir)
    assert r.returncode == 0 and _resolved(cluster, "daemon-login.log") == 1, r.stderr
    bad2 = cluster.run(["srun", "--tf-image=Bad Name", "true"], cwd=workdir)
    assert bad2.returncode != 0
    assert _last_error(bad2.stderr) == _last_error(bad.stderr)
    assert "-> 2 in" in (cluster.state / "log" / "daemon-login.log").read_text()


def _held_pin(cluster: Cluster, workdir: Path) -> str:
    """What a submission pins tiny:1.0 to (sbatch -v says; srun does not print it)."""
    argv = ["sbatch", "-v", "--hold", "--parsable", "--tf-image=tiny:1.0", "--wrap", "true"]
    r = cluster.run(argv, cwd=workdir)
    assert r.returncode == 0, r.stderr
    cluster.run(["scancel", r.stdout.strip().split(";")[0]], as_root=True)
    found = re.search(r"tiny:1\.0 pinned to (\S+@sha256:[0-9a-f]{64})", r.stderr)
    assert found, r.stderr
    return found.group(1)


def _last_error(stderr: str) -> str:
    return next(line for line in reversed(stderr.splitlines()) if "tfimage: submit: " in line)

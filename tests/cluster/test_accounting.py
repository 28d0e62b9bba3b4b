"""Slurm's own accounting on the local cluster (deploy/local/accounting.sh: slurmdbd on
MariaDB, accounts team-a and team-b, fair share): sacct names the digest each
--tf-image job ran (PrologSlurmctld's AdminComment, stage/admincomment.py), keeps an
admin's comment, loses no record while slurmdbd is down, and one team's usage moves
the fair share."""

from __future__ import annotations

import dataclasses
import json
import pwd
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conftest import REPO, Cluster

pytestmark = pytest.mark.cluster
# Slurm's priority/multifactor adds a running job's usage once per PriorityCalcPeriod
# (a minute, its least; a job that starts and ends between two looks adds none).
DECAY_TICK = 60.0


def _sacct(cluster: Cluster, job: str, fields: str = "JobID,Account,Partition,AdminComment") -> str:
    """The job's allocation line in sacct ("" while slurmdbd has no record of it)."""
    r = cluster.run(["sacct", "-n", "-P", "-X", "-j", job, "-o", fields], as_root=True, timeout=30)
    return r.stdout.strip() if r.returncode == 0 else ""


def _sacct_until(cluster: Cluster, job: str, want: str, timeout: float = 60.0) -> str:
    """sacct's line once it holds ``want`` (records reach slurmdbd asynchronously, and
    not all at once: the comment may come before the partition)."""
    deadline = time.monotonic() + timeout
    line = _sacct(cluster, job, "JobID,Account,Partition,State,AdminComment")
    while want not in line and time.monotonic() < deadline:
        time.sleep(0.5)
        line = _sacct(cluster, job, "JobID,Account,Partition,State,AdminComment")
    return line


def _pinned(cluster: Cluster, name: str) -> str:
    r = cluster.run(["tfimage", "resolve", name], as_root=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def _slurmdbd(action: str) -> None:
    subprocess.run(
        ["bash", str(REPO / "deploy/local/cluster.sh"), "slurmdbd", action], check=True, timeout=60
    )


def _home(cluster: Cluster) -> Path:
    return Path(pwd.getpwnam(cluster.user).pw_dir)


@pytest.fixture(scope="module", autouse=True)
def team_a_usage(cluster: Cluster) -> Iterator[float]:
    """A team-a job running from the module's start, so that a decay tick has counted
    its usage by the time the fair-share test (the module's last) looks; team-a's
    raw usage before it."""
    before = _shares(cluster)[cluster.user][0]
    job = cluster.submit(
        _home(cluster), "-p", "dev", "-n1", "-o", "/dev/null", "--wrap", "sleep 300"
    )
    yield before
    cluster.run(["scancel", job], as_root=True)


def test_sacct_names_the_digest_the_job_ran_with_its_account_and_partition(
    cluster: Cluster, workdir: Path
) -> None:
    r, job = cluster.sbatch_wait(workdir, "-p", "dev", "--tf-image=tiny:1.0", "--wrap", "true")
    assert r.returncode == 0, r.stderr
    pinned = _pinned(cluster, "tiny:1.0")
    assert "@sha256:" in pinned
    want = f"{job}|team-a|dev|COMPLETED|tfimage={pinned}"
    assert _sacct_until(cluster, job, want) == want


def test_an_admins_comment_is_kept_before_the_digest(cluster: Cluster, workdir: Path) -> None:
    job = cluster.submit(workdir, "--hold", "-p", "dev", "--tf-image=tiny:1.0", "--wrap", "true")
    note = cluster.run(
        ["scontrol", "update", f"JobId={job}", "AdminComment=ticket 4711"], as_root=True
    )
    assert note.returncode == 0, note.stderr
    assert cluster.run(["scontrol", "release", job], as_root=True).returncode == 0
    want = f"{job}|team-a|dev|COMPLETED|ticket 4711 tfimage={_pinned(cluster, 'tiny:1.0')}"
    assert _sacct_until(cluster, job, want) == want


def test_a_job_without_tf_image_gets_no_tfimage_comment(cluster: Cluster, workdir: Path) -> None:
    r, job = cluster.sbatch_wait(workdir, "-p", "dev", "--wrap", "true")
    assert r.returncode == 0, r.stderr
    want = f"{job}|team-a|dev|COMPLETED|"
    assert _sacct_until(cluster, job, want) == want


def test_a_slurmdbd_that_is_down_at_job_end_loses_no_record(
    cluster: Cluster, workdir: Path
) -> None:
    """slurmctld queues what it could not send, and sends it when slurmdbd returns."""
    _slurmdbd("stop")
    try:
        r, job = cluster.sbatch_wait(workdir, "-p", "dev", "--tf-image=tiny:1.0", "--wrap", "true")
        assert r.returncode == 0, r.stderr
        assert _sacct(cluster, job) == ""  # nowhere to ask while it is down
    finally:
        _slurmdbd("start")
    want = f"{job}|team-a|dev|COMPLETED|tfimage={_pinned(cluster, 'tiny:1.0')}"
    assert _sacct_until(cluster, job, want) == want
    cluster.assert_never_drained("n1")


def _shares(cluster: Cluster) -> dict[str, tuple[float, float]]:
    """{user: (raw usage, fair-share factor)} from sshare."""
    r = cluster.run(["sshare", "-a", "-n", "-P", "-o", "User,RawUsage,FairShare"], as_root=True)
    out = {}
    for line in r.stdout.splitlines():
        user, raw, fs = (f.strip() for f in line.split("|"))
        if user and fs:
            out[user] = (float(raw), float(fs))
    return out


def test_one_teams_usage_lowers_its_fair_share_and_its_next_jobs_priority(
    cluster: Cluster, team_a_usage: float
) -> None:
    other = dataclasses.replace(cluster, user=cluster.env["TFIMAGE_TEST_USER2"])
    a, b = cluster.user, other.user
    deadline = time.monotonic() + DECAY_TICK + 20
    shares = _shares(cluster)
    while shares[a][0] <= team_a_usage and time.monotonic() < deadline:
        time.sleep(1)
        shares = _shares(cluster)
    assert shares[a][0] > team_a_usage, shares  # team-a's running job counted
    assert shares[a][1] < shares[b][1], shares
    # Two jobs submitted now, alike but for their team: team-b's comes first.
    later = ["-p", "dev", "--begin=now+1hour", "-o", "/dev/null", "--wrap", "true"]
    jobs = [cluster.submit(_home(cluster), *later), other.submit(_home(other), *later)]
    try:
        r = cluster.run(["squeue", "-h", "-o", "%i %Q", "-j", ",".join(jobs)], as_root=True)
        prio = dict(line.split() for line in r.stdout.splitlines())
        assert int(prio[jobs[0]]) < int(prio[jobs[1]]), prio
    finally:
        cluster.run(["scancel", *jobs], as_root=True)


def test_the_usage_report_by_account_agrees_with_sacct(cluster: Cluster) -> None:
    """The same window, counted twice: tfimage's usage records from every node, and
    Slurm's own accounting (its --tf-image jobs: those with the tfimage= word)."""
    since = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)
    other = dataclasses.replace(cluster, user=cluster.env["TFIMAGE_TEST_USER2"])
    out = ["-p", "dev", "-o", "/dev/null", "--tf-image=tiny:1.0"]
    for who, script in ((cluster, "true"), (cluster, "exit 3"), (other, "true")):
        r, job = who.sbatch_wait(_home(who), *out, "--wrap", script)
        assert job, r.stderr
    logs = [str(p) for p in sorted((cluster.state / "nodes").glob("*/log"))]
    r = cluster.run(
        ["tfimage", "usage", "report", *logs, "--by", "account", "--json",
         "--since", since.isoformat()],
        as_root=True,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    ours = {g["key"]: (g["jobs"], g["failures"]) for g in json.loads(r.stdout)["groups"]}
    want = f"{since:%Y-%m-%dT%H:%M:%S}"
    theirs: dict[str, tuple[int, int]] = {}
    deadline = time.monotonic() + 60
    while theirs != ours and time.monotonic() < deadline:
        r = cluster.run(
            ["sacct", "-a", "-X", "-n", "-P", "-S", want, "-o", "Account,State,AdminComment"],
            as_root=True,
        )
        theirs = {}
        for line in r.stdout.splitlines():
            account, state, comment = line.split("|", 2)
            if "tfimage=" in comment:
                jobs, failed = theirs.get(account, (0, 0))
                theirs[account] = (jobs + 1, failed + (state == "FAILED"))
        time.sleep(0.5)
    assert ours == theirs == {"team-a": (2, 1), "team-b": (1, 0)}, (ours, theirs)

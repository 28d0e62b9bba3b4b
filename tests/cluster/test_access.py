"""Who may run what, on the local cluster: team-a's private ``team-a/tiny:1.0``
(only a team-a robot reads it at the registry; ``access:`` gives it to Unix group
team-a) runs for TFIMAGE_TEST_USER, who is in team-a, and is refused to
TFIMAGE_TEST_USER2, who is not, on every path a user has: at submit, in the prolog
of a job pinned before access changed, on a cache hit, through a digest swap,
from a ``--tf-batch=host`` script's srun, and in ``tfimage cache ls``.  A site
without ``access:`` behaves as before."""

from __future__ import annotations

import dataclasses
import os
import pwd
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Cluster, home_dir

pytestmark = pytest.mark.cluster

PRIVATE = "team-a/tiny:1.0"
MARKER = "team-a/tiny:1.0"  # /etc/tfimage-test-image in it (images/build.sh)


@pytest.fixture
def other(cluster: Cluster) -> Cluster:
    """The cluster as TFIMAGE_TEST_USER2, not in group team-a."""
    return dataclasses.replace(cluster, user=cluster.env["TFIMAGE_TEST_USER2"])


@pytest.fixture
def otherdir(other: Cluster) -> Iterator[Path]:
    """A fresh directory in TFIMAGE_TEST_USER2's home."""
    yield from home_dir(other.user)


def _digest(cluster: Cluster) -> str:
    ref = cluster.run(["tfimage", "resolve", PRIVATE], as_root=True).stdout.strip()
    assert "@sha256:" in ref, ref
    return ref.rpartition("@")[2]


def _srun(c: Cluster, d: Path, image: str, *extra: str) -> tuple[int, str, str]:
    r = c.run(["srun", "-N1", *extra, f"--tf-image={image}", "cat", "/etc/tfimage-test-image"],
              cwd=d)  # fmt: skip
    return r.returncode, r.stdout.strip(), r.stderr


def _tf_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "tfimage:" in line]


def test_at_submit_the_other_team_hears_what_a_missing_repository_says_and_nothing_queues(
    cluster: Cluster, other: Cluster, workdir: Path, otherdir: Path
) -> None:
    assert _srun(cluster, workdir, PRIVATE)[:2] == (0, MARKER)
    before = cluster.job_ids()
    rc, out, err = _srun(other, otherdir, PRIVATE)
    assert rc != 0 and out == ""
    registry = cluster.env["TFIMAGE_REGISTRY"]
    refused = _tf_lines(err)
    assert refused == [
        f"srun: error: tfimage: submit: {registry}/team-a/tiny: no such repository, or not"
        " readable with the credentials used"
    ], err
    missing = _tf_lines(_srun(other, otherdir, "team-a/nothing:1.0")[2])
    assert missing == [line.replace("team-a/tiny", "team-a/nothing") for line in refused]
    assert cluster.job_ids() <= before  # nothing was queued (old ones may age out)


def test_a_job_pinned_before_access_changed_is_refused_by_the_prolog_on_a_cache_hit(
    cluster: Cluster, other: Cluster, workdir: Path, otherdir: Path
) -> None:
    # n1 holds the image: the permitted user's job just ran there.
    assert _srun(cluster, workdir, PRIVATE, "-w", "n1")[:2] == (0, MARKER)
    script = "#!/bin/sh\ncat /etc/tfimage-test-image\n"
    (otherdir / "job.sh").write_text(script)
    pw = pwd.getpwnam(other.user)
    os.chown(otherdir / "job.sh", pw.pw_uid, pw.pw_gid)
    wider = {"team-a/*": ["@team-a", other.user]}
    with cluster.config_with(access=wider):
        job = other.submit(otherdir, "--hold", "-w", "n1", f"--tf-image={PRIVATE}",
                           "-o", "out.txt", "job.sh")  # fmt: skip
    # Access is back to team-a only when the job starts.
    cluster.run(["scontrol", "release", job], as_root=True)
    for _ in range(300):
        state = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"], as_root=True).stdout
        if not state.strip():
            break
        time.sleep(0.2)
    out = (otherdir / "out.txt").read_text()
    assert MARKER not in out.splitlines()  # the image never ran
    assert f"team-a/tiny: {other.user} may not run it: access rule team-a/* (for @team-a)" in (
        out
    ), out
    cluster.assert_never_drained("n1")


def test_a_private_digest_named_in_an_open_repository_is_refused_on_the_node(
    cluster: Cluster, other: Cluster, workdir: Path, otherdir: Path
) -> None:
    digest = _digest(cluster)
    assert _srun(cluster, workdir, PRIVATE, "-w", "n2")[:2] == (0, MARKER)
    rc, out, err = _srun(other, otherdir, f"tiny@{digest}", "-w", "n2")
    assert rc != 0 and MARKER not in out
    assert (
        f"library/tiny@{digest}: the registry does not hold that digest in library/tiny,"
        " and the bytes on this node came from a repository this user may not run"
    ) in err, err
    cluster.assert_never_drained("n2")


def test_a_host_batch_scripts_srun_is_refused_for_the_other_team_only(
    cluster: Cluster, other: Cluster, workdir: Path, otherdir: Path
) -> None:
    script = (
        "#!/bin/sh\n"
        "#SBATCH --tf-image=tiny:1.0\n"
        "#SBATCH --tf-batch=host\n#SBATCH -o out.txt\n"
        f"srun --tf-image={PRIVATE} cat /etc/tfimage-test-image\n"
        'echo "srun=$?"\n'
    )
    _, out = cluster.sbatch(workdir, "host.sh", script, "out.txt")
    assert MARKER in out and "srun=0" in out, out
    _, out2 = other.sbatch(otherdir, "host.sh", script, "out.txt")
    assert MARKER not in out2 and "srun=0" not in out2, out2
    assert "team-a/tiny: no such repository, or not readable with the credentials used" in (out2), (
        out2
    )


def test_cache_ls_on_a_node_lists_the_private_image_only_for_its_team(
    cluster: Cluster, other: Cluster, workdir: Path
) -> None:
    assert _srun(cluster, workdir, PRIVATE, "-w", "n1")[:2] == (0, MARKER)
    cfg = cluster.env["TFIMAGE_CONFIG"]

    def listed(user: str) -> str:
        r = cluster.on_node("n1", ["setpriv", f"--reuid={user}", f"--regid={user}",
                                   "--init-groups", "/opt/tfimage/bin/tfimage", "--config",
                                   cfg, "cache", "ls"])  # fmt: skip
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "team-a/tiny:1.0" in listed(cluster.user)
    assert "team-a/tiny" not in listed(other.user)
    assert "tiny:1.0" in listed(other.user)


def test_a_site_without_access_rules_runs_any_image_for_anyone(
    cluster: Cluster, other: Cluster, otherdir: Path
) -> None:
    with cluster.config_with(access={}):
        assert _srun(other, otherdir, PRIVATE)[:2] == (0, MARKER)


def test_the_other_team_cannot_read_the_cached_file_or_the_running_jobs_mount(
    cluster: Cluster, other: Cluster, workdir: Path
) -> None:
    digest = _digest(cluster)
    key = digest.replace(":", "-")

    def reads(user: str, path: str) -> bool:
        r = cluster.on_node("n1", ["setpriv", f"--reuid={user}", f"--regid={user}",
                                   "--init-groups", "head", "-c", "4", path])  # fmt: skip
        return r.returncode == 0

    p = cluster.start(["srun", "-N1", "-w", "n1", f"--tf-image={PRIVATE}", "sleep", "60"],
                      workdir)  # fmt: skip
    try:
        mounts: list[str] = []
        for _ in range(300):
            mounts = [m for m in cluster.node_mounts("n1")
                      if m.startswith("/run/tfimage/jobs/") and key[7:19] in m]  # fmt: skip
            if mounts:
                break
            time.sleep(0.1)
        assert mounts, "the job's private image mount never appeared"
        marker = f"{mounts[0]}/etc/tfimage-test-image"
        assert reads(cluster.user, marker) and not reads(other.user, marker)
        cached = f"/var/cache/tfimage/images/{key}.sif"
        assert reads(cluster.user, cached) and not reads(other.user, cached)
        assert not reads(other.user, f"/var/cache/tfimage/images/{key}.json")
        # No shared mount of it exists for anyone to find.
        assert f"/run/tfimage/images/{key}" not in cluster.node_mounts("n1")
    finally:
        cluster.run(["scancel", "-u", cluster.user, "-n", "sleep"], as_root=True)
        p.communicate(timeout=120)


# Holds this many of the pin server's slots for the user who runs it, for the
# seconds given: each connection sends nothing, so its worker waits out PIN_READ
# (2 s) for a request, and each round opens them again.  After its first round it
# prints the status one more connection is answered (75: busy).
_HOLD_PINS = (
    "import socket, sys, time\n"
    "end, said = time.time() + float(sys.argv[3]), False\n"
    "while time.time() < end:\n"
    "    held = []\n"
    "    for _ in range(int(sys.argv[2])):\n"
    "        s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); held.append(s)\n"
    "    if not said:\n"
    "        t = socket.socket(socket.AF_UNIX); t.connect(sys.argv[1]); t.settimeout(5)\n"
    "        print(int.from_bytes(t.recv(8)[:4], 'big', signed=True), flush=True)\n"
    "        said = True\n"
    "    for s in held:\n"
    "        s.settimeout(30); s.recv(1)\n"
)


def test_a_busy_pin_server_is_asked_again_so_a_private_image_still_pins(
    cluster: Cluster, workdir: Path
) -> None:
    """The soak's pin flood (20 of 2,000 tasks refused): with the user's slots on
    the pin server taken (MAX_PINS_PER_UID: in the soak by the flooding user's
    own connections, whose jobs then asked; here by the user's), the plugin was
    answered "busy" and pinned with the user's own credentials, which cannot pin
    what only the host's robot reads (in the soak: any image, for a user with
    none; here a team's private image).  It now asks the busy server again within
    its share of submit_timeout."""
    if cluster.chroot:
        pytest.skip("the pin socket is the host's (the other host runs it there)")
    holder = cluster.start(
        ["/usr/bin/python3", "-c", _HOLD_PINS, "/run/tfimage/pin.sock", "4", "5"], workdir
    )
    job = ""
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "75"  # busy for this user, now
        r = cluster.run(
            ["sbatch", "--parsable", f"--tf-image={PRIVATE}", "-o", "/dev/null", "--wrap", "true"],
            cwd=workdir,
        )
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip()
    finally:
        holder.kill()
        holder.wait(10)
        if job:
            cluster.run(["scancel", job], as_root=True)

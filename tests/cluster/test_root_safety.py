"""Root on the node stays root's, on the real cluster: a user's image cannot lend a
setuid bit or a device to the host, a link cannot take a ``--tf-mount`` outside the
admin's prefixes, a job's values cannot make a hook fail, and a registry that
trickles cannot hold a prolog past its deadline."""

from __future__ import annotations

import hashlib
import os
import pwd
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Cluster, bridge_server, busybox_sif, push
from hostile import Server

from support import add_privileges, build_sif

pytestmark = pytest.mark.cluster
TFIMAGE_MOUNTS = ("/run/tfimage/jobs/", "/run/tfimage/images/")


def _as_nobody_on(cluster: Cluster, node: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``argv`` as another unprivileged user (nobody), in the node's namespaces."""
    return cluster.on_node(
        node, ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    )


def test_a_setuid_file_or_device_in_a_users_image_is_never_root_on_the_node(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    busybox_sif(tmp_path, "setuid:1")
    root = tmp_path / "root-setuid:1"  # busybox_sif's tree: add to it and build again
    add_privileges(root, tmp_path)
    push(cluster, build_sif(root, tmp_path / "setuid.sif"), "setuid:1")
    job = cluster.start(
        ["srun", "-N1", "-w", "n1", "--tf-image=setuid:1", "sh", "-c", "echo up; sleep 60"],
        workdir,
    )
    try:
        assert job.stdout is not None
        assert job.stdout.readline().strip() == "up", job.stderr.read() if job.stderr else ""
        mine = [m for m in cluster.node_mounts("n1") if m.startswith(TFIMAGE_MOUNTS)]
        image = [m for m in mine if "/images/sha256-" in m]
        step = [m for m in mine if m.endswith("/root")]
        assert image and step, mine
        with open(f"/proc/{cluster.node_pid('n1')}/mountinfo") as f:
            flags = {
                line.split()[4]: set(line.split()[5].split(","))
                for line in f
                if line.split()[4].startswith(TFIMAGE_MOUNTS)
            }
        for target, opts in flags.items():
            assert {"ro", "nosuid", "nodev"} <= opts, (target, opts)
        for base in (image[0], step[0]):
            r = _as_nobody_on(cluster, "n1", f"{base}/bin/euid")
            assert r.returncode == 0 and r.stdout.strip() == "65534", r.stdout + r.stderr
            r = _as_nobody_on(cluster, "n1", "dd", f"if={base}/null", "of=/dev/null", "count=1")
            assert r.returncode != 0 and "Permission denied" in r.stderr, r.stderr
    finally:
        job.kill()
        job.wait()


def test_a_link_under_an_allowed_prefix_cannot_mount_what_lies_outside(
    cluster: Cluster, workdir: Path
) -> None:
    link = workdir / "etc-link"
    link.symlink_to("/etc")
    pw = pwd.getpwnam(cluster.user)
    os.lchown(link, pw.pw_uid, pw.pw_gid)
    r = cluster.run(
        ["srun", "-N1", f"--tf-mount={link}:/inputs", "--tf-image=tiny:1.0", "true"], cwd=workdir
    )
    assert r.returncode != 0
    assert f"--tf-mount {link}: it leads to /etc, outside the allowed prefixes" in r.stderr
    # The same directory by its real name, under the prefix, still binds.
    real = workdir / "data"
    real.mkdir()
    os.chown(real, pw.pw_uid, pw.pw_gid)
    (workdir / "data-link").symlink_to(real)
    os.lchown(workdir / "data-link", pw.pw_uid, pw.pw_gid)
    (real / "f").write_text("through the link\n")
    r = cluster.run(
        [
            "srun",
            "-N1",
            f"--tf-mount={workdir / 'data-link'}:/inputs",
            "--tf-image=tiny:1.0",
            "cat",
            "/inputs/f",
        ],
        cwd=workdir,
    )
    assert r.returncode == 0 and r.stdout == "through the link\n", r.stderr


@pytest.mark.parametrize("image", ["-x", "--help", "a\nb"])
def test_the_deployed_prolog_never_fails_for_a_jobs_value(cluster: Cluster, image: str) -> None:
    """Any user can give a job any control environment through Slurm's API; the
    prolog script the role installed must take it as a value, and exit 0."""
    job = str(4_000_000_000 + len(image))
    script = cluster.state / "etc" / "prolog.d" / "50-tfimage"
    assert script.exists()
    before = len(cluster.hooks_log("n1"))
    r = cluster.on_node(
        "n1", ["env", f"SPANK_TFIMAGE_IMAGE={image}", f"SLURM_JOB_ID={job}", "/bin/sh", str(script)]
    )
    assert r.returncode == 0, r.stderr
    new = [line for line in cluster.hooks_log("n1")[before:] if f"job {job}" in line]
    assert len(new) == 1 and "invalid image reference" in new[0], new


@pytest.fixture
def trickling(cluster: Cluster, tmp_path: Path) -> Iterator[Server]:
    """A registry on the cluster's bridge that sends 64 KiB a second (each read well
    inside read_timeout), with a certificate from the cluster's CA."""
    with bridge_server(cluster, tmp_path) as s:
        yield s


def test_a_trickling_registry_ends_the_prolog_at_its_deadline_and_the_job_says_why(
    cluster: Cluster, workdir: Path, trickling: Server
) -> None:
    trickling.serve(os.urandom(16 << 20), delay=1.0)
    digest = "sha256:" + hashlib.sha256(trickling.b.manifest).hexdigest()
    ref = f"{trickling.host}/library/slow@{digest}"
    allowed = [cluster.env["TFIMAGE_REGISTRY"], trickling.host]
    before = len(cluster.hooks_log("n1"))
    with cluster.config_with(hook_deadline=8, allowed_registries=allowed):
        started = time.monotonic()
        r = cluster.run(["srun", "-N1", "-w", "n1", f"--tf-image={ref}", "true"], cwd=workdir)
        took = time.monotonic() - started
    assert r.returncode != 0
    assert "the prolog could not ready it on this node: prolog: gave up after 8 s" in r.stderr
    assert took < 8 + 20, took  # the deadline, once: not a second wait in the step
    lines = [line for line in cluster.hooks_log("n1")[before:] if "library/slow" in line]
    assert len(lines) == 1 and "gave up after 8 s" in lines[0], lines
    cluster.assert_never_drained("n1")

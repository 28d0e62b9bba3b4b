"""--tf-mount and the admin's default binds, on the cluster: where a task finds its
data, and the step that cannot have it fails saying why."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import Cluster

pytestmark = pytest.mark.cluster


def test_mounts_default_and_user(cluster: Cluster, workdir: Path) -> None:
    src = workdir / "inputs"
    src.mkdir()
    (src / "x.txt").write_text("user data\n")
    shutil.chown(src, cluster.user)
    r = cluster.run(
        [
            "srun",
            "-N2",
            "--label",
            "--tf-image=tiny:1.0",
            f"--tf-mount={src}:/inputs:ro",
            "sh",
            "-c",
            "cat /inputs/x.txt /mnt/README",
        ],
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    # Each task's lines in its order; the two tasks' lines may interleave.
    lines = r.stdout.splitlines()
    for task in ("0", "1"):
        mine = [line.split(": ", 1)[1] for line in lines if line.startswith(f"{task}: ")]
        assert mine == ["user data", "site data"], r.stdout
    assert len(lines) == 4, r.stdout


def test_mount_outside_allowed_prefixes_rejected_at_submit(cluster: Cluster, workdir: Path) -> None:
    before = cluster.job_ids()
    r = cluster.run(
        ["sbatch", "--tf-image=tiny:1.0", "--tf-mount=/etc:/hostetc", "--wrap", "true"], cwd=workdir
    )
    assert r.returncode != 0
    assert "tfimage: submit: --tf-mount '/etc:/hostetc': host path /etc is outside" in r.stderr
    assert cluster.job_ids() <= before  # nothing queued (old ones may age out)


def test_a_mount_inside_the_sites_bind_is_refused_at_submit(
    cluster: Cluster, workdir: Path
) -> None:
    # The local cluster binds $STATE/data at /mnt in every container (default_binds):
    # mounted after the user's, it would hide /mnt/d and the job would find it empty.
    before = cluster.job_ids()
    r = cluster.run(
        ["sbatch", "--tf-image=tiny:1.0", f"--tf-mount={workdir}:/mnt/d", "--wrap", "true"],
        cwd=workdir,
    )
    assert r.returncode != 0
    assert (
        f"tfimage: submit: --tf-mount {workdir}:/mnt/d: destination /mnt/d lies inside /mnt, "
        "which the site binds into every container" in r.stderr
    )
    assert cluster.job_ids() <= before  # nothing queued (old ones may age out)


def test_missing_mount_source_fails_the_step_clearly(cluster: Cluster, workdir: Path) -> None:
    r = cluster.run(
        ["srun", "-N1", "--tf-image=tiny:1.0", f"--tf-mount={workdir}/nope:/inputs", "true"],
        cwd=workdir,
    )
    assert r.returncode != 0
    # Resolved as the user when the step is prepared: the reason, on srun's stderr.
    assert f"--tf-mount host path {workdir}/nope: No such file or directory" in r.stderr

"""The seed's prod and dev partitions on the real cluster: prod runs only images that
can be traced (by digest, from the registry's library/ and team-a/, SIF images,
within a size), dev runs the same jobs; a refused job fails with the reason on the
user's stderr, and its node is never drained."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import Cluster, busybox_sif, push, site_registry

from support import push_oci_image

pytestmark = pytest.mark.cluster
MARKER = "/etc/tfimage-test-image"


def _srun(
    cluster: Cluster, workdir: Path, partition: str, image: str, cat: str = "cat"
) -> tuple[int, str, str]:
    r = cluster.run(
        ["srun", "-p", partition, "-N1", "-w", "n1", f"--tf-image={image}", *cat.split(), MARKER],
        cwd=workdir,
    )
    return r.returncode, r.stdout, r.stderr


def _fresh(cluster: Cluster, tmp_path: Path, repo: str) -> tuple[str, str]:
    """A new image in ``repo`` (on no node yet): its marker and digest."""
    marker = f"{repo.rsplit('/', 1)[-1]}-{os.urandom(4).hex()}"
    return marker, push(cluster, busybox_sif(tmp_path, marker), f"{repo}:1")


def test_prod_refuses_a_tag_that_dev_runs_and_runs_it_by_digest(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    marker, digest = _fresh(cluster, tmp_path, "library/policy-tag")
    rc, _, err = _srun(cluster, workdir, "prod", "policy-tag:1")
    assert rc != 0, err
    assert "partition prod requires a digest: --tf-image=policy-tag:1@sha256:..." in err, err
    cluster.assert_never_drained("n1")
    rc, out, err = _srun(cluster, workdir, "dev", "policy-tag:1")
    assert (rc, out) == (0, f"{marker}\n"), err
    rc, out, err = _srun(cluster, workdir, "prod", f"policy-tag:1@{digest}")
    assert (rc, out) == (0, f"{marker}\n"), err


def test_prod_refuses_a_repository_outside_its_projects_before_any_pull(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    _, digest = _fresh(cluster, tmp_path, "team-b/policy-repo")
    rc, _, err = _srun(cluster, workdir, "prod", f"team-b/policy-repo:1@{digest}")
    assert rc != 0
    assert (
        "partition prod runs images of library/*, team-a/* only, not team-b/policy-repo" in err
    ), err
    cache = cluster.state / "nodes" / "n1" / "cache" / "images"
    assert not (cache / f"{digest.replace(':', '-')}.sif").exists()  # nothing pulled
    cluster.assert_never_drained("n1")


def test_prod_refuses_an_oci_image_that_dev_converts_and_runs(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    name = f"policy-oci{os.getpid()}"
    push_oci_image(site_registry(cluster), tmp_path, f"library/{name}")
    rc, out, err = _srun(cluster, workdir, "dev", f"{name}:1", cat="busybox cat")
    assert (rc, out) == (0, "oci-marker\n"), err
    r = cluster.run(["tfimage", "resolve", f"{name}:1"], as_root=True)
    assert r.returncode == 0, r.stderr
    digest = r.stdout.strip().rsplit("@", 1)[1]
    rc, _, err = _srun(cluster, workdir, "prod", f"{name}:1@{digest}")
    assert rc != 0
    assert f"partition prod runs SIF images only: {cluster.env['TFIMAGE_REGISTRY']}" in err, err
    assert "is an OCI image (push it as a SIF)" in err, err
    cluster.assert_never_drained("n1")


def test_prod_refuses_an_image_over_its_size_and_a_batch_job_says_why(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    _, digest = _fresh(cluster, tmp_path, "library/policy-size")
    rules = {"prod": {"max_image_bytes": "4K"}, "dev": {}}
    with cluster.config_with(partitions=rules):
        r, out = cluster.sbatch(
            workdir,
            "big.sh",
            f"#!/bin/sh\n#SBATCH -p prod -N1 -w n1 --tf-image=policy-size@{digest}\n"
            "#SBATCH -o big.out\nsrun cat /etc/tfimage-test-image\n",
            "big.out",
        )
    assert r.returncode != 0, out
    assert "partition prod runs images of at most 4.0 KiB: " in out, out
    cluster.assert_never_drained("n1")


def test_prod_refuses_a_tag_at_submit_in_one_line_and_queues_nothing(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    """cli_filter/lua sees -p and #SBATCH -p, which the SPANK plugin never does."""
    _fresh(cluster, tmp_path, "library/policy-submit")
    before = cluster.job_ids()
    rc, _, err = _srun(cluster, workdir, "prod", "policy-submit:1")
    assert rc != 0
    refusal = (
        "tfimage: partition-check: partition prod requires a digest: "
        "--tf-image=policy-submit:1@sha256:..."
    )
    assert err.splitlines()[0].startswith(refusal), err
    assert "prolog" not in err, err  # stopped before any node saw it
    script = workdir / "prod.sh"
    script.write_text("#!/bin/sh\n#SBATCH -p prod --tf-image=policy-submit:1\ntrue\n")
    r = cluster.run(["sbatch", str(script)], cwd=workdir)
    assert r.returncode != 0 and r.stderr.splitlines()[0].startswith(refusal), r.stderr
    assert cluster.job_ids() <= before  # nothing queued (old ones may age out)
    r = cluster.run(["sbatch", "--parsable", "-p", "dev", str(script)], cwd=workdir)
    assert r.returncode == 0, r.stderr  # -p on the command line wins, and dev takes tags
    cluster.assert_never_drained("n1")


def test_the_prolog_refuses_what_reaches_prod_past_the_submit_check(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    """A job moved to prod after submit (scontrol update, as its user may) never
    passed the cli_filter: the node's prolog refuses it, and says why."""
    _fresh(cluster, tmp_path, "library/policy-moved")
    job = cluster.submit(
        workdir, "--hold", "-p", "dev", "-w", "n1", "-o", "moved.out",
        "--tf-image=policy-moved:1", "--wrap", "srun cat /etc/tfimage-test-image",
    )  # fmt: skip
    moved = cluster.run(["scontrol", "update", f"JobId={job}", "Partition=prod"], cwd=workdir)
    assert moved.returncode == 0, moved.stderr
    assert cluster.run(["scontrol", "release", job], cwd=workdir).returncode == 0
    deadline = time.monotonic() + 120
    while job in cluster.run(["squeue", "-h", "-o", "%i"], as_root=True).stdout.split():
        assert time.monotonic() < deadline
        time.sleep(0.3)
    out = (workdir / "moved.out").read_text()
    assert "the prolog could not ready it on this node: partition prod requires a digest" in out
    cluster.assert_never_drained("n1")


def test_a_job_without_tf_image_in_a_partition_with_a_default_runs_inside_it(
    cluster: Cluster, workdir: Path
) -> None:
    """The local cluster's train partition defaults to tiny:1.0: an srun step and a
    one-task batch script run in it; --tf-image still chooses; dev has no default."""
    r = cluster.run(["srun", "-p", "train", "-w", "n1", "cat", MARKER], cwd=workdir)
    assert (r.returncode, r.stdout) == (0, "tiny:1.0\n"), r.stderr
    r, out = cluster.sbatch(
        workdir, "train.sh", f"#!/bin/sh\n#SBATCH -p train -w n2 -o train.out\ncat {MARKER}\n",
        "train.out",
    )  # fmt: skip
    assert (r.returncode, out) == (0, "tiny:1.0\n"), out
    r = cluster.run(
        ["srun", "-p", "train", "-w", "n1", "--tf-image=team-a/tiny:1.0", "cat", MARKER],
        cwd=workdir,
    )
    assert (r.returncode, r.stdout) == (0, "team-a/tiny:1.0\n"), r.stderr
    r = cluster.run(["srun", "-p", "dev", "-w", "n1", "cat", MARKER], cwd=workdir)
    assert r.returncode != 0 and "No such file" in r.stderr, r.stderr  # the host's /etc
    cluster.assert_never_drained("n1")
    cluster.assert_never_drained("n2")


def test_prod_refuses_a_docker_name_at_submit_and_queues_nothing(
    cluster: Cluster, workdir: Path
) -> None:
    """Conversion is off in prod: a docker:// name is refused by its name, at submit
    (prod here takes the Docker Hub project too, so that conversion is what refuses)."""
    rules = {
        "prod": {"repositories": ["library/*", "dockerhub/library/*"], "allow_conversion": False},
        "dev": {},
    }
    before = cluster.job_ids()
    image = "docker://ubuntu:22.04@sha256:" + "a" * 64
    with cluster.config_with(partitions=rules):
        r = cluster.run(["srun", "-p", "prod", f"--tf-image={image}", "true"], cwd=workdir)
    assert r.returncode != 0
    refusal = "tfimage: partition-check: partition prod runs SIF images only: "
    assert r.stderr.startswith(refusal), r.stderr
    assert cluster.job_ids() <= before  # nothing queued (old ones may age out)

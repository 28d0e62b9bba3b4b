"""What a user coming from `singularity exec` types, and what they are told: a typo in a
tag and a Docker Hub image the site's proxy cache does not hold are answered at submit,
in one line, before anything is queued."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import Cluster, site_registry, write_script

from support import push_oci_image

pytestmark = pytest.mark.cluster


def _refused(cluster: Cluster, workdir: Path, image: str) -> str:
    before = cluster.job_ids()
    r = cluster.run(["srun", "-N1", f"--tf-image={image}", "true"], cwd=workdir)
    assert r.returncode != 0, r.stdout
    assert not cluster.job_ids() - before, r.stderr  # never queued: no new id in Slurm
    return r.stderr


def test_a_typo_in_a_tag_is_answered_with_the_closest_tags(cluster: Cluster, workdir: Path) -> None:
    err = _refused(cluster, workdir, "tf-custom:2.1")
    line = next((x for x in err.splitlines() if "no such tag" in x), err)
    assert line.endswith("/library/tf-custom:2.1: no such tag; did you mean tf-custom:2.0?"), err


def test_a_docker_hub_image_the_proxy_does_not_hold_says_where_it_was_looked_for(
    cluster: Cluster, workdir: Path
) -> None:
    err = _refused(cluster, workdir, "docker://tensorflow/tensorflow:latest-gpu")
    registry = cluster.env["TFIMAGE_REGISTRY"]
    wanted = (
        f"{registry}/dockerhub/tensorflow/tensorflow: no such repository, or not readable "
        "with the credentials used"
    )
    assert wanted in err, err


def test_a_converted_singularity_script_runs_as_a_tfimage_job(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    # The guide's script, on this cluster: its image from "Docker Hub" (the site's
    # dockerhub proxy project), its data bound from the user's home.
    reg = site_registry(cluster)
    name = f"guide{os.getpid()}"
    push_oci_image(reg, tmp_path, f"dockerhub/library/{name}")
    (workdir / "ds").mkdir()
    (workdir / "ds" / "x.txt").write_text("the data\n")
    write_script(workdir, "job.sh", (
        "#!/bin/sh\n"
        "#SBATCH --job-name=tensorflow_train\n"
        "#SBATCH --output=train_%j.out\n"
        "#SBATCH --nodes=1\n"
        "#SBATCH --ntasks=1\n"
        "#SBATCH --time=00:05:00\n"
        "module load singularity/3.8\n"
        "singularity exec \\\n"
        "  --nv \\\n"
        f"  --bind {workdir}/ds:/dataset \\\n"
        f"  docker://{name}:1 \\\n"
        "  sh -c 'cat /etc/tfimage-test-image /dataset/x.txt'\n"
    ), cluster.user)  # fmt: skip
    r = cluster.run(["tfimage", "convert-script", "--write", "job.sh"], cwd=workdir)
    assert r.returncode == 0, r.stderr
    converted = (workdir / "job.sh").read_text()
    assert f"#SBATCH --tf-image=docker://{name}:1\n" in converted, converted
    assert f"#SBATCH --tf-mount={workdir}/ds:/dataset\n" in converted, converted
    r, job = cluster.sbatch_wait(workdir, "job.sh", timeout=300)
    assert r.returncode == 0, r.stderr
    assert (workdir / f"train_{job}.out").read_text() == "oci-marker\nthe data\n"

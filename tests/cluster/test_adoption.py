"""What a user coming from `singularity exec` types, and what they are told: a typo in a
tag and a Docker Hub image the site's proxy cache does not hold are answered at submit,
in one line, before anything is queued."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Cluster

pytestmark = pytest.mark.cluster


def _refused(cluster: Cluster, workdir: Path, image: str) -> str:
    r = cluster.run(["srun", "-N1", f"--tf-image={image}", "true"], cwd=workdir)
    assert r.returncode != 0, r.stdout
    assert "queued" not in r.stderr and "allocated" not in r.stderr, r.stderr  # never queued
    return r.stderr


def test_a_typo_in_a_tag_is_answered_with_the_closest_tags(
    cluster: Cluster, workdir: Path
) -> None:
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


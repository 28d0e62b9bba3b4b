"""docker:// images: an OCI image pushed with skopeo runs converted to a SIF, the site's
own and Docker Hub's through the site's proxy-cache project."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import Cluster, site_registry

from support import push_oci_image

pytestmark = pytest.mark.cluster


def test_docker_image_runs_converted(cluster: Cluster, workdir: Path, tmp_path: Path) -> None:
    """An OCI image pushed with skopeo runs as `--tf-image=docker://...` on both nodes."""
    reg = site_registry(cluster)
    repo = f"library/ocirun{os.getpid()}"
    push_oci_image(reg, tmp_path, repo)
    r = cluster.run(
        [
            "srun",
            "-N2",
            f"--tf-image=docker://{reg.host}/{repo}:1",
            "sh",
            "-c",
            'echo "$(cat /etc/tfimage-test-image) $SLURMD_NODENAME FOO=$FOO"',
        ],
        cwd=workdir,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    # The image config's Env (FOO=bar) reaches the task, as under apptainer.
    assert sorted(r.stdout.split("\n")[:-1]) == ["oci-marker n1 FOO=bar", "oci-marker n2 FOO=bar"]


@pytest.mark.parametrize("asked", ["docker://{name}:1", "docker.io/{name}:1"])
def test_docker_hub_names_come_through_the_sites_proxy_cache_project(
    cluster: Cluster, workdir: Path, tmp_path: Path, asked: str
) -> None:
    # What a user copies from a singularity line: Docker Hub's short name, whose
    # implicit library/ the site's dockerhub project (the role's) holds as Harbor's
    # proxy cache would.
    reg = site_registry(cluster)
    name = f"hub{os.getpid()}{len(asked)}"
    push_oci_image(reg, tmp_path, f"dockerhub/library/{name}")
    asked = asked.format(name=name)
    r, _ = cluster.sbatch_wait(workdir, "-v", "-N1", "-o", f"{name}.out",
                               f"--tf-image={asked}", "--wrap", "cat /etc/tfimage-test-image",
                               timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (workdir / f"{name}.out").read_text() == "oci-marker\n"
    shown = f"tfimage: submit: {asked} pinned to "  # sbatch -v shows the mapping
    line = next((x for x in r.stderr.splitlines() if shown in x), r.stderr[-2000:])
    assert f"{reg.host}/dockerhub/library/{name}:1@sha256:" in line, line

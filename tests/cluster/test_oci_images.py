"""docker:// images: an OCI image pushed with skopeo runs converted to a SIF."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import Cluster

from support import Registry, push_oci_image

pytestmark = pytest.mark.cluster


def test_docker_image_runs_converted(cluster: Cluster, workdir: Path, tmp_path: Path) -> None:
    """An OCI image pushed with skopeo runs as `--tf-image=docker://...` on both nodes."""
    for tool in ("umoci", "skopeo", "busybox"):
        if not shutil.which(tool):
            pytest.skip(f"needs {tool} (deploy/local/packages.sh installs it)")
    site = yaml.safe_load(Path(cluster.env["TFIMAGE_CONFIG"]).read_text())
    creds = yaml.safe_load(Path(site["credentials"]).read_text())["registries"][site["registry"]]
    reg = Registry(site["registry"], Path(site["ca_bundle"]), creds["username"], creds["password"])
    repo = f"library/ocirun{os.getpid()}"
    push_oci_image(reg, tmp_path, repo)
    r = cluster.run(
        [
            "srun",
            "-N2",
            f"--tf-image=docker://{repo}:1",
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

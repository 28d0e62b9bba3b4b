"""SIFs as a site's older clients pushed them, run in real jobs on both nodes: the
exact manifests of SingularityCE 4.0-4.3 and Apptainer 1.3.0 (Docker schema 2) and
of SingularityCE 3.9-3.11 and Apptainer 1.0-1.2 (oras-go's unknown config type),
from tests/peers.py; and an image index holding a SIF per platform, pinned at submit to
this platform's manifest; squashfs compressions other than ours; and a data-only SIF,
refused at submit."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import Cluster, busybox_sif, push, site_registry

from peers import PUSHES, Push
from tfimage.agent.core.sif import this_platform
from tfimage.agent.registry.artifact import SIF_CONFIG, SIF_LAYER, TITLE
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.registry.mediatypes import OCI_INDEX, OCI_MANIFEST


def _push(up: RegistryClient, repo: str, sif: Path, tag: str, media_type: str) -> tuple[str, int]:
    layer, size = up.push_blob(repo, sif)
    config = up.push_bytes(repo, b"{}")
    raw = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": media_type,
            "config": {"mediaType": SIF_CONFIG, "digest": config, "size": 2},
            "layers": [
                {
                    "mediaType": SIF_LAYER,
                    "digest": layer,
                    "size": size,
                    "annotations": {TITLE: "image.sif"},
                }
            ],
        }
    ).encode()
    return up.push_manifest(repo, tag, raw, media_type), len(raw)


def _markers(cluster: Cluster, workdir: Path, image: str) -> list[str]:
    r = cluster.run(
        ["srun", "-N2", f"--tf-image={image}", "cat", "/etc/tfimage-test-image"], cwd=workdir
    )
    assert r.returncode == 0, r.stderr
    return sorted(r.stdout.split())


# The two shapes most of a site's older SIFs have (tests/peers.py cites each).
OLDER = [p for p in PUSHES if p.name in ("ggcr-docker", "oras-go-default")]


@pytest.mark.parametrize("peer", OLDER, ids=[p.name for p in OLDER])
def test_a_sif_as_an_older_client_pushed_it_runs_on_both_nodes(
    cluster: Cluster, workdir: Path, tmp_path: Path, peer: Push
) -> None:
    up = site_registry(cluster).client()
    marker = f"{peer.name}-{os.urandom(4).hex()}"
    sif = busybox_sif(tmp_path, marker)
    layer, size = up.push_blob("library/older", sif)
    up.push_bytes("library/older", peer.config_blob)
    raw = peer.manifest(layer, size, sif.name)
    up.push_manifest("library/older", peer.name, raw, peer.content_type)
    assert _markers(cluster, workdir, f"older:{peer.name}") == [marker, marker]


def test_an_index_of_sifs_runs_this_platforms_image_on_both_nodes(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    up = site_registry(cluster).client()
    here = this_platform().split("/")[1]
    other = "s390x" if here != "s390x" else "arm64"
    ours, theirs = (f"{arch}-{os.urandom(4).hex()}" for arch in (here, other))
    d_theirs, n_theirs = _push(
        up, "library/multi", busybox_sif(tmp_path, theirs), "theirs", OCI_MANIFEST
    )
    d_ours, n_ours = _push(up, "library/multi", busybox_sif(tmp_path, ours), "ours", OCI_MANIFEST)
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [
            {
                "mediaType": OCI_MANIFEST,
                "digest": digest,
                "size": size,
                "platform": {"os": "linux", "architecture": arch},
            }
            for digest, size, arch in ((d_theirs, n_theirs, other), (d_ours, n_ours, here))
        ],
    }
    up.push_manifest("library/multi", "1", json.dumps(index).encode(), OCI_INDEX)
    assert _markers(cluster, workdir, "multi:1") == [ours, ours]


@pytest.mark.parametrize("comp", ["xz", "zstd"])
def test_a_sif_compressed_as_apptainer_may_build_it_runs_on_both_nodes(
    cluster: Cluster, workdir: Path, tmp_path: Path, comp: str
) -> None:
    marker = f"{comp}-{os.urandom(4).hex()}"
    push(cluster, busybox_sif(tmp_path, marker, comp), f"comp-{comp}:1")
    assert _markers(cluster, workdir, f"comp-{comp}:1") == [marker, marker]


def test_a_data_only_sif_is_refused_at_submit_with_one_line(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(1 << 16))
    sif = tmp_path / "data.sif"
    subprocess.run(["siftool", "new", str(sif)], check=True, capture_output=True, timeout=30)
    subprocess.run(["siftool", "add", "--datatype", "7", str(sif), str(data)],
                   check=True, capture_output=True, timeout=30)  # fmt: skip
    push(cluster, sif, "dataonly:1")
    before = cluster.run(["squeue", "-h", "-o", "%i"], as_root=True).stdout.split()
    r = cluster.run(["srun", "-N1", "--tf-image=dataonly:1", "true"], cwd=workdir)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if "error: tfimage:" in line]
    assert len(lines) == 1 and "no system partition (data only" in lines[0], r.stderr
    assert cluster.run(["squeue", "-h", "-o", "%i"], as_root=True).stdout.split() == before

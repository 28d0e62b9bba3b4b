"""docker:// images: a real OCI image (umoci) pushed with skopeo, converted to a SIF."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from support import Registry, need, push_oci_image
from tfimage.agent import mounts
from tfimage.agent.cache import ImageCache
from tfimage.agent.config import load_config
from tfimage.agent.convert import apptainer_build
from tfimage.agent.sif import root_partition


def test_docker_reference_is_converted_and_cached(registry: Registry, tmp_path: Path) -> None:
    need("umoci", "skopeo", "mksquashfs", "siftool", "busybox", "squashfuse")
    if os.geteuid() != 0:
        pytest.skip("reading the converted image back mounts it, which needs root")
    push_oci_image(registry, tmp_path, "library/ocitest")
    cfg = load_config(registry.write_site(tmp_path))
    cache = ImageCache(cfg)
    got = cache.ensure(cfg.reference("docker://ocitest:1"))
    assert not got.hit and got.ref.transport == "docker"
    again = cache.ensure(cfg.reference("docker://ocitest:1"))
    assert again.hit and again.path == got.path  # converted once, cached by digest
    assert not any((cache.root / "tmp").iterdir())  # no work left behind
    with got.path.open("rb") as f:
        assert root_partition(f, got.path.stat().st_size).size > 0
    state = tmp_path / "state"
    state.mkdir()
    assert got.ref.digest
    img = mounts.mount_image(str(state), "1", got.path, got.ref.digest)
    try:
        assert (img / "etc/tfimage-test-image").read_text() == "oci-marker\n"
        assert "export FOO=bar" in (img / ".singularity.d/env/90-environment.sh").read_text()
        assert "cd /etc" in (img / ".singularity.d/runscript").read_text()
        assert "FOO=bar" in (img / "ch/environment").read_text().split()
        assert (img / "etc/hosts").exists()  # added for ch-run
        assert (img / "bin/busybox").stat().st_uid == 0  # -all-root
    finally:
        mounts.release_job(str(state), "1")


def test_apptainer_builds_from_the_fetched_layout_without_credentials(tmp_path: Path) -> None:
    argv, env = apptainer_build("/usr/bin/apptainer", tmp_path)
    assert argv == [
        "/usr/bin/apptainer",
        "build",
        "--force",
        str(tmp_path / "img.sif"),
        f"oci:{tmp_path / 'oci'}:img",
    ]
    # Its cache and scratch stay in the conversion's own directory (removed after).
    assert env == {
        "APPTAINER_CACHEDIR": str(tmp_path / "cache"),
        "APPTAINER_TMPDIR": str(tmp_path / "tmp"),
    }


def test_apptainer_converts_a_real_image_where_installed(
    registry: Registry, tmp_path: Path
) -> None:
    if not shutil.which("apptainer"):
        pytest.skip(
            "apptainer is not installed here (not packaged for Debian 12/13); "
            "conversion used skopeo + umoci + mksquashfs + siftool above"
        )
    need("umoci", "skopeo")
    push_oci_image(registry, tmp_path, "library/ocitest-apptainer")
    cfg = load_config(registry.write_site(tmp_path))
    got = ImageCache(cfg).ensure(cfg.reference("docker://ocitest-apptainer:1"))
    with got.path.open("rb") as f:
        assert root_partition(f, got.path.stat().st_size).size > 0

"""docker:// images: a real OCI image (umoci) pushed with skopeo, converted to a SIF."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from support import Registry, need, push_oci_image
from tfimage.agent.cache.convert import apptainer_build
from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import ImageError
from tfimage.agent.core.sif import root_partition
from tfimage.agent.step import imagemount


def test_docker_reference_is_converted_and_cached(registry: Registry, tmp_path: Path) -> None:
    need("umoci", "skopeo", "mksquashfs", "siftool", "busybox", "squashfuse")
    if os.geteuid() != 0:
        pytest.skip("reading the converted image back mounts it, which needs root")
    push_oci_image(registry, tmp_path, "library/ocitest")
    cfg = load_config(registry.write_site(tmp_path))
    cache = ImageCache(cfg)
    pull = Puller(cache)
    got = pull.ensure(cfg.reference("docker://ocitest:1"))
    assert not got.hit and got.ref.transport == "docker"
    again = pull.ensure(cfg.reference("docker://ocitest:1"))
    assert again.hit and again.path == got.path  # converted once, cached by digest
    assert not any((cache.root / "tmp").iterdir())  # no work left behind
    with got.path.open("rb") as f:
        assert root_partition(f, got.path.stat().st_size).size > 0
    # Published as any entry is: with its metadata (else eviction never sees it).
    entry = {e.digest: e for e in cache.entries()}[str(got.ref.digest)]
    assert entry.source == registry.host and "blob" not in entry.to_json()
    state = tmp_path / "state"
    state.mkdir()
    assert got.ref.digest
    img = imagemount.mount_image(str(state), "1", got.path, got.ref.digest)
    try:
        assert (img / "etc/tfimage-test-image").read_text() == "oci-marker\n"
        assert "export FOO=bar" in (img / ".singularity.d/env/90-environment.sh").read_text()
        assert "cd /etc" in (img / ".singularity.d/runscript").read_text()
        assert "FOO='bar'" in (img / "ch/environment").read_text().split()
        assert (img / "etc/hosts").exists()  # added for ch-run
        assert (img / "bin/busybox").stat().st_uid == 0  # -all-root
    finally:
        imagemount.release_job(str(state), "1")
        imagemount.release_images(str(state), lambda digest: False)


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
    got = Puller(ImageCache(cfg)).ensure(cfg.reference("docker://ocitest-apptainer:1"))
    with got.path.open("rb") as f:
        assert root_partition(f, got.path.stat().st_size).size > 0


# --- the unpacked image is hostile: links, shell in Env, setuid files, devices ------


@pytest.fixture
def converting(registry: Registry, tmp_path: Path) -> Puller:
    need("umoci", "skopeo", "mksquashfs", "siftool", "busybox", "squashfuse")
    if os.geteuid() != 0:
        pytest.skip("conversion writes a root-owned tree and reads it back mounted: root")
    return Puller(ImageCache(load_config(registry.write_site(tmp_path))))


@pytest.mark.parametrize(
    ("link", "written"),
    [("ch", "environment"), (".singularity.d/env", "90-environment.sh")],
)
def test_an_image_whose_link_leads_out_is_refused_and_nothing_is_written_there(
    converting: Puller, registry: Registry, tmp_path: Path, link: str, written: str
) -> None:
    outside = tmp_path / "host-dir"  # stands for /etc or /etc/profile.d
    outside.mkdir()

    def add_link(rootfs: Path) -> None:
        (rootfs / link).parent.mkdir(parents=True, exist_ok=True)
        (rootfs / link).symlink_to(outside)

    repo = "library/linky-" + link.replace("/", "").replace(".", "")
    push_oci_image(registry, tmp_path / "oci", repo, setup=add_link)
    with pytest.raises(ImageError, match=rf"/{link} is a symbolic link .* refuses to write"):
        converting.ensure(converting.cfg.reference(f"docker://{repo.split('/')[1]}:1"))
    assert list(outside.iterdir()) == []  # root wrote nothing through the link
    assert not list((converting.cache.root / "images").iterdir())  # nothing published
    assert not any((converting.cache.root / "tmp").iterdir())  # no work left behind


def test_the_image_env_is_data_never_shell(
    converting: Puller, registry: Registry, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    canary = tmp_path / "ran"
    value = f"$(touch {canary}) `touch {canary}` 'single' \"double\" \\ end\nsecond line"
    env = (f"a;touch {canary};b=1", f"GOOD={value}", "PLAIN=x y")
    push_oci_image(registry, tmp_path / "oci", "library/envy", env=env)
    got = converting.ensure(converting.cfg.reference("docker://envy:1"))
    assert got.ref.digest
    state = tmp_path / "state"
    state.mkdir()
    img = imagemount.mount_image(str(state), "1", got.path, got.ref.digest)
    try:
        script = img / ".singularity.d/env/90-environment.sh"
        # What Apptainer does with it: sourced by a shell, then the task runs.
        shown = subprocess.run(
            ["/bin/sh", "-c", f'. "{script}"; printf %s "$GOOD"; printf "|%s" "$PLAIN"'],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert shown == f"{value}|x y"
        assert not canary.exists()  # neither the key nor the value ran anything
        assert "touch" not in script.read_text().split("GOOD=")[0]  # the bad key is gone
        ch_env = (img / "ch/environment").read_text().splitlines()
        assert ch_env == ["PLAIN='x y'"]  # a line break cannot be written there
    finally:
        imagemount.release_job(str(state), "1")
        imagemount.release_images(str(state), lambda digest: False)
    warned = [r.getMessage() for r in caplog.records]
    assert any("dropped the image's Env entry 'a;touch" in m for m in warned), warned
    assert any("GOOD holds a line break" in m for m in warned), warned


def test_setuid_bits_and_devices_are_stripped_from_a_converted_image(
    converting: Puller, registry: Registry, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def add_privileges(rootfs: Path) -> None:
        shutil.copy("/bin/busybox", rootfs / "bin" / "rootshell")
        (rootfs / "bin" / "rootshell").chmod(0o4755)
        (rootfs / "bin" / "groupie").write_text("x")
        (rootfs / "bin" / "groupie").chmod(0o2755)
        os.mknod(rootfs / "mem", 0o666 | stat.S_IFCHR, os.makedev(1, 1))

    push_oci_image(registry, tmp_path / "oci", "library/privy", setup=add_privileges)
    got = converting.ensure(converting.cfg.reference("docker://privy:1"))
    assert got.ref.digest
    state = tmp_path / "state"
    state.mkdir()
    img = imagemount.mount_image(str(state), "1", got.path, got.ref.digest)
    try:
        assert stat.S_IMODE((img / "bin/rootshell").stat().st_mode) == 0o755
        assert stat.S_IMODE((img / "bin/groupie").stat().st_mode) == 0o755
        assert not (img / "mem").exists()
        assert (img / "bin/busybox").exists()  # the rest is intact
    finally:
        imagemount.release_job(str(state), "1")
        imagemount.release_images(str(state), lambda digest: False)
    assert any(
        "removed setuid/setgid bits from 2 file(s) and 1 device node(s)" in r.getMessage()
        for r in caplog.records
    )


def test_a_fifo_where_the_metadata_goes_is_refused_without_hanging(
    converting: Puller, registry: Registry, tmp_path: Path
) -> None:
    """Opening a FIFO for writing blocks until a reader comes: as root, for ever."""

    def add_fifo(rootfs: Path) -> None:
        (rootfs / "ch").mkdir()
        os.mkfifo(rootfs / "ch" / "environment")

    push_oci_image(registry, tmp_path / "oci", "library/fifo", setup=add_fifo)
    # An operator's pull (no hook deadline around it), in a process a hang can't keep.
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfimage.main",
            "--config",
            str(tmp_path / "config.yaml"),
            "pull",
            "docker://fifo:1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 3, r.stderr
    assert "/ch/environment is not a regular file" in r.stderr
    assert not list((converting.cache.root / "images").iterdir())

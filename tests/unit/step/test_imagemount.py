"""Real squashfuse and overlay mounts (root only), and the path checks in front of them."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from support import add_privileges, build_sif, need
from tfimage.agent.errors import RuntimeSetupError
from tfimage.agent.step import imagemount


@pytest.mark.parametrize(
    "bad", ["relative/x", "/a/../b", "/a/./b", "/a//b", "//a", "/a/", "/a\0b", "/" + "x" * 5000]
)
def test_paths_from_jobs_must_be_normal_and_absolute(bad: str) -> None:
    with pytest.raises(RuntimeSetupError):
        imagemount.safe_abspath(bad, "working directory")


@pytest.mark.parametrize("bad", ["", "12a", "../1", "1/2", "9" * 11])
def test_job_ids_are_digits(bad: str) -> None:
    with pytest.raises(RuntimeSetupError):
        imagemount.job_dir("/run/tfimage", bad)


def test_image_and_step_root_mount_and_release(
    root_with_fuse: None, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    sif = make_sif({"etc/marker": "from-image\n", "home/.keep": ""})
    state = tmp_path / "state"
    state.mkdir()
    digest = "sha256:" + "c" * 64
    img = imagemount.mount_image(str(state), "42", sif, digest)
    try:
        assert imagemount.mounted(img)
        assert (img / "etc/marker").read_text() == "from-image\n"
        assert imagemount.mount_image(str(state), "42", sif, digest) == img  # idempotent

        root = imagemount.step_root(str(state), "42", "0", img, ["/home/u/proj", "/var/spool/x"])
        assert imagemount.mounted(root)
        assert (root / "etc/marker").read_text() == "from-image\n"
        assert (root / "home/u/proj").is_dir() and (root / "var/spool/x").is_dir()
        with pytest.raises(OSError):
            (root / "new-file").write_text("x")  # the container root is read-only
    finally:
        stuck = imagemount.release_job(str(state), "42")
    assert stuck == []
    assert not imagemount.mounted(img)
    assert not (state / "jobs" / "42").exists()


def test_skeleton_refuses_symlinks_on_the_way(root_with_fuse: None, tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "jobs" / "7" / "step-0").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (state / "jobs" / "7" / "step-0" / "skel").symlink_to(outside)
    with pytest.raises(OSError):
        imagemount.step_root(str(state), "7", "0", tmp_path, ["/home/u"])
    assert not (outside / "home").exists()  # nothing created through the link


def _as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        user=65534,
        group=65534,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_setuid_file_or_device_in_an_image_is_never_honoured_on_the_host(
    root_with_fuse: None, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    need("gcc")
    sif = make_sif({"etc/marker": "x\n"})
    root = sif.parent / "rootfs1"  # make_sif's tree: add to it and build again
    add_privileges(root, tmp_path)
    sif = build_sif(root, tmp_path / "setuid.sif")
    # Under /run like a node's state_dir (pytest's tmp is 0700: nobody could not look).
    state = Path(f"/run/tfimage-test-{os.getpid()}")
    state.mkdir(mode=0o755)
    try:
        img = imagemount.mount_image(str(state), "5", sif, "sha256:" + "e" * 64)
        root = imagemount.step_root(str(state), "5", "0", img, ["/home/u"])
        with open("/proc/self/mountinfo") as f:
            ours = [line.split() for line in f if line.split()[4].startswith(str(state))]
        assert len(ours) == 2
        for fields in ours:
            assert {"ro", "nosuid", "nodev"} <= set(fields[5].split(",")), fields
        for base in (img, root):
            r = _as_nobody(str(base / "bin/euid"))
            assert r.returncode == 0, r.stderr
            assert r.stdout.strip() == "65534"  # the setuid bit did nothing
            r = _as_nobody("/bin/dd", f"if={base / 'null'}", "of=/dev/null", "count=1")
            assert r.returncode != 0 and "Permission denied" in r.stderr
        # Traversable by the job's user (any uid here), but not listable.
        for d in (state / "jobs", state / "jobs" / "5", state / "jobs" / "5" / "step-0"):
            assert stat.S_IMODE(d.stat().st_mode) == 0o711, d
        assert _as_nobody("/bin/ls", str(state / "jobs" / "5")).returncode != 0
    finally:
        imagemount.release_job(str(state), "5")
        shutil.rmtree(state, ignore_errors=True)

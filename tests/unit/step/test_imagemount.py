"""Real squashfuse and overlay mounts (root only), and the path checks in front of them."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from support import add_privileges, build_sif, need
from tfimage.agent.core.errors import RuntimeSetupError
from tfimage.agent.core.fsutil import held
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


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(f"{path}/")]


def test_two_jobs_share_one_image_mount_until_neither_uses_it(
    root_with_fuse: None, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    sif = make_sif({"etc/marker": "from-image\n", "home/.keep": ""})
    state = tmp_path / "state"
    state.mkdir()
    digest = "sha256:" + "c" * 64
    running = {"42", "43"}
    try:
        img = imagemount.mount_image(str(state), "42", sif, digest)
        assert img == state / "images" / ("sha256-" + "c" * 64)
        assert (img / "etc/marker").read_text() == "from-image\n"
        assert imagemount.mount_image(str(state), "43", sif, digest) == img  # the same mount
        roots = {
            job: imagemount.step_root(str(state), job, "0", img, ["/home/u/proj", "/var/x"])
            for job in sorted(running)
        }
        assert sorted(_mounts_under(state)) == sorted([str(img), *map(str, roots.values())])
        root = roots["43"]
        assert (root / "etc/marker").read_text() == "from-image\n"
        assert (root / "home/u/proj").is_dir() and (root / "var/x").is_dir()
        with pytest.raises(OSError):
            (root / "new-file").write_text("x")  # the container root is read-only

        # Job 42 ends: its root goes, the image stays for 43.
        assert imagemount.release_job(str(state), "42") == []
        running.discard("42")
        assert imagemount.release_images(str(state), lambda d: d == digest and bool(running)) == []
        assert imagemount.mounted(img) and (root / "etc/marker").read_text() == "from-image\n"
        assert not (state / "jobs" / "42").exists()

        # Job 43 ends: nothing is left.
        assert imagemount.release_job(str(state), "43") == []
        running.discard("43")
        assert imagemount.release_images(str(state), lambda d: d == digest and bool(running)) == []
        assert _mounts_under(state) == []
        assert not img.exists() and not (state / "jobs" / "43").exists()
    finally:
        for job in ("42", "43"):
            imagemount.release_job(str(state), job)
        imagemount.release_images(str(state), lambda d: False)


def test_a_step_reads_its_image_even_if_the_shared_mount_went_under_it(
    root_with_fuse: None, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    # The holders said nobody used it (a job an epilog believed gone), yet a step's
    # root sat on it: the overlay keeps its own reference to the image, so the step
    # reads on, and the next job mounts the image again.
    sif = make_sif({"etc/marker": "still here\n"})
    state = tmp_path / "state"
    digest = "sha256:" + "d" * 64
    img = imagemount.mount_image(str(state), "44", sif, digest)
    root = imagemount.step_root(str(state), "44", "0", img, ["/home/u"])
    try:
        assert imagemount.release_images(str(state), lambda d: False) == []
        assert not imagemount.mounted(img)
        assert (root / "etc/marker").read_text() == "still here\n"
        assert imagemount.mount_image(str(state), "47", sif, digest) == img
        assert (img / "etc/marker").read_text() == "still here\n"
    finally:
        assert imagemount.release_job(str(state), "44") == []
        imagemount.release_images(str(state), lambda d: False)
    assert _mounts_under(state) == []


def test_an_epilog_never_waits_on_an_image_another_process_holds(
    root_with_fuse: None, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    # A job mounting it, or one stuck on a hung FUSE process, holds the image's lock:
    # the sweep leaves that image to the next epilog instead of hanging the node.
    sif = make_sif({"etc/marker": "held\n"})
    state = tmp_path / "state"
    img = imagemount.mount_image(str(state), "48", sif, "sha256:" + "b" * 64)
    try:
        with held(Path(f"{img}.lock")):
            started = time.monotonic()
            assert imagemount.release_images(str(state), lambda d: False) == []
            assert time.monotonic() - started < 5 and imagemount.mounted(img)
        assert imagemount.release_images(str(state), lambda d: False) == []
        assert not imagemount.mounted(img)
    finally:
        imagemount.release_images(str(state), lambda d: False)


def test_a_fuse_mount_whose_process_died_is_mounted_again(
    root_with_fuse: None, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    sif = make_sif({"etc/marker": "again\n"})
    state = tmp_path / "state"
    digest = "sha256:" + "f" * 64
    try:
        img = imagemount.mount_image(str(state), "45", sif, digest, ("squashfuse_ll",))
        fuse = subprocess.run(["pgrep", "-f", f"squashfuse_ll .* {img}$"], capture_output=True,
                              text=True, timeout=30).stdout.split()  # fmt: skip
        assert len(fuse) == 1, fuse
        os.kill(int(fuse[0]), 9)
        for _ in range(50):
            with contextlib.suppress(OSError):
                img.stat()
                time.sleep(0.1)
                continue
            break
        with pytest.raises(OSError):  # ENOTCONN: what a job would have been handed
            img.stat()
        again = imagemount.mount_image(str(state), "46", sif, digest, ("squashfuse_ll",))
        assert again == img and (img / "etc/marker").read_text() == "again\n"
        assert _mounts_under(state) == [str(img)]
    finally:
        imagemount.release_images(str(state), lambda d: False)
    assert _mounts_under(state) == []


@pytest.mark.parametrize(
    ("cgroup", "inside"),
    [
        ("12:pids:/slurm/uid_1000/job_77/step_0\n0::/\n", True),  # cgroup v1
        ("0::/system.slice/slurmstepd.scope/job_77/step_batch/user/task_0\n", True),  # v2
        ("0::/system.slice/slurmstepd.scope/job_77\n", True),
        ("0::/system.slice/slurmd.service\n", False),  # the prolog, the daemon
        ("0::/system.slice/tfimage-daemon.service\n4:memory:/job_x/step_0\n", False),
        ("0::/user.slice/job_1234abc\n", False),
    ],
)
def test_a_helper_knows_when_it_runs_inside_a_slurm_jobs_cgroup(
    tmp_path: Path, cgroup: str, inside: bool
) -> None:
    (tmp_path / "cgroup").write_text(cgroup)
    assert imagemount.in_job_cgroup(str(tmp_path / "cgroup")) is inside


def test_a_step_inside_a_jobs_cgroup_mounts_for_its_job_alone(
    root_with_fuse: None, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    # Its FUSE process lives in the job's cgroup and dies with the job: never a mount
    # that another job could be handed.
    freezer = Path("/sys/fs/cgroup/freezer")
    if not (freezer / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 freezer hierarchy to make a job's cgroup in")
    top = freezer / f"tfimage-test-{os.getpid()}"
    cg = top / "job_9" / "step_0"
    cg.mkdir(parents=True)
    sif = make_sif({"etc/marker": "mine\n"})
    state = tmp_path / "state"
    code = (
        "from pathlib import Path\n"
        "from tfimage.agent.step import imagemount\n"
        f"sif, state = Path({str(sif)!r}), {str(state)!r}\n"
        "print(imagemount.mount_image(state, '9', sif, 'sha256:' + '9' * 64))\n"
    )

    def enter() -> None:
        (cg / "cgroup.procs").write_text(str(os.getpid()))

    try:
        r = subprocess.run([sys.executable, "-c", code], preexec_fn=enter, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(state / "jobs" / "9" / ("img-" + "9" * 12))
        # Outside any job (the prolog, the daemon) the same image is the shared mount.
        shared = imagemount.mount_image(str(state), "10", sif, "sha256:" + "9" * 64)
        assert shared == state / "images" / ("sha256-" + "9" * 64)
        assert sorted(_mounts_under(state)) == sorted([r.stdout.strip(), str(shared)])
    finally:
        imagemount.release_job(str(state), "9")
        imagemount.release_images(str(state), lambda d: False)
        for _ in range(50):  # the FUSE process leaves the cgroup when its mount goes
            with contextlib.suppress(OSError):
                cg.rmdir()
                cg.parent.rmdir()
                top.rmdir()
                break
            time.sleep(0.1)
    assert _mounts_under(state) == []


def test_skeleton_refuses_symlinks_on_the_way(root_with_fuse: None, tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "jobs" / "7" / "step-0").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (state / "jobs" / "7" / "step-0" / "skel").symlink_to(outside)
    with pytest.raises(OSError):
        imagemount.step_root(str(state), "7", "0", tmp_path, ["/home/u"])
    assert not (outside / "home").exists()  # nothing created through the link


def test_an_overlay_that_cannot_be_mounted_is_one_line_and_mounts_nothing(
    root_with_fuse: None, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with pytest.raises(RuntimeSetupError) as e:
        imagemount.step_root(str(state), "7", "0", tmp_path / "no-such-image", ["/home/u"])
    assert str(e.value) == "preparing the container root: overlay: No such file or directory"
    root = state / "jobs" / "7" / "step-0" / "root"
    assert root.is_dir() and not imagemount.mounted(root)


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
        job = state / "jobs" / "5"
        for d in (state / "images", state / "jobs", job, job / "step-0"):
            assert stat.S_IMODE(d.stat().st_mode) == 0o711, d
        assert _as_nobody("/bin/ls", str(state / "jobs" / "5")).returncode != 0
    finally:
        imagemount.release_job(str(state), "5")
        imagemount.release_images(str(state), lambda d: False)
        shutil.rmtree(state, ignore_errors=True)

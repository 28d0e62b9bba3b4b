"""Image mount drivers by policy: each one mounts a real SIF nosuid,nodev and goes
with the job; one a node lacks is skipped, saying so; ``kernel`` only where trusted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tfimage.agent.config import config_from_mapping
from tfimage.agent.errors import ConfigError
from tfimage.agent.step import imagemount

FSTYPE = {
    "kernel": "squashfs",
    "squashfuse_ll": "fuse.squashfuse_ll",
    "squashfuse": "fuse.squashfuse",
}


@pytest.fixture
def root_with_fuse() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    if not Path("/dev/fuse").exists():
        pytest.skip("no /dev/fuse on this machine")


def _mount_of(target: Path) -> tuple[str, set[str]]:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(target):
                sep = fields.index("-")
                return fields[sep + 1], set(fields[5].split(","))
    raise AssertionError(f"{target} is not mounted")


def _loops_of(sif: Path) -> str:
    return subprocess.run(["losetup", "-j", str(sif)], capture_output=True, text=True,
                          timeout=30).stdout  # fmt: skip


@pytest.mark.parametrize("driver", sorted(FSTYPE))
def test_each_driver_mounts_the_image_nosuid_nodev_and_leaves_with_the_job(
    root_with_fuse: None, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path, driver: str
) -> None:
    sif = make_sif({"etc/marker": f"via {driver}\n"})
    state = tmp_path / "state"
    img = imagemount.mount_image(str(state), "61", sif, "sha256:" + "a" * 64, (driver,))
    try:
        fstype, options = _mount_of(img)
        assert fstype == FSTYPE[driver] and {"ro", "nosuid", "nodev"} <= options
        assert (img / "etc/marker").read_text() == f"via {driver}\n"
        if driver == "kernel":
            assert str(sif) in _loops_of(sif)
    finally:
        assert imagemount.release_job(str(state), "61") == []
    assert not imagemount.mounted(img) and _loops_of(sif) == ""  # the loop device went too


def test_a_node_without_loop_devices_falls_back_to_fuse_and_says_so(
    root_with_fuse: None, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    sif = make_sif({"etc/marker": "x\n"})
    state = tmp_path / "state"
    code = (
        "import logging, sys\n"
        "from pathlib import Path\n"
        "from tfimage.agent.step import imagemount\n"
        "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
        f"img = imagemount.mount_image({str(state)!r}, '62', Path({str(sif)!r}),"
        " 'sha256:' + 'b' * 64, ('kernel', 'squashfuse_ll'))\n"
        "print(open('/proc/self/mountinfo').read())\n"
        f"imagemount.release_job({str(state)!r}, '62')\n"
    )
    old = tmp_path / "olddev"
    old.mkdir()
    # A mount namespace whose /dev has FUSE and null but no loop device at all.
    script = (
        f"mount --rbind /dev {old} && mount -t tmpfs -o mode=0755 tmpfs /dev && "
        f"for d in fuse null; do touch /dev/$d && mount --bind {old}/$d /dev/$d; done && "
        f'umount -l {old} && exec {sys.executable} -c "$0"'
    )
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, code],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    mounted = [line for line in r.stdout.splitlines() if "/jobs/62/img-" in line]
    assert len(mounted) == 1 and "fuse.squashfuse_ll" in mounted[0], r.stdout[-2000:]
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith("image mount: kernel: ") and "trying the next driver" in r.stderr


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "one or more of kernel, squashfuse_ll, squashfuse"),
        (["zfs"], "one or more of"),
        (["kernel", "kernel"], "each once"),
        (7, "one or more of"),
    ],
)
def test_a_bad_image_mount_is_one_line_naming_the_choices(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        config_from_mapping({"image_mount": value}, Path("/etc/tfimage/config.yaml"))
    assert "\n" not in str(e.value) and "image_mount" in str(e.value)


def test_kernel_is_tried_only_for_the_trusted_repositories() -> None:
    cfg = config_from_mapping(
        json.loads(
            '{"image_mount": ["kernel", "squashfuse_ll", "squashfuse"],'
            ' "image_mount_kernel": ["library/tf-*"]}'
        )
    )
    assert cfg.mount_drivers("library/tf-custom") == ("kernel", "squashfuse_ll", "squashfuse")
    assert cfg.mount_drivers("library/tiny") == ("squashfuse_ll", "squashfuse")
    assert cfg.mount_drivers("alice/tf-custom") == ("squashfuse_ll", "squashfuse")
    single = config_from_mapping({"image_mount": "squashfuse"})
    assert single.mount_drivers("library/tf-custom") == ("squashfuse",)
    assert config_from_mapping({}).image_mount == ("squashfuse_ll", "squashfuse")  # FUSE: safe

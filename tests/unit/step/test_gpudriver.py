"""The host's driver for a charliecloud GPU step (agent/step/gpudriver.py): found in
a real linker cache (built here by the real ldconfig), trusted only when root alone
may write it, and bound file by file where NVIDIA's CUDA images look."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from gpus import SOURCE, node, nvmlcount_rootfs

from support import build_sif, need
from tfimage.agent.core.config import config_from_mapping
from tfimage.agent.core.errors import ConfigError, RuntimeSetupError
from tfimage.agent.step import imagemount
from tfimage.agent.step.elfname import soname
from tfimage.agent.step.gpudriver import ABI, BIN_DIR, LIB_DIR, driver_binds, from_ldconfig
from tfimage.agent.step.plan import DRIVER_LIB_DIR
from tfimage.agent.step.runtime import Bind, Charliecloud, StepSpec

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="root-owned driver files: run as root")


@pytest.fixture(scope="module")
def driver_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A driver directory as a distribution installs one: versioned files with their
    sonames (the fake NVML's code under each name), the soname links, root's, 0755."""
    d = tmp_path_factory.mktemp("driver")
    for lib in ("libnvidia-ml", "libcuda", "libnvidia-ptxjitcompiler", "libnvidia-glcore"):
        real = d / f"{lib}.so.550.54.15"
        subprocess.run(
            ["gcc", "-shared", "-fPIC", f"-Wl,-soname,{lib}.so.1", "-o", str(real), str(SOURCE)],
            check=True,
            timeout=120,
        )
        real.chmod(0o755)
        (d / f"{lib}.so.1").symlink_to(real.name)
    (d / "libcuda.so").symlink_to("libcuda.so.1")  # the development link
    return d


@pytest.fixture
def driver(driver_build: Path, tmp_path: Path) -> Path:
    d = tmp_path / "driver"
    shutil.copytree(driver_build, d, symlinks=True)
    return d


def _ldconfig(tmp_path: Path, driver: Path) -> str:
    cache = tmp_path / "ld.so.cache"
    subprocess.run(["ldconfig", "-C", str(cache), "-f", "/dev/null", str(driver)], check=True)
    return subprocess.run(
        ["ldconfig", "-p", "-C", str(cache)], check=True, capture_output=True, text=True
    ).stdout


@root_only
def test_the_linker_cache_gives_the_compute_and_utility_libraries_by_soname(
    tmp_path: Path, driver: Path
) -> None:
    text = _ldconfig(tmp_path, driver)
    found = from_ldconfig(text, ABI[platform.machine()])
    ours = {k: v for k, v in found.items() if v.startswith(str(driver))}
    assert sorted(ours) == ["libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1"]
    # graphics libraries and the development link stay out
    binds = {
        b.dst: b.src for b in driver_binds(ldconfig_output=text) if b.src.startswith(str(driver))
    }
    assert binds == {
        f"{LIB_DIR}/libcuda.so.1": str(driver / "libcuda.so.550.54.15"),
        f"{LIB_DIR}/libnvidia-ml.so.1": str(driver / "libnvidia-ml.so.550.54.15"),
        f"{LIB_DIR}/libnvidia-ptxjitcompiler.so.1": str(
            driver / "libnvidia-ptxjitcompiler.so.550.54.15"
        ),
    }


def test_a_32_bit_library_of_the_same_name_is_not_taken() -> None:
    text = (
        "3 libs found in cache `/etc/ld.so.cache'\n"
        "\tlibcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1\n"
        "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
        "\tlibnvidia-ml.so.1 (libc6,x86-64, OS ABI: Linux 3.2.0) => "
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1\n"
    )
    assert from_ldconfig(text, "libc6,x86-64") == {
        "libcuda.so.1": "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "libnvidia-ml.so.1": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
    }


@root_only
def test_the_admins_list_names_the_files_and_their_names_in_the_container(driver: Path) -> None:
    binds = driver_binds((str(driver / "libnvidia-ml.so.1"), str(driver / "libcuda.so.1")))
    libs = [(b.dst, b.src, b.read_only) for b in binds if b.dst.startswith(LIB_DIR)]
    assert libs == [
        (f"{LIB_DIR}/libcuda.so.1", str(driver / "libcuda.so.550.54.15"), True),
        (f"{LIB_DIR}/libnvidia-ml.so.1", str(driver / "libnvidia-ml.so.550.54.15"), True),
    ]
    assert all(b.dst.startswith(BIN_DIR + "/") for b in binds[2:])


@root_only
@pytest.mark.parametrize("how", ["anyone may write it", "a user owns it"])
def test_a_driver_file_someone_else_could_change_is_never_bound(driver: Path, how: str) -> None:
    real = driver / "libnvidia-ml.so.550.54.15"
    if how == "anyone may write it":
        real.chmod(0o757)
    else:
        os.chown(real, 65534, 65534)
    with pytest.raises(RuntimeSetupError, match="not a regular file that only root may write"):
        driver_binds((str(driver / "libnvidia-ml.so.1"),))


def test_a_node_without_a_driver_says_so_in_one_line() -> None:
    with pytest.raises(RuntimeSetupError) as e:
        driver_binds(ldconfig_output="0 libs found in cache `/etc/ld.so.cache'\n")
    assert "no NVIDIA driver library" in str(e.value) and "\n" not in str(e.value)


def test_charliecloud_binds_the_driver_files_read_only_after_the_users_binds() -> None:
    spec = StepSpec(
        workdir="/w",
        home=None,
        gpus=True,
        driver=(Bind("/usr/lib/x/libcuda.so.550", f"{LIB_DIR}/libcuda.so.1", True),),
    )
    assert spec.files() == [f"{LIB_DIR}/libcuda.so.1"]
    assert Charliecloud("/x/ch-run").prefix(Path("/r"), spec) == [
        "/x/ch-run", "--no-passwd", "-b", "/w:/w",
        "-b", f"/usr/lib/x/libcuda.so.550:{LIB_DIR}/libcuda.so.1",
        "-c", "/w", "/r", "--",
    ]  # fmt: skip


@pytest.mark.parametrize("bad", [["lib"], "/x", ["/a/../b"], [1]])
def test_the_driver_list_in_the_config_is_checked(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"gpu\.driver_libs"):
        config_from_mapping({"gpu": {"driver_libs": bad}})


@root_only
def test_a_gpu_step_in_charliecloud_sees_the_nodes_gpus_through_the_bound_driver(
    driver_build: Path,
) -> None:
    """Real SIF, real squashfuse and overlay, real ch-run as an unprivileged user:
    the program in the image finds the host's (fake) driver where tfimage bound it."""
    need("ch-run", "squashfuse", "mksquashfs", "siftool")
    if not Path("/dev/fuse").exists():
        pytest.skip("no /dev/fuse on this machine")
    work = Path(tempfile.mkdtemp(prefix="tfimage-gpudriver-", dir="/var/tmp"))
    try:
        work.chmod(0o755)
        drv = work / "driver"
        shutil.copytree(driver_build, drv, symlinks=True)
        drv.chmod(0o755)
        rootfs = nvmlcount_rootfs(work / "rootfs")
        doc = node(4)
        (rootfs / "etc" / "nvml-state.json").write_text(json.dumps(doc))
        sif = build_sif(rootfs, work / "img.sif")
        state = work / "state"
        img = imagemount.mount_image(str(state), "77", sif, "sha256:" + "d" * 64)
        ch = Charliecloud()
        seen = {}
        for gpus in (True, False):
            binds = driver_binds((str(drv / "libnvidia-ml.so.1"),)) if gpus else []
            spec = StepSpec(workdir=None, home=None, gpus=gpus, driver=tuple(binds))
            step = "0" if gpus else "1"
            root = imagemount.step_root(
                str(state), "77", step, img, [*ch.required_dirs, *spec.mountpoints()], spec.files()
            )
            r = subprocess.run(
                [*ch.prefix(root, spec), "/bin/nvmlcount"],
                env={
                    "PATH": "/usr/bin:/bin",
                    "USER": "nobody",
                    "LD_LIBRARY_PATH": DRIVER_LIB_DIR,
                    "FAKE_NVML_STATE": "/etc/nvml-state.json",
                },
                user=65534,
                group=65534,
                capture_output=True,
                text=True,
                timeout=60,
            )
            seen[gpus] = (r.returncode, r.stdout.split("\n")[:-1], r.stderr)
        assert seen[True][0] == 0, seen[True]
        assert seen[True][1] == ["count=4", *(d["uuid"] for d in doc["devices"])]
        assert seen[False][0] == 2 and seen[False][1][0].startswith("no driver:"), seen[False]
    finally:
        imagemount.release_job(str(work / "state"), "77")
        imagemount.release_images(str(work / "state"), lambda digest: False)
        shutil.rmtree(work, ignore_errors=True)


def _cdi(driver: Path, as_yaml: bool) -> str:
    """A CDI spec shaped as ``nvidia-ctk cdi generate`` writes one: the versioned
    files bound at their own paths, device nodes per GPU, hooks that make links."""
    mounts = [
        {
            "hostPath": str(driver / f"{lib}.so.550.54.15"),
            "containerPath": str(driver / f"{lib}.so.550.54.15"),
            "options": ["ro", "nosuid", "nodev", "bind"],
        }
        for lib in ("libcuda", "libnvidia-ml", "libnvidia-glcore")
    ]
    doc = {
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}],
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [{"path": "/dev/nvidiactl"}],
            "hooks": [
                {
                    "hookName": "createContainer",
                    "path": "/usr/bin/nvidia-cdi-hook",
                    "args": ["nvidia-cdi-hook", "create-symlinks", "--link", "x::y"],
                }
            ],
            "mounts": mounts,
        },
    }
    return yaml.safe_dump(doc) if as_yaml else json.dumps(doc)


@root_only
@pytest.mark.parametrize("as_yaml", [True, False], ids=["yaml", "json"])
def test_a_cdi_spec_gives_the_libraries_under_the_sonames_their_files_carry(
    driver: Path, tmp_path: Path, as_yaml: bool
) -> None:
    spec = tmp_path / "nvidia.yaml"
    spec.write_text(_cdi(driver, as_yaml))
    libs = {b.dst: b.src for b in driver_binds(cdi_spec=str(spec)) if b.dst.startswith(LIB_DIR)}
    assert libs == {
        f"{LIB_DIR}/libcuda.so.1": str(driver / "libcuda.so.550.54.15"),
        f"{LIB_DIR}/libnvidia-ml.so.1": str(driver / "libnvidia-ml.so.550.54.15"),
    }  # the graphics library stays out


@pytest.mark.parametrize(
    ("text", "says"),
    [("[1, 2]", "not a CDI spec"), ("{a: [", "not YAML or JSON")],
)
def test_a_cdi_spec_that_is_not_one_is_a_one_line_error(
    tmp_path: Path, text: str, says: str
) -> None:
    spec = tmp_path / "nvidia.yaml"
    spec.write_text(text)
    with pytest.raises(RuntimeSetupError, match=says) as e:
        driver_binds(cdi_spec=str(spec))
    assert "\n" not in str(e.value).strip()


def test_an_elf_files_soname_is_read_from_it_and_anything_else_has_none(
    driver_build: Path,
) -> None:
    assert soname(str(driver_build / "libcuda.so.550.54.15")) == "libcuda.so.1"
    assert soname("/etc/hostname") is None
    assert soname(str(SOURCE)) is None


def test_a_forged_elf_header_costs_nothing_and_names_nothing(tmp_path: Path) -> None:
    """A header claiming 65535 sections of 65535 bytes (4 GiB of table) or a table
    past the file's end is refused before anything is read; a FIFO never blocks."""
    import struct
    import time

    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<QHH", head, 0x28, 64, 0, 0)
    forged = []
    for shentsize, shnum in ((0xFFFF, 0xFFFF), (64, 4000), (16, 10)):
        struct.pack_into("<HH", head, 0x3A, shentsize, shnum)
        p = tmp_path / f"forged-{shentsize}-{shnum}.so"
        p.write_bytes(bytes(head))
        forged.append(p)
    fifo = tmp_path / "libcuda.so.1"
    os.mkfifo(fifo)
    started = time.monotonic()
    assert [soname(str(p)) for p in [*forged, fifo]] == [None] * 4
    assert time.monotonic() - started < 1

"""A fake NVML for tests: tests/fakenvml/fakenvml.c built into a real
``libnvidia-ml.so.1`` that the real nvidia-ml-py loads through LD_LIBRARY_PATH, with
the GPUs' state in a JSON file named by FAKE_NVML_STATE (the C file documents it).

Named node states, each a dict to write with :meth:`FakeNvml.write`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).parent / "fakenvml" / "fakenvml.c"


def build_fake_nvml(out: Path) -> Path:
    """Compile the fake into ``out/libnvidia-ml.so.1``; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    lib = out / "libnvidia-ml.so.1"
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Werror",
            f'-DFAKE_NVML_DIR="{out}"',  # its state.json, where no environment names one
            "-o",
            str(lib),
            str(SOURCE),
        ],
        check=True,
        timeout=120,
    )
    return out


def gpu(i: int, **over: Any) -> dict[str, Any]:
    """A healthy data-centre GPU: every check answers, nothing wrong.  Minor numbers
    run backwards from the index (7 - i), so a test notices which one is used."""
    d: dict[str, Any] = {
        "uuid": f"GPU-{i:08x}-1111-2222-3333-{i:012x}",
        "pci": f"00000000:{0x1B + 0x10 * i:02X}:00.0",
        "minor": 7 - i,
        "ecc_dbe_volatile": 0,
        "ecc_sbe_volatile": 3,
        "remapped": [0, 0, 0, 0],
        "retired_pending": 0,
        "retired_sbe": 0,
        "retired_dbe": 0,
        "inforom": "SUCCESS",
        "recovery_action": 0,
        "processes": [],
        "nvlinks": [1] * 18,
        "energy_mj": 1_000_000 + i,
        "clock_events": 1,  # idle
        "persistence": 1,
        "pcie": [16, 16, 5, 5],
    }
    d.update(over)
    return d


def node(n: int = 8, **over: Any) -> dict[str, Any]:
    return {"driver": "550.54.15", "devices": [gpu(i) for i in range(n)], **over}


class FakeNvml:
    def __init__(self, lib_dir: Path, state: Path) -> None:
        self.lib_dir = lib_dir
        self.state = state

    def write(self, doc: dict[str, Any]) -> None:
        self.state.write_text(json.dumps(doc))

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "LD_LIBRARY_PATH": str(self.lib_dir),
            "FAKE_NVML_STATE": str(self.state),
        }


def healthy_node(name: str, n: int = 4) -> dict[str, Any]:
    """A local cluster node's GPUs (deploy/local/cluster.sh): UUIDs of its own, and
    minor numbers equal to the indices, as gres.conf's File=/dev/nvidia[0-3] says."""
    tag = int.from_bytes(name.encode()[-4:].rjust(4, b"\0"), "big")
    return node(
        n,
        devices=[gpu(i, uuid=f"GPU-{tag:08x}-0000-4000-8000-{i:012x}", minor=i) for i in range(n)],
    )


NVMLCOUNT = Path(__file__).parent / "fakenvml" / "nvmlcount.c"


def nvmlcount_rootfs(root: Path, also_for: tuple[str, ...] = ()) -> Path:
    """A root filesystem holding ``/bin/nvmlcount`` (tests/fakenvml/nvmlcount.c, built
    here) and the host libraries it links, and those the libraries in ``also_for``
    link (a real driver's libnvidia-ml needs libpthread, libm, libdl, librt): a
    program that reads NVML in an image."""
    for d in ("bin", "dev", "proc", "sys", "tmp", "etc"):
        (root / d).mkdir(parents=True, exist_ok=True)
    prog = root / "bin" / "nvmlcount"
    # -ldl: dlopen lives in libdl before glibc 2.34 (Debian 11, Ubuntu 20.04)
    subprocess.run(["gcc", "-O2", "-o", str(prog), str(NVMLCOUNT), "-ldl"], check=True, timeout=120)
    for binary in (str(prog), *also_for):
        ldd = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True)
        for word in ldd.stdout.split():
            if word.startswith("/") and Path(word).exists() and word != binary:
                dst = root / word.lstrip("/")
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(word, dst)
    return root

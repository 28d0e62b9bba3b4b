"""bench/gpu-smoke's script, run here on the fake driver so that it does not rot
between the GPU machines it is meant for: every step must pass, and the energy
delta must be the counters' movement."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from gpus import build_fake_nvml, node

from support import need

SMOKE = Path(__file__).resolve().parents[3] / "bench" / "gpu_smoke.py"


@pytest.mark.skipif(os.geteuid() != 0, reason="the smoke check mounts images: run as root")
def test_the_gpu_smoke_check_passes_on_the_fake_driver_with_the_right_energy() -> None:
    need("ch-run", "squashfuse", "mksquashfs", "siftool", "gcc")
    if not Path("/dev/fuse").exists():
        pytest.skip("no /dev/fuse on this machine")
    d = Path(tempfile.mkdtemp(prefix="tfimage-smoke-test-", dir="/var/tmp"))
    try:
        d.chmod(0o755)  # the container's user reads the bound library
        lib = build_fake_nvml(d / "lib")
        lib.chmod(0o755)
        (lib / "state.json").write_text(json.dumps(node(2)))
        r = subprocess.run(
            [sys.executable, str(SMOKE), "--fake", str(lib)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        uuids = [g["uuid"] for g in node(2)["devices"]]
        assert f"gpu-smoke:   gpu0 {uuids[0]}: 1.0 J" in r.stdout
        assert f"gpu-smoke:   gpu1 {uuids[1]}: 2.0 J" in r.stdout
        assert "4 NVML inside a charliecloud container: ok" in r.stdout
        assert r.stdout.rstrip().splitlines()[-1].startswith("gpu-smoke: all passed")
    finally:
        shutil.rmtree(d, ignore_errors=True)

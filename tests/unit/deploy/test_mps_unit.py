"""The role's MPS control daemon unit (tfimage_gpu_mps_daemon), rendered from the
role's own template and defaults, and checked by systemd's own parser."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROLE = Path(__file__).resolve().parents[3] / "deploy/ansible/roles/tfimage"


def _render(**over: str) -> str:
    jinja2 = pytest.importorskip("jinja2", reason="jinja2 comes with ansible-core (make lint)")
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROLE / "templates"))
    return env.get_template("nvidia-mps.service.j2").render(
        {**defaults, "ansible_managed": "Ansible managed", **over}
    )


def test_the_mps_unit_starts_nvidias_daemon_where_jobs_look_for_it() -> None:
    text = _render()
    assert "ExecStart=/usr/bin/nvidia-cuda-mps-control -d" in text
    assert "Environment=CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in text
    assert "Type=forking" in text and "Before=slurmd.service" in text


def test_systemd_accepts_the_mps_unit(tmp_path: Path) -> None:
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed here")
    # /bin/true stands in for the driver's tool, which systemd checks is executable
    unit = tmp_path / "nvidia-mps.service"
    unit.write_text(_render(tfimage_gpu_mps_control="/bin/true"))
    r = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr

"""The role refuses the variables it no longer reads, naming their new names: an
ignored ``tfimage_mount_prefixes`` would leave the role's default prefixes, wider
than the site asked for.  The play runs in --check mode and stops at the assert,
its second task, before anything on this machine is looked at."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROLE = Path(__file__).resolve().parents[3] / "deploy/ansible/roles/tfimage"


@pytest.mark.parametrize("old", ["tfimage_mount_prefixes", "tfimage_default_mounts"])
def test_a_removed_variable_stops_the_role_with_its_new_name(tmp_path: Path, old: str) -> None:
    playbook = shutil.which("ansible-playbook", path=str(Path(sys.executable).parent))
    if playbook is None:
        pytest.skip("ansible-playbook is not in this venv (make venv installs ansible-core)")
    play = tmp_path / "play.yml"
    play.write_text(
        "- hosts: localhost\n  connection: local\n  gather_facts: false\n  roles:\n"
        f"    - role: {ROLE}\n      vars:\n        tfimage_version: '1.0'\n"
        f"        tfimage_registry: reg.example\n        {old}: [/scratch]\n"
    )
    r = subprocess.run(
        [playbook, "--check", "-i", "localhost,", str(play)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout[-2000:]
    assert "are now tfimage_bind_prefixes and tfimage_default_binds" in r.stdout
    assert "ok=2 " in r.stdout and "changed=0 " in r.stdout  # stopped at the assert

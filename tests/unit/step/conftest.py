from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def root_with_fuse() -> None:
    """Real mounts: root and /dev/fuse, or the test is skipped saying which."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    if not Path("/dev/fuse").exists():
        pytest.skip("no /dev/fuse on this machine")

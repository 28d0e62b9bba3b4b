from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tfimage.agent.core.errors import VerificationError
from tfimage.agent.core.sif import has_magic, root_partition


def test_root_partition_matches_siftool(make_sif: Callable[[dict[str, str]], Path]) -> None:
    sif = make_sif({"etc/marker": "x\n"})
    listing = subprocess.run(
        ["siftool", "list", str(sif)], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    start, end = map(int, re.search(r"\|(\d+)-(\d+)\s+\|FS", listing).groups())  # type: ignore[union-attr]
    with sif.open("rb") as f:
        part = root_partition(f, sif.stat().st_size)
        assert (part.offset, part.offset + part.size) == (start, end)
        f.seek(part.offset)
        assert f.read(4) == b"hsqs"  # squashfs magic where we say the partition starts
        f.seek(0)
        assert has_magic(f.read(64))


def test_not_a_sif(tmp_path: Path) -> None:
    p = tmp_path / "x.sif"
    p.write_bytes(b"\0" * 4096)
    with p.open("rb") as f, pytest.raises(VerificationError, match="SIF_MAGIC"):
        root_partition(f, 4096)


def test_truncated_sif_is_rejected(make_sif: Callable[[dict[str, str]], Path]) -> None:
    sif = make_sif({"a": "b"})
    data = sif.read_bytes()
    cut = sif.with_name("cut.sif")
    cut.write_bytes(data[:-100])  # the partition now runs past the end
    with cut.open("rb") as f, pytest.raises(VerificationError, match="outside the file"):
        root_partition(f, cut.stat().st_size)

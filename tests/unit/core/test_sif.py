from __future__ import annotations

import io
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tfimage.agent.core.errors import VerificationError
from tfimage.agent.core.sif import (
    Layout,
    has_magic,
    layout,
    machine_arch,
    root_partition,
    table_end,
)


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


def _sif(tmp_path: Path, name: str, *objects: list[str]) -> Path:
    """A real SIF made by siftool, one ``siftool add`` per object (its flags and file)."""
    sif = tmp_path / f"{name}.sif"
    subprocess.run(["siftool", "new", str(sif)], check=True, capture_output=True, timeout=30)
    for argv in objects:
        subprocess.run(["siftool", "add", *argv[:-1], str(sif), argv[-1]],
                       check=True, capture_output=True, timeout=30)  # fmt: skip
    return sif


def _squashfs(tmp_path: Path) -> str:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc" / "marker").write_text("x\n")
    sqfs = tmp_path / "root.sqfs"
    subprocess.run(["mksquashfs", str(root), str(sqfs), "-noappend", "-quiet"],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    return str(sqfs)


def _part(sqfs: str, parttype: int, fs: int = 1, arch: int = 2) -> list[str]:
    return ["--datatype", "4", "--parttype", str(parttype), "--partfs", str(fs),
            "--partarch", str(arch), sqfs]  # fmt: skip


def _layout(sif: Path) -> Layout:
    data = sif.read_bytes()
    return layout(data[: table_end(data)], len(data))


def test_apptainers_primary_system_partition_is_the_root_before_a_plain_system_one(
    tmp_path: Path,
) -> None:
    """`apptainer build` writes parttype 2 (PrimSys), which is what Apptainer runs; a
    SIF with only parttype 1 (siftool's "System", as tfimage built them) still runs."""
    sqfs = _squashfs(tmp_path)
    both = _sif(tmp_path, "both", _part(sqfs, 1), _part(sqfs, 2))
    found = _layout(both)
    assert [p.parttype for p in found.partitions] == [1, 2]
    root = found.root()
    assert root is not None and root.parttype == 2 and found.unfit(machine_arch()) is None
    with both.open("rb") as f:
        assert root_partition(f, both.stat().st_size) == root
    old = _sif(tmp_path, "old", _part(sqfs, 1))
    assert _layout(old).root() is not None and _layout(old).unfit(machine_arch()) is None


def test_each_kind_of_sif_tfimage_cannot_run_is_named_with_what_to_do(tmp_path: Path) -> None:
    sqfs = _squashfs(tmp_path)
    here = machine_arch()
    other, other_code = ("arm64", 4) if here != "arm64" else ("s390x", 11)
    generic = tmp_path / "data.bin"
    generic.write_bytes(b"weights" * 100)
    kinds = {
        "data only": (_sif(tmp_path, "data", _part(sqfs, 3)), "no system partition (data only"),
        "generic data": (
            _sif(tmp_path, "generic", ["--datatype", "7", str(generic)]),
            "no system partition (data only",
        ),
        "encrypted": (_sif(tmp_path, "enc", _part(sqfs, 2, fs=5)), "an encrypted SIF"),
        "ext3": (_sif(tmp_path, "ext3", _part(sqfs, 2, fs=2)), "system partition is ext3"),
        "arch": (
            _sif(tmp_path, "arch", _part(sqfs, 2, arch=other_code)),
            f"a SIF built for {other}; the nodes run {here}: push an {here} build",
        ),
    }
    for kind, (sif, words) in kinds.items():
        why = _layout(sif).unfit(here)
        assert why and words in why and "\n" not in why, (kind, why)
    for kind in ("data only", "encrypted", "ext3"):  # and the mount refuses it, naming it
        sif, words = kinds[kind]
        with sif.open("rb") as f, pytest.raises(VerificationError, match=re.escape(words)):
            root_partition(f, sif.stat().st_size)


def test_an_oci_sif_is_named_as_such(tmp_path: Path) -> None:
    """SingularityCE's --oci SIF holds an OCI root index (data type 0x400a) and blobs
    (0x400b), no partition.  Debian's siftool cannot write those types: a generic
    object's type is rewritten in its descriptor, the one field that differs."""
    index = tmp_path / "index.json"
    index.write_text('{"schemaVersion":2,"manifests":[]}')
    sif = _sif(tmp_path, "oci", ["--datatype", "7", str(index)])
    data = bytearray(sif.read_bytes())
    descoff = int.from_bytes(data[64 + 32 : 64 + 40], "little")
    assert int.from_bytes(data[descoff : descoff + 4], "little") == 0x4007
    data[descoff : descoff + 4] = (0x400A).to_bytes(4, "little")
    found = layout(bytes(data[: table_end(bytes(data))]), len(data))
    why = found.unfit(machine_arch())
    assert why and why.startswith("an OCI-SIF (SingularityCE's --oci format")


def test_a_head_too_short_for_its_descriptor_table_is_refused(tmp_path: Path) -> None:
    sif = _sif(tmp_path, "short", _part(_squashfs(tmp_path), 2))
    data = sif.read_bytes()
    with pytest.raises(VerificationError, match="cut short"):
        layout(data[: table_end(data) - 1], len(data))


def test_a_header_naming_a_far_descriptor_table_is_refused_before_any_read(
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    """A hostile image's header may put its table anywhere: an offset of 2**60 is
    refused from the header alone (the mount runs as root; nothing that size is read)."""
    data = bytearray(make_sif({"a": "b"}).read_bytes())
    data[64 + 32 : 64 + 40] = (1 << 60).to_bytes(8, "little")  # descoff
    assert table_end(bytes(data)) > 1 << 60
    reads: list[int] = []

    class Watched(io.BytesIO):
        def read(self, n: int | None = -1) -> bytes:
            reads.append(-1 if n is None else n)
            return super().read(n)

    with pytest.raises(VerificationError, match="runs past the end of the file"):
        root_partition(Watched(bytes(data)), len(data))
    assert reads == [128]  # the header only

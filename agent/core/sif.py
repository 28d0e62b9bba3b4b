"""Just enough of the SIF container format to check a file and find its root filesystem.

Layout (little endian), as written by siftool/apptainer (SIF v2):

    0     launch script   32 bytes
    32    magic           "SIF_MAGIC\\0"
    42    version, arch   3 + 3 bytes
    48    uuid            16 bytes
    64    ctime, mtime, dfree, dtotal, descoff, desclen, dataoff, datalen  (int64 each)

Each descriptor (585 bytes) at ``descoff``: int32 datatype, bool used, uint32 id,
group, link, then int64 offset, size, size-with-padding, ctime, mtime, uid, gid,
a 128-byte name and 384 bytes of extra data; for a partition the extra data starts
with int32 fstype and int32 parttype.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tfimage.agent.core.errors import VerificationError

MAGIC = b"SIF_MAGIC\x00"
MAGIC_OFFSET = 32
HEADER_SIZE = 128
DESCRIPTOR_SIZE = 585
MAX_DESCRIPTORS = 4096

DATA_PARTITION = 0x4004
FS_SQUASH = 1
PART_PRIMSYS = 1

_HEADER = struct.Struct("<8q")
_DESCRIPTOR = struct.Struct("<i?IIIqqq")
_PART_EXTRA = struct.Struct("<ii")


@dataclass(frozen=True, slots=True)
class Partition:
    offset: int
    size: int


def has_magic(head: bytes) -> bool:
    return head[MAGIC_OFFSET : MAGIC_OFFSET + len(MAGIC)] == MAGIC


def root_partition(f: BinaryIO, file_size: int) -> Partition:
    """The primary system squashfs partition: what the runtime mounts as ``/``."""
    f.seek(0)
    head = f.read(HEADER_SIZE)
    if len(head) < HEADER_SIZE or not has_magic(head):
        raise VerificationError("not a SIF file (no SIF_MAGIC)")
    _ct, _mt, _dfree, dtotal, descoff, desclen, _doff, _dlen = _HEADER.unpack_from(head, 64)
    if not 0 < dtotal <= MAX_DESCRIPTORS or descoff < HEADER_SIZE or desclen < 0:
        raise VerificationError("SIF header is corrupt (descriptor table)")
    if descoff + dtotal * DESCRIPTOR_SIZE > file_size:
        raise VerificationError("SIF descriptor table runs past the end of the file")
    f.seek(descoff)
    table = f.read(dtotal * DESCRIPTOR_SIZE)
    for i in range(dtotal):
        base = i * DESCRIPTOR_SIZE
        datatype, used, _id, _grp, _link, offset, size, _pad = _DESCRIPTOR.unpack_from(table, base)
        if not used or datatype != DATA_PARTITION:
            continue
        fstype, parttype = _PART_EXTRA.unpack_from(table, base + 73 + 128)
        if fstype != FS_SQUASH or parttype != PART_PRIMSYS:
            continue
        if offset < HEADER_SIZE or size <= 0 or offset + size > file_size:
            raise VerificationError("SIF root partition lies outside the file")
        return Partition(offset, size)
    raise VerificationError("SIF has no squashfs system partition")


def build_commands(rootfs: Path, sqfs: Path, sif: Path, comp: str = "lz4") -> list[list[str]]:
    """How a root filesystem becomes a SIF with Debian's tools: a squashfs owned by
    root, without extended attributes (no file capabilities from an image), then a
    SIF holding it as the primary system partition (what runtimes mount).  ``comp``:
    mksquashfs's compressor (lz4 for conversion: fast to write and to read)."""
    return [
        [
            *("mksquashfs", str(rootfs), str(sqfs), "-all-root", "-no-xattrs", "-noappend"),
            *("-quiet", "-comp", comp),
        ],
        ["siftool", "new", str(sif)],
        [
            "siftool",
            "add",
            "--datatype",
            "4",
            "--parttype",
            "1",
            "--partfs",
            "1",
            "--partarch",
            "2",
            str(sif),
            str(sqfs),
        ],
    ]

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
with int32 fstype, int32 parttype and the architecture's 3 bytes ("02\\0": amd64).

``apptainer build`` writes the root filesystem as the primary system partition
(parttype 2); Debian's siftool names parttype 1 "System".
"""

from __future__ import annotations

import platform
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

# Data object types (sylabs/sif pkg/sif: DataDeffile = 0x4001, then in order).
DATA_PARTITION = 0x4004
DATA_OCI_ROOT_INDEX = 0x400A
DATA_OCI_BLOB = 0x400B
# A partition's filesystem and type.
FS_SQUASH = 1
FS_ENCRYPTED_SQUASH = 5
FS_NAMES = {
    1: "squashfs",
    2: "ext3",
    3: "an immutable object",
    4: "raw data",
    5: "encrypted squashfs",
}
PART_SYSTEM = 1
PART_PRIMSYS = 2  # what `apptainer build` writes, and what Apptainer runs
# The architecture field: two ASCII digits (sif's HdrArch*), as Go names them.
ARCHES = {
    b"01": "386", b"02": "amd64", b"03": "arm", b"04": "arm64", b"05": "ppc64",
    b"06": "ppc64le", b"07": "mips", b"08": "mipsle", b"09": "mips64", b"10": "mips64le",
    b"11": "s390x", b"12": "riscv64",
}  # fmt: skip

_HEADER = struct.Struct("<8q")
_DESCRIPTOR = struct.Struct("<i?IIIqqq")
_PART_EXTRA = struct.Struct("<ii3s")
_NAME_AT = 73  # a descriptor's name, after the fixed fields above and five int64 times/ids
_EXTRA_AT = _NAME_AT + 128


@dataclass(frozen=True, slots=True)
class Partition:
    offset: int
    size: int
    fstype: int
    parttype: int
    arch: str


@dataclass(frozen=True, slots=True)
class Layout:
    """What a SIF holds, from its header and descriptor table alone."""

    partitions: tuple[Partition, ...]
    datatypes: frozenset[int]

    def root(self) -> Partition | None:
        """The squashfs partition a runtime mounts as ``/``: the primary system one,
        as Apptainer takes it; else a lone system one (as tfimage built them before)."""
        for wanted in (PART_PRIMSYS, PART_SYSTEM):
            for p in self.partitions:
                if p.parttype == wanted and p.fstype == FS_SQUASH:
                    return p
        return None

    def unfit(self, arch: str) -> str | None:
        """Why tfimage cannot run this SIF on a machine of ``arch``, in words for the
        user that say what to do instead; None when it can."""
        if DATA_OCI_ROOT_INDEX in self.datatypes or DATA_OCI_BLOB in self.datatypes:
            return (
                "an OCI-SIF (SingularityCE's --oci format: OCI layers, no system partition);"
                " push the image as docker:// or build a plain SIF"
            )
        system = [p for p in self.partitions if p.parttype in (PART_PRIMSYS, PART_SYSTEM)]
        if any(p.fstype == FS_ENCRYPTED_SQUASH for p in system):
            return "an encrypted SIF, which tfimage cannot decrypt; push an unencrypted build"
        root = self.root()
        if root is None:
            if system:
                fs = FS_NAMES.get(system[0].fstype, f"filesystem {system[0].fstype}")
                return f"a SIF whose system partition is {fs}, not squashfs; rebuild it"
            return (
                "a SIF with no system partition (data only, as `apptainer build --data`"
                " makes), not an image to run"
            )
        if root.arch != arch:
            return f"a SIF built for {root.arch}; the nodes run {arch}: push an {arch} build"
        return None


# Go's names, which SIF and the image spec use, for what uname says.
_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "i686": "386", "armv7l": "arm"}


def machine_arch() -> str:
    """This machine's architecture in Go's words (``amd64``), as SIF and OCI name it."""
    machine = platform.machine()
    return _GOARCH.get(machine, machine)


def this_platform() -> str:
    """``os/architecture`` of this machine in the image spec's words: ``linux/amd64``."""
    return f"linux/{machine_arch()}"


def has_magic(head: bytes) -> bool:
    return head[MAGIC_OFFSET : MAGIC_OFFSET + len(MAGIC)] == MAGIC


def table_end(head: bytes) -> int:
    """How many bytes from the start hold the header and the descriptor table (a
    VerificationError where the header is not a SIF's): what :func:`layout` needs."""
    if len(head) < HEADER_SIZE or not has_magic(head):
        raise VerificationError("not a SIF file (no SIF_MAGIC)")
    _ct, _mt, _dfree, dtotal, descoff, desclen, _doff, _dlen = _HEADER.unpack_from(head, 64)
    if not 0 < dtotal <= MAX_DESCRIPTORS or descoff < HEADER_SIZE or desclen < 0:
        raise VerificationError("SIF header is corrupt (descriptor table)")
    return int(descoff + dtotal * DESCRIPTOR_SIZE)


def layout(head: bytes, file_size: int) -> Layout:
    """The SIF's partitions and data types, from its first :func:`table_end` bytes
    (``head`` may hold more); sizes are checked against ``file_size`` before use."""
    end = table_end(head)
    if end > file_size:
        raise VerificationError("SIF descriptor table runs past the end of the file")
    if len(head) < end:
        raise VerificationError("SIF descriptor table is cut short")
    _ct, _mt, _dfree, dtotal, descoff, _dl, _doff, _dlen = _HEADER.unpack_from(head, 64)
    parts: list[Partition] = []
    types: set[int] = set()
    for i in range(dtotal):
        base = descoff + i * DESCRIPTOR_SIZE
        datatype, used, _id, _grp, _link, offset, size, _pad = _DESCRIPTOR.unpack_from(head, base)
        if not used:
            continue
        types.add(datatype)
        if datatype != DATA_PARTITION:
            continue
        fstype, parttype, raw_arch = _PART_EXTRA.unpack_from(head, base + _EXTRA_AT)
        if offset < HEADER_SIZE or size <= 0 or offset + size > file_size:
            raise VerificationError("SIF partition lies outside the file")
        arch = ARCHES.get(raw_arch.rstrip(b"\0"), "an unknown architecture")
        parts.append(Partition(offset, size, fstype, parttype, arch))
    return Layout(tuple(parts), frozenset(types))


def root_partition(f: BinaryIO, file_size: int) -> Partition:
    """The squashfs system partition (:meth:`Layout.root`): what the runtime mounts as
    ``/``; a VerificationError that names the kind of SIF where there is none."""
    f.seek(0)
    head = f.read(HEADER_SIZE)
    end = table_end(head)
    if end > file_size:  # before the read: a header may name any offset
        raise VerificationError("SIF descriptor table runs past the end of the file")
    f.seek(0)
    found = layout(f.read(end), file_size)
    root = found.root()
    if root is None:
        raise VerificationError(found.unfit("") or "SIF has no squashfs system partition")
    return root


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
            str(PART_PRIMSYS),
            "--partfs",
            "1",
            "--partarch",
            "2",
            str(sif),
            str(sqfs),
        ],
    ]

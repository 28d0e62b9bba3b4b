"""The names in an ELF file's dynamic section, read without running or loading
it: the soname a shared library gives itself (``DT_SONAME``), the name a program's
loader asks for (``libcuda.so.1``), which a CDI spec does not say (it names
``libcuda.so.550.54.15``); and the libraries a program needs (``DT_NEEDED``),
which say what a squashfuse binary can decompress (step/squashcomp.py).

Only 64-bit ELF, only a regular file (opened without following a link at its end
and without blocking on a FIFO); the section table must lie within the file, and
only the first dynamic section is read, at most 1 MiB.
"""

from __future__ import annotations

import os
import re
import stat
import struct
from typing import BinaryIO

MAX_SECTIONS = 4096
MAX_DYNAMIC = 1 << 20
MAX_NAME = 255
SHENTSIZE = 64  # an ELF64 section header
SHT_DYNAMIC = 6
DT_NULL, DT_NEEDED, DT_SONAME = 0, 1, 14
MAX_NEEDED = 256
_NAME = re.compile(r"[A-Za-z0-9._+-]{1,255}\Z")


def soname(path: str) -> str | None:
    """``DT_SONAME`` of the library at ``path``, or None (no ELF64, no soname)."""
    names = _names(path, DT_SONAME)
    return names[0] if names else None


def needed(path: str) -> list[str] | None:
    """``DT_NEEDED`` of the ELF file at ``path``, in order, or None (not ELF64)."""
    return _names(path, DT_NEEDED)


def _names(path: str, wanted: int) -> list[str] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            names = _read(f, st.st_size, wanted)
        except (OSError, struct.error, ValueError):
            return None
    if names is None:
        return None
    return [n for n in names if _NAME.match(n)]


def _read(fh: BinaryIO, size: int, wanted: int) -> list[str] | None:
    head = fh.read(64)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:
        return None
    end = "<" if head[5] == 1 else ">"
    (shoff,) = struct.unpack_from(end + "Q", head, 0x28)
    shentsize, shnum = struct.unpack_from(end + "HH", head, 0x3A)
    if shentsize != SHENTSIZE or not 0 < shnum <= MAX_SECTIONS or shoff + shnum * SHENTSIZE > size:
        return None
    fh.seek(shoff)
    table = fh.read(SHENTSIZE * shnum)
    sections = [
        struct.unpack_from(end + "IIQQQQI", table, i * SHENTSIZE)  # name..sh_link
        for i in range(len(table) // SHENTSIZE)
    ]
    dynamic = next((s for s in sections if s[1] == SHT_DYNAMIC), None)
    if dynamic is None or not 0 <= dynamic[6] < len(sections):
        return None
    _name, _kind, _flags, _addr, offset, length, link = dynamic
    fh.seek(offset)
    dyn = fh.read(min(length, MAX_DYNAMIC))
    names: list[str] = []
    for i in range(len(dyn) // 16):
        tag, value = struct.unpack_from(end + "qQ", dyn, i * 16)
        if tag == DT_NULL or len(names) >= MAX_NEEDED:
            break
        if tag == wanted:
            fh.seek(sections[link][4] + value)
            names.append(fh.read(MAX_NAME + 1).split(b"\0", 1)[0].decode("ascii", "replace"))
    return names

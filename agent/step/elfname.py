"""The soname an ELF shared library gives itself (``DT_SONAME``), read without
running or loading it: the name a program's loader asks for (``libcuda.so.1``),
which a CDI spec does not say (it names ``libcuda.so.550.54.15``).

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
DT_NULL, DT_SONAME = 0, 14
_NAME = re.compile(r"[A-Za-z0-9._+-]{1,255}\Z")


def soname(path: str) -> str | None:
    """``DT_SONAME`` of the library at ``path``, or None (no ELF64, no soname)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            name = _read(f, st.st_size)
        except (OSError, struct.error, ValueError):
            return None
    return name if name and _NAME.match(name) else None


def _read(fh: BinaryIO, size: int) -> str | None:
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
    for i in range(len(dyn) // 16):
        tag, value = struct.unpack_from(end + "qQ", dyn, i * 16)
        if tag == DT_NULL:
            return None
        if tag == DT_SONAME:
            fh.seek(sections[link][4] + value)
            return fh.read(MAX_NAME + 1).split(b"\0", 1)[0].decode("ascii", "replace")
    return None

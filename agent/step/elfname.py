"""The soname an ELF shared library gives itself (``DT_SONAME``), read without
running or loading it: the name a program's loader asks for (``libcuda.so.1``),
which a CDI spec does not say (it names ``libcuda.so.550.54.15``).

Only 64-bit ELF; every offset and size is bounded before it is read.
"""

from __future__ import annotations

import struct
from typing import BinaryIO

MAX_SECTIONS = 4096
MAX_DYNAMIC = 1 << 20
MAX_NAME = 255
SHT_DYNAMIC = 6
DT_NULL, DT_SONAME = 0, 14


def soname(path: str) -> str | None:
    """``DT_SONAME`` of the library at ``path``, or None (no ELF64, no soname)."""
    try:
        with open(path, "rb") as f:
            return _read(f)
    except (OSError, struct.error, ValueError):
        return None


def _read(fh: BinaryIO) -> str | None:
    head = fh.read(64)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:
        return None
    end = "<" if head[5] == 1 else ">"
    (shoff,) = struct.unpack_from(end + "Q", head, 0x28)
    shentsize, shnum = struct.unpack_from(end + "HH", head, 0x3A)
    if not 0 < shnum <= MAX_SECTIONS or shentsize < 64:
        return None
    fh.seek(shoff)
    table = fh.read(shentsize * shnum)
    sections = [
        struct.unpack_from(end + "IIQQQQI", table, i * shentsize)  # name..sh_link
        for i in range(len(table) // shentsize)
    ]
    for _name, kind, _flags, _addr, offset, size, link in sections:
        if kind != SHT_DYNAMIC or not 0 <= link < len(sections):
            continue
        fh.seek(offset)
        dyn = fh.read(min(size, MAX_DYNAMIC))
        for i in range(len(dyn) // 16):
            tag, value = struct.unpack_from(end + "qQ", dyn, i * 16)
            if tag == DT_NULL:
                break
            if tag == DT_SONAME:
                fh.seek(sections[link][4] + value)
                name = fh.read(MAX_NAME + 1).split(b"\0", 1)[0]
                return name.decode("ascii") if name else None
    return None

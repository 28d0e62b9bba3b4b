"""The one check of an image's bytes, and ``cache verify``.

:class:`BlobCheck` is fed a blob's bytes in order and judges its size, sha256 and
SIF magic.  Three places feed it: a download as it appends (pull.py), a copy that
was staged for a job (staged.py), and ``cache verify`` re-reading every entry
(:func:`verify`).  Each words the answer for its own reader.
"""

from __future__ import annotations

import hashlib
import os

from tfimage.agent.cache.store import CHUNK, ImageCache
from tfimage.agent.core import layout
from tfimage.agent.core.sif import has_magic

SHORT, LONG, MISMATCH, NOT_SIF = "short", "long", "sha256", "magic"
HEAD = 64  # what has_magic reads


class BlobCheck:
    """Size, sha256 and SIF magic of one blob, fed in order (``digest`` None: an
    entry cached before blobs were recorded, whose sha256 is not known)."""

    def __init__(self, digest: str | None, size: int) -> None:
        self.digest, self.size = digest, size
        self.got = 0
        self._h = hashlib.sha256()
        self._head = bytearray()

    def update(self, block: bytes | memoryview) -> None:
        if len(self._head) < HEAD:
            self._head.extend(block[: HEAD - len(self._head)])
        self._h.update(block)
        self.got += len(block)

    def problem(self) -> str | None:
        """None when the blob is whole and right; else SHORT, LONG, MISMATCH or
        NOT_SIF (in that order of precedence)."""
        if self.got < self.size:
            return SHORT
        if self.got > self.size:
            return LONG
        if self.digest is not None and "sha256:" + self._h.hexdigest() != self.digest:
            return MISMATCH
        if not has_magic(bytes(self._head)):
            return NOT_SIF
        return None


def check_fd(fd: int, digest: str | None, size: int) -> str | None:
    """:meth:`BlobCheck.problem` of what ``fd`` holds from its start, reading at most
    one byte past ``size`` (a longer file is LONG without reading it all)."""
    check = BlobCheck(digest, size)
    offset = 0
    while offset <= size and (block := os.pread(fd, min(CHUNK, size + 1 - offset), offset)):
        check.update(block)
        offset += len(block)
    return check.problem()


def verify(cache: ImageCache) -> list[tuple[str, str]]:
    """(digest, problem) for each bad entry, and for each orphan (an image without
    its metadata, or metadata without its image)."""
    bad = [
        (
            layout.digest_of_key(p.name) or p.stem,
            "image without metadata (cache prune removes it)"
            if p.suffix == ".sif"
            else "metadata without its image (cache prune removes it)",
        )
        for p in cache.orphans()
    ]
    words = {
        SHORT: "shorter than its size",
        LONG: "longer than its size",
        MISMATCH: "content does not match its sha256",
        NOT_SIF: "not a SIF file",
    }
    for entry in cache.entries():
        path = cache.path_of(entry.digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                # An entry from before blobs were recorded: its magic, as ever.
                size = entry.size if entry.blob else os.fstat(fd).st_size
                problem = check_fd(fd, entry.blob or None, size)
            finally:
                os.close(fd)
        except OSError as e:
            bad.append((entry.digest, f"unreadable: {e.strerror}"))
            continue
        if problem is not None:
            bad.append((entry.digest, words[problem]))
    return bad

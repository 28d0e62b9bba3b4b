"""Lock files: the cache's one way to hold a ``locks/*.lock`` file exclusively."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def held(path: Path) -> Iterator[int]:
    """``path`` (created 0600, never through a symlink) open and flock'd exclusively,
    until the block ends; yields its descriptor (a lock file may carry a record)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)

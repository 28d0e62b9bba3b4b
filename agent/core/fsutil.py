"""The file primitives every writer of tfimage's state uses.

- :func:`held`: a lock file (created 0600, never through a link) held with flock
  until the block ends;
- :func:`write_atomic` (and :func:`write_json`): replace a file atomically (a
  temporary file in the same directory, renamed over it), fsynced first when asked;
  a reader sees the old content or the new, never a part;
- :func:`fsync_dir`: make a rename into a directory survive a crash;
- :func:`read_json`: a small JSON file of root's own, never through a link and never
  more than a bound.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tfimage.agent.core.posixacl import restrict


@contextlib.contextmanager
def held(path: Path, *, blocking: bool = True) -> Iterator[int]:
    """``path`` open and flock'd exclusively until the block ends; yields its
    descriptor (a lock file may carry a record).  With ``blocking=False`` a lock
    another holds raises BlockingIOError at once."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        yield fd
    finally:
        os.close(fd)


Readers = tuple[list[int], list[int]]


def write_json(
    path: Path,
    data: object,
    *,
    mode: int = 0o644,
    durable: bool = False,
    readers: Readers | None = None,
) -> None:
    """Replace ``path`` with ``data`` as JSON, atomically (see :func:`write_atomic`)."""
    text = json.dumps(data, sort_keys=True).encode()
    write_atomic(path, text, mode=mode, durable=durable, readers=readers)


def write_atomic(
    path: Path,
    data: bytes,
    *,
    mode: int = 0o644,
    durable: bool = False,
    readers: Readers | None = None,
) -> None:
    """Replace ``path`` with ``data`` atomically (a temporary file in the same
    directory, renamed over it); ``durable``: fsynced (file and directory) before it
    counts; ``readers``: (uids, gids) the only users but root who may read it
    (posixacl.py), set before it has its name.  Raises OSError; leaves no
    temporary file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, mode)
            if readers is not None:
                restrict(fd, *readers)
            rest = memoryview(data)
            while rest:  # a short write (a full disk) is finished or raises
                rest = rest[os.write(fd, rest) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path``: the names renamed into it are on disk after."""
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_json(path: Path, limit: int) -> object | None:
    """``path``'s JSON, or None when it is missing, a link, larger than ``limit``
    bytes or not JSON: state a crash, a full disk or a hand may have left."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        return None
    try:
        doc: object = json.loads(raw)
    except ValueError:
        return None
    return doc

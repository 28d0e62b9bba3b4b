"""A blob's download: received into stripe buffers, hashed in order from memory, and
appended in order to the partial file, with O_DIRECT where the filesystem allows it.

Why (the figures behind it are bench/pull.py's, described in the README):

- one HTTPS stream is bound by one core on each side (the registry reads and
  encrypts serially per request), so a large blob may come faster over several;
- writing through the page cache and then fsyncing costs more CPU, and varies
  more, than O_DIRECT, and the CPU is the registry's too on a small node;
- reading the file back to hash it in order is one more copy of every byte.

So with ``pull_connections`` > 1 each connection asks for one stripe
(``pull_stripe_bytes``) at a time with a Range request, straight into a buffer of
its own (``readinto``: no bytes objects); the caller hashes the buffers in the
blob's order while a writer thread appends them in that order.  ``connections + 1``
buffers bound the memory, and so how far one connection may run ahead.  A
connection takes a stripe only once it holds a buffer, so the lowest stripe not yet
hashed always has one: the buffers cannot all wait on each other.

The partial file is therefore always a prefix of the blob: an interrupted download
(a kill -9, a dropped connection, a crash) resumes from its end, whatever the number
of connections, and needs no other bookkeeping.  The sha256 over the whole file, checked
before publishing, decides.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tfimage.agent.core.errors import RegistryStalled, RegistryUnreachable

if TYPE_CHECKING:
    from tfimage.agent.registry.client import RegistryClient

# O_DIRECT wants offsets, lengths and buffer addresses aligned to the device's
# block; 4 KiB covers every block size Linux filesystems use.
ALIGN = 4096
# A connection that broke off is asked again from where it stopped.
ATTEMPTS = 3
# Buffered writes (no O_DIRECT here) start writeback every so often, so the fsync
# before publishing does not wait for the whole image at once.
WRITEBACK = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2


@dataclass(slots=True)
class _Block:
    offset: int
    length: int
    view: memoryview


class _Stopped(Exception):  # noqa: N818 - a signal between threads, not an error
    """The download was abandoned; a worker just leaves."""


def resume_point(kept: int) -> int:
    """Where a download resumes from a partial file of ``kept`` bytes: its last
    whole block (O_DIRECT writes aligned ones)."""
    return kept - kept % ALIGN


def jobs(start: int, size: int, connections: int, stripe: int) -> list[tuple[int, int]]:
    """The requests ``[a, b)`` for bytes ``[start, size)``: stripes when there are
    several connections and at least two stripes' worth, else one stream."""
    if connections > 1 and size - start >= 2 * stripe:
        return [(a, min(a + stripe, size)) for a in range(start, size, stripe)]
    return [(start, size)] if start < size else []


class Download:
    """Bytes ``[start, size)`` of a blob, fetched with one client per connection,
    handed in order to ``consume`` (in the caller's thread) and appended to
    ``partial`` (which holds exactly ``start`` bytes, ``start`` a multiple of
    ALIGN).  Not fsynced.  :meth:`run` raises the first error of any thread.

    Its steps, each a method: :meth:`fetch_stripes` (each connection's thread),
    :meth:`fetch` (one request, asked again where it broke), :meth:`append` (the
    writer thread), :meth:`hand_over` (the caller, in order)."""

    def __init__(
        self,
        clients: Sequence[RegistryClient],
        repository: str,
        digest: str,
        size: int,
        partial: Path,
        start: int,
        stripe: int,
    ) -> None:
        self.clients = clients
        self.repository = repository
        self.digest = digest
        self.size = size
        self.partial = partial
        self.start = start
        self.todo = jobs(start, size, len(clients), stripe)
        self.striped = len(self.todo) > 1
        self.workers = min(len(clients), len(self.todo))
        bufsize = min(stripe, -(-(size - start) // ALIGN) * ALIGN)
        self.pool: queue.Queue[memoryview] = queue.Queue()
        for _ in range(self.workers + 1 if self.todo else 0):
            self.pool.put(memoryview(mmap.mmap(-1, bufsize)))
        self.cond = threading.Condition()
        self.ready: dict[int, _Block] = {}
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.pending = iter(self.todo)
        self.take = threading.Lock()
        self.written = queue.Queue[_Block | None]()

    # -- shared steps ----------------------------------------------------------------

    def buffer(self) -> memoryview:
        """A free buffer, once one is back in the pool (or _Stopped)."""
        while not self.stop.is_set():
            with contextlib.suppress(queue.Empty):
                return self.pool.get(timeout=0.2)
        raise _Stopped

    def deliver(self, block: _Block) -> None:
        with self.cond:
            self.ready[block.offset] = block
            self.cond.notify_all()

    def fail(self, e: BaseException) -> None:
        with self.cond:
            self.errors.append(e)
            self.cond.notify_all()

    # -- a connection's thread --------------------------------------------------------

    def fetch(self, client: RegistryClient, a: int, b: int, view: memoryview) -> None:
        """Bytes [a, b) into consecutive buffers, the first ``view``; every full
        buffer (and the last) is delivered.  A broken connection is asked again."""
        pos, filled, attempt = a, 0, 0
        while pos < b:
            try:
                with client.open_blob(
                    self.repository, self.digest, pos, b, self.size, whole_ok=not self.striped
                ) as body:
                    while pos < b:
                        if self.stop.is_set():
                            raise _Stopped
                        n = body.readinto(view[filled : min(len(view), filled + b - pos)])
                        filled += n
                        pos += n
                        if filled == len(view) or pos == b:
                            self.deliver(_Block(pos - filled, filled, view))
                            if pos < b:
                                view, filled = self.buffer(), 0
            except RegistryUnreachable as e:
                attempt += 1
                # A stalled registry is not asked again: it would cost another whole
                # read timeout before the user learns anything.
                if isinstance(e, RegistryStalled) or attempt >= ATTEMPTS or self.stop.is_set():
                    if filled:  # kept, if it continues the prefix: the next pull goes on
                        self.deliver(_Block(pos - filled, filled, view))
                    raise

    def fetch_stripes(self, client: RegistryClient) -> None:
        """Take stripes until none is left; each only once a buffer is held (see the
        module's docstring)."""
        try:
            while True:
                view = self.buffer()
                with self.take:
                    job = next(self.pending, None)
                if job is None:
                    self.pool.put(view)
                    return
                self.fetch(client, *job, view)
        except _Stopped:
            pass
        except BaseException as e:  # handed to the caller, raised there
            self.fail(e)

    # -- the writer thread ---------------------------------------------------------------

    def append(self) -> None:
        try:
            with _Appender(self.partial) as out:
                while (block := self.written.get()) is not None:
                    out.write(block.view[: block.length], block.offset)
                    self.pool.put(block.view)
        except BaseException as e:
            self.stop.set()
            self.fail(e)
            while self.written.get() is not None:
                pass  # let the caller hand over what it has, and finish

    # -- the caller ------------------------------------------------------------------------

    def hand_over(self, consume: Callable[[memoryview], None]) -> None:
        """Each block in the blob's order: to ``consume``, then to the writer."""
        offset = self.start
        while offset < self.size:
            with self.cond:
                while offset not in self.ready and not self.errors:
                    self.cond.wait(1.0)
                if offset not in self.ready:  # what is ready in order is kept first
                    raise self.errors[0]
                block = self.ready.pop(offset)
            consume(block.view[: block.length])
            self.written.put(block)
            offset += block.length

    def run(self, consume: Callable[[memoryview], None]) -> None:
        if not self.todo:
            return
        writer = threading.Thread(target=self.append, name="tfimage-writer", daemon=True)
        threads = [
            threading.Thread(
                target=self.fetch_stripes, args=(c,), name=f"tfimage-fetch-{i}", daemon=True
            )
            for i, c in enumerate(self.clients[: self.workers])
        ]
        writer.start()
        for t in threads:
            t.start()
        try:
            self.hand_over(consume)
        finally:
            self.stop.set()
            self.written.put(None)
            writer.join()
            for t in threads:
                t.join(timeout=1.0)
        if self.errors:
            raise self.errors[0]  # the writer's, after the last block was handed over


class _Appender:
    """Appends blocks in order: O_DIRECT for whole aligned blocks where the
    filesystem takes it, the page cache for the tail (and everywhere else)."""

    def __init__(self, path: Path) -> None:
        flags = os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW
        self.fd = os.open(path, flags)
        self.direct: int | None = None
        try:
            self.direct = os.open(path, flags | os.O_DIRECT)
        except OSError as e:  # tmpfs and some others refuse it
            if e.errno != errno.EINVAL:
                os.close(self.fd)
                raise
        self.flushed: int | None = None

    def write(self, view: memoryview, offset: int) -> None:
        aligned = len(view) % ALIGN == 0 and offset % ALIGN == 0
        fd = self.direct if aligned and self.direct is not None else self.fd
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(fd, view[done:], offset + done)
            except OSError as e:
                if fd != self.direct or e.errno != errno.EINVAL:
                    raise
                fd = self.fd  # opened with O_DIRECT, refused at write: the page cache
        if fd == self.fd:
            if self.flushed is None:
                self.flushed = offset
            if offset + len(view) - self.flushed >= WRITEBACK:
                _start_writeback(self.fd, self.flushed, offset + len(view) - self.flushed)
                self.flushed = offset + len(view)

    def __enter__(self) -> _Appender:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
        if self.direct is not None:
            os.close(self.direct)


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """sync_file_range(SYNC_FILE_RANGE_WRITE): queue the range for writeback and
    return at once (Linux; Python's os module lacks it).  Best effort: the fsync
    before publishing is what makes the file durable."""
    global _libc
    if _libc is None:
        import ctypes

        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.sync_file_range.argtypes = [
                ctypes.c_int,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_uint,
            ]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


_libc: Any = None

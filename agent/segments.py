"""A large blob fetched over several connections at once, and hashed in order.

Why: one HTTPS stream from a registry is bound by one core on each side (the
registry reads and encrypts serially per request; measured here: one curl stream
~0.45 GiB/s, two Range requests at once ~0.7 GiB/s).  Worker threads each fetch
one segment with a Range request and ``pwrite`` it at its offset in the partial
file; the caller reads the file back (from the page cache) in order, right
behind the writers, to hash it, as sha256 needs the bytes in order.

Resume: ``PARTIAL.parts`` beside the partial file records each segment's range
and how far it was written.  It is written before the partial file exists (so a
partial file without it is a one-stream pull's), rewritten as the pull goes
(every ``MARK_EVERY`` seconds) and always lags what was written, so after a crash
or a kill -9 each segment resumes from its mark with a Range request.  The sha256
over the whole file, checked before publishing, catches anything the marks got
wrong (a power cut between the data and the mark): the pull then starts over.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tfimage.agent.errors import RegistryUnreachable, TfimageError

if TYPE_CHECKING:
    from tfimage.agent.registry import RegistryClient

CHUNK = 1 << 20
MAX_SEGMENTS = 16
# A segment whose connection broke off is asked again from where it stopped.
SEGMENT_ATTEMPTS = 3
MARK_EVERY = 0.25  # seconds between rewrites of the marks


@dataclass
class Segment:
    start: int
    end: int  # exclusive
    done: int  # bytes [start, done) are in the file


def plan(size: int, connections: int, segment_bytes: int) -> list[Segment]:
    """Up to ``connections`` segments of at least ``segment_bytes`` each (one: don't split)."""
    n = max(1, min(connections, MAX_SEGMENTS, size // max(1, segment_bytes)))
    bounds = [size * i // n for i in range(n + 1)]
    return [Segment(a, b, a) for a, b in itertools.pairwise(bounds)]


def parts_path(partial: Path) -> Path:
    return partial.with_name(partial.name + ".parts")


def load_parts(path: Path, size: int) -> list[Segment] | None:
    """The marks of an interrupted segmented pull of ``size`` bytes; None if absent or
    not exactly a cover of [0, size) with marks inside their segments."""
    try:
        data = json.loads(path.read_bytes()[:65536])
        if not isinstance(data, dict) or data.get("size") != size:
            return None
        segs = [Segment(int(a), int(b), int(d)) for a, b, d in data["segments"]]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not 0 < len(segs) <= MAX_SEGMENTS or segs[0].start != 0 or segs[-1].end != size:
        return None
    for s, nxt in zip(segs, [*segs[1:], None], strict=True):
        if not s.start <= s.done <= s.end or s.start >= s.end:
            return None
        if nxt is not None and nxt.start != s.end:
            return None
    return segs


def save_parts(path: Path, size: int, segs: list[Segment]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(
            json.dumps({"size": size, "segments": [[s.start, s.end, s.done] for s in segs]})
        )
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a full disk must not leave it behind
        raise


def fetch(
    clients: list[RegistryClient],
    repository: str,
    digest: str,
    partial: Path,
    size: int,
    segs: list[Segment],
    writeback: Callable[[int, int, int], None],
    writeback_every: int,
) -> Iterator[bytes]:
    """Fill ``partial`` with one worker per unfinished segment; yield the blob's bytes
    in order, read back from the file.  Errors of the workers are raised here."""
    cond = threading.Condition()
    stop = threading.Event()
    errors: list[BaseException] = []
    marks = parts_path(partial)

    def work(seg: Segment, client: RegistryClient) -> None:
        # Its own descriptor, closed by itself: a worker still reading when the pull
        # was abandoned writes only into this partial file, never a reused fd.
        fd = os.open(partial, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            flushed = seg.done
            attempt = 0
            while seg.done < seg.end and not stop.is_set():
                try:
                    for chunk in client.blob_range(repository, digest, seg.done, seg.end):
                        if stop.is_set():
                            return
                        os.pwrite(fd, chunk, seg.done)
                        with cond:
                            seg.done += len(chunk)
                            cond.notify_all()
                        if seg.done - flushed >= writeback_every:
                            writeback(fd, flushed, seg.done - flushed)
                            flushed = seg.done
                except RegistryUnreachable:
                    attempt += 1
                    if attempt >= SEGMENT_ATTEMPTS:
                        raise
                    time.sleep(0.2 * attempt)
        except BaseException as e:  # handed to the reader, raised there
            with cond:
                errors.append(e)
                cond.notify_all()
        finally:
            os.close(fd)

    threads = [
        threading.Thread(target=work, args=(s, c), daemon=True)
        for s, c in zip(segs, clients, strict=False)
        if s.done < s.end
    ]
    for t in threads:
        t.start()
    rfd = os.open(partial, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        pos, saved = 0, time.monotonic()
        for seg in segs:
            while pos < seg.end:
                with cond:
                    while seg.done <= pos and not errors:
                        cond.wait(1.0)
                    if errors:
                        raise errors[0]
                    ready = seg.done
                block = os.pread(rfd, min(CHUNK, ready - pos), pos)
                if not block:
                    raise TfimageError(f"{partial}: shorter than what was written")
                pos += len(block)
                yield block
                if time.monotonic() - saved >= MARK_EVERY:
                    with cond:
                        save_parts(marks, size, segs)
                    saved = time.monotonic()
    finally:
        stop.set()
        os.close(rfd)
        with cond, contextlib.suppress(OSError):
            # What was written so far, for the next pull to resume from (the caller
            # deletes it with the partial file when the pull is over either way).
            save_parts(marks, size, segs)
        for t in threads:
            t.join(timeout=1.0)

"""Critical XIDs from the kernel log, each reported once, matched to its GPU by PCI id.

NVML's events do not report the past, so the gate reads the kernel's log
(``/dev/kmsg``: one message per read, ``PRI,SEQ,USEC,FLAGS;TEXT``), where the driver
writes ``NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.``
A cursor per GPU (the last sequence number checked for it) makes a check report
only what is new since the last check of that GPU; the GPUs a check did not look
at keep theirs, so a job's prolog never swallows another GPU's XID.

    gpu/xid-cursor.json (core/layout.py)  {"boot": BOOT_ID, "seq": {"0000:3b:00": 1234}}

Sequence numbers restart at boot, and so do the cursors (the boot id says when).
The log is the kernel's, but its text is written by whatever a user can make the
kernel log: lines are bounded and parsed strictly, and never trusted for more than
an XID number and a bus id.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tfimage.agent.core import layout
from tfimage.agent.core.fsutil import held, write_json

MAX_MESSAGE = 8192  # the kernel's own limit is 1 KiB of text per message
MAX_MESSAGES = 200_000
MAX_FILE = 64 << 20  # a fixture (a regular file) read at most this far
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

_MESSAGE = re.compile(r"(\d{1,3}),(\d{1,20}),(\d{1,20}),[^;]{0,16};(.*)\Z", re.S)
_XID = re.compile(
    r"NVRM: Xid \(PCI:([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\): (\d{1,5}),"
)


@dataclass(frozen=True)
class Xid:
    seq: int
    pci: str  # the GPU's bus, as key(): 0000:3b:00
    xid: int
    text: str


def key(bus_id: str) -> str:
    """``0000:3b:00`` for NVML's ``00000000:3B:00.0`` and the log's ``0000:3b:00``;
    "" for anything else."""
    m = re.fullmatch(r"([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(\.[0-7])?", bus_id)
    if not m:
        return ""
    return f"{int(m[1], 16):04x}:{int(m[2], 16):02x}:{int(m[3], 16):02x}"


def parse_message(message: str) -> Xid | None:
    """The XID in one kmsg message (its first line), or None."""
    m = _MESSAGE.match(message.split("\n", 1)[0][:MAX_MESSAGE])
    # The driver's own line, from the kernel facility (PRI < 8): not a kernel message
    # that quotes a user's text, nor a user's write to /dev/kmsg (facility 1, user).
    if not m or int(m[1]) >= 8:
        return None
    x = _XID.match(m[4])
    if not x:
        return None
    pci = key(f"{x[1]}:{x[2]}:{x[3]}")
    return Xid(int(m[2]), pci, int(x[4]), m[4].strip()[:300]) if pci else None


def messages(path: Path) -> Iterator[str]:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if stat.S_ISCHR(os.fstat(fd).st_mode):  # /dev/kmsg: one message per read
            for _ in range(MAX_MESSAGES):
                try:
                    data = os.read(fd, MAX_MESSAGE)
                except BlockingIOError:
                    return
                except OSError as e:
                    if e.errno == errno.EPIPE:  # overwritten while reading: go on
                        continue
                    raise
                if not data:
                    return
                yield data.decode("utf-8", "replace")
        else:
            with os.fdopen(os.dup(fd), "rb") as f:
                for n, line in enumerate(f):
                    if n >= MAX_MESSAGES or f.tell() > MAX_FILE:
                        return
                    yield line.decode("utf-8", "replace")
    finally:
        os.close(fd)


def read_xids(path: Path) -> list[Xid]:
    """Every XID message in the log at ``path``, oldest first."""
    return [x for x in map(parse_message, messages(path)) if x is not None]


def _boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


@contextlib.contextmanager
def cursor(state_dir: Path, *, save: bool = True) -> Iterator[dict[str, int]]:
    """The cursors by GPU bus, locked for the block and (``save``) saved after it."""
    path = layout.xid_cursor(state_dir)
    d = path.parent
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    d.chmod(0o700)
    with held(path.with_suffix(".lock")):
        boot = _boot_id()
        seqs: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError, KeyError):
            doc = json.loads(path.read_text())
            if doc.get("boot") == boot:
                seqs = {str(k): int(v) for k, v in doc["seq"].items()}
        yield seqs
        if save:
            write_json(path, {"boot": boot, "seq": seqs}, mode=0o600)


def new_xids(log: list[Xid], seqs: dict[str, int], buses: list[str]) -> dict[str, list[Xid]]:
    """The XIDs of each of ``buses`` past its cursor, and the cursors moved past
    everything read (for those buses only)."""
    out: dict[str, list[Xid]] = {b: [] for b in buses}
    last = max((x.seq for x in log), default=None)
    for x in log:
        if x.pci in out and x.seq > seqs.get(x.pci, -1):
            out[x.pci].append(x)
    if last is not None:
        for b in buses:
            seqs[b] = max(seqs.get(b, -1), last)
    return out

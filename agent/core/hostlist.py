"""Slurm's compact lists, expanded strictly and within bounds: hostlists
(``rack[1-2]-n[01-02],gpu9``), tasks per node (``2(x3),1``) and port lists
(``20000-20003,20010``).

They come from a step's environment, so from a job: each is counted, and each
name measured, before a single item is built (``a[0-65535][0-65535]`` would be
2^32 names; ``x*100000 + [1-65536]`` 6.5 GB of them).  Slurm's order is kept,
never sorted as strings (``n9`` before ``n10``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from tfimage.agent.core.errors import StepLayoutError
from tfimage.agent.core.logtext import oneline

MAX_HOSTS = 65536
# A host name is at most 255 bytes (HOST_NAME_MAX); a layout variable, as Slurm
# writes one, far less than 64 KiB.  Both are checked before anything is expanded.
MAX_NAME = 255
MAX_TEXT = 65536


def _split_top(text: str) -> Iterator[str]:
    """The comma-separated names of a hostlist (commas inside brackets are not
    separators), one at a time: a caller stops at its limit without the rest."""
    depth = 0
    start = 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise StepLayoutError(f"unbalanced ']' in hostlist {oneline(text, 80)!r}")
        elif c == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    if depth:
        raise StepLayoutError(f"unbalanced '[' in hostlist {oneline(text, 80)!r}")
    yield text[start:]


def _ranges(body: str, text: str, limit: int) -> tuple[list[tuple[int, int, int]], int]:
    """A bracket's ranges as (lo, hi, width), and how many names they make; nothing
    expanded, and no more than ``limit`` names' worth even parsed."""
    out: list[tuple[int, int, int]] = []
    count = 0
    if body.count(",") >= limit:  # each item names a node at least
        return out, limit + 1
    for item in body.split(","):
        m = re.fullmatch(r"(\d{1,9})(?:-(\d{1,9}))?", item)
        if not m:
            raise StepLayoutError(
                f"bad range {oneline(item, 40)!r} in hostlist {oneline(text, 80)!r}"
            )
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise StepLayoutError(
                f"bad range {oneline(item, 40)!r} in hostlist {oneline(text, 80)!r}"
            )
        out.append((lo, hi, len(m.group(1))))
        count += hi - lo + 1
        if count > limit:
            break
    return out, count


def expand_hostlist(text: str, limit: int = MAX_HOSTS) -> list[str]:
    """``rack[1-2]-n[01-02],gpu9`` -> rack1-n01, rack1-n02, rack2-n01, rack2-n02, gpu9.

    The count (the product of each name's ranges, summed over names) and each
    name's length are checked before a single name is built: the text comes from a
    job."""
    _bounded(text, "SLURM_STEP_NODELIST")
    parts = []
    total = 0
    for part in _split_top(text.strip()):
        if not part:
            raise StepLayoutError(f"empty name in hostlist {oneline(text, 80)!r}")
        pieces = re.split(r"(\[[^\]]*\])", part)
        parsed: list[str | list[tuple[int, int, int]]] = []
        count = 1
        length = 0
        for piece in pieces:
            if piece.startswith("["):
                ranges, n = _ranges(piece[1:-1], text, limit)
                count *= n
                length += max((max(w, len(str(hi))) for _, hi, w in ranges), default=0)
                parsed.append(ranges)
            else:
                length += len(piece)
                parsed.append(piece)
            if count > limit or length > MAX_NAME:
                break
        if length > MAX_NAME:
            raise StepLayoutError(
                f"hostlist {oneline(text, 80)!r} has a name longer than {MAX_NAME} bytes"
            )
        total += count
        if total > limit:
            raise StepLayoutError(f"hostlist {oneline(text, 80)!r} names more than {limit} nodes")
        parts.append(parsed)
    hosts: list[str] = []
    for parsed in parts:
        names = [""]
        for piece in parsed:
            if isinstance(piece, str):
                names = [n + piece for n in names]
            else:
                names = [
                    n + str(i).zfill(w)
                    for n in names
                    for lo, hi, w in piece
                    for i in range(lo, hi + 1)
                ]
        hosts += names
    return hosts


def expand_counts(text: str, limit: int = MAX_HOSTS) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1]; at most ``limit`` nodes and ``limit`` tasks in
    all, checked before expanding."""
    _bounded(text, "SLURM_STEP_TASKS_PER_NODE")
    items = []
    nodes = tasks = 0
    for item in text.strip().split(","):
        m = re.fullmatch(r"(\d{1,9})(?:\(x(\d{1,9})\))?", item)
        if not m:
            raise StepLayoutError(
                f"bad tasks-per-node item {oneline(item, 40)!r} in {oneline(text, 80)!r}"
            )
        n, times = int(m.group(1)), int(m.group(2) or 1)
        nodes += times
        tasks += n * times
        if nodes > limit or tasks > limit:
            raise StepLayoutError(f"tasks-per-node {oneline(text, 80)!r} is more than {limit}")
        items.append((n, times))
    return [n for n, times in items for _ in range(times)]


def expand_ports(text: str, limit: int = MAX_HOSTS) -> list[int]:
    """``20000-20003`` or ``20000,20002-20003`` -> the ports, in order (at most
    ``limit``, checked before expanding)."""
    _bounded(text, "SLURM_STEP_RESV_PORTS")
    ranges = []
    count = 0
    for item in text.strip().split(","):
        m = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", item)
        if not m:
            raise StepLayoutError(f"bad reserved port item {oneline(item, 40)!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if not 0 < lo <= hi < 65536:
            raise StepLayoutError(f"bad reserved port range {item!r}")
        count += hi - lo + 1
        if count > limit:
            raise StepLayoutError(f"reserved ports {oneline(text, 80)!r} are more than {limit}")
        ranges.append((lo, hi))
    return [p for lo, hi in ranges for p in range(lo, hi + 1)]


def _bounded(text: str, name: str) -> None:
    if len(text) > MAX_TEXT:
        raise StepLayoutError(f"{name} is longer than {MAX_TEXT} bytes")

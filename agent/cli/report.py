"""``tfimage usage report``: usage records from many nodes, aggregated.  Pure: it reads
the files it is given and prints nothing (cli/usage.py does).

Inputs are files or directories (walked, never through a link): plain logs, their
rotations (``usage.jsonl.1``) and compressed ones (``.gz``).  A line that is not a
schema-1 record is counted and skipped, never fatal; the same job on the same node
seen twice (a file given twice, a rotation copied) counts once.
"""

from __future__ import annotations

import gc
import gzip
import math
import os
import re
import statistics
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tfimage.agent.core.errors import InputError
from tfimage.agent.usage import record

BY = ("image", "user", "account", "partition", "node")
TREND = ("day", "week")
# Names a directory's usage logs carry: the role's, rotated (usage.jsonl.1, or with
# logrotate's dateext usage.jsonl-20261203), compressed.
LOG_NAME = re.compile(r".*\.jsonl(\.\d+|-\d{8,10})?(\.gz)?\Z")
_RELATIVE = re.compile(r"(\d{1,6})([mhdw])\Z")
_UNITS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# Wilson score interval's z for 95 %: 1 failure of 1 ranks below 30 of 100.
Z = 1.96


def parse_when(text: str, now: datetime | None = None) -> datetime:
    """``2026-12-01``, ``2026-12-01T12:00``, ISO 8601 with a zone, or ``7d``/``12h``/
    ``30m``/``2w`` ago.  Without a zone: UTC."""
    now = now or datetime.now(UTC)
    m = _RELATIVE.match(text)
    if m:
        return now - timedelta(seconds=int(m.group(1)) * _UNITS[m.group(2)])
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise InputError(
            f"{text!r} is not a time: give 2026-12-01, 2026-12-01T12:00 or 7d, 12h, 30m, 2w"
        ) from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def log_files(paths: Iterable[str]) -> list[Path]:
    """The files to read: each file given, and the usage logs under each directory."""
    out: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            for root, dirs, files in os.walk(path):  # links to directories: not followed
                dirs.sort()
                for name in sorted(files):
                    f = Path(root) / name
                    if LOG_NAME.match(name) and not f.is_symlink() and f.is_file():
                        out.append(f)
        elif path.is_file():
            out.append(path)
        else:
            raise InputError(f"{p}: no such file or directory")
    return out


@dataclass(slots=True)
class Job:
    """The part of a record a report needs."""

    key: str  # the --by value
    job_id: str
    end: datetime
    wall: float
    failed: bool
    gpus: int
    energy_j: float | None
    image: str


@dataclass
class Loaded:
    jobs: list[Job] = field(default_factory=list)
    files: int = 0
    skipped: int = 0  # lines that were not records
    duplicates: int = 0
    damaged: list[str] = field(default_factory=list)  # files cut short: read up to there


def image_of(rec: dict[str, Any]) -> str:
    image = rec.get("image") or rec.get("image_asked") or "-"
    return str(image).split("@", 1)[0]


def _lines(path: Path, damaged: list[str]) -> Iterator[bytes]:
    """The file's lines; a compressed one cut short (a copy in progress, a full disk)
    gives what it had, and is named in ``damaged``."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            yield from f
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        damaged.append(f"{path}: {e}")
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None


def load(
    paths: Iterable[str],
    *,
    by: str = "image",
    since: datetime | None = None,
    until: datetime | None = None,
) -> Loaded:
    """The records of ``paths`` whose end lies in [since, until)."""
    import json

    # Hundreds of thousands of small objects that all live to the end: the cyclic
    # collector would walk them again and again (half the time, measured) for nothing.
    paused = gc.isenabled()
    gc.disable()
    try:
        return _load(paths, by, since, until, json.loads)
    finally:
        if paused:
            gc.enable()


def _load(
    paths: Iterable[str],
    by: str,
    since: datetime | None,
    until: datetime | None,
    loads: Callable[[bytes], Any],
) -> Loaded:

    if by not in BY:
        raise InputError(f"--by {by!r}: give one of {', '.join(BY)}")
    out = Loaded()
    seen: set[tuple[object, object, object]] = set()
    for path in log_files(paths):
        out.files += 1
        for line in _lines(path, out.damaged):
            try:
                rec = loads(line)
                if rec["schema"] != 1:
                    raise ValueError
                end = datetime.fromisoformat(rec["end"])
                if end.tzinfo is None:
                    end = end.replace(tzinfo=UTC)
                wall = float(rec["wall_seconds"])
                if not 0 <= wall < 1e9:  # NaN fails this too
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                out.skipped += 1
                continue
            if (since and end < since) or (until and end >= until):
                continue
            ident = (rec.get("job_id"), rec.get("node"), rec.get("start"))
            if ident in seen:
                out.duplicates += 1
                continue
            seen.add(ident)
            gpus = rec.get("gpus") if isinstance(rec.get("gpus"), list) else []
            joules = [g.get("energy_j") for g in gpus if isinstance(g, dict)]
            known = [float(j) for j in joules if isinstance(j, (int, float))]
            image = image_of(rec)
            key = image if by == "image" else str(rec.get(by) or "-")
            out.jobs.append(
                Job(key, str(rec.get("job_id")), end, wall, record.failed(rec), len(gpus),
                    sum(known) if known else None,
                    image)
            )  # fmt: skip
    return out


def _quantile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank quantile (q in (0, 1]) of a sorted, non-empty list."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def wilson_low(failures: int, jobs: int) -> float:
    """The lower end of the 95 % Wilson interval of a failure rate: what ranks images."""
    if jobs == 0:
        return 0.0
    p = failures / jobs
    centre = p + Z * Z / (2 * jobs)
    spread = Z * math.sqrt(p * (1 - p) / jobs + Z * Z / (4 * jobs * jobs))
    return max(0.0, (centre - spread) / (1 + Z * Z / jobs))


def summarize(jobs: list[Job]) -> list[dict[str, Any]]:
    """Per group: jobs, failures, failure rate, median and p90 wall time, GPU-hours,
    energy; the largest groups first."""
    groups: dict[str, list[Job]] = {}
    for j in jobs:
        groups.setdefault(j.key, []).append(j)
    rows: list[dict[str, Any]] = []
    for key, js in groups.items():
        walls = sorted(j.wall for j in js)
        fails = sum(j.failed for j in js)
        energy = [j.energy_j for j in js if j.energy_j is not None]
        rows.append(
            {
                "key": key,
                "jobs": len(js),
                "failures": fails,
                "failure_rate": round(fails / len(js), 4),
                "median_seconds": round(statistics.median(walls), 3),
                "p90_seconds": round(_quantile(walls, 0.9), 3),
                "gpu_hours": round(sum(j.wall * j.gpus for j in js) / 3600, 3),
                "energy_kwh": round(sum(energy) / 3.6e6, 6) if energy else None,
            }
        )
    rows.sort(key=lambda r: (-r["jobs"], r["key"]))
    return rows


def top_failing(jobs: list[Job], n: int) -> list[dict[str, Any]]:
    """The ``n`` images most likely to fail: ranked by the lower end of their failure
    rate's 95 % interval, so 1 failure in 1 job ranks below 30 in 100."""
    if n < 1:
        raise InputError("--top-failing: give a count of at least 1")
    counts: dict[str, list[int]] = {}
    for j in jobs:
        c = counts.setdefault(j.image, [0, 0])
        c[0] += 1
        c[1] += j.failed
    rows: list[dict[str, Any]] = [
        {
            "image": image,
            "jobs": total,
            "failures": fails,
            "failure_rate": round(fails / total, 4),
            "rank_score": round(wilson_low(fails, total), 4),
        }
        for image, (total, fails) in counts.items()
        if fails
    ]
    rows.sort(key=lambda r: (-r["rank_score"], -r["failures"], r["image"]))
    return rows[:n]


def period_of(t: datetime, per: str) -> str:
    if per == "day":
        return t.strftime("%Y-%m-%d")
    year, week, _ = t.isocalendar()
    return f"{year}-W{week:02d}"


def trend(jobs: list[Job], per: str) -> list[dict[str, Any]]:
    """Average and median training duration (wall time) per day or ISO week of the
    jobs' end, oldest first; failed jobs count (a crash is part of the trend) and are
    counted apart."""
    if per not in TREND:
        raise InputError(f"--trend {per!r}: give day or week")
    periods: dict[str, list[Job]] = {}
    for j in jobs:
        periods.setdefault(period_of(j.end, per), []).append(j)
    rows: list[dict[str, Any]] = []
    for p in sorted(periods):
        js = periods[p]
        walls = [j.wall for j in js]
        rows.append(
            {
                "period": p,
                "jobs": len(js),
                "failures": sum(j.failed for j in js),
                "mean_seconds": round(sum(walls) / len(walls), 3),
                "median_seconds": round(statistics.median(walls), 3),
            }
        )
    return rows


def duration(seconds: float) -> str:
    """1h02m, 4m05s, 12.3s: what a table shows."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = round(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """Rows as an aligned text table; ``columns``: (key, heading)."""

    def cell(row: dict[str, Any], key: str) -> str:
        v = row.get(key)
        if v is None:
            return "-"
        if key.endswith("_seconds"):
            return duration(float(v))
        if key.endswith("_rate") or key == "rank_score":
            return f"{100 * float(v):.1f}%"
        return str(v)

    cells = [[h for _, h in columns]] + [[cell(r, k) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = []
    for row in cells:
        first, *rest = row
        lines.append(
            "  ".join(
                [
                    first.ljust(widths[0]),
                    *(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True)),
                ]
            ).rstrip()
        )
    return "\n".join(lines)

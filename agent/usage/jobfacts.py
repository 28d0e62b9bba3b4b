"""What the prolog and the job's steps learn of a job on this node, kept for its epilog.

``usage/<job>.json`` under ``state_dir`` (core/layout.py; 0600, root's alone), e.g.
``{"prolog_start": 1764780000.5, "image": "...", "cache": "miss", "pull_seconds":
4.2, ...}``, and ``<job>.lock`` beside it, held while it changes (the prolog and the
steps at once).

The prolog writes its first facts before it pulls, so a prolog killed halfway still
leaves the job's start and image for the record; the epilog reads the file and
removes both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tfimage.agent.core import layout
from tfimage.agent.core.fsutil import held, read_json, write_json

# A file no tfimage writer makes larger; a bigger one is not read.
MAX_BYTES = 64 << 10


def usage_dir(state_dir: str) -> Path:
    """``state_dir/usage``, root's alone (the job facts' and the node counters')."""
    d = layout.usage_dir(state_dir)
    Path(state_dir).mkdir(mode=0o755, parents=True, exist_ok=True)
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _path(state_dir: str, job_id: str) -> Path:
    return layout.job_facts(state_dir, job_id)


def _read(path: Path) -> dict[str, Any]:
    doc = read_json(path, MAX_BYTES)
    return doc if isinstance(doc, dict) else {}


def _change(state_dir: str, job_id: str, change: Callable[[dict[str, Any]], bool]) -> None:
    """Apply ``change`` to the job's facts under their lock; written when it says so."""
    path = _path(state_dir, job_id)
    usage_dir(state_dir)
    with held(path.with_suffix(".lock")):
        doc = _read(path)
        if change(doc):
            write_json(path, doc, mode=0o600)


def note(state_dir: str, job_id: str, **facts: Any) -> None:
    """Merge ``facts`` into the job's file (a later value wins)."""

    def change(doc: dict[str, Any]) -> bool:
        doc.update(facts)
        return True

    _change(state_dir, job_id, change)


def note_max(state_dir: str, job_id: str, key: str, value: int) -> None:
    """Keep the largest ``value`` seen for ``key`` (a job's steps may differ in size)."""

    def change(doc: dict[str, Any]) -> bool:
        old = doc.get(key)
        if isinstance(old, int) and old >= value:
            return False
        doc[key] = value
        return True

    _change(state_dir, job_id, change)


@contextlib.contextmanager
def claimed(state_dir: str, job_id: str) -> Iterator[dict[str, Any]]:
    """The epilog's hold on the job's facts: yields them and removes them when the
    block ends, under their lock throughout, so that of two epilogs at once (Slurm
    may start a second) one finds the facts and the other finds none: one record.
    Nothing to claim (no prolog kept facts here) yields {} and makes nothing."""
    path = _path(state_dir, job_id)
    lock = path.with_suffix(".lock")
    if not path.parent.is_dir():
        yield {}
        return
    with held(lock):
        try:
            yield _read(path)
        finally:
            for p in (path, lock):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()

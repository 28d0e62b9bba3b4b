"""Eviction: how full the cache is, prune, remove, and what is left over (stale
holders, interrupted downloads, orphans).

Prune starts at the high watermark and stops at the low one, least recently used
first.  It never takes a kept entry (keep.py), one a running job holds, or one used more
recently than the minimum age.  A holder whose job has left this node (its state
under ``state_dir/jobs`` is gone, e.g. after a crash or a reboot) is reclaimed, and
so is an interrupted download nobody resumed within the minimum age.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tfimage.agent.cache.store import Entry, ImageCache
from tfimage.agent.core import layout
from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import CacheError
from tfimage.agent.core.fsutil import held
from tfimage.agent.core.ids import valid_job_id
from tfimage.agent.usage import metrics


@dataclass(frozen=True)
class Fill:
    """How full the cache is, against what its watermarks are percentages of."""

    cache_bytes: int
    entries: int
    limit_bytes: int  # what the watermarks are percentages of
    used_bytes: int  # what counts against the limit

    @property
    def percent(self) -> float:
        return 100.0 * self.used_bytes / self.limit_bytes if self.limit_bytes else 0.0


def fill(cache: ImageCache) -> Fill:
    entries = cache.entries()
    size = sum(e.size for e in entries)
    if cache.cfg.cache_max_bytes:
        return Fill(size, len(entries), cache.cfg.cache_max_bytes, size)
    st = os.statvfs(cache.root)
    total = st.f_blocks * st.f_frsize
    return Fill(size, len(entries), total, total - st.f_bavail * st.f_frsize)


def live_job(cache: ImageCache, job: str) -> bool:
    """Whether ``job`` is running on this node: its images file is there (step/).
    A holder no job id could be (a hand's) never is."""
    return valid_job_id(job) and layout.job_images(cache.cfg.state_dir, job).exists()


def in_use(cache: ImageCache, digest: str) -> bool:
    """Whether a job still running on this node holds the image."""
    return any(live_job(cache, h) for h in cache.read_entry(digest).holders)


def reclaim_holders(cache: ImageCache) -> int:
    """Drop holders whose jobs are gone from this node; returns how many."""
    dropped = 0
    for entry in cache.entries():
        stale = {h for h in entry.holders if not live_job(cache, h)}
        if stale:
            dropped += len(stale)
            cache.update_entry(entry.digest, functools.partial(Entry.without_holders, gone=stale))
    return dropped


def remove(cache: ImageCache, digest: str, *, force: bool = False) -> None:
    """Remove one entry; refuses one a running job holds, and a kept one unless forced."""
    with cache.lock(digest):
        entry = cache.read_entry(digest)
        if not cache.path_of(digest).exists():
            raise CacheError(f"{digest[:19]} is not in the cache")
        holders = [h for h in entry.holders if live_job(cache, h)]
        if holders:
            raise CacheError(f"{digest[:19]} is held by running job(s) {', '.join(holders)}")
        if entry.kept and not force:
            raise CacheError(f"{digest[:19]} is kept; unkeep it or use --force")
        # Unlinking is safe even while mounted: a reader keeps its open file.
        cache.path_of(digest).unlink()
        with contextlib.suppress(FileNotFoundError):
            cache.entry_path(digest).unlink()


def prune(cache: ImageCache, *, dry_run: bool = False, now: float | None = None) -> list[Entry]:
    """Evict down to the low watermark if above the high one; returns what went."""
    cfg = cache.cfg
    reclaim_holders(cache)
    f = fill(cache)
    if f.percent < cfg.cache_high_watermark:
        return []
    target = cfg.cache_low_watermark * f.limit_bytes / 100.0
    now = time.time() if now is None else now
    gone: list[Entry] = []
    used = f.used_bytes
    for entry in sorted(cache.entries(), key=lambda e: e.last_used):
        if used <= target:
            break
        if entry.kept or any(live_job(cache, h) for h in entry.holders):
            continue
        if now - entry.last_used < cfg.cache_min_age:
            continue
        if not dry_run:
            try:
                remove(cache, entry.digest)
            except CacheError:
                continue  # held or kept since we looked
        used -= entry.size
        gone.append(entry)
    if gone and not dry_run:
        _count(cfg, gone)
    return gone


def _count(cfg: Config, gone: list[Entry]) -> None:
    """Evictions into the node's metrics; their trouble never undoes an eviction."""
    freed = sum(e.size for e in gone)

    def change(counters: dict[str, Any]) -> None:
        metrics.add("cache_evictions", len(gone))(counters)
        metrics.add("cache_evicted_bytes", freed)(counters)

    with contextlib.suppress(Exception):
        metrics.update(cfg.state_dir, cfg.metrics_dir, cfg.cache_dir, change)


def stale_partials(
    cache: ImageCache, *, dry_run: bool = False, now: float | None = None
) -> list[Path]:
    """What interrupted pulls left in ``tmp/`` (downloads ``sha256-*.partial``,
    conversions ``convert-sha256-*`` and ``sha256-*.converted``, adoptions
    ``sha256-*.adopting``: a pull killed at its deadline, a crash) and copies staged
    in ``staged/`` that no job took, alone for the minimum age, whose digest no pull
    holds now; removed unless ``dry_run``."""
    now = time.time() if now is None else now
    gone = []
    for path in layout.cache_leftovers(cache.root):
        work_dir = path.name.startswith(layout.CONVERT_PREFIX)
        if work_dir and (not path.is_dir() or path.is_symlink()):
            continue  # only root writes tmp/: a link there is left for an operator
        if path.parent.name == "staged" and path.is_dir() and not path.is_symlink():
            continue  # staged/ holds files alone: a directory there is left for an operator
        try:
            if now - path.lstat().st_mtime < cache.cfg.cache_min_age:
                continue
        except OSError:
            continue
        if _drop_unheld(cache, path, dry_run=dry_run):
            gone.append(path)
    return gone


def abandoned_downloads(cache: ImageCache) -> list[Path]:
    """Drop the partial downloads in ``tmp/`` that no pull is at now, whatever their
    age: what a failed pull kept to resume.  The epilog calls it, so that a job whose
    image could not be pulled leaves nothing behind when it ends (the soak's leak
    check); a pull asked again before then, or within the same pull, still resumes."""
    return [
        path
        for path in layout.cache_partials(cache.root)
        if _drop_unheld(cache, path, dry_run=False)
    ]


def _drop_unheld(cache: ImageCache, path: Path, *, dry_run: bool) -> bool:
    """Remove ``path`` (unless ``dry_run``) under its digest's lock, taken without
    waiting; whether it was free (the pull at work on a digest holds its lock)."""
    key = path.name.removeprefix(layout.CONVERT_PREFIX)[: layout.KEY_LENGTH]
    try:
        with held(layout.cache_lock(cache.root, key), blocking=False):
            if not dry_run:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            return True
    except OSError:  # BlockingIOError: a pull is resuming it right now
        return False


def orphans(cache: ImageCache, *, dry_run: bool = False) -> list[Path]:
    """Images without metadata files and metadata files without images (store.py's publish
    leaves neither, but a crash between its two steps, or an older tfimage, may);
    removed under their digest's lock, unless ``dry_run``."""
    gone = []
    for path in cache.orphans():
        with cache.lock(path.stem):  # the key: the digest's lock
            other = layout.cache_entry_pair(path)
            if other is None or other.exists() or not path.exists():
                continue  # published (or removed) since we looked
            if not dry_run:
                path.unlink()
            gone.append(path)
    return gone

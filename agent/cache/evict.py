"""Eviction: usage, prune, remove, and what is left over (stale holders,
interrupted downloads, orphans).

Prune starts at the high watermark and stops at the low one, least recently used
first.  It never takes a kept entry (keep.py), one a running job holds, or one used more
recently than the minimum age.  A holder whose job has left this node (its state
under ``state_dir/jobs`` is gone, e.g. after a crash or a reboot) is reclaimed, and
so is an interrupted download nobody resumed within the minimum age.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tfimage.agent.cache.keep import is_kept
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.config import Config
from tfimage.agent.errors import CacheError
from tfimage.agent.fsutil import held
from tfimage.agent.usage import metrics


@dataclass(frozen=True)
class Usage:
    cache_bytes: int
    entries: int
    limit_bytes: int  # what the watermarks are percentages of
    used_bytes: int  # what counts against the limit

    @property
    def percent(self) -> float:
        return 100.0 * self.used_bytes / self.limit_bytes if self.limit_bytes else 0.0


def usage(cache: ImageCache) -> Usage:
    entries = cache.entries()
    size = sum(int(e.get("size", 0)) for e in entries)
    if cache.cfg.cache_max_bytes:
        return Usage(size, len(entries), cache.cfg.cache_max_bytes, size)
    st = os.statvfs(cache.root)
    total = st.f_blocks * st.f_frsize
    return Usage(size, len(entries), total, total - st.f_bavail * st.f_frsize)


def live_job(cache: ImageCache, job: str) -> bool:
    return (Path(cache.cfg.state_dir) / "jobs" / f"{job}.images.json").exists()


def in_use(cache: ImageCache, digest: str) -> bool:
    """Whether a job still running on this node holds the image."""
    return any(live_job(cache, h) for h in cache.read_meta(digest).get("holders", []))


def reclaim_holders(cache: ImageCache) -> int:
    """Drop holders whose jobs are gone from this node; returns how many."""
    dropped = 0
    for meta in cache.entries():
        stale = {h for h in meta.get("holders", []) if not live_job(cache, h)}
        if stale:
            dropped += len(stale)

            def drop(m: dict[str, Any], stale: set[str] = stale) -> None:
                m["holders"] = [h for h in m["holders"] if h not in stale]

            cache.update_meta(meta["digest"], drop)
    return dropped


def remove(cache: ImageCache, digest: str, *, force: bool = False) -> None:
    """Remove one entry; refuses one a running job holds, and a kept one unless forced."""
    with cache.lock(digest):
        meta = cache.read_meta(digest)
        if not cache.path_of(digest).exists():
            raise CacheError(f"{digest[:19]} is not in the cache")
        holders = [h for h in meta.get("holders", []) if live_job(cache, h)]
        if holders:
            raise CacheError(f"{digest[:19]} is held by running job(s) {', '.join(holders)}")
        if is_kept(meta) and not force:
            raise CacheError(f"{digest[:19]} is kept; unkeep it or use --force")
        # Unlinking is safe even while mounted: a reader keeps its open file.
        cache.path_of(digest).unlink()
        with contextlib.suppress(FileNotFoundError):
            cache.meta_path(digest).unlink()


def prune(
    cache: ImageCache, *, dry_run: bool = False, now: float | None = None
) -> list[dict[str, Any]]:
    """Evict down to the low watermark if above the high one; returns what went."""
    cfg = cache.cfg
    reclaim_holders(cache)
    u = usage(cache)
    if u.percent < cfg.cache_high_watermark:
        return []
    target = cfg.cache_low_watermark * u.limit_bytes / 100.0
    now = time.time() if now is None else now
    gone: list[dict[str, Any]] = []
    used = u.used_bytes
    for meta in sorted(cache.entries(), key=lambda m: float(m.get("last_used", 0))):
        if used <= target:
            break
        if is_kept(meta) or any(live_job(cache, h) for h in meta.get("holders", [])):
            continue
        if now - float(meta.get("last_used", 0)) < cfg.cache_min_age:
            continue
        if not dry_run:
            try:
                remove(cache, meta["digest"])
            except CacheError:
                continue  # held or kept since we looked
        used -= int(meta.get("size", 0))
        gone.append(meta)
    if gone and not dry_run:
        _count(cfg, gone)
    return gone


def _count(cfg: Config, gone: list[dict[str, Any]]) -> None:
    """Evictions into the node's metrics; their trouble never undoes an eviction."""
    freed = sum(int(m.get("size", 0)) for m in gone)

    def change(counters: dict[str, Any]) -> None:
        metrics.add("cache_evictions", len(gone))(counters)
        metrics.add("cache_evicted_bytes", freed)(counters)

    with contextlib.suppress(Exception):
        metrics.update(cfg.state_dir, cfg.metrics_dir, cfg.cache_dir, change)


def stale_partials(
    cache: ImageCache, *, dry_run: bool = False, now: float | None = None
) -> list[Path]:
    """What interrupted pulls left in ``tmp/`` (downloads ``sha256-*.partial``,
    conversions ``convert-sha256-*`` and ``sha256-*.converted``: a pull killed at
    its deadline, a crash) alone for the minimum age, whose digest no pull holds
    now; removed unless ``dry_run``."""
    now = time.time() if now is None else now
    gone = []
    tmp = cache.root / "tmp"
    left = [*tmp.glob("sha256-*.partial"), *tmp.glob("sha256-*.converted")]
    left += [p for p in tmp.glob("convert-sha256-*") if p.is_dir() and not p.is_symlink()]
    for path in sorted(left):
        key = path.name.removeprefix("convert-")[: len("sha256-") + 64]
        try:
            if now - path.lstat().st_mtime < cache.cfg.cache_min_age:
                continue
            with held(cache.root / "locks" / f"{key}.lock", blocking=False):
                if not dry_run:
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        with contextlib.suppress(FileNotFoundError):
                            path.unlink()
                gone.append(path)
        except BlockingIOError:
            continue  # a pull is resuming it right now
        except OSError:
            continue
    return gone


def orphans(cache: ImageCache, *, dry_run: bool = False) -> list[Path]:
    """Images without metadata and metadata without images (store.py's publish
    leaves neither, but a crash between its two steps, or an older tfimage, may);
    removed under their digest's lock, unless ``dry_run``."""
    gone = []
    for path in cache.orphans():
        digest = path.stem.replace("-", ":", 1)
        with cache.lock(digest):
            other = path.with_suffix(".json" if path.suffix == ".sif" else ".sif")
            if other.exists() or not path.exists():
                continue  # published (or removed) since we looked
            if not dry_run:
                path.unlink()
            gone.append(path)
    return gone

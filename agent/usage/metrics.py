"""The node's tfimage metrics, in Prometheus's text format for node_exporter's
textfile collector.

Counters live where no job reaches them, and the text is rendered from them after
each change::

    usage/counters.json (core/layout.py)  0600  {"images": {"library/x": {"jobs": 3}},
                                                 "evictions": 1, "drains": 0, "gpus": {}}
    usage/counters.lock                   0600  held while they change
    <metrics_dir>/tfimage.prom        0644  written to a temporary file in the same
                                            directory, then renamed over it

Labels are bounded: the image's repository (at most MAX_REPOSITORIES a node, the
rest counted as ``other``), a GPU's index and UUID; never a job id or a digest.
Counters start again from zero when /run is emptied (a reboot), which PromQL's
``rate()`` and ``increase()`` expect of any counter.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tfimage.agent.core import layout
from tfimage.agent.core.fsutil import held, read_json, write_atomic, write_json
from tfimage.agent.usage import record
from tfimage.agent.usage.jobfacts import usage_dir

FILE_NAME = "tfimage.prom"
MAX_REPOSITORIES = 100
OTHER = "other"

# name, type, help; per-repository counters first (the key in counters.json after the
# name's "tfimage_" and before "_total").
PER_IMAGE = (
    ("jobs", "Jobs that ran with --tf-image on this node."),
    ("job_failures", "Such jobs that failed: non-zero exit, a signal, or no image."),
    ("image_failures", "Such jobs whose image could not be readied on this node."),
    ("job_duration_seconds", "Wall time of such jobs on this node (prolog to epilog)."),
    ("pull_bytes", "Bytes pulled from the registry or a mirror for such jobs."),
    ("pull_seconds", "Time the prolog spent readying the image (pull and check)."),
    ("cache_hits", "Jobs whose image was in the node cache already."),
    ("cache_misses", "Jobs whose image had to be pulled."),
    ("cache_staged", "Jobs whose image was adopted from a copy staged for the job."),
)
NODE_COUNTERS = (
    ("cache_evictions", "Images evicted from the node cache."),
    ("cache_evicted_bytes", "Bytes freed by evictions."),
    ("gpu_drains", "Times tfimage drained this node for a GPU fault."),
)
GAUGES = (
    ("tfimage_cache_size_bytes", "Bytes of images in the node cache."),
    ("tfimage_cache_images", "Images in the node cache."),
    ("tfimage_gpu_healthy", "The last tfimage check of a GPU: 1 healthy, 0 drained."),
)
# Every metric name tfimage exports (the dashboard's test checks its queries by it).
EXPORTED = (
    *(f"tfimage_{k}" for k, _ in PER_IMAGE),
    *(f"tfimage_{k}" for k, _ in NODE_COUNTERS),
    *(name for name, _ in GAUGES),
)


def _paths(state_dir: str) -> tuple[Path, Path]:
    path = layout.counters(state_dir)
    usage_dir(state_dir)  # made, 0700
    return path, path.with_suffix(".lock")


# Counters of 100 repositories and 64 GPUs fit in a fraction of this.
MAX_BYTES = 1 << 20


def _load(path: Path) -> dict[str, Any]:
    doc = read_json(path, MAX_BYTES)
    return doc if isinstance(doc, dict) else {}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(v: object) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return "0"
    return repr(float(v)) if isinstance(v, float) else str(v)


def render(counters: Mapping[str, Any], cache_dir: str) -> str:
    """The Prometheus text of ``counters`` and the cache's present size."""
    out: list[str] = []
    images = counters.get("images") if isinstance(counters.get("images"), dict) else {}
    assert isinstance(images, dict)
    for key, text in PER_IMAGE:
        name = f"tfimage_{key}_total"
        out += [f"# HELP {name} {text}", f"# TYPE {name} counter"]
        for repo in sorted(images):
            row = images[repo] if isinstance(images[repo], dict) else {}
            out.append(f'{name}{{repository="{_label(repo)}"}} {_number(row.get(key, 0))}')
    for key, text in NODE_COUNTERS:
        name = f"tfimage_{key}_total"
        out += [f"# HELP {name} {text}", f"# TYPE {name} counter"]
        out.append(f"{name} {_number(counters.get(key, 0))}")
    size, count = _cache_size(cache_dir)
    for (name, text), value in zip(GAUGES[:2], (size, count), strict=True):
        out += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name} {value}"]
    name, text = GAUGES[2]
    out += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
    gpus = counters.get("gpus") if isinstance(counters.get("gpus"), dict) else {}
    assert isinstance(gpus, dict)
    for uuid in sorted(gpus):
        g = gpus[uuid] if isinstance(gpus[uuid], dict) else {}
        out.append(
            f'{name}{{gpu="{_label(str(g.get("index", "")))}",uuid="{_label(uuid)}"}} '
            f"{1 if g.get('healthy') else 0}"
        )
    return "\n".join(out) + "\n"


def _cache_size(cache_dir: str) -> tuple[int, int]:
    size = count = 0
    with contextlib.suppress(OSError), os.scandir(layout.cache_images(cache_dir)) as it:
        for e in it:
            if e.name.endswith(".sif") and e.is_file(follow_symlinks=False):
                size += e.stat(follow_symlinks=False).st_size
                count += 1
    return size, count


def write_text(metrics_dir: str, text: str) -> Path:
    """Replace ``metrics_dir/tfimage.prom`` atomically: node_exporter never reads half."""
    path = Path(metrics_dir) / FILE_NAME
    write_atomic(path, text.encode(), mode=0o644)
    return path


def update(
    state_dir: str,
    metrics_dir: str,
    cache_dir: str,
    change: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Apply ``change`` to the counters under their lock, then write the text where
    ``metrics_dir`` exists (node_exporter's package makes it; the role too): a node
    without node_exporter keeps the counters alone."""
    path, lock = _paths(state_dir)
    with held(lock):
        counters = _load(path)
        if change is not None:
            change(counters)
            write_json(path, counters, mode=0o600)
        if metrics_dir and Path(metrics_dir).is_dir():
            write_text(metrics_dir, render(counters, cache_dir))


def image_row(
    counters: dict[str, Any], repository: str | None, *, new: bool = True
) -> dict[str, Any]:
    """The counters of ``repository``; ``new``: it may get a label of its own (an
    image that was readied here; a name that never pulled is anyone's to invent, and
    would otherwise crowd real images out of the bounded label set)."""
    images = counters.setdefault("images", {})
    repo = repository or OTHER
    if repo not in images and (not new or len(images) >= MAX_REPOSITORIES):
        repo = OTHER
    row: dict[str, Any] = images.setdefault(repo, {})
    return row


def count_job(rec: Mapping[str, Any]) -> Callable[[dict[str, Any]], None]:
    """The change one usage record makes."""

    def change(counters: dict[str, Any]) -> None:
        readied = rec.get("cache") in record.CACHE_VALUES
        row = image_row(counters, rec.get("repository"), new=readied)

        def add(key: str, n: float) -> None:
            row[key] = row.get(key, 0) + n

        add("jobs", 1)
        add("job_failures", 1 if record.failed(rec) else 0)
        add("image_failures", 1 if rec.get("image_error") else 0)
        add("job_duration_seconds", float(rec.get("wall_seconds") or 0.0))
        add("pull_bytes", int(rec.get("pull_bytes") or 0))
        if rec.get("cache") == "miss":  # a hit's few ms are no pull
            add("pull_seconds", float(rec.get("pull_seconds") or 0.0))
        add("cache_hits", 1 if rec.get("cache") == "hit" else 0)
        add("cache_misses", 1 if rec.get("cache") == "miss" else 0)
        add("cache_staged", 1 if rec.get("cache") == "staged" else 0)

    return change


def add(key: str, n: float = 1) -> Callable[[dict[str, Any]], None]:
    """A node counter's change (cache_evictions, cache_evicted_bytes, gpu_drains)."""
    assert key in {k for k, _ in NODE_COUNTERS}

    def change(counters: dict[str, Any]) -> None:
        counters[key] = counters.get(key, 0) + n

    return change


def gpu_health(verdicts: Mapping[str, tuple[int, bool]]) -> Callable[[dict[str, Any]], None]:
    """Each checked GPU's last verdict: {uuid: (index, healthy)}."""

    def change(counters: dict[str, Any]) -> None:
        gpus = counters.setdefault("gpus", {})
        for uuid, (index, healthy) in verdicts.items():
            gpus[uuid] = {"index": index, "healthy": healthy}
        while len(gpus) > 64:  # a node's GPUs; never grows without bound
            gpus.pop(next(iter(gpus)))

    return change

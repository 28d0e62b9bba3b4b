"""The usage record: one JSON line per job per node, appended by the epilog.

Schema 1 (every key always present; ``null`` where unknown)::

    schema          1
    job_id          "123"           Slurm's, as strings
    array_job_id    "120" | null    array_task_id "3" | null
    user, uid       "alice", 1001   account, partition: "proj1", "gpu"
    node            "n1"
    image_asked     "tf-custom:2.0" the reference as the user wrote it
    image           "reg/library/tf-custom:2.0@sha256:..."  pinned (what ran)
    repository      "library/tf-custom"   the image's repository (metrics' label)
    runtime         "charliecloud"
    cache           "hit" | "staged" | "miss" | null (never readied on this node):
                    the node cache, a copy staged for the job, or the registry
    pull_seconds    4.2             pull_bytes  1048576 (0 on a hit)
    source          "harbor.example" | null    the registry or mirror that served it
    image_error     "..." | null    why the image could not be readied
    gpus            [{"uuid": "GPU-..." | null, "energy_j": 1234.5 | null}, ...]  the job's
                    GPUs on this node (uuid null: Slurm named it by index and no check ran)
    gpu_health      {"prolog": "ok" | "warn" | "drain" | null, "epilog": ...}
    start, end      "2026-12-03T17:00:00.000Z"  (the prolog's start, the epilog's)
    wall_seconds    3600.0
    state           "COMPLETED" | "FAILED" | "SIGNALED" | "UNKNOWN"  from Slurm's exit code
                    (UNKNOWN too for a job whose epilog never came, reclaimed by a
                    later one: hooks/vestigial.py; its end is then the reclaim's);
                    "REQUEUED": the prolog requeued the job, its slurmd having died
                    under it (hooks/orphan.py), and this try never ran
    exit_code       0 | null        signal  0 | null  (SLURM_JOB_EXIT_CODE2, "exit:signal";
                                    null, UNKNOWN: Slurm gave the epilog none)
    tf_workers      4 | null        workers in the largest TF_CONFIG a step got

A line is written with one ``write`` on a descriptor opened ``O_APPEND`` for that
line alone, so concurrent epilogs never interleave and logrotate may rename the file
(the next line makes a new one) or copy and truncate it (the next line lands at the
new end) at any time.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tfimage.agent.core.logtext import oneline

SCHEMA = 1
# No record is longer (strings from a job are cut well below it).
MAX_LINE = 16 << 10
FIELDS = (
    "schema", "job_id", "array_job_id", "array_task_id", "user", "uid", "account",
    "partition", "node", "image_asked", "image", "repository", "runtime", "cache",
    "pull_seconds", "pull_bytes", "source", "image_error", "gpus", "gpu_health", "start",
    "end", "wall_seconds", "state", "exit_code", "signal", "tf_workers",
)  # fmt: skip

CACHE_VALUES = ("hit", "staged", "miss")


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def exit_status(code2: str, raw: str = "") -> tuple[int, int] | None:
    """(exit code, signal) from Slurm's ``SLURM_JOB_EXIT_CODE2`` ("3:0"), else from the
    raw wait status ``SLURM_JOB_EXIT_CODE`` (768); None when neither parses (Slurm
    sets them only when it knows)."""
    left, sep, right = code2.partition(":")
    if sep and left.isdigit() and right.isdigit() and len(code2) < 12:
        return int(left), int(right)
    if raw.isdigit() and len(raw) < 12:
        status = int(raw)
        return (status >> 8) & 0xFF, status & 0x7F
    return None


def state_of(status: tuple[int, int] | None) -> str:
    if status is None:
        return "UNKNOWN"
    if status[1]:
        return "SIGNALED"
    return "FAILED" if status[0] else "COMPLETED"


def failed(rec: Mapping[str, Any]) -> bool:
    """A record of a failed job: a non-zero exit, a signal, or no image.  A job whose
    end Slurm did not report (UNKNOWN) is not counted as failed."""
    return rec.get("state") in ("FAILED", "SIGNALED") or bool(rec.get("image_error"))


def _text(v: object, limit: int = 256) -> str | None:
    """One line of at most ``limit`` ASCII characters (others escaped first), so that
    no field, whatever a job puts in it, grows past its share of MAX_LINE."""
    if v in (None, ""):
        return None
    return oneline(str(v).encode("ascii", "backslashreplace").decode("ascii"), limit)


def _num(v: object, kind: type[int] | type[float]) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return kind(v)


def build(
    slurm: Mapping[str, str],
    facts: Mapping[str, Any],
    *,
    end: float,
    gpus: list[dict[str, Any]],
    epilog_health: str | None,
) -> dict[str, Any]:
    """The record from what Slurm gave the epilog (``slurm``: job_id, user, uid,
    account, partition, node, array_job_id, array_task_id, exit, exit_raw,
    image_asked) and what the prolog and steps kept (jobfacts)."""
    status = exit_status(slurm.get("exit", ""), slurm.get("exit_raw", ""))
    start = _num(facts.get("prolog_start"), float)
    start = start if start is not None and 0 < start <= end else end
    uid = slurm.get("uid", "")
    rec: dict[str, Any] = {
        "schema": SCHEMA,
        "job_id": _text(slurm["job_id"], 20),
        # Slurm 22.05's epilog has no SLURM_ARRAY_*: then the steps' (jobfacts).
        "array_job_id": _text(slurm.get("array_job_id") or facts.get("array_job_id"), 20),
        "array_task_id": _text(slurm.get("array_task_id") or facts.get("array_task_id"), 20),
        "user": _text(slurm.get("user"), 64),
        "uid": int(uid) if uid.isdigit() and len(uid) < 11 else None,
        "account": _text(slurm.get("account"), 64),
        "partition": _text(slurm.get("partition"), 64),
        "node": _text(slurm.get("node"), 64),
        "image_asked": _text(slurm.get("image_asked") or facts.get("image_asked"), 1024),
        "image": _text(facts.get("image") or slurm.get("image"), 1024),
        "repository": _text(facts.get("repository"), 256),
        "runtime": _text(facts.get("runtime"), 32),
        "cache": facts.get("cache") if facts.get("cache") in CACHE_VALUES else None,
        "pull_seconds": round(_num(facts.get("pull_seconds"), float) or 0.0, 3),
        "pull_bytes": _num(facts.get("pull_bytes"), int) or 0,
        "source": _text(facts.get("source"), 256),
        "image_error": _text(facts.get("image_error"), 1000),
        "gpus": [
            {"uuid": _text(g.get("uuid"), 96), "energy_j": _num(g.get("energy_j"), float)}
            for g in gpus[:64]
        ],
        "gpu_health": {"prolog": _text(facts.get("gpu_prolog"), 16), "epilog": epilog_health},
        "start": iso(start),
        "end": iso(end),
        "wall_seconds": round(end - start, 3),
        "state": "REQUEUED" if facts.get("requeued") is True else state_of(status),
        "exit_code": status[0] if status else None,
        "signal": status[1] if status else None,
        "tf_workers": _num(facts.get("tf_workers"), int),
    }
    return rec


def line_of(rec: Mapping[str, Any]) -> bytes:
    line = json.dumps(rec, separators=(",", ":"), ensure_ascii=True) + "\n"
    data = line.encode()
    if len(data) > MAX_LINE:
        raise ValueError(f"usage record of {len(data)} bytes: over {MAX_LINE}")
    return data


def append(path: Path, rec: Mapping[str, Any]) -> None:
    """Append ``rec`` as one line: one ``write`` on a fresh ``O_APPEND`` descriptor
    (never through a link).  A short write (a full disk) raises; the report skips
    the torn line it leaves.  Should the file have been rotated away and deleted
    between the open and the write (logrotate compressing it), the line is written
    again to the new file: a record seen twice counts once in the report, a lost one
    never comes back."""
    data = line_of(rec)
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    for _ in range(2):
        fd = os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640
        )
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(28, f"{path}: short write ({written} of {len(data)} bytes)")
            if os.fstat(fd).st_nlink:
                return
        finally:
            os.close(fd)

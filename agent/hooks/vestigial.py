"""Jobs whose epilog never came, found by a later epilog on the node.

A slurmd killed (or restarted) as a job ends takes the job's Epilog with it, and
the slurmd that comes back answers slurmctld's resent TERMINATE_JOB without one
(22.05.8: the 2,000-task soak's job 1275 on n2, whose slurmd was killed a
millisecond after the job completed).  The job's image mounts, its holds and its
state would stay on the node for good, and its usage record would never be
written.  epilog/main.py reclaims what :func:`gone` names, after its own job:

1. candidates (:func:`candidates`): a job id with state under ``state_dir``
   (``usage/<job>.json``, ``jobs/<job>*``), not the epilog's own, untouched for
   GRACE_SECONDS, with no ``slurmstepd: [<job>.…]`` on this host.  A running job
   has its steps here (read from /proc: no Slurm call), so a busy node asks
   Slurm nothing;
2. if there is one, ``squeue -h -w NODE -o %A``: the jobs Slurm has on this node,
   one in its prolog or epilog, or allocated with no step yet (salloc), included;
3. a candidate Slurm does not list is gone.

Slurm not answering (within SQUEUE_TIMEOUT) reclaims nothing; the next epilog
asks again.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

from tfimage.agent.core import layout
from tfimage.agent.core.config import Config
from tfimage.agent.core.ids import check_node, valid_job_id
from tfimage.agent.core.toolrun import run, slurm_env, slurm_tool

GRACE_SECONDS = 30.0
SQUEUE_TIMEOUT = 10.0
_JOB_OF_NAME = re.compile(r"(\d{1,10})(?:\.|\Z)")
_STEPD = re.compile(rb"slurmstepd: \[(\d{1,10})[.\]]")


def _job_of(name: str) -> str | None:
    """The job a state entry's name is of (``<job>.json``, ``<job>``, ``<job>.<step>``)."""
    m = _JOB_OF_NAME.match(name)
    return m[1] if m and valid_job_id(m[1]) else None


def _newest(paths: Iterable[Path]) -> float:
    newest = 0.0
    for p in paths:
        try:
            newest = max(newest, p.lstat().st_mtime)
        except OSError:
            continue  # gone meanwhile: its own epilog is at it
    return newest


def _entries(state_dir: str) -> dict[str, list[Path]]:
    """Each job id with state here, and its entries."""
    found: dict[str, list[Path]] = {}
    for d in (layout.usage_dir(state_dir), layout.jobs_dir(state_dir)):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if job := _job_of(name):
                found.setdefault(job, []).append(d / name)
    return found


def stepd_jobs(proc: Path = Path("/proc")) -> set[str]:
    """The jobs with a slurmstepd on this host (its argv names ``[job.step]``)."""
    jobs: set[str] = set()
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            head = (proc / entry.name / "cmdline").read_bytes()[:64]
        except OSError:
            continue
        if m := _STEPD.match(head):
            jobs.add(m[1].decode())
    return jobs


def candidates(
    state_dir: str, own_job: str, *, now: float | None = None, proc: Path = Path("/proc")
) -> set[str]:
    """Jobs with state here that look over, before Slurm is asked (step 1 above)."""
    now = time.time() if now is None else now
    quiet = {
        job
        for job, paths in _entries(state_dir).items()
        if job != own_job and _newest(paths) < now - GRACE_SECONDS
    }
    return quiet - stepd_jobs(proc) if quiet else set()


def on_node(cfg: Config, node: str) -> set[str]:
    """The job ids Slurm has on ``node`` (raises when it does not answer)."""
    out = run(
        [slurm_tool("squeue", cfg.gpu.slurm_bin), "-h", "-w", check_node(node), "-o", "%A"],
        timeout=SQUEUE_TIMEOUT,
        what="squeue",
        env=slurm_env(),
    )
    return {line.strip() for line in out.splitlines() if valid_job_id(line.strip())}


def gone(cfg: Config, node: str, own_job: str) -> list[str]:
    """The jobs whose state is here and whose epilog never came, oldest id first."""
    maybe = candidates(cfg.state_dir, own_job)
    if not maybe or not node:
        return []
    return sorted(maybe - on_node(cfg, node), key=int)

"""A prolog whose slurmd died under it: the job's launch died with that slurmd.

The soak's finding (bench/soak, CI on 24.11; 22.05 the same): a slurmd killed, or
restarted, while a batch job's prolog runs is back in seconds, knows nothing of the
job, and Slurm keeps the job RUNNING with reason ``Prolog`` and no end.  Only a node
down past SlurmdTimeout, or rebooted, gets it requeued.  The prolog outlives its
slurmd (slurmd's unit kills the main process alone), so it is the one that knows: at
its end it asks slurmctld to requeue the job, which runs again, as after a node
failure.  Nothing else changes: the node is not drained, and the epilog that the
requeue brings records the try that never ran.

Its slurmd is the slurmd daemon among the hook's ancestors (``slurmd_of``: by its
name or program, Slurm's ``slurmd`` or Debian's ``slurmd-wlm``; above any launcher
of slurmd's own program): the prolog's own when run directly, or, in the node daemon's
worker, the hook client's (tfimage-hook, the worker's peer), so that a daemon
restarted under its worker is no slurmd's death.
A process is known by its pid and its start time, so a pid used again is not taken
for the slurmd that died.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import TfimageError, cause
from tfimage.agent.core.toolrun import run, slurm_env, slurm_tool

MAX_DEPTH = 8  # slurmd, a site's prolog script, the hook: a few generations at most
SCONTROL_TIMEOUT = 20.0
SLURMD_NAMES = ("slurmd", "slurmd-wlm")  # Slurm's own, Debian's (slurm-wlm)


@dataclass(frozen=True)
class Process:
    pid: int
    start: int  # clock ticks after boot (/proc/PID/stat's 22nd field)


_watched: Process | None = None
_in_worker = False


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(comm, ppid, start) of ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096).decode("ascii", "replace")
    except OSError:
        return None
    # comm is in parentheses and may hold anything, spaces and ")" too: split after
    # the last ")".
    head, _, rest = raw.rpartition(")")
    fields = rest.split()
    try:
        return head.partition("(")[2], int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def slurmd_of(pid: int) -> Process | None:
    """The slurmd daemon among ``pid``'s ancestors (None where there is none): the
    topmost of the nearest run of slurmd processes.  Slurm 23.11 and later run a
    prolog through a launcher, slurmd's own program started again between the
    daemon and the script, which lives as long as the script: that one never dies
    under the prolog, the daemon does."""
    found: Process | None = None
    for _ in range(MAX_DEPTH):
        st = _stat(pid)
        if st is None or st[1] <= 1:
            break
        parent = _stat(st[1])
        if parent is None:
            break
        if _is_slurmd(st[1], parent[0]):
            found = Process(st[1], parent[2])
        elif found is not None:
            break  # above the daemon
        pid = st[1]
    return found


def _is_slurmd(pid: int, comm: str) -> bool:
    """By its name, or by its program.  Debian installs the daemon as slurmd-wlm
    (``slurmd`` is an alternatives link): started as ``slurmd`` it is named so, but
    24.11's ``scontrol reconfigure`` re-executes it in place by its real path, and
    from then on it is ``slurmd-wlm``, by name and by program."""
    if comm in SLURMD_NAMES:
        return True
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return os.path.basename(exe.removesuffix(" (deleted)")) in SLURMD_NAMES


def watch_peer(peer_pid: int) -> None:
    """In the daemon's worker, before a hook runs: its slurmd is its client's."""
    global _watched, _in_worker
    _in_worker = True
    _watched = slurmd_of(peer_pid) if peer_pid > 0 else None


def slurmd() -> Process | None:
    """The slurmd this hook runs for, as found now (``watch_peer``'s in a worker)."""
    return _watched if _in_worker else slurmd_of(os.getpid())


def gone(p: Process) -> bool:
    """Whether the slurmd ``p`` is gone: its pid ended, or is another's (its start
    differs).  A slurmd that re-executed itself keeps both: it is not gone."""
    st = _stat(p.pid)
    return st is None or st[2] != p.start


_ID = re.compile(r"[0-9]{1,10}")


def alone(job_id: str, listed: str) -> str:
    """The name that ``scontrol requeue`` takes for job ``job_id`` alone, from
    ``squeue -h -j ID -o %A|%F|%K`` (job id, array job id, array task id): an
    array task's ``ARRAY_TASK``.  The task whose job id is its array's (the last
    one started, the array's own record) would be the whole array to slurmctld,
    which requeued every task of it, those running fine too (the soak on 24.11 in
    CI, 2026-12-07; `scontrol requeue` of that id on 22.05.8 the same).  Raises
    when squeue does not list the job."""
    for line in listed.splitlines():
        raw, _, rest = line.partition("|")
        if raw != job_id:
            continue  # squeue -j ARRAY_ID lists every task of the array
        array, _, task = rest.partition("|")
        if task == "N/A":
            return job_id
        if _ID.fullmatch(array) and _ID.fullmatch(task):
            return f"{array}_{task}"
        raise TfimageError(f"squeue: job {job_id}: array {array[:20]!r}, task {task[:20]!r}")
    raise TfimageError(f"squeue: job {job_id} is not listed")


def orphaned(parent: Process | None) -> bool:
    """Whether ``parent`` (the prolog's slurmd, found at its start) is gone."""
    return parent is not None and gone(parent)


def requeue(parent: Process, cfg: Config, job_id: str, log: logging.Logger) -> bool:
    """Ask slurmctld to requeue the job whose slurmd (``parent``) died under its
    prolog, and say so; whether Slurm took it."""
    try:
        listed = run(
            [slurm_tool("squeue", cfg.gpu.slurm_bin), "-h", "-j", job_id, "-o", "%A|%F|%K"],
            timeout=SCONTROL_TIMEOUT,
            what="squeue",
            env=slurm_env(),
        )
        argv = [slurm_tool("scontrol", cfg.gpu.slurm_bin), "requeue", alone(job_id, listed)]
        run(argv, timeout=SCONTROL_TIMEOUT, what="scontrol requeue", env=slurm_env())
    except TfimageError as e:
        log.error(
            "job %s: slurmd (pid %d) died under the prolog, and the requeue failed: %s; "
            "Slurm keeps the job in its prolog until an operator requeues or cancels it",
            job_id,
            parent.pid,
            cause(e),
        )
        return False
    log.warning(
        "job %s: slurmd (pid %d) died under the prolog, which its launch needed: "
        "requeued (scontrol requeue %s)",
        job_id,
        parent.pid,
        argv[-1],
    )
    return True

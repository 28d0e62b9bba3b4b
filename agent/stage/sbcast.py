"""The broadcast: one file from the controller to a configuring job's nodes, down
slurmd's tree (``sbcast``: fan-out up to 64 per hop, 8 MB blocks).

What each Slurm generation allows from ``PrologSlurmctld`` while the job configures
(tried on the local cluster; docs/developer.md keeps the table):

- 22.05: ``sbcast --jobid=J --force SRC DST`` reaches every node of the job, run as
  the job's owner alone: slurmd refuses root's request ("sbcast cred from 1001/1001
  but rpc from 0/0") and slurmctld refuses Slurm's user a credential for another's
  job.  slurmd writes the file as that user, with the source's mode.
- 24.11: the same, and ``--nodelist=L`` with ``--jobid`` reaches the nodes in ``L``
  alone.

So the broadcast runs as the job's user, with no other groups, and reads the image
through a descriptor root opened (``/dev/fd/N``): the user is given that one image's
bytes, which the controller checked they may run, and no path into the staging
cache.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tfimage.agent.core.errors import RuntimeSetupError
from tfimage.agent.core.toolrun import run, slurm_env, slurm_tool

# --nodelist came with 24.11; an older sbcast refuses the flag.
NODELIST_SINCE = (24, 11)
_VERSION = re.compile(r"slurm(?:-wlm)? (\d+)\.(\d+)")


def version(slurm_bin: str = "", *, timeout: float = 10.0) -> tuple[int, int] | None:
    """sbcast's Slurm generation, e.g. (24, 11); None when it says none (then the
    broadcast takes the form every generation knows)."""
    try:
        argv = [slurm_tool("sbcast", slurm_bin), "--version"]
        out = run(argv, timeout=timeout, what="stage: sbcast", env=slurm_env())
    except RuntimeSetupError:
        return None  # the broadcast itself will say what is wrong with sbcast
    m = _VERSION.search(out)
    return (int(m[1]), int(m[2])) if m else None


def reaches_some(generation: tuple[int, int] | None) -> bool:
    """Whether this generation's sbcast can send to some of a job's nodes alone."""
    return generation is not None and generation >= NODELIST_SINCE


def argv(
    job_id: str, fd: int, dst: str, *, nodes: Sequence[str] = (), slurm_bin: str = ""
) -> list[str]:
    """sbcast's command line for the open descriptor ``fd``: to ``nodes`` alone (only
    where :func:`reaches_some`), else (empty) to every node of the job."""
    out = [slurm_tool("sbcast", slurm_bin), f"--jobid={job_id}", "--force"]
    if nodes:
        out.append("--nodelist=" + ",".join(nodes))
    return [*out, f"/dev/fd/{fd}", dst]


def broadcast(cmd: Sequence[str], fd: int, timeout: float, owner: tuple[int, int]) -> None:
    """Run ``cmd`` (from :func:`argv`) as the job's ``owner`` (uid, gid), with ``fd``
    its only inherited descriptor.  A refusal or the deadline raises, with sbcast's
    own last line."""
    run(cmd, timeout=timeout, what="stage: sbcast", env=slurm_env(), as_user=owner,
        pass_fds=(fd,))  # fmt: skip

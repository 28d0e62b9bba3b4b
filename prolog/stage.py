"""PrologSlurmctld: for every ``--tf-image`` job, its pinned image into its
AdminComment (``record_digest``: stage/admincomment.py); for a multi-node one, one
pull on the controller and a broadcast down Slurm's tree to the nodes that lack the
image (``stage``: agent/stage/).

It runs on the controller while the job configures, before any node's prolog, as
root: directly where Slurm's user is root, else through the controller's daemon
(the role's front, ``tfimage-stage``).  It always exits 0: slurmctld requeues a
batch job and cancels an srun whose PrologSlurmctld fails, and nothing here is worth
a job.  When it cannot stage the image (the registry, the disk, sbcast,
stage_deadline) it says why in one log line and each node pulls for itself, as
without it.

Arguments come as ``--image=VALUE`` (hooks/args.py, from the wire's table); run
without them, each is read from Slurm's variable for it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tfimage.agent.core import wire
from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.errors import TfimageError, cause
from tfimage.agent.core.ids import valid_job_id
from tfimage.agent.core.logtext import oneline
from tfimage.agent.hooks.args import parse_hook_args
from tfimage.agent.hooks.log import LOG_FILE, guarded, hook_logger, log_to

NAME = "stage"


def main(argv: Sequence[str] | None = None) -> int:
    log = hook_logger(NAME, log_file=None)
    guarded(log, NAME, lambda: _stage(argv, log))
    return 0  # never a reason for Slurm to requeue or cancel the job


def _stage(argv: Sequence[str] | None, log: logging.Logger) -> int:
    args = parse_hook_args(wire.STAGE_HOOK, __doc__, argv)
    if not args.image:
        return 0  # not a tfimage job
    if not valid_job_id(args.job_id):
        log.error("no valid SLURM_JOB_ID (%s); skipping", oneline(repr(args.job_id), 40))
        return 0
    try:
        cfg = load_config(args.config)
    except TfimageError:
        log_to(LOG_FILE, NAME)
        raise
    log_to(Path(cfg.hook_log), NAME)
    if cfg.record_digest:
        _record(cfg, args.job_id, args.image, log)
    if not cfg.stage or (Path(args.config).parent / wire.STAGE_OFF_SWITCH).exists():
        return 0
    if os.geteuid() != 0:
        log.error(
            "job %s: stage: runs as uid %d, not root: the controller's daemon does not "
            "answer on its stage socket; each node pulls for itself",
            args.job_id,
            os.geteuid(),
        )
        return 0
    owner = _owner(args.uid, args.gid)
    if owner is None:
        log.error("job %s: stage: no valid SLURM_JOB_UID/GID; each node pulls", args.job_id)
        return 0
    from tfimage.agent.stage.job import stage  # a job that stops above loads none of it

    outcome = stage(
        cfg, args.job_id, args.image, args.nodes, owner,
        partition=args.partition, asked=args.image_asked,
    )  # fmt: skip
    if outcome.held or outcome.nodes == 1:
        return 0  # a warm job or a one-node one: a line for each would say nothing new
    line = outcome.line(args.job_id, oneline(args.image, 200))
    (log.error if outcome.failed else log.info)("%s", line)
    return 0


def _record(cfg: Config, job_id: str, image: str, log: logging.Logger) -> None:
    """The digest into the job's AdminComment; a failure is one line, and the job
    runs on (its usage record names the digest all the same)."""
    from tfimage.agent.stage import admincomment

    try:
        ref = admincomment.pinned(cfg, image)
        admincomment.record(job_id, ref, slurm_bin=cfg.gpu.slurm_bin)
    except (TfimageError, OSError) as e:
        log.error("job %s: AdminComment: %s; the job runs without it", job_id, cause(e))
        return
    log.info("job %s: AdminComment: %s", job_id, oneline(admincomment.word(ref), 300))


def _owner(uid: str, gid: str) -> tuple[int, int] | None:
    if not (uid.isdigit() and gid.isdigit() and len(uid) < 11 and len(gid) < 11):
        return None
    return int(uid), int(gid)


if __name__ == "__main__":
    sys.exit(main())

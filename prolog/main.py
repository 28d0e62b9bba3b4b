"""Prolog: check the job's GPUs, then pull the job's image into the node cache.

Exit status matters here: Slurm drains a node whose Prolog fails.  An image
problem is never the node's fault, so it is logged and the prolog exits 0; the
step that needs the image then fails with the reason on the user's stderr.  Every
other exception too (hooks/log.py's guarded): only a fault of the node may drain it.  That
one is a GPU fault (agent/gpu/gate.py): the prolog drains the node with a
``tfimage:`` reason and exits 1, and Slurm requeues the job (held, unless the site
sets ``SchedulerParameters=nohold_on_prolog_fail``).

Arguments come as ``--image=VALUE``, never ``--image VALUE`` (hooks/args.py, from
the wire's table).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tfimage.agent.cache.store import STAGED_SOURCE as STAGED
from tfimage.agent.core import layout
from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.deadline import deadline
from tfimage.agent.core.errors import InputError, NodeFault, PolicyError, TfimageError, cause
from tfimage.agent.core.fsutil import write_atomic
from tfimage.agent.core.hostlist import expand_hostlist
from tfimage.agent.core.ids import check_node, valid_job_id
from tfimage.agent.core.logtext import oneline
from tfimage.agent.core.partition import default_image, rules_for
from tfimage.agent.gpu.alloc import parse_gpus
from tfimage.agent.gpu.gate import health, prolog_gate
from tfimage.agent.hooks import orphan
from tfimage.agent.hooks.args import parse_hook_args
from tfimage.agent.hooks.log import LOG_FILE, guarded, hook_logger, log_to
from tfimage.agent.step.imagemount import make_jobs_dir
from tfimage.agent.step.plan import prepare_job
from tfimage.agent.usage import jobfacts


def main(argv: Sequence[str] | None = None) -> int:
    log = hook_logger("prolog", log_file=None)
    return guarded(log, "prolog", lambda: _prolog(argv, log))


def _prolog(argv: Sequence[str] | None, log: logging.Logger) -> int:
    started = time.time()
    args = parse_hook_args("tfimage-prolog", __doc__, argv)
    image = args.image
    job_id = args.job_id
    if not image and not args.gpus and not args.partition:
        return 0  # neither a tfimage job nor a GPU job: nothing to do
    if not valid_job_id(job_id):
        log.error("no valid SLURM_JOB_ID (%s); skipping", oneline(repr(job_id), 40))
        return 0
    try:
        cfg = load_config(args.config)
    except TfimageError:
        log_to(LOG_FILE, "prolog")  # no config to name another
        raise
    log_to(Path(cfg.hook_log), "prolog")
    slurmd = orphan.slurmd()  # the launch's: if it dies under us, the job is requeued
    try:
        return _ready(cfg, args, image, started, log)
    finally:
        if slurmd is not None and orphan.orphaned(slurmd):
            # Noted first: the requeue brings the epilog, which records this try.
            note = _Facts(cfg, job_id, log)
            note(requeued=True)
            if not orphan.requeue(slurmd, cfg, job_id, log):
                note(requeued=False)


def _ready(
    cfg: Config, args: argparse.Namespace, image: str, started: float, log: logging.Logger
) -> int:
    """The job's GPUs checked and its image ready on this node."""
    job_id = args.job_id
    asked = args.image_asked
    if not image and cfg.partitions:
        image = _default(cfg, job_id, args.partition, log)
        asked = image
    if not image and not args.gpus:
        return 0
    note = _Facts(cfg, job_id, log)
    if image:  # first, so that a prolog killed halfway still leaves the job's start
        note(prolog_start=started, runtime=cfg.runtime)
    if args.gpus and cfg.gpu.checks and (image or cfg.gpu.all_jobs):
        verdict = _gpu_gate(cfg, job_id, args, log, note)  # a GPU fault: NodeFault, exit 1
        if image and verdict:
            note(gpu_prolog=verdict)
    if not image:
        return 0

    try:
        with deadline(cfg.hook_deadline, "prolog"):
            uid = int(args.uid) if args.uid.isdigit() and len(args.uid) < 11 else None
            got = prepare_job(
                cfg.on_node(args.node) if args.node else cfg,
                job_id,
                image,
                uid=uid,
                partition=args.partition,
                asked=asked,
                jitter=cfg.pull_jitter if _many_nodes(args.nodes) else 0.0,
            )
        note(
            image=str(got.ref),
            repository=got.ref.repository,
            cache="hit" if got.hit else "staged" if got.source == STAGED else "miss",
            pull_seconds=round(got.seconds, 3),
            pull_bytes=got.size if not got.hit and got.source != STAGED else 0,
            source=got.source,
        )
        if got.refused:
            log.warning("job %s: %s", job_id, got.refused)
        log.info(
            "job %s: %s %s in %.2f s",
            job_id,
            got.ref,
            "cache hit"
            if got.hit
            else "adopted the copy staged for the job"
            if got.source == STAGED
            else f"pulled from {got.source}",
            got.seconds,
        )
    except Exception as e:  # recorded for the job's steps by prepare_job
        log.error("job %s: image %s: %s", job_id, oneline(image), cause(e))
        note(image_error=cause(e), repository=_repository(cfg, image))
    return 0


def _many_nodes(nodes: str) -> bool:
    """Whether the job's hostlist names more than one node (unreadable: assume so)."""
    if not nodes:
        return False
    try:
        return len(expand_hostlist(nodes, 2)) > 1
    except TfimageError:
        return True


def _default(cfg: Config, job_id: str, partition: str, log: logging.Logger) -> str:
    """The partition's default image for a job that named none (core/partition.py),
    written where the job's steps look for it (layout.job_default_image) before it is
    readied: a step of a job whose default failed fails with the prolog's reason,
    never runs on the host instead.  "" for none."""
    try:
        image = default_image(rules_for(cfg.partitions, partition), partition)
    except PolicyError as e:
        log.error("job %s: no default image: %s", job_id, cause(e))
        return ""
    if image:
        make_jobs_dir(cfg.state_dir)
        path = layout.job_default_image(cfg.state_dir, job_id)
        write_atomic(path, (image + "\n").encode(), mode=0o644)
        log.info("job %s: no --tf-image; partition %s's default %s", job_id, partition, image)
    return image


class _Facts:
    """The job's facts for its usage record (the epilog's): never a reason to fail the
    job, and a failure to keep them is said once, not at every fact."""

    def __init__(self, cfg: Config, job_id: str, log: logging.Logger) -> None:
        self.cfg, self.job_id, self.log, self.broken = cfg, job_id, log, False

    def __call__(self, **facts: object) -> None:
        if self.broken:
            return
        try:
            jobfacts.note(self.cfg.state_dir, self.job_id, **facts)
        except Exception as e:
            self.broken = True
            self.log.error("job %s: usage: not kept: %s", self.job_id, cause(e))


def _repository(cfg: Config, image: str) -> str | None:
    try:
        return cfg.reference(image).repository
    except TfimageError:
        return None


def _gpu_gate(
    cfg: Config, job_id: str, args: argparse.Namespace, log: logging.Logger, note: _Facts
) -> str | None:
    """The gate's verdict (ok or warn); None when it did not judge."""
    try:
        alloc = parse_gpus(args.gpus)
        node = check_node(args.node)
    except InputError as e:  # Slurm's own values: a bug or a new format, not a fault
        log.error("job %s: gpu: not checked: %s", job_id, e)
        return None
    if not alloc:
        return None
    try:
        return health(prolog_gate(cfg, job_id, node, alloc, shared=bool(args.mps)))
    except NodeFault:
        if args.image:
            note(gpu_prolog="drain")
        raise
    except Exception as e:  # the gate's own trouble (a full /run): the image still comes
        log.error("job %s: gpu: not checked: %s", job_id, cause(e))
        return None


if __name__ == "__main__":
    sys.exit(main())

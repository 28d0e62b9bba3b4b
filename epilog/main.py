"""Epilog: unmount and remove what the job's steps used on this node.

Cleanup problems are logged, never fatal: a failing Epilog would drain the node
(hooklog.guarded turns every exception into one log line and exit 0).  Arguments
come as ``--job=VALUE`` (see the prolog).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tfimage.agent.cache.store import ImageCache
from tfimage.agent.config import DEFAULT_PATH, load_config
from tfimage.agent.errors import TfimageError
from tfimage.agent.gpu.gate import drop_baseline
from tfimage.agent.hooklog import LOG_FILE, guarded, hook_logger, log_to
from tfimage.agent.ids import valid_job_id
from tfimage.agent.step.imagemount import release_job


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tfimage-epilog", description=__doc__)
    p.add_argument("--config", default=str(DEFAULT_PATH))
    # Given explicitly when run through the node daemon (tfimage-hook).
    p.add_argument("--job", default=os.environ.get("SLURM_JOB_ID", ""))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    log = hook_logger("epilog", log_file=None)
    return guarded(log, "epilog", lambda: _epilog(argv, log))


def _epilog(argv: Sequence[str] | None, log: logging.Logger) -> int:
    args = _parser().parse_args(argv)
    job_id = args.job
    if not valid_job_id(job_id):
        return 0
    try:
        cfg = load_config(args.config)
    except TfimageError:
        log_to(LOG_FILE, "epilog")
        raise
    log_to(Path(cfg.hook_log), "epilog")
    stuck: list[str] = []
    # Each part runs whatever the other did: a hold the epilog leaves is an image
    # nobody may evict until the next reclaim, a mount left is a mount leaked.
    for part, run in (
        ("unmounting", lambda: stuck.extend(release_job(cfg.state_dir, job_id))),
        ("releasing its images", lambda: ImageCache(cfg).release(job_id)),
        ("dropping its GPU baseline", lambda: drop_baseline(cfg.state_dir, job_id)),
    ):
        try:
            run()
        except Exception as e:
            cause = str(e) if isinstance(e, TfimageError) else f"{type(e).__name__}: {e}"
            log.error("job %s: cleanup: %s: %s", job_id, part, cause)
    for target in stuck:
        log.error("job %s: %s was busy; detached it lazily", job_id, target)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Epilog: unmount and remove what the job's steps used on this node.

Cleanup problems are logged, never fatal: a failing Epilog would drain the node.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from tfimage.agent.cache import ImageCache
from tfimage.agent.config import DEFAULT_PATH, load_config
from tfimage.agent.errors import TfimageError
from tfimage.agent.hooklog import hook_logger
from tfimage.agent.mounts import release_job

_JOB = re.compile(r"[0-9]{1,10}\Z")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tfimage-epilog", description=__doc__)
    p.add_argument("--config", default=str(DEFAULT_PATH))
    # Given explicitly when run through the node daemon (tfimage-hook).
    p.add_argument("--job", default=os.environ.get("SLURM_JOB_ID", ""))
    args = p.parse_args(argv)
    log = hook_logger("epilog")
    job_id = args.job
    if not _JOB.match(job_id):
        return 0
    try:
        cfg = load_config(args.config)
        stuck = release_job(cfg.state_dir, job_id)
        ImageCache(cfg).release(job_id)
    except TfimageError as e:
        log.error("job %s: cleanup: %s", job_id, e)
        return 0
    for target in stuck:
        log.error("job %s: %s was busy; detached it lazily", job_id, target)
    return 0


if __name__ == "__main__":
    sys.exit(main())

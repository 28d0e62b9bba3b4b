"""Prolog: pull the job's image into the node cache and mount it.

Exit status matters here: Slurm drains a node whose Prolog fails.  An image
problem is never the node's fault, so it is logged and the prolog exits 0; the
step that needs the image then fails with the reason on the user's stderr.  Every
other exception too (hooklog.guarded): only a fault of the node may drain it.

Arguments come as ``--image=VALUE``, never ``--image VALUE``: the value is the
job's (any user can submit a job with a control environment of their choosing
through Slurm's API), and one starting with ``-`` must stay a value.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tfimage.agent.config import DEFAULT_PATH, load_config
from tfimage.agent.deadline import deadline
from tfimage.agent.errors import TfimageError
from tfimage.agent.hooklog import LOG_FILE, guarded, hook_logger, log_to
from tfimage.agent.ids import valid_job_id
from tfimage.agent.logtext import oneline
from tfimage.agent.step.plan import prepare_job


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tfimage-prolog", description=__doc__)
    p.add_argument("--config", default=str(DEFAULT_PATH))
    # Given explicitly when run through the node daemon (tfimage-hook).
    p.add_argument("--job", default=os.environ.get("SLURM_JOB_ID", ""))
    p.add_argument("--image", default=os.environ.get("SPANK_TFIMAGE_IMAGE", ""))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    log = hook_logger("prolog", log_file=None)
    return guarded(log, "prolog", lambda: _prolog(argv, log))


def _prolog(argv: Sequence[str] | None, log: logging.Logger) -> int:
    args = _parser().parse_args(argv)
    image = args.image
    job_id = args.job
    if not image:
        return 0  # not a tfimage job: nothing to do
    if not valid_job_id(job_id):
        log.error("no valid SLURM_JOB_ID (%s); skipping", oneline(repr(job_id), 40))
        return 0
    try:
        cfg = load_config(args.config)
    except TfimageError:
        log_to(LOG_FILE, "prolog")  # no config to name another
        raise
    log_to(Path(cfg.hook_log), "prolog")

    try:
        with deadline(cfg.hook_deadline, "prolog"):
            got = prepare_job(cfg, job_id, image)
        log.info(
            "job %s: %s %s in %.2f s",
            job_id,
            got.ref,
            "cache hit" if got.hit else f"pulled from {got.source}",
            got.seconds,
        )
    except Exception as e:  # recorded for the job's steps by prepare_job
        log.error("job %s: image %s: %s", job_id, oneline(image), _cause(e))
    return 0


def _cause(e: BaseException) -> str:
    return str(e) if isinstance(e, TfimageError) else f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    sys.exit(main())

"""Prolog: pull the job's image into the node cache and mount it.

Exit status matters here: Slurm drains a node whose Prolog fails.  An image
problem is never the node's fault, so it is logged and the prolog exits 0; the
step that needs the image then fails with the reason on the user's stderr.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from tfimage.agent.config import DEFAULT_PATH, load_config
from tfimage.agent.errors import TfimageError
from tfimage.agent.hooklog import hook_logger
from tfimage.agent.step import prepare_job

_JOB = re.compile(r"[0-9]{1,10}\Z")


class _DeadlineError(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise _DeadlineError


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tfimage-prolog", description=__doc__)
    p.add_argument("--config", default=str(DEFAULT_PATH))
    # Given explicitly when run through the node daemon (tfimage-hook).
    p.add_argument("--job", default=os.environ.get("SLURM_JOB_ID", ""))
    p.add_argument("--image", default=os.environ.get("SPANK_TFIMAGE_IMAGE", ""))
    args = p.parse_args(argv)
    log = hook_logger("prolog")

    image = args.image
    job_id = args.job
    if not image:
        return 0  # not a tfimage job: nothing to do
    if not _JOB.match(job_id):
        log.error("no valid SLURM_JOB_ID; skipping")
        return 0
    try:
        cfg = load_config(args.config)
    except TfimageError as e:
        log.error("job %s: %s", job_id, e)
        return 0
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, int(cfg.hook_deadline)))
    try:
        got = prepare_job(cfg, job_id, image)
        log.info(
            "job %s: %s %s in %.2f s",
            job_id,
            got.ref,
            "cache hit" if got.hit else f"pulled from {got.source}",
            got.seconds,
        )
    except TfimageError as e:
        log.error("job %s: image %s: %s", job_id, image[:200], e)
    except _DeadlineError:
        log.error("job %s: image %s: gave up after %.0f s", job_id, image[:200], cfg.hook_deadline)
    finally:
        signal.alarm(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())

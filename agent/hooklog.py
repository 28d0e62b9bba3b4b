"""Logging for the root-side hooks: one line per event, to stderr and a log file.

Messages never carry credentials; they carry job id, phase and cause.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOG_FILE = Path("/var/log/tfimage/hooks.log")


def hook_logger(name: str, log_file: Path = LOG_FILE) -> logging.Logger:
    log = logging.getLogger(f"tfimage.{name}")
    if log.handlers:
        return log
    log.setLevel(logging.INFO)
    log.propagate = False
    fmt = logging.Formatter(f"%(asctime)s tfimage-{name}: %(message)s")
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(fmt)
    log.addHandler(err)
    try:
        log_file.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fh = logging.FileHandler(log_file)
        fh.setFormatter(fmt)
        log.addHandler(fh)
    except OSError:
        pass  # a read-only /var/log must not fail a job
    return log

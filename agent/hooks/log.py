"""The node hooks' logging and their one rule: a hook never fails a node for tfimage.

Slurm drains a node whose Prolog or Epilog exits non-zero.  An image, a registry or a
job is never the node's fault, so :func:`guarded` turns every exception (a bug, a
full filesystem, a hostile input, argparse's usage error, SIGTERM) into one log line
and exit 0.  The one exception is :class:`~tfimage.agent.core.errors.NodeFault`: a fault
of the node's own hardware, for which draining is the point.

One line per event, to stderr (slurmd's log, or the daemon's answer) and to the hook
log file; user-controlled text is escaped to one line (logtext.py), and messages
never carry credentials: they carry job id, phase and cause.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from tfimage.agent.core.errors import NodeFault, TfimageError
from tfimage.agent.core.logtext import oneline

LOG_FILE = Path("/var/log/tfimage/hooks.log")
# Above any line a hook writes; what a log shipper takes as one record.
MAX_LINE = 2000


class _OneLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return oneline(super().format(record), MAX_LINE)


def hook_logger(name: str, log_file: Path | None = LOG_FILE) -> logging.Logger:
    """``tfimage.<name>``, writing through the ``tfimage`` logger (so the library's
    warnings, e.g. a converted image's dropped variables, reach the same log).  Set
    afresh for each hook run: a process (a daemon's worker) runs one hook."""
    top = logging.getLogger("tfimage")
    for h in list(top.handlers):
        top.removeHandler(h)
        h.close()
    top.setLevel(logging.INFO)
    top.propagate = False
    err = logging.StreamHandler(sys.stderr)
    err.setFormatter(_OneLine(f"%(asctime)s tfimage-{name}: %(message)s"))
    top.addHandler(err)
    if log_file is not None:
        log_to(log_file, name)
    return logging.getLogger(f"tfimage.{name}")


def log_to(log_file: Path, name: str) -> None:
    """Add ``log_file`` to the hook's log (once; a read-only /var/log fails no job)."""
    top = logging.getLogger("tfimage")
    for h in top.handlers:
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == log_file:
            return
    try:
        log_file.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fh = logging.FileHandler(log_file)
    except OSError:
        return
    fh.setFormatter(_OneLine(f"%(asctime)s tfimage-{name}: %(message)s"))
    top.addHandler(fh)


class Terminated(BaseException):  # a signal, not an error: like KeyboardInterrupt
    """SIGTERM reached a hook."""


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def guarded(log: logging.Logger, what: str, body: Callable[[], int]) -> int:
    """Run a hook's ``body``: its status when it returns, the fault's for a
    :class:`NodeFault`, and 0 with one log line for anything else."""
    try:
        old = signal.signal(signal.SIGTERM, _terminated)
    except ValueError:  # not the main thread (a test's): no handler to install
        old = None
    try:
        return body()
    except NodeFault as e:
        log.error("%s: %s", what, e)
        return e.exit_code
    except TfimageError as e:
        log.error("%s: %s", what, e)
    except SystemExit as e:  # argparse: its usage line went to stderr already
        if e.code not in (0, None):
            log.error("%s: bad arguments (exit %s); nothing done", what, e.code)
    except Terminated:
        log.error("%s: terminated (SIGTERM); nothing more done", what)
    except BaseException as e:  # a bug, a full disk, a hostile input: never the node's fault
        log.error("%s: %s: %s", what, type(e).__name__, e)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return 0

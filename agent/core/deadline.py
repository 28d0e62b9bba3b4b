"""One deadline for a hook's or a step's work, enforced in-process with SIGALRM.

A pull that trickles (a byte every few seconds, each read inside ``read_timeout``)
would otherwise run for as long as the registry likes.  The alarm interrupts any
blocking call (PEP 475 retries a call only when the handler returns), and a tool
run through ``proc.run`` is killed on the way out (subprocess.run kills its child
on any exception).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

from tfimage.agent.core.errors import DeadlineExceeded


@contextlib.contextmanager
def deadline(seconds: float, what: str, setting: str = "hook_deadline") -> Iterator[None]:
    """Raise :class:`DeadlineExceeded` ("WHAT: gave up after N s (SETTING)") in the
    block once ``seconds`` have passed.  Main thread only (signals)."""

    def expired(signum: int, frame: FrameType | None) -> None:
        raise DeadlineExceeded(f"{what}: gave up after {seconds:.0f} s ({setting})")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)

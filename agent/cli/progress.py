"""A pull's progress bar: on stderr, and only when stderr is a terminal."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    def __init__(self) -> None:
        self.on = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, got: int, total: int) -> None:
        now = time.monotonic()
        if not self.on or (now - self.last < 0.1 and got < total):
            return
        self.last = now
        frac = got / total if total else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r[{bar:<30}] {frac:6.1%} {got >> 20}/{total >> 20} MiB")
        if got >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

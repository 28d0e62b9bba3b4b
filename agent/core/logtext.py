"""Text from a job, an image or a registry, made safe for one log line.

A reference, a path or a registry's answer may hold a newline, a carriage return or
an escape sequence: written as is, it would forge log lines (or a terminal's).  So
such text goes through :func:`oneline` before it reaches a log or a message.
"""

from __future__ import annotations

LIMIT = 200


def oneline(text: object, limit: int = LIMIT) -> str:
    """``text`` on one line: control characters escaped as ``\\n``, ``\\x1b``...,
    cut to ``limit`` characters with ``...``."""
    s = str(text)
    if not s.isprintable():
        s = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in s)
    return s if len(s) <= limit else s[: max(0, limit - 3)] + "..."

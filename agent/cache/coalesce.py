"""One tag resolution for the requests on a node that ask for the same tag at once.

Sixteen ``tfimage cache pull tf-custom:2.0`` started together would each open a TLS
connection and ask the registry for the tag (and, at 2 cores, spend on that the CPU
the one download needs).  Here they take the tag's lock in turn: the first asks the
registry and leaves the answer in the lock file; each one after it uses that answer
if it was asked for **after its own request began**.  An answer so shared is one the
waiter could have got itself at some moment of its own request, so sharing never
hands out a tag older than asking would: a pull started after the tag moved always
asks again.

The answer is a digest, or "unreachable": a registry that is down is tried once per
group, not once per waiter in turn (each would wait out its own timeouts).  Other
errors are not shared; the next waiter asks itself.

Times are ``CLOCK_MONOTONIC`` (one clock for every process of a host) with the boot
it belongs to, so an answer left from before a reboot never looks new.

A tag's lock file (``locks/tag-<sha256 of the name>.lock``, core/layout.py) holds
the last answer (JSON).  Root only, like the rest of the cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from tfimage.agent.core import layout
from tfimage.agent.core.errors import RegistryUnreachable
from tfimage.agent.core.fsutil import held
from tfimage.agent.core.ids import valid_digest

MAX_LOCK_FILE = 4096

_boot: str | None = None


def _boot_id() -> str:
    global _boot
    if _boot is None:
        try:
            _boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            _boot = ""
    return _boot


def resolve_tag(cache_dir: Path, name: str, started: float, resolve: Callable[[], str]) -> str:
    """The digest the tag ``name`` (``host/repository:tag``) names: from ``resolve()``
    or, when another request asked the registry after ``started`` (``time.monotonic()``
    at this request's start), from its answer.  Raises ``resolve``'s errors, and
    RegistryUnreachable when the shared answer is that the registry is down."""
    with held(layout.cache_tag_lock(cache_dir, name)) as fd:
        shared = _read(fd, name, started)
        if shared is not None:
            if shared.get("unreachable"):
                raise RegistryUnreachable(str(shared["unreachable"]))
            return str(shared["digest"])
        asked = time.monotonic()
        try:
            digest = resolve()
        except RegistryUnreachable as e:
            _write(fd, {"name": name, "boot": _boot_id(), "asked": asked, "unreachable": str(e)})
            raise
        _write(fd, {"name": name, "boot": _boot_id(), "asked": asked, "digest": digest})
        return digest


def _read(fd: int, name: str, started: float) -> dict[str, object] | None:
    """The answer in the lock file, if it answers ``name`` and was asked for after
    ``started`` in this boot; anything else (empty, garbage, older) is None."""
    try:
        answer = json.loads(os.pread(fd, MAX_LOCK_FILE, 0))
    except (OSError, ValueError):
        return None
    if not isinstance(answer, dict) or answer.get("name") != name:
        return None
    if answer.get("boot") != _boot_id() or not _boot_id():
        return None
    asked = answer.get("asked")
    if not isinstance(asked, float) or asked < started:
        return None
    digest = answer.get("digest")
    if isinstance(digest, str) and valid_digest(digest):
        return answer
    return answer if isinstance(answer.get("unreachable"), str) else None


def _write(fd: int, answer: dict[str, object]) -> None:
    data = json.dumps(answer).encode()
    with contextlib.suppress(OSError):  # a answer not kept costs the next waiter one request
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

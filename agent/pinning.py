"""Pinning at submit: a tag becomes the digest it names now, so every node of the job
runs the same bytes however the tag moves while the job waits.

When the registry does not answer, the last digest this host saw for the tag is used
(with a warning).  Those are kept per user, in ``~/.cache/tfimage/last-seen.json``,
since submission runs as the user.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tfimage.agent.config import Config
from tfimage.agent.errors import ReferenceError, RegistryError, RegistryUnreachable
from tfimage.agent.reference import Reference

if TYPE_CHECKING:
    from tfimage.agent.registry import RegistryClient

MAX_REMEMBERED = 1000


def last_seen_file() -> Path:
    home = Path(pwd.getpwuid(os.geteuid()).pw_dir)
    return home / ".cache" / "tfimage" / "last-seen.json"


def _load(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}


def _save(path: Path, data: dict[str, str]) -> None:
    with contextlib.suppress(OSError):  # a read-only home must not block a submission
        path.parent.mkdir(parents=True, exist_ok=True)
        keep = dict(list(data.items())[-MAX_REMEMBERED:])
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".last-seen.")
        with os.fdopen(fd, "w") as f:
            json.dump(keep, f)
        os.replace(tmp, path)


def _first_answer(
    cfg: Config, ref: Reference, client_factory: Callable[[str], RegistryClient]
) -> str:
    """The tag's digest from the first of the registry and its mirrors that answers."""
    last: RegistryUnreachable | None = None
    for host in cfg.sources(ref):
        try:
            return client_factory(host).manifest(ref.repository, ref.version).digest
        except RegistryUnreachable as e:
            last = e
    assert last is not None
    raise last


def pin(
    cfg: Config,
    ref: Reference,
    client_factory: Callable[[str], RegistryClient] | None = None,
    store: Path | None = None,
    job_image: str | None = None,
) -> tuple[Reference, str | None]:
    """Return ``ref`` pinned to a digest, and a warning for the user if any.

    ``job_image`` is the pinned image of the job this submission runs in (an srun
    inside an sbatch script): the same tag keeps the job's digest, so every step of
    a job runs the bytes pinned when the job was submitted.
    """
    if ref.digest:
        return ref, None
    if job_image:
        with contextlib.suppress(ReferenceError):
            job_ref = cfg.reference(job_image)
            if job_ref.digest and job_ref.unpinned == ref:
                return job_ref, None
    if client_factory is None:
        from tfimage.agent.cache import client_for

        def client_factory(host: str) -> RegistryClient:
            return client_for(cfg, host, light=True)  # on srun's path: no requests

    store = store or last_seen_file()
    key = str(ref.unpinned)
    try:
        digest = _first_answer(cfg, ref, client_factory)
    except RegistryUnreachable as e:
        known = _load(store).get(key)
        if not known:
            raise RegistryError(
                f"cannot pin {key}: {e}, and this host has never seen that tag"
            ) from None
        return ref.pinned(known), (
            f"warning: {e}; using the last digest this host saw for {key}: {known}"
        )
    seen = _load(store)
    seen.pop(key, None)
    seen[key] = digest
    _save(store, seen)
    return ref.pinned(digest), None

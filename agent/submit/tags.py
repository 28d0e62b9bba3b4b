"""``tfimage tags REPO``: the tags of a repository that the caller may run, from the
registry, with the caller's own credentials, as a submission would see them.

A repository the site's ``access:`` rules keep from the caller is answered exactly
as one that does not exist (pin.refuse_unseen, as at submit): a refused user learns
nothing of what a private project holds.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import ImageNotFound, InputError
from tfimage.agent.core.reference import Reference
from tfimage.agent.submit import suggest
from tfimage.agent.submit.pin import refuse_unseen, user_clients

if TYPE_CHECKING:
    from tfimage.agent.registry.client import RegistryClient


def repository(cfg: Config, text: str) -> Reference:
    """``text`` as a repository: a name as ``--tf-image`` takes it, without a tag."""
    last = text.rsplit("/", 1)[-1]
    if "@" in last or ":" in last:
        raise InputError(f"{text}: give a repository without a tag or digest, e.g. tf-custom")
    return cfg.reference(text)


def tags(
    cfg: Config,
    text: str,
    uid: int | None = None,
    client_factory: Callable[[str], RegistryClient] | None = None,
) -> tuple[Reference, list[str]]:
    """The repository ``text`` names, and its tags sorted (the registry's first five
    pages of them: client.tags)."""
    ref = repository(cfg, text)
    refuse_unseen(cfg, ref, os.geteuid() if uid is None else uid)
    if client_factory is None:
        client_factory = user_clients(cfg)
    try:
        found = client_factory(ref.registry).tags(ref.repository)
    except ImageNotFound:
        raise ImageNotFound(suggest.message(ref, None)) from None
    return ref, sorted(found)

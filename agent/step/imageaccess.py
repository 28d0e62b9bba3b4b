"""The node's access check, for the prolog and every step: may the job's user run
the image the job names, and the bytes the cache holds for it.

Two questions, each root's (core/access.py judges the uid Slurm gives):

1. the repository the job names, before anything is pulled for it: a refused
   user's job brings no private bytes to the node;
2. the repository the cached bytes came from (the cache entry's ``origin``, which
   the first pull set and no later name changes), after a cache hit: a job that
   names an open repository with a private image's digest is refused, unless the
   registry confirms that digest in the repository it named too (then the same
   bytes are public there, and a pull would have fetched them).
"""

from __future__ import annotations

from collections.abc import Callable

from tfimage.agent.core.access import check
from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import AccessDenied, RegistryError
from tfimage.agent.core.reference import Reference

# Whether the registry holds ``digest`` in the reference's repository.
Confirm = Callable[[Reference, str], bool]


def check_named(cfg: Config, ref: Reference, uid: int | None) -> None:
    """AccessDenied unless ``uid`` may run the repository ``ref`` names."""
    if not cfg.access:
        return
    if uid is None:
        raise AccessDenied(f"{ref.repository}: Slurm gave no uid for the job")
    check(cfg.access, ref.repository, uid)


def check_origin(
    cfg: Config,
    ref: Reference,
    digest: str,
    origin: str | None,
    uid: int | None,
    confirm: Confirm,
) -> None:
    """AccessDenied unless ``uid`` may run the bytes cached for ``digest``, which
    came from ``origin`` (``host/repository``)."""
    if not cfg.access or origin is None:
        return
    repository = origin.partition("/")[2]
    if repository == ref.repository:
        return  # check_named judged it
    if uid is None:
        raise AccessDenied(f"{ref.repository}: Slurm gave no uid for the job")
    try:
        check(cfg.access, repository, uid)
    except AccessDenied:
        if confirm(ref, digest):
            return
        raise AccessDenied(
            f"{ref.repository}@{digest}: the registry does not hold that digest in"
            f" {ref.repository}, and the bytes on this node came from a repository"
            " this user may not run"
        ) from None


def registry_confirms(cfg: Config) -> Confirm:
    """Asks the reference's registry, with the node's credentials, for the digest."""

    def confirm(ref: Reference, digest: str) -> bool:
        from tfimage.agent.registry.access import client_for

        try:
            client_for(cfg, ref.registry, light=True).manifest(ref.repository, digest)
        except RegistryError:
            return False
        return True

    return confirm

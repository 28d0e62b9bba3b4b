""" "Did you mean": what a user learns when the tag or repository named is not there.

At submit, a reference the registry does not have (``tf-custom:2.1`` for ``2.0``)
is answered with the repository's closest tags, or with the fact that the
repository itself is not there (or not readable with the credentials used: a
registry answers both alike, so as not to tell who may see what).  One tag list
(client.tags, bounded) is asked for, on the connection the pin used.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tfimage.agent.core.errors import ImageNotFound, RegistryError
from tfimage.agent.core.reference import Reference

if TYPE_CHECKING:
    from tfimage.agent.registry.client import RegistryClient

MAX_SUGGESTIONS = 3
SHOWN_WHEN_NONE_CLOSE = 5


def closest(wanted: str, tags: Sequence[str], n: int = MAX_SUGGESTIONS) -> list[str]:
    """The tags most like ``wanted``, best first (none when nothing is close)."""
    return difflib.get_close_matches(wanted, list(dict.fromkeys(tags)), n=n, cutoff=0.6)


def message(ref: Reference, tags: Sequence[str] | None) -> str:
    """The one line for ``ref`` not found; ``tags``: the repository's, or None when it
    has none this client may see."""
    name = f"{ref.registry}/{ref.repository}"
    if tags is None:
        return f"{name}: no such repository, or not readable with the credentials used"
    if not ref.tag or ref.tag in tags:  # a digest, or a tag that came meanwhile
        return f"{name}:{ref.version}: not found"
    short = ref.repository.rsplit("/", 1)[-1]
    near = [f"{short}:{t}" for t in closest(ref.tag, tags)]
    if near:
        options = near[0] if len(near) == 1 else f"{', '.join(near[:-1])} or {near[-1]}"
        return f"{name}:{ref.tag}: no such tag; did you mean {options}?"
    if not tags:
        return f"{name}:{ref.tag}: no such tag; the repository has no tags"
    some = sorted(tags)[:SHOWN_WHEN_NONE_CLOSE]
    more = ", ..." if len(tags) > len(some) else ""
    return f"{name}:{ref.tag}: no such tag; it has {len(tags)}: {', '.join(some)}{more}"


def not_found(client: RegistryClient, ref: Reference) -> ImageNotFound:
    """The error to raise for ``ref``, which ``client``'s registry said it lacks."""
    try:
        tags: list[str] | None = client.tags(ref.repository)
    except ImageNotFound:
        tags = None
    except RegistryError:  # no list to be had: say what is known
        return ImageNotFound(f"{ref.registry}/{ref.repository}:{ref.version}: not found")
    return ImageNotFound(message(ref, tags))

"""The operator's keep list: images never evicted, and fetched again by ``cache warm``.

"Keep" is eviction protection; "pin" means only a tag fixed to its digest at
submit (see the README's glossary).  It is kept in two places (core/layout.py names
both): ``keep.json``, the kept references as the operator gave them, so that a
kept tag that moves brings its new bytes at warm; and each kept entry's ``kept``
(store.py), which eviction reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core import layout
from tfimage.agent.core.errors import CacheError


def kept_refs(cache: ImageCache) -> list[str]:
    """The references the operator keeps, as given."""
    try:
        refs = json.loads(layout.cache_keep_list(cache.root).read_text())
    except (OSError, ValueError):
        return []
    return [r for r in refs if isinstance(r, str)] if isinstance(refs, list) else []


def change_kept_refs(cache: ImageCache, change: Callable[[list[str]], list[str]]) -> None:
    """Read, change and replace the keep list under its lock: two operators (or an
    operator and the warm timer) at once lose neither's."""
    cache.make_dirs()
    with cache.lock("keep"):
        refs = sorted(set(change(kept_refs(cache))))
        cache.write_json(
            layout.cache_keep_list(cache.root), refs, what="the keep list", durable=True
        )


def set_kept(cache: ImageCache, digest: str, kept: bool) -> None:
    if not cache.path_of(digest).exists():
        raise CacheError(f"{digest[:19]} is not in the cache")
    cache.update_entry(digest, lambda e: replace(e, kept=kept))

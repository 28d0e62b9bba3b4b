"""The operator's keep list: images never evicted, and fetched again by ``cache warm``.

"Keep" is eviction protection; "pin" means only a tag fixed to its digest at
submit (see the README's glossary).  Under ``cache_dir``::

    keep.json                  the kept references as the operator gave them (a
                               kept tag that moves brings its new bytes at warm)
    images/sha256-<hex>.json   "kept": true on each kept entry

tfimage before this release wrote ``pins.json`` and ``"pinned"``: both are read
as the same, so a node keeps what it kept across the upgrade.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tfimage.agent.cache.store import ImageCache
from tfimage.agent.errors import CacheError

KEEP_FILE = "keep.json"
OLD_KEEP_FILE = "pins.json"


def is_kept(meta: dict[str, Any]) -> bool:
    return bool(meta.get("kept") or meta.get("pinned"))


def kept_refs(cache: ImageCache) -> list[str]:
    """The references the operator keeps, as given."""
    for name in (KEEP_FILE, OLD_KEEP_FILE):
        try:
            refs = json.loads((cache.root / name).read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            return []
        return [r for r in refs if isinstance(r, str)] if isinstance(refs, list) else []
    return []


def change_kept_refs(cache: ImageCache, change: Callable[[list[str]], list[str]]) -> None:
    """Read, change and replace the keep list under its lock: two operators (or an
    operator and the warm timer) at once lose neither's."""
    cache.make_dirs()
    with cache.lock("keep"):
        refs = sorted(set(change(kept_refs(cache))))
        cache.write_json(cache.root / KEEP_FILE, refs, what="the keep list", durable=True)


def set_kept(cache: ImageCache, digest: str, kept: bool) -> None:
    if not cache.path_of(digest).exists():
        raise CacheError(f"{digest[:19]} is not in the cache")

    def change(meta: dict[str, Any]) -> None:
        meta.pop("pinned", None)
        meta["kept"] = kept

    cache.update_meta(digest, change)

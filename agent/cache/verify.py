"""``cache verify``: every entry re-hashed, and the orphans named."""

from __future__ import annotations

import hashlib

from tfimage.agent.cache.store import CHUNK, ImageCache
from tfimage.agent.core import layout
from tfimage.agent.core.sif import has_magic


def verify(cache: ImageCache) -> list[tuple[str, str]]:
    """(digest, problem) for each bad entry, and for each orphan (an image without
    its metadata, or metadata without its image)."""
    bad = [
        (
            layout.digest_of_key(p.name) or p.stem,
            "image without metadata (cache prune removes it)"
            if p.suffix == ".sif"
            else "metadata without its image (cache prune removes it)",
        )
        for p in cache.orphans()
    ]
    for entry in cache.entries():
        path = cache.path_of(entry.digest)
        try:
            h = hashlib.sha256()
            with path.open("rb") as f:
                head = f.read(64)
                h.update(head)
                while block := f.read(CHUNK):
                    h.update(block)
        except OSError as e:
            bad.append((entry.digest, f"unreadable: {e.strerror}"))
            continue
        if not has_magic(head):
            bad.append((entry.digest, "not a SIF file"))
        elif entry.blob and "sha256:" + h.hexdigest() != entry.blob:
            bad.append((entry.digest, "content does not match its sha256"))
    return bad

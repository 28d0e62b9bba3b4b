"""The last digest a host saw for each tag, for pinning when the registry is down.

One store serves everyone on a login node (the pin server runs as root for every
user), so one user must not be able to push everyone else's tags out: entries are
kept per uid, ``PER_UID`` each (the least recently changed go first), for at most
``MAX_UIDS`` users (the least recently active go first).  A lookup takes the
caller's own entry first, then the newest any user saw: digests come from the
registry, never from a user, so another user's is as good as one's own.

Layout (JSON, replaced atomically under ``<store>.lock``)::

    {"uids": {"1001": {"reg/library/x:1": ["sha256:...", 1733212800.0], ...}, ...}}
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from tfimage.agent.core.fsutil import held, write_json
from tfimage.agent.core.ids import valid_digest

PER_UID = 100
MAX_UIDS = 200
MAX_BYTES = 16 << 20  # far above PER_UID * MAX_UIDS entries; a bigger file is not read


class LastSeen:
    def __init__(self, path: Path) -> None:
        self.path = path

    def _load(self) -> dict[str, dict[str, tuple[str, float]]]:
        try:
            with self.path.open("rb") as f:
                raw: Any = json.loads(f.read(MAX_BYTES + 1)[:MAX_BYTES])
        except (OSError, ValueError):
            return {}
        uids = raw.get("uids") if isinstance(raw, dict) else None
        out: dict[str, dict[str, tuple[str, float]]] = {}
        for uid, tags in (uids if isinstance(uids, dict) else {}).items():
            if not isinstance(tags, dict):
                continue
            out[str(uid)] = {
                k: (v[0], float(v[1]))
                for k, v in tags.items()
                if isinstance(v, list)
                and len(v) == 2
                and isinstance(v[0], str)
                and valid_digest(v[0])
                and isinstance(v[1], int | float)
            }
        return out

    def recall(self, key: str, uid: int) -> str | None:
        """The digest for tag ``key``: ``uid``'s own, else the newest anyone saw."""
        uids = self._load()
        own = uids.get(str(uid), {}).get(key)
        if own:
            return own[0]
        seen = [tags[key] for tags in uids.values() if key in tags]
        return max(seen, key=lambda e: e[1])[0] if seen else None

    def remember(self, key: str, digest: str, uid: int) -> None:
        """Record that ``uid`` saw ``key`` name ``digest``; a store that cannot be
        written (a read-only home) is skipped, never an error."""
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with held(self.path.with_name(self.path.name + ".lock")):
                uids = self._load()
                tags = uids.pop(str(uid), {})
                if tags.get(key, ("", 0.0))[0] == digest:
                    return  # nothing new: no write on the common path
                tags.pop(key, None)
                tags[key] = (digest, time.time())
                while len(tags) > PER_UID:
                    del tags[min(tags, key=lambda k: tags[k][1])]
                uids[str(uid)] = tags  # the most recently active user goes last
                while len(uids) > MAX_UIDS:
                    del uids[min(uids, key=lambda u: max(e[1] for e in uids[u].values()))]
                write_json(
                    self.path,
                    {"uids": {u: {k: list(v) for k, v in t.items()} for u, t in uids.items()}},
                    mode=0o600,
                )

"""Which nodes each image was broadcast to, and when: ``sent/sha256-<hex>.json``.

The controller cannot ask a node what it holds: nothing in Slurm carries that, and
tfimage opens no port.  It knows what it sent.  A node that received an image for a
job holds it, as that job's last use, for at least ``cache_min_age`` (eviction never
takes an image younger than that: cache/evict.py), so within that time it is not
sent again; after it, or for a node never sent it, it is.  A node that lost it early
(an operator's ``cache rm``, a full disk) pulls it itself, checked; a node that
pulled it by itself receives a copy it discards.  Neither is ever wrong, only slower.

Schema: ``{"node": seconds since the epoch, ...}``, at most :data:`MAX_NODES` nodes
(the oldest dropped), root's, 0600.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from tfimage.agent.core import layout
from tfimage.agent.core.fsutil import held, read_json, write_json

MAX_NODES = 65536
_MAX_BYTES = MAX_NODES * 96


class Ledger:
    def __init__(self, stage_dir: str | Path) -> None:
        self.root = Path(stage_dir)

    def _path(self, digest: str) -> Path:
        return layout.stage_sent(self.root, digest)

    def sent(self, digest: str) -> dict[str, float]:
        """The nodes ``digest`` went to, and when; {} where unknown or unreadable."""
        doc = read_json(self._path(digest), _MAX_BYTES)
        if not isinstance(doc, dict):
            return {}
        return {
            k: float(v)
            for k, v in doc.items()
            if isinstance(k, str)
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
        }

    def lacking(self, digest: str, nodes: Iterable[str], now: float, fresh: float) -> list[str]:
        """``nodes`` (in order) that were not sent ``digest`` in the last ``fresh``
        seconds (a clock set back counts as never)."""
        sent = self.sent(digest)
        return [n for n in nodes if not 0 <= now - sent.get(n, -math.inf) < fresh]

    def record(self, digest: str, nodes: Iterable[str], now: float) -> None:
        """``nodes`` hold ``digest`` as of ``now`` (they received it, or used it)."""
        path = self._path(digest)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with held(path.with_suffix(".lock")):
            sent = self.sent(digest)
            sent.update(dict.fromkeys(nodes, now))
            if len(sent) > MAX_NODES:
                sent = dict(sorted(sent.items(), key=lambda kv: kv[1])[-MAX_NODES:])
            write_json(path, sent, mode=0o600)

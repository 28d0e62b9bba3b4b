"""What a job's prolog and steps on a node know of its images (one small file).

"Record" in tfimage is the usage record alone (usage/record.py); this is the job's
image list, ``layout.job_images``."""

from __future__ import annotations

import json

from tfimage.agent.core import layout
from tfimage.agent.core.config import Config
from tfimage.agent.core.fsutil import write_json
from tfimage.agent.core.logtext import oneline
from tfimage.agent.step import imagemount


class JobImages:
    """``jobs/<job>.images.json`` (core/layout.py): for each image text the job uses on this
    node, the reference it was pinned to, or why the prolog could not ready it::

        {"pinned": {"reg/library/x:1": "reg/library/x:1@sha256:..."},
         "failed": {"reg/library/y:2": "reg.example: unreachable: ..."}}

    Its existence also says the job is live on this node (evict.live_job).  Changed
    under the job's lock, replaced atomically."""

    def __init__(self, cfg: Config, job_id: str) -> None:
        self.cfg = cfg
        self.job_id = job_id
        self.path = layout.job_images(cfg.state_dir, job_id)

    def _load(self) -> dict[str, dict[str, str]]:
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError):
            raw = {}
        out: dict[str, dict[str, str]] = {"pinned": {}, "failed": {}}
        if not isinstance(raw, dict):
            return out
        for part in out:
            got = raw.get(part)
            if isinstance(got, dict):
                out[part] = {k: v for k, v in got.items() if isinstance(v, str)}
        return out

    def pinned(self, key: str) -> str | None:
        return self._load()["pinned"].get(key)

    def failure(self, key: str) -> str | None:
        return self._load()["failed"].get(key)

    def _change(self, part: str, key: str, value: str) -> None:
        with imagemount.job_lock(self.cfg.state_dir, self.job_id):
            images = self._load()
            images[part][key] = value
            if part == "pinned":
                images["failed"].pop(key, None)
            write_json(self.path, images, mode=0o600)

    def set_pinned(self, key: str, pinned: str) -> None:
        self._change("pinned", key, pinned)

    def set_failed(self, key: str, reason: str) -> None:
        self._change("failed", key, oneline(reason, 500))

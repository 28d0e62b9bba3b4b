"""Pinning at submit against a real registry, and the fallback when it is down."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from support import Registry
from tfimage.agent.config import load_config
from tfimage.agent.errors import RegistryError
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.submit.pin import pin


def down(host: str) -> RegistryClient:
    # Nothing listens on port 1: connection refused at once, one attempt.
    return RegistryClient("127.0.0.1:1", attempts=1, connect_timeout=1)


def test_pin_then_fall_back_to_last_seen(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    up = registry.client()
    digest = up.push_sif("library/pinme", "1", make_sif({"m": "1"}))
    cfg = load_config(registry.write_site(tmp_path))
    store = tmp_path / "last-seen.json"
    ref = cfg.reference("pinme:1")

    pinned, warning = pin(cfg, ref, lambda h: up, store)
    assert (pinned.digest, pinned.tag, warning) == (digest, "1", None)

    again, warning = pin(cfg, ref, down, store)
    assert again == pinned
    assert warning and "last digest this host saw" in warning and digest in warning

    with pytest.raises(RegistryError, match="never seen that tag"):
        pin(cfg, cfg.reference("other:1"), down, store)


def test_inner_srun_keeps_the_jobs_digest(tmp_path: Path) -> None:
    cfg = load_config(_cfg(tmp_path))
    job = "reg.site/library/tiny:1@sha256:" + "a" * 64
    pinned, _ = pin(cfg, cfg.reference("tiny:1"), down, tmp_path / "s.json", job_image=job)
    assert str(pinned) == job  # no registry asked (it is down), the job's bytes kept
    with pytest.raises(RegistryError):  # another tag is pinned afresh
        pin(cfg, cfg.reference("tiny:2"), down, tmp_path / "s.json", job_image=job)


def test_already_pinned_needs_no_registry(tmp_path: Path) -> None:
    cfg = load_config(_cfg(tmp_path))
    ref = cfg.reference("tiny@sha256:" + "b" * 64)
    assert pin(cfg, ref, down, tmp_path / "s.json") == (ref, None)


def _cfg(tmp_path: Path) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text("registry: reg.site\n")
    return p

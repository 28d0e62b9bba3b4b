"""A rack mirror makes a pull cheaper, never possible: whatever it fails with, the
registry is asked next; and a node asks only its own rack's mirror."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hostile import SIF_LAYER, Server, digest_of

from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import ImageNotFound
from tfimage.agent.registry.access import client_for


@pytest.fixture
def site(tls: Path) -> Iterator[tuple[Server, Server]]:
    """The registry, and rack 1's mirror."""
    servers = (Server(tls), Server(tls))
    yield servers
    for s in servers:
        s.httpd.shutdown()


@pytest.fixture
def blob(make_sif: Callable[[dict[str, str]], Path]) -> bytes:
    return make_sif({"etc/marker": os.urandom(64).hex()}).read_bytes()


def on_node(tmp_path: Path, tls: Path, registry: Server, rack: Server, node: str) -> Puller:
    (tmp_path / "config.yaml").write_text(
        f'registry: "{registry.host}"\nca_bundle: {tls / "ca.crt"}\n'
        f"credentials: {tmp_path / 'none.yaml'}\ncache_dir: {tmp_path / node}\n"
        f'read_timeout: 5\nrack_mirrors: {{"n[1-2]": ["{rack.host}"]}}\n'
    )
    cfg = load_config(tmp_path / "config.yaml").on_node(node)
    return Puller(ImageCache(cfg), lambda host: client_for(cfg, host, light=True))


@pytest.mark.parametrize(("node", "in_rack"), [("n2", True), ("n3", False)])
def test_a_node_asks_its_racks_mirror_alone_and_a_node_outside_every_rack_never_does(
    site: tuple[Server, Server], tmp_path: Path, tls: Path, blob: bytes, node: str, in_rack: bool
) -> None:
    registry, rack = site
    registry.serve(blob)
    rack.serve(blob)
    pull = on_node(tmp_path, tls, registry, rack, node)
    got = pull.ensure(pull.cfg.reference("x:1"))
    served, unasked = (rack, registry) if in_rack else (registry, rack)
    assert got.source == served.host and got.path.read_bytes() == blob
    assert unasked.b.seen == []


@pytest.mark.parametrize(
    "fault",
    ["not found", "refused", "down", "bytes that fail their digest"],
)
def test_whatever_a_rack_mirror_fails_with_the_registry_serves(
    site: tuple[Server, Server], tmp_path: Path, tls: Path, blob: bytes, fault: str
) -> None:
    registry, rack = site
    registry.serve(blob)
    if fault == "not found":
        rack.serve(blob, status=404)
    elif fault == "refused":
        rack.serve(blob, status=403)
    elif fault == "down":
        rack.serve(blob, status=502)
    else:
        evil = bytearray(blob)
        evil[-1] ^= 0xFF
        layer = {"mediaType": SIF_LAYER, "digest": digest_of(blob), "size": len(blob)}
        rack.serve(bytes(evil), layers=[layer])
    pull = on_node(tmp_path, tls, registry, rack, "n1")
    got = pull.ensure(pull.cfg.reference("x:1"))
    assert got.source == registry.host and got.path.read_bytes() == blob
    assert rack.b.seen  # it was asked first
    assert pull.cache.read_entry(str(got.ref.digest)).source == registry.host


def test_when_the_registry_says_not_found_too_its_answer_is_the_one_given(
    site: tuple[Server, Server], tmp_path: Path, tls: Path, blob: bytes
) -> None:
    registry, rack = site
    registry.serve(blob, status=404)
    rack.serve(blob, status=404)
    pull = on_node(tmp_path, tls, registry, rack, "n1")
    with pytest.raises(ImageNotFound) as e:
        pull.ensure(pull.cfg.reference("x:1"))
    assert str(e.value) == f"{registry.host}/library/x:1: not found"

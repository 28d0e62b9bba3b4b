"""A registry that accepts connections and never answers (stopped, overloaded) at
submit, with the default timeouts: the pin gives the registry its share of
submit_timeout (wire.PIN_REGISTRY_SECONDS) and then answers with the digest this
host last saw, and its warning, well inside the pin server's half."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tfimage.agent.core import wire
from tfimage.agent.core.config import config_from_mapping
from tfimage.agent.submit.lastseen import LastSeen
from tfimage.agent.submit.pin import pin


@pytest.fixture
def hung_registry() -> Iterator[str]:
    """host:port of a listener that accepts every connection and never sends a byte."""
    srv = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except TimeoutError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join(timeout=5)
        for c in held:
            c.close()
        srv.close()


def test_a_hung_registry_gives_the_remembered_digest_within_the_pin_servers_share(
    hung_registry: str, tmp_path: Path
) -> None:
    cfg = config_from_mapping(
        {"registry": hung_registry, "credentials": str(tmp_path / "none.yaml")},
        tmp_path / "config.yaml",
    )
    assert (cfg.connect_timeout, cfg.read_timeout) == (5.0, 30.0)  # the defaults
    ref = cfg.reference("tiny:1.0")
    known = "sha256:" + "ab" * 32
    store = tmp_path / "seen.json"
    LastSeen(store).remember(str(ref.unpinned), known, 1000)
    started = time.monotonic()
    pinned, warning = pin(cfg, ref, store=store, uid=1000)
    took = time.monotonic() - started
    assert pinned.digest == known
    assert warning is not None and warning.startswith("warning: the registry: gave up after")
    assert f"using the last digest this host saw for {ref.unpinned}: {known}" in warning
    assert wire.PIN_REGISTRY_SECONDS - 0.5 < took < wire.PIN_SERVER_SHARE - 2, took

"""A registry that sheds load (Harbor's per-project max_upstream_conn answers 429) is
waited out, never a reason to fail a job sooner than a slow registry would; and
cold pulls of a multi-node job start apart, not in the same second."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hostile import Server

from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core.config import load_config
from tfimage.agent.core.deadline import deadline
from tfimage.agent.core.errors import DeadlineExceeded, RegistryUnreachable
from tfimage.agent.registry.access import client_for
from tfimage.agent.registry.client import RETRY_AFTER_MAX, RegistryClient

Node = Callable[..., Puller]


@pytest.fixture
def server(tls: Path) -> Iterator[Server]:
    s = Server(tls)
    yield s
    s.httpd.shutdown()


@pytest.fixture
def node(tmp_path: Path, tls: Path) -> Node:
    """A node of its own (its own cache) on the server, through the stdlib transport
    the prolog uses; ``settings`` go into its config."""
    count = 0

    def make(s: Server, **settings: object) -> Puller:
        nonlocal count
        count += 1
        d = tmp_path / f"n{count}"
        d.mkdir()
        (d / "config.yaml").write_text(
            f'registry: "{s.host}"\nca_bundle: {tls / "ca.crt"}\n'
            f"credentials: {d / 'none.yaml'}\ncache_dir: {d / 'cache'}\nread_timeout: 5\n"
            + "".join(f"{k}: {v}\n" for k, v in settings.items())
        )
        cfg = load_config(d / "config.yaml")
        return Puller(ImageCache(cfg), lambda host: client_for(cfg, host, light=True))

    return make


def a_sif(make_sif: Callable[[dict[str, str]], Path], size: int = 0) -> bytes:
    """A real SIF of at least ``size`` bytes (random text: squashfs cannot shrink it)."""
    blob = make_sif({"etc/marker": os.urandom(size // 2).hex()}).read_bytes()
    assert len(blob) >= size
    return blob


def test_six_nodes_pulling_at_once_from_a_registry_serving_two_all_get_the_image(
    server: Server, node: Node, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    blob = a_sif(make_sif)
    # Each download takes a while, so that six at once overlap.
    server.serve(blob, max_in_flight=2, retry_after="1", delay=0.02)
    nodes = [node(server) for _ in range(6)]
    got: dict[int, bytes] = {}
    failed: dict[int, BaseException] = {}
    go = threading.Barrier(len(nodes))

    def pull(i: int) -> None:
        go.wait()
        try:
            cached = nodes[i].ensure(nodes[i].cfg.reference("x:1"))
            got[i] = cached.path.read_bytes()
        except BaseException as e:  # said below, per node
            failed[i] = e

    threads = [threading.Thread(target=pull, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert failed == {}
    assert sorted(got) == list(range(6)) and all(b == blob for b in got.values())
    assert server.b.shed > 0  # it did turn some away...
    assert server.b.peak <= 2  # ...and never served more than two at once


def test_a_registry_that_sheds_load_is_asked_until_the_deadline_not_three_times(
    server: Server, node: Node, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    server.serve(a_sif(make_sif), max_in_flight=0, retry_after="0")
    puller = node(server, hook_deadline=2)
    started = time.monotonic()
    with pytest.raises(RegistryUnreachable, match="shedding load: answered 429"):
        puller.ensure(puller.cfg.reference("x:1"))
    # Waits of 0.1-0.3 s, up to the 2 s budget: the last refused one is at most 0.3.
    assert time.monotonic() - started >= 1.6
    assert server.b.shed > 3


def test_a_shedding_registry_fails_a_prolog_no_sooner_than_a_slow_one(
    server: Server, tls: Path, node: Node, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    """Both end at the prolog's deadline: 429s never make a job fail faster."""
    blob = a_sif(make_sif, 512 << 10)
    slow = Server(tls)
    try:
        slow.serve(blob, delay=0.5)  # 64 KiB each half second: 4 s for the blob
        server.serve(blob, max_in_flight=0, retry_after="0")
        took = {}
        for name, s in (("slow", slow), ("shedding", server)):
            puller = node(s, hook_deadline=1.5, read_timeout=10)
            started = time.monotonic()
            with pytest.raises((DeadlineExceeded, RegistryUnreachable)), deadline(1.5, "prolog"):
                puller.ensure(puller.cfg.reference("x:1"))
            took[name] = time.monotonic() - started
        assert took["slow"] >= 1.4
        assert took["shedding"] >= 1.2  # its budget less its last wait (at most 0.3 s)
    finally:
        slow.httpd.shutdown()


def _client(server: Server, tls: Path, sleeps: list[float], busy_for: float) -> RegistryClient:
    return RegistryClient(
        server.host, ca_bundle=str(tls / "ca.crt"), busy_for=busy_for, sleep=sleeps.append
    )


def test_a_retry_after_of_an_hour_is_waited_at_most_the_bound_spread_by_half(
    server: Server, tls: Path, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    server.serve(a_sif(make_sif), max_in_flight=0, retry_after="3600")
    sleeps: list[float] = []
    with pytest.raises(RegistryUnreachable, match="shedding load"):
        _client(server, tls, sleeps, busy_for=200).manifest("library/x", "1")
    assert sleeps and all(RETRY_AFTER_MAX * 0.5 <= s <= RETRY_AFTER_MAX * 1.5 for s in sleeps)
    assert sum(sleeps) <= 200
    assert len(set(sleeps)) == len(sleeps)  # spread: no two clients wait alike


def test_a_503_without_retry_after_is_an_outage_asked_three_times(
    server: Server, tls: Path, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    """The next mirror serves sooner than a registry that is down would come back."""
    server.serve(a_sif(make_sif), status=503)
    sleeps: list[float] = []
    with pytest.raises(RegistryUnreachable, match="still answering 503 after 3 tries"):
        _client(server, tls, sleeps, busy_for=200).manifest("library/x", "1")
    assert len(server.b.seen) == 3 and len(sleeps) == 2


def test_a_cold_pull_of_a_multi_node_job_waits_a_moment_at_random_and_a_hit_never(
    server: Server, node: Node, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    blob = a_sif(make_sif)
    server.serve(blob)
    waits: list[float] = []
    puller = node(server)
    spread = Puller(puller.cache, puller._client_factory, jitter=3.0, sleep=waits.append)
    got = spread.ensure(spread.cfg.reference("x:1"))
    assert len(waits) == 1 and 0 <= waits[0] <= 3.0 and spread.waited == waits[0]
    spread.ensure(got.ref)  # pinned and cached: no wait
    assert len(waits) == 1
    assert Puller(puller.cache, puller._client_factory).jitter == 0  # one-node jobs

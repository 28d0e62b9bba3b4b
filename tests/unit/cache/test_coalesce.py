"""Requests for one tag at once ask the registry once (agent/cache/coalesce.py), on a real
registry; a request that starts after an answer never takes it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from support import Registry, at_once, flock_waiters, wait_for
from tfimage.agent.cache.pull import CachedImage, Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core import layout
from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.fsutil import held
from tfimage.agent.registry.access import client_for
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.registry.transport import Response, StdlibTransport


class CountingTransport(StdlibTransport):
    """The stdlib transport, noting each request's method and URL path in ``log``."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def request(self, method: str, url: str, **kw: Any) -> Response:
        self.log.append(f"{method} {url.split('/v2/', 1)[-1]}")
        return super().request(method, url, **kw)


def counting_cache(cfg: Config, log: list[str], hosts: list[str]) -> Puller:
    def factory(host: str) -> RegistryClient:
        hosts.append(host)
        c = client_for(cfg, host)
        return RegistryClient(
            host,
            c.credential,
            ca_bundle=cfg.ca_bundle,
            connect_timeout=cfg.connect_timeout,
            read_timeout=cfg.read_timeout,
            transport=CountingTransport(log),
        )

    return Puller(ImageCache(cfg), client_factory=factory)


@contextmanager
def tag_held(cfg: Config, name: str) -> Iterator[None]:
    """Hold the tag's lock, so every request started meanwhile queues on it."""
    locks = Path(cfg.cache_dir) / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with held(layout.cache_tag_lock(cfg.cache_dir, name)):
        yield


def queued(
    cfg: Config, name: str, call: Callable[[], CachedImage], n: int
) -> tuple[list[CachedImage], list[BaseException]]:
    """``n`` calls at once, all started while the tag's lock is held, then let go."""
    out: dict[str, Any] = {}
    with tag_held(cfg, name):
        t = threading.Thread(target=lambda: out.update(r=at_once(call, n)))
        t.start()
        lock = layout.cache_tag_lock(cfg.cache_dir, name)
        wait_for(lambda: flock_waiters(lock) == n, what=f"{n} calls queued on the tag's lock")
    t.join(120)
    return out["r"]  # type: ignore[no-any-return]


def tag_gets(log: list[str], repo: str, tag: str) -> int:
    return sum(line == f"GET {repo}/manifests/{tag}" for line in log)


def test_sixteen_requests_for_one_tag_ask_the_registry_once(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    sif = make_sif({"etc/tfimage-test-image": "coalesced\n"})
    digest = registry.client().push_sif("library/coalesced", "1", sif)
    cfg = load_config(registry.write_site(tmp_path))
    log: list[str] = []
    hosts: list[str] = []
    pull = counting_cache(cfg, log, hosts)
    ref = cfg.reference("coalesced:1")
    got, errors = queued(cfg, f"{registry.host}/library/coalesced:1", lambda: pull.ensure(ref), 16)
    assert not errors and len(got) == 16
    assert {g.ref.digest for g in got} == {digest}
    assert sum(not g.hit for g in got) == 1  # one download
    # One resolution: its challenge and its authenticated GET (16 x 2 without sharing).
    assert tag_gets(log, "library/coalesced", "1") == 2, log
    assert len(hosts) <= 2  # the one that asked, and the downloader if another


def test_a_request_after_the_tag_moved_asks_again(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    up = registry.client()
    first = up.push_sif("library/moving", "1", make_sif({"v": "1"}))
    cfg = load_config(registry.write_site(tmp_path))
    name = f"{registry.host}/library/moving:1"
    locks = Path(cfg.cache_dir) / "locks"
    locks.mkdir(parents=True)
    layout.cache_tag_lock(cfg.cache_dir, name).write_bytes(b"\x00not json")  # garbage is ignored
    log: list[str] = []
    pull = counting_cache(cfg, log, [])
    assert pull.ensure(cfg.reference("moving:1")).ref.digest == first
    second = up.push_sif("library/moving", "1", make_sif({"v": "2"}))
    # The answer on record is older than this request: never taken.
    assert pull.ensure(cfg.reference("moving:1")).ref.digest == second
    assert tag_gets(log, "library/moving", "1") == 4  # each: its challenge, its GET
    assert second.encode() in layout.cache_tag_lock(cfg.cache_dir, name).read_bytes()


def test_a_registry_that_is_down_is_tried_once_per_group(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    digest = registry.client().push_sif("library/downed", "1", make_sif({"v": "d"}))
    site: Mapping[str, str] = {"mirrors": f'["{registry.host}"]', "connect_timeout": "1"}
    path = registry.write_site(tmp_path, **site)
    path.write_text(
        path.read_text().replace(f'registry: "{registry.host}"', 'registry: "127.0.0.1:1"')
    )
    cfg = load_config(path)
    hosts: list[str] = []
    pull = counting_cache(cfg, [], hosts)
    got, errors = queued(
        cfg, "127.0.0.1:1/library/downed:1", lambda: pull.ensure(cfg.reference("downed:1")), 8
    )
    assert not errors and {g.ref.digest for g in got} == {digest}
    assert {g.source for g in got if not g.hit} == {registry.host}
    # The primary was asked by one request; the other seven took its answer.
    assert hosts.count("127.0.0.1:1") == 1, hosts

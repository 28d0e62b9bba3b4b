"""A registry that lies or breaks, served over real TLS by a small server in the test.

Each case must be refused with a clear message, publish nothing, and leave the
cache consistent; an interrupted download resumes with a Range request.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hostile import SIF_LAYER, Server, digest_of

from support import at_once, flock_waiters, wait_for
from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import (
    CacheError,
    ImageNotFound,
    RegistryError,
    RegistryStalled,
    RegistryUnreachable,
    VerificationError,
)
from tfimage.agent.registry.access import client_for
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.registry.credentials import Credential
from tfimage.agent.registry.transport import RequestsTransport, StdlibTransport, tls_context


@pytest.fixture
def server(tls: Path) -> Iterator[Server]:
    s = Server(tls)
    yield s
    s.httpd.shutdown()


@pytest.fixture(params=["requests", "stdlib"])
def cache_for(
    request: pytest.FixtureRequest, tmp_path: Path, tls: Path
) -> Callable[[Server], Puller]:
    """A cache on the server, through each transport (agent/registry/transport.py) in turn."""

    def make(s: Server, **extra: int) -> Puller:
        cfg = tmp_path / "config.yaml"
        cfg.write_text(
            f'registry: "{s.host}"\nca_bundle: {tls / "ca.crt"}\n'
            f"credentials: {tmp_path / 'none.yaml'}\ncache_dir: {tmp_path / 'cache'}\n"
            "read_timeout: 5\n" + "".join(f"{k}: {v}\n" for k, v in extra.items())
        )
        site = load_config(cfg)
        light = request.param == "stdlib"
        return Puller(
            ImageCache(site), client_factory=lambda host: client_for(site, host, light=light)
        )

    return make


CacheFor = Callable[..., Puller]


def a_sif(make_sif: Callable[[dict[str, str]], Path], size: int = 0) -> bytes:
    """A real SIF of at least ``size`` bytes (random text, so squashfs cannot shrink it)."""
    blob = make_sif({"etc/marker": os.urandom(size).hex()}).read_bytes()
    assert len(blob) >= size
    return blob


def nothing_published(cache: ImageCache) -> None:
    assert not list((cache.root / "images").glob("*.sif"))


def test_sha256_mismatch(
    server: Server,
    cache_for: Callable[[Server], Puller],
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    good = a_sif(make_sif)
    evil = bytearray(good)
    evil[-1] ^= 0xFF
    server.serve(
        bytes(evil), layers=[{"mediaType": SIF_LAYER, "digest": digest_of(good), "size": len(good)}]
    )
    pull = cache_for(server)
    with pytest.raises(VerificationError, match="sha256 of the download does not match"):
        pull.ensure(pull.cfg.reference("x:1"))
    nothing_published(pull.cache)
    assert not any((pull.cache.root / "tmp").iterdir())  # and no partial kept


def test_two_layers(server: Server, cache_for: Callable[[Server], Puller]) -> None:
    layer = {"mediaType": SIF_LAYER, "digest": digest_of(b"a"), "size": 1}
    server.serve(b"a", layers=[layer, layer])
    pull = cache_for(server)
    with pytest.raises(VerificationError, match="exactly one layer, this one has 2"):
        pull.ensure(pull.cfg.reference("x:1"))
    nothing_published(pull.cache)


def test_non_sif_layer(server: Server, cache_for: Callable[[Server], Puller]) -> None:
    server.serve(
        b"a",
        layers=[
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": digest_of(b"a"),
                "size": 1,
            }
        ],
    )
    pull = cache_for(server)
    with pytest.raises(VerificationError, match="not a SIF file"):
        pull.ensure(pull.cfg.reference("x:1"))
    nothing_published(pull.cache)


def test_bytes_that_are_not_a_sif(server: Server, cache_for: Callable[[Server], Puller]) -> None:
    blob = b"#!/bin/sh\necho not a sif\n" + b"\0" * 100
    server.serve(blob)
    pull = cache_for(server)
    with pytest.raises(VerificationError, match="not a SIF file"):
        pull.ensure(pull.cfg.reference("x:1"))
    nothing_published(pull.cache)


def test_ten_gigabyte_content_length(
    server: Server,
    cache_for: Callable[[Server], Puller],
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    blob = a_sif(make_sif)
    server.serve(blob, content_length=10 << 30)
    pull = cache_for(server)
    with pytest.raises(VerificationError, match=f"sends {10 << 30} bytes .* has {len(blob)}"):
        pull.ensure(pull.cfg.reference("x:1"))
    nothing_published(pull.cache)


def test_a_download_that_broke_off_is_asked_again_from_where_it_stopped(
    server: Server,
    cache_for: Callable[[Server], Puller],
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    blob = a_sif(make_sif, size=3_000_000)
    server.serve(blob, cut_after=2_500_000)
    pull = cache_for(server)
    got = pull.ensure(pull.cfg.reference("x:1"))
    # The same pull asks once more, from what it had (requests reads 1 MiB at a time).
    [again] = server.b.ranges
    assert again in ("bytes=2500000-", f"bytes={2 << 20}-")
    assert got.path.read_bytes() == blob


def test_a_download_that_keeps_breaking_fails_and_the_next_pull_resumes(
    server: Server,
    cache_for: Callable[[Server], Puller],
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    blob = a_sif(make_sif, size=3_000_000)
    server.serve(blob, cut_after=2_500_000, cuts=3)  # every attempt of the pull
    pull = cache_for(server)
    with pytest.raises(RegistryUnreachable, match="broke off"):
        pull.ensure(pull.cfg.reference("x:1"))
    nothing_published(pull.cache)
    [partial] = (pull.cache.root / "tmp").iterdir()
    kept = partial.stat().st_size  # requests reads 1 MiB at a time
    assert kept in (2_500_000, 2 << 20) and partial.read_bytes() == blob[:kept]
    server.b.ranges.clear()
    got = pull.ensure(pull.cfg.reference("x:1"))
    # From the kept prefix's last whole 4 KiB block (O_DIRECT writes aligned ones).
    assert server.b.ranges == [f"bytes={kept - kept % 4096}-"]
    assert got.path.read_bytes() == blob


@pytest.mark.parametrize(
    "breaks",
    [{"blob_status": 502}, {"cut_after": 1000, "cuts": 9}],
    ids=["its blob answering 502", "cut before a whole block came"],
)
def test_a_pull_that_got_nothing_to_resume_from_leaves_no_partial_file(
    server: Server,
    cache_for: Callable[[Server], Puller],
    make_sif: Callable[[dict[str, str]], Path],
    breaks: dict[str, int],
) -> None:
    # The soak's registry kill on Debian 13 (CI at bbc5ef3): the manifest came, the
    # blob did not, and a partial file stayed behind that no pull could resume from
    # (a resume starts at its last whole 4 KiB block).
    server.serve(a_sif(make_sif, size=100_000), **breaks)
    pull = cache_for(server)
    with pytest.raises(RegistryUnreachable):
        pull.ensure(pull.cfg.reference("x:1"))
    assert sum("/blobs/" in path for path, _ in server.b.seen) >= 1
    nothing_published(pull.cache)
    assert list((pull.cache.root / "tmp").iterdir()) == []


def test_a_registry_that_stalls_mid_download_fails_the_pull_within_one_read_timeout(
    request: pytest.FixtureRequest,
    server: Server,
    cache_for: CacheFor,
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    # A registry SIGSTOPped mid-pull: the connection stays open and nothing comes.
    # A broken connection is asked again (above); a stalled one is not: it would cost
    # another whole read timeout (and the prolog's retries, the user's wait) for nothing.
    blob = a_sif(make_sif, size=3_000_000)
    # 2 MB, then silence: past requests' 1 MiB reads, whose transport keeps the stall
    # for its next call rather than letting urllib3 call it an incomplete read
    server.serve(blob, stall_after=2_000_000)
    pull = cache_for(server, read_timeout=1)
    started = time.monotonic()
    with pytest.raises(RegistryStalled, match=r"stalled|timed out"):
        pull.ensure(pull.cfg.reference("x:1"))
    took = time.monotonic() - started
    assert took < 1 + 3, took  # one read timeout, and a little for TLS and the manifest
    assert sum("/blobs/" in path for path, _ in server.b.seen) == 1
    # What came is kept for the next pull where the transport handed it over:
    # requests' 1 MiB reads did; the stdlib transport's readinto fills its whole
    # buffer or loses it to the timeout, and an empty file is not left behind.
    kept = [p.read_bytes() for p in (pull.cache.root / "tmp").iterdir()]
    if request.node.callspec.params["cache_for"] == "requests":
        assert [len(k) >= 1 << 20 for k in kept] == [True]
    assert all(k and k == blob[: len(k)] for k in kept)


def kill_9_pull_when(config: Path, ready: Callable[[], bool]) -> None:
    """Run `tfimage pull x:1` in a process of its own; SIGKILL it once ``ready()``."""
    puller = subprocess.Popen(
        [sys.executable, "-m", "tfimage.main", "pull", "x:1"],
        env={**os.environ, "TFIMAGE_CONFIG": str(config)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            if ready():
                break
            time.sleep(0.02)
        puller.send_signal(signal.SIGKILL)
    finally:
        puller.wait(10)


def test_kill_9_mid_pull_then_resume(
    server: Server,
    cache_for: Callable[[Server], Puller],
    tmp_path: Path,
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    blob = a_sif(make_sif, size=2_000_000)
    server.serve(blob, delay=0.05)  # about 40 pieces: 2 s for the whole blob
    # One stream, written 64 KiB at a time.
    pull = cache_for(server, pull_connections=1, pull_stripe_bytes=1 << 16)
    tmp = pull.cache.root / "tmp"

    def far_enough() -> bool:
        parts = list(tmp.glob("*.partial")) if tmp.exists() else []
        return bool(parts) and parts[0].stat().st_size > 200_000

    kill_9_pull_when(tmp_path / "config.yaml", far_enough)
    [partial] = tmp.glob("*.partial")
    kept = partial.stat().st_size
    assert 0 < kept < len(blob) and partial.read_bytes() == blob[:kept]
    nothing_published(pull.cache)
    server.b.delay = 0
    server.b.ranges.clear()
    got = pull.ensure(pull.cfg.reference("x:1"))
    assert server.b.ranges == [f"bytes={kept - kept % 4096}-"]
    assert got.path.read_bytes() == blob


def test_429_then_success(
    server: Server,
    cache_for: Callable[[Server], Puller],
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    blob = a_sif(make_sif)
    server.serve(blob, busy=2)
    pull = cache_for(server)
    got = pull.ensure(pull.cfg.reference("x:1"))
    assert got.path.read_bytes() == blob
    assert server.b.manifest_requests == 3  # two 429s, retried, then the answer


def test_expired_bearer_token_is_fetched_again(
    server: Server,
    cache_for: Callable[[Server], Puller],
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    blob = a_sif(make_sif)
    server.serve(blob, bearer=True)
    pull = cache_for(server)
    got = pull.ensure(pull.cfg.reference("proj/x:1"))
    assert got.path.read_bytes() == blob
    asked = [t for t in server.b.tokens if t != "expired"]
    # One token for the manifest, a fresh one once it expired, for the same repository.
    assert len(asked) == 2 and set(asked) == {"repository:proj/x:pull"}


@pytest.mark.parametrize("connections", [1, 4])
def test_full_disk_is_a_clear_error_and_leaves_the_cache_consistent(
    server: Server,
    tmp_path: Path,
    tls: Path,
    make_sif: Callable[[dict[str, str]], Path],
    connections: int,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem for the cache needs root")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], check=True, timeout=30
    )
    try:
        blob = a_sif(make_sif, size=3_000_000)  # larger than the filesystem
        server.serve(blob)
        cfg = tmp_path / "small.yaml"
        cfg.write_text(
            f'registry: "{server.host}"\nca_bundle: {tls / "ca.crt"}\n'
            f"credentials: {tmp_path / 'none.yaml'}\ncache_dir: {small / 'cache'}\n"
            f"pull_connections: {connections}\npull_stripe_bytes: {1 << 18}\n"
        )
        pull = Puller(ImageCache(load_config(cfg)))
        with pytest.raises(CacheError, match="No space left on device"):
            pull.ensure(pull.cfg.reference("x:1"))
        nothing_published(pull.cache)
        assert not any((pull.cache.root / "tmp").iterdir())  # the partial is gone, space back
        assert pull.cache.entries() == []
    finally:
        subprocess.run(["umount", str(small)], check=True, timeout=30)


# --- one blob over several connections (agent/cache/download.py) ----------------------------

STRIPED = {"pull_connections": 4, "pull_stripe_bytes": 1 << 18}


def _asked(server: Server, size: int) -> list[tuple[int, int]]:
    """The byte ranges ``[a, b)`` the client asked for, in order."""
    out = []
    for r in server.b.ranges:
        first, _, last = r.removeprefix("bytes=").partition("-")
        out.append((int(first), int(last) + 1 if last else size))
    return sorted(out)


def test_a_large_blob_comes_in_stripes_and_is_verified(
    server: Server, cache_for: CacheFor, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    blob = a_sif(make_sif, size=2_000_000)
    server.serve(blob)
    pull = cache_for(server, **STRIPED)
    got = pull.ensure(pull.cfg.reference("x:1"))
    assert got.path.read_bytes() == blob
    ranges = _asked(server, len(blob))
    assert len(ranges) == -(-len(blob) // (1 << 18))  # one request per stripe
    assert ranges[0][0] == 0 and ranges[-1][1] == len(blob)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # a cover
    assert not any((pull.cache.root / "tmp").iterdir())  # no partial file left


def test_a_registry_that_ignores_range_is_read_in_one_stream(
    server: Server, cache_for: CacheFor, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    blob = a_sif(make_sif, size=2_000_000)
    server.serve(blob, ignore_range=True)
    pull = cache_for(server, **STRIPED)
    got = pull.ensure(pull.cfg.reference("x:1"))
    assert got.path.read_bytes() == blob and server.b.ranges  # it asked, then streamed
    assert not any((pull.cache.root / "tmp").iterdir())


def test_a_bad_stripe_fails_the_sha256_and_leaves_nothing(
    server: Server, cache_for: CacheFor, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    good = a_sif(make_sif, size=2_000_000)
    evil = bytearray(good)
    evil[len(good) * 3 // 4] ^= 0xFF  # inside a later stripe, not the first
    server.serve(
        bytes(evil), layers=[{"mediaType": SIF_LAYER, "digest": digest_of(good), "size": len(good)}]
    )
    pull = cache_for(server, **STRIPED)
    with pytest.raises(VerificationError, match="sha256 of the download does not match"):
        pull.ensure(pull.cfg.reference("x:1"))
    nothing_published(pull.cache)
    assert not any((pull.cache.root / "tmp").iterdir())


def test_a_stripe_that_breaks_off_is_asked_again_from_where_it_stopped(
    server: Server, cache_for: CacheFor, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    blob = a_sif(make_sif, size=2_000_000)
    cut = len(blob) * 5 // 8 + 1000  # inside a stripe, not on a 64 KiB piece's edge
    server.serve(blob, cut_after=cut)
    pull = cache_for(server, **STRIPED)
    got = pull.ensure(pull.cfg.reference("x:1"))
    assert got.path.read_bytes() == blob
    starts = [a for a, _ in _asked(server, len(blob))]
    assert len(starts) == -(-len(blob) // (1 << 18)) + 1 and cut in starts  # and the rest


def test_kill_9_mid_striped_pull_resumes_from_the_prefix_it_wrote(
    server: Server,
    cache_for: CacheFor,
    tmp_path: Path,
    tls: Path,
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    blob = a_sif(make_sif, size=3_000_000)
    server.serve(blob, delay=0.05)  # 64 KiB every 50 ms on each connection
    pull = cache_for(server, pull_connections=2, pull_stripe_bytes=1 << 16)
    tmp = pull.cache.root / "tmp"

    def far_enough() -> bool:
        parts = list(tmp.glob("*.partial")) if tmp.exists() else []
        return bool(parts) and parts[0].stat().st_size > 400_000

    kill_9_pull_when(tmp_path / "config.yaml", far_enough)
    nothing_published(pull.cache)
    [partial] = tmp.glob("*.partial")
    kept = partial.stat().st_size
    # Stripes came over two connections, yet the file is the blob's first bytes.
    assert 400_000 < kept < len(blob) and partial.read_bytes() == blob[:kept]
    # The resume asks a registry of its own: a request the killed pull had already
    # sent can still reach the first one's handlers (and its log) after the kill.
    again = Server(tls)
    try:
        again.serve(blob)
        pull = cache_for(again, pull_connections=2, pull_stripe_bytes=1 << 16)
        got = pull.ensure(pull.cfg.reference("x:1"))
    finally:
        again.httpd.shutdown()
    assert got.path.read_bytes() == blob
    ranges = _asked(again, len(blob))
    # From the prefix's last whole 4 KiB block on, each byte asked for once.
    assert ranges[0][0] == kept - kept % 4096 and ranges[-1][1] == len(blob)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert not any(tmp.iterdir())


def test_pinned_ensures_waiting_for_one_download_ask_the_registry_nothing(
    server: Server, cache_for: CacheFor, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    blob = a_sif(make_sif, size=500_000)
    server.serve(blob, delay=0.02)  # the download takes a while: the others queue on it
    pull = cache_for(server)
    ref = pull.cfg.reference(f"x@{digest_of(server.b.manifest)}")  # as the prolog has it
    hits, errors = at_once(lambda: pull.ensure(ref).hit, 8)
    assert not errors and sorted(hits) == [False] + [True] * 7
    assert server.b.manifest_requests == 1  # only the one that downloaded asked


def test_a_pinned_ensure_that_waited_for_the_download_never_loads_the_registry_client(
    server: Server, cache_for: CacheFor, tmp_path: Path, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    """What 16 prologs for one new image pay: each waiter only takes the lock."""
    blob = a_sif(make_sif)
    server.serve(blob)
    pull = cache_for(server)
    digest = digest_of(server.b.manifest)
    pull.cache.make_dirs()
    code = (
        "import json, sys; from tfimage.agent.core.config import load_config; "
        "from tfimage.agent.cache.pull import Puller; "
        "from tfimage.agent.cache.store import ImageCache; c = load_config(sys.argv[1]); "
        "g = Puller(ImageCache(c)).ensure(c.reference(sys.argv[2])); "
        "print(json.dumps([g.hit, 'tfimage.agent.registry.client' in sys.modules, "
        "'hashlib' in sys.modules]))"
    )
    with pull.cache.lock(digest):  # the download in progress, as another pull holds it
        waiter = subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / "config.yaml"), f"x@{digest}"],
            stdout=subprocess.PIPE,
            text=True,
        )
        lock = pull.cache.root / "locks" / f"{digest.replace(':', '-')}.lock"
        wait_for(lambda: flock_waiters(lock) == 1, what="the waiter queued on the lock")
        done = pull.cache.root / "tmp" / "published"
        done.write_bytes(blob)
        done.rename(pull.cache.path_of(digest))  # the download finished
    out, _ = waiter.communicate(timeout=30)
    # A hit, and neither the registry client nor hashlib (OpenSSL's start) loaded.
    assert json.loads(out) == [True, False, False]
    assert server.b.manifest_requests == 0


# --- credentials go to the registry's host, and to no one else ------------------------

CRED = Credential("robot$library+test", "the-password")


@pytest.fixture(params=["requests", "stdlib"])
def client_on(request: pytest.FixtureRequest, tls: Path) -> Callable[..., RegistryClient]:
    """A client with credentials for the server, through each transport in turn."""

    def make(s: Server, **kw: Any) -> RegistryClient:
        transport = StdlibTransport() if request.param == "stdlib" else RequestsTransport()
        return RegistryClient(
            s.host, CRED, ca_bundle=str(tls / "ca.crt"), transport=transport, attempts=1, **kw
        )

    return make


def test_a_token_service_on_another_host_gets_no_credentials(
    server: Server, client_on: Callable[..., RegistryClient]
) -> None:
    other = server.host.replace("127.0.0.1", "localhost")
    server.serve(b"x", bearer=True, realm_host=other)
    with pytest.raises(RegistryError, match=rf"token service is on another host \({other}\)"):
        client_on(server).manifest("library/x", "1")
    assert not [p for p, _ in server.b.seen if p.startswith("/service/token")]
    # The same host name on the default port is another service, too.
    with pytest.raises(RegistryError, match="token service is on another host"):
        client_on(server, token_realms=("localhost",)).manifest("library/x", "1")
    # The admin may name it: then the token flow works, credentials and all.
    server.serve(b"x", bearer=True, realm_host=other)
    client_on(server, token_realms=(other,)).manifest("library/x", "1")
    sent = [a for p, a in server.b.seen if p.startswith("/service/token")]
    assert sent and sent[0].startswith("Basic ")


def test_a_token_that_could_end_a_header_line_is_refused(
    server: Server, client_on: Callable[..., RegistryClient]
) -> None:
    server.serve(b"x", bearer=True, token_text="abc\r\nX-Injected: 1")
    with pytest.raises(RegistryError, match="token service sent an unusable token"):
        client_on(server).manifest("library/x", "1")


def test_a_redirect_from_https_to_http_is_refused(
    server: Server, client_on: Callable[..., RegistryClient], make_sif: Callable[..., Path]
) -> None:
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen(1)
    plain.settimeout(0.5)
    try:
        blob = a_sif(make_sif)
        location = f"http://127.0.0.1:{plain.getsockname()[1]}/blob"
        server.serve(blob, basic=True, redirect_blob=location)
        client = client_on(server)
        with pytest.raises(RegistryError, match="refused a redirect from https to http"):
            client.open_blob("library/x", digest_of(blob), 0, len(blob), len(blob), whole_ok=True)
        with pytest.raises(TimeoutError):
            plain.accept()  # nothing ever came to the plain-HTTP listener
    finally:
        plain.close()


def test_credentials_do_not_follow_a_redirect_to_another_host(
    server: Server, client_on: Callable[..., RegistryClient], make_sif: Callable[..., Path]
) -> None:
    blob = a_sif(make_sif)
    other = server.host.replace("127.0.0.1", "localhost")
    server.serve(blob, basic=True, redirect_blob=f"https://{other}/redirected/blob")
    client = client_on(server)
    with client.open_blob(
        "library/x", digest_of(blob), 0, len(blob), len(blob), whole_ok=True
    ) as body:
        buf = bytearray(len(blob))
        got = 0
        while got < len(blob) and (n := body.readinto(memoryview(buf)[got:])):
            got += n
    assert bytes(buf) == blob  # the redirect was followed...
    seen = dict(server.b.seen)
    assert seen["/redirected/blob"] == ""  # ...without the password
    blob_gets = [a for p, a in server.b.seen if "/blobs/" in p]
    assert blob_gets and blob_gets[-1].startswith("Basic ")  # which the registry did get


# --- mirrors: who serves when the registry does not -------------------------------------


@pytest.fixture
def three(tls: Path) -> Iterator[list[Server]]:
    """A registry and two mirrors, each a hostile server of its own."""
    servers = [Server(tls) for _ in range(3)]
    yield servers
    for s in servers:
        s.httpd.shutdown()


def _with_mirrors(
    cache_for: CacheFor, registry: Server, mirrors: list[str], tmp_path: Path
) -> Puller:
    pull = cache_for(registry)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(cfg.read_text() + f"mirrors: {mirrors}\nconnect_timeout: 1\n")
    return Puller(ImageCache(load_config(cfg)), client_factory=pull._client_factory)


def test_a_registry_still_answering_5xx_moves_the_pull_to_the_mirror(
    three: list[Server], cache_for: CacheFor, tmp_path: Path, make_sif: Callable[..., Path]
) -> None:
    primary, mirror, _ = three
    blob = a_sif(make_sif)
    primary.serve(blob, status=503)
    mirror.serve(blob)
    pull = _with_mirrors(cache_for, primary, [mirror.host], tmp_path)
    got = pull.ensure(pull.cfg.reference("x:1"))
    assert got.source == mirror.host and got.path.read_bytes() == blob
    assert len(primary.b.seen) >= 2  # asked again (retries) before the mirror served


def test_two_mirrors_are_tried_in_order_and_the_record_names_the_one_that_served(
    three: list[Server], cache_for: CacheFor, tmp_path: Path, make_sif: Callable[..., Path]
) -> None:
    primary, first, second = three
    blob = a_sif(make_sif)
    primary.serve(blob, status=502)
    first.serve(blob, status=503)
    second.serve(blob)
    pull = _with_mirrors(cache_for, primary, [first.host, second.host], tmp_path)
    got = pull.ensure(pull.cfg.reference("x:1"))
    assert got.source == second.host
    assert first.b.seen and second.b.seen  # the first was asked, then the second
    assert pull.cache.read_entry(str(got.ref.digest)).source == second.host


@pytest.mark.parametrize("status", [404, 403])
def test_a_4xx_from_the_registry_is_final_and_no_mirror_is_asked(
    three: list[Server],
    cache_for: CacheFor,
    tmp_path: Path,
    make_sif: Callable[..., Path],
    status: int,
) -> None:
    """Mirrors hold the same repositories: one that is not there, or not for these
    credentials, is not there on a mirror either (docs/admin.md: Registry access)."""
    primary, mirror, _ = three
    blob = a_sif(make_sif)
    primary.serve(blob, status=status)
    mirror.serve(blob)
    pull = _with_mirrors(cache_for, primary, [mirror.host], tmp_path)
    with pytest.raises(RegistryError) as e:
        pull.ensure(pull.cfg.reference("x:1"))
    # The registry's own answer, said as such; never a mirror's "unreachable".
    said = {404: f"{primary.host}/library/x:1: not found",
            403: f"{primary.host}/library/x: manifest request failed (403)"}  # fmt: skip
    assert str(e.value) == said[status]
    assert isinstance(e.value, ImageNotFound) == (status == 404)
    assert not isinstance(e.value, RegistryUnreachable)
    assert mirror.b.seen == []


def test_a_ca_bundle_replaced_on_disk_is_used_by_the_next_connection(
    server: Server, tls: Path, tmp_path: Path
) -> None:
    # The daemon makes its TLS context once, before it forks, for every worker: a
    # site that rotates its CA (the role writes a new file over the old) must not
    # have to restart it.
    bundle = tmp_path / "ca.crt"
    # Another CA's certificate (not the server's own: Python 3.13 verifies a chain
    # that ends at any certificate in the bundle, VERIFY_X509_PARTIAL_CHAIN).
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=another CA", "-keyout", str(tmp_path / "other.key"),
                    "-out", str(bundle)], check=True, capture_output=True, timeout=60)  # fmt: skip
    server.serve(b"x")

    def client() -> RegistryClient:
        return RegistryClient(server.host, CRED, ca_bundle=str(bundle),
                              transport=StdlibTransport(), attempts=1)  # fmt: skip

    with pytest.raises(RegistryError, match="TLS verification failed"):
        client().manifest("library/x", "1")
    assert tls_context(str(bundle)) is tls_context(str(bundle))  # made once, then shared
    new = tmp_path / "ca.crt.new"
    new.write_bytes((tls / "ca.crt").read_bytes())
    new.replace(bundle)
    assert client().manifest("library/x", "1").digest.startswith("sha256:")

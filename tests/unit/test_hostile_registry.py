"""A registry that lies or breaks, served over real TLS by a small server in the test.

Each case must be refused with a clear message, publish nothing, and leave the
cache consistent; an interrupted download resumes with a Range request.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

from tfimage.agent.cache import ImageCache, client_for
from tfimage.agent.config import load_config
from tfimage.agent.errors import CacheError, RegistryUnreachable, VerificationError

SIF_CONFIG = "application/vnd.sylabs.sif.config.v1+json"
SIF_LAYER = "application/vnd.sylabs.sif.layer.v1.sif"
OCI = "application/vnd.oci.image.manifest.v1+json"


def digest_of(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


@dataclass
class Behaviour:
    manifest: bytes = b""
    blob: bytes = b""
    content_length: int | None = None  # claim this many bytes, send the blob
    cut_after: int | None = None  # close the connection after this many bytes, once
    delay: float = 0.0  # seconds between 64 KiB pieces
    ranges: list[str] = field(default_factory=list)
    busy: int = 0  # answer 429 to this many manifest requests first
    bearer: bool = False  # Harbor's token flow; each token is good for one request
    tokens: list[str] = field(default_factory=list)  # scopes asked for, in order
    manifest_requests: int = 0


class Server:
    def __init__(self, tls: Path) -> None:
        self.b = Behaviour()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                b = outer.b
                if self.path.startswith("/service/token"):
                    scope = self.path.split("scope=", 1)[1].split("&")[0]
                    b.tokens.append(unquote(scope))
                    body = json.dumps({"token": f"t{len(b.tokens)}"}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if b.bearer and self.headers.get("Authorization") != f"Bearer t{len(b.tokens)}":
                    realm = f"https://{outer.host}/service/token"
                    self.send_response(401)
                    self.send_header(
                        "WWW-Authenticate", f'Bearer realm="{realm}",service="harbor-registry"'
                    )
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if b.bearer:
                    b.tokens.append("expired")  # the token just used is now stale
                if "/manifests/" in self.path:
                    b.manifest_requests += 1
                    if b.busy:
                        b.busy -= 1
                        self.send_response(429)
                        self.send_header("Retry-After", "0")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(200)
                    self.send_header("Content-Type", OCI)
                    self.send_header("Content-Length", str(len(b.manifest)))
                    self.end_headers()
                    self.wfile.write(b.manifest)
                    return
                start = 0
                rng = self.headers.get("Range")
                if rng:
                    b.ranges.append(rng)
                    start = int(rng.removeprefix("bytes=").rstrip("-"))
                body = b.blob[start:]
                self.send_response(206 if rng else 200)
                self.send_header("Content-Length", str(b.content_length or len(body)))
                self.end_headers()
                sent = 0
                for i in range(0, len(body), 65536):
                    piece = body[i : i + 65536]
                    if b.cut_after is not None and start + sent + len(piece) > b.cut_after:
                        self.wfile.write(piece[: b.cut_after - start - sent])
                        b.cut_after = None  # only the first time
                        self.close_connection = True
                        return
                    self.wfile.write(piece)
                    sent += len(piece)
                    if b.delay:
                        time.sleep(b.delay)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls / "srv.crt", tls / "srv.key")
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.host = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def serve(
        self, blob: bytes, layers: list[dict[str, object]] | None = None, **kw: object
    ) -> None:
        layers = layers or [{"mediaType": SIF_LAYER, "digest": digest_of(blob), "size": len(blob)}]
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI,
            "config": {"mediaType": SIF_CONFIG, "digest": digest_of(b"{}"), "size": 2},
            "layers": layers,
        }
        self.b = Behaviour(json.dumps(manifest).encode(), blob, **kw)  # type: ignore[arg-type]


@pytest.fixture
def server(tls: Path) -> Iterator[Server]:
    s = Server(tls)
    yield s
    s.httpd.shutdown()


@pytest.fixture(params=["requests", "stdlib"])
def cache_for(
    request: pytest.FixtureRequest, tmp_path: Path, tls: Path
) -> Callable[[Server], ImageCache]:
    """A cache on the server, through each transport (agent/transport.py) in turn."""

    def make(s: Server) -> ImageCache:
        cfg = tmp_path / "config.yaml"
        cfg.write_text(
            f'registry: "{s.host}"\nca_bundle: {tls / "ca.crt"}\n'
            f"credentials: {tmp_path / 'none.yaml'}\ncache_dir: {tmp_path / 'cache'}\n"
            "read_timeout: 5\n"
        )
        site = load_config(cfg)
        light = request.param == "stdlib"
        return ImageCache(site, client_factory=lambda host: client_for(site, host, light=light))

    return make


def a_sif(make_sif: Callable[[dict[str, str]], Path], size: int = 0) -> bytes:
    """A real SIF of at least ``size`` bytes (random text, so squashfs cannot shrink it)."""
    blob = make_sif({"etc/marker": os.urandom(size).hex()}).read_bytes()
    assert len(blob) >= size
    return blob


def nothing_published(cache: ImageCache) -> None:
    assert not list((cache.root / "images").glob("*.sif"))


def test_sha256_mismatch(
    server: Server,
    cache_for: Callable[[Server], ImageCache],
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    good = a_sif(make_sif)
    evil = bytearray(good)
    evil[-1] ^= 0xFF
    server.serve(
        bytes(evil), layers=[{"mediaType": SIF_LAYER, "digest": digest_of(good), "size": len(good)}]
    )
    cache = cache_for(server)
    with pytest.raises(VerificationError, match="sha256 of the download does not match"):
        cache.ensure(cache.cfg.reference("x:1"))
    nothing_published(cache)
    assert not any((cache.root / "tmp").iterdir())  # and no partial kept


def test_two_layers(server: Server, cache_for: Callable[[Server], ImageCache]) -> None:
    layer = {"mediaType": SIF_LAYER, "digest": digest_of(b"a"), "size": 1}
    server.serve(b"a", layers=[layer, layer])
    cache = cache_for(server)
    with pytest.raises(VerificationError, match="exactly one layer, this one has 2"):
        cache.ensure(cache.cfg.reference("x:1"))
    nothing_published(cache)


def test_non_sif_layer(server: Server, cache_for: Callable[[Server], ImageCache]) -> None:
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
    cache = cache_for(server)
    with pytest.raises(VerificationError, match="not a SIF file"):
        cache.ensure(cache.cfg.reference("x:1"))
    nothing_published(cache)


def test_bytes_that_are_not_a_sif(
    server: Server, cache_for: Callable[[Server], ImageCache]
) -> None:
    blob = b"#!/bin/sh\necho not a sif\n" + b"\0" * 100
    server.serve(blob)
    cache = cache_for(server)
    with pytest.raises(VerificationError, match="not a SIF file"):
        cache.ensure(cache.cfg.reference("x:1"))
    nothing_published(cache)


def test_ten_gigabyte_content_length(
    server: Server,
    cache_for: Callable[[Server], ImageCache],
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    blob = a_sif(make_sif)
    server.serve(blob, content_length=10 << 30)
    cache = cache_for(server)
    with pytest.raises(VerificationError, match=f"sends {10 << 30} bytes .* has {len(blob)}"):
        cache.ensure(cache.cfg.reference("x:1"))
    nothing_published(cache)


def test_broken_download_resumes_with_range(
    server: Server,
    cache_for: Callable[[Server], ImageCache],
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    blob = a_sif(make_sif, size=3_000_000)
    server.serve(blob, cut_after=2_500_000)  # past the client's first 1 MiB pieces
    cache = cache_for(server)
    with pytest.raises(RegistryUnreachable):
        cache.ensure(cache.cfg.reference("x:1"))
    [partial] = (cache.root / "tmp").iterdir()
    kept = partial.stat().st_size
    assert 0 < kept < len(blob)
    got = cache.ensure(cache.cfg.reference("x:1"))
    assert server.b.ranges == [f"bytes={kept}-"]
    assert got.path.read_bytes() == blob


def test_kill_9_mid_pull_then_resume(
    server: Server,
    cache_for: Callable[[Server], ImageCache],
    tmp_path: Path,
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    blob = a_sif(make_sif, size=2_000_000)
    server.serve(blob, delay=0.05)  # about 40 pieces: 2 s for the whole blob
    cache = cache_for(server)
    env = {**os.environ, "TFIMAGE_CONFIG": str(tmp_path / "config.yaml")}
    puller = subprocess.Popen(
        [sys.executable, "-m", "tfimage.agent.cli", "pull", "x:1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tmp = cache.root / "tmp"
    try:
        for _ in range(200):
            parts = list(tmp.glob("*.partial")) if tmp.exists() else []
            if parts and parts[0].stat().st_size > 200_000:
                break
            time.sleep(0.02)
        puller.send_signal(signal.SIGKILL)
    finally:
        puller.wait(10)
    [partial] = tmp.glob("*.partial")
    kept = partial.stat().st_size
    assert 0 < kept < len(blob)
    nothing_published(cache)
    server.b.delay = 0
    got = cache.ensure(cache.cfg.reference("x:1"))
    assert server.b.ranges and int(server.b.ranges[0].split("=")[1].rstrip("-")) >= kept
    assert got.path.read_bytes() == blob


def test_429_then_success(
    server: Server,
    cache_for: Callable[[Server], ImageCache],
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    blob = a_sif(make_sif)
    server.serve(blob, busy=2)
    cache = cache_for(server)
    got = cache.ensure(cache.cfg.reference("x:1"))
    assert got.path.read_bytes() == blob
    assert server.b.manifest_requests == 3  # two 429s, retried, then the answer


def test_expired_bearer_token_is_fetched_again(
    server: Server,
    cache_for: Callable[[Server], ImageCache],
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    blob = a_sif(make_sif)
    server.serve(blob, bearer=True)
    cache = cache_for(server)
    got = cache.ensure(cache.cfg.reference("proj/x:1"))
    assert got.path.read_bytes() == blob
    asked = [t for t in server.b.tokens if t != "expired"]
    # One token for the manifest, a fresh one once it expired, for the same repository.
    assert len(asked) == 2 and set(asked) == {"repository:proj/x:pull"}


def test_full_disk_is_a_clear_error_and_leaves_the_cache_consistent(
    server: Server, tmp_path: Path, tls: Path, make_sif: Callable[[dict[str, str]], Path]
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
        )
        cache = ImageCache(load_config(cfg))
        with pytest.raises(CacheError, match="No space left on device"):
            cache.ensure(cache.cfg.reference("x:1"))
        nothing_published(cache)
        assert not any((cache.root / "tmp").iterdir())  # the partial is gone, space back
        assert cache.entries() == []
    finally:
        subprocess.run(["umount", str(small)], check=True, timeout=30)

"""A registry that lies or breaks, served over real TLS by a small server in the test
(the hostile-registry tests, the hooks' and the transports')."""

from __future__ import annotations

import hashlib
import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

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
    cut_after: int | None = None  # close the connection at this byte of the blob...
    cuts: int = 1  # ... this many times
    delay: float = 0.0  # seconds between 64 KiB pieces
    stall_after: int | None = None  # send this many bytes of the blob, then nothing
    ranges: list[str] = field(default_factory=list)
    ignore_range: bool = False  # answer 200 with the whole blob, as some servers do
    busy: int = 0  # answer 429 to this many manifest requests first
    bearer: bool = False  # Harbor's token flow; each token is good for one request
    tokens: list[str] = field(default_factory=list)  # scopes asked for, in order
    manifest_requests: int = 0
    token_text: str | None = None  # hand out this token instead of t<N>
    realm_host: str | None = None  # the realm's host[:port] (default: this server's)
    redirect_blob: str | None = None  # answer blob GETs with 307 to this Location
    basic: bool = False  # challenge requests without credentials for Basic auth
    status: int | None = None  # answer every request with this status and nothing else
    blob_status: int | None = None  # answer blob requests alone with this status
    # Shed load as Harbor's max_upstream_conn does: 429 with Retry-After to any
    # request beyond this many in flight; how many were shed, and the most served
    # at once.
    max_in_flight: int | None = None
    retry_after: str = "1"
    shed: int = 0
    peak: int = 0
    in_flight: int = 0
    # tag list pages in the order asked for: (tags, the Link header to send or None)
    tag_pages: list[tuple[list[str], str | None]] = field(default_factory=list)
    # (path, Authorization header or "") of every request, in order
    seen: list[tuple[str, str]] = field(default_factory=list)


class Server:
    """The hostile registry: ``tls`` holds srv.crt and srv.key for ``address``."""

    def __init__(self, tls: Path, address: str = "127.0.0.1") -> None:
        self.b = Behaviour()
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                b = outer.b
                if b.max_in_flight is None:
                    self._get()
                    return
                with outer.lock:
                    admitted = b.in_flight < b.max_in_flight
                    if admitted:
                        b.in_flight += 1
                        b.peak = max(b.peak, b.in_flight)
                    else:
                        b.shed += 1
                if not admitted:
                    self.send_response(429)
                    self.send_header("Retry-After", b.retry_after)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                try:
                    self._get()
                finally:
                    with outer.lock:
                        b.in_flight -= 1

            def _get(self) -> None:
                b = outer.b
                b.seen.append((self.path, self.headers.get("Authorization", "")))
                if b.status is not None:
                    self.send_response(b.status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path.startswith("/service/token"):
                    scope = self.path.split("scope=", 1)[1].split("&")[0]
                    b.tokens.append(unquote(scope))
                    token = b.token_text or f"t{len(b.tokens)}"
                    body = json.dumps({"token": token}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                # /redirected/ stands for a storage backend's signed URL: no auth asked.
                redirected = self.path.startswith("/redirected/")
                if b.basic and not redirected and not self.headers.get("Authorization"):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="hostile"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if b.bearer and self.headers.get("Authorization") != f"Bearer t{len(b.tokens)}":
                    realm = f"https://{b.realm_host or outer.host}/service/token"
                    self.send_response(401)
                    self.send_header(
                        "WWW-Authenticate", f'Bearer realm="{realm}",service="harbor-registry"'
                    )
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if b.bearer:
                    b.tokens.append("expired")  # the token just used is now stale
                if "/tags/list" in self.path and b.tag_pages:
                    asked = sum(1 for path, _ in b.seen if "/tags/list" in path)
                    tags, link = b.tag_pages[min(asked, len(b.tag_pages)) - 1]
                    body = json.dumps({"name": "x", "tags": tags}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    if link:
                        self.send_header("Link", link)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
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
                if b.blob_status is not None and "/blobs/" in self.path:
                    self.send_response(b.blob_status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if b.redirect_blob is not None and "/blobs/" in self.path:
                    self.send_response(307)
                    self.send_header("Location", b.redirect_blob)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start, end = 0, len(b.blob)
                rng = self.headers.get("Range")
                if rng:
                    b.ranges.append(rng)
                if rng and not b.ignore_range:
                    first, _, last = rng.removeprefix("bytes=").partition("-")
                    start, end = int(first), int(last) + 1 if last else len(b.blob)
                body = b.blob[start:end]
                self.send_response(206 if rng and not b.ignore_range else 200)
                self.send_header("Content-Length", str(b.content_length or len(body)))
                if rng and not b.ignore_range:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(b.blob)}")
                self.end_headers()
                sent = 0
                for i in range(0, len(body), 65536):
                    piece = body[i : i + 65536]
                    at = start + sent
                    if b.cut_after is not None and at <= b.cut_after < at + len(piece):
                        self.wfile.write(piece[: b.cut_after - at])
                        b.cuts -= 1
                        if not b.cuts:
                            b.cut_after = None
                        self.close_connection = True
                        return
                    self.wfile.write(piece)
                    sent += len(piece)
                    if b.delay:
                        time.sleep(b.delay)
                    if b.stall_after is not None and sent >= b.stall_after:
                        self.wfile.flush()
                        time.sleep(30)  # stopped, as a SIGSTOPped registry is
                        return

        self.httpd = ThreadingHTTPServer((address, 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls / "srv.crt", tls / "srv.key")
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.host = f"{address}:{self.httpd.server_address[1]}"
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

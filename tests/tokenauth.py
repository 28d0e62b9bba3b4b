"""A Harbor-like token service for a real registry configured with ``auth: token``.

Harbor puts CNCF distribution behind token auth: a client asks the registry, gets
``401`` with ``WWW-Authenticate: Bearer realm=.../service/token,service=...,scope=...``,
fetches a token from the realm with its robot account's basic credentials, and sends
``Authorization: Bearer <JWT>``.  The registry itself checks each JWT: the signature
(through the ``x5c`` certificate against its ``rootcertbundle``), issuer, audience,
expiry (with 60 s of leeway) and the repository and actions it grants.

This service signs real RS256 JWTs with ``openssl`` and grants the robot account
what it asks for in its own project only (``robot$library+...`` → ``library/...``),
as Harbor's project robots are.  It records every scope it was asked for, and can
be told to hand out tokens that expire within seconds.
"""

from __future__ import annotations

import base64
import hmac
import json
import ssl
import subprocess
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

ISSUER = "tfimage-test-token"
SERVICE = "harbor-registry"
LEEWAY = 60  # distribution's, on exp and nbf


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def signing_cert(d: Path) -> tuple[Path, Path]:
    """A self-signed RSA key and certificate to sign tokens with (the registry's
    ``rootcertbundle``)."""
    key, crt = d / "token.key", d / "token.crt"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"),
            *("-subj", "/CN=tfimage test token signer", "-keyout", str(key), "-out", str(crt)),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return key, crt


class TokenService:
    """``GET /service/token?service=...&scope=...`` over TLS, in a thread."""

    def __init__(
        self, tls: Path, key: Path, crt: Path, username: str, password: str, project: str
    ) -> None:
        self.key, self.crt = key, crt
        der = subprocess.run(
            ["openssl", "x509", "-in", str(crt), "-outform", "DER"],
            check=True,
            capture_output=True,
            timeout=60,
        ).stdout
        self.x5c = base64.b64encode(der).decode()
        self.username, self.password, self.project = username, password, project
        self.scopes: list[str] = []  # every scope asked for, in order ("" for none)
        self.refused = 0  # requests with wrong or no credentials
        self.issued: list[str] = []  # every token handed out
        self.lifetime = 300  # seconds a token is good for, leeway aside
        self.short_lived = 0  # this many next tokens expire within 5 s
        self._lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                service._answer(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls / "srv.crt", tls / "srv.key")
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.realm = f"https://127.0.0.1:{self.server.server_address[1]}/service/token"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _authorized(self, header: str) -> str | None:
        if not header.startswith("Basic "):
            return None
        try:
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        ok = hmac.compare_digest(user.encode(), self.username.encode()) and hmac.compare_digest(
            password.encode(), self.password.encode()
        )
        return user if ok else None

    def _answer(self, req: BaseHTTPRequestHandler) -> None:
        url = urlsplit(req.path)
        query = parse_qs(url.query)
        user = self._authorized(req.headers.get("Authorization", ""))
        if url.path != "/service/token" or query.get("service") != [SERVICE] or not user:
            with self._lock:
                self.refused += 1
            req.send_response(401 if url.path == "/service/token" else 404)
            req.send_header("Content-Length", "0")
            req.end_headers()
            return
        access = []
        scopes = query.get("scope", [])
        with self._lock:
            self.scopes.extend(scopes or [""])
            short = self.short_lived > 0
            self.short_lived -= short
        for scope in scopes:
            kind, name, actions = [*scope.split(":"), "", ""][:3]
            if kind == "repository" and name.startswith(self.project + "/"):
                granted = [a for a in actions.split(",") if a in ("pull", "push")]
                access.append({"type": kind, "name": name, "actions": granted})
        token = self._sign(user, access, short)
        with self._lock:
            self.issued.append(token)
        body = json.dumps({"token": token, "expires_in": self.lifetime})
        data = body.encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    def _sign(self, user: str, access: list[dict[str, object]], short: bool) -> str:
        now = int(time.time())
        # A short-lived token: past its exp, within the registry's leeway for 5 s more.
        exp = now - LEEWAY + 5 if short else now + self.lifetime
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {
            "iss": ISSUER,
            "sub": user,
            "aud": SERVICE,
            "exp": exp,
            "nbf": now - 1,
            "iat": now,
            "jti": uuid.uuid4().hex,
            "access": access,
        }
        signed = _b64url(json.dumps(header).encode()) + "." + _b64url(json.dumps(claims).encode())
        sig = subprocess.run(
            ["openssl", "dgst", "-sha256", "-sign", str(self.key)],
            input=signed.encode(),
            check=True,
            capture_output=True,
            timeout=60,
        ).stdout
        return signed + "." + _b64url(sig)

"""HTTP transports for the registry client: one interface, two implementations, and
what reads their answers (a bounded body, an error's text).

``RegistryClient`` talks to a ``Transport``; tests and callers inject one instead of
patching.  Both raise only ``TransportError`` (``TLSError`` for certificate trouble),
so the client never sees a library's own exception types.  The redirect rules are
``Transport.request``'s, once for both; each implementation says only how one
exchange goes.

- ``StdlibTransport``: ``http.client`` + ``ssl``, nothing else imported.  For all a
  node does: pinning a tag at submit (on the job-launch path, where ``import
  requests`` alone costs ~110 ms, several times the request itself), manifests, and
  blob downloads (``readinto`` straight into the stripe buffers: no copy).
- ``RequestsTransport``: a pooled ``requests.Session``; for pushes.

Neither reads proxies or netrc from the environment: only what the config says.
"""

from __future__ import annotations

import abc
import base64
import functools
import http.client
import os
import ssl
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

from tfimage.agent.core.errors import VerificationError

Body = bytes | Iterable[bytes] | None


class TransportError(Exception):
    """No usable answer: connection refused or reset, timeout, a read that broke off."""


class TransportTimeout(TransportError):  # noqa: N818 - it names what happened
    """Nothing came within the timeout: a peer that stalled (or a SIGSTOPped one)."""


def _failed(e: BaseException) -> TransportError:
    """The transport's error for ``e``: a timeout stays a timeout."""
    text = str(e) or type(e).__name__
    if isinstance(e, TimeoutError) or "timed out" in text.lower():
        return TransportTimeout(text)
    return TransportError(text)


class TLSError(TransportError):
    """The peer's certificate was not accepted."""


class RedirectRefused(TransportError):  # noqa: N818 - it names what happened
    """A redirect tfimage does not follow: from https to anything else."""


MAX_REDIRECTS = 5


def redirect(current: str, location: str) -> tuple[str, bool]:
    """Where a redirect from ``current`` to ``location`` leads, and whether the
    request's credentials may go along: only to the same scheme and host[:port].
    From https, only https is followed (:class:`RedirectRefused`): a registry's
    answer must not send a pull, or a password, over plain HTTP."""
    if not location:
        raise TransportError("a redirect without a Location")
    if any(c <= " " or c >= "\x7f" for c in location):
        raise RedirectRefused(
            "refused a redirect to a URL with spaces, control or non-ASCII characters"
        )
    target = urllib.parse.urljoin(current, location)
    cur, new = urllib.parse.urlsplit(current), urllib.parse.urlsplit(target)
    if new.scheme not in ("http", "https") or (cur.scheme == "https" and new.scheme != "https"):
        raise RedirectRefused(f"refused a redirect from {cur.scheme} to {new.scheme or '?'}")
    return target, (new.scheme, new.netloc) == (cur.scheme, cur.netloc)


class Headers(Protocol):
    """Case-insensitive response headers (requests' dict or http.client's message)."""

    def get(self, name: str, default: Any = None) -> Any: ...

    def __contains__(self, name: str, /) -> bool: ...

    def __getitem__(self, name: str) -> Any: ...


class Response(Protocol):
    status_code: int

    @property
    def headers(self) -> Headers: ...

    def read(self, n: int) -> bytes:
        """Up to ``n`` raw body bytes (b"" at the end); raises TransportError."""
        ...

    def readinto(self, buf: memoryview) -> int:
        """Fill ``buf`` from the body (fewer bytes only at its end); raises TransportError."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Response: ...

    def __exit__(self, *exc: object) -> None: ...


_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# Only these are followed: another method's body would have to be sent again.
_FOLLOWED = ("GET", "HEAD")


@dataclass(slots=True)
class _Hop:
    """One request as the redirect loop sends it, hop after hop (it changes the URL
    and, off-host, drops the credentials)."""

    method: str
    url: str
    # never in a repr: they carry the Authorization header and the password
    headers: dict[str, str] = field(repr=False)
    auth: tuple[str, str] | None = field(repr=False)
    timeout: tuple[float, float]
    verify: str | bool
    data: Body


@dataclass(frozen=True, slots=True)
class _Redirect:
    """An answer that is a redirect to follow; its response is already let go of."""

    location: str


class Transport(abc.ABC):
    """What ``RegistryClient`` sends through.  A base class, not a protocol, so both
    implementations share one redirect loop: one set of rules for where a request and
    its credentials may go."""

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str],
        auth: tuple[str, str] | None,
        timeout: tuple[float, float],
        verify: str | bool,
        data: Body = None,
    ) -> Response:
        """Send, following redirects (at most 5) as :func:`redirect` allows:
        credentials only to the same host."""
        hop = _Hop(method, url, self._headers(headers, auth), auth, timeout, verify, data)
        for _ in range(MAX_REDIRECTS + 1):
            answer = self._exchange(hop)
            if not isinstance(answer, _Redirect):
                return answer
            hop.url, same = redirect(hop.url, answer.location)
            if not same:  # never un-done: a later hop back gets none either
                hop.auth = None
                hop.headers.pop("Authorization", None)
        raise TransportError("too many redirects")

    @abc.abstractmethod
    def _headers(self, headers: Mapping[str, str], auth: tuple[str, str] | None) -> dict[str, str]:
        """The headers every hop sends."""

    @abc.abstractmethod
    def _exchange(self, hop: _Hop) -> Response | _Redirect:
        """One request, one answer.  A redirect to follow is let go of here: whether
        its body is drained or its connection dropped is the implementation's call."""


def read_capped(resp: Response, cap: int, what: str) -> bytes:
    """The whole body, refused (:class:`VerificationError`) once over ``cap`` bytes,
    as announced or as it comes: a small answer (manifest, tag list, token) must not
    fill memory.  A read that broke off raises ``TransportError``."""
    length = resp.headers.get("Content-Length")
    if length and length.isdigit() and int(length) > cap:
        raise VerificationError(f"{what} is larger than {cap} bytes")
    buf = bytearray()
    for chunk in iter(lambda: resp.read(65536), b""):
        buf += chunk
        if len(buf) > cap:
            raise VerificationError(f"{what} is larger than {cap} bytes")
    return bytes(buf)


def brief(e: BaseException) -> str:
    """What a registry error quotes of a transport's: its first line, bounded, as
    it goes on to a user's terminal and the logs."""
    text = _first_line(e)
    return text if len(text) < 160 else text[:157] + "..."


def basic_auth(auth: tuple[str, str]) -> str:
    return "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode("ascii")


# -- http.client --------------------------------------------------------------------


class _Closing:
    """``with response:`` closes it, for both transports' responses."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _StdlibResponse(_Closing):
    def __init__(self, resp: http.client.HTTPResponse, conn: http.client.HTTPConnection) -> None:
        self._resp = resp
        self._conn = conn
        self.status_code = resp.status

    @property
    def headers(self) -> Headers:
        return self._resp.headers  # an email.message.Message: case-insensitive

    def read(self, n: int) -> bytes:
        try:
            return self._resp.read(n)
        except (OSError, http.client.HTTPException) as e:
            raise _failed(e) from None

    def readinto(self, buf: memoryview) -> int:
        try:
            # Straight from the TLS layer into the caller's buffer: no bytes object.
            return self._resp.readinto(buf)
        except (OSError, http.client.HTTPException) as e:
            raise _failed(e) from None

    def close(self) -> None:
        # Unread bytes would be taken for the next response on this kept-alive
        # connection: drain a small rest, otherwise drop the connection.
        if not self._resp.isclosed():
            rest = self._resp.length
            try:
                if rest is not None and rest <= 65536 and not self._resp.will_close:
                    self._resp.read()
                else:
                    self._conn.close()
            except (OSError, http.client.HTTPException):
                self._conn.close()
        self._resp.close()


def tls_context(verify: str | bool) -> ssl.SSLContext:
    """The TLS context for ``verify`` (a CA bundle, True for the system's, False for
    none), made once per process and bundle: loading a bundle costs ~2 ms a
    connection, and the daemon makes it before it forks, for its workers to share.
    A bundle that changed on disk (a site's CA rotated) is loaded again."""
    if isinstance(verify, str):
        try:
            st = os.stat(verify)
            return _tls_context(verify, (st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            pass  # load_verify_locations says what is wrong with it
    return _tls_context(verify, None)


@functools.lru_cache(maxsize=8)
def _tls_context(verify: str | bool, _version: tuple[int, int, int] | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
    if verify is False:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class StdlibTransport(Transport):
    """``http.client`` with one kept-alive connection per host."""

    def __init__(self) -> None:
        self._conns: dict[tuple[str, str, str | bool], http.client.HTTPConnection] = {}

    def _conn(
        self, scheme: str, netloc: str, timeout: tuple[float, float], verify: str | bool
    ) -> http.client.HTTPConnection:
        key = (scheme, netloc, verify)
        conn = self._conns.get(key)
        if conn is None:
            if scheme == "https":
                ctx = tls_context(verify)
                conn = http.client.HTTPSConnection(netloc, timeout=timeout[0], context=ctx)
            else:
                conn = http.client.HTTPConnection(netloc, timeout=timeout[0])
            self._conns[key] = conn
        return conn

    def _headers(self, headers: Mapping[str, str], auth: tuple[str, str] | None) -> dict[str, str]:
        hdrs = dict(headers)
        # Basic credentials travel as a header, which the redirect loop drops off-host.
        if auth and "Authorization" not in hdrs:
            hdrs["Authorization"] = basic_auth(auth)
        return hdrs

    def _exchange(self, hop: _Hop) -> Response | _Redirect:
        parts = urllib.parse.urlsplit(hop.url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn = self._conn(parts.scheme, parts.netloc, hop.timeout, hop.verify)
        connected = False
        try:
            if conn.sock is None:
                conn.connect()
                sock: Any = conn.sock  # connect() timed out at timeout[0]; reads get theirs
                sock.settimeout(hop.timeout[1])
            connected = True
            conn.request(hop.method, path or "/", body=hop.data, headers=hop.headers)
            resp = conn.getresponse()
        except ssl.SSLCertVerificationError as e:
            conn.close()
            raise TLSError(e.verify_message or str(e)) from None
        except ssl.SSLError as e:
            conn.close()
            raise TLSError(str(e)) from None
        except (OSError, http.client.HTTPException, ValueError) as e:
            # ValueError: http.client refusing what an answer led to (a URL or a
            # header it will not send): the registry's fault, not ours.  Only a
            # timeout once connected is a stall: connecting (TCP, TLS handshake)
            # is asked again, as a registry with a full accept queue may answer.
            conn.close()
            if not connected:
                raise TransportError(str(e) or type(e).__name__) from None
            raise _failed(e) from None
        if resp.status in _REDIRECTS and hop.method in _FOLLOWED:
            location = resp.getheader("Location", "")
            # A redirect's body is nothing we want: a small one is drained (the
            # connection stays usable), anything else drops the connection.
            if resp.length is not None and resp.length <= 65536 and not resp.will_close:
                resp.read()
            else:
                conn.close()
            resp.close()
            return _Redirect(location)
        if hop.method == "HEAD":
            resp.read()
        return _StdlibResponse(resp, conn)


# -- requests -------------------------------------------------------------------------


class _RequestsResponse(_Closing):
    def __init__(self, resp: Any) -> None:
        self._resp = resp
        self.status_code: int = resp.status_code
        self._stalled: TransportTimeout | None = None

    @property
    def headers(self) -> Headers:
        return self._resp.headers  # type: ignore[no-any-return]

    def read(self, n: int) -> bytes:
        import requests
        import urllib3

        try:
            # Straight from the socket in big reads: requests' iter_content loop, not
            # the hash, is what limits a naive verified download.
            return self._resp.raw.read(n, decode_content=False)  # type: ignore[no-any-return]
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            raise _failed(e) from None

    def readinto(self, buf: memoryview) -> int:
        got = 0
        # 1 MiB at a time: urllib3 drops what a read had when the connection breaks.
        if self._stalled is not None:  # the last call's, kept for this one
            raise self._stalled
        while got < len(buf):
            try:
                data = self.read(min(len(buf) - got, 1 << 20))
            except TransportError as e:
                if got:
                    # What came before the break; the next call raises, a stall as a
                    # stall (urllib3's own next error would say "incomplete read").
                    if isinstance(e, TransportTimeout):
                        self._stalled = e
                    return got
                raise
            if not data:
                break
            buf[got : got + len(data)] = data
            got += len(data)
        return got

    def close(self) -> None:
        self._resp.close()


class RequestsTransport(Transport):
    """A pooled ``requests.Session`` (or the one given)."""

    def __init__(self, session: Any = None) -> None:
        import requests

        self._session = session or requests.Session()
        self._session.trust_env = False

    def _headers(self, headers: Mapping[str, str], auth: tuple[str, str] | None) -> dict[str, str]:
        # Raw bytes, as they are stored: a blob's digest is of those, not of a decoding.
        return {"Accept-Encoding": "identity", **headers}

    def _exchange(self, hop: _Hop) -> Response | _Redirect:
        import requests

        try:
            resp = self._session.request(
                hop.method,
                hop.url,
                headers=hop.headers,
                auth=hop.auth,
                timeout=hop.timeout,
                verify=hop.verify,
                allow_redirects=False,  # followed by Transport.request, by redirect()'s rules
                stream=True,
                data=hop.data,
            )
        except requests.exceptions.SSLError as e:
            raise TLSError(_first_line(e)) from None
        except requests.ConnectTimeout as e:  # connecting is asked again
            raise TransportError(_first_line(e)) from None
        except requests.Timeout as e:
            raise TransportTimeout(_first_line(e)) from None
        except requests.RequestException as e:  # connection and the rest
            raise TransportError(_first_line(e)) from None
        if resp.status_code in _REDIRECTS and hop.method in _FOLLOWED:
            location = resp.headers.get("Location", "")
            resp.close()
            return _Redirect(location)
        return _RequestsResponse(resp)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__

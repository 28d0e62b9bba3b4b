"""A small, strict OCI distribution client for Harbor-style registries: manifests,
blobs (whole or by range), tag lists and pushes, with bounded retries and bounded
answers.

Why not oras-py's ``Registry``?  It sets no timeouts, retries for minutes on a
wrong password, reuses one token across repositories and does not verify blob
digests.  This client does all four, and takes an injected ``Transport``
(registry/transport.py) so tests swap the transport instead of patching.  How it
authenticates is auth.py's; what a SIF artifact's manifest looks like, artifact.py's.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tfimage.agent.core.errors import (
    ImageNotFound,
    RangeUnsupported,
    RegistryError,
    RegistryStalled,
    RegistryUnreachable,
    VerificationError,
)
from tfimage.agent.core.reference import is_tag
from tfimage.agent.registry.artifact import SIF_CONFIG_BLOB, sif_manifest
from tfimage.agent.registry.auth import HostAuth
from tfimage.agent.registry.credentials import Credential
from tfimage.agent.registry.mediatypes import DOCKER_LIST, DOCKER_MANIFEST, OCI_INDEX, OCI_MANIFEST
from tfimage.agent.registry.transport import (
    RedirectRefused,
    Response,
    TLSError,
    Transport,
    TransportError,
    TransportTimeout,
    brief,
    read_capped,
)

MANIFEST_ACCEPT = ", ".join((OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST))

MAX_MANIFEST = 4 << 20
CHUNK = 1 << 20
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
# The longest a Retry-After is taken at its word; longer ones are waited this long.
RETRY_AFTER_MAX = 30.0
# A tag list's next page (distribution's Link header); anything else ends the list.
_NEXT_PAGE = re.compile(
    r'<(/v2/[A-Za-z0-9._/-]+/tags/list\?[A-Za-z0-9._%=&-]{1,512})>;\s*rel="next"\Z'
)


@dataclass(frozen=True, slots=True)
class Manifest:
    digest: str
    media_type: str
    raw: bytes
    body: dict[str, Any]


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class BlobReader:
    """An open blob response that yields exactly the bytes asked for, into the caller's
    buffers (``readinto``: no bytes objects on the download's path)."""

    def __init__(self, resp: Response, host: str, *, skip: int, left: int) -> None:
        self._resp = resp
        self._host = host
        self._skip = skip  # a whole blob sent for a range: what comes before it
        self.left = left

    def readinto(self, buf: memoryview) -> int:
        """Fill ``buf`` (or what is left of the range); 0 once all of it has come.
        Fewer bytes when the body broke off: the next call raises
        :class:`RegistryUnreachable` (so a caller keeps what came)."""
        want = buf[: min(len(buf), self.left)]
        got = 0
        try:
            while self._skip:  # into the caller's buffer, overwritten below
                n = self._resp.readinto(buf[: min(self._skip, len(buf))])
                if not n:
                    break
                self._skip -= n
            while got < len(want) and (n := self._resp.readinto(want[got:])):
                got += n
        except TransportTimeout as e:
            if not got:
                raise RegistryStalled(f"{self._host}: download stalled: {brief(e)}") from None
            self.left -= got
            return got
        except TransportError as e:
            if not got:
                raise RegistryUnreachable(f"{self._host}: download broke off: {brief(e)}") from None
            self.left -= got
            return got  # what came before the break counts; the next call raises
        self.left -= got
        if want and not got:  # the body ended early: what came was returned before
            raise RegistryUnreachable(f"{self._host}: download broke off {self.left} bytes short")
        return got

    def close(self) -> None:
        self._resp.close()

    def __enter__(self) -> BlobReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RegistryClient:
    """One registry host.  Its tokens are cached per repository scope (auth.py)."""

    def __init__(
        self,
        host: str,
        credential: Credential | None = None,
        *,
        ca_bundle: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 30.0,
        attempts: int = 3,
        busy_for: float = 60.0,
        transport: Transport | None = None,
        scheme: str = "https",
        sleep: Callable[[float], None] = time.sleep,
        token_realms: tuple[str, ...] = (),
        projects: Mapping[str, Credential] | None = None,
    ) -> None:
        self.host = host
        self.credential = credential
        self._base = f"{scheme}://{host}/v2"
        self._timeout = (connect_timeout, read_timeout)
        self._attempts = max(1, attempts)
        # A registry shedding load (429, or 503 with Retry-After) is asked again for
        # this many seconds of waiting, not a number of times: it must never fail a
        # job sooner than one that answers slowly (the hook's deadline ends both).
        self._busy_for = busy_for
        if transport is None:
            from tfimage.agent.registry.transport import RequestsTransport

            transport = RequestsTransport()
        self._transport = transport
        self._verify: str | bool = ca_bundle or True
        self._sleep = sleep
        self._auth = HostAuth(
            host,
            credential,
            transport=transport,
            timeout=self._timeout,
            verify=self._verify,
            token_realms=token_realms,
            projects=projects,
        )

    def credential_for(self, repository: str) -> Credential | None:
        """The credential this client reads ``repository`` with (its project's own
        robot where the credentials file names one)."""
        return self._auth.credential(repository)

    # -- transport ---------------------------------------------------------------

    def _send(self, method: str, url: str, scope: str, **kw: Any) -> Response:
        """Send with auth and retries: a few on connection errors and 5xx, and for
        ``busy_for`` seconds of waiting while the registry sheds load."""
        authed_once = False
        attempt = 0
        busy = 0  # answers that shed load, and the seconds waited after them
        waited = 0.0
        while True:
            headers = dict(kw.pop("headers", None) or {})
            if (bearer := self._auth.bearer(scope)) is not None:
                headers["Authorization"] = bearer
            try:
                resp = self._transport.request(
                    method,
                    url,
                    headers=headers,
                    auth=self._auth.basic(scope),
                    timeout=self._timeout,
                    verify=self._verify,
                    **kw,
                )
            except TLSError as e:
                raise RegistryError(f"{self.host}: TLS verification failed: {brief(e)}") from None
            except RedirectRefused as e:
                raise RegistryError(f"{self.host}: {brief(e)}") from None
            except TransportTimeout as e:  # stalled: asking again costs as much again
                raise RegistryStalled(f"{self.host}: no answer: {brief(e)}") from None
            except TransportError as e:
                attempt += 1
                if attempt >= self._attempts:
                    raise RegistryUnreachable(f"{self.host}: unreachable: {brief(e)}") from None
                self._backoff(attempt)
                kw["headers"] = headers
                continue
            if resp.status_code == 401 and not authed_once:
                authed_once = True
                self._auth.answer(resp, scope)
                resp.close()
                kw["headers"] = headers
                continue
            retry_after = resp.headers.get("Retry-After")
            if resp.status_code == 429 or (resp.status_code == 503 and retry_after):
                resp.close()
                busy += 1
                delay = self._delay(busy, retry_after)
                if waited + delay > self._busy_for:
                    raise RegistryUnreachable(
                        f"{self.host}: shedding load: answered {resp.status_code} "
                        f"{busy} times over {waited:.0f} s"
                    )
                waited += delay
                self._sleep(delay)
                kw["headers"] = headers
                continue
            if resp.status_code in _RETRY_STATUS and attempt + 1 < self._attempts:
                attempt += 1
                resp.close()
                self._backoff(attempt)
                kw["headers"] = headers
                continue
            if resp.status_code == 401:
                resp.close()
                raise RegistryError(f"{self.host}: authentication refused for {scope}")
            if resp.status_code in _RETRY_STATUS:
                resp.close()
                raise RegistryUnreachable(
                    f"{self.host}: still answering {resp.status_code} after {attempt + 1} tries"
                )
            return resp

    def _backoff(self, attempt: int) -> None:
        self._sleep(self._delay(attempt, None, cap=2.0))

    @staticmethod
    def _delay(attempt: int, retry_after: str | None, cap: float = 5.0) -> float:
        """Seconds before asking again: the registry's Retry-After (seconds, at most
        RETRY_AFTER_MAX), else doubling from 0.2 s up to ``cap``; either spread by
        half either way, so that the prologs it turned away together come back
        apart."""
        if retry_after and retry_after.isdigit() and len(retry_after) < 6:
            base = min(float(retry_after), RETRY_AFTER_MAX) or 0.2
        else:
            base = min(cap, 0.2 * 2 ** min(attempt - 1, 16))
        return base * random.uniform(0.5, 1.5)  # noqa: S311 - spreading, not secrecy

    # -- reading -----------------------------------------------------------------

    def ping(self) -> None:
        """``GET /v2/`` with the configured credentials: reachable, and they are accepted."""
        resp = self._send("GET", self._base + "/", "registry:catalog:*")
        resp.close()
        if resp.status_code != 200:
            raise RegistryError(f"{self.host}: /v2/ answered {resp.status_code}")

    def manifest(self, repository: str, version: str) -> Manifest:
        """GET a manifest by tag or digest; a digest is checked against the bytes."""
        scope = f"repository:{repository}:pull"
        resp = self._send(
            "GET",
            f"{self._base}/{repository}/manifests/{version}",
            scope,
            headers={"Accept": MANIFEST_ACCEPT},
        )
        missing = f"{self.host}/{repository}:{version}: not found"
        raw = self._small_answer(resp, repository, "manifest", missing)
        digest = sha256_digest(raw)
        if version.startswith("sha256:") and digest != version:
            raise VerificationError(f"{self.host}/{repository}: manifest digest mismatch")
        try:
            body = json.loads(raw)
        except ValueError:
            raise VerificationError(f"{self.host}/{repository}: manifest is not JSON") from None
        if not isinstance(body, dict):
            raise VerificationError(f"{self.host}/{repository}: manifest is not an object")
        media = body.get("mediaType") or resp.headers.get("Content-Type", "")
        return Manifest(digest, str(media), raw, body)

    def _small_answer(self, resp: Response, repository: str, what: str, missing: str) -> bytes:
        """A manifest's or a tag list's body, bounded; a 404 is ImageNotFound(missing),
        a read that broke off RegistryUnreachable."""
        with resp:
            if resp.status_code == 404:
                raise ImageNotFound(missing)
            if resp.status_code != 200:
                raise RegistryError(
                    f"{self.host}/{repository}: {what} request failed ({resp.status_code})"
                )
            try:
                return read_capped(resp, MAX_MANIFEST, what)
            except TransportError as e:
                raise RegistryUnreachable(
                    f"{self.host}: {what} read broke off: {brief(e)}"
                ) from None

    def tags(self, repository: str, *, pages: int = 5, per_page: int = 1000) -> list[str]:
        """The repository's tags (``/v2/<name>/tags/list``, following its ``Link``
        pages on this registry): at most ``pages`` requests of ``per_page`` tags, so
        a repository of a million tags costs what five pages cost.  ImageNotFound
        when the registry knows no such repository (for these credentials)."""
        out: list[str] = []
        path = f"/{repository}/tags/list?n={per_page}"
        for _ in range(pages):
            resp = self._send("GET", self._base + path, f"repository:{repository}:pull")
            link = resp.headers.get("Link", "")
            missing = f"{self.host}/{repository}: no such repository"
            raw = self._small_answer(resp, repository, "tag list", missing)
            try:
                listed = json.loads(raw).get("tags") or []
            except (ValueError, AttributeError):
                raise RegistryError(f"{self.host}/{repository}: tag list is not JSON") from None
            if not isinstance(listed, list):
                raise RegistryError(f"{self.host}/{repository}: tag list is not a list")
            # What reaches a user's terminal: real tags only, and a bounded number.
            out += [t for t in listed[:per_page] if isinstance(t, str) and is_tag(t)]
            # Link: </v2/<name>/tags/list?n=..&last=..>; rel="next", on this registry
            m = _NEXT_PAGE.match(link)
            if not m or not m.group(1).startswith(f"/v2/{repository}/tags/list?"):
                break
            path = m.group(1).removeprefix("/v2")
        return out

    def _get_blob(self, repository: str, digest: str, byte_range: str) -> Response:
        return self._send(
            "GET",
            f"{self._base}/{repository}/blobs/{digest}",
            f"repository:{repository}:pull",
            headers={"Range": byte_range} if byte_range else {},
        )

    def open_blob(
        self, repository: str, digest: str, start: int, end: int, size: int, *, whole_ok: bool
    ) -> BlobReader:
        """Open bytes ``[start, end)`` of a blob of ``size`` bytes (the manifest's); the
        caller verifies the digest.

        A part is asked for with a Range request; only a 206 whose Content-Range names
        exactly that range is taken.  A registry that ignores Range answers 200 with the
        whole blob: ``whole_ok`` (one stream) skips to ``start``, otherwise that raises
        :class:`RangeUnsupported` so the caller streams instead.  A Content-Length that
        disagrees is refused before a byte is read.
        """
        if start == 0 and end == size:
            byte_range = ""
        else:  # open-ended when it runs to the end, as a resumed download's does
            byte_range = f"bytes={start}-" + (str(end - 1) if end < size else "")
        resp = self._get_blob(repository, digest, byte_range)
        try:
            length = resp.headers.get("Content-Length", "")
            if resp.status_code == 200:
                if length.isdigit() and int(length) != size:
                    raise VerificationError(
                        f"{self.host}/{repository}: the registry sends {int(length)} bytes "
                        f"for a blob the manifest says has {size}"
                    )
                if start and not whole_ok:
                    raise RangeUnsupported(
                        f"{self.host}: answers Range requests with the whole blob"
                    )
                return BlobReader(resp, self.host, skip=start, left=end - start)
            if resp.status_code != 206 or not byte_range:
                raise RegistryError(
                    f"{self.host}/{repository}: blob {digest[:19]} request failed "
                    f"({resp.status_code})"
                )
            got_range = resp.headers.get("Content-Range", "")
            if not got_range.startswith(f"bytes {start}-{end - 1}/") or (
                length and length != str(end - start)
            ):
                raise VerificationError(
                    f"{self.host}/{repository}: asked for bytes {start}-{end - 1}, "
                    f"got {got_range or 'no Content-Range'}"
                )
            return BlobReader(resp, self.host, skip=0, left=end - start)
        except BaseException:
            resp.close()
            raise

    # -- writing (admins and the local cluster push images with these) --------------

    def push_blob(self, repository: str, path: Path) -> tuple[str, int]:
        h = hashlib.sha256()
        size = 0
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                size += len(chunk)
            f.seek(0)
            digest = "sha256:" + h.hexdigest()
            self._upload(repository, digest, size, _FileBody(f, size))
        return digest, size

    def push_bytes(self, repository: str, data: bytes) -> str:
        digest = sha256_digest(data)
        self._upload(repository, digest, len(data), data)
        return digest

    def _upload(self, repository: str, digest: str, size: int, body: object) -> None:
        """Monolithic upload, skipped when the registry already has the blob."""
        scope = f"repository:{repository}:pull,push"
        head = self._send("HEAD", f"{self._base}/{repository}/blobs/{digest}", scope)
        head.close()
        if head.status_code == 200:
            return
        start = self._send("POST", f"{self._base}/{repository}/blobs/uploads/", scope)
        start.close()
        if start.status_code != 202 or "Location" not in start.headers:
            raise RegistryError(f"{self.host}/{repository}: upload refused ({start.status_code})")
        location = start.headers["Location"]
        if location.startswith("/"):
            location = self._base.rsplit("/v2", 1)[0] + location
        sep = "&" if "?" in location else "?"
        done = self._send(
            "PUT",
            f"{location}{sep}digest={digest}",
            scope,
            data=body,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
        )
        done.close()
        if done.status_code != 201:
            raise RegistryError(
                f"{self.host}/{repository}: blob upload failed ({done.status_code})"
            )

    def push_manifest(self, repository: str, tag: str, raw: bytes, media_type: str) -> str:
        resp = self._send(
            "PUT",
            f"{self._base}/{repository}/manifests/{tag}",
            f"repository:{repository}:pull,push",
            data=raw,
            headers={"Content-Type": media_type},
        )
        resp.close()
        if resp.status_code != 201:
            raise RegistryError(
                f"{self.host}/{repository}: manifest push failed ({resp.status_code})"
            )
        return sha256_digest(raw)

    def push_sif(self, repository: str, tag: str, sif: Path) -> str:
        """Push ``sif`` in Apptainer's ORAS shape (artifact.py); returns the manifest
        digest."""
        config_digest = self.push_bytes(repository, SIF_CONFIG_BLOB)
        layer_digest, layer_size = self.push_blob(repository, sif)
        raw = sif_manifest(config_digest, layer_digest, layer_size, sif.name)
        return self.push_manifest(repository, tag, raw, OCI_MANIFEST)


class _FileBody:
    """A file as a request body of known length, streamed, never read whole."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self._f = f
        self._size = size

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self._f.read(CHUNK):
            yield chunk

"""The node-local image cache, content-addressed by manifest digest.

Layout under ``cache_dir`` (root-owned, 0755)::

    images/sha256-<hex>.sif     published images, mode 0444, never rewritten
    images/sha256-<hex>.json    metadata: refs, size, created, last_used
    locks/sha256-<hex>.lock     one flock per digest, so one download per image
    tmp/                        downloads in progress, same filesystem as images/
    tmp/sha256-<hex>.partial    an interrupted download, resumed by the next pull
    tmp/sha256-<hex>.partial.parts  its segments' marks, for a multi-connection one

A download is streamed to ``tmp/`` (large ones over several connections at once,
segments.py), checked for size, sha256 and SIF magic, fsynced, then renamed into
``images/``: a reader sees a whole verified image or nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tfimage.agent.config import Config
from tfimage.agent.errors import (
    CacheError,
    RangeUnsupported,
    RegistryError,
    RegistryUnreachable,
    VerificationError,
)
from tfimage.agent.reference import Reference
from tfimage.agent.sif import has_magic

if TYPE_CHECKING:  # the registry client (and its transport) load only when needed
    from tfimage.agent.registry import Manifest, RegistryClient
    from tfimage.agent.segments import Segment

Progress = Callable[[int, int], None]
CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class CachedImage:
    ref: Reference  # pinned
    path: Path
    size: int
    hit: bool
    seconds: float
    source: str | None = None  # the registry or mirror that served it (None: cache hit)


def credentials_file(cfg: Config) -> Path | None:
    """Root uses the site's file; a user (submitting, on a login node) uses their own."""
    if os.geteuid() == 0:
        return Path(cfg.credentials)
    import pwd

    home = Path(pwd.getpwuid(os.geteuid()).pw_dir)
    for candidate in (home / ".config/tfimage/credentials.yaml", home / ".docker/config.json"):
        if candidate.exists():
            return candidate
    return None  # anonymous pulls


WRITEBACK = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """sync_file_range(SYNC_FILE_RANGE_WRITE): queue the range for writeback and
    return at once (Linux; Python's os module lacks it).  Best effort: the fsync
    before publishing is what makes the file durable."""
    global _libc
    if _libc is None:
        import ctypes

        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.sync_file_range.argtypes = [
                ctypes.c_int,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_uint,
            ]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


_libc: Any = None


def prefetch(chunks: Iterator[bytes], depth: int = 4) -> Iterator[bytes]:
    """Read ahead in a thread, so the network and the hash-and-write overlap
    (socket reads, sha256 and file writes all release the GIL)."""
    q: queue.Queue[bytes | BaseException | None] = queue.Queue(depth)
    stop = threading.Event()

    def pump() -> None:
        try:
            for c in chunks:
                if stop.is_set():
                    return
                q.put(c)
            q.put(None)
        except BaseException as e:  # handed to the consumer, raised there
            q.put(e)

    threading.Thread(target=pump, daemon=True).start()
    try:
        while (item := q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        with contextlib.suppress(queue.Empty):
            while True:  # unblock a producer waiting on a full queue
                q.get_nowait()


def client_for(cfg: Config, host: str, *, light: bool = False) -> RegistryClient:
    """A client for ``host`` with this node's credentials.  ``light``: the stdlib
    transport, for a few small requests on the job-launch path (no ``requests``)."""
    from tfimage.agent.credentials import load_credentials
    from tfimage.agent.registry import RegistryClient

    path = credentials_file(cfg)
    creds = load_credentials(path) if path else {}
    transport = None
    if light:
        from tfimage.agent.transport import StdlibTransport

        transport = StdlibTransport()
    return RegistryClient(
        host,
        creds.get(host),
        ca_bundle=cfg.ca_bundle,
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        transport=transport,
    )


def _key(digest: str) -> str:
    return digest.replace(":", "-")


class ImageCache:
    def __init__(
        self, cfg: Config, client_factory: Callable[[str], RegistryClient] | None = None
    ) -> None:
        self.cfg = cfg
        self.root = Path(cfg.cache_dir)
        # Manifests through the light (stdlib) transport: the many callers that only
        # resolve a tag, or wait on another's download, never import requests.  The
        # one that downloads takes a pooled requests client for the blob.
        self._client_factory = client_factory or (lambda host: client_for(cfg, host, light=True))
        self._bulk_factory = client_factory or (lambda host: client_for(cfg, host))

    def _dirs(self) -> None:
        for sub in ("", "images", "locks", "tmp"):
            d = self.root / sub
            d.mkdir(mode=0o755, exist_ok=True, parents=(sub == ""))

    def path_of(self, digest: str) -> Path:
        return self.root / "images" / f"{_key(digest)}.sif"

    @contextlib.contextmanager
    def lock(self, digest: str) -> Iterator[None]:
        fd = os.open(
            self.root / "locks" / f"{_key(digest)}.lock",
            os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
            0o600,
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def ensure(
        self, ref: Reference, progress: Progress | None = None, job: str | None = None
    ) -> CachedImage:
        """Make sure the image ``ref`` names is in the cache; return it pinned.

        ``job`` (the prolog's and the steps') becomes a holder: eviction never takes
        an image a running job holds.
        """
        started = time.monotonic()
        self._dirs()
        if ref.digest and self.path_of(ref.digest).exists():
            # Pinned and present: no registry round trip, not even an import.
            path = self.path_of(ref.digest)
            self._touch(ref, ref.digest, job=job)
            return CachedImage(ref, path, path.stat().st_size, True, time.monotonic() - started)
        last: RegistryUnreachable | None = None
        for host in self.cfg.sources(ref):
            client = self._client_factory(host)
            try:
                if ref.digest:
                    # Pinned (the prolog's case): the lock first, so the jobs waiting
                    # for one download find it done and ask the registry nothing.
                    with self.lock(ref.digest):
                        path = self.path_of(ref.digest)
                        hit = path.exists()
                        blob = None if hit else self._fill(client, host, ref, progress)
                    pinned = ref
                else:
                    manifest = client.manifest(ref.repository, ref.version)
                    pinned = ref.pinned(manifest.digest)
                    path = self.path_of(manifest.digest)
                    with self.lock(manifest.digest):
                        hit = path.exists()
                        blob = None if hit else self._fill(client, host, pinned, progress, manifest)
                self._touch(pinned, pinned.digest or "", job=job, blob=blob)
            except RegistryUnreachable as e:
                last = e  # this one is down: the next mirror serves
                continue
            return CachedImage(
                pinned,
                path,
                path.stat().st_size,
                hit,
                time.monotonic() - started,
                None if hit else host,
            )
        assert last is not None
        raise last

    def _fill(
        self,
        client: RegistryClient,
        host: str,
        pinned: Reference,
        progress: Progress | None,
        manifest: Manifest | None = None,
    ) -> str | None:
        """Under the digest's lock: put the image ``pinned`` names into the cache.
        Returns the SIF blob's digest (None for an OCI image, converted)."""
        from tfimage.agent.artifact import sif_layer
        from tfimage.agent.convert import is_image_manifest, oci_to_sif

        assert pinned.digest
        if manifest is None:
            # By digest: the client checks the manifest's bytes against it.
            manifest = client.manifest(pinned.repository, pinned.digest)
        path = self.path_of(pinned.digest)
        if pinned.transport == "docker" or is_image_manifest(manifest.body):
            # An OCI image: converted once, cached under its manifest digest.
            oci_to_sif(
                pinned,
                pinned.digest,
                path,
                self.root / "tmp",
                credential=client.credential,
                ca_bundle=self.cfg.ca_bundle,
            )
            return None
        layer = sif_layer(manifest)
        self._download(host, pinned, layer.digest, layer.size, path, progress)
        return layer.digest

    def _download(
        self,
        host: str,
        ref: Reference,
        digest: str,
        size: int,
        dest: Path,
        progress: Progress | None,
    ) -> None:
        from tfimage.agent import segments

        tmp = self.root / "tmp" / f"{dest.stem}.partial"
        marks = segments.parts_path(tmp)
        try:
            segs = segments.load_parts(marks, size) if tmp.exists() else None
            if segs is None and marks.exists():
                self._discard(tmp)  # marks without their file, of another size, damaged
            if segs is None and not tmp.exists():
                plan = segments.plan(size, self.cfg.pull_connections, self.cfg.pull_segment_bytes)
                if len(plan) > 1:
                    segments.save_parts(marks, size, plan)  # before the partial file exists
                    segs = plan
            self._fetch(host, ref, digest, size, tmp, segs, progress)
        except RangeUnsupported:
            self._discard(tmp)  # this registry streams whole blobs only
            self._fetch(host, ref, digest, size, tmp, None, progress)
        except RegistryUnreachable:
            raise  # keep the partial file (and its marks): the next pull resumes it
        except OSError as e:
            self._discard(tmp)
            raise CacheError(f"{self.root}: cannot store {ref.name}: {e.strerror}") from None
        except (VerificationError, RegistryError, CacheError):
            self._discard(tmp)
            raise
        with contextlib.suppress(FileNotFoundError):
            marks.unlink()
        os.chmod(tmp, 0o444)
        os.rename(tmp, dest)
        dirfd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)

    @staticmethod
    def _discard(tmp: Path) -> None:
        from tfimage.agent.segments import parts_path

        for p in (tmp, parts_path(tmp)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def _fetch(
        self,
        host: str,
        ref: Reference,
        digest: str,
        size: int,
        tmp: Path,
        segs: list[Segment] | None,
        progress: Progress | None,
    ) -> None:
        """Fill ``tmp`` with the blob and check it (size, sha256, SIF magic), fsynced.

        One stream (``segs`` None), resuming a partial file with a Range request; or
        segments over several connections (segments.py), resuming each from its mark.
        """
        import hashlib  # a cache hit, the launch path, never hashes

        from tfimage.agent import segments

        h = hashlib.sha256()
        head = b""
        got = 0
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "r+b") as out:
            if not stat.S_ISREG(os.fstat(out.fileno()).st_mode):
                raise CacheError(f"{tmp}: not a regular file")
            if segs is not None:
                if os.fstat(out.fileno()).st_size != size:
                    out.truncate(size)  # every segment writes at its own offset
                clients = [self._bulk_factory(host) for _ in segs]
                blocks: Iterator[bytes] = segments.fetch(
                    clients,
                    ref.repository,
                    digest,
                    tmp,
                    size,
                    segs,
                    _start_writeback,
                    WRITEBACK,
                )
            else:
                # A partial download left by an interrupted pull (a crash, a kill -9,
                # a dropped connection) is resumed: hash what is there, Range the rest.
                while block := out.read(CHUNK):
                    h.update(block)
                    if len(head) < 64:
                        head += block[: 64 - len(head)]
                    got += len(block)
                if got > size:
                    out.seek(0)
                    out.truncate()
                    h, head, got = hashlib.sha256(), b"", 0
                client = self._bulk_factory(host)
                blocks = prefetch(client.blob_chunks(ref.repository, digest, offset=got, size=size))
            flushed = got
            for chunk in blocks:
                got += len(chunk)
                if got > size:
                    raise VerificationError(
                        f"{ref.name}: blob is larger than the {size} bytes the manifest says"
                    )
                if len(head) < 64:
                    head += chunk[: 64 - len(head)]
                h.update(chunk)
                if segs is None:
                    out.write(chunk)
                    if got - flushed >= WRITEBACK:
                        # Start writing back what has arrived, so the final fsync
                        # does not wait for the whole image at once.
                        out.flush()
                        _start_writeback(out.fileno(), flushed, got - flushed)
                        flushed = got
                if progress:
                    progress(got, size)
            if got != size:
                raise RegistryUnreachable(f"{ref.name}: got {got} of {size} bytes")
            if "sha256:" + h.hexdigest() != digest:
                raise VerificationError(f"{ref.name}: sha256 of the download does not match")
            if not has_magic(head):
                raise VerificationError(f"{ref.name}: the download is not a SIF file")
            out.flush()
            os.fsync(out.fileno())

    def _touch(
        self, ref: Reference, digest: str, *, job: str | None = None, blob: str | None = None
    ) -> None:
        """Record a use: the ref, last_used, and the job now holding the entry."""
        name = f"{ref.name}:{ref.tag}" if ref.tag else ref.name

        def change(meta: dict[str, Any]) -> None:
            if name not in meta["refs"]:
                meta["refs"].append(name)
            meta["last_used"] = time.time()
            meta["size"] = self.path_of(digest).stat().st_size
            if blob:
                meta["blob"] = blob
            if job and job not in meta["holders"]:
                meta["holders"].append(job)

        self.update_meta(digest, change)

    def meta_path(self, digest: str) -> Path:
        return self.root / "images" / f"{_key(digest)}.json"

    def read_meta(self, digest: str) -> dict[str, Any]:
        try:
            meta = json.loads(self.meta_path(digest).read_text())
        except (FileNotFoundError, ValueError):
            meta = {}
        base: dict[str, Any] = {
            "digest": digest,
            "refs": [],
            "created": time.time(),
            "last_used": 0.0,
            "size": 0,
            "pinned": False,
            "holders": [],
        }
        return {**base, **meta} if isinstance(meta, dict) else base

    def update_meta(self, digest: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Read, change and atomically replace an entry's metadata, under its lock."""
        with self.lock(digest):
            meta = self.read_meta(digest)
            change(meta)
            path = self.meta_path(digest)
            tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
            try:
                tmp.write_text(json.dumps(meta, sort_keys=True))
                os.replace(tmp, path)
            except OSError as e:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise CacheError(f"{self.root}: cannot record {digest[:19]}: {e}") from None

    def release(self, job: str) -> list[str]:
        """The epilog: ``job`` no longer holds any entry.  Returns the digests it held."""
        released = []
        for meta in self.entries():
            if job in meta.get("holders", []):
                self.update_meta(
                    meta["digest"],
                    lambda m: m.__setitem__("holders", [h for h in m["holders"] if h != job]),
                )
                released.append(meta["digest"])
        return released

    def entries(self) -> list[dict[str, Any]]:
        out = []
        images = self.root / "images"
        if not images.is_dir():
            return []
        for meta_path in sorted(images.glob("*.json")):
            try:
                out.append(json.loads(meta_path.read_text()))
            except (OSError, ValueError):
                continue
        return out

"""The node-local image cache, content-addressed by manifest digest.

Layout under ``cache_dir`` (root-owned, 0755)::

    images/sha256-<hex>.sif     published images, mode 0444, never rewritten
    images/sha256-<hex>.json    metadata: refs, size, created, last_used, kept,
                                holders (jobs), blob, source (who served it),
                                origin (the registry/repository it was pulled as)
    locks/sha256-<hex>.lock     one flock per digest, so one download per image
    tmp/                        downloads in progress, same filesystem as images/
    tmp/sha256-<hex>.partial    a download in progress or interrupted: always a prefix
                                of the blob, resumed from its end by the next pull

A download is appended to ``tmp/`` in order (large ones come over several
connections at once, download.py), checked for size, sha256 and SIF magic, fsynced,
then renamed into ``images/``: a reader sees a whole verified image or nothing.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import stat
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
from tfimage.agent.fsutil import fsync_dir, held, write_json
from tfimage.agent.reference import Reference
from tfimage.agent.sif import has_magic

if TYPE_CHECKING:  # the registry client (and its transport) load only when needed
    from tfimage.agent.registry.client import Manifest, RegistryClient

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


def _client(cfg: Config, host: str) -> RegistryClient:
    from tfimage.agent.registry.access import client_for  # only a download needs it

    return client_for(cfg, host, light=True)


def _key(digest: str) -> str:
    return digest.replace(":", "-")


class ImageCache:
    def __init__(
        self, cfg: Config, client_factory: Callable[[str], RegistryClient] | None = None
    ) -> None:
        self.cfg = cfg
        self.root = Path(cfg.cache_dir)
        # The stdlib transport for all of it: the many callers that only resolve a
        # tag, or wait on another's download, never import requests, and the one
        # that downloads reads straight into its buffers (transport.py).
        self._client_factory = client_factory or (lambda host: _client(cfg, host))

    def make_dirs(self) -> None:
        """The cache's directories, created where missing (root-owned, 0755)."""
        for sub in ("", "images", "locks", "tmp"):
            d = self.root / sub
            d.mkdir(mode=0o755, exist_ok=True, parents=(sub == ""))

    def path_of(self, digest: str) -> Path:
        return self.root / "images" / f"{_key(digest)}.sif"

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Hold ``locks/<name>.lock``: a digest's (one download per image, one metadata
        change at a time) or another of the cache's (``keep``)."""
        with held(self.root / "locks" / f"{_key(name)}.lock"):
            yield

    def ensure(
        self, ref: Reference, progress: Progress | None = None, job: str | None = None
    ) -> CachedImage:
        """Make sure the image ``ref`` names is in the cache; return it pinned.

        ``job`` (the prolog's and the steps') becomes a holder: eviction never takes
        an image a running job holds.
        """
        started = time.monotonic()
        self.make_dirs()
        if ref.digest and self.path_of(ref.digest).exists():
            # Pinned and present: no registry round trip, not even an import.
            path = self.path_of(ref.digest)
            self._touch(ref, ref.digest, job=job)
            return CachedImage(ref, path, path.stat().st_size, True, time.monotonic() - started)
        last: RegistryUnreachable | None = None
        for host in self.cfg.sources(ref):
            try:
                if ref.digest:
                    # Pinned (the prolog's case): the lock first, so the jobs waiting
                    # for one download find it done and ask the registry nothing (nor
                    # import its client).
                    with self.lock(ref.digest):
                        path = self.path_of(ref.digest)
                        hit = path.exists()
                        if not hit:
                            self._fill(self._client_factory(host), host, ref, progress, job)
                    pinned = ref
                else:
                    # By tag: requests for the same tag at once ask the registry once
                    # (coalesce.py), then wait on the digest's lock as pinned ones do.
                    from tfimage.agent.cache.coalesce import resolve_tag  # hashlib: not on a hit

                    asked: list[tuple[RegistryClient, Manifest]] = []
                    digest = resolve_tag(
                        self.root / "locks",
                        f"{host}/{ref.repository}:{ref.version}",
                        started,
                        functools.partial(self._ask, host, ref, asked),
                    )
                    pinned = ref.pinned(digest)
                    path = self.path_of(digest)
                    with self.lock(digest):
                        hit = path.exists()
                        if hit:
                            pass
                        elif asked:
                            client, manifest = asked[0]
                            self._fill(client, host, pinned, progress, job, manifest)
                        else:  # another asked for the tag: the manifest by its digest
                            self._fill(self._client_factory(host), host, pinned, progress, job)
                if hit:
                    self._touch(pinned, pinned.digest or "", job=job)
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

    def _ask(self, host: str, ref: Reference, into: list[tuple[RegistryClient, Manifest]]) -> str:
        """The tag's digest from ``host``; the client and manifest go ``into`` the list,
        for the download that follows."""
        client = self._client_factory(host)
        manifest = client.manifest(ref.repository, ref.version)
        into.append((client, manifest))
        return manifest.digest

    def _fill(
        self,
        client: RegistryClient,
        host: str,
        pinned: Reference,
        progress: Progress | None,
        job: str | None,
        manifest: Manifest | None = None,
    ) -> None:
        """Under the digest's lock: put the image ``pinned`` names into the cache,
        with its metadata (published together: see :meth:`_publish`)."""
        from tfimage.agent.cache.convert import is_image_manifest, oci_to_sif
        from tfimage.agent.registry.artifact import sif_layer

        assert pinned.digest
        if manifest is None:
            # By digest: the client checks the manifest's bytes against it.
            manifest = client.manifest(pinned.repository, pinned.digest)
        tmp = self.root / "tmp" / f"{_key(pinned.digest)}.partial"
        if pinned.transport == "docker" or is_image_manifest(manifest.body):
            # An OCI image: converted once, cached under its manifest digest.
            converted = tmp.with_suffix(".converted")
            try:
                oci_to_sif(
                    pinned,
                    pinned.digest,
                    converted,
                    self.root / "tmp",
                    credential=client.credential,
                    ca_bundle=self.cfg.ca_bundle,
                )
                self._publish(converted, pinned, job=job, source=host, blob=None)
            finally:
                self._discard(converted)
            return
        layer = sif_layer(manifest)
        self._download(client, pinned, layer.digest, layer.size, tmp, progress)
        try:
            self._publish(tmp, pinned, job=job, source=host, blob=layer.digest)
        except CacheError:
            self._discard(tmp)  # a full disk gets its space back
            raise

    def _publish(
        self, tmp: Path, ref: Reference, *, job: str | None, source: str, blob: str | None
    ) -> None:
        """Under the digest's lock: make the verified file ``tmp`` the entry for
        ``ref``, metadata first, so an image is never published without it (eviction
        and ``cache ls`` see entries by their metadata).  A failure on the way leaves
        neither; a crash between the two leaves metadata without its image, which
        ``cache verify`` reports and ``cache prune`` removes."""
        assert ref.digest
        digest = ref.digest
        size = tmp.stat().st_size
        now = time.time()

        def change(meta: dict[str, Any]) -> None:
            meta.update(created=now, last_used=now, size=size, source=source)
            # Where the bytes came from (registry/repository as asked), for trust: the
            # registry served this digest from that repository.  Later names (refs,
            # from _touch) only say who used it.
            meta.setdefault("origin", ref.name)
            if blob:
                meta["blob"] = blob
            name = f"{ref.name}:{ref.tag}" if ref.tag else ref.name
            if name not in meta["refs"]:
                meta["refs"].append(name)
            if job and job not in meta["holders"]:
                meta["holders"].append(job)

        meta = self.read_meta(digest)
        change(meta)
        self.write_json(self.meta_path(digest), meta, what=digest[:19], durable=True)
        try:
            os.chmod(tmp, 0o444)
            os.rename(tmp, self.path_of(digest))
            fsync_dir(self.root / "images")
        except OSError as e:
            self._discard(self.meta_path(digest))
            raise CacheError(f"{self.root}: cannot publish {ref.name}: {e.strerror}") from None

    def _download(
        self,
        client: RegistryClient,
        ref: Reference,
        digest: str,
        size: int,
        tmp: Path,
        progress: Progress | None,
    ) -> None:
        """Fill ``tmp`` with the verified blob (resuming what an interrupted pull
        left there)."""
        try:
            try:
                self._fetch(client, ref, digest, size, tmp, self.cfg.pull_connections, progress)
            except RangeUnsupported:
                # This registry streams whole blobs only: one stream, from what came.
                self._fetch(client, ref, digest, size, tmp, 1, progress)
        except RegistryUnreachable:
            raise  # keep the partial file: the next pull resumes it
        except OSError as e:
            self._discard(tmp)
            raise CacheError(f"{self.root}: cannot store {ref.name}: {e.strerror}") from None
        except (VerificationError, RegistryError, CacheError):
            self._discard(tmp)
            raise

    @staticmethod
    def _discard(tmp: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()

    def _fetch(
        self,
        client: RegistryClient,
        ref: Reference,
        digest: str,
        size: int,
        tmp: Path,
        connections: int,
        progress: Progress | None,
    ) -> None:
        """Fill ``tmp`` with the blob and check it (size, sha256, SIF magic), fsynced.

        A partial file an interrupted pull left (a crash, a kill -9, a dropped
        connection) is a prefix of the blob (download.py): it is hashed, and the rest
        asked for, over ``connections`` connections.
        """
        import hashlib  # a cache hit, the launch path, never hashes

        from tfimage.agent.cache import download

        h = hashlib.sha256()
        head = bytearray()
        got = 0
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "r+b") as out:
            if not stat.S_ISREG(os.fstat(out.fileno()).st_mode):
                raise CacheError(f"{tmp}: not a regular file")
            kept = os.fstat(out.fileno()).st_size
            kept = 0 if kept > size else kept - kept % download.ALIGN  # O_DIRECT goes on aligned
            out.truncate(kept)

            def consume(block: memoryview) -> None:
                nonlocal got
                if len(head) < 64:
                    head.extend(block[: 64 - len(head)])
                h.update(block)
                got += len(block)
                if progress:
                    progress(got, size)

            while got < kept and (block := out.read(min(CHUNK, kept - got))):
                consume(memoryview(block))
            clients = [client] + [self._client_factory(client.host) for _ in range(connections - 1)]
            download.Download(
                clients,
                ref.repository,
                digest,
                size,
                tmp,
                got,
                self.cfg.pull_stripe_bytes,
            ).run(consume)
            if got != size:
                raise RegistryUnreachable(f"{ref.name}: got {got} of {size} bytes")
            if "sha256:" + h.hexdigest() != digest:
                raise VerificationError(f"{ref.name}: sha256 of the download does not match")
            if not has_magic(bytes(head)):
                raise VerificationError(f"{ref.name}: the download is not a SIF file")
            os.fsync(out.fileno())

    def _touch(self, ref: Reference, digest: str, *, job: str | None = None) -> None:
        """Record a use of a cached entry: the ref, last_used, the job now holding it."""
        name = f"{ref.name}:{ref.tag}" if ref.tag else ref.name

        def change(meta: dict[str, Any]) -> None:
            if name not in meta["refs"]:
                meta["refs"].append(name)
            meta["last_used"] = time.time()
            meta["size"] = self.path_of(digest).stat().st_size
            if job and job not in meta["holders"]:
                meta["holders"].append(job)

        self.update_meta(digest, change)

    def meta_path(self, digest: str) -> Path:
        return self.root / "images" / f"{_key(digest)}.json"

    def read_meta(self, digest: str) -> dict[str, Any]:
        try:
            meta = json.loads(self.meta_path(digest).read_text())
        except (OSError, ValueError):  # none yet, or unreadable: writing it will say
            meta = {}
        base: dict[str, Any] = {
            "digest": digest,
            "refs": [],
            "created": time.time(),
            "last_used": 0.0,
            "size": 0,
            "kept": False,
            "holders": [],
        }
        return {**base, **meta} if isinstance(meta, dict) else base

    def update_meta(self, digest: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Read, change and atomically replace an entry's metadata, under its lock."""
        with self.lock(digest):
            meta = self.read_meta(digest)
            change(meta)
            self.write_json(self.meta_path(digest), meta, what=digest[:19])

    def write_json(self, path: Path, data: object, *, what: str, durable: bool = False) -> None:
        """Replace ``path`` with ``data`` as JSON, atomically (fsutil.py); the caller
        holds the lock that guards it."""
        try:
            write_json(path, data, durable=durable)
        except OSError as e:
            raise CacheError(f"{self.root}: cannot record {what}: {e}") from None

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
        """Every published entry's metadata (an entry is its metadata and its image;
        either alone is an orphan: see :meth:`orphans`)."""
        out = []
        images = self.root / "images"
        if not images.is_dir():
            return []
        for meta_path in sorted(images.glob("*.json")):
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict) and meta_path.with_suffix(".sif").exists():
                out.append(meta)
        return out

    def orphans(self) -> list[Path]:
        """Images without metadata and metadata without images (an interrupted
        publish, or a cache an older tfimage wrote)."""
        images = self.root / "images"
        if not images.is_dir():
            return []
        out = []
        for p in sorted(images.iterdir()):
            other = p.with_suffix(".json" if p.suffix == ".sif" else ".sif")
            if p.suffix in (".sif", ".json") and not other.exists():
                out.append(p)
        return out

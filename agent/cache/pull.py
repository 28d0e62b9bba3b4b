"""Filling the cache: :meth:`Puller.ensure` makes an image a cache entry (store.py).

It asks the node's rack mirrors, the site's registry and then its mirrors in turn
(core/mirrortiers.py), each taken over when the one before is unreachable (a rack
mirror: whatever it failed with); a cold pull of a multi-node job first waits a
moment at random (``jitter``), so that a job's prologs do not reach the registry
in the same second; requests for one tag at once ask once (coalesce.py),
and one image is downloaded once however many wait for it (its digest's lock).
An OCI image is converted to SIF once (convert.py) and cached under its manifest
digest.  A download is appended to its partial file in ``tmp/`` (on the same
filesystem as ``images/``; where each lies: core/layout.py) in order, large ones
over several connections at once (download.py), so an interrupted one is always a
prefix of the blob and the next pull resumes it from its end.  It is checked for
size, sha256 and SIF magic and fsynced before it is published.
"""

from __future__ import annotations

import functools
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tfimage.agent.cache.store import CHUNK, ImageCache, discard
from tfimage.agent.core import layout
from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import (
    CacheError,
    ImageError,
    RangeUnsupported,
    RegistryError,
    RegistryUnreachable,
    VerificationError,
)
from tfimage.agent.core.reference import Reference

if TYPE_CHECKING:  # the registry client (and its transport) load only when needed
    from tfimage.agent.registry.artifact import SifLayer
    from tfimage.agent.registry.client import Manifest, RegistryClient

Progress = Callable[[int, int], None]
# Asked before anything is downloaded or converted: the SIF's size (0 where an OCI
# image is yet to be converted) and whether it is converted; raises to refuse it.
Admit = Callable[[int, bool], None]


@dataclass(frozen=True, slots=True)
class CachedImage:
    ref: Reference  # pinned
    path: Path
    size: int
    hit: bool
    seconds: float
    source: str | None = None  # the registry or mirror that served it (None: cache hit;
    # staged.SOURCE: a copy staged for the job)
    refused: str | None = None  # why a copy staged for the job was not taken


def _client(cfg: Config, host: str) -> RegistryClient:
    from tfimage.agent.registry.access import client_for  # only a download needs it

    return client_for(cfg, host, light=True)


class Puller:
    """Pulls into ``cache``, with a client per registry host from ``client_factory``."""

    def __init__(
        self,
        cache: ImageCache,
        client_factory: Callable[[str], RegistryClient] | None = None,
        *,
        jitter: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.cache = cache
        self.cfg = cache.cfg
        # The most seconds a cold pull waits at random before its first request
        # (the prolog of a multi-node job: config's pull_jitter).
        self.jitter = jitter
        self._sleep = sleep
        self.waited = 0.0  # what this Puller's last cold pull waited
        # The stdlib transport for all of it: the many callers that only resolve a
        # tag, or wait on another's download, never import requests, and the one
        # that downloads reads straight into its buffers (transport.py).
        self._client_factory = client_factory or (lambda host: _client(cache.cfg, host))

    def ensure(
        self,
        ref: Reference,
        progress: Progress | None = None,
        job: str | None = None,
        uid: int | None = None,
        admit: Admit | None = None,
    ) -> CachedImage:
        """Make sure the image ``ref`` names is in the cache; return it pinned.

        ``job`` (the prolog's and the steps') becomes a holder: eviction never takes
        an image a running job holds.  ``uid``, the job's user, may own a copy
        staged for the job (staged.py).  ``admit`` may refuse a download or a
        conversion before it starts (a cached image is the caller's to judge).
        """
        started = time.monotonic()
        cache = self.cache
        cache.make_dirs()
        if ref.digest and cache.path_of(ref.digest).exists():
            # Pinned and present: no registry round trip, not even an import.
            path = cache.path_of(ref.digest)
            cache.touch(ref, ref.digest, job=job)
            if job:  # a copy staged for the job is not needed: gone (two unlinks)
                for staged_file in layout.cache_staged(cache.root, ref.digest, job):
                    discard(staged_file)
            return CachedImage(ref, path, path.stat().st_size, True, time.monotonic() - started)
        refused = None  # why a copy staged for the job was not taken, if one was
        if ref.digest and job:
            adopted = self._adopt(ref, job, uid, started)
            if isinstance(adopted, CachedImage):
                return adopted
            refused = adopted
        last: ImageError | None = None
        self._spread(ref)
        for host in self.cfg.sources(ref):
            try:
                if ref.digest:
                    # Pinned (the prolog's case): the lock first, so the jobs waiting
                    # for one download find it done and ask the registry nothing (nor
                    # import its client).
                    with cache.lock(ref.digest):
                        path = cache.path_of(ref.digest)
                        hit = path.exists()
                        if not hit:
                            self._fill(self._client_factory(host), host, ref, progress, job,
                                       admit=admit)  # fmt: skip
                    pinned = ref
                else:
                    # By tag: requests for the same tag at once ask the registry once
                    # (coalesce.py), then wait on the digest's lock as pinned ones do.
                    from tfimage.agent.cache.coalesce import resolve_tag  # hashlib: not on a hit

                    asked: list[tuple[RegistryClient, Manifest]] = []
                    digest = resolve_tag(
                        cache.root,
                        f"{host}/{ref.repository}:{ref.version}",
                        started,
                        functools.partial(self._ask, host, ref, asked),
                    )
                    pinned = ref.pinned(digest)
                    path = cache.path_of(digest)
                    with cache.lock(digest):
                        hit = path.exists()
                        if hit:
                            pass
                        elif asked:
                            client, manifest = asked[0]
                            self._fill(client, host, pinned, progress, job, manifest, admit)
                        else:  # another asked for the tag: the manifest by its digest
                            self._fill(self._client_factory(host), host, pinned, progress,
                                       job, admit=admit)  # fmt: skip
                if hit:
                    cache.touch(pinned, pinned.digest or "", job=job)
            except RegistryUnreachable as e:
                last = e  # this one is down: the next mirror serves
                continue
            except (RegistryError, VerificationError) as e:
                if not self.cfg.is_rack_mirror(host):
                    raise
                # A rack mirror refused, lost or garbled it: the registry decides.
                last = e
                continue
            return CachedImage(
                pinned,
                path,
                path.stat().st_size,
                hit,
                time.monotonic() - started,
                None if hit else host,
                refused,
            )
        assert last is not None
        raise last

    def _spread(self, ref: Reference) -> None:
        """Wait up to ``jitter`` seconds, at random, before a cold pull: one whose
        image (pinned) is not in the cache, or a tag's lookup."""
        self.waited = 0.0
        if self.jitter <= 0 or (ref.digest and self.cache.path_of(ref.digest).exists()):
            return
        import random

        self.waited = random.uniform(0, self.jitter)  # noqa: S311 - spreading, not secrecy
        self._sleep(self.waited)

    def _adopt(
        self, ref: Reference, job: str, uid: int | None, started: float
    ) -> CachedImage | str | None:
        """The copy staged for ``job`` (staged.py), published if it is exactly ``ref``:
        the cached image; else why it was refused, or None when there was none to
        take."""
        assert ref.digest
        cache = self.cache
        with cache.lock(ref.digest):
            path = cache.path_of(ref.digest)
            if path.exists():  # another job's pull just published it
                return None
            from tfimage.agent.cache import staged

            why = staged.adopt(cache, ref, job, self.cfg.staging_owners(), uid)
            if why is None:
                return CachedImage(ref, path, path.stat().st_size, False,
                                   time.monotonic() - started, staged.SOURCE)  # fmt: skip
        return why or None

    def _ask(self, host: str, ref: Reference, into: list[tuple[RegistryClient, Manifest]]) -> str:
        """The tag's digest from ``host``; the client and manifest go ``into`` the list,
        for the download that follows."""
        client = self._client_factory(host)
        from tfimage.agent.registry.platforms import tag_manifest

        manifest = tag_manifest(client, ref, self.cfg.node_platform)
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
        admit: Admit | None = None,
    ) -> None:
        """Under the digest's lock: put the image ``pinned`` names into the cache,
        with its metadata (published together: see :meth:`ImageCache.publish`)."""
        from tfimage.agent.cache.convert import is_image_manifest, oci_to_sif
        from tfimage.agent.registry.artifact import sif_layer

        assert pinned.digest
        root = self.cache.root
        if manifest is None:
            # By digest: the client checks the manifest's bytes against it.
            manifest = client.manifest(pinned.repository, pinned.digest)
        if pinned.transport == "docker" or is_image_manifest(manifest.body):
            # An OCI image: converted once, cached under its manifest digest.
            if admit:
                admit(0, True)
            converted = layout.cache_converted(root, pinned.digest)
            try:
                oci_to_sif(
                    pinned,
                    pinned.digest,
                    converted,
                    layout.cache_convert_work(root, pinned.digest),
                    credential=client.credential_for(pinned.repository),
                    ca_bundle=self.cfg.ca_bundle,
                )
                self.cache.publish(converted, pinned, job=job, source=host, blob=None)
            finally:
                discard(converted)
            return
        tmp = layout.cache_partial(root, pinned.digest)
        layer = sif_layer(manifest)
        if admit:
            admit(layer.size, False)
        self._download(client, pinned, layer, tmp, progress)
        try:
            self.cache.publish(tmp, pinned, job=job, source=host, blob=layer.digest)
        except CacheError:
            discard(tmp)  # a full disk gets its space back
            raise

    def _download(
        self,
        client: RegistryClient,
        ref: Reference,
        layer: SifLayer,
        tmp: Path,
        progress: Progress | None,
    ) -> None:
        """Fill ``tmp`` with the verified blob ``layer`` (resuming what an
        interrupted pull left there)."""
        try:
            try:
                self._fetch(client, ref, layer, tmp, self.cfg.pull_connections, progress)
            except RangeUnsupported:
                # This registry streams whole blobs only: one stream, from what came.
                self._fetch(client, ref, layer, tmp, 1, progress)
        except RegistryUnreachable:
            # Kept for the next pull to resume while the job lives (its epilog drops
            # it: evict.abandoned_downloads); one too short to resume from is nobody's.
            if _resumable(tmp) == 0:
                discard(tmp)
            raise
        except OSError as e:
            discard(tmp)
            raise CacheError(f"{self.cache.root}: cannot store {ref.name}: {e.strerror}") from None
        except (VerificationError, RegistryError, CacheError):
            discard(tmp)
            raise

    def _fetch(
        self,
        client: RegistryClient,
        ref: Reference,
        layer: SifLayer,
        tmp: Path,
        connections: int,
        progress: Progress | None,
    ) -> None:
        """Fill ``tmp`` with the blob ``layer`` and check it (size, sha256, SIF
        magic), fsynced.

        A partial file an interrupted pull left (a crash, a kill -9, a dropped
        connection) is a prefix of the blob (download.py): it is hashed, and the rest
        asked for, over ``connections`` connections.
        """
        from tfimage.agent.cache import download
        from tfimage.agent.cache.verify import NOT_SIF, SHORT, BlobCheck

        digest, size = layer.digest, layer.size
        check = BlobCheck(digest, size)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "r+b") as out:
            if not stat.S_ISREG(os.fstat(out.fileno()).st_mode):
                raise CacheError(f"{tmp}: not a regular file")
            kept = os.fstat(out.fileno()).st_size
            kept = 0 if kept > size else download.resume_point(kept)
            out.truncate(kept)

            def consume(block: memoryview) -> None:
                check.update(block)
                if progress:
                    progress(check.got, size)

            while check.got < kept and (block := out.read(min(CHUNK, kept - check.got))):
                consume(memoryview(block))
            clients = [client] + [self._client_factory(client.host) for _ in range(connections - 1)]
            download.Download(
                clients,
                ref.repository,
                digest,
                size,
                tmp,
                check.got,
                self.cfg.pull_stripe_bytes,
            ).run(consume)
            problem = check.problem()
            if problem == SHORT:
                raise RegistryUnreachable(f"{ref.name}: got {check.got} of {size} bytes")
            if problem == NOT_SIF:
                raise VerificationError(f"{ref.name}: the download is not a SIF file")
            if problem is not None:
                raise VerificationError(f"{ref.name}: sha256 of the download does not match")
            os.fsync(out.fileno())


def _resumable(partial: Path) -> int:
    """How much of ``partial`` a pull would resume from."""
    from tfimage.agent.cache.download import resume_point

    try:
        return resume_point(partial.lstat().st_size)
    except FileNotFoundError:
        return 0

"""The node-local image cache's entries, content-addressed by manifest digest.

An entry is a published image and its metadata (:class:`Entry`): both under
``cache_dir/images/``, where core/layout.py names every file of the cache.  Here
they are published, read, changed under their digest's lock, listed, released and
told from the orphans a crash may leave; filling the cache is pull.py's.

An image is published only verified and whole: the metadata first, then the image
renamed into ``images/`` (see :meth:`ImageCache.publish`), so a reader sees a
whole verified image or nothing, and never an image without its metadata.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tfimage.agent.core import layout
from tfimage.agent.core.access import first_rule, readers
from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import CacheError
from tfimage.agent.core.fsutil import Readers, fsync_dir, held, write_json
from tfimage.agent.core.posixacl import XATTR, restrict
from tfimage.agent.core.reference import Reference

CHUNK = 1 << 20
# An entry's source when its bytes came from a copy staged for a job (staged.py).
STAGED_SOURCE = "staged"


def _strings(value: object) -> tuple[str, ...]:
    return tuple(x for x in value if isinstance(x, str)) if isinstance(value, list) else ()


def _number(value: object, default: float) -> float:
    # bool is an int to Python, and json reads NaN: neither is a size or a time.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value) if math.isfinite(value) else default


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class Entry:
    """A cached image's metadata, ``images/sha256-<hex>.json``."""

    digest: str  # the manifest's: the entry's name
    refs: tuple[str, ...] = ()  # every name it was asked for by, as asked
    size: int = 0  # bytes of the published image
    created: float = 0.0  # when it was published (time.time())
    last_used: float = 0.0  # what eviction orders by
    kept: bool = False  # on the operator's keep list (keep.py): never evicted
    holders: tuple[str, ...] = ()  # the jobs holding it: never evicted while they run
    blob: str | None = None  # the SIF layer's digest (None: converted from an OCI image)
    source: str | None = None  # the registry or mirror that served it
    origin: str | None = None  # the registry/repository it was pulled as

    @classmethod
    def parse(cls, digest: str, doc: object) -> Entry:
        """The metadata ``doc`` (a file's JSON) for the image ``digest``.  What a hand,
        a crash or a hostile file put there is never trusted nor fatal: the digest
        is the file's name, and a field missing or of the wrong type reads as if
        tfimage had not written it (a list keeps its strings)."""
        d = doc if isinstance(doc, dict) else {}
        return cls(
            digest=digest,
            refs=_strings(d.get("refs")),
            size=int(_number(d.get("size"), 0)),
            # None yet (an entry being published), or a hand's: made now, as far as
            # anyone can tell.
            created=_number(d.get("created"), time.time()),
            last_used=_number(d.get("last_used"), 0.0),
            kept=d.get("kept") is True,
            holders=_strings(d.get("holders")),
            blob=_text(d.get("blob")),
            source=_text(d.get("source")),
            origin=_text(d.get("origin")),
        )

    def to_json(self) -> dict[str, object]:
        """The metadata as it is written: every field, the unset optional ones left out."""
        return {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in asdict(self).items()
            if v is not None
        }

    def used_by(self, ref: Reference, job: str | None) -> Entry:
        """This metadata with ``ref`` among its names and ``job`` among its holders."""
        name = f"{ref.name}:{ref.tag}" if ref.tag else ref.name
        refs = self.refs if name in self.refs else (*self.refs, name)
        holders = self.holders if not job or job in self.holders else (*self.holders, job)
        return replace(self, refs=refs, holders=holders)

    def without_holders(self, gone: Collection[str]) -> Entry:
        return replace(self, holders=tuple(h for h in self.holders if h not in gone))


def discard(path: Path) -> None:
    """Remove ``path`` if it is there."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class ImageCache:
    """One node's cache, at ``cfg.cache_dir``."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.root = Path(cfg.cache_dir)

    def make_dirs(self) -> None:
        """The cache's directories, created where missing (root-owned, 0755)."""
        self.root.mkdir(mode=0o755, exist_ok=True, parents=True)
        for sub in layout.CACHE_DIRS:
            (self.root / sub).mkdir(mode=0o755, exist_ok=True)
        self._staged_dir()

    def _staged_dir(self) -> None:
        """``staged/``, root's, 1733: ``sbcast`` writes there as the job's user (Slurm
        22.05 lets no one else broadcast to a job) or as Slurm's user; the sticky bit
        keeps one user from taking or replacing another's file, and no one but root
        may list it."""
        staged = layout.cache_staged_dir(self.root)
        with contextlib.suppress(FileExistsError):
            staged.mkdir(mode=0o700)
        if os.geteuid() != 0:
            return
        st = staged.lstat()
        if not stat.S_ISDIR(st.st_mode):
            return  # adopt() opens nothing through it but regular files it checks
        if st.st_uid != 0 or st.st_gid != 0:
            os.chown(staged, 0, 0, follow_symlinks=False)
        if stat.S_IMODE(st.st_mode) != layout.STAGED_MODE:
            os.chmod(staged, layout.STAGED_MODE)

    def path_of(self, digest: str) -> Path:
        return layout.cache_sif(self.root, digest)

    def entry_path(self, digest: str) -> Path:
        return layout.cache_entry(self.root, digest)

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Hold ``locks/<name>.lock``: a digest's (one download per image, one metadata
        change at a time) or another of the cache's (``keep``)."""
        with held(layout.cache_lock(self.root, name)):
            yield

    def publish(
        self, tmp: Path, ref: Reference, *, job: str | None, source: str, blob: str | None
    ) -> None:
        """Under the digest's lock: make the verified file ``tmp`` the entry for
        ``ref``, its metadata first, so an image is never published without it
        (eviction and ``cache ls`` see entries by their metadata files).  A failure on the
        way leaves neither; a crash between the two leaves metadata without its
        image, which ``cache verify`` reports and ``cache prune`` removes."""
        assert ref.digest
        digest = ref.digest
        size = tmp.stat().st_size
        now = time.time()
        entry = self.read_entry(digest)
        entry = replace(
            entry.used_by(ref, job),
            created=now,
            last_used=now,
            size=size,
            source=source,
            # Where the bytes came from (registry/repository as asked), for trust: the
            # registry served this digest from that repository.  Later names (refs,
            # from touch) only say who used it.
            origin=ref.name if entry.origin is None else entry.origin,
            blob=blob or entry.blob,
        )
        self.write_entry(entry, durable=True)
        try:
            os.chmod(tmp, 0o444)
            if (who := self.readers(entry.origin)) is not None:
                restrict(str(tmp), *who)
            os.rename(tmp, self.path_of(digest))
            fsync_dir(layout.cache_images(self.root))
        except OSError as e:
            discard(self.entry_path(digest))
            raise CacheError(f"{self.root}: cannot publish {ref.name}: {e.strerror}") from None

    def touch(self, ref: Reference, digest: str, *, job: str | None = None) -> None:
        """Note a use of a cached entry: the ref, last_used, the job now holding it."""

        def change(entry: Entry) -> Entry:
            self.protect(digest, entry.origin)
            return replace(
                entry.used_by(ref, job),
                last_used=time.time(),
                size=self.path_of(digest).stat().st_size,
            )

        self.update_entry(digest, change)

    def protect(self, digest: str, origin: str | None) -> None:
        """The cached image readable as the access rules now say: by its rule's users
        and groups only (posixacl.py), or by everyone where no rule matches; so an
        image cached before a rule came (or went) follows it at its next use."""
        path = str(self.path_of(digest))
        if (who := self.readers(origin)) is not None:
            restrict(path, *who)
        else:
            with contextlib.suppress(OSError):  # no ACL to remove on this filesystem
                os.removexattr(path, XATTR)
            os.chmod(path, 0o444)

    def read_entry(self, digest: str) -> Entry:
        """The metadata of ``digest``; empty where there is none (yet) or it
        cannot be read (writing it will say)."""
        try:
            doc = json.loads(self.entry_path(digest).read_text())
        except (OSError, ValueError):
            doc = {}
        return Entry.parse(digest, doc)

    def update_entry(self, digest: str, change: Callable[[Entry], Entry]) -> None:
        """Read, change and atomically replace an entry's metadata, under its lock."""
        with self.lock(digest):
            self.write_entry(change(self.read_entry(digest)))

    def private(self, origin: str | None) -> bool:
        """Whether an access rule matches the repository of ``origin``
        (``host/repository``): a glob test, no user or group lookup."""
        if not self.cfg.access or not origin:
            return False
        return first_rule(self.cfg.access, origin.partition("/")[2]) is not None

    def readers(self, origin: str | None) -> Readers | None:
        """Who but root may read the files of an image pulled as ``origin``
        (``host/repository``): the access rule's users and groups where one
        matches (core/access.py); None (everyone) where none does."""
        if not self.cfg.access or not origin:
            return None
        return readers(self.cfg.access, origin.partition("/")[2])

    def write_entry(self, entry: Entry, *, durable: bool = False) -> None:
        """Replace the metadata of ``entry.digest``; the caller holds its lock.  A
        private image's metadata (its tags) is as private as the image."""
        self.write_json(
            self.entry_path(entry.digest),
            entry.to_json(),
            what=entry.digest[:19],
            durable=durable,
            readers=self.readers(entry.origin),
        )

    def write_json(
        self,
        path: Path,
        data: object,
        *,
        what: str,
        durable: bool = False,
        readers: Readers | None = None,
    ) -> None:
        """Replace ``path`` with ``data`` as JSON, atomically (fsutil.py); the caller
        holds the lock that guards it."""
        try:
            write_json(path, data, durable=durable, readers=readers)
        except OSError as e:
            raise CacheError(f"{self.root}: cannot record {what}: {e}") from None

    def release(self, job: str) -> list[str]:
        """The epilog: ``job`` no longer holds any entry.  Returns the digests it held."""
        released = []
        for entry in self.entries():
            if job in entry.holders:
                self.update_entry(entry.digest, lambda e: e.without_holders({job}))
                released.append(entry.digest)
        return released

    def entries(self) -> list[Entry]:
        """Every published entry (an entry is its metadata and its image; either alone
        is an orphan: see :meth:`orphans`), by digest."""
        images = layout.cache_images(self.root)
        if not images.is_dir():
            return []
        out = []
        for path in sorted(images.glob("*.json")):
            digest = layout.digest_of_key(path.name)
            if digest is None or path != self.entry_path(digest):
                continue  # no name tfimage gives a metadata file
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and self.path_of(digest).exists():
                out.append(Entry.parse(digest, doc))
        return out

    def orphans(self) -> list[Path]:
        """Images without metadata files and metadata files without images (an interrupted
        publish, or a cache an older tfimage wrote)."""
        images = layout.cache_images(self.root)
        if not images.is_dir():
            return []
        out = []
        for p in sorted(images.iterdir()):
            other = layout.cache_entry_pair(p)
            if other is not None and not other.exists():
                out.append(p)
        return out

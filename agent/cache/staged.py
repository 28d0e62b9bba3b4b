"""A copy of a job's image that was staged on this node for it, adopted only if it
proves to be exactly the pinned image; otherwise the node pulls as ever.

The controller's broadcast (``sbcast``, fanout/) puts two files for a job into
``cache_dir/staged/`` (core/layout.py), named from the job id and the pinned
manifest digest alone::

    staged/sha256-<hex>.<job>.manifest   the manifest's bytes, as the registry served them
    staged/sha256-<hex>.<job>.sif        the SIF layer's bytes

``staged/`` is root's, 1733: slurmd writes a broadcast file as the job's user on
Slurm 22.05 (it refuses anyone else's broadcast to a job), so anyone may add a file,
and the sticky bit keeps one user from replacing another's.  Nothing there is
trusted more than a registry's answer.  Each file must be a regular file with one
name, owned by root, Slurm's user or the job's own user (a file another user put
under a job's name is refused), that no group or other may write.  The manifest's
sha256 must be the pinned digest; its one SIF layer gives the blob's digest and
size.  The SIF is first renamed into root's own ``tmp/`` (so its name can no longer
be swapped) and opened there without following a link or blocking.  One that root
or Slurm's user owns is taken by root (0400) and checked through that descriptor; a
file that changed meanwhile (its size, mtime or ctime) is refused.  One the job's
user owns could still be written through a descriptor they opened before, so its
bytes are copied into a file root creates, and that copy is what is checked and
published.  Either way the check is the cache's one
:class:`~tfimage.agent.cache.verify.BlobCheck`, and :meth:`ImageCache.publish` takes
the result as it takes a download: the same metadata and the same origin, so
kernel-mount trust is unchanged.

Whatever happens, both staged files are gone afterwards; a refusal is one line for
the hook log, and the caller pulls.  (A writer that opened a root- or Slurm-owned
file before it was taken and writes after its check is the one thing not caught:
only root and Slurm's user may open one of those at all.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from pathlib import Path

from tfimage.agent.cache.store import STAGED_SOURCE, ImageCache, discard
from tfimage.agent.cache.verify import LONG, MISMATCH, NOT_SIF, SHORT, check_fd
from tfimage.agent.core import layout
from tfimage.agent.core.errors import VerificationError
from tfimage.agent.core.reference import Reference

SOURCE = STAGED_SOURCE  # what the entry and the usage record say served it
MAX_MANIFEST = 4 << 20  # as the registry client reads one
_WORDS = {
    SHORT: "shorter than its layer",
    LONG: "longer than its layer",
    MISMATCH: "its sha256 is not the layer's",
    NOT_SIF: "not a SIF file",
}


class Refused(Exception):  # noqa: N818 - it names what happened
    """Why a staged copy was not adopted (one line)."""


def discard_staged(cache: ImageCache, digest: str, job: str) -> None:
    for path in layout.cache_staged(cache.root, digest, job):
        discard(path)


def adopt(
    cache: ImageCache,
    ref: Reference,
    job: str,
    owners: frozenset[int],
    uid: int | None = None,
) -> str | None:
    """Under the digest's lock, the image not cached: publish the copy staged for
    ``job`` if it is exactly ``ref`` (pinned).  None when it was adopted; "" when
    nothing was staged; else why it was refused.  ``owners``: the uids whose staged
    files are taken as they are (root and Slurm's user); ``uid``: the job's user,
    whose files are copied first."""
    assert ref.digest
    manifest_path, sif_path = layout.cache_staged(cache.root, ref.digest, job)
    if not os.path.lexists(manifest_path) and not os.path.lexists(sif_path):
        return ""
    tmp = layout.cache_adopting(cache.root, ref.digest)
    copy = layout.cache_adopted(cache.root, ref.digest)
    allowed = owners | ({uid} if uid is not None and uid > 0 else set())
    try:
        layer_digest, layer_size = _layer(manifest_path, ref.digest, allowed)
        try:
            os.rename(sif_path, tmp)  # into root's tmp/: its name is ours from here
        except FileNotFoundError:
            raise Refused("SIF: missing") from None
        taken = _take_sif(tmp, copy, layer_digest, layer_size, owners, allowed)
        cache.publish(taken, ref, job=job, source=SOURCE, blob=layer_digest)
        return None
    except Refused as e:
        return f"staged copy refused: {e}"
    except OSError as e:
        return f"staged copy refused: {e.strerror or e}"
    finally:
        discard(tmp)
        discard(copy)
        discard_staged(cache, ref.digest, job)


def _open_owned(path: Path, what: str, owners: frozenset[int]) -> int:
    """``path`` opened read-only without following a link or blocking (a FIFO), if a
    regular file with one name, owned by one of ``owners``, writable by no one else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Refused(f"{what}: missing") from None
    except OSError as e:  # ELOOP: a link
        raise Refused(f"{what}: {e.strerror}") from None
    st = os.fstat(fd)
    why = (
        "not a regular file"
        if not stat.S_ISREG(st.st_mode)
        else "more than one name"
        if st.st_nlink != 1
        else f"owned by uid {st.st_uid}"
        if st.st_uid not in owners
        else f"mode {stat.S_IMODE(st.st_mode):04o} lets others write it"
        if st.st_mode & 0o022
        else None
    )
    if why:
        os.close(fd)
        raise Refused(f"{what}: {why}")
    return fd


def _layer(path: Path, digest: str, owners: frozenset[int]) -> tuple[str, int]:
    """The SIF layer's digest and size, from the staged manifest that is ``digest``."""
    from tfimage.agent.registry.artifact import sif_layer
    from tfimage.agent.registry.client import Manifest
    from tfimage.agent.registry.mediatypes import OCI_MANIFEST

    fd = _open_owned(path, "manifest", owners)
    try:
        raw = os.read(fd, MAX_MANIFEST + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_MANIFEST:
        raise Refused("manifest larger than 4 MiB")
    if "sha256:" + hashlib.sha256(raw).hexdigest() != digest:
        raise Refused("manifest is not the pinned digest")
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("not an object")
        media = body.get("mediaType")
        layer = sif_layer(Manifest(digest, media if isinstance(media, str) else OCI_MANIFEST,
                                   raw, body))  # fmt: skip
    except (ValueError, VerificationError) as e:
        raise Refused(f"manifest: {e}") from None
    return layer.digest, layer.size


def _take_sif(
    path: Path, copy: Path, blob: str, size: int, owners: frozenset[int], allowed: frozenset[int]
) -> Path:
    """The checked SIF to publish: ``path`` itself where root or Slurm's user owns
    it, else root's ``copy`` of it."""
    fd = _open_owned(path, "SIF", allowed)
    try:
        st = os.fstat(fd)
        if st.st_size != size:
            raise Refused(f"SIF: {st.st_size} bytes, not the layer's {size}")
        if st.st_uid in owners:
            _check_in_place(fd, blob, size)
            return path
        _copy_and_check(fd, copy, blob, size)
        return copy
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _check_in_place(fd: int, blob: str, size: int) -> None:
    # Root's from now: no one else may open it for writing again.
    os.fchown(fd, 0, 0)
    os.fchmod(fd, 0o400)
    before = os.fstat(fd)
    if before.st_size != size:
        raise Refused(f"SIF: {before.st_size} bytes, not the layer's {size}")
    _verify(fd, blob, size)
    after = os.fstat(fd)
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns, after.st_nlink) != (
        before.st_size,
        before.st_mtime_ns,
        before.st_ctime_ns,
        1,
    ):
        raise Refused("SIF: changed while it was checked")
    os.fsync(fd)


def _copy_and_check(src: int, copy: Path, blob: str, size: int) -> None:
    """``size`` bytes of ``src`` into a new root-owned ``copy`` (never more: a file
    that grows meanwhile is refused), then the check on the copy, which no one else
    has ever been able to open."""
    discard(copy)
    out = os.open(copy, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400)
    try:
        done = 0
        while done < size:
            n = os.copy_file_range(src, out, min(size - done, 1 << 30), done, done)
            if n == 0:
                raise Refused("SIF: shorter than its layer")
            done += n
        if os.pread(src, 1, size):
            raise Refused("SIF: longer than its layer")
        _verify(out, blob, size)
        os.fsync(out)
    finally:
        os.close(out)


def _verify(fd: int, blob: str, size: int) -> None:
    problem = check_fd(fd, blob, size)
    if problem:
        raise Refused(f"SIF: {_WORDS[problem]}")

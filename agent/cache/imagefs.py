"""Writing into an unpacked image's root filesystem as root, never through its links.

An image is hostile input: its ``/ch`` may be a link to ``/etc``, its
``/.singularity.d/env`` a link to ``/etc/profile.d``.  An ordinary ``open(rootfs /
"ch/environment", "w")`` as root would follow them and write onto the host.  Here
every path is walked one component at a time from a descriptor of the root, each
opened with ``O_NOFOLLOW``: a link anywhere on the way is refused with
:class:`UnsafeImage`, naming it.

The same walk strips what an image must not carry into a squashfs that root
mounts: setuid and setgid bits, and device nodes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tfimage.agent.core.errors import UnsafeImage

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _refuse(rel: str, dir_fd: int, name: str) -> UnsafeImage:
    try:
        target = os.readlink(name, dir_fd=dir_fd)
        what = f"a symbolic link (to {target[:100]!r})"
    except OSError:
        what = "not a directory"
    return UnsafeImage(f"the image's /{rel} is {what}; tfimage refuses to write through it as root")


@contextlib.contextmanager
def open_dir(root: Path, rel: str, *, create: bool = True) -> Iterator[int]:
    """A descriptor of ``root/rel`` (created 0755 where missing), every component
    opened without following links."""
    fd = os.open(root, _DIR_FLAGS)
    done: list[str] = []
    try:
        for part in Path(rel).parts:
            if part in ("", ".", "..", "/"):
                raise UnsafeImage(f"refusing the image path {rel!r}")
            done.append(part)
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refuse("/".join(done), fd, part) from None
                raise
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)


def write_file(root: Path, rel: str, data: bytes, mode: int = 0o644) -> None:
    """Create or replace ``root/rel`` with ``data`` and ``mode``; links refused."""
    parent, name = os.path.split(rel)
    with open_dir(root, parent) as dfd:
        try:
            # O_NONBLOCK: a FIFO the image put there would block the open for ever
            # (it fails with ENXIO instead); anything but a regular file is refused.
            fd = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                mode,
                dir_fd=dfd,
            )
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR):
                raise _refuse(rel, dfd, name) from None
            if e.errno == errno.ENXIO:
                raise UnsafeImage(f"the image's /{rel} is not a regular file") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsafeImage(f"the image's /{rel} is not a regular file")
            os.ftruncate(fd, 0)  # only now: truncating on open would hit any file type
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)


def lexists(root: Path, rel: str) -> bool:
    """Whether ``root/rel`` exists (as anything, a link included), without following
    a link on the way; a link on the way counts as absent."""
    parent, name = os.path.split(rel)
    try:
        with open_dir(root, parent, create=False) as dfd:
            os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except (OSError, UnsafeImage):
        return False
    return True


def is_regular(root: Path, rel: str) -> bool:
    """Whether ``root/rel`` is a regular file, no link followed on the way or at it."""
    parent, name = os.path.split(rel)
    try:
        with open_dir(root, parent, create=False) as dfd:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except (OSError, UnsafeImage):
        return False
    return stat.S_ISREG(st.st_mode)


@dataclass(frozen=True)
class Stripped:
    setid: list[str]  # files whose setuid/setgid bits were removed
    devices: list[str]  # device nodes removed


def strip_privileges(root: Path) -> Stripped:
    """Remove setuid/setgid bits from every non-directory and every block or
    character device from the tree.  Walked with directory descriptors and
    ``lstat`` only: no link of the image's is followed, not even to look."""
    setid: list[str] = []
    devices: list[str] = []
    fd = os.open(root, _DIR_FLAGS)
    try:
        _strip(fd, "", setid, devices)
    finally:
        os.close(fd)
    return Stripped(setid, devices)


MAX_DEPTH = 256  # a descriptor per level on the way down


def _strip(dfd: int, rel_dir: str, setid: list[str], devices: list[str], depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise UnsafeImage(f"the image nests directories deeper than {MAX_DEPTH} (at /{rel_dir})")
    for name in os.listdir(dfd):
        rel = f"{rel_dir}/{name}" if rel_dir else name
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            sub = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            try:
                _strip(sub, rel, setid, devices, depth + 1)
            finally:
                os.close(sub)
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            os.unlink(name, dir_fd=dfd)
            devices.append(rel)
        elif stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            # A regular file (not a link): chmod through an O_NOFOLLOW descriptor.
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd
            )
            try:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
            finally:
                os.close(fd)
            setid.append(rel)

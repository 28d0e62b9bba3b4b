"""Image and step mounts on a node, for runtimes that need a mounted root filesystem.

Where each lies under ``state_dir`` is core/layout.py's: ``images/sha256-<hex>/``,
the SIF's squashfs partition (ro,nosuid,nodev), one mount per image on the node,
shared by every job using it, by the first driver of the config's image_mount that
works here: the kernel's squashfs on a loop device (freed with the mount),
squashfuse_ll or squashfuse; ``jobs/<job>/img-<hex12>/``, the same private to one
job: when a step must mount by itself from inside a job's cgroup, where a FUSE
process would die with the job or step (Slurm kills what is left in it) and take
another job's image with it, and for a private image (an ``access:`` rule matches
where its bytes came from), whose job directory only root and the job's user may
traverse (0700 and a POSIX ACL: core/posixacl.py); and per step, ``skel/``
(empty directories to bind host paths onto, 0755; empty files for a GPU step's
driver, 0644; the batch step's stand-ins for Slurm's commands, 0755,
slurmstubs.py) and ``root/``, the overlay of
skel over the image (ro,nosuid,nodev) that ch-run runs.

A shared mount is counted by the image's holders in the cache (store.py): the
epilog unmounts it when no running job holds the image, under the image's lock,
so a job that starts meanwhile either still sees it or mounts it again.  Each job
reads it through its own overlay, which holds a reference of its own: even an
unmount the holders got wrong never takes the image from a running step.  One
mount per image means one page cache and one FUSE process per image on the node:
the tenth job on the node mounts nothing.

``images/``, ``jobs/``, ``jobs/<jobid>/`` and ``step-<stepid>/`` are 0711: the job's user must
traverse them to reach the container root, but nobody lists them (a private image's
``jobs/<jobid>/`` is its user's alone, and no chmod here opens it again).  What lies
there is the image (an open one is readable by every local user, see cache/store.py) and
empty directories; no user data is ever mounted in the host's namespace (binds are
made by the runtime, inside its own).  Every mount is ``nosuid,nodev``: a setuid
file or a device node a user put into their own image is never honoured on the host.

Why the overlay: ch-run can only bind onto directories that exist in the image,
and a SIF is read-only.  The skeleton holds the mount points (working directory,
home, batch script directory) without ever touching the user's paths as root.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from tfimage.agent.core import layout, toolrun
from tfimage.agent.core.errors import RuntimeSetupError
from tfimage.agent.core.fsutil import held
from tfimage.agent.core.posixacl import XATTR, restrict
from tfimage.agent.core.sif import root_partition
from tfimage.agent.step.squashcomp import Readers, compression, fuse_tool

MOUNT_TIMEOUT = 30.0
# Every mount tfimage makes: read-only, and never a setuid file or device from an image.
MOUNT_FLAGS = "ro,nosuid,nodev"
# Directories a job's user must traverse but has no reason to list.
TRAVERSE_ONLY = 0o711

log = logging.getLogger("tfimage.mount")


def _path(where: Callable[[], Path]) -> Path:
    """A layout path, its id or digest refused as the step's setup error."""
    try:
        return where()
    except ValueError as e:
        raise RuntimeSetupError(str(e)) from None


def job_dir(state_dir: str, job_id: str) -> Path:
    return _path(lambda: layout.job_dir(state_dir, job_id))


def safe_abspath(path: str, what: str) -> str:
    """A path from a job, accepted only when absolute and already normal."""
    if (
        not path.startswith("/")
        or "\0" in path
        or len(path) > 4096
        or os.path.normpath(path) != path
        or path.startswith("//")
    ):
        raise RuntimeSetupError(f"{what} {path[:200]!r} is not a normal absolute path")
    return path


@contextlib.contextmanager
def job_lock(state_dir: str, job_id: str) -> Iterator[None]:
    """Serialise the mounts of one job: its steps may start at the same moment."""
    lock = _path(lambda: layout.job_lock(state_dir, job_id))
    _mkdirs(Path(state_dir), lock.parent, TRAVERSE_ONLY)
    with held(lock):
        yield


def make_jobs_dir(state_dir: str) -> Path:
    """``state_dir/jobs`` made as the job lock makes it (no link followed, 0711)."""
    jobs = layout.jobs_dir(state_dir)
    _mkdirs(Path(state_dir), jobs, TRAVERSE_ONLY)
    return jobs


def mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def _mkdirs(state_dir: Path, path: Path, mode: int = 0o755) -> None:
    """mkdir -p below a root-owned tree of our own, refusing links on the way.  With
    TRAVERSE_ONLY every directory on the way gets that mode, existing ones too (a
    tree an older tfimage made 0755)."""
    # The admin's root-owned state directory (/run/tfimage: gone after a reboot
    # until the daemon or the first job makes it again).
    state_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in path.relative_to(state_dir).parts:
            created = False
            try:
                os.mkdir(part, dir_fd=fd)
                created = True
            except FileExistsError:
                pass
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
            if created or (mode == TRAVERSE_ONLY and not _restricted(fd)):
                os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _restricted(fd: int) -> bool:
    """A directory given an access ACL on purpose (a private image's job directory,
    kept to its user): a chmod would open it again, so it is left as it is."""
    try:
        os.getxattr(fd, XATTR)
    except OSError:
        return False
    return True


# A Slurm job's cgroup, v1 (/slurm/uid_1/job_2/step_0) or v2
# (/system.slice/slurmstepd.scope/job_2/step_0/...).
_JOB_CGROUP = re.compile(r"/job_[0-9]+(/|$)")


def shared_dir(state_dir: str, digest: str) -> Path:
    return _path(lambda: layout.image_mount(state_dir, digest))


def in_job_cgroup(proc_cgroup: str = "/proc/self/cgroup") -> bool:
    """Whether this process runs inside a Slurm job's cgroup (a step's helper run
    without the daemon): what it starts there dies with the job."""
    try:
        with open(proc_cgroup) as f:
            return any(_JOB_CGROUP.search(line.rstrip("\n").split(":", 2)[-1]) for line in f)
    except OSError:
        return False


def _alive(target: Path) -> bool:
    """A mount whose FUSE process died answers ENOTCONN: not a mount to hand a job."""
    try:
        os.stat(target)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            return False
        raise
    return True


def mount_image(
    state_dir: str,
    job_id: str,
    sif: Path,
    digest: str,
    drivers: Sequence[str] = ("squashfuse",),
    readers: Readers | None = None,
    private_to: int | None = None,
) -> Path:
    """The SIF's root partition mounted (idempotent), shared by every job on the node
    (see above), with the first of ``drivers`` that works here; each that does not
    (or that ``readers``, by default this node's, says cannot read the image's
    compression) is logged and skipped.  The caller has made ``job_id`` a holder of
    the image.

    ``private_to``: the image is private (an access rule matches it) and this uid's
    job may run it: mounted in the job's own directory instead, which only root and
    that uid may traverse (posixacl.py), so no other user of the node reaches it."""
    if private_to is None:
        shared = shared_dir(state_dir, digest)
        _mkdirs(Path(state_dir), shared.parent, TRAVERSE_ONLY)
        with held(Path(f"{shared}.lock")):
            if mounted(shared) and _alive(shared):
                return shared
            if not in_job_cgroup():
                _unmount(shared)  # a dead FUSE mount: its process was killed
                return _mount(state_dir, shared, sif, drivers, readers)
    # Inside a job's cgroup, or private: a mount of its own, which goes with the job.
    private = _path(lambda: layout.job_image_mount(state_dir, job_id, digest))
    with job_lock(state_dir, job_id):
        if mounted(private) and _alive(private):
            return private
        _unmount(private)
        _mkdirs(Path(state_dir), private.parent, TRAVERSE_ONLY)
        if private_to is not None:
            restrict(str(job_dir(state_dir, job_id)), [private_to], [], directory=True)
        return _mount(state_dir, private, sif, drivers, readers)


def _unmount(target: Path) -> None:
    """Detach whatever is mounted at ``target`` at once, even a busy or dead mount."""
    while mounted(target):
        toolrun.run(["umount", "-l", str(target)], timeout=MOUNT_TIMEOUT,
                    what="unmounting a dead image mount")  # fmt: skip


def _take_off(target: str, what: str) -> bool:
    """Unmount ``target``; a busy one is detached lazily instead, so that nothing
    waits on it.  False when it was busy (a failed lazy detach raises)."""
    try:
        toolrun.run(["umount", target], timeout=MOUNT_TIMEOUT, what=what)
        return True
    except RuntimeSetupError:
        toolrun.run(["umount", "-l", target], timeout=MOUNT_TIMEOUT, what=what)
        return False


def _mount(
    state_dir: str, target: Path, sif: Path, drivers: Sequence[str], readers: Readers | None
) -> Path:
    _mkdirs(Path(state_dir), target)
    with sif.open("rb") as f:
        part = root_partition(f, sif.stat().st_size)
        comp = compression(f, part.offset)
    if not drivers:
        raise RuntimeSetupError(
            "no image mount driver may mount this image: image_mount has only kernel, and "
            "image_mount_kernel does not list where it came from"
        )
    readers = readers or Readers()
    last: RuntimeSetupError | None = None
    unread: list[str] = []
    for driver in drivers:
        why = readers.cannot_read(driver, comp)
        if why:
            unread.append(f"{driver} ({why})")
            last = RuntimeSetupError(f"{driver} cannot read {comp} squashfs: {why}")
        else:
            try:
                toolrun.run(_mount_argv(driver, sif, part.offset, target), timeout=MOUNT_TIMEOUT,
                            what=f"mounting the image ({driver})")  # fmt: skip
                return target
            except RuntimeSetupError as e:
                _unmount(target)  # it mounted, then failed (a timeout): not trusted
                last = e if comp in (None, "gzip") else RuntimeSetupError(f"{e} ({comp} image)")
        if driver != drivers[-1]:
            log.warning("image mount: %s: %s; trying the next driver", driver, last)
    if len(unread) == len(drivers):
        raise RuntimeSetupError(
            f"the image's squashfs is {comp}-compressed, which no image mount driver here"
            f" reads: {', '.join(unread)}; rebuild it with gzip (mksquashfs's default) or"
            " install a driver that reads it"
        )
    assert last is not None
    raise last


def _mount_argv(driver: str, sif: Path, offset: int, target: Path) -> list[str]:
    if driver == "kernel":
        # mount(8) sets the loop device up with autoclear: it goes with the mount.
        options = f"{MOUNT_FLAGS},loop,offset={offset}"
        return ["mount", "-t", "squashfs", "-o", options, str(sif), str(target)]
    if driver in ("squashfuse_ll", "squashfuse"):
        tool = fuse_tool(driver)
        if not tool:
            raise RuntimeSetupError(f"{driver} is not installed on this node")
        options = f"{MOUNT_FLAGS},offset={offset},allow_other"
        return [tool, "-o", options, str(sif), str(target)]
    raise RuntimeSetupError(f"unknown image mount driver {driver!r}")


def step_root(
    state_dir: str,
    job_id: str,
    step_id: str,
    image: Path,
    mountpoints: Iterable[str],
    files: Iterable[str] = (),
    scripts: Mapping[str, str] | None = None,
) -> Path:
    """A read-only overlay of the image with ``mountpoints`` present as directories,
    ``files`` as empty files and ``scripts`` ({path: text}) as executables."""
    base = _path(lambda: layout.step_dir(state_dir, job_id, step_id))
    root = base / "root"
    skel = base / "skel"
    wanted = [safe_abspath(p, "mount point").lstrip("/") for p in mountpoints]
    wanted_files = [safe_abspath(p, "mount point").lstrip("/") for p in files]
    wanted_scripts = {
        safe_abspath(p, "command").lstrip("/"): text for p, text in (scripts or {}).items()
    }
    for p in [*wanted, *wanted_files]:  # a bind lands there: it wins over a stand-in
        wanted_scripts.pop(p, None)
    if mounted(root):
        if all((skel / p).is_dir() for p in wanted) and all(
            (skel / p).is_file() for p in [*wanted_files, *wanted_scripts]
        ):
            return root
        # A task found its working directory missing: rebuild before it enters.
        _take_off(str(root), "remounting")
    _mkdirs(Path(state_dir), base, TRAVERSE_ONLY)
    for p in wanted:
        _mkdirs(Path(state_dir), skel / p)
    for p in wanted_files:
        _mkdirs(Path(state_dir), (skel / p).parent)
        # skel is root's own tree (no link in it but those _mkdirs refused)
        fd = os.open(skel / p, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        os.close(fd)
    for p, text in wanted_scripts.items():
        _mkdirs(Path(state_dir), (skel / p).parent)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(skel / p, flags, 0o755)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o755)
            f.write(text)
    _mkdirs(Path(state_dir), root)
    _mount_overlay(f"lowerdir={skel}:{image}", root)
    return root


# MOUNT_FLAGS as mount(2)'s flags (<sys/mount.h>): an option added there without
# its flag here fails at import, never silently.
_MS = {"ro": 1, "nosuid": 2, "nodev": 4}  # MS_RDONLY, MS_NOSUID, MS_NODEV
_OVERLAY_FLAGS = sum(_MS[o] for o in MOUNT_FLAGS.split(","))


def _mount_overlay(options: str, target: Path) -> None:
    """mount(2) the step's overlay, ``MOUNT_FLAGS`` as flags: no mount(8) to start
    on each node's share of a step's launch (~3 ms of the ~13 ms preparation here).
    The worker that calls it has its own deadline (the daemon kills it, or the
    plugin stops waiting), as mount(8) had MOUNT_TIMEOUT."""
    libc = ctypes.CDLL(None, use_errno=True)
    mount = libc.mount
    mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    if mount(b"overlay", os.fsencode(target), b"overlay", _OVERLAY_FLAGS, os.fsencode(options)):
        e = ctypes.get_errno()
        raise RuntimeSetupError(f"preparing the container root: overlay: {os.strerror(e)}")


def release_job(state_dir: str, job_id: str) -> list[str]:
    """Unmount everything of the job, deepest first, and remove its directory.

    Returns the mount points that would not unmount (they are detached lazily, so
    the node never hangs on a busy FUSE mount).
    """
    base = job_dir(state_dir, job_id)
    prefix = str(base) + "/"
    with open("/proc/self/mountinfo") as f:
        targets = [line.split()[4] for line in f if line.split()[4].startswith(prefix)]
    stuck = []
    for target in sorted(targets, key=len, reverse=True):
        try:
            if not _take_off(target, "unmounting"):
                stuck.append(target)
        except RuntimeSetupError:
            stuck.append(target)
    if base.exists() and not any(mounted(Path(t)) for t in targets):
        shutil.rmtree(base, ignore_errors=True)
    for leftover in (layout.job_lock(state_dir, job_id), layout.job_images(state_dir, job_id)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)
    return stuck


def release_images(state_dir: str, in_use: Callable[[str], bool]) -> list[str]:
    """Unmount every shared image mount whose image no running job uses any more
    (``in_use(digest)``, asked under the image's lock).  Returns the mount points
    that were busy all the same (detached lazily: a process left in the image).
    An image whose lock another holds (a job mounting it, or one stuck on a hung
    FUSE process) is left to the next epilog: an epilog never waits on it."""
    base = layout.mounts_dir(state_dir)
    with open("/proc/self/mountinfo") as f:
        targets = sorted({Path(t) for line in f if (t := line.split()[4]).startswith(f"{base}/")})
    stuck = []
    for target in targets:
        digest = layout.digest_of_key(target.name)
        if target.parent != base or digest is None or layout.key(digest) != target.name:
            continue
        try:
            with held(Path(f"{target}.lock"), blocking=False):
                if in_use(digest) or not mounted(target):
                    continue
                if not _take_off(str(target), "unmounting"):
                    stuck.append(str(target))
                with contextlib.suppress(OSError):
                    target.rmdir()
        except BlockingIOError:
            log.info("image mount %s: in use by a job starting; left to the next epilog", target)
        except Exception as e:  # one image's trouble never keeps the others mounted
            log.error("image mount %s: %s", target, e)
            stuck.append(str(target))
    return stuck

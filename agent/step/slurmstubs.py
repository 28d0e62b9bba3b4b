"""Slurm's commands where a batch script runs inside the image.

With ``--tf-batch=auto`` a one-task job's script runs in the image, where ``srun``,
``sbatch`` and ``scontrol`` do not exist: a script that says ``srun python train.py``,
as most do, would end with ``srun: not found`` and nothing more.  Such a step's
overlay skeleton (never the image) gets a small script for each that says what
happened and what to do, and exits 127 as the shell does for a missing command::

    tfimage: srun: this batch script runs inside the image (...); submit with
    --tf-batch=host to run it on the host, where each srun step runs in the image

They go to ``/usr/local/bin``, on every image's PATH, unless the image has a command
of that name in any of the usual PATH directories, or its ``/usr/local/bin`` is not a
plain directory (a link: the skeleton's directory would hide where it leads).  The
image's tree is walked with ``O_NOFOLLOW``: root never follows an image's link; an
image that cannot be read gets none.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

DIR = ("usr", "local", "bin")
COMMANDS = ("srun", "sbatch", "salloc", "scontrol", "squeue", "scancel")


def script(name: str) -> str:
    return (
        "#!/bin/sh\n"
        f'echo "tfimage: {name}: this batch script runs inside the image (--tf-batch=auto '
        "runs a one-task job's script there), where Slurm's commands do not exist; submit "
        'with --tf-batch=host to run it on the host, where each srun step runs in the image" >&2\n'
        "exit 127\n"
    )


# Where a shell looks for a command in practically every image.
PATH = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin")


def _open_dir(root_fd: int, rel: str) -> int | None:
    """``rel`` under ``root_fd`` as a directory, never through a link; None if absent."""
    fd = os.dup(root_fd)
    try:
        for part in rel.split("/"):
            nfd = os.open(
                part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
            os.close(fd)
            fd = nfd
    except OSError:
        os.close(fd)
        return None
    return fd


def stubs(image_root: Path) -> dict[str, str]:
    """{path in the container: content} for the commands the image lacks."""
    try:
        return _stubs(image_root)
    except OSError:  # an image that cannot be read (EIO, a dead FUSE mount): none
        return {}


def _stubs(image_root: Path) -> dict[str, str]:
    root = os.open(image_root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        # usr/local/bin must be a real directory, or absent (the skeleton makes it)
        for depth in range(1, len(DIR) + 1):
            rel = "/".join(DIR[:depth])
            fd = _open_dir(root, rel)
            if fd is not None:
                os.close(fd)
                continue
            try:  # what is above it was just opened as real directories
                os.stat(rel, dir_fd=root, follow_symlinks=False)
            except FileNotFoundError:
                break
            return {}  # a link or a file where a directory should be
        present = set()
        for rel in PATH:
            d = _open_dir(root, rel)
            if d is None:
                continue
            try:
                for name in COMMANDS:
                    with contextlib.suppress(FileNotFoundError):
                        os.stat(name, dir_fd=d, follow_symlinks=False)
                        present.add(name)
            finally:
                os.close(d)
    finally:
        os.close(root)
    return {f"/{'/'.join(DIR)}/{n}": script(n) for n in COMMANDS if n not in present}

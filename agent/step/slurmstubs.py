"""Slurm's commands where a batch script runs inside the image.

With ``--tf-batch=auto`` a one-task job's script runs in the image, where ``srun``,
``sbatch`` and ``scontrol`` do not exist: a script that says ``srun python train.py``,
as most do, would end with ``srun: not found`` and nothing more.  Such a step's
overlay skeleton (never the image) gets a small script for each that says what
happened and what to do, and exits 127 as the shell does for a missing command::

    tfimage: srun: this batch script runs inside the image (...); submit with
    --tf-batch=host to run it on the host, where each srun step runs in the image

They go to ``/usr/local/bin``, on every image's PATH, unless the image has its own
command of that name there, or its ``/usr/local/bin`` is not a plain directory (a
link: the skeleton's directory would hide where it leads).  The image's tree is
walked with ``O_NOFOLLOW``: root never follows an image's link.
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


def stubs(image_root: Path) -> dict[str, str]:
    """{path in the container: content} for the commands the image lacks."""
    fd = os.open(image_root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in DIR:
            try:
                nfd = os.open(
                    part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
            except FileNotFoundError:
                break  # the skeleton makes the rest; nothing of the image is hidden
            except OSError:
                return {}  # a link or a file where a directory should be
            os.close(fd)
            fd = nfd
        else:
            present = set()
            for name in COMMANDS:
                with contextlib.suppress(FileNotFoundError):
                    os.stat(name, dir_fd=fd, follow_symlinks=False)
                    present.add(name)
            return {f"/{'/'.join(DIR)}/{n}": script(n) for n in COMMANDS if n not in present}
    finally:
        os.close(fd)
    return {f"/{'/'.join(DIR)}/{n}": script(n) for n in COMMANDS}

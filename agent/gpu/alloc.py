"""Slurm's GPU allocation, as the prolog's environment gives it, parsed strictly.

``SLURM_JOB_GPUS`` and ``CUDA_VISIBLE_DEVICES`` hold node-wide GPU indices
(``0,2``), or UUIDs (``GPU-8f1c...``, ``MIG-...``).  Which number an index is (NVML's
index under ``AutoDetect=nvml``, the minor number of ``File=/dev/nvidiaN``) is the
site's choice, ``gpu.mapping``.  The text is a job's: bounded before it is split.
"""

from __future__ import annotations

import re

from tfimage.agent.core.errors import InputError

MAX_TEXT = 8192
MAX_GPUS = 1024
_INDEX = re.compile(r"(0|[1-9][0-9]{0,3})\Z")
_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z/-]{1,96}\Z")


def parse_gpus(text: str) -> tuple[str, ...]:
    """The GPUs ``text`` names, in its order; ``()`` for none.  A duplicate or a
    token that is neither an index nor a UUID is an error, never skipped."""
    if len(text) > MAX_TEXT:
        raise InputError(f"GPU list: longer than {MAX_TEXT} characters")
    if not text.strip() or text.strip() in ("NoDevFiles", "N/A"):
        return ()
    tokens = text.split(",")
    if len(tokens) > MAX_GPUS:
        raise InputError(f"GPU list: more than {MAX_GPUS} GPUs")
    for t in tokens:
        if not (_INDEX.match(t) or _UUID.match(t)):
            raise InputError(f"GPU list: {t[:40]!r} is neither a GPU index nor a UUID")
    if len(set(tokens)) != len(tokens):
        raise InputError("GPU list: a GPU is named twice")
    return tuple(tokens)


def is_uuid(token: str) -> bool:
    return bool(_UUID.match(token))

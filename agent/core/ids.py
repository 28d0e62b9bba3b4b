"""The identifiers tfimage takes from Slurm and registries, each matched one way."""

from __future__ import annotations

import re

from tfimage.agent.core.errors import InputError

JOB_ID = re.compile(r"[0-9]{1,10}\Z")
STEP_ID = re.compile(r"[0-9]{1,10}\Z")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")
NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


def check_node(node: str) -> str:
    """``node`` if it can be a Slurm node name (one of Slurm's own: a hook's
    argument from SLURMD_NODENAME), else InputError."""
    if not NODE.match(node):
        raise InputError(f"node name {node[:40]!r} is not a Slurm node name")
    return node


def valid_job_id(text: str) -> bool:
    return bool(JOB_ID.match(text))


def valid_step_id(text: str) -> bool:
    return bool(STEP_ID.match(text))


def valid_digest(text: str) -> bool:
    return bool(DIGEST.match(text))

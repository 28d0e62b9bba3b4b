"""The identifiers tfimage takes from Slurm and registries, each matched one way."""

from __future__ import annotations

import re

JOB_ID = re.compile(r"[0-9]{1,10}\Z")
STEP_ID = re.compile(r"[0-9]{1,10}\Z")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")


def valid_job_id(text: str) -> bool:
    return bool(JOB_ID.match(text))


def valid_step_id(text: str) -> bool:
    return bool(STEP_ID.match(text))


def valid_digest(text: str) -> bool:
    return bool(DIGEST.match(text))

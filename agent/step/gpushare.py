"""Fractional GPUs: what a task sharing its GPUs through Slurm's gres/mps gets.

Slurm sets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` for a gres/mps job (a share of each
GPU's threads) but nothing for memory, and TensorFlow has no variable that caps it:
``--mem-per-gpu`` (``SLURM_MEM_PER_GPU``, MB) becomes a real per-process limit only
through MPS, as ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (CUDA >= 11.5, Volta or newer;
NVIDIA's MPS guide, "Appendix: Environment Variables"), one entry per GPU ordinal as
the task sees them (``0=10G,1=10G``).  The MPS control daemon must run on the node.
Like every variable tfimage offers, it never overrides one the user set.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from tfimage.agent.core.errors import InputError
from tfimage.agent.gpu.alloc import parse_gpus

LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
_MB = re.compile(r"[1-9][0-9]{0,8}\Z")


def _amount(mb: int) -> str:
    return f"{mb >> 10}G" if mb % 1024 == 0 else f"{mb}MB"


def mps_memory_limit(env: Mapping[str, str]) -> tuple[str, str] | None:
    """``(value, why)`` for the MPS memory limit of a task in ``env``, or None when
    the step is not an MPS step with ``--mem-per-gpu``."""
    if not env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        return None
    mem = env.get("SLURM_MEM_PER_GPU", "")
    if not _MB.match(mem):
        return None
    try:
        gpus = parse_gpus(env.get("CUDA_VISIBLE_DEVICES") or env.get("SLURM_STEP_GPUS", ""))
    except InputError:
        return None
    if not gpus:
        return None
    amount = _amount(int(mem))
    value = ",".join(f"{i}={amount}" for i in range(len(gpus)))
    return value, f"--mem-per-gpu={mem}M on each of the task's {len(gpus)} MPS-shared GPU(s)"

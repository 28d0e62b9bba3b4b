"""NVML readings of a node's GPUs, one :class:`Reading` per GPU.

The GPU gate's one user of ``pynvml`` (nvidia-ml-py; ``tfimage doctor`` also loads
it, apart, only to say why it cannot).  It loads
``libnvidia-ml.so.1`` through the normal library search, which is how the tests
give it a fake library with the state of their choosing (tests/fakenvml/).

A function the GPU or the driver does not have (``NotSupported``, or a driver too
old for it: ``FunctionNotFound``) is recorded in ``skipped``, never a fault.  A GPU
that NVML reports lost or needing a reset is a fault, however far the reading got.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tfimage.agent.gpu.alloc import is_uuid

# NVML's return codes (nvml.h), the few whose meaning the gate depends on.
NOT_SUPPORTED = 3
FUNCTION_NOT_FOUND = 13
CORRUPTED_INFOROM = 14
GPU_IS_LOST = 15
RESET_REQUIRED = 16
FI_DEV_GET_GPU_RECOVERY_ACTION = 230
MAX_NVLINKS = 36  # NVML_NVLINK_MAX_LINKS

_FAULTS = {GPU_IS_LOST: "GPU is lost", RESET_REQUIRED: "GPU needs a reset"}


@dataclass
class Reading:
    """One GPU as NVML saw it.  ``values`` by metric name; ``skipped``: the metrics
    this GPU or driver does not report, and why."""

    index: int
    uuid: str = ""
    pci: str = ""  # NVML's bus id, 00000000:3B:00.0
    minor: int | None = None
    fault: str = ""  # lost or needing a reset: nothing else read is trusted
    values: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


@dataclass
class NodeReading:
    init_error: str = ""  # NVML did not initialise: why
    driver: str = ""
    gpus: list[Reading] = field(default_factory=list)
    seconds: float = 0.0


class _Skip(Exception):  # noqa: N818 - a control-flow signal, not an error
    def __init__(self, why: str) -> None:
        self.why = why


class _Fault(Exception):  # noqa: N818 - a control-flow signal, not an error
    def __init__(self, why: str) -> None:
        self.why = why


@dataclass(frozen=True)
class Selection:
    """Which GPUs get the full reading: every one, or those the tokens name (Slurm's
    indices or UUIDs; a number means an NVML index or, with ``mapping: minor``, a
    minor number).  Data, not a function: it crosses into the child (child.py)."""

    everything: bool
    tokens: tuple[str, ...] = ()
    mapping: str = "index"

    def allocated(self, r: Reading) -> bool:
        return any(self.names(r, t) for t in self.tokens)

    def names(self, r: Reading, token: str) -> bool:
        if is_uuid(token):
            return r.uuid == token or r.uuid.startswith(token)
        n = int(token)
        return r.minor == n if self.mapping == "minor" else r.index == n

    def __call__(self, r: Reading) -> bool:
        return self.everything or self.allocated(r)


def _call(nvml: Any, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except nvml.NVMLError as e:
        code = getattr(e, "value", None)
        if code in _FAULTS:
            raise _Fault(_FAULTS[code]) from None
        if code == FUNCTION_NOT_FOUND:
            raise _Skip("the driver has no such function") from None
        if code == NOT_SUPPORTED:
            raise _Skip("not supported") from None
        raise _Skip(f"NVML: {e}") from None


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _metrics(nvml: Any, h: Any) -> dict[str, Callable[[], Any]]:
    def retired(cause: int) -> int:
        return len(nvml.nvmlDeviceGetRetiredPages(h, cause))

    def inforom() -> str:
        try:
            nvml.nvmlDeviceValidateInforom(h)
        except nvml.NVMLError as e:
            if getattr(e, "value", None) == CORRUPTED_INFOROM:
                return "corrupt"
            raise
        return "ok"

    def recovery() -> int:
        v = nvml.nvmlDeviceGetFieldValues(h, [FI_DEV_GET_GPU_RECOVERY_ACTION])[0]
        if v.nvmlReturn != 0:
            raise nvml.NVMLError(v.nvmlReturn)
        return int(v.value.uiVal)

    def nvlinks() -> list[int]:
        states: list[int] = []
        for link in range(MAX_NVLINKS):
            try:
                states.append(int(nvml.nvmlDeviceGetNvLinkState(h, link)))
            except nvml.NVMLError:
                if not states:
                    raise
                break  # past the GPU's last link
        return states

    def clocks() -> int:
        try:
            return int(nvml.nvmlDeviceGetCurrentClocksEventReasons(h))
        except nvml.NVMLError as e:
            if getattr(e, "value", None) != FUNCTION_NOT_FOUND:
                raise
            return int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))  # older drivers

    return {
        "ecc_dbe": lambda: int(nvml.nvmlDeviceGetTotalEccErrors(h, 1, 0)),
        "ecc_sbe": lambda: int(nvml.nvmlDeviceGetTotalEccErrors(h, 0, 0)),
        "remapped": lambda: tuple(int(x) for x in nvml.nvmlDeviceGetRemappedRows(h)),
        "retired_pending": lambda: int(nvml.nvmlDeviceGetRetiredPagesPendingStatus(h)),
        "retired_sbe": lambda: retired(0),
        "retired_dbe": lambda: retired(1),
        "inforom": inforom,
        "recovery": recovery,
        "processes": lambda: sorted(
            int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)
        ),
        "nvlinks": nvlinks,
        "energy_mj": lambda: int(nvml.nvmlDeviceGetTotalEnergyConsumption(h)),
        "clock_events": clocks,
        "persistence": lambda: int(nvml.nvmlDeviceGetPersistenceMode(h)),
        "pcie": lambda: (
            int(nvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
            int(nvml.nvmlDeviceGetMaxPcieLinkWidth(h)),
            int(nvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
            int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),
        ),
    }


def _identify(nvml: Any, index: int) -> tuple[Reading, Any]:
    r = Reading(index)
    try:
        h = _call(nvml, lambda: nvml.nvmlDeviceGetHandleByIndex(index))
        r.uuid = _text(_call(nvml, lambda: nvml.nvmlDeviceGetUUID(h)))
        r.pci = _text(_call(nvml, lambda: nvml.nvmlDeviceGetPciInfo(h).busId))
    except _Fault as e:
        r.fault = e.why
        return r, None
    except _Skip as e:  # a GPU NVML cannot even name is as good as lost
        r.fault = f"cannot be read ({e.why})"
        return r, None
    try:
        r.minor = int(_call(nvml, lambda: nvml.nvmlDeviceGetMinorNumber(h)))
    except _Skip as e:
        r.skipped["minor"] = e.why
    except _Fault as e:
        r.fault = e.why
    return r, h


def probe(wanted: Callable[[Reading], bool]) -> NodeReading:
    """Every GPU's identity, and the full reading of those ``wanted`` picks."""
    started = time.monotonic()
    node = NodeReading()
    try:
        import pynvml as nvml
    except ImportError:
        node.init_error = "nvidia-ml-py is not installed"
        return node
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        node.init_error = str(e)
        node.seconds = time.monotonic() - started
        return node
    try:
        try:
            node.driver = _text(nvml.nvmlSystemGetDriverVersion())
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as e:
            node.init_error = str(e)
            return node
        for index in range(count):
            r, h = _identify(nvml, index)
            node.gpus.append(r)
            if h is None or r.fault or not wanted(r):
                continue
            for name, read in _metrics(nvml, h).items():
                try:
                    r.values[name] = _call(nvml, read)
                except _Skip as e:
                    r.skipped[name] = e.why
                except _Fault as e:
                    r.fault = e.why
                    break
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
        node.seconds = time.monotonic() - started
    return node

"""Readings + policy -> findings.  Pure: no NVML, no files, no Slurm.

A finding names the GPU (``gpu3 GPU-8f1c...``), the check (gpuconfig.CHECKS), its
severity (``drain``, ``warning``, or ``skipped`` for a check the GPU or the driver
cannot answer, never a drain) and the cause in a few words, which is what a drained
node's reason says: ``tfimage: gpu3 GPU-8f1c...: volatile uncorrected ECC: 2``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from tfimage.agent.core.gpuconfig import GpuPolicy
from tfimage.agent.gpu.probe import NodeReading, Reading
from tfimage.agent.gpu.xid import Xid
from tfimage.agent.gpu.xid import key as bus_key

# NVML's recovery actions (nvmlDeviceGetFieldValues, NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)
# that ask for a reset or a reboot: GPU reset, node reboot, drain and reset, bus
# reset, system reboot.  0 is none; 3 (drain peer-to-peer) and 5 (IMEX) are not the GPU's.
RECOVERY = {1: "GPU reset", 2: "node reboot", 4: "drain and reset", 6: "bus reset", 7: "reboot"}
# nvmlClocksEventReason*: software and hardware thermal, hardware slowdown, power brake.
CLOCK_EVENTS = {
    0x08: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}
GPU_IDLE = 0x01  # an idle GPU lowers its PCIe generation on purpose
# Which checks a metric that cannot be read leaves unanswered.
SKIPS = {
    "ecc_dbe": ("ecc_dbe",),
    "remapped": ("remap_failure", "remap_pending", "remapped_rows"),
    "retired_pending": ("retired_pending",),
    "retired_sbe": ("retired_pages",),
    "retired_dbe": ("retired_pages",),
    "inforom": ("inforom",),
    "recovery": ("recovery",),
    "processes": ("processes",),
    "nvlinks": ("nvlink",),
    "persistence": ("persistence",),
    "clock_events": ("clocks",),
    "pcie": ("pcie",),
}


@dataclass(frozen=True)
class Finding:
    gpu: str  # gpu3, or "nvml" for the library itself
    uuid: str
    check: str
    severity: str  # drain, warning or skipped
    cause: str

    def reason(self) -> str:
        """A drained node's reason, within what ``sinfo -R`` shows whole."""
        who = f"{self.gpu} {self.uuid}".strip()
        return f"tfimage: {who}: {self.cause}"[:REASON_MAX]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


REASON_MAX = 200


@dataclass(frozen=True)
class Verdict:
    findings: tuple[Finding, ...]

    @property
    def drains(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "drain"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def status(self) -> int:
        """0 healthy, 1 warnings, 2 a drain-class finding (``tfimage gpu check``)."""
        return 2 if self.drains else 1 if self.warnings else 0


def _gpu_findings(
    r: Reading, policy: GpuPolicy, expect_idle: bool, xids: Iterable[Xid]
) -> Iterable[tuple[str, str]]:
    """(check, cause) for each thing wrong with one GPU."""
    if r.fault:
        yield "lost", r.fault
        return
    v = r.values
    if v.get("inforom") == "corrupt":
        yield "inforom", "corrupt InfoROM"
    action = v.get("recovery")
    if action in RECOVERY:
        yield "recovery", f"the driver asks for a {RECOVERY[action]}"
    if "remapped" in v:
        corr, unc, pending, failure = v["remapped"]
        if failure:
            yield "remap_failure", "row remapping failed"
        if pending:
            yield "remap_pending", "row remapping pending (needs a reset)"
        if policy.remapped_rows_max is not None and corr + unc > policy.remapped_rows_max:
            yield "remapped_rows", f"{corr + unc} remapped rows (over {policy.remapped_rows_max})"
    if v.get("retired_pending"):
        yield "retired_pending", "retired pages pending (needs a reset)"
    sbe, dbe = v.get("retired_sbe", 0), v.get("retired_dbe", 0)
    if sbe + dbe > policy.retired_pages_max:
        yield "retired_pages", f"{sbe + dbe} retired pages (over {policy.retired_pages_max})"
    elif dbe > policy.retired_pages_dbe_max:
        yield (
            "retired_pages",
            f"{dbe} double-bit retired pages (over {policy.retired_pages_dbe_max})",
        )
    if v.get("ecc_dbe", 0) > 0:
        yield "ecc_dbe", f"volatile uncorrected ECC: {v['ecc_dbe']}"
    procs = v.get("processes", [])
    if procs and expect_idle:
        shown = ",".join(str(p) for p in procs[:4]) + ("..." if len(procs) > 4 else "")
        yield "processes", f"{len(procs)} compute process(es) from outside the job: pid {shown}"
    links = v.get("nvlinks", [])
    down = [i for i, up in enumerate(links) if not up]
    # Every link inactive is a GPU with no NVLink wired (a PCIe card without a
    # bridge); a link down beside links up is a fault.
    if down and len(down) < len(links):
        yield "nvlink", "NVLink down: link " + ",".join(map(str, down))
    seen = sorted({x.xid for x in xids if x.xid in policy.xids})
    if seen:
        yield "xid", "XID " + ",".join(map(str, seen)) + " in the kernel log"
    if v.get("persistence") == 0:
        yield "persistence", "persistence mode off"
    events = v.get("clock_events", 0)
    slow = [name for bit, name in CLOCK_EVENTS.items() if events & bit]
    if slow:
        yield "clocks", "clocks held down: " + ", ".join(slow)
    if "pcie" in v:
        cw, mw, cg, mg = v["pcie"]
        if cw < mw:
            yield "pcie", f"PCIe link x{cw} of x{mw}"
        elif cg < mg and not events & GPU_IDLE:
            yield "pcie", f"PCIe link gen{cg} of gen{mg}"


def judge(
    node: NodeReading,
    gpus: list[Reading],
    missing: list[str],
    policy: GpuPolicy,
    *,
    idle: set[int] | frozenset[int] = frozenset(),
    xids: dict[str, list[Xid]] | None = None,
) -> Verdict:
    """The findings for ``gpus`` (the readings to judge) and for the ``missing``
    allocated GPUs NVML does not show.  ``idle``: the indices of GPUs on which no
    compute process belongs (a job's own, before it starts)."""
    out: list[Finding] = []

    def add(gpu: str, uuid: str, check: str, cause: str) -> None:
        level = policy.severity_of(check)
        if level != "off":
            out.append(Finding(gpu, uuid, check, level, cause))

    if node.init_error:
        add("nvml", "", "init", f"NVML does not initialise: {node.init_error}")
        return Verdict(tuple(out))
    if missing:
        add(
            "nvml",
            "",
            "count",
            f"{len(missing)} allocated GPU(s) not visible: {','.join(missing)[:60]}",
        )
    for r in gpus:
        label = f"gpu{r.index}"
        for check, cause in _gpu_findings(
            r, policy, r.index in idle, (xids or {}).get(bus_key(r.pci), [])
        ):
            add(label, r.uuid, check, cause)
        unanswered: dict[str, str] = {}
        for metric, why in sorted(r.skipped.items()):
            for check in SKIPS.get(metric, ()):
                if check != "remapped_rows" or policy.remapped_rows_max is not None:
                    unanswered.setdefault(check, why)
        for check, why in unanswered.items():
            if policy.severity_of(check) != "off":
                # NotSupported (or no such function) is a skip; any other NVML error
                # on a GPU that answers otherwise is worth a look, never a drain.
                level = "warning" if why.startswith("NVML:") else "skipped"
                out.append(Finding(label, r.uuid, check, level, why))
    return Verdict(tuple(out))

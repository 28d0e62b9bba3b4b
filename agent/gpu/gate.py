"""The GPU gate: the prolog's check of a job's GPUs, its baseline, and the operator's
``tfimage gpu check``.

On a drain-class finding the prolog drains the node itself, with the finding as the
reason (``tfimage: gpu3 GPU-...: row remapping pending (needs a reset)``), and raises
:class:`NodeFault`: the one case in which a tfimage hook exits non-zero, so that
Slurm requeues the job (held, unless ``SchedulerParameters=nohold_on_prolog_fail``).
Warnings and skipped checks are logged.

The baseline (the job's own GPUs' counters, which the epilog turns into the job's
deltas and checks again) is kept where no
job's user can reach it, ``gpu/jobs/<job>.json`` under ``state_dir`` (core/layout.py;
``gpu/`` is 0700): ``{"GPU-...": {"energy_mj": ..., "ecc_sbe": ...}, ...}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfimage.agent.core import layout
from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import NodeFault, TfimageError
from tfimage.agent.core.fsutil import read_json, write_json
from tfimage.agent.gpu import drain as slurm
from tfimage.agent.gpu import xid
from tfimage.agent.gpu.child import probe_bounded
from tfimage.agent.gpu.probe import NodeReading, Reading, Selection
from tfimage.agent.gpu.verdict import Finding, Verdict, judge
from tfimage.agent.usage import metrics

BASELINE = ("energy_mj", "ecc_sbe", "ecc_dbe", "remapped", "retired_sbe", "retired_dbe")

log = logging.getLogger("tfimage.gpu")


@dataclass
class Check:
    node: NodeReading
    gpus: list[Reading]  # the GPUs judged, in NVML's order
    verdict: Verdict
    # Of those, the job's own (with ``scope: node`` the others are judged too, but
    # belong to other jobs: no baseline, no idle check after the job)
    allocated: list[Reading] = field(default_factory=list)


def check(
    cfg: Config,
    alloc: tuple[str, ...],
    *,
    expect_idle: bool,
    shared: bool = False,
    advance: bool = False,
    node_name: str = "",
) -> Check:
    """Judge the allocated GPUs (every GPU with ``scope: node``, or with no allocation
    given, as an operator's check does).  ``expect_idle``: no process belongs on the
    allocated ones (other GPUs of the node may be busy with other jobs).  ``advance``:
    move the XID cursors past what this check saw (the prolog and a health check,
    which act on it; an operator's look must not swallow an XID).  ``node_name``:
    this node, for ``gpu.shared``'s list (a node that shares GPUs expects others'
    processes on them)."""
    policy = cfg.gpu
    shared = shared or policy.shares(node_name or socket.gethostname().split(".")[0])
    # A MIG instance's UUID names no whole GPU: such a job's GPUs are checked whole.
    mig = any(t.startswith("MIG-") for t in alloc)
    whole = tuple(t for t in alloc if not t.startswith("MIG-"))
    wanted = Selection(policy.scope == "node" or not whole or mig, whole, policy.mapping)
    node = probe_bounded(wanted, policy.timeout)
    gpus = [r for r in node.gpus if wanted(r)]
    missing = [t for t in whole if not any(wanted.names(r, t) for r in node.gpus)]
    idle = {r.index for r in gpus if wanted.allocated(r)} if expect_idle and not shared else set()
    xids: dict[str, list[xid.Xid]] = {}
    if not node.init_error and policy.severity_of("xid") != "off":
        buses = [b for b in (xid.key(r.pci) for r in gpus) if b]
        try:
            log_records = xid.read_xids(Path(policy.kmsg))
            with xid.cursor(Path(cfg.state_dir), save=advance) as seqs:
                xids = xid.new_xids(log_records, seqs, buses)
        except OSError as e:  # no kernel log to read is no finding, but said
            log.warning("gpu: XIDs not checked: %s: %s", policy.kmsg, e.strerror)
    verdict = judge(node, gpus, missing, policy, idle=idle, xids=xids)
    return Check(node, gpus, verdict, [r for r in gpus if wanted.allocated(r)])


def _baseline_path(state_dir: str, job_id: str) -> Path:
    return layout.gpu_baseline(state_dir, job_id)


def save_baseline(state_dir: str, job_id: str, gpus: list[Reading]) -> Path:
    doc: dict[str, dict[str, Any]] = {
        r.uuid: {k: r.values[k] for k in BASELINE if k in r.values} for r in gpus if r.uuid
    }
    path = _baseline_path(state_dir, job_id)
    path.parent.parent.parent.mkdir(mode=0o755, parents=True, exist_ok=True)  # state_dir
    for d in (path.parent.parent, path.parent):  # gpu/ and gpu/jobs/: root's alone
        d.mkdir(mode=0o700, exist_ok=True)
        d.chmod(0o700)
    write_json(path, doc, mode=0o600)
    return path


def load_baseline(state_dir: str, job_id: str) -> dict[str, dict[str, Any]]:
    """The prolog's baseline for the job: {uuid: counters}; empty when none was saved."""
    doc = read_json(_baseline_path(state_dir, job_id), 1 << 20)
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, dict)}


def drop_baseline(state_dir: str, job_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _baseline_path(state_dir, job_id).unlink()


def prolog_gate(
    cfg: Config, job_id: str, node_name: str, alloc: tuple[str, ...], *, shared: bool = False
) -> Check:
    """The prolog's check of the job's GPUs.  Drains the node and raises NodeFault on
    a drain-class finding; otherwise saves the baseline and returns the check.
    ``shared``: the job shares its GPUs (gres/mps), so other processes are legitimate."""
    got = check(cfg, alloc, expect_idle=True, shared=shared, advance=True, node_name=node_name)
    for f in got.verdict.warnings:
        log.warning("job %s: gpu: %s", job_id, f.reason())
    skipped = [f for f in got.verdict.findings if f.severity == "skipped"]
    if skipped:
        log.info(
            "job %s: gpu: %d check(s) skipped (not supported): %s",
            job_id,
            len(skipped),
            ", ".join(sorted({f.check for f in skipped})),
        )
    count(cfg, got)
    if got.verdict.drains:
        raise NodeFault(f"job {job_id}: {_drain(cfg, job_id, node_name, got.verdict.drains)}")
    save_baseline(cfg.state_dir, job_id, got.allocated)
    log.info(
        "job %s: gpu: %d GPU(s) healthy in %.0f ms",
        job_id,
        len(got.gpus),
        got.node.seconds * 1000,
    )
    return got


def _drain(cfg: Config, job_id: str, node_name: str, drains: list[Finding]) -> str:
    """Drain the node with the first finding as the reason; says what was done.  When
    scontrol cannot, raises NodeFault: the hook's non-zero exit makes Slurm drain it."""
    first = drains[0]
    more = f" (and {len(drains) - 1} more)" if len(drains) > 1 else ""
    try:
        slurm.drain(node_name, first.reason(), cfg.gpu.slurm_bin)
    except TfimageError as e:
        raise NodeFault(f"job {job_id}: {first.reason()}{more}; {e}") from None
    return f"drained {node_name}: {first.reason()}{more}"


def count(cfg: Config, got: Check) -> None:
    """Each GPU's verdict and a drain into the node's metrics (usage/metrics.py).  Their
    trouble (a full /run) is logged: it never changes what the check decided."""
    per = per_gpu(got)

    def change(counters: dict[str, Any]) -> None:
        metrics.gpu_health(per)(counters)
        if got.verdict.drains:
            metrics.add("gpu_drains")(counters)

    try:
        metrics.update(cfg.state_dir, cfg.metrics_dir, cfg.cache_dir, change)
    except Exception as e:
        log.error("gpu: metrics not written: %s: %s", type(e).__name__, e)


def health(got: Check) -> str:
    """One word for a check: ``drain``, ``warn`` or ``ok``."""
    if got.verdict.drains:
        return "drain"
    return "warn" if got.verdict.warnings else "ok"


def per_gpu(got: Check) -> dict[str, tuple[int, bool]]:
    """Each judged GPU's verdict, for the metrics: {uuid: (index, healthy)}."""
    bad = {f.uuid for f in got.verdict.drains}
    return {r.uuid: (r.index, r.uuid not in bad) for r in got.gpus if r.uuid}


@dataclass
class AfterJob:
    check: Check
    energy_j: dict[str, float | None]  # per GPU: the job's energy (epilog minus prolog)


def epilog_gate(
    cfg: Config,
    job_id: str,
    node_name: str,
    baseline: dict[str, dict[str, Any]],
    *,
    shared: bool = False,
    settle: float = 1.0,
) -> AfterJob:
    """The epilog's check of the job's GPUs (those of its baseline): a compute process
    left on them after the job drains the node; so does any other drain-class finding.
    Slurm has killed the job's processes by now, but a driver may still list one for
    a moment: a finding of processes alone is looked at again after ``settle`` s.
    Returns the check and each GPU's energy in J."""
    alloc = tuple(baseline)
    got = check(cfg, alloc, expect_idle=True, shared=shared, advance=True, node_name=node_name)
    if got.verdict.drains and all(f.check == "processes" for f in got.verdict.drains):
        time.sleep(settle)
        got = check(cfg, alloc, expect_idle=True, shared=shared, advance=True, node_name=node_name)
    findings = tuple(
        dataclasses.replace(
            f, cause=f.cause.replace("from outside the job", f"left by job {job_id}")
        )
        if f.check == "processes"
        else f
        for f in got.verdict.findings
    )
    got = Check(got.node, got.gpus, Verdict(findings), got.allocated)
    energy: dict[str, float | None] = {}
    for uuid, before in baseline.items():
        now = next((r for r in got.gpus if r.uuid == uuid), None)
        start, end = before.get("energy_mj"), now.values.get("energy_mj") if now else None
        ok = isinstance(start, int) and isinstance(end, int) and end >= start
        energy[uuid] = round((end - start) / 1000.0, 3) if ok else None  # type: ignore[operator]
    for f in got.verdict.warnings:
        log.warning("job %s: gpu after the job: %s", job_id, f.reason())
    count(cfg, got)
    if got.verdict.drains:
        log.error("job %s: %s", job_id, _drain(cfg, job_id, node_name, got.verdict.drains))
    return AfterJob(got, energy)

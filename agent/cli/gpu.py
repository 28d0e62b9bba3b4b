"""``tfimage gpu check`` and ``tfimage gpu resume``: the prolog's GPU gate, for operators.

``check`` exits 0 healthy, 1 warnings, 2 a drain-class finding.  With
``--health-check`` it is Slurm's ``HealthCheckProgram``: every GPU, busy ones
included, and a drain-class finding drains the node with a ``tfimage:`` reason.
``resume`` returns a node to service only when tfimage drained it (the reason starts
with ``tfimage:``) and a fresh check passes; any other drain is the site's, and is
never touched.
"""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path
from typing import Any

from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import TfimageError
from tfimage.agent.core.ids import check_node
from tfimage.agent.gpu import drain as slurm
from tfimage.agent.gpu.alloc import parse_gpus
from tfimage.agent.gpu.gate import Check, check

LEVELS = ("healthy", "warning", "drain")
# The driver's control device: present on every node with an NVIDIA GPU.
NVIDIACTL = "/dev/nvidiactl"


def _node(args: argparse.Namespace) -> str:
    return check_node(args.node or socket.gethostname().split(".")[0])


def _report(args: argparse.Namespace, got: Check, extra: dict[str, Any]) -> None:
    v = got.verdict
    if args.json:
        doc = {
            "status": LEVELS[v.status],
            "driver": got.node.driver,
            "nvml": got.node.init_error or "ok",
            "gpus": [
                {"index": r.index, "uuid": r.uuid, "pci": r.pci, "minor": r.minor} for r in got.gpus
            ],
            "findings": [f.as_dict() for f in v.findings],
            "milliseconds": round(got.node.seconds * 1000, 1),
            **extra,
        }
        print(json.dumps(doc, sort_keys=True))
        return
    for f in v.findings:
        if f.severity == "skipped" and args.verbose:
            print(f"SKIPPED  {f.gpu} {f.uuid}: {f.check}: {f.cause}")
        elif f.severity != "skipped":
            print(f"{f.severity.upper():8} {f.reason().removeprefix('tfimage: ')}")
    skipped = len([f for f in v.findings if f.severity == "skipped"])
    driver = f"driver {got.node.driver}, " if got.node.driver else ""
    print(
        f"tfimage: gpu: {len(got.gpus)} GPU(s), {driver}{LEVELS[v.status]}"
        + (f", {skipped} check(s) not supported" if skipped else "")
        + f" ({got.node.seconds * 1000:.0f} ms)"
    )


def cmd_gpu_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    alloc = parse_gpus(args.gpus)
    node = _node(args)
    # A health check acts on what it sees, as the prolog does: it moves the XID
    # cursors (an XID drains once, and `gpu resume` can pass after it).
    got = check(cfg, alloc, expect_idle=args.idle, node_name=node, advance=args.health_check)
    extra: dict[str, Any] = {}
    if args.health_check and got.node.init_error and not Path(NVIDIACTL).exists():
        # HealthCheckProgram is cluster-wide: a node without NVIDIA GPUs is no fault.
        why = f"no NVIDIA GPU on this node ({NVIDIACTL} missing): nothing to check"
        if args.json:
            print(json.dumps({"status": "skipped", "why": why, "nvml": got.node.init_error}))
        else:
            print(f"tfimage: gpu: {why}")
        return 0
    if args.health_check and got.verdict.drains:
        slurm.drain(node, got.verdict.drains[0].reason(), cfg.gpu.slurm_bin)
        extra["drained"] = node
    _report(args, got, extra)
    return got.verdict.status


def cmd_gpu_resume(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    node = _node(args)
    st, reason = slurm.state(node, cfg.gpu.slurm_bin)
    if "drain" not in st:
        print(f"tfimage: gpu: {node} is {st}, not drained: nothing to resume")
        return 0
    if not slurm.is_ours(reason):
        raise TfimageError(
            f"gpu: {node} was drained by someone else ({reason[:80] or 'no reason'}); left alone"
        )
    got = check(cfg, (), expect_idle=False, node_name=node)
    if got.verdict.drains:
        _report(args, got, {"resumed": False})
        raise TfimageError(f"{node} still fails: {got.verdict.drains[0].reason()}")
    slurm.resume(node, cfg.gpu.slurm_bin)
    if args.json:
        _report(args, got, {"resumed": True, "node": node, "was": reason})
    else:
        print(f"tfimage: gpu: {node} resumed (was: {reason})")
    return 0


def register(sub: Any) -> None:
    g = sub.add_parser(
        "gpu",
        help="check this node's GPUs with NVML; resume a node tfimage drained",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gs = g.add_subparsers(dest="gpu_command", required=True, metavar="ACTION")

    c = gs.add_parser(
        "check",
        help="run the prolog's GPU checks now (exit 0 healthy, 1 warning, 2 drain)",
        description="Run the GPU checks the prolog runs before a job. Exit 0: healthy; "
        "1: warnings; 2: a finding that drains a node before a job.",
    )
    c.add_argument("--gpus", default="", help="only these GPUs (indices or UUIDs, as Slurm)")
    c.add_argument(
        "--idle",
        action="store_true",
        help="no compute process belongs on them (as before a job); default: busy is fine",
    )
    c.add_argument(
        "--health-check",
        action="store_true",
        help="as Slurm's HealthCheckProgram: drain this node on a drain-class finding",
    )
    c.add_argument("--node", default="", help="the Slurm node name (default: short hostname)")
    c.add_argument("--verbose", "-v", action="store_true", help="list skipped checks too")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.set_defaults(func=cmd_gpu_check)

    r = gs.add_parser(
        "resume",
        help="return a node tfimage drained to service, after a passing check",
        description="Resume NODE if, and only if, its drain reason starts with 'tfimage:' "
        "and a fresh check of every GPU finds nothing that drains. A drain with any "
        "other reason is the site's and is left alone (exit 1).",
    )
    r.add_argument("--node", default="", help="the Slurm node name (default: short hostname)")
    r.add_argument("--verbose", "-v", action="store_true", help="list skipped checks too")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(func=cmd_gpu_resume)

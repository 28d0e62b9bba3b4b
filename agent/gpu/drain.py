"""Draining a node for a GPU fault, and resuming only what tfimage drained.

The drain is ``scontrol update NodeName=N State=DRAIN Reason="tfimage: ..."``: the
reason starts with ``tfimage:`` so that :func:`resume` (``tfimage gpu resume``) can
tell its own drains from a site's, and never touches the site's.
"""

from __future__ import annotations

from tfimage.agent.core.errors import TfimageError
from tfimage.agent.core.ids import check_node
from tfimage.agent.core.toolrun import run, slurm_env, slurm_tool

PREFIX = "tfimage:"
TIMEOUT = 15.0


def drain(node: str, reason: str, slurm_bin: str = "") -> None:
    """Drain ``node`` with ``reason`` (which must start with ``tfimage:``)."""
    if not reason.startswith(PREFIX):
        raise ValueError("a tfimage drain's reason starts with tfimage:")
    run(
        [
            slurm_tool("scontrol", slurm_bin),
            "update",
            f"NodeName={check_node(node)}",
            "State=DRAIN",
            f"Reason={reason}",
        ],
        timeout=TIMEOUT,
        what="gpu: drain",
        env=slurm_env(),
    )


def state(node: str, slurm_bin: str = "") -> tuple[str, str]:
    """The node's state (``drained``, ``idle``...) and its reason ("" for none)."""
    out = run(
        [slurm_tool("sinfo", slurm_bin), "-h", "-N", "-n", check_node(node), "-o", "%T|%E"],
        timeout=TIMEOUT,
        what="gpu: node state",
        env=slurm_env(),
    )
    line = out.splitlines()[0] if out.strip() else ""
    if not line:
        raise TfimageError(f"gpu: node {node} is not known to Slurm")
    st, _, reason = line.partition("|")
    return st.strip(), "" if reason.strip() == "none" else reason.strip()


def is_ours(reason: str) -> bool:
    return reason.startswith(PREFIX)


def resume(node: str, slurm_bin: str = "") -> None:
    run(
        [
            slurm_tool("scontrol", slurm_bin),
            "update",
            f"NodeName={check_node(node)}",
            "State=RESUME",
        ],
        timeout=TIMEOUT,
        what="gpu: resume",
        env=slurm_env(),
    )

"""The local cluster's size and its registry's link, as a developer asks for them
(``TFIMAGE_NODES=16 make cluster-up``): a bad value is one line before anything is
touched, and a good one names its nodes.  ``cluster.sh status`` reads only pid
files, under a state directory of the test's own, so no cluster is brought up."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "deploy" / "local" / "cluster.sh"


def _status(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), "status"],
        # none of a sourced build/cluster.env's TFIMAGE_* settings: only the test's
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("TFIMAGE_")},
            "TFIMAGE_LOCAL_STATE": str(tmp_path),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize("count", ["1", "33", "016", "4x", "-2", "2 3"])
def test_a_bad_node_count_is_one_line_naming_the_range(tmp_path: Path, count: str) -> None:
    r = _status(tmp_path, TFIMAGE_NODES=count)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (
        f"cluster: error: TFIMAGE_NODES must be a number of nodes from 2 to 32, not '{count}'\n"
    )


@pytest.mark.parametrize("rate", ["fast", "200", "200mbit;tc qdisc del", "0mbit", "200 mbit"])
def test_a_bad_registry_rate_is_one_line(tmp_path: Path, rate: str) -> None:
    r = _status(tmp_path, TFIMAGE_REGISTRY_RATE=rate)
    assert r.returncode == 1
    assert r.stderr.splitlines() == [
        f"cluster: error: TFIMAGE_REGISTRY_RATE must be a rate like 200mbit, not '{rate}'"
    ]


def test_sixteen_nodes_are_n1_to_n16(tmp_path: Path) -> None:
    r = _status(tmp_path, TFIMAGE_NODES="16", TFIMAGE_REGISTRY_RATE="200mbit")
    assert r.returncode == 0, r.stderr
    slurmds = [line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("slurmd-")]
    assert slurmds == [f"slurmd-n{i}" for i in range(1, 17)]


def test_status_names_the_nodes_the_running_cluster_was_brought_up_with(tmp_path: Path) -> None:
    """An `up` of another size first takes down every node of the one running."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "nodes").write_text("n1\nn2\nn3\n")
    r = _status(tmp_path, TFIMAGE_NODES="8")
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stdout.splitlines() if line.startswith("slurmd-")] == [
        "slurmd-n1: stopped",
        "slurmd-n2: stopped",
        "slurmd-n3: stopped",
    ]

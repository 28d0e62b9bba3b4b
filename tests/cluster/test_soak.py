"""The soak's short form (bench/soak.py): a fixed seed, two nodes, every fault kind
once, a few minutes; nothing lost, leaked, drained or recorded twice."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO, Cluster

from support import report_figure

sys.path.insert(0, str(REPO / "bench"))
import soak

pytestmark = pytest.mark.cluster


def test_a_short_soak_with_every_fault_loses_leaks_drains_and_doubles_nothing(
    cluster: Cluster,
) -> None:
    if cluster.chroot:
        pytest.skip("the soak drives the host flavor's cluster (the other host runs it there)")
    report = soak.soak(
        dict(cluster.env), tasks=60, seed=46, nodes=2, hold=(3, 6), waves=4, timeout=220
    )
    print(soak.table(report))
    kinds = {f["kind"] for f in report["faults"]}
    want = set(soak.FAULTS) - (
        {"mirror-5xx-hang"} if not cluster.env.get("TFIMAGE_MIRROR") else set()
    )
    assert kinds == want, kinds
    assert report["tasks"].get("completed", 0) >= 30, report["tasks"]
    assert soak.problems(report) == [], soak.table(report)
    report_figure(
        f"soak (seed 46, 60 tasks, 2 nodes): {report['seconds']} s, "
        + ", ".join(f"{k} {v}" for k, v in report["tasks"].items())
        + f"; reasons {report['reasons']}; throughput {report['throughput_per_min']}"
    )

"""A registry that stops answering mid-pull: the user learns why within one read
timeout, from the prolog's verdict, not after the step has tried again."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import Cluster

pytestmark = pytest.mark.cluster
READ_TIMEOUT = 4


def test_a_registry_stopped_mid_pull_fails_the_job_within_one_read_timeout(
    cluster: Cluster, workdir: Path
) -> None:
    ref = cluster.run(["tfimage", "resolve", "tf-custom:2.0"], as_root=True).stdout.strip()
    digest = ref.rpartition("@")[2]
    assert digest.startswith("sha256:"), ref
    # n2 must pull it: not cached, no partial download to resume from
    cfg = cluster.env["TFIMAGE_CONFIG"]
    cluster.on_node(
        "n2", ["/opt/tfimage/bin/tfimage", "--config", cfg, "cache", "rm", digest, "--force"]
    )
    partials = cluster.state / "nodes/n2/cache/tmp"
    for p in partials.glob("*.partial"):
        p.unlink()
    registry = int((cluster.state / "run/registry.pid").read_text())
    with cluster.config_with(read_timeout=READ_TIMEOUT):
        p = cluster.start(
            ["srun", "-N1", "-w", "n2", f"--tf-image=tf-custom@{digest}", "true"], workdir
        )
        try:
            for _ in range(300):  # until the prolog's download is under way
                if any(f.stat().st_size > (8 << 20) for f in partials.glob("*.partial")):
                    break
                time.sleep(0.05)
            else:
                pytest.fail("the prolog's download never started")
            os.kill(registry, signal.SIGSTOP)
            stopped = time.monotonic()
            _, err = p.communicate(timeout=300)
            waited = time.monotonic() - stopped
        finally:
            os.kill(registry, signal.SIGCONT)
    assert p.returncode != 0
    assert f"tfimage: prepare tf-custom@{digest}: the prolog could not ready it" in err, err
    assert "stalled" in err or "no answer" in err, err
    # one read timeout, then Slurm's own start and end of the step: never a second wait
    assert waited < READ_TIMEOUT + 8, waited
    cluster.assert_never_drained("n2")

"""Pinning at submit: a tag moved while the job waits does not change what it runs."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
from conftest import Cluster, busybox_sif, push, write_script

pytestmark = pytest.mark.cluster


def test_tag_moved_while_queued_is_not_followed(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    if not shutil.which("busybox"):
        pytest.skip("needs busybox-static (deploy/local/packages.sh installs it)")
    tag = f"pintest:t{os.getpid()}{int(time.time())}"
    d1 = push(cluster, busybox_sif(tmp_path, "v1"), tag)
    write_script(
        workdir,
        "job.sh",
        (f"#!/bin/sh\n#SBATCH --tf-image={tag}\n#SBATCH -o out.txt\ncat /etc/tfimage-test-image\n"),
        cluster.user,
    )
    r = cluster.run(["sbatch", "-v", "--hold", "--parsable", "job.sh"], cwd=workdir)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    assert re.search(rf"pinned to \S+@{d1}", r.stderr), r.stderr  # shown with -v
    try:
        d2 = push(cluster, busybox_sif(tmp_path, "v2"), tag)  # the tag moves
        assert d2 != d1
        assert cluster.run(["scontrol", "release", job], as_root=True).returncode == 0
        for _ in range(300):
            q = cluster.run(["squeue", "-h", "-j", job], as_root=True)
            if not q.stdout.strip():
                break
            time.sleep(0.2)
    finally:
        cluster.run(["scancel", job], as_root=True)
    assert (workdir / "out.txt").read_text() == "v1\n"

    # A new submission now gets the new bytes.
    r = cluster.run(
        ["srun", "-N1", f"--tf-image={tag}", "cat", "/etc/tfimage-test-image"], cwd=workdir
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == "v2\n"

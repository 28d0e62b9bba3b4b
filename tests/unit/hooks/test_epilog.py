"""The epilog after every kind of job: nothing left on the node, the job recorded once.

Real parts: a TLS registry, a real SIF pulled and mounted with squashfuse by the real
prolog, a prolog killed with SIGKILL mid-pull.  Run as root, as slurmd runs them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hostile import Server

from support import Registry, hook_site
from tfimage.epilog.main import main as epilog
from tfimage.prolog.main import main as prolog

VENV_BIN = Path(sys.executable).parent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hooks run as root: run as root")

SLURM = ["--node=n1", "--user=alice", "--uid=1001", "--partition=gpu", "--account=proj"]


def _log(tmp_path: Path) -> list[str]:
    path = tmp_path / "hooks.log"
    return path.read_text().splitlines() if path.exists() else []


def _records(tmp_path: Path) -> list[dict[str, Any]]:
    log = tmp_path / "usage.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(path))]


def _job_traces(tmp_path: Path, job: str) -> list[str]:
    """Everything of ``job`` in the node's state and cache: what the epilog must remove."""
    state = tmp_path / "state"
    found = [str(p) for p in state.rglob(f"{job}*")] if state.exists() else []
    found += [str(p) for p in state.rglob(f"{job}.*")] if state.exists() else []
    images = tmp_path / "cache" / "images"
    for meta in images.glob("*.json") if images.exists() else []:
        if job in json.loads(meta.read_text()).get("holders", []):
            found.append(f"{meta}: holder {job}")
    return sorted(set(found + _mounts_under(state)))


@pytest.fixture
def cached_image(registry: Registry, make_sif: Callable[[dict[str, str]], Path]) -> str:
    digest = registry.client().push_sif("library/usagey", "1", make_sif({"m": "1"}))
    return f"{registry.host}/library/usagey:1@{digest}"


def test_the_epilog_twice_after_a_whole_job_leaves_nothing_and_records_it_once(
    registry: Registry, cached_image: str, tmp_path: Path
) -> None:
    cfg = registry.write_site(tmp_path, hook_log=str(tmp_path / "hooks.log"))
    (tmp_path / "metrics").mkdir()  # node_exporter's textfile directory
    job = ["--job=31", f"--image={cached_image}"]
    assert prolog([f"--config={cfg}", *job]) == 0
    # While the job runs: its mount, its hold on the image, its state and usage facts.
    during = _job_traces(tmp_path, "31")
    assert any("/images/sha256-" in t for t in during), during  # the image, mounted
    assert any("holder 31" in t for t in during) and any("/usage/31.json" in t for t in during)
    args = [f"--config={cfg}", *job, "--asked=usagey:1", "--exit=0:0", *SLURM]
    assert epilog(args) == 0
    assert epilog(args) == 0  # Slurm may run it again (a slurmd restart): harmless
    assert _job_traces(tmp_path, "31") == []
    assert _log(tmp_path) == [] or "error" not in "".join(_log(tmp_path)).lower()
    (rec,) = _records(tmp_path)
    assert rec["image"] == cached_image and rec["image_asked"] == "usagey:1"
    assert (rec["cache"], rec["source"], rec["state"], rec["exit_code"]) == (
        "miss",
        registry.host,
        "COMPLETED",
        0,
    )
    assert rec["pull_bytes"] > 0 and rec["repository"] == "library/usagey"
    assert (rec["node"], rec["user"], rec["uid"], rec["partition"]) == ("n1", "alice", 1001, "gpu")
    prom = (tmp_path / "metrics" / "tfimage.prom").read_text()
    assert 'tfimage_jobs_total{repository="library/usagey"} 1' in prom
    assert 'tfimage_cache_misses_total{repository="library/usagey"} 1' in prom


def test_the_first_of_two_jobs_leaves_their_shared_image_mounted_for_the_second(
    registry: Registry, cached_image: str, tmp_path: Path
) -> None:
    cfg = registry.write_site(tmp_path, hook_log=str(tmp_path / "hooks.log"))
    state = tmp_path / "state"
    for job in ("35", "36"):
        assert prolog([f"--config={cfg}", f"--job={job}", f"--image={cached_image}"]) == 0
    (image,) = [m for m in _mounts_under(state) if "/images/sha256-" in m]  # one, shared
    assert epilog([f"--config={cfg}", "--job=35", f"--image={cached_image}", *SLURM]) == 0
    assert _mounts_under(state) == [image]  # job 36 still holds it
    assert any("holder 36" in t for t in _job_traces(tmp_path, "36"))
    assert epilog([f"--config={cfg}", "--job=36", f"--image={cached_image}", *SLURM]) == 0
    assert _mounts_under(state) == [] and _job_traces(tmp_path, "36") == []


def test_after_a_prolog_killed_halfway_the_epilog_leaves_nothing_and_says_why(
    tls: Path, tmp_path: Path
) -> None:
    s = Server(tls)
    try:
        s.serve(os.urandom(4 << 20), delay=0.5)  # a trickle: the prolog is mid-download
        cfg = hook_site(tmp_path, registry=s.host, ca_bundle=tls / "ca.crt")
        p = subprocess.Popen(
            [str(VENV_BIN / "tfimage-prolog"), f"--config={cfg}", "--job=32", "--image=x:1"],
        )
        for _ in range(100):
            if any("/blobs/" in path for path, _ in s.b.seen):
                break
            time.sleep(0.1)
        assert any("/blobs/" in path for path, _ in s.b.seen), "the pull never started"
        p.send_signal(signal.SIGKILL)  # slurmd past PrologEpilogTimeout, the OOM killer
        p.wait(30)
    finally:
        s.httpd.shutdown()
    assert _job_traces(tmp_path, "32"), "the killed prolog left nothing to clean: no test"
    assert epilog([f"--config={cfg}", "--job=32", "--image=x:1", "--exit=1:0", *SLURM]) == 0
    assert _job_traces(tmp_path, "32") == []
    # The download the kill cut goes with the job (no later pull of it is coming).
    assert list((tmp_path / "cache" / "tmp").glob("*.partial")) == []
    said = _log(tmp_path)
    assert len(said) == 1 and "job 32: dropped sha256-" in said[0], said
    (rec,) = _records(tmp_path)
    # The job is recorded as far as the prolog got: its start, no image readied.
    assert rec["cache"] is None and rec["state"] == "FAILED" and rec["exit_code"] == 1
    assert rec["wall_seconds"] > 0 and rec["image"] == "x:1"


def test_a_job_without_tf_image_gets_no_record_and_leaves_no_trace(tmp_path: Path) -> None:
    cfg = hook_site(tmp_path)
    assert prolog([f"--config={cfg}", "--job=33"]) == 0
    assert epilog([f"--config={cfg}", "--job=33", "--exit=0:0", *SLURM]) == 0
    assert epilog([f"--config={cfg}", "--job=33", "--exit=0:0", *SLURM]) == 0
    assert _records(tmp_path) == [] and _job_traces(tmp_path, "33") == []
    assert _log(tmp_path) == []


def test_an_image_that_could_not_be_pulled_is_recorded_with_the_reason(tmp_path: Path) -> None:
    cfg = hook_site(tmp_path)  # r.invalid: no such registry
    assert prolog([f"--config={cfg}", "--job=34", "--image=tf-custom:2.1"]) == 0
    assert epilog([f"--config={cfg}", "--job=34", "--image=tf-custom:2.1",
                   "--asked=tf-custom:2.1", "--exit=3:0", *SLURM]) == 0  # fmt: skip
    (rec,) = _records(tmp_path)
    assert rec["image_error"] and "r.invalid" in rec["image_error"]
    assert (rec["state"], rec["exit_code"], rec["repository"]) == ("FAILED", 3, "library/tf-custom")


def test_two_epilogs_at_once_record_the_job_once(tmp_path: Path) -> None:
    cfg = hook_site(tmp_path)
    assert prolog([f"--config={cfg}", "--job=35", "--image=x:1"]) == 0  # r.invalid: fails
    argv = [str(VENV_BIN / "tfimage-epilog"), f"--config={cfg}", "--job=35", "--image=x:1",
            "--exit=0:0", *SLURM]  # fmt: skip
    procs = [subprocess.Popen(argv) for _ in range(2)]
    assert [p.wait(60) for p in procs] == [0, 0]
    assert len(_records(tmp_path)) == 1 and _job_traces(tmp_path, "35") == []


def test_a_job_without_an_image_in_a_partition_with_a_default_runs_it_and_leaves_nothing(
    registry: Registry, cached_image: str, tmp_path: Path
) -> None:
    """The prolog readies the partition's default and leaves its name where the
    plugin's steps look (layout.job_default_image); the epilog records the job as
    any --tf-image job and removes every trace."""
    rules = '{"train": {"default_image": "usagey:1"}, "dev": {}}'
    cfg = registry.write_site(tmp_path, hook_log=str(tmp_path / "hooks.log"), partitions=rules)
    assert prolog([f"--config={cfg}", "--job=41", "--partition=train"]) == 0
    default = tmp_path / "state" / "jobs" / "41.default-image"
    assert default.read_text() == "usagey:1\n"
    st = default.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o644)
    images = json.loads((tmp_path / "state" / "jobs" / "41.images.json").read_text())
    assert images["pinned"] == {f"{registry.host}/library/usagey:1": cached_image}, images
    assert prolog([f"--config={cfg}", "--job=42", "--partition=dev"]) == 0  # no default
    assert not (tmp_path / "state" / "jobs" / "42.default-image").exists()
    args = [f"--config={cfg}", "--job=41", "--exit=0:0", *SLURM]
    assert epilog(args) == 0
    assert _job_traces(tmp_path, "41") == []
    (rec,) = _records(tmp_path)
    assert rec["image"] == cached_image and rec["repository"] == "library/usagey"

"""A job whose epilog never came is reclaimed by the node's next epilog
(hooks/vestigial.py).

Scenario "slurmd killed as its job ended" (the 2,000-task soak, 22.05.8: job 1275
on n2, its slurmd SIGKILLed a millisecond after the job completed): the restarted
slurmd answered slurmctld's resent TERMINATE_JOB without an Epilog, and the job's
image mount, squashfuse, hold and state stayed on the node, with no usage record.
Real parts: the real prolog pulls from a TLS registry and mounts the SIF; no epilog
runs for that job; ``squeue`` is a stand-in that says which jobs Slurm has on the
node (no slurmctld here) and records how it was asked.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support import Registry
from tfimage.agent.hooks import vestigial
from tfimage.epilog.main import main as epilog
from tfimage.prolog.main import main as prolog

SLURM = ["--node=n1", "--user=alice", "--uid=1001", "--partition=gpu", "--account=proj"]


def _squeue(tmp_path: Path, listed: list[str], status: int = 0) -> tuple[Path, Path]:
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    asked = tmp_path / "squeue.args"
    lines = "".join(f"{j}\n" for j in listed)
    (bin_dir / "squeue").write_text(
        f'#!/bin/sh\nprintf "%s " "$@" >> {asked}\necho >> {asked}\n'
        f"[ {status} = 0 ] || {{ echo 'slurm_load_jobs error: Unable to contact slurm "
        f"controller' >&2; exit {status}; }}\nprintf '{lines}'\n"
    )
    (bin_dir / "squeue").chmod(0o755)
    return bin_dir, asked


def _age(state: Path, job: str, seconds: float) -> None:
    """The job's state as if written ``seconds`` ago (rather than waiting the grace)."""
    then = time.time() - seconds
    for p in [*state.rglob(f"{job}.*"), *state.rglob(job)]:
        os.utime(p, (then, then), follow_symlinks=False)


def _records(tmp_path: Path) -> list[dict[str, Any]]:
    log = tmp_path / "usage.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _traces(tmp_path: Path, job: str) -> list[str]:
    state = tmp_path / "state"
    found = [str(p) for p in [*state.rglob(f"{job}.*"), *state.rglob(job)]]
    for meta in (tmp_path / "cache" / "images").glob("*.json"):
        if job in json.loads(meta.read_text()).get("holders", []):
            found.append(f"{meta.name}: holder {job}")
    with open("/proc/self/mountinfo") as f:
        found += [ln.split()[4] for ln in f if ln.split()[4].startswith(str(state))]
    return sorted(found)


@pytest.fixture(autouse=True)
def unmounted(tmp_path: Path) -> Iterator[None]:
    """A test that fails before an epilog ran leaves no mount of its own behind."""
    yield
    state = str(tmp_path / "state")
    with open("/proc/self/mountinfo") as f:
        left = [ln.split()[4] for ln in f if ln.split()[4].startswith(state)]
    for target in reversed(left):
        subprocess.run(["umount", "-l", target], check=False, capture_output=True)


@pytest.fixture
def image(registry: Registry, make_sif: Callable[[dict[str, str]], Path]) -> str:
    digest = registry.client().push_sif("library/vestigial", "1", make_sif({"v": "1"}))
    return f"{registry.host}/library/vestigial:1@{digest}"


@pytest.mark.skipif(os.geteuid() != 0, reason="the hooks run as root: run as root")
def test_a_job_whose_slurmd_died_as_it_ended_is_cleaned_and_recorded_by_the_next_epilog(
    registry: Registry, image: str, tmp_path: Path
) -> None:
    bin_dir, asked = _squeue(tmp_path, ["52"])  # Slurm has only the job ending now
    cfg = registry.write_site(
        tmp_path, hook_log=str(tmp_path / "hooks.log"), gpu=f"{{slurm_bin: {bin_dir}}}"
    )
    assert prolog([f"--config={cfg}", "--job=51", f"--image={image}", "--node=n1"]) == 0
    assert _traces(tmp_path, "51")  # mounted, held, its state: then no epilog came
    _age(tmp_path / "state", "51", vestigial.GRACE_SECONDS + 5)

    assert epilog([f"--config={cfg}", "--job=52", "--exit=0:0", *SLURM]) == 0

    assert _traces(tmp_path, "51") == []
    (rec,) = _records(tmp_path)  # job 52 had no image: no record of its own
    assert (rec["job_id"], rec["image"], rec["node"]) == ("51", image, "n1")
    assert rec["state"] == "UNKNOWN" and rec["exit_code"] is None  # no exit code came
    assert asked.read_text().split() == ["-h", "-w", "n1", "-o", "%A"]
    said = (tmp_path / "hooks.log").read_text()
    assert "job 51: its epilog never came" in said and "reclaimed by job 52's" in said


@pytest.mark.skipif(os.geteuid() != 0, reason="the hooks run as root: run as root")
def test_a_job_slurm_still_has_on_the_node_or_a_slurm_that_does_not_answer_is_left_alone(
    registry: Registry, image: str, tmp_path: Path
) -> None:
    # An salloc allocation with no step yet has no slurmstepd here, and its state is
    # as quiet as a vestigial job's: only Slurm can tell them apart.
    bin_dir, _ = _squeue(tmp_path, ["51", "52"])
    cfg = registry.write_site(
        tmp_path, hook_log=str(tmp_path / "hooks.log"), gpu=f"{{slurm_bin: {bin_dir}}}"
    )
    assert prolog([f"--config={cfg}", "--job=51", f"--image={image}", "--node=n1"]) == 0
    _age(tmp_path / "state", "51", vestigial.GRACE_SECONDS + 5)
    held = _traces(tmp_path, "51")
    assert epilog([f"--config={cfg}", "--job=52", "--exit=0:0", *SLURM]) == 0
    assert _traces(tmp_path, "51") == held and _records(tmp_path) == []

    _squeue(tmp_path, [], status=1)  # slurmctld down: nothing is known, nothing reclaimed
    assert epilog([f"--config={cfg}", "--job=53", "--exit=0:0", *SLURM]) == 0
    assert _traces(tmp_path, "51") == held and _records(tmp_path) == []
    said = (tmp_path / "hooks.log").read_text()
    assert "job 53: looking for jobs whose epilog never came: " in said
    assert "Unable to contact slurm controller" in said

    args = [f"--config={cfg}", "--job=51", f"--image={image}", "--exit=0:0", *SLURM]
    assert epilog(args) == 0  # its own epilog, at last
    assert _traces(tmp_path, "51") == [] and [r["state"] for r in _records(tmp_path)] == [
        "COMPLETED"
    ]


def test_only_quiet_jobs_without_a_slurmstepd_here_are_candidates(tmp_path: Path) -> None:
    state = tmp_path / "state"
    for name in (
        "usage/5.json",
        "usage/5.lock",
        "jobs/5.images.json",
        "jobs/6.lock",
        "usage/7.json",
        "usage/8.json",
        "usage/counters.json",
        "jobs/x9.lock",
    ):
        (state / name).parent.mkdir(parents=True, exist_ok=True)
        (state / name).write_text("{}")  # fmt: skip
    (state / "jobs" / "6").mkdir()
    now = time.time()
    for job in ("5", "7", "8"):
        _age(state, job, vestigial.GRACE_SECONDS + 1)
    proc = tmp_path / "proc"
    for pid, argv in (
        ("100", b"slurmstepd: [7.batch]\0"),
        ("101", b"slurmstepd: [70.0]\0"),
        ("102", b"sleep\x0060\0"),
        ("self", b"slurmstepd: [5.0]\0"),
    ):
        (proc / pid).mkdir(parents=True)
        (proc / pid / "cmdline").write_bytes(argv)  # fmt: skip
    # 5: quiet, no step; 6: touched just now; 7: a step runs; 8: the epilog's own job.
    assert vestigial.candidates(str(state), "8", now=now, proc=proc) == {"5"}
    assert vestigial.stepd_jobs(proc) == {"7", "70"}
    assert vestigial.candidates(str(tmp_path / "none"), "8", proc=proc) == set()

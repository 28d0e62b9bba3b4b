"""The prolog's GPU gate: the one case in which a tfimage hook exits non-zero.

Run as slurmd runs it (a real process, the fake NVML under the real nvidia-ml-py).
Slurm is not reachable here (SLURM_CONF names an empty file: scontrol fails at
once), so the drain itself is the
cluster tier's to prove; here: the exit status, the one log line with the reason
the node would carry, the baseline kept for the epilog, and what is not checked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import hook
from gpus import FakeNvml, gpu, node

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hooks run as root: run as root")


def test_a_healthy_gpu_job_passes_and_keeps_a_baseline_the_epilog_drops(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    nvml.write(node(4))
    cfg = site()
    r = hook("prolog", nvml, cfg, "--job=42", "--node=n1", "--gpus=1,2")
    assert r.returncode == 0, r.stderr
    assert "job 42: gpu: 2 GPU(s) healthy" in (tmp_path / "hooks.log").read_text()
    baseline = tmp_path / "state/gpu/jobs/42.json"
    doc = json.loads(baseline.read_text())
    uuids = [node(4)["devices"][i]["uuid"] for i in (1, 2)]
    assert sorted(doc) == sorted(uuids)
    assert doc[uuids[0]]["energy_mj"] == 1_000_001 and doc[uuids[0]]["ecc_sbe"] == 3
    assert baseline.stat().st_mode & 0o777 == 0o600
    assert baseline.parent.parent.stat().st_mode & 0o777 == 0o700

    assert hook("epilog", nvml, cfg, "--job=42").returncode == 0
    assert not baseline.exists()


def test_a_faulty_gpu_fails_the_prolog_with_the_reason_the_node_would_carry(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    doc = node(4)
    doc["devices"][2] = gpu(2, remapped=[0, 1, 1, 0])
    nvml.write(doc)
    r = hook("prolog", nvml, site(), "--job=43", "--node=n1", "--gpus=2", "--image=tiny:1.0")
    assert r.returncode == 1
    log = (tmp_path / "hooks.log").read_text()
    reason = f"tfimage: gpu2 {doc['devices'][2]['uuid']}: row remapping pending (needs a reset)"
    assert reason in log and "gpu: drain:" in log, log  # scontrol could not reach Slurm
    assert not (tmp_path / "state/gpu/jobs/43.json").exists()
    # the image was never pulled: the job goes elsewhere
    assert "tiny:1.0" not in log


def test_a_faulty_gpu_outside_the_job_does_not_stop_it(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(4)
    doc["devices"][3] = gpu(3, ecc_dbe_volatile=4)
    nvml.write(doc)
    assert hook("prolog", nvml, site(), "--job=44", "--node=n1", "--gpus=0").returncode == 0


def test_an_mps_jobs_gpu_may_run_other_jobs_processes(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(1)
    doc["devices"][0] = gpu(0, processes=[{"pid": 99, "mem": 1}])
    nvml.write(doc)
    cfg = site()
    args = ("--job=45", "--node=n1", "--gpus=0")
    assert hook("prolog", nvml, cfg, *args).returncode == 1
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}  # as Slurm sets it for gres/mps
    assert hook("prolog", nvml, cfg, *args, env=env).returncode == 0


def test_what_is_not_checked(nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path) -> None:
    doc = node(1)
    doc["devices"][0] = gpu(0, ecc_dbe_volatile=1)
    nvml.write(doc)
    # a job without GPUs: nothing to check, nothing read
    assert hook("prolog", nvml, site(), "--job=46", "--node=n1", "--gpus=").returncode == 0
    # a GPU job without --tf-image, where the site checks only tfimage jobs
    r = hook("prolog", nvml, site(all_jobs=False), "--job=47", "--node=n1", "--gpus=0")
    assert r.returncode == 0
    # the gate switched off
    r = hook("prolog", nvml, site(checks=False), "--job=48", "--node=n1", "--gpus=0")
    assert r.returncode == 0
    # by default, a GPU job without --tf-image is checked: that is what fails here
    assert hook("prolog", nvml, site(), "--job=49", "--node=n1", "--gpus=0").returncode == 1


def test_slurms_variables_are_read_from_the_prologs_environment(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(2)
    doc["devices"][1] = gpu(1, ecc_dbe_volatile=1)
    nvml.write(doc)
    env = {"SLURM_JOB_ID": "50", "SLURMD_NODENAME": "n1", "SLURM_JOB_GPUS": "1"}
    assert hook("prolog", nvml, site(), env=env).returncode == 1
    env["SLURM_JOB_GPUS"] = "0"
    assert hook("prolog", nvml, site(), env=env).returncode == 0


def test_a_malformed_gpu_list_is_logged_and_never_drains(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    nvml.write(node(1, init="DRIVER_NOT_LOADED"))
    r = hook("prolog", nvml, site(), "--job=51", "--node=n1", "--gpus=0,0")
    assert r.returncode == 0
    assert (
        "job 51: gpu: not checked: GPU list: a GPU is named twice"
        in (tmp_path / "hooks.log").read_text()
    )


def test_the_baseline_is_roots_alone_even_with_xids_off(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    nvml.write(node(1))
    cfg = site(severity={"xid": "off"})
    assert hook("prolog", nvml, cfg, "--job=52", "--node=n1", "--gpus=0").returncode == 0
    for d in ("state/gpu", "state/gpu/jobs"):
        assert (tmp_path / d).stat().st_mode & 0o777 == 0o700, d


def test_a_site_whose_slurm_lives_elsewhere_is_drained_with_its_own_scontrol(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    """gpu.slurm_bin: the drain runs that directory's scontrol (here a stand-in that
    records its arguments), not whatever the fixed PATH holds."""
    bin_dir = tmp_path / "opt-slurm-bin"
    bin_dir.mkdir()
    record = tmp_path / "scontrol.args"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    scontrol.chmod(0o755)
    doc = node(2)
    doc["devices"][1] = gpu(1, ecc_dbe_volatile=1)
    nvml.write(doc)
    r = hook("prolog", nvml, site(slurm_bin=str(bin_dir)), "--job=46", "--node=n7", "--gpus=1")
    assert r.returncode == 1
    uuid = doc["devices"][1]["uuid"]
    assert record.read_text().splitlines() == [
        "update",
        "NodeName=n7",
        "State=DRAIN",
        f"Reason=tfimage: gpu1 {uuid}: volatile uncorrected ECC: 1",
    ]
    assert "job 46: drained n7" in (tmp_path / "hooks.log").read_text()


def _record(tmp_path: Path) -> dict[str, object]:
    (line,) = (tmp_path / "usage.jsonl").read_text().splitlines()
    doc: dict[str, object] = json.loads(line)
    return doc


def test_the_epilog_records_each_gpus_energy_over_the_job(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    doc = node(4)
    nvml.write(doc)
    cfg = site()
    job = ("--job=46", "--node=n1", "--image=registry.invalid/x:1")
    assert hook("prolog", nvml, cfg, *job, "--gpus=1,2").returncode == 0
    doc["devices"][1]["energy_mj"] += 5_000_000  # 5 kJ over the job
    doc["devices"][2]["energy_mj"] += 250_500
    nvml.write(doc)
    r = hook("epilog", nvml, cfg, *job, "--exit=0:0")
    assert r.returncode == 0, r.stderr
    rec = _record(tmp_path)
    uuids = [doc["devices"][i]["uuid"] for i in (1, 2)]
    assert rec["gpus"] == [
        {"uuid": uuids[0], "energy_j": 5000.0},
        {"uuid": uuids[1], "energy_j": 250.5},
    ]
    assert rec["gpu_health"] == {"prolog": "ok", "epilog": "ok"}
    assert not (tmp_path / "state/gpu/jobs/46.json").exists()


def test_a_process_left_on_the_jobs_gpu_drains_the_node_from_the_epilog(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    doc = node(4)
    nvml.write(doc)
    (tmp_path / "metrics").mkdir()  # node_exporter's textfile directory (site() names it)
    cfg = site()
    job = ("--job=47", "--node=n1", "--image=registry.invalid/x:1")
    assert hook("prolog", nvml, cfg, *job, "--gpus=1").returncode == 0
    doc["devices"][1]["processes"] = [{"pid": 4242, "mem": 100}]  # stuck in D state, say
    nvml.write(doc)
    r = hook("epilog", nvml, cfg, *job, "--exit=0:0")
    # scontrol cannot reach Slurm here: the non-zero exit is what makes Slurm drain it
    assert r.returncode == 1
    reason = (
        f"tfimage: gpu1 {doc['devices'][1]['uuid']}: 1 compute process(es) left by job 47: pid 4242"
    )
    assert reason in (tmp_path / "hooks.log").read_text()
    rec = _record(tmp_path)
    assert rec["gpu_health"] == {"prolog": "ok", "epilog": "drain"}
    prom = (tmp_path / "metrics/tfimage.prom").read_text()
    assert "tfimage_gpu_drains_total 1" in prom
    assert f'tfimage_gpu_healthy{{gpu="1",uuid="{doc["devices"][1]["uuid"]}"}} 0' in prom
    # everything else of the job is gone all the same
    assert not list((tmp_path / "state").rglob("47*")) and not list(
        (tmp_path / "state").rglob("47.*")
    )
    doc["devices"][1]["processes"] = []
    nvml.write(doc)
    assert hook("epilog", nvml, cfg, *job, "--exit=0:0").returncode == 0  # idempotent


def test_with_scope_node_the_epilog_judges_only_the_jobs_gpus_idle(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    doc = node(4)
    doc["devices"][3]["processes"] = [{"pid": 777, "mem": 1}]  # another job's, on GPU 3
    nvml.write(doc)
    cfg = site(scope="node")
    job = ("--job=48", "--node=n1", "--image=registry.invalid/x:1")
    assert hook("prolog", nvml, cfg, *job, "--gpus=1").returncode == 0
    baseline = json.loads((tmp_path / "state/gpu/jobs/48.json").read_text())
    assert list(baseline) == [doc["devices"][1]["uuid"]]  # the job's GPU alone
    r = hook("epilog", nvml, cfg, *job, "--exit=0:0")
    assert r.returncode == 0, (tmp_path / "hooks.log").read_text()
    rec = _record(tmp_path)
    assert rec["gpus"] == [{"uuid": doc["devices"][1]["uuid"], "energy_j": 0.0}]
    assert rec["gpu_health"] == {"prolog": "ok", "epilog": "ok"}


def test_without_a_check_the_record_still_counts_the_jobs_gpus(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    nvml.write(node(4))
    cfg = site(checks=False)
    job = ("--job=49", "--node=n1", "--image=registry.invalid/x:1")
    assert hook("prolog", nvml, cfg, *job, "--gpus=0,2").returncode == 0
    assert hook("epilog", nvml, cfg, *job, "--gpus=0,2", "--exit=0:0").returncode == 0
    assert _record(tmp_path)["gpus"] == [{"uuid": None, "energy_j": None}] * 2

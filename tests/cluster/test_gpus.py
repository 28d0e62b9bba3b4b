"""GPUs on the real cluster: four per node in gres.conf (/dev/nvidia0..3 in each
node's own /dev and a fake libnvidia-ml.so.1 under the real nvidia-ml-py,
deploy/local/cluster.sh node_dev and write_gpus), each node with its own NVML state.
The prolog's gate, the drain with a tfimage: reason, the job's requeue to a healthy
node, and `tfimage gpu resume`."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import Cluster
from gpus import gpu, healthy_node

from support import wait_for

TFIMAGE = "/opt/tfimage/bin/tfimage"


def _set_gpus(cluster: Cluster, node: str, state: dict[str, object]) -> None:
    (cluster.state / "gpu" / f"state-{node}.json").write_text(json.dumps(state))


def _state_and_reason(cluster: Cluster, node: str) -> tuple[str, str]:
    r = cluster.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T|%E"], as_root=True)
    state, _, reason = r.stdout.strip().splitlines()[0].partition("|")
    return state, reason


def _wait(what: str, check: Callable[[], object], timeout: float = 150) -> None:
    wait_for(check, timeout, what, interval=0.5)  # each check is a Slurm command


@pytest.fixture
def gpu_nodes(cluster: Cluster) -> Iterator[Cluster]:
    """Both nodes healthy and in service before and after."""
    for n in ("n1", "n2"):
        _set_gpus(cluster, n, healthy_node(n))
    yield cluster
    for n in ("n1", "n2"):
        _set_gpus(cluster, n, healthy_node(n))
        cluster.run(["scontrol", "update", f"NodeName={n}", "State=RESUME"], as_root=True)


def test_a_gpu_step_in_the_image_keeps_the_gpus_slurm_gave_it(
    gpu_nodes: Cluster, workdir: Path
) -> None:
    cluster = gpu_nodes
    before = len(cluster.hooks_log("n2"))
    show = "echo gpus=$CUDA_VISIBLE_DEVICES; cat /etc/tfimage-test-image"
    r = cluster.run(
        ["srun", "-N1", "-w", "n2", "--gres=gpu:2", "--tf-image=tiny:1.0", "sh", "-c", show],
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["gpus=0,1", "tiny:1.0"]  # as Slurm set it, in the image
    gate = [line for line in cluster.hooks_log("n2")[before:] if "gpu:" in line]
    assert len(gate) == 1 and "gpu: 2 GPU(s) healthy" in gate[0], gate
    r = cluster.run(
        ["srun", "-N1", "-w", "n2", "--tf-image=tiny:1.0", "sh", "-c", show], cwd=workdir
    )
    assert r.stdout.split()[0] == "gpus=", r.stdout  # no GPUs asked, none given


def test_nvml_inside_the_container_sees_exactly_the_jobs_gpus_through_the_bound_driver(
    gpu_nodes: Cluster, workdir: Path
) -> None:
    """The host's driver (the fake NVML, gpu.driver_libs) is bound into a charliecloud
    GPU step; a program in the image (tf-custom's glibc) loads it and reads the GPUs.
    Slurm's ConstrainDevices lets the job's cgroup open only its own two device files
    (the node's /dev/nvidiaN, which ch-run binds), so NVML lists exactly those,
    numbered from 0, as the real library does."""
    cluster = gpu_nodes
    prog = workdir / "nvmlcount"
    src = Path(__file__).parents[1] / "fakenvml" / "nvmlcount.c"
    subprocess.run(["gcc", "-O2", "-o", str(prog), str(src), "-ldl"], check=True, timeout=120)
    state = workdir / "nvml-state.json"
    state.write_text(json.dumps(healthy_node("n2")))
    state.chmod(0o644)
    show = f"FAKE_NVML_STATE={state} {prog}; echo gpus=$CUDA_VISIBLE_DEVICES"
    argv = ["srun", "-N1", "-w", "n2", "--tf-image=tf-custom:2.0", "sh", "-c", show]
    r = cluster.run([*argv[:4], "--gres=gpu:2", *argv[4:]], cwd=workdir, timeout=600)
    assert r.returncode == 0, r.stderr
    uuids = [d["uuid"] for d in healthy_node("n2")["devices"]]
    assert r.stdout.split() == ["count=2", uuids[0], uuids[1], "gpus=0,1"], r.stdout
    # Three GPUs asked, three seen: the count follows the allocation, not the node.
    r = cluster.run([*argv[:4], "--gres=gpu:3", *argv[4:]], cwd=workdir, timeout=600)
    assert r.stdout.split() == ["count=3", *uuids[:3], "gpus=0,1,2"], r.stdout
    r = cluster.run(argv, cwd=workdir, timeout=600)
    assert "no driver:" in r.stdout and r.stdout.split()[-1] == "gpus=", r.stdout


# Each of the container's /dev/nvidia* files, opened for reading and writing as CUDA
# does: "refused" when the job's device cgroup denies it (EPERM), else "allowed" (no
# driver is behind the fake GPUs' files: an open that gets past the cgroup ends in
# ENXIO).  Then the job's GPU indices as Slurm gave them, and the image's marker.
_OPEN_EACH = (
    "for f in /dev/nvidia*; do"
    ' if err=$( (: <>"$f") 2>&1); then echo "$f allowed";'
    ' else case $err in *"not permitted"*) echo "$f refused";; *) echo "$f allowed $err";; esac;'
    " fi;"
    " done;"
    " echo ids=${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-none}} gpus=$CUDA_VISIBLE_DEVICES;"
    " cat /etc/tfimage-test-image"
)


def test_a_gpu_tasks_container_lists_the_nodes_gpu_files_and_opens_only_its_own(
    gpu_nodes: Cluster, workdir: Path
) -> None:
    """What a real node gives a `--gres=gpu:2` task: its container has the node's
    /dev/nvidia0..3 and /dev/nvidiactl (ch-run binds the node's /dev, where
    gres.conf's File= names them), and the job's cgroup device controller
    (ConstrainDevices) lets it open its own two GPUs' files and nvidiactl alone.
    Another job holds GPUs 0 and 1, so its own are 2 and 3, numbered 0,1 for CUDA."""
    cluster = gpu_nodes
    other = cluster.submit(workdir, "-w", "n2", "--gres=gpu:2", "--wrap", "sleep 300")

    def squeue(*opts: str) -> str:
        return cluster.run(["squeue", "-h", "-j", other, *opts], as_root=True).stdout.strip()

    try:
        _wait("the other job to run", lambda: squeue("-o", "%T") == "RUNNING")
        r = cluster.run(
            ["srun", "-N1", "-w", "n2", "--gres=gpu:2", "--tf-image=tiny:1.0", "sh", "-c",
             _OPEN_EACH],
            cwd=workdir,
        )  # fmt: skip
    finally:
        cluster.run(["scancel", other], as_root=True)
        _wait("the other job to end", lambda: not squeue())
    assert r.returncode == 0, r.stderr
    *files, ids, marker = r.stdout.splitlines()
    assert marker == "tiny:1.0", r.stdout  # in the image
    assert ids == "ids=2,3 gpus=0,1", r.stdout  # Slurm's indices, and CUDA's numbering
    verdicts = dict(line.split()[:2] for line in files)
    assert verdicts == {
        "/dev/nvidia0": "refused",
        "/dev/nvidia1": "refused",
        "/dev/nvidia2": "allowed",  # minor = index (gres.conf's File=)
        "/dev/nvidia3": "allowed",
        "/dev/nvidiactl": "allowed",
    }, files
    # The node's own /dev (cluster.sh node_dev), not this host's, which never gets them.
    r = cluster.on_node("n2", ["stat", "-c", "%d", "/dev"])
    assert r.returncode == 0 and r.stdout.split() != [str(os.stat("/dev").st_dev)], r


def test_a_gpu_fault_drains_its_node_the_job_runs_elsewhere_and_resume_waits_for_a_pass(
    gpu_nodes: Cluster, workdir: Path
) -> None:
    cluster = gpu_nodes
    site = "site: disk swap"  # the site's own drain, which tfimage never touches
    cluster.run(
        ["scontrol", "update", "NodeName=n2", "State=DRAIN", f"Reason={site}"], as_root=True
    )
    faulty: dict[str, Any] = healthy_node("n1")
    faulty["devices"] = [
        gpu(i, uuid=d["uuid"], minor=i, ecc_dbe_volatile=2) for i, d in enumerate(faulty["devices"])
    ]
    _set_gpus(cluster, "n1", faulty)

    job = cluster.submit(workdir, "-N1", "--gres=gpu:2", "-o", "where.txt", "--wrap", "hostname")
    _wait("n1 to drain", lambda: "drain" in _state_and_reason(cluster, "n1")[0])
    reason = _state_and_reason(cluster, "n1")[1]
    uuid = faulty["devices"][0]["uuid"]
    assert reason.startswith(f"tfimage: gpu0 {uuid}: volatile uncorrected ECC: 2"), reason
    assert any(f"job {job}: drained n1" in line for line in cluster.hooks_log("n1"))

    # The job was requeued, not lost: it runs once the site returns n2 to service.
    def show() -> str:
        return cluster.run(["scontrol", "-o", "show", "job", job], as_root=True).stdout

    _wait("the job to be requeued", lambda: "Restarts=1" in show() and "JobState=PENDING" in show())
    cluster.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], as_root=True)
    # Slurm holds a requeued job back about 120 s (its BeginTime, Slurm's own, not
    # tfimage's), then backfill starts it: release it now, as an admin would, so that
    # the test waits for where it runs and not for that timer (127 s -> seconds).
    cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], as_root=True)
    _wait("the job to run on n2", lambda: (workdir / "where.txt").exists(), timeout=300)
    _wait(
        "the job to end",
        lambda: not cluster.run(["squeue", "-h", "-j", job], as_root=True).stdout.strip(),
    )
    assert (workdir / "where.txt").read_text().split() == ["n2"]
    shown = show()
    assert "JobState=COMPLETED" in shown and "Restarts=1" in shown, shown

    # Still faulty: resume refuses, and n1 stays out.
    r = cluster.on_node("n1", [TFIMAGE, "gpu", "resume", "--node", "n1"])
    assert r.returncode == 1 and "n1 still fails: tfimage: gpu0" in r.stderr, r.stderr
    assert "drain" in _state_and_reason(cluster, "n1")[0]
    # Repaired: a passing check returns it to service.
    _set_gpus(cluster, "n1", healthy_node("n1"))
    r = cluster.on_node("n1", [TFIMAGE, "gpu", "resume", "--node", "n1"])
    assert r.returncode == 0 and "n1 resumed (was: tfimage: gpu0" in r.stdout, r.stderr
    cluster.assert_never_drained("n1")

    # A site's drain survives gpu resume, whatever the GPUs say.
    cluster.run(
        ["scontrol", "update", "NodeName=n2", "State=DRAIN", f"Reason={site}"], as_root=True
    )
    r = cluster.on_node("n2", [TFIMAGE, "gpu", "resume", "--node", "n2"])
    assert r.returncode == 1 and "drained by someone else (site: disk swap)" in r.stderr, r.stderr
    assert _state_and_reason(cluster, "n2") == ("drained", site)


@pytest.mark.parametrize(
    ("fault", "timeout", "said"),
    [
        ({"signal": 9}, None, "the NVML reading failed: exit status -9"),
        ({}, 0.001, "the NVML reading did not start within 0.001 s"),
    ],
    ids=["reading killed by the OOM killer", "reading not started within its bound"],
)
def test_a_gpu_reading_that_fails_for_tfimages_own_reasons_drains_nothing(
    gpu_nodes: Cluster, workdir: Path, fault: dict[str, Any], timeout: float | None, said: str
) -> None:
    """Not a GPU fault, so not a drain: the job runs where Slurm put it, the prolog
    says why it could not check, and the node stays in service in Slurm's eyes."""
    cluster = gpu_nodes
    _set_gpus(cluster, "n1", {**healthy_node("n1"), **fault})
    site = yaml.safe_load(Path(cluster.env["TFIMAGE_CONFIG"]).read_text())
    gpu_section = {**site.get("gpu", {}), **({"timeout": timeout} if timeout else {})}
    before = len(cluster.hooks_log("n1"))
    with cluster.config_with(gpu=gpu_section):
        r = cluster.run(
            ["srun", "-N1", "-w", "n1", "--gres=gpu:1", "hostname"], cwd=workdir, timeout=120
        )
    assert r.returncode == 0 and r.stdout.strip() == "n1", r.stderr
    new = cluster.hooks_log("n1")[before:]
    assert any(said in line for line in new), new
    assert not any("drained" in line for line in new), new
    cluster.assert_never_drained("n1")


def test_the_roles_health_check_drains_a_faulty_node_as_slurmd_would_run_it(
    gpu_nodes: Cluster,
) -> None:
    """The role wrote HealthCheckProgram (the site had none) and nohold_on_prolog_fail
    into slurm.conf; its program, run with only SLURMD_NODENAME in its environment as
    slurmd runs it, drains a node whose GPU fails and leaves a healthy one alone."""
    cluster = gpu_nodes
    shown = cluster.run(["scontrol", "show", "config"], as_root=True).stdout
    conf = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition("=") for line in shown.splitlines())
    )
    program = conf["HealthCheckProgram"]
    assert program.endswith("/tfimage-health-check"), conf["HealthCheckProgram"]
    assert "nohold_on_prolog_fail" in conf["SchedulerParameters"].split(",")

    as_slurmd = ["env", "-i", "SLURMD_NODENAME=n1", program]
    r = cluster.on_node("n1", as_slurmd)
    assert r.returncode == 0, r.stdout + r.stderr
    cluster.assert_never_drained("n1")

    faulty = healthy_node("n1")
    faulty["devices"][3] = gpu(3, uuid=faulty["devices"][3]["uuid"], retired_pending=1)
    _set_gpus(cluster, "n1", faulty)
    r = cluster.on_node("n1", as_slurmd)
    assert r.returncode == 2, r.stdout + r.stderr
    state, reason = _state_and_reason(cluster, "n1")
    assert "drain" in state and reason.startswith("tfimage: gpu3 GPU-"), (state, reason)
    cluster.assert_never_drained("n2")


def _busy(node: str, gpu_index: int) -> dict[str, Any]:
    """The node's NVML state with a compute process on one GPU (another job's)."""
    doc = healthy_node(node)
    d = doc["devices"][gpu_index]
    doc["devices"][gpu_index] = gpu(
        gpu_index, uuid=d["uuid"], minor=gpu_index, processes=[{"pid": 4242, "mem": 1 << 30}]
    )
    return doc


def test_shard_and_mps_jobs_beside_another_jobs_process_never_drain_but_a_whole_gpu_does(
    gpu_nodes: Cluster, workdir: Path
) -> None:
    """n1 shares its GPUs as gres/shard (gpu.shared: [n1]), n2 through gres/mps: a
    process on GPU 0 is another sharer's.  Two shard jobs on that GPU at once and an
    MPS job there all run; a whole-GPU job on n2, which does not share, drains it."""
    cluster = gpu_nodes
    _set_gpus(cluster, "n1", _busy("n1", 0))
    _set_gpus(cluster, "n2", _busy("n2", 0))
    before = {n: len(cluster.hooks_log(n)) for n in ("n1", "n2")}
    show = (
        "echo ${CUDA_VISIBLE_DEVICES:-none} ${GPU_DEVICE_ORDINAL:-none}"
        " ${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-none};"
        " test -s /usr/local/nvidia/lib64/libnvidia-ml.so.1 && echo driver; sleep 3"
    )
    jobs = []
    for name, opts in (
        ("shard-a", ["-w", "n1", "--gres=shard:1"]),
        ("shard-b", ["-w", "n1", "--gres=shard:1"]),
        ("mps", ["-w", "n2", "--gres=mps:50"]),
    ):
        jobs.append(
            cluster.submit(
                workdir, *opts, "--tf-image=tiny:1.0", "-o", f"{name}.txt", "--wrap", show
            )
        )
    _wait(
        "the three jobs to end",
        lambda: not cluster.run(["squeue", "-h", "-j", ",".join(jobs)], as_root=True).stdout,
    )
    for job in jobs:
        shown = cluster.run(["scontrol", "-o", "show", "job", job], as_root=True).stdout
        assert "JobState=COMPLETED" in shown and "Restarts=0" in shown, shown
    # Both shard jobs had GPU 0, where the other process is.  Inside the image the
    # variables are as Slurm set them (22.05 gives a shard job GPU_DEVICE_ORDINAL and
    # no CUDA_VISIBLE_DEVICES), and the driver is there.
    for name in ("shard-a", "shard-b"):
        words = (workdir / f"{name}.txt").read_text().split()
        assert words[1:] == ["0", "none", "driver"], (name, words)
    words = (workdir / "mps.txt").read_text().split()
    assert words[0] == "0" and words[2] != "none" and words[3] == "driver", words
    gates = [
        line
        for n in ("n1", "n2")
        for line in cluster.hooks_log(n)[before[n] :]
        if "gpu: 1 GPU(s) healthy" in line
    ]
    assert sorted(g.split("job ")[1].split(":")[0] for g in gates) == sorted(jobs), gates
    cluster.assert_never_drained("n1")
    cluster.assert_never_drained("n2")

    # The same process before a whole-GPU job on a node that does not share: a fault.
    sub = cluster.run(
        ["sbatch", "--parsable", "-w", "n2", "--gres=gpu:1", "--wrap", "true"], cwd=workdir
    )
    job = sub.stdout.strip().split(";")[0]
    _wait("n2 to drain", lambda: "drain" in _state_and_reason(cluster, "n2")[0])
    assert _state_and_reason(cluster, "n2")[1] == (
        f"tfimage: gpu0 {_busy('n2', 0)['devices'][0]['uuid']}: "
        "1 compute process(es) from outside the job: pid 4242"
    )
    cluster.run(["scancel", job], as_root=True)

"""TensorFlow multi-worker training inside tf-custom:2.0, with no TF_CONFIG code in the job."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import REPO, Cluster, write_script

pytestmark = pytest.mark.cluster
TRAIN = REPO / "deploy" / "local" / "examples" / "mwms_train.py"
WORKER = re.compile(r"^WORKER (\d+)/(\d+) host=(\S+) loss (\S+) -> (\S+) weights (\w+)$", re.M)


def training_job(d: Path, user: str, shape: str, name: str = "job") -> Path:
    shutil.copy(TRAIN, d / "mwms_train.py")
    write_script(
        d,
        f"{name}.sh",
        (
            "#!/bin/bash\n#SBATCH --tf-image=tf-custom:2.0\n"
            f"#SBATCH {shape}\n#SBATCH -o {name}.out\n#SBATCH -e {name}.err\n"
            # A worker whose peer never starts ignores SIGTERM: guard it with SIGKILL.
            "srun --kill-on-bad-exit=1 timeout -s KILL 300 python3 mwms_train.py\n"
        ),
        user,
    )
    shutil.chown(d / "mwms_train.py", user)
    return d / f"{name}.sh"


def check_agreement(out: str, workers: int, hosts: set[str]) -> None:
    found = WORKER.findall(out)
    assert sorted(int(i) for i, *_ in found) == list(range(workers)), out
    assert {int(n) for _, n, *_ in found} == {workers}
    assert {h for _, _, h, *_ in found} == hosts
    assert len({w for *_, w in found}) == 1, f"workers disagree on the weights:\n{out}"
    for *_, first, last, _w in found:
        assert float(last) < float(first) / 10, f"loss did not go down: {first} -> {last}"


@pytest.mark.parametrize(
    ("shape", "workers"), [("-N2 --ntasks-per-node=1", 2), ("-N2 --ntasks-per-node=2", 4)]
)
def test_multi_worker_training(cluster: Cluster, workdir: Path, shape: str, workers: int) -> None:
    training_job(workdir, cluster.user, shape)
    r, _ = cluster.sbatch_wait(workdir, "job.sh", timeout=600)
    out = (workdir / "job.out").read_text()
    assert r.returncode == 0, out + (workdir / "job.err").read_text()[-2000:]
    check_agreement(out, workers, {"n1", "n2"})


def test_two_jobs_at_once_on_the_same_nodes_do_not_collide(cluster: Cluster, workdir: Path) -> None:
    a, b = workdir / "a", workdir / "b"
    for d in (a, b):
        d.mkdir()
        shutil.chown(d, cluster.user)
        training_job(d, cluster.user, "-N2 --ntasks-per-node=1", "job")
    ids = [cluster.submit(d, "job.sh") for d in (a, b)]
    # Both running at once (each trains for tens of seconds), then both finished.
    poll = cluster.run(
        [
            "sh",
            "-c",
            f"both=0; while squeue -h -j {','.join(ids)} | grep -q .; do "
            f'[ "$(squeue -h -t R -j {",".join(ids)} | wc -l)" = 2 ] && both=1; '
            "sleep 0.5; done; echo both=$both",
        ],
        cwd=workdir,
        timeout=600,
    )
    assert poll.stdout.strip() == "both=1", "the two jobs never ran at the same time"
    for d in (a, b):
        out = (d / "job.out").read_text()
        check_agreement(out, 2, {"n1", "n2"})


def test_one_task_job_runs_python_directly_in_the_image(cluster: Cluster, workdir: Path) -> None:
    r, out = cluster.sbatch(
        workdir,
        "one.sh",
        (
            "#!/bin/bash\n#SBATCH --tf-image=tf-custom:2.0\n"
            "#SBATCH -o one.out\n#SBATCH -e one.err\n"
            "python3 -c 'import json, os, tensorflow as tf; "
            'print("TF", tf.__version__, json.dumps({k: os.environ.get(k) for k in '
            '("TF_CONFIG", "TF_FORCE_GPU_ALLOW_GROWTH")}))\'\n'
        ),
        "one.out",
        timeout=300,
    )
    assert r.returncode == 0, out + (workdir / "one.err").read_text()[-2000:]
    m = re.search(r"^TF (\S+) (\{.*\})$", out, re.M)
    assert m, out
    env = json.loads(m.group(2))
    assert env == {"TF_CONFIG": None, "TF_FORCE_GPU_ALLOW_GROWTH": "true"}


@pytest.mark.parametrize(("mode", "where"), [("host", "host"), ("container", "tiny:1.0")])
def test_tf_batch_chooses_where_the_script_runs(
    cluster: Cluster, workdir: Path, mode: str, where: str
) -> None:
    r, out = cluster.sbatch(
        workdir,
        "b.sh",
        (
            f"#!/bin/sh\n#SBATCH --tf-image=tiny:1.0\n#SBATCH --tf-batch={mode}\n#SBATCH -o b.out\n"
            "cat /etc/tfimage-test-image 2>/dev/null || echo host\n"
        ),
        "b.out",
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert out.split() == [where]


def test_step_gets_tf_config_and_user_values_win(cluster: Cluster, workdir: Path) -> None:
    r = cluster.run(
        [
            "srun",
            "-N2",
            "-n3",
            "--tf-image=tiny:1.0",
            "sh",
            "-c",
            'echo "$SLURMD_NODENAME $SLURM_LOCALID $TF_CONFIG $NCCL_SOCKET_IFNAME"',
        ],
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    rows = sorted(line.split(" ") for line in r.stdout.splitlines())
    cfgs = [json.loads(row[2]) for row in rows]
    workers = cfgs[0]["cluster"]["worker"]
    assert [w.split(":")[0] for w in workers] == ["n1", "n1", "n2"]
    assert len(set(workers)) == 3
    assert [c["task"]["index"] for c in cfgs] == [0, 1, 2]
    assert all(c["cluster"]["worker"] == workers for c in cfgs)
    assert {row[3] for row in rows} == {"=eth0"}
    mine = cluster.run(
        ["srun", "-N2", "--tf-image=tiny:1.0", "sh", "-c", 'echo "$TF_CONFIG"'],
        cwd=workdir,
        extra_env={"TF_CONFIG": "user-set"},
    )
    assert mine.stdout.split() == ["user-set", "user-set"]


def test_env_explain_inside_a_step(cluster: Cluster, workdir: Path) -> None:
    r = cluster.run(
        ["srun", "-N2", "-n2", "tfimage", "env", "--json"],
        cwd=workdir,
        extra_env={"TF_FORCE_GPU_ALLOW_GROWTH": "false"},
    )
    assert r.returncode == 0, r.stderr
    for line in r.stdout.splitlines():
        rows = {row["name"]: row for row in json.loads(line)}
        assert rows["TF_FORCE_GPU_ALLOW_GROWTH"]["state"].startswith("set by the user")
        assert "host-major over n1,n2" in rows["TF_CONFIG"]["why"]
    outside = cluster.run(["tfimage", "env"], cwd=workdir)
    assert outside.returncode == 2 and "not inside a job step" in outside.stderr

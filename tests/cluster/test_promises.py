"""The README's promises on the real cluster, each with a test that fails without it:
the prolog pulls ahead of time, Slurm's reserved ports, NCCL_IB_HCA, salloc, the
pinning fallbacks at submit, 'never drains', env --explain inside an image step,
the operators' cache commands, and an epilog that cleans what really was there."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import (
    REPO,
    Cluster,
    bridge_server,
    busybox_sif,
    push,
    tfimage_here,
    write_script,
)

from support import wait_for

pytestmark = pytest.mark.cluster
CLUSTER_SH = REPO / "deploy/local/cluster.sh"


def _node_cache(cluster: Cluster, node: str) -> Path:
    return cluster.state / "nodes" / node / "cache" / "images"


@contextlib.contextmanager
def registry_stopped(cluster: Cluster) -> Iterator[None]:
    """The cluster's registry frozen (SIGSTOP), and its front, the project proxy
    (nginx, its own process group): it accepts connections, answers none."""
    pid = int((cluster.state / "run" / "registry.pid").read_text())
    proxy = os.getpgid(int((cluster.state / "run" / "proxy.pid").read_text()))
    os.kill(pid, signal.SIGSTOP)
    os.killpg(proxy, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(proxy, signal.SIGCONT)
        os.kill(pid, signal.SIGCONT)


def _fresh_image(cluster: Cluster, tmp_path: Path, name: str) -> str:
    """A new image (never cached on any node) pushed as ``name:1``; its digest."""
    marker = f"{name}-{os.urandom(4).hex()}"
    return push(cluster, busybox_sif(tmp_path, marker), f"{name}:1")


# --- 1. the prolog pulls ahead of time ------------------------------------------------


def test_the_prolog_pulls_the_image_before_the_first_step(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    digest = _fresh_image(cluster, tmp_path, "ahead")
    cached = _node_cache(cluster, "n1") / f"{digest.replace(':', '-')}.sif"
    assert not cached.exists()
    go = workdir / "go"
    write_script(
        workdir,
        "job.sh",
        # Two tasks: the batch script runs on the host, and its first step waits for us.
        "#!/bin/sh\n#SBATCH --tf-image=ahead:1\n#SBATCH -w n1 -n2\n#SBATCH -o out.txt\n"
        f"while [ ! -e {go} ]; do sleep 0.2; done\n"
        "srun -n1 cat /etc/tfimage-test-image\n",
        cluster.user,
    )
    job = cluster.submit(workdir, "job.sh")
    try:
        # Before any step: the image is in n1's cache, and the prolog said so.
        wait_for(cached.exists, timeout=120, what="the prolog's pull")
        wait_for(
            lambda: any(
                f"job {job}: " in line and "pulled from" in line for line in cluster.hooks_log("n1")
            ),
            what="the prolog's log line",
        )
        # A first step that starts late still finds it there, and asks for nothing.
        time.sleep(2)
        go.touch()
        wait_for(
            lambda: (
                (workdir / "out.txt").exists() and "ahead-" in (workdir / "out.txt").read_text()
            ),
            timeout=120,
        )
    finally:
        go.touch()
        cluster.run(["scancel", job], as_root=True)
    assert (workdir / "out.txt").read_text().startswith("ahead-")


# --- 2. Slurm's reserved ports -----------------------------------------------------------


def _ports(text: str) -> list[int]:
    out: list[int] = []
    for item in text.split(","):
        lo, _, hi = item.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def test_tf_config_takes_exactly_the_ports_slurm_reserved_for_the_step(
    cluster: Cluster, workdir: Path
) -> None:
    r = cluster.run(
        [
            "srun",
            "-N2",
            "--ntasks-per-node=2",
            "--resv-ports=2",  # 22.05 reserves none for a bare --resv-ports
            "--tf-image=tiny:1.0",
            "sh",
            "-c",
            'echo "$SLURM_LOCALID|$SLURM_STEP_RESV_PORTS|$TF_CONFIG"',
        ],
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    mpi = range(20000, 21000)  # MpiParams=ports=20000-20999 in the cluster's slurm.conf
    lines = r.stdout.splitlines()
    assert len(lines) == 4, r.stdout
    for line in lines:
        local, resv, tf_config = line.split("|", 2)
        reserved = _ports(resv)
        workers = json.loads(tf_config)["cluster"]["worker"]
        ports = [int(w.rsplit(":", 1)[1]) for w in workers]
        assert all(p in mpi for p in ports), ports
        # Each node's task L takes the L-th reserved port, as Slurm gave it to the step.
        assert ports == [reserved[0], reserved[1]] * 2, (ports, resv)
        mine = json.loads(tf_config)["task"]["index"]
        assert ports[mine] == reserved[int(local)]


# --- 3. NCCL_IB_HCA ------------------------------------------------------------------------


def test_a_tasks_nccl_ib_hca_names_the_nodes_active_ports(cluster: Cluster, workdir: Path) -> None:
    tree = cluster.state / "ib-fake"  # visible in every node's namespace (and the chroot)
    for dev, ports in {"mlx5_0": {"1": "4: ACTIVE"}, "mlx5_1": {"1": "1: DOWN"}}.items():
        for port, state in ports.items():
            (tree / dev / "ports" / port).mkdir(parents=True, exist_ok=True)
            (tree / dev / "ports" / port / "state").write_text(state + "\n")
    with cluster.config_with(ib_sysfs=str(tree)):
        r = cluster.run(
            ["srun", "-N2", "--tf-image=tiny:1.0", "sh", "-c", 'echo "$NCCL_IB_HCA"'],
            cwd=workdir,
        )
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["mlx5_0:1", "mlx5_0:1"]


# --- 4. salloc -----------------------------------------------------------------------------


def test_salloc_with_an_image_runs_its_sruns_in_it(cluster: Cluster, workdir: Path) -> None:
    r = cluster.run(
        ["salloc", "-N2", "--tf-image=tiny:1.0", "srun", "cat", "/etc/tfimage-test-image"],
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["tiny:1.0", "tiny:1.0"]


# --- 5. pinning fallbacks at submit ---------------------------------------------------------


def test_when_the_host_cannot_pin_the_users_own_credentials_do(
    cluster: Cluster, workdir: Path
) -> None:
    creds = Path(yaml.safe_load(Path(cluster.env["TFIMAGE_CONFIG"]).read_text())["credentials"])
    good = creds.read_text()
    data = json.loads(good)
    for entry in data["registries"].values():
        entry["password"] = "not-the-password"
    creds.write_text(json.dumps(data))
    login_log = cluster.state / "log" / "daemon-login.log"
    try:
        subprocess.run(["bash", str(CLUSTER_SH), "daemon", "login"], check=True, timeout=60)
        r = cluster.run(
            ["srun", "-N1", "--tf-image=tiny:1.0", "cat", "/etc/tfimage-test-image"], cwd=workdir
        )
        said = login_log.read_text()  # before the restart below starts a new log
    finally:
        creds.write_text(good)
        subprocess.run(["bash", str(CLUSTER_SH), "daemon", "login"], check=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "tiny:1.0", r.stderr
    uid = pwd.getpwnam(cluster.user).pw_uid
    assert f"pin uid {uid} -> 75" in said, said  # the host could not


def test_registry_down_at_submit_the_last_seen_digest_and_a_warning(
    cluster: Cluster, workdir: Path
) -> None:
    ok = cluster.run(["srun", "-N1", "--tf-image=tiny:1.0", "true"], cwd=workdir)
    assert ok.returncode == 0, ok.stderr  # seen now, by the pin server and the user
    with cluster.config_with(connect_timeout=1, read_timeout=2), registry_stopped(cluster):
        r = cluster.run(
            ["srun", "-N1", "--tf-image=tiny:1.0", "cat", "/etc/tfimage-test-image"], cwd=workdir
        )
        never = cluster.run(["srun", "-N1", "--tf-image=never-seen:1", "true"], cwd=workdir)
    assert r.returncode == 0 and r.stdout.strip() == "tiny:1.0", r.stderr
    assert "last digest this host saw" in r.stderr  # the user is told
    assert never.returncode != 0
    # One line of ours (Slurm adds its own "plugin ... failed" after it).
    lines = [line for line in never.stderr.splitlines() if "error: tfimage:" in line]
    assert len(lines) == 1 and lines[0].endswith("never seen that tag"), never.stderr


def test_registry_killed_a_private_tag_is_refused_for_the_registry_not_the_users_credentials(
    cluster: Cluster, workdir: Path
) -> None:
    # The soak's registry-kill fault: the project proxy still answers, so the pin
    # server (the host's credentials) gets 502s and the user's own pin a 401 for a
    # project whose robot only the host has; the user used to read the 401 alone.
    subprocess.run(["bash", str(CLUSTER_SH), "registry", "stop"], check=True, timeout=60)
    try:
        r = cluster.run(["srun", "-N1", "--tf-image=team-a/tiny:never-pinned", "true"], cwd=workdir)
    finally:
        subprocess.run(["bash", str(CLUSTER_SH), "registry", "start"], check=True, timeout=120)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if "error: tfimage:" in line]
    assert len(lines) == 1, r.stderr
    host, _, own = lines[0].partition("; pinning with your own credentials: ")
    assert "answering 502" in host and host.endswith("never seen that tag"), lines[0]
    assert own, lines[0]  # and what the user's own try met, after it


# --- 7. never drains ---------------------------------------------------------------------------


def test_a_registry_stopped_during_the_prolog_fails_the_job_not_the_node(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    digest = _fresh_image(cluster, tmp_path, "stopped")
    with cluster.config_with(connect_timeout=1, read_timeout=2), registry_stopped(cluster):
        r = cluster.run(
            ["srun", "-N1", "-w", "n1", f"--tf-image=stopped@{digest}", "true"], cwd=workdir
        )
    assert r.returncode != 0
    assert "the prolog could not ready it" in r.stderr and "unreachable" in r.stderr, r.stderr
    cluster.assert_never_drained("n1")
    assert not list(_node_cache(cluster, "n1").glob(f"{digest.replace(':', '-')}.*"))


def test_a_corrupt_blob_fails_the_job_not_the_node_and_publishes_nothing(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    good = busybox_sif(tmp_path, "corrupt").read_bytes()
    evil = bytearray(good)
    evil[-1] ^= 0xFF
    layer = {
        "mediaType": "application/vnd.sylabs.sif.layer.v1.sif",
        "digest": "sha256:" + hashlib.sha256(good).hexdigest(),
        "size": len(good),
    }
    with bridge_server(cluster, tmp_path) as server:
        server.serve(bytes(evil), layers=[layer])
        digest = "sha256:" + hashlib.sha256(server.b.manifest).hexdigest()
        allowed = [cluster.env["TFIMAGE_REGISTRY"], server.host]
        with cluster.config_with(allowed_registries=allowed):
            evil_ref = f"{server.host}/library/evil@{digest}"
            r = cluster.run(
                ["srun", "-N1", "-w", "n1", f"--tf-image={evil_ref}", "true"], cwd=workdir
            )
    assert r.returncode != 0 and "sha256 of the download does not match" in r.stderr, r.stderr
    cluster.assert_never_drained("n1")
    assert not list(_node_cache(cluster, "n1").glob(f"{digest.replace(':', '-')}.*"))


def test_a_full_cache_filesystem_fails_the_job_not_the_node(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    digest = _fresh_image(cluster, tmp_path, "full")
    small = ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0755", "tmpfs", "/var/cache/tfimage"]
    r = cluster.on_node("n1", small)
    assert r.returncode == 0, r.stderr
    try:
        job = cluster.run(
            ["srun", "-N1", "-w", "n1", f"--tf-image=full@{digest}", "true"], cwd=workdir
        )
        left = cluster.on_node("n1", ["find", "/var/cache/tfimage/images", "-type", "f"])
    finally:
        cluster.on_node("n1", ["umount", "/var/cache/tfimage"])
    assert job.returncode != 0 and "No space left on device" in job.stderr, job.stderr
    assert left.stdout.strip() == ""  # nothing half-published
    cluster.assert_never_drained("n1")


# --- 8. env --explain inside an image step ---------------------------------------------------


def test_env_explain_in_an_image_step_tells_the_values_the_task_has(
    cluster: Cluster, workdir: Path
) -> None:
    """tfimage env runs inside tf-custom:2.0 from the node's own install, bound in."""
    etc = str(Path(cluster.env["TFIMAGE_CONFIG"]).parent)
    probe = (
        "export PYTHONPATH=$(echo /opt/tfimage/lib/python3*/site-packages); "
        f"python3 -m tfimage.main --config {etc}/config.yaml env --json "
        ">explain.$SLURM_PROCID && "
        "python3 -c 'import json, os; print(json.dumps(dict(os.environ)))' >env.$SLURM_PROCID"
    )  # to files: srun cuts a task's long lines into 2 KiB pieces and interleaves them
    prefixes = ["/home", "/opt/tfimage", etc]
    with cluster.config_with(bind_prefixes=prefixes):
        r = cluster.run(
            [
                "srun",
                "-N2",
                "-n2",
                "--tf-image=tf-custom:2.0",
                f"--tf-mount=/opt/tfimage:/opt/tfimage:ro,{etc}:{etc}:ro",
                "sh",
                "-c",
                probe,
            ],
            cwd=workdir,
            timeout=300,
        )
    assert r.returncode == 0, r.stderr
    explained = 0
    for task in range(2):
        rows = json.loads((workdir / f"explain.{task}").read_text())
        env = json.loads((workdir / f"env.{task}").read_text())
        for row in rows:
            assert env.get(row["name"]) == row["value"], row  # what it says is what is
            assert row["state"] == "set by tfimage", row
            explained += 1
    assert explained >= 4  # TF_CONFIG, NCCL_SOCKET_IFNAME, TF_FORCE_... on each task


# --- 9. the operators' cache commands ---------------------------------------------------------


def test_cache_rm_refuses_a_held_image_then_frees_its_bytes(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    digest = _fresh_image(cluster, tmp_path, "rmme")
    write_script(
        workdir,
        "hold.sh",
        f"#!/bin/sh\n#SBATCH --tf-image=rmme@{digest}\n#SBATCH -w n1\n#SBATCH -o hold.out\n"
        f"while [ ! -e {workdir / 'release'} ]; do sleep 0.2; done\n",
        cluster.user,
    )
    jid = cluster.submit(workdir, "hold.sh")
    cached = _node_cache(cluster, "n1") / f"{digest.replace(':', '-')}.sif"
    tfimage = ["/opt/tfimage/bin/tfimage", "--config", cluster.env["TFIMAGE_CONFIG"], "cache"]
    try:
        wait_for(cached.exists, timeout=120, what="the held image")
        held = cluster.on_node("n1", [*tfimage, "rm", digest])
        assert held.returncode != 0 and f"held by running job(s) {jid}" in held.stderr
        before = json.loads(cluster.on_node("n1", [*tfimage, "du", "--json"]).stdout)
        size = cached.stat().st_size
    finally:
        (workdir / "release").touch()
    wait_for(lambda: _job_done(cluster, jid), timeout=60, what=f"job {jid} to end")
    wait_for(
        lambda: (
            not any(
                jid in json.loads(p.read_text()).get("holders", [])
                for p in cached.parent.glob("*.json")
            )
        ),
        what="the epilog's release",
    )
    gone = cluster.on_node("n1", [*tfimage, "rm", digest, "--json"])
    assert gone.returncode == 0 and json.loads(gone.stdout) == {"removed": digest}, gone.stderr
    after = json.loads(cluster.on_node("n1", [*tfimage, "du", "--json"]).stdout)
    assert before["cache_bytes"] - after["cache_bytes"] == size  # exactly its bytes freed
    assert before["entries"] - after["entries"] == 1
    assert not cached.exists()


def _job_done(cluster: Cluster, jid: str) -> bool:
    r = cluster.run(["squeue", "-h", "-j", jid, "-o", "%T"], as_root=True)
    return r.stdout.strip() in ("", "COMPLETED", "CANCELLED", "FAILED")


def test_resolve_asks_the_live_registry(cluster: Cluster, tmp_path: Path) -> None:
    digest = _fresh_image(cluster, tmp_path, "resolveme")
    r = tfimage_here(cluster, "resolve", "resolveme:1", "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["digest"] == digest
    moved = push(cluster, busybox_sif(tmp_path, "resolveme-2"), "resolveme:1")
    r = tfimage_here(cluster, "resolve", "resolveme:1", timeout=60)
    assert r.stdout.strip().endswith("@" + moved)  # not a cached answer


# --- 13. the epilog cleans what was there ------------------------------------------------------


def test_the_epilog_removes_the_mounts_and_holds_a_running_job_had(
    cluster: Cluster, workdir: Path
) -> None:
    job = cluster.start(
        ["srun", "-N2", "--tf-image=tiny:1.0", "sh", "-c", 'echo "$SLURM_JOB_ID"; sleep 30'],
        workdir,
    )
    try:
        assert job.stdout is not None
        jid = job.stdout.readline().strip()
        images = set()
        for node in ("n1", "n2"):
            mounts = sorted(cluster.job_mounts(node, jid))
            # the step's root, and the image (shared by the jobs on the node) under it
            assert [m.split("/")[3] for m in mounts] == ["images", "jobs"], mounts
            images.add((node, mounts[0]))
            held = [
                p
                for p in _node_cache(cluster, node).glob("*.json")
                if jid in json.loads(p.read_text()).get("holders", [])
            ]
            assert held, f"job {jid} holds nothing on {node} while it runs"
    finally:
        job.kill()
        job.wait()
        cluster.run(["scancel", jid], as_root=True)
    for node in ("n1", "n2"):
        wait_for(
            lambda node=node: (
                not [
                    m
                    for m in cluster.node_mounts(node)
                    if m.startswith(f"/run/tfimage/jobs/{jid}/") or (node, m) in images
                ]
            ),
            timeout=60,
            what=f"the epilog on {node}",
        )
        wait_for(
            lambda node=node: (
                not [
                    p
                    for p in _node_cache(cluster, node).glob("*.json")
                    if jid in json.loads(p.read_text()).get("holders", [])
                ]
            ),
            what=f"the holds on {node}",
        )
        assert not (cluster.state / "nodes" / node).joinpath(f"run/jobs/{jid}").exists()
    assert re.fullmatch(r"\d+", jid)

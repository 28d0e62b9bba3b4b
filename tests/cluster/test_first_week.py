"""A site's first week, on the real cluster: what users type from habit, a registry
that hangs at submit with default timeouts, a submit that runs out of time, the kill
switch, the command on users' PATH with its man pages, and the docs' commands run as
written."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, Cluster, write_script
from test_promises import registry_stopped

from support import wait_for

pytestmark = pytest.mark.cluster


def _etc(cluster: Cluster) -> Path:
    return Path(cluster.env["TFIMAGE_CONFIG"]).parent


def _our_lines(stderr: str) -> list[str]:
    """The plugin's own error lines (Slurm adds its "plugin ... failed" after them)."""
    return [line for line in stderr.splitlines() if "error: tfimage:" in line]


# --- what users type from habit ------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["srun", "sbatch"])
@pytest.mark.parametrize(
    "ref", ["docker.io/tensorflow/tensorflow:2.16.1", "docker://tensorflow/tensorflow:2.16.1"]
)
def test_a_docker_hub_name_on_a_site_without_a_proxy_says_so_at_submit(
    cluster: Cluster, workdir: Path, cmd: str, ref: str
) -> None:
    before = cluster.job_ids()
    argv = [cmd, f"--tf-image={ref}"] + (["--wrap", "true"] if cmd == "sbatch" else ["true"])
    with cluster.config_with(dockerhub_project=None):
        r = cluster.run(argv, cwd=workdir, timeout=60)
    assert r.returncode != 0
    lines = _our_lines(r.stderr)
    assert len(lines) == 1 and "this site has no Docker Hub proxy" in lines[0], r.stderr
    assert cluster.job_ids() <= before  # nothing queued (old ones may age out)


# --- a registry that hangs at submit ----------------------------------------------------------


def test_a_hung_registry_at_default_timeouts_gives_the_remembered_digest_in_time(
    cluster: Cluster, workdir: Path
) -> None:
    """Accepts connections and never answers (SIGSTOP), at the shipped timeouts: the
    pin gives up on the registry after its share (wire.PIN_REGISTRY_SECONDS) and uses
    the digest this host saw, well within submit_timeout (30 s)."""
    from tfimage.agent.core import wire

    ok = cluster.run(["srun", "-w", "n1", "--tf-image=tiny:1.0", "true"], cwd=workdir)
    assert ok.returncode == 0, ok.stderr
    with registry_stopped(cluster):
        t0 = time.monotonic()
        r = cluster.run(
            ["srun", "-w", "n1", "--tf-image=tiny:1.0", "cat", "/etc/tfimage-test-image"],
            cwd=workdir,
            timeout=90,
        )
        took = time.monotonic() - t0
    assert r.returncode == 0 and r.stdout.strip() == "tiny:1.0", r.stderr
    assert "last digest this host saw" in r.stderr, r.stderr
    assert took < wire.DEFAULT_SUBMIT_TIMEOUT, f"{took:.1f} s"


@contextlib.contextmanager
def plugstack_with(cluster: Cluster, arg: str) -> Iterator[None]:
    """The login node's plugin line with one more argument (read by each srun)."""
    conf = Path(cluster.env["SLURM_CONF"]).parent / "plugstack.conf.d" / "tfimage.conf"
    text = conf.read_text()
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if "spank_tfimage.so" in line)
    lines[i] += f" {arg}"
    conf.write_text("\n".join(lines) + "\n")
    try:
        yield
    finally:
        conf.write_text(text)


def test_a_submit_that_runs_out_of_time_says_what_to_try_not_which_program(
    cluster: Cluster, workdir: Path
) -> None:
    with plugstack_with(cluster, "submit_timeout=2"), registry_stopped(cluster):
        r = cluster.run(["srun", "--tf-image=never-seen-slow:1", "true"], cwd=workdir, timeout=60)
    assert r.returncode != 0
    lines = _our_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert "no answer within submit_timeout (2 s)" in lines[0]
    assert "name the image by digest (NAME@sha256:...)" in lines[0]
    assert "/bin/tfimage" not in r.stderr


# --- the kill switch ---------------------------------------------------------------------------


def test_the_kill_switch_stops_new_tf_image_jobs_and_no_running_one(
    cluster: Cluster, workdir: Path
) -> None:
    switch = _etc(cluster) / "submit.off"
    go = workdir / "go"
    # A job queued before: its batch script (on the host, two tasks) waits, then steps.
    write_script(
        workdir,
        "before.sh",
        "#!/bin/sh\n#SBATCH --tf-image=tiny:1.0\n#SBATCH -n2 -o before.txt\n"
        f"while [ ! -e {go} ]; do sleep 0.2; done\n"
        "srun -n1 cat /etc/tfimage-test-image\n",
        cluster.user,
    )
    job = cluster.submit(workdir, "before.sh")
    try:
        wait_for(
            lambda: "RUNNING" in cluster.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout,
            timeout=60,
            what="the earlier job running",
        )
        switch.write_text("registry maintenance until 14:00\n")
        refused = cluster.run(["srun", "--tf-image=tiny:1.0", "true"], cwd=workdir)
        plain = cluster.run(["srun", "cat", "/etc/hostname"], cwd=workdir)
        go.touch()
        wait_for(
            lambda: (
                (workdir / "before.txt").exists()
                and "tiny:1.0" in (workdir / "before.txt").read_text()
            ),
            timeout=120,
            what="the earlier job's srun inside the image",
        )
    finally:
        switch.unlink(missing_ok=True)
        go.touch()
        cluster.run(["scancel", job], as_root=True)
    assert refused.returncode != 0
    assert _our_lines(refused.stderr) == [
        "srun: error: tfimage: submit: --tf-image is turned off on this cluster: "
        "registry maintenance until 14:00; jobs already queued still run"
    ], refused.stderr
    assert plain.returncode == 0, plain.stderr
    again = cluster.run(["srun", "--tf-image=tiny:1.0", "true"], cwd=workdir)
    assert again.returncode == 0, again.stderr


# --- the command on PATH, and its pages ------------------------------------------------------


def test_the_role_puts_tfimage_on_users_path_with_its_man_pages(
    cluster: Cluster, workdir: Path
) -> None:
    link = cluster.state / "bin" / "tfimage"
    assert link.is_symlink()
    env = {"PATH": f"{link.parent}:/usr/bin:/bin", "TFIMAGE_CONFIG": cluster.env["TFIMAGE_CONFIG"]}
    r = cluster.run(["tfimage", "tags", "tiny", "--json"], cwd=workdir, extra_env=env)
    assert r.returncode == 0, r.stderr
    assert "1.0" in json.loads(r.stdout)["tags"]
    for page, title in (
        ("man1/tfimage.1", "TFIMAGE(1)"),
        ("man8/tfimage-spank.8", "TFIMAGE-SPANK(8)"),
    ):
        shown = subprocess.run(
            ["man", "-l", str(cluster.state / "man" / page)],
            env={"MANWIDTH": "80", "LC_ALL": "C.UTF-8", "PATH": "/usr/bin:/bin"},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert shown.returncode == 0 and shown.stdout.startswith(title), shown.stderr


# --- the docs' commands, as written ----------------------------------------------------------


def _code_after(text: str, marker: str) -> str:
    return text.split(marker, 1)[1].split("```", 2)[1].split("\n", 1)[1]


def test_the_readme_quickstart_runs_as_written(cluster: Cluster, workdir: Path) -> None:
    script = _code_after((REPO / "README.md").read_text(), "## Quickstart for users")
    assert "#SBATCH --tf-image=tf-custom:2.0" in script
    write_script(
        workdir,
        "train.py",
        "import importlib.util, json, os\n"
        "tf = json.loads(os.environ['TF_CONFIG'])\n"
        "print(tf['task']['index'], len(tf['cluster']['worker']),"
        " importlib.util.find_spec('tensorflow') is not None)\n",
        cluster.user,
    )
    # Its output where the test reads it; every other line as the README has it.
    script = script.replace("#!/bin/bash\n", "#!/bin/bash\n#SBATCH -o out.txt\n", 1)
    r, out = cluster.sbatch(workdir, "train.sh", script, "out.txt", timeout=300)
    assert r.returncode == 0, r.stderr + out
    assert sorted(out.split("\n")[:-1]) == ["0 2 True", "1 2 True"], out


def test_the_user_guides_first_commands_run_as_written(cluster: Cluster, workdir: Path) -> None:
    block = _code_after((REPO / "docs" / "user.md").read_text(), "(`man tfimage-spank` on a")
    commands = [line[2:] for line in block.splitlines() if line.startswith("$ ")]
    assert len(commands) >= 4
    for command in commands:
        r = cluster.run(["bash", "-c", command], cwd=workdir, timeout=120)
        assert r.returncode == 0, f"{command}: {r.stderr}"
        assert not re.search(r"error|Traceback", r.stderr), f"{command}: {r.stderr}"

"""The Ansible role, as the local cluster was deployed with it (deploy/local/role.sh).

cluster.sh gave the cluster a site's own Prolog, Epilog and SPANK plugin before it
applied the role; these tests re-apply it, check that nothing of the site's was lost,
and run `tfimage doctor` inside each node.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, Cluster

ROLE = REPO / "deploy" / "local" / "role.sh"
RECAP = re.compile(r"^localhost\s+:\s+(.*)$", re.MULTILINE)


def _apply(*args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, int], float]:
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", str(ROLE), "apply", *args], capture_output=True, text=True, timeout=900
    )
    took = time.monotonic() - t0
    m = RECAP.search(r.stdout)
    counts = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))} if m else {}
    return r, counts, took


def test_check_diff_on_an_applied_machine_reports_nothing() -> None:
    r, counts, _ = _apply("--check", "--diff")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert counts.get("changed") == 0, r.stdout[-3000:]
    assert "--- before" not in r.stdout, r.stdout[-3000:]


def test_a_bad_variable_stops_the_play_with_the_spec_message() -> None:
    r, _, _ = _apply("--check", "-e", "tfimage_cache_max_bytes=lots")
    assert r.returncode != 0
    assert "Validation of arguments failed" in r.stdout
    assert "argument 'tfimage_cache_max_bytes' is of type str" in r.stdout
    r, _, _ = _apply("--check", "-e", "tfimage_runtime=docker")
    assert r.returncode != 0
    assert "tfimage_runtime" in r.stdout and "charliecloud" in r.stdout


def test_a_value_the_config_refuses_stops_the_play_and_changes_nothing(cluster: Cluster) -> None:
    """A value of the right type that tfimage refuses (the argument spec cannot say
    1-16): the config template's validation stops the play with tfimage's own
    one-line message, and the node keeps the config it had."""
    config = cluster.state / "etc" / "tfimage" / "config.yaml"
    before = config.read_bytes()
    assert b"pull_connections: 1\n" in before  # the role's default, rendered
    r, counts, _ = _apply("-e", '{"tfimage_pull_connections": 0}')
    assert r.returncode != 0 and counts.get("failed") == 1, r.stdout[-3000:]
    assert "'pull_connections' must be an integer from 1 to 16" in r.stdout
    assert config.read_bytes() == before


def test_site_prolog_epilog_and_plugin_survive(cluster: Cluster, workdir: Path) -> None:
    etc = cluster.state / "etc"
    conf = (etc / "slurm.conf").read_text()
    assert re.search(rf"^Prolog={re.escape(str(etc))}/prolog\.d/\*$", conf, re.M), conf
    assert re.search(rf"^Epilog={re.escape(str(etc))}/epilog\.d/\*$", conf, re.M), conf
    assert re.search(r"^PrologFlags=.*\bAlloc\b", conf, re.M), conf
    assert (etc / "prolog.d" / "99-site-prolog").resolve() == etc / "site-prolog"
    assert (etc / "epilog.d" / "99-site-epilog").resolve() == etc / "site-epilog"
    plugstack = (etc / "plugstack.conf").read_text()
    assert f"optional {cluster.state}/lib/site_hello.so" in plugstack
    assert plugstack.count("include ") == 1, plugstack  # Debian-style include kept, not doubled

    help_ = cluster.run(["srun", "--help"])
    assert "--site-hello" in help_.stdout and "--tf-image" in help_.stdout, help_.stderr

    r = cluster.run(
        [
            "srun",
            "-N2",
            "-n2",
            "--tf-image=tiny:1.0",
            "sh",
            "-c",
            'echo "$SLURM_JOB_ID $(cat /etc/tfimage-test-image)"',
        ],
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    lines = set(r.stdout.split("\n")) - {""}
    assert len(lines) == 1, r.stdout  # both tasks: one job, inside the image
    last, marker = lines.pop().split()
    assert marker == "tiny:1.0"  # tfimage's prolog and plugin did their part
    for node in ("n1", "n2"):
        log = cluster.state / "nodes" / node / "log"
        assert (
            log / f"site-prolog.{last}"
        ).read_text().strip() == f"site prolog ran for job {last}"
        for _ in range(100):  # the epilog runs as the job completes
            if (log / f"site-epilog.{last}").exists():
                break
            time.sleep(0.1)
        assert (log / f"site-epilog.{last}").exists(), sorted(p.name for p in log.iterdir())


@pytest.mark.parametrize("node", ["n1", "n2"])
def test_doctor_is_clean_on_each_node(cluster: Cluster, node: str) -> None:
    r = cluster.on_node(node, ["/opt/tfimage/bin/tfimage", "doctor", "--json"])
    report = json.loads(r.stdout)
    bad = [f for f in report["diagnoses"] if f["level"] not in ("ok", "info")]
    assert r.returncode == 0 and report["status"] == "ok", bad
    checks = {f["check"] for f in report["diagnoses"] if f["level"] == "ok"}
    assert {"config", "plugin", "hooks", "runtime", "registry", "cache"} <= checks, checks


def test_doctor_names_what_to_fix_when_the_prolog_is_gone(cluster: Cluster) -> None:
    # A copy of the node's slurm.conf without the role's hooks: what a site sees when
    # someone rewrote slurm.conf from an old template.
    etc = cluster.state / "etc"
    conf = cluster.state / "run" / "doctor-test-slurm.conf"  # seen by the nodes too
    text = (etc / "slurm.conf").read_text()
    text = re.sub(r"^(Prolog|Epilog|PrologFlags)=.*$", "", text, flags=re.M)
    conf.write_text(text + f"PlugStackConfig={etc}/plugstack.conf\n")
    try:
        r = cluster.on_node("n1", ["/opt/tfimage/bin/tfimage", "doctor", "--slurm-conf", str(conf)])
    finally:
        conf.unlink()
    assert r.returncode == 2, r.stdout
    assert "ERROR    hooks     Prolog= is not set in slurm.conf" in r.stdout
    assert "fix: set Prolog=" in r.stdout
    assert "PrologFlags lacks Alloc" in r.stdout


def test_a_login_node_gets_the_plugin_and_config_only(cluster: Cluster) -> None:
    # A scratch "login node" layout (under the state dir, which the nodes see too):
    # the same role with tfimage_node_type=login must leave slurm.conf alone and
    # make no cache, prolog or timer, yet give Slurm the plugin and the helper its config.
    scratch = cluster.state / "run" / "login-node"
    shutil.rmtree(scratch, ignore_errors=True)
    (scratch / "etc").mkdir(parents=True)
    site_conf = (cluster.state / "etc" / "slurm.conf").read_text()
    site_conf = re.sub(
        r"^PlugStackConfig=.*$",
        f"PlugStackConfig={scratch}/etc/plugstack.conf",
        site_conf,
        flags=re.M,
    )
    (scratch / "etc" / "slurm.conf").write_text(site_conf)
    try:
        r, counts, _ = _apply(
            "-e",
            "tfimage_node_type=login",
            "-e",
            f"tfimage_slurm_conf_dir={scratch}/etc",
            "-e",
            f"tfimage_config_dir={scratch}/etc/tfimage",
            "-e",
            f"tfimage_plugin_dir={scratch}/lib",
            "-e",
            f"tfimage_cache_dir={scratch}/cache",
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        assert counts.get("failed") == 0
        assert (scratch / "etc" / "slurm.conf").read_text() == site_conf  # untouched
        assert not (scratch / "etc" / "prolog.d").exists()
        assert not (scratch / "cache").exists()
        creds = scratch / "etc" / "tfimage" / "credentials.yaml"
        assert creds.stat().st_mode & 0o777 == 0o600 and creds.stat().st_uid == 0
        dropin = (scratch / "etc" / "plugstack.conf.d" / "tfimage.conf").read_text()
        assert f"required {scratch}/lib/spank_tfimage.so" in dropin
        # Login nodes pin at submit through the daemon; they prepare no steps.
        assert " pin_socket=/run/tfimage/pin.sock" in dropin and " daemon=" not in dropin
        doctor = cluster.on_node(
            "n1",
            [
                "/opt/tfimage/bin/tfimage",
                "--config",
                f"{scratch}/etc/tfimage/config.yaml",
                "doctor",
                "--login",
                "--slurm-conf",
                f"{scratch}/etc/slurm.conf",
                "--json",
            ],
        )
        report = json.loads(doctor.stdout)
        assert doctor.returncode == 0, report
        checks = {f["check"] for f in report["diagnoses"]}
        assert checks == {"config", "plugin", "daemon", "registry"}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_change_reconfigures_slurm_and_an_unchanged_run_changes_nothing(
    cluster: Cluster, workdir: Path
) -> None:
    """Drift repaired with Slurm reconfigured, then a second run that changes
    nothing, reconfigures nothing, and says a lot (-vvv) without the credentials."""
    hook = cluster.state / "etc" / "prolog.d" / "50-tfimage"
    hook.unlink()  # drift: someone removed tfimage's prolog
    on = '{"tfimage_slurm_reconfigure": true}'
    r, counts, _ = _apply("-e", on)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert counts["changed"] >= 1 and hook.exists()
    assert "RUNNING HANDLER [tfimage : Reconfigure Slurm]" in r.stdout
    r, counts, took = _apply("-e", on, "-vvv")
    print(f"role re-run: {took:.1f} s, {counts}")
    assert r.returncode == 0 and counts.get("failed") == 0, r.stdout[-3000:]
    assert counts.get("ok", 0) > 10, counts
    changed = [line for line in r.stdout.splitlines() if line.startswith("changed:")]
    assert counts.get("changed") == 0 and not changed, changed
    assert "RUNNING HANDLER" not in r.stdout
    password = (cluster.state / "pki" / "robot.password").read_text().strip()
    assert len(r.stdout) > 10000  # -vvv did say a lot
    assert password not in r.stdout and password not in r.stderr
    # Slurm took the reconfigure in its stride: the same daemons, jobs still run.
    for node in ("n1", "n2"):
        assert Path(f"/proc/{cluster.node_pid(node)}").exists()
    job = cluster.run(
        ["srun", "-N2", "--tf-image=tiny:1.0", "cat", "/etc/tfimage-test-image"], cwd=workdir
    )
    assert job.returncode == 0 and job.stdout.split() == ["tiny:1.0", "tiny:1.0"], job.stderr


def test_the_maintenance_entry_warms_then_prunes(cluster: Cluster) -> None:
    cron = Path(cluster.chroot or "/") / "etc" / "cron.d" / "tfimage"
    lines = [line for line in cron.read_text().splitlines() if not line.startswith("#")]
    job = next(line for line in lines if "cache warm" in line)
    assert job.index("cache warm") < job.index("cache prune"), job


def test_the_sites_prolog_runs_before_tfimages(cluster: Cluster, workdir: Path) -> None:
    log = cluster.state / "nodes" / "n1" / "log"
    seen = len(cluster.hooks_log("n1"))  # job ids restart with the cluster
    r = cluster.run(
        ["srun", "-N1", "-w", "n1", "--tf-image=tiny:1.0", "sh", "-c", "echo $SLURM_JOB_ID"],
        cwd=workdir,
    )
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    site_done = (log / f"site-prolog.{job}").stat().st_mtime
    ours = next(
        line for line in cluster.hooks_log("n1")[seen:] if f"tfimage-prolog: job {job}: " in line
    )
    stamp = time.mktime(time.strptime(ours[:19], "%Y-%m-%d %H:%M:%S")) + int(ours[20:23]) / 1000
    assert site_done <= stamp + 0.001, (site_done, ours)  # 99-site-prolog, then 50-tfimage

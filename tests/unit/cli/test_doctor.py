"""`tfimage doctor` against real files, the real plugin, srun and a real registry."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from support import Registry, need
from tfimage.agent.cli.doctor import Context, check_registry, exit_status, run_checks
from tfimage.agent.cli.main import main
from tfimage.agent.core.config import load_config

REPO = Path(__file__).resolve().parents[3]
PLUGIN = REPO / "spank" / "build" / "spank_tfimage.so"


def _node(
    tmp: Path,
    registry: Registry,
    *,
    flags: str = "Alloc",
    plugin: bool = True,
    prolog_timeout: int = 1200,
) -> Context:
    need("srun", "ch-run", "squashfuse")
    if plugin and not PLUGIN.exists():
        pytest.skip(f"{PLUGIN} is not built (make spank)")
    cfg = registry.write_site(tmp, runtime="charliecloud")
    (tmp / "cache").mkdir(mode=0o755)
    os.chmod(tmp / "cache", 0o755)  # noqa: S103 - what the role makes: readable, root-writable
    for kind in ("prolog", "epilog"):
        d = tmp / f"{kind}.d"
        d.mkdir()
        (d / "50-tfimage").write_text(f"#!/bin/sh\nexec /opt/tfimage/bin/tfimage-{kind}\n")
    (tmp / "plugstack.conf").write_text(f"include {tmp}/plugstack.conf.d/*.conf\n")
    (tmp / "plugstack.conf.d").mkdir()
    if plugin:
        (tmp / "plugstack.conf.d" / "tfimage.conf").write_text(
            f"required {PLUGIN} helper={shutil.which('true')} config={cfg}\n"
        )
    (tmp / "slurm.conf").write_text(
        "ClusterName=doctor\nSlurmctldHost=localhost\n"
        f"PlugStackConfig={tmp}/plugstack.conf\n"
        f"Prolog={tmp}/prolog.d/*\nEpilog={tmp}/epilog.d/*\n"
        + (f"PrologFlags={flags}\n" if flags else "")
        + f"PrologEpilogTimeout={prolog_timeout}\n"
        + "NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n"
    )
    (tmp / "fuse.conf").write_text("# site\nuser_allow_other\n")
    return Context(cfg, tmp / "slurm.conf", fuse_conf=tmp / "fuse.conf")


@pytest.mark.skipif(os.geteuid() != 0, reason="the cache must be root-owned: run as root")
def test_a_node_in_order_exits_0(tmp_path: Path, registry: Registry) -> None:
    diagnoses = run_checks(_node(tmp_path, registry))
    bad = [f for f in diagnoses if f.level not in ("ok", "info")]
    assert bad == [] and exit_status(diagnoses) == 0
    text = {f.message for f in diagnoses}
    assert f"{registry.host} reachable, credentials accepted" in text
    assert "srun --help lists --tf-image: Slurm loads the plugin" in text
    assert any(m.startswith("Prolog runs tfimage-prolog") for m in text)


@pytest.mark.skipif(os.geteuid() != 0, reason="the cache must be root-owned: run as root")
def test_each_fault_is_an_error_with_a_fix(tmp_path: Path, registry: Registry) -> None:
    ctx = _node(tmp_path, registry, flags="Contain", plugin=False, prolog_timeout=600)
    os.chmod(tmp_path / "cache", 0o777)  # noqa: S103 - the fault under test
    (tmp_path / "fuse.conf").write_text("#user_allow_other\n")
    creds = tmp_path / "credentials.yaml"
    creds.write_text(creds.read_text().replace(registry.password, "wrong-password"))
    (tmp_path / "epilog.d" / "50-tfimage").unlink()
    diagnoses = run_checks(ctx)
    errors = {(f.check, f.message) for f in diagnoses if f.level == "error"}
    assert exit_status(diagnoses) == 2
    assert ("hooks", "PrologFlags lacks Alloc: images are pulled too late") in errors
    assert any(
        c == "hooks" and m.startswith("hook_deadline (600 s) + 30 s of grace is not below")
        for c, m in errors
    )
    assert ("cache", f"{tmp_path / 'cache'} is writable by others (mode 0777)") in errors
    assert ("runtime", f"{tmp_path / 'fuse.conf'} lacks user_allow_other") in errors
    assert any(c == "plugin" and "no spank_tfimage.so line" in m for c, m in errors)
    assert any(c == "hooks" and m.startswith("no script of Epilog=") for c, m in errors)
    assert any(c == "registry" and "authentication refused" in m for c, m in errors)
    assert "wrong-password" not in repr(diagnoses)
    assert all(f.fix for f in diagnoses if f.level == "error")


@pytest.mark.skipif(os.geteuid() != 0, reason="a filesystem of its own needs root")
def test_a_nearly_full_cache_and_a_leftover_mount_process_are_named(
    tmp_path: Path, registry: Registry
) -> None:
    ctx = _node(tmp_path, registry, plugin=False)
    cache = tmp_path / "cache"
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(cache)], check=True
    )
    fake = tmp_path / "bin" / "squashfuse_ll"  # a real process by the default driver's name
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nsleep "$1"\n')
    fake.chmod(0o755)
    state = Path(load_config(ctx.config_path).state_dir)
    gone = state / "images" / ("sha256-" + "a" * 64)  # its mount point, unmounted
    # Its own process group: killing it must take its sleep too (a leftover sleep
    # fails the other host's leftover check).
    left = subprocess.Popen([str(fake), "300", str(gone)], start_new_session=True)
    for _ in range(100):  # until it has exec'd (its name is the program's)
        if Path(f"/proc/{left.pid}/comm").read_text().strip() == "squashfuse_ll":
            break
        time.sleep(0.02)
    try:
        (cache / "fill").write_bytes(b"\0" * (1000 << 10))
        diagnoses = {f.check: f for f in run_checks(ctx) if f.check in ("cache", "mounts")}
    finally:
        os.killpg(left.pid, signal.SIGKILL)
        left.wait()
        subprocess.run(["umount", str(cache)], check=True)
    assert diagnoses["cache"].level == "error" and "% full" in diagnoses["cache"].message
    assert diagnoses["mounts"].level == "warning"
    assert f"{left.pid} ({gone})" in diagnoses["mounts"].message


@pytest.mark.skipif(os.geteuid() != 0, reason="the cache must be root-owned: run as root")
def test_a_cache_owned_by_another_user_is_an_error(tmp_path: Path, registry: Registry) -> None:
    ctx = _node(tmp_path, registry, plugin=False)
    os.chown(tmp_path / "cache", 65534, 65534)
    cache = [f for f in run_checks(ctx) if f.check == "cache"]
    assert [(f.level, f.message) for f in cache] == [
        ("error", f"{tmp_path / 'cache'} is owned by uid 65534, not root")
    ]
    assert cache[0].fix == f"chown root {tmp_path / 'cache'}"


def test_no_nvml_on_a_node_with_gpu_devices_is_an_error(tmp_path: Path) -> None:
    """This machine has no libnvidia-ml.so.1: on a node without GPU device files that
    is nothing to fix, on one with them an error (docs/admin.md: doctor)."""
    import ctypes.util

    from tfimage.agent.cli.doctor import check_nvml

    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has libnvidia-ml: the not-found path cannot be reached")
    ctx = Context(tmp_path / "c.yaml", tmp_path / "slurm.conf", dev_dir=tmp_path / "dev")
    (tmp_path / "dev").mkdir()
    assert [f.level for f in check_nvml(ctx)] == ["info"]
    for n in ("nvidia0", "nvidia1", "nvidiactl"):
        (tmp_path / "dev" / n).touch()
    found = list(check_nvml(ctx))
    assert [f.level for f in found] == ["error"]
    assert "2 GPU device file(s)" in found[0].message and found[0].fix


def test_json_and_exit_code_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "--config",
            str(tmp_path / "missing.yaml"),
            "doctor",
            "--json",
            "--login",
            "--slurm-conf",
            str(tmp_path / "slurm.conf"),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 2 and report["status"] == "error"
    assert {f["check"] for f in report["diagnoses"]} == {
        "config",
        "plugin",
    }  # login: no node checks
    assert report["diagnoses"][0]["message"].endswith("missing.yaml: no such config file")


def test_a_missing_cache_is_a_warning(tmp_path: Path, registry: Registry) -> None:
    need("srun")
    cfg = registry.write_site(tmp_path)
    from tfimage.agent.cli.doctor import check_cache, check_config

    ctx = Context(cfg, tmp_path / "slurm.conf")
    list(check_config(ctx))
    found = list(check_cache(ctx))
    assert [f.level for f in found] == ["warning"] and "does not exist yet" in found[0].message
    assert exit_status(found) == 1


def test_a_configured_daemon_that_does_not_answer_is_a_warning(tmp_path: Path) -> None:
    from tfimage.agent.cli.doctor import _daemon_diagnosis

    f = _daemon_diagnosis(str(tmp_path / "daemon.sock"), "steps start Python")
    assert f.level == "warning" and "no tfimage daemon answers" in f.message and f.fix
    import socket

    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(str(tmp_path / "daemon.sock"))
        srv.listen(1)
        assert _daemon_diagnosis(str(tmp_path / "daemon.sock"), "steps start Python").level == "ok"


def _controller(tmp: Path, registry: Registry, *, prolog_slurmctld: str, timeout: int) -> Context:
    need("sbcast")
    cfg = registry.write_site(tmp, stage_dir=str(tmp / "stage"), stage_deadline="300")
    front = tmp / "tfimage-stage"
    front.write_text("#!/bin/sh\nexec /opt/tfimage/bin/tfimage-stage\n")
    (tmp / "slurm.conf").write_text(
        "ClusterName=doctor\nSlurmctldHost=localhost\n"
        + (f"PrologSlurmctld={prolog_slurmctld.format(front=front)}\n" if prolog_slurmctld else "")
        + f"PrologEpilogTimeout={timeout}\nNodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n"
    )
    return Context(cfg, tmp / "slurm.conf", controller=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="the staging cache must be root's: run as root")
def test_a_controller_in_order_exits_0(tmp_path: Path, registry: Registry) -> None:
    ctx = _controller(tmp_path, registry, prolog_slurmctld="{front}", timeout=1200)
    (tmp_path / "stage").mkdir(mode=0o700)
    found = run_checks(ctx)
    stage = [(d.level, d.message) for d in found if d.check == "stage"]
    assert [level for level, _ in stage] == ["ok"] * 4, stage
    assert stage[0][1] == f"PrologSlurmctld runs tfimage-stage ({tmp_path / 'tfimage-stage'})"
    assert stage[3][1].startswith("sbcast: slurm")
    assert {d.check for d in found} == {"config", "stage", "registry"}  # no node checks
    assert exit_status(found) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the staging cache must be root's: run as root")
def test_a_controller_missing_each_part_is_told_what_to_fix(
    tmp_path: Path, registry: Registry
) -> None:
    ctx = _controller(tmp_path, registry, prolog_slurmctld="", timeout=300)
    (tmp_path / "stage").mkdir(mode=0o755)
    found = [d for d in run_checks(ctx) if d.check == "stage"]
    by_level = {(d.level, d.message.split(":")[0]) for d in found}
    assert ("warning", "PrologSlurmctld=(unset) does not run tfimage-stage") in by_level
    assert any(
        d.level == "error" and "is not below PrologEpilogTimeout (300 s)" in d.message
        for d in found
    ), found
    assert any(
        d.level == "error" and d.message.startswith(f"{tmp_path / 'stage'} must be a directory")
        for d in found
    ), found
    assert exit_status(found) == 2


def test_a_rack_mirror_that_does_not_answer_is_a_warning_and_the_order_is_shown(
    tmp_path: Path, registry: Registry
) -> None:
    cfg = registry.write_site(tmp_path, runtime="charliecloud")
    me = socket.gethostname().split(".")[0]
    with cfg.open("a") as f:
        f.write(f'rack_mirrors: {{"{me}": ["127.0.0.1:1"]}}\nconnect_timeout: 1\n')
    ctx = Context(cfg, tmp_path / "slurm.conf", cfg=load_config(cfg))
    diagnoses = list(check_registry(ctx))
    said = {(f.level, f.message) for f in diagnoses}
    assert ("ok", f"node {me} (rack {me}) pulls from 127.0.0.1:1, then {registry.host}") in said
    assert ("ok", f"{registry.host} reachable, credentials accepted") in said
    warned = [f for f in diagnoses if f.level == "warning"]
    assert len(warned) == 1 and warned[0].message.startswith("rack mirror: 127.0.0.1:1")
    assert not [f for f in diagnoses if f.level == "error"]

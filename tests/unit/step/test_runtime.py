from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tfimage.agent.core.config import config_from_mapping
from tfimage.agent.step.runtime import Apptainer, Bind, Charliecloud, StepSpec, runtime_for

SPEC = StepSpec(
    workdir="/home/u/proj",
    home="/home/u",
    binds=(Bind("/var/spool/slurmd/job00042", "/var/spool/slurmd/job00042", read_only=True),),
)


def test_charliecloud_argv_binds_home_workdir_and_script_dir() -> None:
    argv = Charliecloud("/usr/bin/ch-run").prefix(Path("/run/tfimage/jobs/42/step-0/root"), SPEC)
    assert argv == [
        "/usr/bin/ch-run",
        "--no-passwd",
        "-b",
        "/home/u:/home/u",
        "-b",
        "/home/u/proj:/home/u/proj",
        "-b",
        "/var/spool/slurmd/job00042:/var/spool/slurmd/job00042",
        "-c",
        "/home/u/proj",
        "/run/tfimage/jobs/42/step-0/root",
        "--",
    ]


def test_charliecloud_mountpoints_cover_every_bind() -> None:
    assert SPEC.mountpoints() == ["/home/u", "/home/u/proj", "/var/spool/slurmd/job00042"]


def test_root_workdir_is_not_bound() -> None:
    spec = StepSpec(workdir="/", home=None)
    assert Charliecloud("/x/ch-run").prefix(Path("/r"), spec) == [
        "/x/ch-run",
        "--no-passwd",
        "-c",
        "/",
        "/r",
        "--",
    ]


def test_apptainer_argv_no_cleanenv_nv_only_with_gpus() -> None:
    a = Apptainer("apptainer", "/usr/bin/apptainer")
    argv = a.prefix(Path("/c/img.sif"), SPEC)
    assert argv == [
        "/usr/bin/apptainer",
        "exec",
        "-B",
        "/var/spool/slurmd/job00042:/var/spool/slurmd/job00042:ro",
        "--pwd",
        "/home/u/proj",
        "/c/img.sif",
    ]
    assert "--cleanenv" not in argv and "-e" not in argv
    gpu = StepSpec(workdir=None, home=None, gpus=True)
    assert a.prefix(Path("/c/img.sif"), gpu) == ["/usr/bin/apptainer", "exec", "--nv", "/c/img.sif"]


def test_apptainer_asks_nvidia_container_cli_for_the_gpus_where_the_site_says_so() -> None:
    nvccli = config_from_mapping({"gpu": {"nvccli": True}}).gpu.nvccli
    a = runtime_for("apptainer", "/usr/bin/apptainer", nvccli=nvccli)
    gpu = StepSpec(workdir=None, home=None, gpus=True)
    assert a.prefix(Path("/c/i.sif"), gpu) == [
        "/usr/bin/apptainer",
        "exec",
        "--nv",
        "--nvccli",
        "/c/i.sif",
    ]
    assert "--nvccli" not in a.prefix(Path("/c/i.sif"), StepSpec(workdir=None, home=None))


def test_apptainer_runs_a_real_sif_where_installed(
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    exe = shutil.which("apptainer") or shutil.which("singularity")
    if not exe:
        pytest.skip(
            "apptainer/singularity is not installed here (not packaged for Debian 12/13);"
            " the charliecloud runtime is what the cluster tier runs"
        )
    sif = make_sif({"etc/tfimage-test-image": "apptainer-test\n"})
    argv = Apptainer(Path(exe).name, exe).prefix(sif, StepSpec(workdir=None, home=None))
    r = subprocess.run(
        [*argv, "cat", "/etc/tfimage-test-image"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TF_CONFIG": "{}"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "apptainer-test"


def test_charliecloud_applies_the_image_environment_when_it_has_one(tmp_path: Path) -> None:
    spec = StepSpec(workdir=None, home=None)
    assert "--set-env" not in Charliecloud("/x/ch-run").prefix(tmp_path, spec)
    (tmp_path / "ch").mkdir()
    (tmp_path / "ch" / "environment").write_text("FOO=bar\n")
    argv = Charliecloud("/x/ch-run").prefix(tmp_path, spec)
    assert argv[:4] == ["/x/ch-run", "--no-passwd", "--env-no-expand", "--set-env"]
    (tmp_path / "ch" / "environment").unlink()
    (tmp_path / "ch" / "environment").symlink_to("/etc/hostname")
    assert "--set-env" not in Charliecloud("/x/ch-run").prefix(tmp_path, spec)

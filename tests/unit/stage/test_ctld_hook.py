"""PrologSlurmctld's program (prolog/stage.py) as slurmctld runs it: which of its two
jobs it does (record_digest, stage, the admin's stage.off), and that neither can
hold a job.  scontrol is a stand-in program in the config's slurm_bin that logs its
argv (the cluster tier runs the real one, and reads the comment back with sacct)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from support import hook_site
from tfimage.agent.core import wire
from tfimage.prolog.stage import main

PINNED = "r.invalid/library/tiny:1.0@sha256:" + "1" * 64
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="slurmctld's hook stages as root")


def _scontrol(tmp_path: Path, exit_code: int = 0) -> Path:
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    tool = bin_dir / "scontrol"
    tool.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$*" >>{tmp_path}/scontrol.argv\n'
        f'[ "$1" = show ] && printf "JobId=7\\n   AdminComment=site note \\n   Comment=x\\n"\n'
        f"exit {exit_code}\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def _hook(tmp_path: Path, *, nodes: str = "n[1-2]", image: str = PINNED, **cfg: object) -> str:
    config = hook_site(tmp_path, gpu={"slurm_bin": str(tmp_path / "slurm-bin")}, **cfg)
    argv = [f"--config={config}", "--job=7", f"--image={image}", f"--nodes={nodes}",
            "--uid=4321", "--gid=4321", "--partition=debug"]  # fmt: skip
    assert main(argv) == 0
    log = tmp_path / "hooks.log"
    return log.read_text() if log.exists() else ""


def test_the_pinned_image_goes_into_the_admin_comment_after_the_sites_note(
    tmp_path: Path,
) -> None:
    _scontrol(tmp_path)
    log = _hook(tmp_path, nodes="n1")
    calls = (tmp_path / "scontrol.argv").read_text().splitlines()
    assert calls == ["show job 7", f"update JobId=7 AdminComment=site note tfimage={PINNED}"]
    assert f"job 7: AdminComment: tfimage={PINNED}" in log


def test_a_failing_scontrol_is_one_line_and_the_job_goes_on(tmp_path: Path) -> None:
    _scontrol(tmp_path, exit_code=1)
    log = _hook(tmp_path, nodes="n1")
    lines = [line for line in log.splitlines() if "AdminComment" in line]
    assert len(lines) == 1 and "the job runs without it" in lines[0], log


def test_a_tag_no_registry_answers_for_is_one_line_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    _scontrol(tmp_path)
    log = _hook(tmp_path, nodes="n1", image="tiny:1.0")
    assert not (tmp_path / "scontrol.argv").exists()
    assert "job 7: AdminComment: " in log and "the job runs without it" in log, log


def test_record_digest_false_leaves_the_comment_alone(tmp_path: Path) -> None:
    _scontrol(tmp_path)
    _hook(tmp_path, nodes="n1", record_digest=False)
    assert not (tmp_path / "scontrol.argv").exists()


def test_staging_happens_only_where_the_config_says_and_stage_off_is_absent(
    tmp_path: Path,
) -> None:
    _scontrol(tmp_path)
    assert "stage:" not in _hook(tmp_path, image="tiny:1.0", record_digest=False)
    on = _hook(tmp_path, image="tiny:1.0", record_digest=False, stage=True)
    assert "job 7: stage: not pinned at submit" in on
    (tmp_path / "hooks.log").unlink()
    (tmp_path / wire.STAGE_OFF_SWITCH).write_text("the controller's disk is replaced\n")
    assert "stage:" not in _hook(tmp_path, image="tiny:1.0", record_digest=False, stage=True)


def test_a_one_node_job_is_not_staged_and_says_nothing_about_it(tmp_path: Path) -> None:
    _scontrol(tmp_path)
    assert "stage:" not in _hook(tmp_path, nodes="n1", record_digest=False, stage=True)

"""The batch step's stand-ins for Slurm's commands: what goes into the skeleton, and
what an image's own tree (walked as root, never through its links) keeps it from."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tfimage.agent.step import slurmstubs


def test_an_image_without_slurm_gets_every_command_saying_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "usr/local/bin").mkdir(parents=True)
    got = slurmstubs.stubs(tmp_path)
    assert sorted(got) == sorted(f"/usr/local/bin/{n}" for n in slurmstubs.COMMANDS)
    stub = tmp_path / "srun"
    stub.write_text(got["/usr/local/bin/srun"])
    stub.chmod(0o755)
    r = subprocess.run(
        [str(stub), "python", "train.py"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 127 and r.stdout == ""
    assert r.stderr.startswith("tfimage: srun: this batch script runs inside the image")
    assert "--tf-batch=host" in r.stderr and r.stderr.count("\n") == 1


def test_an_images_own_command_is_kept(tmp_path: Path) -> None:
    (tmp_path / "usr/local/bin").mkdir(parents=True)
    (tmp_path / "usr/local/bin/srun").write_text("#!/bin/sh\n")
    (tmp_path / "usr/local/bin/sbatch").symlink_to("/nonexistent")  # a link counts too
    got = slurmstubs.stubs(tmp_path)
    assert "/usr/local/bin/srun" not in got and "/usr/local/bin/sbatch" not in got
    assert "/usr/local/bin/scontrol" in got


def test_a_linked_usr_local_gets_none_and_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "bin").mkdir(parents=True)
    image = tmp_path / "image"
    (image / "usr").mkdir(parents=True)
    (image / "usr/local").symlink_to(outside)
    assert slurmstubs.stubs(image) == {}


def test_a_command_anywhere_on_the_images_path_is_kept(tmp_path: Path) -> None:
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/srun").write_text("#!/bin/sh\n")  # an image with Slurm's client
    (tmp_path / "bin").symlink_to("usr/bin")  # merged /usr: a link, not followed
    got = slurmstubs.stubs(tmp_path)
    assert "/usr/local/bin/srun" not in got and "/usr/local/bin/sbatch" in got


def test_an_image_without_usr_local_gets_them_all(tmp_path: Path) -> None:
    (tmp_path / "usr").mkdir()
    assert len(slurmstubs.stubs(tmp_path)) == len(slurmstubs.COMMANDS)

"""``tfimage partition-check`` (cli/partitioncheck.py): the partition policy at submit,
as the role's cli_filter.lua calls it.  Slurm's default partition comes from a
stand-in scontrol in the config's slurm_bin (the cluster tier runs the real one,
through srun and sbatch)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from support import hook_site
from tfimage.agent.cli.partitioncheck import check, partitions
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import InputError, PolicyError

DIGEST = "sha256:" + "1" * 64
RULES = {
    "prod": {"repositories": ["library/*"], "require_digest": True, "allow_conversion": False},
    "dev": {},
}


def _site(tmp_path: Path, default: str = "debug", **extra: object) -> Path:
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "scontrol"
    tool.write_text(
        "#!/bin/sh\n"
        f"echo called >>{tmp_path}/scontrol.calls\n"
        "echo 'PartitionName=prod AllowGroups=ALL Default=NO MaxTime=UNLIMITED'\n"
        f"echo 'PartitionName={default} AllowGroups=ALL Default=YES MaxTime=UNLIMITED'\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return hook_site(tmp_path, registry="r.example", gpu={"slurm_bin": str(bin_dir)}, **extra)


@pytest.mark.parametrize("text", ["prod", "prod,dev", "gpu-a100", "p.1_x"])
def test_partition_lists_as_slurm_takes_them_are_read(text: str) -> None:
    assert partitions(text) == text.split(",")


@pytest.mark.parametrize("text", ["bad name", "prod;dev", "$(id)", "x" * 65, ",".join(["p"] * 17)])
def test_what_is_not_a_partition_list_is_one_input_error(text: str) -> None:
    with pytest.raises(InputError, match="is not a list of partition names"):
        partitions(text)


def test_prod_refuses_a_tag_and_dev_takes_it(tmp_path: Path) -> None:
    cfg = load_config(_site(tmp_path, partitions=RULES))
    with pytest.raises(PolicyError, match="partition prod requires a digest"):
        check(cfg, "tiny:1.0", "prod")
    assert check(cfg, "tiny:1.0", "dev") == ["dev"]
    assert check(cfg, f"tiny:1.0@{DIGEST}", "prod") == ["prod"]


def test_a_job_that_may_land_in_either_is_refused_when_either_refuses(tmp_path: Path) -> None:
    cfg = load_config(_site(tmp_path, partitions=RULES))
    with pytest.raises(PolicyError, match="partition prod"):
        check(cfg, "tiny:1.0", "dev,prod")


def test_no_partition_means_slurms_default_one(tmp_path: Path) -> None:
    cfg = load_config(_site(tmp_path, default="prod", partitions=RULES))
    with pytest.raises(PolicyError, match="partition prod requires a digest"):
        check(cfg, "tiny:1.0", "")


def test_without_partition_rules_nothing_is_asked_of_slurm(tmp_path: Path) -> None:
    cfg = load_config(_site(tmp_path))
    assert check(cfg, "tiny:1.0", "") == []
    assert not (tmp_path / "scontrol.calls").exists()


def test_a_repository_outside_prods_projects_and_a_docker_name_are_refused(
    tmp_path: Path,
) -> None:
    cfg = load_config(_site(tmp_path, partitions=RULES))
    with pytest.raises(PolicyError, match="runs images of library/\\* only, not team-b/x"):
        check(cfg, f"team-b/x:1@{DIGEST}", "prod")
    with pytest.raises(PolicyError, match="runs SIF images only"):
        check(cfg, f"docker://ubuntu:22.04@{DIGEST}", "prod")


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tfimage.main", f"--config={config}", "partition-check", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_refusal_is_one_tfimage_line_and_exit_2(tmp_path: Path) -> None:
    config = _site(tmp_path, partitions=RULES)
    r = _cli(config, "--partition=prod", "--", "tiny:1.0")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.splitlines() == [
        "tfimage: partition-check: partition prod requires a digest: --tf-image=tiny:1.0"
        "@sha256:... (`tfimage resolve NAME` prints it; or use a partition that takes tags)"
    ]
    ok = _cli(config, "--partition=dev", "--json", "--", "tiny:1.0")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"image": "tiny:1.0", "allowed": True, "partitions": ["dev"]}


@pytest.mark.parametrize("image", ["Bad Ref", "tiny@sha256:xyz", "evil.example/x/y:1", "./tf.sif"])
def test_a_reference_the_plugin_refuses_passes_here_for_the_plugin_to_say_why(
    tmp_path: Path, image: str
) -> None:
    cfg = load_config(_site(tmp_path, partitions=RULES))
    assert check(cfg, image, "prod") == []


def test_a_partition_without_a_rule_is_not_checked(tmp_path: Path) -> None:
    cfg = load_config(_site(tmp_path, partitions=RULES))
    assert check(cfg, "tiny:1.0", "debug") == []

"""The role's Prolog, Epilog and PrologSlurmctld scripts send each hook exactly the wire's flags
(``wire.HOOK_FLAGS``), in its order, each from the Slurm variables the table names:
the scripts are rendered from the role's templates and run by ``sh`` against a
stand-in ``tfimage-hook`` that prints what it was given, and what they send is what
the hook would read by itself, run directly as Slurm's Prolog or Epilog."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tfimage.agent.core import wire
from tfimage.agent.hooks.args import hook_parser

ROLE = Path(__file__).resolve().parents[3] / "deploy/ansible/roles/tfimage"
TEMPLATE = {
    "tfimage-prolog": "prolog.j2",
    "tfimage-epilog": "epilog.j2",
    wire.STAGE_HOOK: "stage.j2",
}
# The stage hook's front starts nothing for a job on one node.
MULTI_NODE = {"SLURM_JOB_NUM_NODES": "2"}


def _script(
    tmp_path: Path,
    prog: str,
    chained: str = "",
    config_dir: str = "/etc/tfimage",
    partitions: dict[str, object] | None = None,
) -> Path:
    jinja2 = pytest.importorskip("jinja2", reason="jinja2 comes with ansible-core (make lint)")
    pytest.importorskip("ansible", reason="the role's bool filter is ansible-core's (make venv)")
    defaults = yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    from ansible.module_utils.parsing.convert_bool import boolean

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROLE / "templates"))
    env.filters["bool"] = boolean  # Ansible's own, as the role renders them
    text = env.get_template(TEMPLATE[prog]).render(
        {
            **defaults,
            "ansible_managed": "Ansible managed",
            "tfimage_daemon": True,
            "tfimage_plugin_dir": str(tmp_path),
            "tfimage_prefix": "/opt/tfimage",
            "tfimage_config_dir": config_dir,
            "tfimage_state_dir": "/run/tfimage",
            "tfimage_stage_chained": chained,
            "tfimage_partitions": partitions or {},
        }
    )
    hook = tmp_path / "tfimage-hook"
    hook.write_text('#!/bin/sh\nfor a; do printf "%s\\0" "$a"; done\n')
    hook.chmod(0o755)
    script = tmp_path / TEMPLATE[prog].removesuffix(".j2")
    script.write_text(text)
    return script


def _sent(script: Path, environ: dict[str, str]) -> list[str]:
    out = subprocess.run(
        ["sh", str(script)],
        env={"PATH": os.environ["PATH"], **MULTI_NODE, **environ},
        capture_output=True,
        check=True,
        timeout=30,
    ).stdout
    argv = out.decode().split("\0")[:-1]
    # tfimage-hook SOCKET DEADLINE PROGRAM ARGS...
    assert Path(argv[2]).name in wire.HOOKS, argv
    return argv[3:]


@pytest.mark.parametrize("prog", wire.HOOKS)
def test_the_roles_script_sends_the_wires_flags_in_order(tmp_path: Path, prog: str) -> None:
    args = _sent(_script(tmp_path, prog), {wire.PROLOG_IMAGE_VAR: "tiny:1.0"})
    names = [a.partition("=")[0] for a in args]
    assert names == ["--config", *(f.name for f in wire.HOOK_FLAGS[prog])], args
    assert all("=" in a for a in args), args  # a job's value never becomes a flag


@pytest.mark.parametrize("prog", wire.HOOKS)
def test_each_flag_comes_from_every_variable_the_wire_names_for_it(
    tmp_path: Path, prog: str
) -> None:
    """One variable at a time (the last of each fallback chain too: the epilog's
    ``--gpus`` once lacked ``CUDA_VISIBLE_DEVICES``), and what the script sends is
    what the hook would read from the same environment by itself."""
    script = _script(tmp_path, prog)
    for flag in wire.HOOK_FLAGS[prog]:
        for var in flag.env:
            environ = {wire.PROLOG_IMAGE_VAR: "tiny:1.0", var: f"-value-of-{var}"}
            sent = vars(hook_parser(prog, None, {}).parse_args(_sent(script, environ)))
            direct = vars(hook_parser(prog, None, environ).parse_args([]))
            assert sent[flag.dest] == f"-value-of-{var}", (flag, var)
            assert {k: v for k, v in sent.items() if k != "config"} == {
                k: v for k, v in direct.items() if k != "config"
            }, (flag, var)


def test_a_hook_run_directly_takes_the_first_variable_that_is_set() -> None:
    gpus = next(f for f in wire.HOOK_FLAGS["tfimage-epilog"] if f.name == "--gpus")
    assert wire.hook_default(gpus, {"CUDA_VISIBLE_DEVICES": "0,1"}) == "0,1"
    assert wire.hook_default(gpus, {"SLURM_JOB_GPUS": "2", "CUDA_VISIBLE_DEVICES": "0"}) == "2"
    assert wire.hook_default(gpus, {"SLURM_JOB_GPUS": "", "CUDA_VISIBLE_DEVICES": "3"}) == "3"
    assert wire.hook_default(gpus, {}) == ""


# The wire's table spelled out by hand from Slurm's prolog and epilog environment
# (slurm.conf(5), "Prolog and Epilog Scripts"), not computed from it: the tests above
# take the table as given, so a flag read from the wrong variable would pass them.
# --uid is slurmd's SLURM_JOB_UID and never anything a job can set.
SLURMS_OWN = {
    "tfimage-prolog": [
        ("--job", "SLURM_JOB_ID"),
        ("--image", "SPANK_TFIMAGE_IMAGE"),
        ("--node", "SLURMD_NODENAME"),
        ("--gpus", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"),
        ("--mps", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        ("--uid", "SLURM_JOB_UID"),
        ("--asked", "SPANK__SLURM_SPANK_OPTION_tfimage_tf_image"),
        ("--partition", "SLURM_JOB_PARTITION"),
        # 23.02.6 added SLURM_JOB_NODELIST to the prolog's; 22.05 has SLURM_NODELIST.
        ("--nodes", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    ],
    "tfimage-epilog": [
        ("--job", "SLURM_JOB_ID"),
        ("--image", "SPANK_TFIMAGE_IMAGE"),
        ("--asked", "SPANK__SLURM_SPANK_OPTION_tfimage_tf_image"),
        ("--node", "SLURMD_NODENAME"),
        ("--user", "SLURM_JOB_USER"),
        ("--uid", "SLURM_JOB_UID"),
        ("--account", "SLURM_JOB_ACCOUNT"),
        ("--partition", "SLURM_JOB_PARTITION"),
        ("--array-job", "SLURM_ARRAY_JOB_ID"),
        ("--array-task", "SLURM_ARRAY_TASK_ID"),
        ("--exit", "SLURM_JOB_EXIT_CODE2"),
        ("--exit-raw", "SLURM_JOB_EXIT_CODE"),
        ("--gpus", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"),
        ("--mps", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
    ],
    # slurmctld's PrologSlurmctld environment (slurm.conf(5)): the job's node list and
    # owner, and its SPANK_ control variables.
    wire.STAGE_HOOK: [
        ("--job", "SLURM_JOB_ID"),
        ("--image", "SPANK_TFIMAGE_IMAGE"),
        ("--nodes", "SLURM_JOB_NODELIST"),
        ("--uid", "SLURM_JOB_UID"),
        ("--gid", "SLURM_JOB_GID"),
        ("--asked", "SPANK__SLURM_SPANK_OPTION_tfimage_tf_image"),
        ("--partition", "SLURM_JOB_PARTITION"),
    ],
}


@pytest.mark.parametrize("prog", wire.HOOKS)
def test_the_wires_hook_table_reads_the_variables_slurm_itself_sets(prog: str) -> None:
    table = [(f.name, *f.env) for f in wire.HOOK_FLAGS[prog]]
    assert table == SLURMS_OWN[prog]


@pytest.mark.parametrize("prog", wire.HOOKS)
def test_a_script_given_slurms_variables_sends_each_value_under_its_flag(
    tmp_path: Path, prog: str
) -> None:
    """Every variable set at once, each to a value of its own: each flag carries the
    value of the first variable SLURMS_OWN names for it."""
    environ = {var: f"v-{var}" for row in SLURMS_OWN[prog] for var in row[1:]}
    sent = dict(a.split("=", 1) for a in _sent(_script(tmp_path, prog), environ)[1:])
    assert sent == {row[0]: f"v-{row[1]}" for row in SLURMS_OWN[prog]}


def _run(script: Path, environ: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["sh", str(script)],
        env={"PATH": os.environ["PATH"], **environ},
        capture_output=True,
        timeout=30,
        check=False,
    )


def test_the_stage_front_starts_nothing_for_a_job_without_an_image(tmp_path: Path) -> None:
    done = _run(_script(tmp_path, wire.STAGE_HOOK), {"SLURM_JOB_NUM_NODES": "4"})
    assert (done.returncode, done.stdout) == (0, b"")


@pytest.mark.parametrize("count", ["1", "3", "", "2x"])
def test_the_stage_front_asks_the_hook_for_every_image_job_whatever_its_node_count(
    tmp_path: Path, count: str
) -> None:
    """A one-node job's digest goes into its AdminComment too; whether to stage (and
    the admin's stage.off) is the hook's to judge (prolog/stage.py)."""
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    (config_dir / wire.STAGE_OFF_SWITCH).write_text("off while the controller's disk is replaced\n")
    script = _script(tmp_path, wire.STAGE_HOOK, config_dir=str(config_dir))
    done = _run(
        script, {wire.PROLOG_IMAGE_VAR: "tiny@sha256:" + "1" * 64, "SLURM_JOB_NUM_NODES": count}
    )
    assert done.returncode == 0 and done.stdout.split(b"\0")[2].endswith(b"tfimage-stage")


def test_the_stage_front_exits_0_whatever_the_hook_does(tmp_path: Path) -> None:
    script = _script(tmp_path, wire.STAGE_HOOK)
    (tmp_path / "tfimage-hook").write_text("#!/bin/sh\nexit 70\n")
    done = _run(script, {wire.PROLOG_IMAGE_VAR: "tiny:1.0", "SLURM_JOB_NUM_NODES": "3"})
    assert done.returncode == 0


def test_a_chained_site_program_runs_first_and_its_failure_is_kept(tmp_path: Path) -> None:
    """Slurm 22.05 runs one PrologSlurmctld: the site's own, chained, still decides."""
    site = tmp_path / "site-ctld-prolog"
    site.write_text(f"#!/bin/sh\necho ran >{tmp_path}/site-ran\nexit ${{SITE_EXIT:-0}}\n")
    site.chmod(0o755)
    script = _script(tmp_path, wire.STAGE_HOOK, chained=str(site))
    env = {wire.PROLOG_IMAGE_VAR: "tiny:1.0", "SLURM_JOB_NUM_NODES": "3"}
    ok = _run(script, env)
    assert ok.returncode == 0 and (tmp_path / "site-ran").exists()
    assert ok.stdout.split(b"\0")[2].endswith(b"tfimage-stage")  # then tfimage's
    failed = _run(script, {**env, "SITE_EXIT": "3"})
    assert (failed.returncode, failed.stdout) == (3, b"")


@pytest.mark.parametrize(
    ("environ", "asked"),
    [
        ({"SLURM_JOB_PARTITION": "train"}, True),
        ({"SLURM_JOB_PARTITION": "train-big"}, True),
        ({"SLURM_JOB_PARTITION": "dev"}, False),
        ({}, False),
        ({"SLURM_JOB_PARTITION": "dev", wire.PROLOG_IMAGE_VAR: "tiny:1.0"}, True),
    ],
    ids=["default", "default-by-glob", "no-default", "no-partition", "image-anyway"],
)
def test_the_prolog_runs_for_a_job_without_an_image_where_its_partition_has_a_default(
    tmp_path: Path, environ: dict[str, str], asked: bool
) -> None:
    rules = {"train": {"default_image": "tiny:1.0"}, "train-*": {"default_image": "x:1"}, "dev": {}}
    env = {"SLURM_JOB_GPUS": "", **environ}
    done = _run(_script(tmp_path, "tfimage-prolog", partitions=rules), env)
    assert done.returncode == 0, done.stderr
    assert bool(done.stdout) == asked, done.stdout

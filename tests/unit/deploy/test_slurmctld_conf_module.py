"""The role's PrologSlurmctld editor (library/tfimage_slurmctld_conf.py): on Slurm
24.11 tfimage's line joins the site's; on 22.05, which runs one program, the site's
is chained (tfimage's front runs it first); off, everything is put back; a second
pass changes nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

MODULE = (
    Path(__file__).resolve().parents[3]
    / "deploy/ansible/roles/tfimage/library/tfimage_slurmctld_conf.py"
)
OURS = "/usr/local/lib/tfimage/tfimage-stage"


@pytest.fixture(scope="module")
def mod() -> ModuleType:
    pytest.importorskip(
        "ansible", reason="ansible-core is not in this venv (make lint installs it)"
    )
    spec = importlib.util.spec_from_file_location("tfimage_slurmctld_conf", MODULE)
    assert spec and spec.loader
    m = importlib.util.module_from_spec(spec)
    sys.modules["tfimage_slurmctld_conf"] = m
    spec.loader.exec_module(m)
    return m


@pytest.mark.parametrize("several", [False, True])
def test_without_a_site_program_tfimages_line_is_added(mod: ModuleType, several: bool) -> None:
    text, chained = mod.plan("ClusterName=x\n", OURS, several)
    assert (text, chained) == (f"ClusterName=x\nPrologSlurmctld={OURS}\n", None)


def test_on_24_11_the_sites_line_stays_and_ours_joins_it(mod: ModuleType) -> None:
    before = "PrologSlurmctld=/site/ctld-prolog\n"
    text, chained = mod.plan(before, OURS, True)
    assert (text, chained) == (f"{before}PrologSlurmctld={OURS}\n", None)


def test_on_22_05_the_sites_program_is_chained_and_runs_first(mod: ModuleType) -> None:
    before = "SlurmUser=slurm\nPrologSlurmctld=/site/ctld-prolog  # audit\n"
    text, chained = mod.plan(before, OURS, False)
    assert chained == "/site/ctld-prolog"
    assert text == (
        "SlurmUser=slurm\n"
        f"#PrologSlurmctld=/site/ctld-prolog  # audit  # tfimage: chained from {OURS}\n"
        f"PrologSlurmctld={OURS}\n"
    )
    again, still = mod.plan(text, OURS, False)  # a second pass: the same, and still chained
    assert (again, still) == (text, "/site/ctld-prolog")


@pytest.mark.parametrize("several", [False, True])
@pytest.mark.parametrize("before", ["", "PrologSlurmctld=/site/p\n", "prologslurmctld=/a # c\n"])
def test_off_puts_back_what_the_site_had(mod: ModuleType, before: str, several: bool) -> None:
    on, _ = mod.plan(before, OURS, several)
    assert mod.plan(on, OURS, several)[0] == on
    off, chained = mod.plan(on, "", several)
    assert chained is None
    assert off.splitlines() == before.splitlines()

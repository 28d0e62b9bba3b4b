"""The role's slurm.conf editor (deploy/ansible/.../library/tfimage_slurm_conf.py):
the site's hooks keep running, and a second pass changes nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

MODULE = (
    Path(__file__).resolve().parents[3]
    / "deploy/ansible/roles/tfimage/library/tfimage_slurm_conf.py"
)


@pytest.fixture(scope="module")
def mod() -> ModuleType:
    pytest.importorskip(
        "ansible", reason="ansible-core is not in this venv (make lint installs it)"
    )
    spec = importlib.util.spec_from_file_location("tfimage_slurm_conf", MODULE)
    assert spec and spec.loader
    m = importlib.util.module_from_spec(spec)
    sys.modules["tfimage_slurm_conf"] = m
    spec.loader.exec_module(m)
    return m


def test_unset_hooks_become_globs(mod: ModuleType) -> None:
    text, extra = mod.plan(
        "ClusterName=x\n", "/etc/slurm/prolog.d", "/etc/slurm/epilog.d", ["Alloc"]
    )
    assert text == (
        "ClusterName=x\nProlog=/etc/slurm/prolog.d/*\nEpilog=/etc/slurm/epilog.d/*\nPrologFlags=Alloc\n"
    )
    assert extra["links"] == {}
    assert extra["dirs"] == {"Prolog": "/etc/slurm/prolog.d", "Epilog": "/etc/slurm/epilog.d"}


def test_a_site_program_keeps_running_first(mod: ModuleType) -> None:
    before = "Prolog=/usr/local/sbin/site-prolog  # cleans /tmp\nprologflags=Contain,X11\n"
    text, extra = mod.plan(before, "/p.d", "/e.d", ["Alloc"])
    assert "#Prolog=/usr/local/sbin/site-prolog  # cleans /tmp  # tfimage: moved" in text
    assert "\nProlog=/p.d/*\n" in text
    assert extra["links"] == {"/p.d/99-site-prolog": "/usr/local/sbin/site-prolog"}
    assert "PrologFlags=Contain,X11,Alloc\n" in text  # the site's flags kept, in order


def test_a_site_glob_is_kept_and_used(mod: ModuleType) -> None:
    before = "Prolog=/etc/site/prolog.d/*.sh\nEpilog=/etc/site/epilog.d/*\nPrologFlags=alloc\n"
    text, extra = mod.plan(before, "/p.d", "/e.d", ["Alloc"])
    assert text == before
    assert extra["dirs"] == {"Prolog": "/etc/site/prolog.d", "Epilog": "/etc/site/epilog.d"}


def test_the_last_setting_is_the_one_changed(mod: ModuleType) -> None:
    before = "Prolog=/old\nNodeName=n1\nProlog=/newer\n"
    text, extra = mod.plan(before, "/p.d", "/e.d", ["Alloc"])
    assert text.startswith("Prolog=/old\nNodeName=n1\n#Prolog=/newer")
    assert extra["links"] == {"/p.d/99-site-prolog": "/newer"}


@pytest.mark.parametrize(
    "before",
    ["", "Prolog=/x\nEpilog=/y\n", "PrologFlags=Contain\nEpilog=/e/*\n", "prolog=/a # c\n"],
)
def test_a_second_pass_changes_nothing(mod: ModuleType, before: str) -> None:
    once, _ = mod.plan(before, "/p.d", "/e.d", ["Alloc"])
    twice, extra = mod.plan(once, "/p.d", "/e.d", ["Alloc"])
    assert twice == once
    assert extra["links"] == {}


def test_an_older_link_that_ran_after_tfimages_is_renamed_to_run_first(
    mod: ModuleType, tmp_path: Path
) -> None:
    # slurmd runs a glob's matches in reverse order of name: 99-site before 50-tfimage
    # before 00-site (seen on the local cluster: test_the_sites_prolog_runs_before_tfimages).
    p, e = tmp_path / "p.d", tmp_path / "e.d"
    p.mkdir()
    e.mkdir()
    (p / "00-site-prolog").symlink_to("/usr/local/sbin/site-prolog")
    (e / "99-site-epilog").symlink_to("/already/new")
    (e / "00-site-epilog").symlink_to("/usr/local/sbin/site-epilog")  # both: leave it
    renames = mod.renamed_site_links({"Prolog": str(p), "Epilog": str(e)})
    assert renames == {str(p / "00-site-prolog"): str(p / "99-site-prolog")}


def test_a_gpu_fault_requeues_instead_of_holding_and_other_parameters_stay(
    mod: ModuleType,
) -> None:
    text, _ = mod.plan(
        "SchedulerParameters=bf_window=2880,defer\n", "/p", "/e", ["Alloc"],
        ["nohold_on_prolog_fail"],
    )  # fmt: skip
    assert "SchedulerParameters=bf_window=2880,defer,nohold_on_prolog_fail\n" in text
    again, _ = mod.plan(text, "/p", "/e", ["Alloc"], ["nohold_on_prolog_fail"])
    assert again == text
    fresh, _ = mod.plan("ClusterName=x\n", "/p", "/e", ["Alloc"], ["nohold_on_prolog_fail"])
    assert fresh.splitlines()[-1] == "SchedulerParameters=nohold_on_prolog_fail"


def test_the_gpu_health_check_is_set_only_where_the_site_has_none(mod: ModuleType) -> None:
    hc = "/usr/local/lib/tfimage/tfimage-health-check"
    text, extra = mod.plan("ClusterName=x\n", "/p", "/e", ["Alloc"], [], hc, 600)
    assert f"HealthCheckProgram={hc}\nHealthCheckInterval=600\n" in text
    assert extra["health_check_kept"] is None
    assert mod.plan(text, "/p", "/e", ["Alloc"], [], hc, 600)[0] == text
    site = "ClusterName=x\nHealthCheckProgram=/usr/sbin/nhc\nHealthCheckInterval=300\n"
    text, extra = mod.plan(site, "/p", "/e", ["Alloc"], [], hc, 600)
    assert "HealthCheckProgram=/usr/sbin/nhc\n" in text and hc not in text
    assert "HealthCheckInterval=300\n" in text and "600" not in text
    assert extra["health_check_kept"] == "/usr/sbin/nhc"

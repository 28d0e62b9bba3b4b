"""The skip budget (tests/skipbudget.py) as CI runs it: a real pytest, started as the
other host's run is (an environment with nothing but what is passed), on a test
file that skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[2]

SKIPS = "import pytest\n\ndef test_{name}():\n    pytest.skip('not here')\n"


def run_pytest(root: Path, rel: str, name: str, **env: str) -> subprocess.CompletedProcess[str]:
    """pytest with only the budget plugin, on ROOT/REL holding one skipping test."""
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SKIPS.format(name=name))
    (root / "pytest.ini").write_text("[pytest]\n")  # ROOT is the rootdir: node ids as CI's
    # As other-host.sh's `env -i`: no CI, nothing but what is named.
    clean = {"PATH": os.environ["PATH"], "PYTHONPATH": str(TESTS), **env}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "skipbudget", rel],
        cwd=root,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "env",
    [{"TFIMAGE_STRICT": "1"}, {"TFIMAGE_STRICT": "1", "CI": "1"}, {"CI": "true"}],
    ids=["strict-without-CI", "strict-with-CI=1", "CI=true"],
)
def test_a_skip_outside_the_budget_fails_a_strict_run(tmp_path: Path, env: dict[str, str]) -> None:
    done = run_pytest(tmp_path, "tests/unit/test_new.py", "new_thing", **env)
    assert done.returncode == 1, done.stdout
    assert "1 skip(s) outside the budget" in done.stdout
    assert "tests/unit/test_new.py::test_new_thing" in done.stdout


@pytest.mark.parametrize("env", [{}, {"CI": "1"}], ids=["no-CI", "CI=1"])
def test_a_developers_run_reports_the_skip_and_passes(tmp_path: Path, env: dict[str, str]) -> None:
    done = run_pytest(tmp_path, "tests/unit/test_new.py", "new_thing", **env)
    assert done.returncode == 0, done.stdout
    assert "1 skipped" in done.stdout
    assert "outside the budget" not in done.stdout


def test_a_skip_the_budget_names_passes_a_strict_run(tmp_path: Path) -> None:
    done = run_pytest(
        tmp_path,
        "tests/unit/step/test_runtime.py",
        "apptainer_runs_a_real_sif_where_installed",
        TFIMAGE_STRICT="1",
    )
    assert done.returncode == 0, done.stdout
    assert "1 skipped" in done.stdout


def test_every_way_into_the_other_host_carries_strict_mode() -> None:
    # .ci/run sets it whatever CI says; other-host.sh passes it through its env -i.
    ci = (TESTS.parent / ".ci" / "run").read_text()
    assert "export TFIMAGE_STRICT=1" in ci.splitlines()
    inner = (TESTS.parent / "deploy" / "local" / "other-host.sh").read_text()
    start = inner.index("for v in http_proxy")
    assert "TFIMAGE_STRICT" in inner[start : inner.index("; do", start)].split()

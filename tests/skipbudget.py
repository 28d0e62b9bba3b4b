"""The skip budget, a pytest plugin: in strict mode a run fails when a test skips that
is not in ``ALLOWED_SKIPS`` (a short list, reviewed: each entry says why CI may skip
it), so no tier goes missing in silence.

Strict mode is ``TFIMAGE_STRICT=1``, which ``.ci/run`` always sets and
``tests/run-all.sh`` carries into the other host's run (whose ``env -i`` drops
everything else), or ``CI=true`` as a CI provider sets it.  ``CI=1`` or no ``CI``
alone is a developer's run: skips are reported, not failed.

tests/conftest.py loads it for the suite; a test loads it alone with ``-p skipbudget``.
"""

from __future__ import annotations

import os

import pytest

# node id -> why a CI machine may skip it (anything else skipped in strict mode fails)
ALLOWED_SKIPS = {
    "tests/unit/step/test_runtime.py::test_apptainer_runs_a_real_sif_where_installed": (
        "apptainer is not packaged for Debian 12 or 13"
    ),
    "tests/unit/cache/test_convert.py::test_apptainer_converts_a_real_image_where_installed": (
        "apptainer is not packaged for Debian 12 or 13"
    ),
    "tests/unit/cli/test_doctor.py::test_no_nvml_on_a_node_with_gpu_devices_is_an_error": (
        "a machine with libnvidia-ml cannot reach the not-found path"
    ),
    "tests/cluster/test_crashed_slurmd.py::"
    "test_a_slurmd_killed_under_a_prolog_has_its_job_requeued_recorded_once_never_lost"
    "[a reconfigure]": (
        "before Slurm 23.11 (Debian 12's 22.05) a reconfigure does not re-execute slurmd"
    ),
}
_UNBUDGETED: list[str] = []


def strict() -> bool:
    """Whether this run is CI's: skips outside the budget and missing tools fail it."""
    return os.environ.get("TFIMAGE_STRICT") == "1" or os.environ.get("CI") == "true"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and report.nodeid not in ALLOWED_SKIPS:
        _UNBUDGETED.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if strict() and _UNBUDGETED and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if strict() and _UNBUDGETED:
        terminalreporter.write_line(
            f"tests: FAILED: {len(_UNBUDGETED)} skip(s) outside the budget "
            "(tests/skipbudget.py ALLOWED_SKIPS) in strict mode (TFIMAGE_STRICT=1 or CI=true):",
            red=True,
        )
        for nodeid in _UNBUDGETED:
            terminalreporter.write_line(f"  {nodeid}")

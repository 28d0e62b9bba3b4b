"""NVML in a child with a deadline (agent/gpu/child.py): a hung or crashing driver
is a GPU fault the gate reports in time; tfimage's own trouble never drains.

The hang and the crash are the fake library's (``hang_s``, ``abort``): nvmlInit
sleeps or calls abort() in the real child process the gate starts."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import drains, gpu_check, hook
from gpus import FakeNvml, node

from tfimage.agent.core.errors import NodeFault, TfimageError
from tfimage.agent.gpu.child import probe_bounded
from tfimage.agent.gpu.probe import Selection


@pytest.fixture
def in_process(nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """The fake NVML for the children this test process starts (probe_bounded's)."""
    for name in ("LD_LIBRARY_PATH", "FAKE_NVML_STATE"):
        monkeypatch.setenv(name, nvml.env()[name])
    return nvml


def test_a_driver_that_stops_answering_is_an_init_drain_within_the_timeout(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(4)
    doc["hang_s"] = 30
    nvml.write(doc)
    started = time.monotonic()
    status, out = gpu_check(nvml, site(timeout=1))
    took = time.monotonic() - started
    assert status == 2
    assert drains(out) == [
        (
            "nvml",
            "init",
            "NVML does not initialise: NVML did not answer within 1 s (a hung driver or GPU)",
        )
    ]
    assert took < 15, took  # not the fake's 30 s


def test_a_driver_library_that_crashes_is_an_init_drain_naming_the_signal(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(2)
    doc["abort"] = True
    nvml.write(doc)
    status, out = gpu_check(nvml, site())
    assert status == 2
    assert drains(out) == [
        ("nvml", "init", "NVML does not initialise: NVML crashed the reading (SIGABRT)")
    ]


def test_a_process_killed_by_the_oom_killer_is_not_a_gpu_fault(
    in_process: FakeNvml,
) -> None:
    """SIGKILL (the OOM killer, an admin) is the machine's trouble: no drain."""
    doc = node(1)
    doc["signal"] = 9
    in_process.write(doc)
    with pytest.raises(TfimageError, match=r"the NVML reading failed: exit status -9") as e:
        probe_bounded(Selection(True), 10)
    # Exactly tfimage's own trouble: a NodeFault (a TfimageError too) would drain.
    assert type(e.value) is TfimageError and not isinstance(e.value, NodeFault)


def test_the_child_reads_the_same_gpus_the_selection_names(
    in_process: FakeNvml,
) -> None:
    in_process.write(node(4))
    got = probe_bounded(Selection(False, ("1", node(4)["devices"][3]["uuid"])), 10)
    assert not got.init_error and len(got.gpus) == 4
    read = [r.index for r in got.gpus if r.values]
    assert read == [1, 3]  # the others named only
    assert got.gpus[1].values["remapped"] == [0, 0, 0, 0]


def test_a_python_error_in_the_child_is_tfimages_trouble_not_a_gpu_fault(
    in_process: FakeNvml,
) -> None:
    in_process.write(node(1))
    with pytest.raises(TfimageError, match=r"gpu: the NVML reading failed: ValueError") as e:
        probe_bounded(Selection(False, ("not-a-gpu",)), 10)
    assert type(e.value) is TfimageError and not isinstance(e.value, NodeFault)


def test_a_child_that_does_not_start_in_time_is_not_a_gpu_fault(in_process: FakeNvml) -> None:
    in_process.write(node(1))
    # No Python starts in 1 ms: the child never says READY.
    with pytest.raises(TfimageError, match=r"did not start within 0.001 s") as e:
        probe_bounded(Selection(True), 0.001)
    assert type(e.value) is TfimageError and not isinstance(e.value, NodeFault)


ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the hooks run as root: run as root")


@ROOT_ONLY
@pytest.mark.parametrize(
    ("fault", "timeout", "said"),
    [
        ({"signal": 9}, 20, "the NVML reading failed: exit status -9"),
        ({}, 0.001, "the NVML reading did not start within 0.001 s"),
    ],
    ids=["killed by the OOM killer", "not started within its bound"],
)
def test_a_prolog_whose_reading_fails_for_tfimages_own_reasons_exits_0(
    nvml: FakeNvml,
    site: Callable[..., Path],
    tmp_path: Path,
    fault: dict[str, object],
    timeout: float,
    said: str,
) -> None:
    """Slurm drains a node whose prolog exits non-zero: these must exit 0."""
    nvml.write({**node(2), **fault})
    r = hook("prolog", nvml, site(timeout=timeout), "--job=45", "--node=n1", "--gpus=0,1")
    assert r.returncode == 0, r.stderr
    log = (tmp_path / "hooks.log").read_text()
    assert said in log, log
    assert "drain" not in log, log


@pytest.mark.skipif(os.geteuid() != 0, reason="the hooks run as root: run as root")
def test_a_prolog_on_a_hung_driver_fails_in_time_and_pulls_nothing(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    doc = node(4)
    doc["hang_s"] = 30
    nvml.write(doc)
    started = time.monotonic()
    r = hook(
        "prolog", nvml, site(timeout=1), "--job=44", "--node=n1", "--gpus=0", "--image=tiny:1.0"
    )
    assert r.returncode == 1
    assert time.monotonic() - started < 15
    log = (tmp_path / "hooks.log").read_text()
    assert "tfimage: nvml: NVML does not initialise: NVML did not answer within 1 s" in log, log
    assert "tiny:1.0" not in log

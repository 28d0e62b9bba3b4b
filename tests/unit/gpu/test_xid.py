"""Critical XIDs from the kernel log: matched to their GPU by PCI bus id, each
reported once (a cursor per GPU, moved by the prolog), never swallowed by a check of
other GPUs nor by an operator's look."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import drains, gpu_check, hook
from gpus import FakeNvml, node
from hypothesis import given
from hypothesis import strategies as st

from tfimage.agent.gpu.xid import key, messages, parse_message, read_xids


def _xid(seq: int, bus: int, number: int, text: str = "GPU has fallen off the bus.") -> str:
    return f"4,{seq},{seq * 1000},-;NVRM: Xid (PCI:0000:{bus:02x}:00): {number}, pid=77, {text}\n"


def test_xid_79_drains_its_gpu_once_and_a_new_one_drains_again(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    nvml.write(node(2))  # gpu0 on bus 1b, gpu1 on bus 2b
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        "6,1,100,-;Linux version 6.1\n"
        + _xid(2, 0x1B, 13, "Graphics Exception")  # the application's, never the node's
        + "6,3,300,-;NVRM: Xid (PCI:zzzz): 79, not a bus\n"
        + _xid(4, 0x2B, 79)
        + " SUBSYSTEM=pci\n"
    )
    cfg = site()
    status, out = gpu_check(nvml, cfg)
    assert status == 2 and drains(out) == [("gpu1", "xid", "XID 79 in the kernel log")]
    assert gpu_check(nvml, cfg)[0] == 2  # an operator's look swallows nothing
    assert prolog(nvml, cfg, "0,1").returncode == 1  # the prolog acts on it, once
    assert prolog(nvml, cfg, "0,1").returncode == 0
    assert gpu_check(nvml, cfg)[0] == 0

    with kmsg.open("a") as f:
        f.write(_xid(5, 0x2B, 48, "DBE"))
    status, out = gpu_check(nvml, cfg)
    assert drains(out) == [("gpu1", "xid", "XID 48 in the kernel log")]
    assert prolog(nvml, cfg, "1").returncode == 1
    cursor = json.loads((tmp_path / "state/gpu/xid-cursor.json").read_text())
    assert cursor["seq"] == {"0000:1b:00": 4, "0000:2b:00": 5}  # gpu0 not looked at since
    assert (tmp_path / "state/gpu/xid-cursor.json").stat().st_mode & 0o777 == 0o600


def test_a_check_of_other_gpus_leaves_an_xid_for_its_own_gpus_check(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    nvml.write(node(2))
    (tmp_path / "kmsg").write_text(_xid(9, 0x2B, 79))
    cfg = site()
    assert gpu_check(nvml, cfg, "--gpus=0")[0] == 0  # another job's GPU
    _status, out = gpu_check(nvml, cfg, "--gpus=1")
    assert drains(out) == [("gpu1", "xid", "XID 79 in the kernel log")]


def test_cursors_from_another_boot_are_forgotten(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    nvml.write(node(2))
    (tmp_path / "kmsg").write_text(_xid(3, 0x2B, 79))
    cfg = site()
    assert prolog(nvml, cfg, "1").returncode == 1
    assert prolog(nvml, cfg, "1").returncode == 0
    path = tmp_path / "state/gpu/xid-cursor.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "boot": "an-earlier-boot"}))  # sequence numbers restarted
    assert prolog(nvml, cfg, "1").returncode == 1


def test_a_site_list_without_an_xid_leaves_it_alone(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    nvml.write(node(2))
    (tmp_path / "kmsg").write_text(_xid(3, 0x2B, 79))
    assert gpu_check(nvml, site(xids=[48]))[0] == 0


def test_a_missing_kernel_log_is_said_and_is_no_finding(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    nvml.write(node(1))
    status, out = gpu_check(nvml, site(kmsg=str(tmp_path / "nowhere")))
    assert status == 0 and out["findings"] == []


def test_only_the_drivers_own_kernel_line_counts(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    nvml.write(node(2))
    forged = _xid(3, 0x2B, 79).split(";", 1)[1]
    (tmp_path / "kmsg").write_text(
        f"12,3,300,-;{forged}"  # a user's write to /dev/kmsg: facility user (1 << 3)
        + f"4,4,400,-;overlayfs: failed to resolve '{forged.strip()}'\n"  # quoted by the kernel
    )
    assert gpu_check(nvml, site())[0] == 0


def prolog(nvml: FakeNvml, config: Path, gpus: str) -> subprocess.CompletedProcess[str]:
    return hook("prolog", nvml, config, "--job=60", "--node=n1", f"--gpus={gpus}")


def test_bus_ids_from_nvml_and_from_the_log_meet() -> None:
    assert key("00000000:3B:00.0") == key("0000:3b:00") == "0000:3b:00"
    assert key("0000:3b") == key("../../etc") == ""
    got = parse_message(_xid(12, 0x3B, 79))
    assert got is not None and (got.seq, got.pci, got.xid) == (12, "0000:3b:00", 79)


@given(st.text(max_size=300))
def test_no_log_line_breaks_the_parser(text: str) -> None:
    got = parse_message(text)
    assert got is None or (got.xid > 0 and key(got.pci) == got.pci)


@pytest.mark.skipif(os.geteuid() != 0, reason="writing /dev/kmsg needs root")
def test_the_real_kernel_log_is_read_and_a_users_forged_xid_in_it_never_counts() -> None:
    """/dev/kmsg itself (a message per read, non-blocking to its end): the forged
    line is there, as the kernel stamps a write from user space (never facility 0),
    and it is no XID."""
    kmsg = Path("/dev/kmsg")
    marker = f"tfimage-test-{uuid.uuid4().hex[:12]}"
    # A bus no machine has and an XID no list holds: other monitors must not act on it.
    forged = f"<3>NVRM: Xid (PCI:ffff:ff:1f): 999, pid=1, tfimage test line {marker}"
    try:
        with open(kmsg, "w") as f:
            f.write(forged + "\n")  # a message without its newline stays open
    except OSError as e:
        pytest.skip(f"/dev/kmsg is not writable here: {e.strerror}")
    seen = [r for r in messages(kmsg) if marker in r]
    assert len(seen) == 1, "the message written was not read back"
    assert int(seen[0].split(",", 1)[0]) >> 3 != 0  # not the kernel's facility
    assert not [x for x in read_xids(kmsg) if x.pci == key("ffff:ff:1f")]


def test_a_health_check_acts_on_an_xid_once_as_the_prolog_does(
    nvml: FakeNvml, site: Callable[..., Path], tmp_path: Path
) -> None:
    nvml.write(node(2))
    (tmp_path / "kmsg").write_text(_xid(7, 0x1B, 79))
    bin_dir = tmp_path / "slurm-bin"  # a stand-in scontrol that records the drain
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/drains\n')
    (bin_dir / "scontrol").chmod(0o755)
    cfg = site(slurm_bin=str(bin_dir))
    for _ in range(2):  # two intervals
        subprocess.run(
            [sys.executable, "-m", "tfimage.main", "--config", str(cfg), "gpu", "check",
             "--health-check", "--node=n1"],
            env=nvml.env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    drained = (tmp_path / "drains").read_text().splitlines()
    assert len(drained) == 1 and "XID 79 in the kernel log" in drained[0], drained
    assert gpu_check(nvml, cfg)[0] == 0  # and `gpu resume` can pass

"""Named GPU failure scenarios, each through the real nvidia-ml-py and a fake
libnvidia-ml.so.1 (tests/fakenvml), as ``tfimage gpu check`` runs them.

Each scenario is the state a real fault leaves NVML in (nvml.h's return codes and
counters), named for what an operator would see; the comment says which field
carries it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import drains, gpu_check
from gpus import FakeNvml, gpu, node


def test_a_healthy_8_gpu_node_passes_with_nothing_to_say(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    nvml.write(node(8))
    status, doc = gpu_check(nvml, site(), "--idle")
    assert status == 0 and doc["status"] == "healthy", doc
    assert [g["index"] for g in doc["gpus"]] == list(range(8))
    assert doc["findings"] == []
    assert doc["driver"] == "550.54.15"


def test_a_double_bit_ecc_error_on_one_gpu_drains_naming_that_gpu(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(8)
    # nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE)
    doc["devices"][5] = gpu(5, ecc_dbe_volatile=2)
    nvml.write(doc)
    status, out = gpu_check(nvml, site())
    assert status == 2
    assert drains(out) == [("gpu5", "ecc_dbe", "volatile uncorrected ECC: 2")]
    assert next(f for f in out["findings"])["uuid"] == doc["devices"][5]["uuid"]


def test_a_pending_row_remap_drains(nvml: FakeNvml, site: Callable[..., Path]) -> None:
    doc = node(2)
    doc["devices"][1] = gpu(1, remapped=[0, 1, 1, 0])  # nvmlDeviceGetRemappedRows: pending
    nvml.write(doc)
    status, out = gpu_check(nvml, site())
    assert status == 2 and drains(out) == [
        ("gpu1", "remap_pending", "row remapping pending (needs a reset)")
    ]


def test_a_failed_row_remap_drains(nvml: FakeNvml, site: Callable[..., Path]) -> None:
    doc = node(2)
    doc["devices"][0] = gpu(0, remapped=[0, 8, 0, 1])
    nvml.write(doc)
    assert drains(gpu_check(nvml, site())[1]) == [("gpu0", "remap_failure", "row remapping failed")]


def test_remapped_rows_over_the_sites_limit_drain_and_under_it_do_not(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(1)
    doc["devices"][0] = gpu(0, remapped=[3, 2, 0, 0])
    nvml.write(doc)
    assert gpu_check(nvml, site())[0] == 0  # no limit by default
    assert gpu_check(nvml, site(remapped_rows_max=5))[0] == 0
    status, out = gpu_check(nvml, site(remapped_rows_max=4))
    assert status == 2 and drains(out) == [("gpu0", "remapped_rows", "5 remapped rows (over 4)")]


def test_pending_retired_pages_drain(nvml: FakeNvml, site: Callable[..., Path]) -> None:
    doc = node(2)
    doc["devices"][1] = gpu(1, retired_pending=1)  # nvmlDeviceGetRetiredPagesPendingStatus
    nvml.write(doc)
    assert drains(gpu_check(nvml, site())[1]) == [
        ("gpu1", "retired_pending", "retired pages pending (needs a reset)")
    ]


def test_retired_pages_over_dcgms_limits_drain(nvml: FakeNvml, site: Callable[..., Path]) -> None:
    doc = node(3)
    doc["devices"][0] = gpu(0, retired_sbe=45, retired_dbe=15)  # 60 in all, 15 DBE: at the limits
    doc["devices"][1] = gpu(1, retired_sbe=45, retired_dbe=16)
    doc["devices"][2] = gpu(2, retired_sbe=0, retired_dbe=16)
    nvml.write(doc)
    assert drains(gpu_check(nvml, site())[1]) == [
        ("gpu1", "retired_pages", "61 retired pages (over 60)"),
        ("gpu2", "retired_pages", "16 double-bit retired pages (over 15)"),
    ]


def test_a_lost_gpu_drains_even_unnamed(nvml: FakeNvml, site: Callable[..., Path]) -> None:
    doc = node(4)
    doc["devices"][2] = gpu(2, handle="GPU_IS_LOST")  # fallen off the bus
    doc["devices"][3] = gpu(3, errors={"nvmlDeviceGetRemappedRows": "RESET_REQUIRED"})
    nvml.write(doc)
    status, out = gpu_check(nvml, site())
    assert status == 2
    assert drains(out) == [("gpu2", "lost", "GPU is lost"), ("gpu3", "lost", "GPU needs a reset")]


def test_a_driver_that_is_not_loaded_drains_a_node_whose_job_has_gpus(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    nvml.write(node(4, init="DRIVER_NOT_LOADED"))
    status, out = gpu_check(nvml, site(), "--gpus=0,1")
    assert status == 2 and out["nvml"] == "Driver Not Loaded"
    assert drains(out) == [("nvml", "init", "NVML does not initialise: Driver Not Loaded")]


def test_a_driver_and_library_version_mismatch_drains(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    nvml.write(node(1, init="LIB_RM_VERSION_MISMATCH"))
    status, out = gpu_check(nvml, site())
    assert status == 2 and drains(out)[0][1] == "init"


def test_fewer_gpus_visible_than_allocated_drains(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    nvml.write(node(2))
    status, out = gpu_check(nvml, site(), "--gpus=0,1,2,3")
    assert status == 2
    assert drains(out) == [("nvml", "count", "2 allocated GPU(s) not visible: 2,3")]
    assert [g["index"] for g in out["gpus"]] == [0, 1]


def test_a_leftover_process_drains_before_a_job_but_not_on_a_shared_gpu(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(2)
    doc["devices"][0] = gpu(0, processes=[{"pid": 4242, "mem": 1 << 30}])
    nvml.write(doc)
    status, out = gpu_check(nvml, site(), "--idle", "--gpus=0")
    assert status == 2 and drains(out) == [
        ("gpu0", "processes", "1 compute process(es) from outside the job: pid 4242")
    ]
    # gres/shard (or gres/mps) on this node: the other sharers' processes are legitimate
    assert gpu_check(nvml, site(shared=True), "--idle", "--gpus=0")[0] == 0
    # ... or named among the nodes that share (the prolog cannot tell a shard job)
    sharing = site(shared=["gpu-s*", "n7"])
    assert gpu_check(nvml, sharing, "--idle", "--gpus=0", "--node=gpu-s01")[0] == 0
    assert gpu_check(nvml, sharing, "--idle", "--gpus=0", "--node=gpu-w01")[0] == 2
    # an operator's check of a busy node expects processes
    assert gpu_check(nvml, site(), "--gpus=0")[0] == 0


def test_an_nvlink_down_drains(nvml: FakeNvml, site: Callable[..., Path]) -> None:
    doc = node(2)
    doc["devices"][1] = gpu(1, nvlinks=[1, 1, 0, 1, 0, 1])  # nvmlDeviceGetNvLinkState
    nvml.write(doc)
    assert drains(gpu_check(nvml, site())[1]) == [("gpu1", "nvlink", "NVLink down: link 2,4")]


def test_a_corrupt_inforom_drains(nvml: FakeNvml, site: Callable[..., Path]) -> None:
    doc = node(1)
    doc["devices"][0] = gpu(0, inforom="CORRUPTED_INFOROM")  # nvmlDeviceValidateInforom
    nvml.write(doc)
    assert drains(gpu_check(nvml, site())[1]) == [("gpu0", "inforom", "corrupt InfoROM")]


def test_the_drivers_recovery_action_asking_for_a_reboot_drains(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(2)
    doc["devices"][1] = gpu(1, recovery_action=2)  # NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    nvml.write(doc)
    assert drains(gpu_check(nvml, site())[1]) == [
        ("gpu1", "recovery", "the driver asks for a node reboot")
    ]


def test_everything_not_supported_passes_with_every_check_skipped(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    # A consumer GPU: no ECC, no remapping, no NVLink, no minor number...
    bare = [{"uuid": d["uuid"], "pci": d["pci"]} for d in node(2)["devices"]]
    nvml.write({"driver": "550.54.15", "devices": bare})
    status, out = gpu_check(nvml, site(), "--idle")
    assert status == 0, out
    assert {f["severity"] for f in out["findings"]} == {"skipped"}
    checks = {f["check"] for f in out["findings"] if f["gpu"] == "gpu0"}
    assert checks == {
        "ecc_dbe",
        "remap_failure",
        "remap_pending",
        "retired_pending",
        "retired_pages",
        "inforom",
        "recovery",
        "nvlink",
        "persistence",
        "clocks",
        "pcie",
    }  # processes: an empty answer is an answer; remapped_rows: no limit set
    status, out = gpu_check(nvml, site(remapped_rows_max=4), "--idle")
    assert status == 0 and "remapped_rows" in {f["check"] for f in out["findings"]}


def test_a_driver_too_old_for_a_function_skips_that_check(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(1)
    doc["devices"][0]["errors"] = {"nvmlDeviceGetRemappedRows": "FUNCTION_NOT_FOUND"}
    nvml.write(doc)
    status, out = gpu_check(nvml, site())
    assert status == 0
    skipped = {(f["check"], f["cause"]) for f in out["findings"]}
    assert ("remap_pending", "the driver has no such function") in skipped


def test_warnings_say_so_and_exit_1(nvml: FakeNvml, site: Callable[..., Path]) -> None:
    doc = node(3)
    doc["devices"][0] = gpu(0, persistence=0)
    doc["devices"][1] = gpu(1, clock_events=0x40 | 0x80)  # HW thermal, power brake
    doc["devices"][2] = gpu(2, pcie=[8, 16, 5, 5])
    nvml.write(doc)
    status, out = gpu_check(nvml, site())
    assert status == 1 and out["status"] == "warning"
    assert [(f["gpu"], f["cause"]) for f in out["findings"]] == [
        ("gpu0", "persistence mode off"),
        ("gpu1", "clocks held down: hardware thermal slowdown, hardware power brake"),
        ("gpu2", "PCIe link x8 of x16"),
    ]


def test_an_idle_gpus_lower_pcie_generation_is_not_a_warning(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(2)
    doc["devices"][0] = gpu(0, pcie=[16, 16, 1, 5], clock_events=1)  # idle: gen1 on purpose
    doc["devices"][1] = gpu(1, pcie=[16, 16, 3, 5], clock_events=0)  # busy and slow
    nvml.write(doc)
    status, out = gpu_check(nvml, site())
    assert status == 1
    assert [(f["gpu"], f["cause"]) for f in out["findings"]] == [("gpu1", "PCIe link gen3 of gen5")]


def test_a_site_can_turn_a_check_off_or_make_it_a_warning(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(2)
    doc["devices"][0] = gpu(0, nvlinks=[1, 0])
    doc["devices"][1] = gpu(1, persistence=0)
    nvml.write(doc)
    status, out = gpu_check(nvml, site(severity={"nvlink": "warning", "persistence": "off"}))
    assert status == 1
    assert [(f["check"], f["severity"]) for f in out["findings"]] == [("nvlink", "warning")]


def test_index_uuid_and_minor_mappings_pick_the_gpus_slurm_meant(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(4)  # minor = 3 - index... here 7 - index: 7, 6, 5, 4
    doc["devices"][1] = gpu(1, ecc_dbe_volatile=1)  # index 1, minor 6
    nvml.write(doc)
    # AutoDetect=nvml: Slurm's "1" is NVML's index 1
    assert drains(gpu_check(nvml, site(mapping="index"), "--gpus=1")[1])[0][0] == "gpu1"
    # File=/dev/nvidia1 is minor 1: no such GPU on this node
    status, out = gpu_check(nvml, site(mapping="minor"), "--gpus=1")
    assert drains(out) == [("nvml", "count", "1 allocated GPU(s) not visible: 1")]
    # File=/dev/nvidia6 is index 1
    status, out = gpu_check(nvml, site(mapping="minor"), "--gpus=6")
    assert [g["index"] for g in out["gpus"]] == [1] and drains(out)[0][:2] == ("gpu1", "ecc_dbe")
    # a UUID in the allocation is a UUID in any mode
    uuid = doc["devices"][1]["uuid"]
    status, out = gpu_check(nvml, site(mapping="minor"), f"--gpus={uuid}")
    assert [g["uuid"] for g in out["gpus"]] == [uuid] and status == 2
    healthy = doc["devices"][2]["uuid"]
    assert gpu_check(nvml, site(), f"--gpus={healthy}")[0] == 0


def test_the_job_scope_ignores_a_fault_on_another_jobs_gpu_and_node_scope_sees_it(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(4)
    doc["devices"][3] = gpu(3, ecc_dbe_volatile=1)
    nvml.write(doc)
    assert gpu_check(nvml, site(), "--gpus=0,1")[0] == 0
    assert gpu_check(nvml, site(scope="node"), "--gpus=0,1")[0] == 2


def test_with_node_scope_another_jobs_processes_on_its_own_gpus_are_fine(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(4)
    doc["devices"][3] = gpu(3, processes=[{"pid": 700, "mem": 1}])  # the other job's GPU
    nvml.write(doc)
    assert gpu_check(nvml, site(scope="node"), "--idle", "--gpus=0,1")[0] == 0
    status, out = gpu_check(nvml, site(scope="node"), "--idle", "--gpus=3")
    assert status == 2 and drains(out)[0][:2] == ("gpu3", "processes")


def test_a_gpu_with_every_nvlink_inactive_has_none_wired_and_passes(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(1)
    doc["devices"][0] = gpu(0, nvlinks=[0, 0, 0, 0])  # a PCIe card without a bridge
    nvml.write(doc)
    assert gpu_check(nvml, site())[0] == 0


def test_an_nvml_error_other_than_not_supported_is_a_warning_not_a_skip(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(1)
    doc["devices"][0]["errors"] = {"nvmlDeviceGetTotalEccErrors": "UNKNOWN_ERROR"}
    nvml.write(doc)
    status, out = gpu_check(nvml, site())
    assert status == 1
    assert [(f["check"], f["severity"]) for f in out["findings"]] == [("ecc_dbe", "warning")]
    assert out["findings"][0]["cause"].startswith("NVML: ")


def test_a_mig_allocation_checks_its_gpus_whole_and_misses_none(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    doc = node(2)
    doc["devices"][1] = gpu(1, ecc_dbe_volatile=1)
    nvml.write(doc)
    status, out = gpu_check(nvml, site(), "--gpus=MIG-5c3e1a2b-0000-1111-2222-333344445555")
    assert status == 2
    assert [g["index"] for g in out["gpus"]] == [0, 1]
    assert drains(out) == [("gpu1", "ecc_dbe", "volatile uncorrected ECC: 1")]


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this machine has NVIDIA GPUs")
def test_a_health_check_on_a_node_without_nvidia_gpus_is_no_fault(
    nvml: FakeNvml, site: Callable[..., Path]
) -> None:
    """HealthCheckProgram runs on every node of the cluster: where there is no NVIDIA
    driver at all (no /dev/nvidiactl, no library), nothing is drained."""
    nvml.write({"init": "LIBRARY_NOT_FOUND", "devices": []})
    status, out = gpu_check(nvml, site(), "--health-check", "--node=cpu01")
    assert status == 0 and out["status"] == "skipped", out
    assert "no NVIDIA GPU on this node" in out["why"]
    # an operator's own look still says what NVML said
    status, out = gpu_check(nvml, site())
    assert status == 2 and drains(out)[0][1] == "init"

"""Fractional GPUs: an MPS step's --mem-per-gpu becomes a real per-process cap,
CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, one entry per GPU ordinal as the task sees them."""

from __future__ import annotations

import pytest

from tfimage.agent.core.config import config_from_mapping
from tfimage.agent.step.gpushare import LIMIT, mps_memory_limit
from tfimage.agent.step.plan import StepRequest, step_env
from tfimage.agent.step.taskenv import task_env

MPS = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_VISIBLE_DEVICES": "0"}
STEP = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "n1",
    "SLURM_STEP_TASKS_PER_NODE": "2",
}


def test_an_mps_step_with_mem_per_gpu_gets_a_cap_on_each_of_its_gpus() -> None:
    assert mps_memory_limit({**MPS, "SLURM_MEM_PER_GPU": "10240"}) == (
        "0=10G",
        "--mem-per-gpu=10240M on each of the task's 1 MPS-shared GPU(s)",
    )
    two = {**MPS, "CUDA_VISIBLE_DEVICES": "2,3", "SLURM_MEM_PER_GPU": "1500"}
    assert mps_memory_limit(two) == (
        "0=1500MB,1=1500MB",
        "--mem-per-gpu=1500M on each of the task's 2 MPS-shared GPU(s)",
    )  # ordinals as the task sees them, never the node's indices
    from_step = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "SLURM_STEP_GPUS": "1"}
    assert mps_memory_limit({**from_step, "SLURM_MEM_PER_GPU": "2048"}) == (
        "0=2G",
        "--mem-per-gpu=2048M on each of the task's 1 MPS-shared GPU(s)",
    )


@pytest.mark.parametrize(
    "env",
    [
        {"CUDA_VISIBLE_DEVICES": "0", "SLURM_MEM_PER_GPU": "1024"},  # whole GPUs: no MPS
        dict(MPS),  # no --mem-per-gpu
        {**MPS, "SLURM_MEM_PER_GPU": "0"},
        {**MPS, "SLURM_MEM_PER_GPU": "10G"},
        {**MPS, "SLURM_MEM_PER_GPU": "1" * 12},
        {**MPS, "CUDA_VISIBLE_DEVICES": "0,0", "SLURM_MEM_PER_GPU": "1024"},
        {**MPS, "CUDA_VISIBLE_DEVICES": "", "SLURM_MEM_PER_GPU": "1024"},
    ],
)
def test_anything_else_gets_no_cap(env: dict[str, str]) -> None:
    assert mps_memory_limit(env) is None


def test_a_cap_the_user_set_is_kept() -> None:
    env = {**STEP, "SLURM_NODEID": "0", "SLURM_LOCALID": "0", **MPS, "SLURM_MEM_PER_GPU": "4096"}
    assert task_env(env, interface_of=lambda h: None).set[LIMIT].value == "0=4G"
    mine = task_env({**env, LIMIT: "0=1G"}, interface_of=lambda h: None)
    assert LIMIT not in mine.set and LIMIT in mine.kept


def test_every_task_of_a_step_and_a_batch_script_get_it_beside_the_site_variables() -> None:
    cfg = config_from_mapping({})
    layout = {**STEP, **MPS, "SLURM_MEM_PER_GPU": "8192"}
    envs = step_env(cfg, StepRequest("7", "0", 1000, "x:1", layout=layout, local_tasks=2))
    assert [e[LIMIT] for e in envs.values()] == ["0=8G", "0=8G"]
    assert all(e["TF_FORCE_GPU_ALLOW_GROWTH"] == "true" for e in envs.values())
    batch = {"SLURM_JOB_ID": "7", **MPS, "SLURM_MEM_PER_GPU": "8192"}
    envs = step_env(cfg, StepRequest("7", "batch", 1000, "x:1", layout=batch, local_tasks=1))
    assert envs[0][LIMIT] == "0=8G" and envs[0]["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    plain = step_env(cfg, StepRequest("7", "0", 1000, "x:1", layout=dict(STEP), local_tasks=2))
    assert all(LIMIT not in e for e in plain.values())

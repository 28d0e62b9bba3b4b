"""Which step's array ids reach the usage record (step/plan.py, spank/node.c).

Only the batch step's: slurmd has those from slurmctld's launch message.  A launch
step's S_JOB_ARRAY_ID is read from the step's environment (22.05.8's
slurmstepd_job.c), which the user sets, and a plain job's says the job's own id with
NO_VAL for the task (the records said so for every plain srun job until this).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tfimage.agent.core.config import load_config
from tfimage.agent.step.plan import BATCH_STEP, StepRequest, _note_array
from tfimage.agent.usage import jobfacts


@pytest.mark.parametrize(
    ("step", "job", "task", "noted"),
    [
        (BATCH_STEP, "40", "2", True),  # an array task's batch step: Slurm's own
        ("0", "40", "2", False),  # srun's: the job's environment, perhaps a lie
        ("0", "999", "7", False),
        (BATCH_STEP, "41", str(0xFFFFFFFE), False),  # NO_VAL: no array
        (BATCH_STEP, "41", "x", False),
    ],
)
def test_only_the_batch_steps_array_ids_are_kept_for_the_record(
    tmp_path: Path, step: str, job: str, task: str, noted: bool
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(f'registry: "r.example"\nstate_dir: {tmp_path / "run"}\n')
    cfg = load_config(str(path))
    req = StepRequest("41", step, 1000, "tiny:1.0", array_job=job, array_task=task)
    _note_array(cfg, req)
    with jobfacts.claimed(cfg.state_dir, "41") as facts:
        got = (facts.get("array_job_id"), facts.get("array_task_id"))
    assert got == ((job, task) if noted else (None, None))

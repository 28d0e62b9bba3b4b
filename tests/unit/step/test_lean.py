"""What a node runs on a job's launch path imports no heavy library: a pull by
digest (the prolog's) and a step's preparation load neither requests, yaml, oras
nor psutil (the README promises it; each costs 25-110 ms of import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from support import Registry
from tfimage.agent.core.config import compile_config
from tfimage.agent.step.imagemount import release_images, release_job

HEAVY = ("requests", "yaml", "oras", "psutil", "pynvml")
SCRIPT = """
import json, sys
from tfimage.main import main
status = [main(argv) for argv in json.loads(sys.argv[1])]
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
print(json.dumps({"status": status, "heavy": heavy}), file=sys.stderr)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="step preparation runs as root")
def test_a_pull_and_a_step_preparation_load_no_heavy_library(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    digest = registry.client().push_sif("library/lean", "1", make_sif({"etc/hosts": ""}))
    cfg = registry.write_site(tmp_path, runtime="charliecloud")
    # As the role leaves a node: credentials in JSON, the config compiled.
    creds = tmp_path / "credentials.yaml"
    creds.write_text(
        json.dumps(
            {
                "registries": {
                    registry.host: {"username": registry.username, "password": registry.password}
                }
            }
        )
    )
    creds.chmod(0o600)
    compile_config(cfg)
    ref = f"{registry.host}/library/lean:1@{digest}"
    steps = [
        ["--config", str(cfg), "pull", ref],
        [
            *("--config", str(cfg), "step-prepare", "--job=5", "--step=0", "--uid=65534"),
            *(f"--image={ref}", "--node-id=0", "--local-tasks=2", "--layout=SLURM_JOB_ID=5"),
            *("--layout=SLURM_STEP_NODELIST=localhost", "--layout=SLURM_STEP_TASKS_PER_NODE=2"),
        ],
    ]
    try:
        r = subprocess.run(
            [sys.executable, "-c", SCRIPT, json.dumps(steps), json.dumps(HEAVY)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        release_job(str(tmp_path / "state"), "5")
        release_images(str(tmp_path / "state"), lambda digest: False)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stderr.strip().splitlines()[-1])
    assert got == {"status": [0, 0], "heavy": []}, r.stderr

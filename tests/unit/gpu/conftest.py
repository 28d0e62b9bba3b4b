from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gpus import FakeNvml


@pytest.fixture
def nvml(fake_nvml_lib: Path, tmp_path: Path) -> FakeNvml:
    return FakeNvml(fake_nvml_lib, tmp_path / "nvml-state.json")


@pytest.fixture
def site(tmp_path: Path) -> Callable[..., Path]:
    """A config file with a state dir and kernel log of the test's own."""
    kmsg = tmp_path / "kmsg"
    kmsg.touch()

    def write(**gpu: Any) -> Path:
        cfg = tmp_path / "config.yaml"
        doc = {
            "state_dir": str(tmp_path / "state"),
            "hook_log": str(tmp_path / "hooks.log"),
            "usage_log": str(tmp_path / "usage.jsonl"),
            "metrics_dir": str(tmp_path / "metrics"),
            "gpu": {"kmsg": str(kmsg), **gpu},
        }
        cfg.write_text(json.dumps(doc))
        return cfg

    return write


def gpu_check(nvml: FakeNvml, config: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """``tfimage gpu check --json ARGS`` as an operator runs it."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfimage.main",
            "--config",
            str(config),
            "gpu",
            "check",
            "--json",
            *args,
        ],
        env=nvml.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout, r.stderr
    return r.returncode, json.loads(r.stdout)


def drains(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(f["gpu"], f["check"], f["cause"]) for f in doc["findings"] if f["severity"] == "drain"]


EMPTY = Path("/dev/null")


def hook(
    name: str, nvml: FakeNvml, config: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"tfimage.{name}.main", f"--config={config}", *args],
        env={**nvml.env(), "SLURM_CONF": str(EMPTY), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )

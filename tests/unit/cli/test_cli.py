"""The tfimage command as operators and the plugin run it: a real subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def tfimage(*args: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TFIMAGE_CONFIG": str(config) if config else "/nonexistent"}
    return subprocess.run(
        [sys.executable, "-m", "tfimage.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text("registry: reg.site:5000\nproject: library\n")
    return p


def test_resolve_offline_prints_canonical(cfg: Path) -> None:
    r = tfimage("resolve", "--offline", "tf-custom:2.0", config=cfg)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "reg.site:5000/library/tf-custom:2.0"
    j = json.loads(tfimage("resolve", "--offline", "--json", "x/y:1", config=cfg).stdout)
    assert (j["repository"], j["tag"], j["digest"]) == ("x/y", "1", None)


@pytest.mark.parametrize(
    ("ref", "code", "words"),
    [
        ("Bad Ref", 2, "whitespace"),
        ("other.site/x/y:1", 2, "not allowed"),
        ("tiny@sha256:12", 2, "digest"),
    ],
)
def test_bad_reference_one_line_exit_2(cfg: Path, ref: str, code: int, words: str) -> None:
    r = tfimage("resolve", "--offline", "--", ref, config=cfg)
    assert r.returncode == code
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("tfimage: ")
    assert words in r.stderr and "Traceback" not in r.stderr


def test_missing_config_is_exit_2() -> None:
    r = tfimage("resolve", "--offline", "x:1")
    assert r.returncode == 2 and "no such config file" in r.stderr


def test_help_explains_every_command() -> None:
    top = tfimage("--help")
    assert top.returncode == 0
    for cmd in ("resolve", "pull", "push", "cache"):
        assert cmd in top.stdout
        assert tfimage(cmd, "--help").returncode == 0
    actions = ("ls", "pull", "rm", "prune", "keep", "unkeep", "verify", "du", "warm")
    listing = tfimage("cache", "--help").stdout
    for action in actions:
        assert action in listing
        r = tfimage("cache", action, "--help")
        assert r.returncode == 0 and "--json" in r.stdout and "Exit status:" in r.stdout
        # A positional argument is explained, not just named.
        assert "positional arguments:" not in r.stdout or re.search(
            r"positional arguments:\n  \w+ +\S", r.stdout
        ), r.stdout


def test_the_plugins_commands_are_left_out_of_help_but_explain_themselves() -> None:
    top = tfimage("--help").stdout
    assert "submit-check" not in top and "step-prepare" not in top
    for cmd in ("submit-check", "step-prepare"):
        r = tfimage(cmd, "--help")
        assert r.returncode == 0 and "SPANK plugin" in r.stdout


def test_step_prepare_refuses_root_tasks(cfg: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("step-prepare only runs as root; this test is not root")
    r = tfimage(
        "step-prepare", "--job", "1", "--step", "0", "--uid", "0", "--image", "x:1", config=cfg
    )
    assert r.returncode == 3
    assert "refusing to run a container task as root" in r.stderr


def test_cache_ls_empty_json(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(f"cache_dir: {tmp_path / 'cache'}\n")
    r = tfimage("cache", "ls", "--json", config=p)
    assert r.returncode == 0 and json.loads(r.stdout) == []

from __future__ import annotations

from pathlib import Path

import pytest

from tfimage.agent.config import load_config
from tfimage.agent.errors import ConfigError, ImageReferenceError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(text)
    return p


def test_defaults_and_allowlist(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "registry: reg.site\nmirrors: [m1.site, m2.site]\n"))
    assert cfg.allowlist == ("reg.site", "m1.site", "m2.site")
    assert str(cfg.reference("tiny:1")) == "reg.site/library/tiny:1"
    with pytest.raises(ImageReferenceError, match="not allowed"):
        cfg.reference("other.site/x/y:1")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("registyr: x\n", "unknown setting"),
        ("mirrors: m1\n", "list of strings"),
        ("read_timeout: -1\n", "positive number"),
        ("read_timeout: true\n", "positive number"),
        ("runtime: docker\n", "runtime must be"),
        ("cache_dir: relative/path\n", "absolute"),
        ("pull_connections: 0\n", "integer from 1 to 16"),
        ("pull_stripe_bytes: 1000000\n", "multiple of 4096"),
        ("- a\n- b\n", "mapping"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path: Path, text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as e:
        load_config(write(tmp_path, text))
    assert "\n" not in str(e.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


def test_tf_settings(tmp_path: Path) -> None:
    cfg = load_config(
        write(tmp_path, "tf_port_range: [30000, 30100]\nsite_env: {NCCL_DEBUG: WARN}\n")
    )
    assert cfg.tf_port_range == (30000, 30100)
    assert cfg.site_env == {"NCCL_DEBUG": "WARN"}
    assert load_config(write(tmp_path, "")).site_env == {"TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    for bad in (
        "tf_port_range: [10, 20]\n",
        "site_env: {'bad name': x}\n",
        "site_env: {A: 1}\n",
        "single_task_tf_config: yes-please\n",
    ):
        with pytest.raises(ConfigError):
            load_config(write(tmp_path, bad))

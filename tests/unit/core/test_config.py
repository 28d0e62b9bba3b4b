from __future__ import annotations

from pathlib import Path

import pytest

from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import ConfigError, ImageReferenceError


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
        ("registyr: x\n", r"unknown setting\(s\): registyr \(did you mean registry\?\)"),
        ("colour: blue\n", r"unknown setting\(s\): colour$"),
        ("gpu: {chekcs: true}\n", r"under 'gpu': chekcs \(did you mean checks\?\)"),
        ("mirrors: m1\n", "list of strings"),
        ("read_timeout: -1\n", "positive number"),
        ("read_timeout: true\n", "positive number"),
        ("runtime: docker\n", "runtime must be"),
        ("cache_dir: relative/path\n", "absolute"),
        ("pull_connections: 0\n", "integer from 1 to 16"),
        ("pull_stripe_bytes: 1000000\n", "multiple of 4096"),
        ("- a\n- b\n", "mapping"),
        ("a: [\n", "not valid YAML"),
        ("registry: r\n  mirrors: [x]\n", "not valid YAML: line 2, column 10: mapping values"),
        ("dockerhub_project: Docker Hub\n", "project name"),
        ("registry_rewrites: [nvcr.io]\n", "map upstream prefixes"),
        ("registry_rewrites: {nvcr.io: harbor.site}\n", "host/project"),
        ("registry_rewrites: {nvcr.io: docker.io/nv}\n", "'docker.io/nv' is itself rewritten"),
        (
            "registry: r.site\ndockerhub_project: hub\nimage_mount_kernel: ['*/tf-*']\n",
            "would trust hub/, which the registry only proxies",
        ),
        (
            "registry: r.site\nregistry_rewrites: {ghcr.io: r.site/gh}\n"
            "image_mount_kernel: [library/tf-*, gh/*]\n",
            "would trust gh/",
        ),
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
    for bad, key in (
        ("tf_port_range: [10, 20]\n", "tf_port_range"),
        ("site_env: {'bad name': x}\n", "site_env"),
        ("site_env: {A: 1}\n", "site_env"),
        ("single_task_tf_config: yes-please\n", "single_task_tf_config"),
    ):
        with pytest.raises(ConfigError) as e:
            load_config(write(tmp_path, bad))
        assert key in str(e.value), (bad, str(e.value))  # names the setting at fault


@pytest.mark.parametrize(
    ("key", "low", "high"),
    [
        ("pull_connections", 1, 16),
        ("pull_stripe_bytes", 1 << 16, 1 << 28),
        ("step_max_tasks", 1, 1 << 20),
    ],
)
def test_integer_settings_take_both_edges_and_nothing_past_them(
    tmp_path: Path, key: str, low: int, high: int
) -> None:
    assert getattr(load_config(write(tmp_path, f"{key}: {low}\n")), key) == low
    assert getattr(load_config(write(tmp_path, f"{key}: {high}\n")), key) == high
    step = 4096 if key == "pull_stripe_bytes" else 1  # stripes stay block-aligned
    for past in (low - step, high + step):
        with pytest.raises(ConfigError, match=f"integer from {low} to {high}"):
            load_config(write(tmp_path, f"{key}: {past}\n"))


def test_a_stripe_one_byte_off_a_block_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="multiple of 4096"):
        load_config(write(tmp_path, f"pull_stripe_bytes: {(1 << 20) + 1}\n"))
    with pytest.raises(ConfigError, match="multiple of 4096"):
        load_config(write(tmp_path, f"pull_stripe_bytes: {(1 << 20) + 4095}\n"))


def test_the_port_range_may_span_1024_to_65535_and_no_further(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "tf_port_range: [1024, 65535]\n")).tf_port_range == (
        1024,
        65535,
    )
    assert load_config(write(tmp_path, "tf_port_range: [2000, 2000]\n")).tf_port_range == (
        2000,
        2000,
    )
    for bad in ("[1023, 2000]", "[2000, 65536]", "[3000, 2999]", "[2000]", "[true, 3000]"):
        with pytest.raises(ConfigError, match="within 1024-65535"):
            load_config(write(tmp_path, f"tf_port_range: {bad}\n"))


@pytest.mark.parametrize("key", ["cache_max_bytes", "read_timeout", "cache_min_age"])
def test_a_zero_size_or_time_is_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError, match="positive"):
        load_config(write(tmp_path, f"{key}: 0\n"))
    assert getattr(load_config(write(tmp_path, f"{key}: 1\n")), key) == 1


def test_a_mirror_that_is_the_registry_is_asked_once(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "registry: reg.site\nmirrors: [reg.site, m1.site]\n"))
    assert cfg.sources(cfg.reference("tiny:1")) == ["reg.site", "m1.site"]


def test_the_allowlist_judges_what_an_upstream_name_maps_to(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, (
        "registry: reg.site\ndockerhub_project: dockerhub\n"
        "registry_rewrites: {nvcr.io: reg.site/nvcr, ghcr.io: elsewhere.site/ghcr}\n"
    )))  # fmt: skip
    assert (
        str(cfg.reference("docker://ubuntu:22.04"))
        == "docker://reg.site/dockerhub/library/ubuntu:22.04"
    )
    assert str(cfg.reference("nvcr.io/nvidia/tf:1")) == "reg.site/nvcr/nvidia/tf:1"
    with pytest.raises(ImageReferenceError, match=r"'elsewhere\.site' is not allowed"):
        cfg.reference("ghcr.io/acme/x:1")  # mapped, but not to a registry the site allows
    with pytest.raises(ImageReferenceError, match=r"'quay\.io' is not allowed"):
        cfg.reference("quay.io/acme/x:1")  # no rewrite: as before

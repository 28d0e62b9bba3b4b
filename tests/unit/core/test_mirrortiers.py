"""Rack mirrors: each node group asks its own pull-through cache before the registry."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.errors import ConfigError

SITE = (
    "registry: reg.site\nmirrors: [dr.site]\n"
    'rack_mirrors: {"n[1-2]": [r1.site:5000, r1b.site], "n[3-4],gpu7": [r2.site], '
    '"n[2-3]": [never.site]}\n'
)


def load(tmp_path: Path, text: str) -> Config:
    p = tmp_path / "config.yaml"
    p.write_text(text)
    return load_config(p)


def test_a_node_asks_its_racks_mirrors_then_the_registry_then_the_site_mirrors(
    tmp_path: Path,
) -> None:
    cfg = load(tmp_path, SITE)
    ref = cfg.reference("tiny:1")
    on = cfg.on_node
    assert on("n1").sources(ref) == ["r1.site:5000", "r1b.site", "reg.site", "dr.site"]
    # The first group that names a node wins (n2 is in two).
    assert on("n2").sources(ref) == ["r1.site:5000", "r1b.site", "reg.site", "dr.site"]
    assert on("gpu7").sources(ref) == ["r2.site", "reg.site", "dr.site"]
    assert on("n9").sources(ref) == ["reg.site", "dr.site"]
    assert on("n3").node_mirrors() == ("n3", "n[3-4],gpu7", ("r2.site",))


def test_a_node_with_no_name_given_is_this_hosts_short_name(tmp_path: Path) -> None:
    me = socket.gethostname().split(".")[0]
    cfg = load(tmp_path, f'registry: reg.site\nrack_mirrors: {{"{me}": [r.site]}}\n')
    assert cfg.node_mirrors() == (me, me, ("r.site",))


def test_another_registrys_image_never_goes_to_a_rack_mirror(tmp_path: Path) -> None:
    cfg = load(tmp_path, SITE + "allowed_registries: [reg.site, other.site]\n")
    ref = cfg.reference("other.site/x/y:1")
    assert cfg.on_node("n1").sources(ref) == ["other.site"]


def test_every_rack_mirror_is_on_the_default_allowlist_of_every_node(tmp_path: Path) -> None:
    cfg = load(tmp_path, SITE)
    assert set(cfg.allowlist) == {
        "reg.site", "dr.site", "r1.site:5000", "r1b.site", "r2.site", "never.site"
    }  # fmt: skip
    assert cfg.is_rack_mirror("r2.site") is False  # not here
    assert cfg.on_node("n4").is_rack_mirror("r2.site")


def test_the_node_name_is_not_a_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown setting"):
        load(tmp_path, "node_name: n1\n")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("rack_mirrors: [r.site]", "must map Slurm hostlists to lists of mirrors"),
        ('rack_mirrors: {"n[1-2": [r.site]}', "unbalanced"),
        ('rack_mirrors: {"n[1-99999999]": [r.site]}', "'n\\[1-99999999\\]'"),
        ('rack_mirrors: {"n1": []}', "needs a list of host\\[:port\\]"),
        ('rack_mirrors: {"n1": ["https://r.site"]}', "needs a list of host\\[:port\\]"),
        ('rack_mirrors: {"n1": "r.site"}', "needs a list of host\\[:port\\]"),
        ("pull_jitter: -1", "'pull_jitter' must be a number of seconds from 0 to 600"),
        ("pull_jitter: true", "'pull_jitter' must be a number of seconds from 0 to 600"),
    ],
)
def test_a_bad_tier_is_one_clear_line(tmp_path: Path, text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        load(tmp_path, text + "\n")


def test_no_jitter_is_a_setting_too(tmp_path: Path) -> None:
    assert load(tmp_path, "pull_jitter: 0\n").pull_jitter == 0
    assert load(tmp_path, "").pull_jitter == 2.0

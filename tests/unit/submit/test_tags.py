"""``tfimage tags REPO`` against a real registry: the tags a user may run, and the
same answer for a repository refused by the access rules as for a missing one."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from support import Registry
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import ImageNotFound
from tfimage.agent.submit.tags import tags

NOBODY = 65534


def cli(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tfimage.main", "--config", str(cfg), "tags", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def site(registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path) -> Path:
    up = registry.client()
    for tag in ("2.0", "1.0", "2.1"):
        up.push_sif("library/tgs", tag, make_sif({"v": tag}))
    up.push_sif("secret/model", "1", make_sif({"v": "s"}))
    cfg = registry.write_site(tmp_path)
    cfg.write_text(cfg.read_text() + 'access: {"secret/*": ["@nosuchgroup-tfimage"]}\n')
    return cfg


def test_tags_lists_a_repositorys_tags_sorted_as_tf_image_names_them(site: Path) -> None:
    r = cli(site, "tgs")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["library/tgs:1.0", "library/tgs:2.0", "library/tgs:2.1"]
    doc = json.loads(cli(site, "tgs", "--json").stdout)
    assert doc["tags"] == ["1.0", "2.0", "2.1"] and doc["repository"].endswith("/library/tgs")


@pytest.mark.parametrize("text", ["tgs:2.0", "tgs@sha256:" + "a" * 64])
def test_a_tag_or_digest_is_bad_input(site: Path, text: str) -> None:
    r = cli(site, text)
    assert r.returncode == 2 and r.stderr.startswith("tfimage: tags: ")
    assert "without a tag or digest" in r.stderr


def test_a_missing_repository_is_said_in_one_line(site: Path) -> None:
    r = cli(site, "nothere")
    assert r.returncode == 3, r.stderr
    assert r.stderr.endswith("/library/nothere: no such repository, or not readable with the "
                             "credentials used\n")  # fmt: skip


def test_a_refused_repository_reads_as_a_missing_one(site: Path) -> None:
    cfg = load_config(site)
    with pytest.raises(ImageNotFound) as refused:
        tags(cfg, "secret/model", uid=NOBODY)
    with pytest.raises(ImageNotFound) as missing:
        tags(cfg, "secret/nothere", uid=NOBODY)
    assert str(refused.value) == str(missing.value).replace("nothere", "model")
    # root, as the rules let it, sees the same repository's tags
    assert tags(cfg, "secret/model", uid=0)[1] == ["1"]

"""A Docker Hub name, as users type it from habit, on a site without a Docker Hub
proxy: said so, with what to do, rather than "not allowed" or a bare "not found"."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import Registry
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import ImageNotFound, ImageReferenceError
from tfimage.agent.submit.pin import pin


@pytest.mark.parametrize(
    "text",
    ["docker.io/tensorflow/tensorflow:2.16.1", "index.docker.io/library/ubuntu:22.04"],
)
def test_a_docker_hub_host_without_a_proxy_says_so(registry: Registry, tmp_path: Path,
                                                    text: str) -> None:  # fmt: skip
    cfg = load_config(registry.write_site(tmp_path))
    with pytest.raises(ImageReferenceError) as e:
        cfg.reference(text)
    assert "this site has no Docker Hub proxy; copy the image to " + registry.host in str(e.value)
    assert "not allowed" not in str(e.value)


def test_a_docker_name_not_found_without_a_proxy_says_where_it_was_looked_up(
    registry: Registry, tmp_path: Path
) -> None:
    cfg = load_config(registry.write_site(tmp_path))
    with pytest.raises(ImageNotFound) as e:
        pin(cfg, cfg.reference("docker://tensorflow/tensorflow:latest-gpu"), store=tmp_path / "s")
    assert str(e.value) == (
        f"{registry.host}/tensorflow/tensorflow: no such repository, or not readable with "
        "the credentials used (this site has no Docker Hub proxy: docker://NAME is looked "
        f"up in {registry.host}; copy the image there, or ask your admins for a proxy)"
    )


def test_with_a_proxy_a_missing_docker_name_gets_no_such_hint(
    registry: Registry, tmp_path: Path
) -> None:
    path = registry.write_site(tmp_path)
    path.write_text(path.read_text() + "dockerhub_project: dockerhub\n")
    cfg = load_config(path)
    with pytest.raises(ImageNotFound) as e:
        pin(cfg, cfg.reference("docker://tensorflow/tensorflow:latest-gpu"), store=tmp_path / "s")
    assert "/dockerhub/tensorflow/tensorflow: no such repository" in str(e.value)
    assert "Docker Hub proxy" not in str(e.value)

"""A robot per project: the credentials file keys a robot by ``host/project`` as
well as by host, the most specific wins, and a real per-project auth proxy
(Debian's nginx in front of the registry) refuses every other robot, so no node
credential need read every project."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from support import TEAM_ROBOT, Registry
from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import CredentialsError, RegistryError
from tfimage.agent.registry.access import client_for
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.registry.credentials import Credential, load_credentials


def _robot(reg: Registry, user: str, password: str) -> RegistryClient:
    return RegistryClient(reg.host, Credential(user, password), ca_bundle=str(reg.ca))


def _site(reg: Registry, d: Path, *, team_key: bool) -> Path:
    cfg = reg.write_site(d)
    creds = d / "credentials.yaml"
    text = creds.read_text()
    if team_key:
        text += (
            f'  "{reg.host}/team-a":\n    username: "{TEAM_ROBOT[0]}"\n'
            f'    password: "{TEAM_ROBOT[1]}"\n'
        )
    creds.write_text(text)
    return cfg


def test_the_proxy_gives_each_robot_its_own_project_and_no_other(
    project_registry: Registry, make_sif: Callable[[dict[str, str]], Path]
) -> None:
    site = project_registry.client()
    team = _robot(project_registry, *TEAM_ROBOT)
    team.push_sif("team-a/sdk", "1", make_sif({"etc/x": "team\n"}))
    site.push_sif("library/base", "1", make_sif({"etc/x": "site\n"}))
    assert team.manifest("team-a/sdk", "1").digest.startswith("sha256:")
    assert site.manifest("library/base", "1").digest.startswith("sha256:")
    with pytest.raises(RegistryError) as e1:
        site.manifest("team-a/sdk", "1")
    with pytest.raises(RegistryError) as e2:
        team.manifest("library/base", "1")
    host = project_registry.host
    assert str(e1.value) == f"{host}: authentication refused for repository:team-a/sdk:pull"
    assert str(e2.value) == f"{host}: authentication refused for repository:library/base:pull"


def test_a_node_reads_each_project_with_its_robot_and_the_rest_with_the_hosts(
    project_registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    team_sif = make_sif({"etc/x": "team-a's\n"})
    site_sif = make_sif({"etc/x": "everyone's\n"})
    _robot(project_registry, *TEAM_ROBOT).push_sif("team-a/tiny", "1.0", team_sif)
    project_registry.client().push_sif("library/tiny", "1.0", site_sif)
    cfg = load_config(_site(project_registry, tmp_path, team_key=True))
    creds = load_credentials(cfg.credentials)
    assert sorted(creds) == [project_registry.host, f"{project_registry.host}/team-a"]
    client = client_for(cfg, project_registry.host)
    assert client.credential_for("team-a/tiny") == Credential(*TEAM_ROBOT)
    assert client.credential_for("team-ab/tiny") == client.credential_for("library/tiny")
    puller = Puller(ImageCache(cfg))
    assert puller.ensure(cfg.reference("team-a/tiny:1.0")).path.read_bytes() == (
        team_sif.read_bytes()
    )
    assert puller.ensure(cfg.reference("tiny:1.0")).path.read_bytes() == site_sif.read_bytes()
    # With the host's robot alone the team's project is out of reach.
    (tmp_path / "host-only").mkdir()
    only = load_config(_site(project_registry, tmp_path / "host-only", team_key=False))
    with pytest.raises(RegistryError) as e3:
        Puller(ImageCache(only)).ensure(only.reference("team-a/tiny:1.0"))
    assert str(e3.value) == (
        f"{project_registry.host}: authentication refused for repository:team-a/tiny:pull"
    )


@pytest.mark.parametrize("key", ["harbor.example/Team-A", "harbor.example//x", "a b/team"])
def test_a_key_that_is_no_host_or_host_and_project_is_refused_in_one_line(
    tmp_path: Path, key: str
) -> None:
    path = tmp_path / "credentials.yaml"
    path.write_text(f'registries:\n  "{key}":\n    username: u\n    password: p\n')
    path.chmod(0o600)
    with pytest.raises(CredentialsError) as e:
        load_credentials(path)
    assert "is not a registry host or host/project" in str(e.value)
    assert "\n" not in str(e.value) and "password" not in str(e.value).replace(
        "username and password", ""
    )

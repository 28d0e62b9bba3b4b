from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tfimage.agent.core.errors import CredentialsError
from tfimage.agent.registry.credentials import load_credentials


def test_private_file_loads_and_hides_password(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text('registries:\n  "reg:5000":\n    username: "robot$proj+ci"\n    password: "pw1"\n')
    p.chmod(0o600)
    creds = load_credentials(p)
    assert creds["reg:5000"].username == "robot$proj+ci"
    assert creds["reg:5000"].password == "pw1"
    assert "pw1" not in repr(creds)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o620, 0o602, 0o660, 0o606])
def test_readable_or_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("registries: {}\n")
    p.chmod(mode)
    with pytest.raises(CredentialsError, match="chmod 0600"):
        load_credentials(p)


def test_symlink_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real.yaml"
    real.write_text("registries: {}\n")
    real.chmod(0o600)
    (tmp_path / "link.yaml").symlink_to(real)
    with pytest.raises(CredentialsError) as e:
        load_credentials(tmp_path / "link.yaml")
    assert (
        str(e.value) == f"{tmp_path / 'link.yaml'}: cannot open: Too many levels of symbolic links"
    )


def test_absent_file_means_anonymous(tmp_path: Path) -> None:
    assert load_credentials(tmp_path / "none.yaml") == {}


def test_docker_config_json(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    auth = base64.b64encode(b"robot$x+y:pw:with:colons").decode()
    p.write_text(json.dumps({"auths": {"https://reg.site/": {"auth": auth}}}))
    p.chmod(0o600)
    c = load_credentials(p)["reg.site"]
    assert (c.username, c.password) == ("robot$x+y", "pw:with:colons")


def test_json_syntax_is_read_without_a_yaml_parser(tmp_path: Path) -> None:
    p = tmp_path / "credentials.yaml"
    p.write_text('{"registries": {"h:5000": {"username": "robot$x+y", "password": "pw"}}}\n')
    p.chmod(0o600)
    code = (
        "import sys; from tfimage.agent.registry.credentials import load_credentials; "
        f"c = load_credentials({str(p)!r}); print(c['h:5000'].username, 'yaml' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["robot$x+y", "False"]


def test_a_requests_hop_never_shows_its_credentials_in_a_repr() -> None:
    """A hop logged or shown in a traceback's locals must not carry the password."""
    from tfimage.agent.registry.transport import _Hop

    hop = _Hop("GET", "https://reg/v2/", {"Authorization": "Basic czNjcmV0"}, ("robot", "s3cret"),
               (1.0, 2.0), True, None)  # fmt: skip
    assert "s3cret" not in repr(hop) and "czNjcmV0" not in repr(hop)
    assert "https://reg/v2/" in repr(hop)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("registries: {}\n")
    p.chmod(0o600)
    os.chown(p, 65534, 65534)
    with pytest.raises(CredentialsError) as e:
        load_credentials(p)
    assert str(e.value) == f"{p}: not owned by uid 0"

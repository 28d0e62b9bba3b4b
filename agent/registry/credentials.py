"""Registry credentials: a root-owned YAML file of mode 0600, or a docker config.json.

    registries:
      harbor.example:
        username: robot$library+puller
        password: "..."
      harbor.example/team-a:             # a project's own robot
        username: robot$team-a+puller
        password: "..."

A key names a registry host, or a host and a repository path under it (a Harbor
project): for a repository the most specific key wins (``harbor.example/team-a``
for ``team-a/tiny``; ``harbor.example`` for ``library/tiny``), so each team's
project is read with its own robot and no node credential need read them all.

Credentials never go to logs, to a job's environment, or into exception text.
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from tfimage.agent.core.errors import CredentialsError


@dataclass(frozen=True, slots=True)
class Credential:
    username: str
    password: str

    def __repr__(self) -> str:  # keep secrets out of tracebacks and logs
        return f"Credential(username={self.username!r}, password=<hidden>)"


def _read_private(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CredentialsError(f"{path}: cannot open: {e.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CredentialsError(f"{path}: not a regular file")
        if st.st_mode & 0o077:
            raise CredentialsError(
                f"{path}: mode {stat.S_IMODE(st.st_mode):04o} is readable by others; chmod 0600 it"
            )
        if st.st_uid != os.geteuid():
            raise CredentialsError(f"{path}: not owned by uid {os.geteuid()}")
        return f.read()


# host[:port], then optionally the repository path a project's robot reads.
_KEY = re.compile(r"[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[a-z0-9][a-z0-9._-]*)*\Z")


def load_credentials(path: str | Path) -> dict[str, Credential]:
    """Credentials by registry host, or ``host/project`` (the most specific key
    wins: registry/auth.py); an absent file means anonymous access."""
    p = Path(path)
    try:
        text = _read_private(p)
    except FileNotFoundError:
        return {}
    if p.name.endswith(".json"):
        return _from_docker_config(p, text)
    if text.lstrip().startswith("{"):
        # JSON is YAML too; parsed as such it spares srun's path the ~25 ms that
        # importing a YAML parser costs (the role writes the site's file this way).
        try:
            data = json.loads(text)
        except ValueError:
            raise CredentialsError(f"{p}: not valid JSON") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError:
            raise CredentialsError(f"{p}: not valid YAML") from None
    regs = data.get("registries") if isinstance(data, dict) else None
    if not isinstance(regs, dict):
        raise CredentialsError(f"{p}: expected a 'registries' mapping")
    out: dict[str, Credential] = {}
    for host, entry in regs.items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("username"), str)
            or not isinstance(entry.get("password"), str)
        ):
            raise CredentialsError(f"{p}: entry for {host!r} needs username and password")
        if "/" in str(host) and not _KEY.match(str(host)):
            raise CredentialsError(
                f"{p}: {str(host)[:80]!r} is not a registry host or host/project"
            )
        out[str(host)] = Credential(entry["username"], entry["password"])
    return out


def _from_docker_config(p: Path, text: str) -> dict[str, Credential]:
    try:
        auths = json.loads(text).get("auths", {})
        out = {}
        for host, entry in auths.items():
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            out[host.removeprefix("https://").rstrip("/")] = Credential(user, password)
        return out
    except (ValueError, KeyError, AttributeError, TypeError):
        raise CredentialsError(f"{p}: not a valid docker config.json") from None

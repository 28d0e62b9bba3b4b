"""A registry client for a host, with this node's (or this user's) credentials.

Root uses the site's credentials file; a user pinning at submit uses their own.
The stdlib transport (``light``) serves all a node does: pinning at submit,
manifests, downloads (no ``requests`` import on a job's launch path).
"""

from __future__ import annotations

import os
from pathlib import Path

from tfimage.agent.core.config import Config
from tfimage.agent.registry.client import RegistryClient


def credentials_file(cfg: Config) -> Path | None:
    """Root uses the site's file; a user (submitting, on a login node) uses their own."""
    if os.geteuid() == 0:
        return Path(cfg.credentials)
    import pwd

    home = Path(pwd.getpwuid(os.geteuid()).pw_dir)
    for candidate in (home / ".config/tfimage/credentials.yaml", home / ".docker/config.json"):
        if candidate.exists():
            return candidate
    return None  # anonymous pulls


def client_for(cfg: Config, host: str, *, light: bool = False) -> RegistryClient:
    """A client for ``host`` with this node's credentials.  ``light``: the stdlib
    transport, for all a node does (no ``requests``: transport.py); pushes use the
    default."""
    from tfimage.agent.registry.credentials import load_credentials

    path = credentials_file(cfg)
    creds = load_credentials(path) if path else {}
    transport = None
    if light:
        from tfimage.agent.registry.transport import StdlibTransport

        transport = StdlibTransport()
    prefix = f"{host}/"
    projects = {k.removeprefix(prefix): c for k, c in creds.items() if k.startswith(prefix)}
    return RegistryClient(
        host,
        creds.get(host),
        projects=projects,
        ca_bundle=cfg.ca_bundle,
        connect_timeout=cfg.connect_timeout,
        read_timeout=cfg.read_timeout,
        # Shedding load ends where a slow answer would: at the hook's deadline.
        busy_for=cfg.hook_deadline,
        transport=transport,
        token_realms=cfg.token_realms,
    )

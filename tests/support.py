"""Types shared by the fixtures and the tests."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from tfimage.agent.credentials import Credential
from tfimage.agent.registry import RegistryClient
from tfimage.agent.sif import build_commands
from tfimage.agent.transport import Transport

T = TypeVar("T")


def build_sif(root: Path, sif: Path) -> Path:
    """A real SIF of the directory tree ``root``, made the way the converter makes one."""
    for argv in build_commands(root, sif.with_suffix(".sqfs"), sif):
        subprocess.run(argv, check=True, capture_output=True, timeout=120)
    return sif


@dataclass(frozen=True)
class Registry:
    host: str
    ca: Path
    username: str
    password: str

    def client(
        self, *, password: str | None = None, transport: Transport | None = None
    ) -> RegistryClient:
        """A client with the test account's credentials (or ``password``), trusting the
        test CA; the client's default transport unless one is given."""
        return RegistryClient(
            self.host,
            Credential(self.username, password or self.password),
            ca_bundle=str(self.ca),
            transport=transport,
        )

    def write_site(self, d: Path, **extra: str) -> Path:
        """A tfimage config + credentials for this registry; returns the config path."""
        creds = d / "credentials.yaml"
        creds.write_text(
            f'registries:\n  "{self.host}":\n    username: "{self.username}"\n'
            f'    password: "{self.password}"\n'
        )
        creds.chmod(0o600)
        lines = [
            f'registry: "{self.host}"',
            "project: library",
            f"ca_bundle: {self.ca}",
            f"credentials: {creds}",
            f"cache_dir: {d / 'cache'}",
            f"state_dir: {d / 'state'}",
        ]
        lines += [f"{k}: {v}" for k, v in extra.items()]
        cfg = d / "config.yaml"
        cfg.write_text("\n".join(lines) + "\n")
        return cfg


def need(*tools: str) -> None:
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (make venv installs them)")


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, timeout=120)


def push_oci_image(registry: Registry, d: Path, repo: str) -> None:
    """busybox, a marker, Env FOO=bar and a working directory, as an OCI image."""
    lay, bundle = d / "layout", d / "bundle"
    _run("umoci", "init", "--layout", str(lay))
    _run("umoci", "new", "--image", f"{lay}:t")
    _run("umoci", "unpack", "--image", f"{lay}:t", str(bundle))
    rootfs = bundle / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "etc").mkdir(exist_ok=True)
    shutil.copy("/bin/busybox", rootfs / "bin" / "busybox")
    (rootfs / "bin" / "sh").symlink_to("busybox")
    (rootfs / "etc" / "tfimage-test-image").write_text("oci-marker\n")
    _run("umoci", "repack", "--image", f"{lay}:t", str(bundle))
    _run(
        "umoci",
        "config",
        "--image",
        f"{lay}:t",
        "--config.env",
        "FOO=bar",
        "--config.workingdir",
        "/etc",
        "--config.cmd",
        "/bin/sh",
    )
    auth = d / "auth.json"
    token = base64.b64encode(f"{registry.username}:{registry.password}".encode()).decode()
    auth.write_text(json.dumps({"auths": {registry.host: {"auth": token}}}))
    certs = d / "certs"
    certs.mkdir()
    shutil.copy(registry.ca, certs / "ca.crt")
    _run(
        "skopeo",
        "copy",
        "--quiet",
        "--dest-authfile",
        str(auth),
        "--dest-cert-dir",
        str(certs),
        f"oci:{lay}:t",
        f"docker://{registry.host}/{repo}:1",
    )


def at_once(call: Callable[[], T], n: int) -> tuple[list[T], list[BaseException]]:
    """Run ``call`` in ``n`` threads at once; its results and what it raised."""
    results: list[T] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            results.append(call())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors

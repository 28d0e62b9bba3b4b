"""Types shared by the fixtures and the tests."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from tfimage.agent.core.sif import build_commands
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.registry.credentials import Credential
from tfimage.agent.registry.transport import Transport

T = TypeVar("T")


def busybox_sif(d: Path, marker: str, comp: str = "lz4", payload_mib: int = 0) -> Path:
    """A real SIF with busybox and a marker, like tiny:1.0 but ours to re-tag (its
    squashfs compressed with ``comp``), and ``payload_mib`` MiB of random bytes in
    ``/payload`` where a size is wanted (bench/stage.py)."""
    root = d / f"root-{marker}"
    (root / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    for app in ("sh", "cat"):
        (root / "bin" / app).symlink_to("busybox")
    for sub in ("etc", "home", "proc", "sys", "dev", "tmp"):
        (root / sub).mkdir(exist_ok=True)
    (root / "etc" / "hosts").write_text("")
    (root / "etc" / "resolv.conf").write_text("")
    (root / "etc" / "tfimage-test-image").write_text(marker + "\n")
    if payload_mib:
        with (root / "payload").open("wb") as f:
            for _ in range(payload_mib):
                f.write(os.urandom(1 << 20))
    return build_sif(root, d / f"{marker}.sif", comp)


def build_sif(root: Path, sif: Path, comp: str = "lz4") -> Path:
    """A real SIF of the directory tree ``root``, made the way the converter makes one
    (with mksquashfs's compressor ``comp``)."""
    for argv in build_commands(root, sif.with_suffix(".sqfs"), sif, comp):
        subprocess.run(argv, check=True, capture_output=True, timeout=120)
    return sif


TEAM_ROBOT = ("robot$team-a+puller", "team-a-pass")  # team-a's own Harbor robot


@dataclass(frozen=True)
class Registry:
    host: str
    ca: Path
    username: str
    password: str
    token_realms: tuple[str, ...] = ()  # its token service's host:port, when not its own

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
            token_realms=self.token_realms,
        )

    def manifest_bytes(self, repository: str, tag: str) -> bytes:
        """The manifest the registry itself serves for ``repository:tag``, fetched with
        the standard library alone, so that a test's expected value never comes
        from tfimage's own client or cache."""
        import ssl
        import urllib.request

        accept = (
            "application/vnd.oci.image.manifest.v1+json, "
            "application/vnd.docker.distribution.manifest.v2+json, "
            "application/vnd.oci.image.index.v1+json"
        )
        token = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        req = urllib.request.Request(
            f"https://{self.host}/v2/{repository}/manifests/{tag}",
            headers={"Accept": accept, "Authorization": f"Basic {token}"},
        )
        ctx = ssl.create_default_context(cafile=str(self.ca))
        with urllib.request.urlopen(req, context=ctx, timeout=30) as resp:
            body: bytes = resp.read()
        return body

    def digest_of(self, repository: str, tag: str) -> str:
        """The digest the registry serves for ``repository:tag``: its manifest's sha256."""
        import hashlib

        return "sha256:" + hashlib.sha256(self.manifest_bytes(repository, tag)).hexdigest()

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
            # never the host's own (usage/record.py, usage/metrics.py)
            f"usage_log: {d / 'usage.jsonl'}",
            f"metrics_dir: {d / 'metrics'}",
        ]
        if self.token_realms:
            lines.append(f"token_realms: {list(self.token_realms)}")
        lines += [f"{k}: {v}" for k, v in extra.items()]
        cfg = d / "config.yaml"
        cfg.write_text("\n".join(lines) + "\n")
        return cfg


def hook_site(tmp_path: Path, **extra: object) -> Path:
    """A node's config for the hooks' tests, everything under ``tmp_path`` (never the
    host's own log or metrics): an unreachable registry unless ``extra`` says
    otherwise."""
    settings: dict[str, object] = {
        "registry": "r.invalid",
        "cache_dir": tmp_path / "cache",
        "state_dir": tmp_path / "state",
        "hook_log": tmp_path / "hooks.log",
        "usage_log": tmp_path / "usage.jsonl",
        "metrics_dir": tmp_path / "metrics",
        "connect_timeout": 2,
        "read_timeout": 5,
        **extra,
    }
    cfg = tmp_path / "config.yaml"
    # JSON is YAML too; paths as strings.
    cfg.write_text(
        json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in settings.items()})
    )
    return cfg


def need(*tools: str) -> None:
    """Skip, saying why, where ``tools`` are missing; in strict mode (skipbudget.py)
    fail instead: a CI machine installs everything (.ci/run), so a missing tool is a
    broken step."""
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        why = f"needs {', '.join(missing)} (make venv and deploy/local/packages.sh install them)"
        from skipbudget import strict  # here: conftest loads it as a plugin first

        if strict():
            pytest.fail(f"{why}; strict mode (CI): a missing tool is a failure, not a skip")
        pytest.skip(why)


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, timeout=120)


def push_oci_image(
    registry: Registry,
    d: Path,
    repo: str,
    *,
    setup: Callable[[Path], None] | None = None,
    env: tuple[str, ...] = ("FOO=bar",),
) -> None:
    """busybox, a marker, Env FOO=bar and a working directory, as an OCI image;
    ``setup`` may add to its root filesystem (links, setuid files, devices) and
    ``env`` replaces its Env."""
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
    if setup:
        setup(rootfs)
    _run("umoci", "repack", "--image", f"{lay}:t", str(bundle))
    _run(
        "umoci",
        "config",
        "--image",
        f"{lay}:t",
        *[a for e in env for a in ("--config.env", e)],
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


def ask_daemon(path: Path, *args: str, timeout: float = 20) -> tuple[int, str, bytes]:
    """One request to a daemon socket, as spank/client.c sends it: (status, stderr,
    stdout); struct.error when it closed without an answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(b"TFI1\0" + b"".join(a.encode() + b"\0" for a in args))
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status, elen = struct.unpack(">iI", data[:8])
    return status, data[8 : 8 + elen].decode(), data[8 + elen :]


@contextlib.contextmanager
def started_daemon(
    tmp_path: Path, config: str, env: dict[str, str] | None = None
) -> Iterator[tuple[Path, Path, subprocess.Popen[bytes]]]:
    """A daemon on a config (``{run}``: its state dir), in ``env`` (default: ours);
    yields its run dir, the config and the process."""
    # Under /run, not pytest's 0700 tmp: another uid must be able to reach the socket.
    run = Path(f"/run/tfimage-test-{os.getpid()}-{tmp_path.name}")
    run.mkdir()
    run.chmod(0o755)  # root-owned, searchable: what a node's /run/tfimage is
    cfg = tmp_path / "config.yaml"
    cfg.write_text(config.replace("{run}", str(run)))
    log = tmp_path / "daemon.log"
    p = subprocess.Popen(
        [sys.executable, "-m", "tfimage.main", "--config", str(cfg), "daemon"],
        stderr=log.open("w"),
        env=env,
    )
    for _ in range(100):
        if "pinning on" in log.read_text():
            break
        time.sleep(0.05)
    try:
        assert (run / "pin.sock").exists(), log.read_text()
        assert (run / "daemon.sock").stat().st_mode & 0o777 == 0o600
        assert (run / "pin.sock").stat().st_mode & 0o777 == 0o666
        yield run, cfg, p
    finally:
        p.kill()
        p.wait()
        shutil.rmtree(run, ignore_errors=True)


EUID_C = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) { printf("%d\n", (int)geteuid()); return 0; }
"""


def add_privileges(root: Path, work: Path) -> None:
    """What a user could put into their own image: ``/bin/euid``, a setuid-root
    static program printing its effective uid, and ``/null``, a world-writable
    character device (1,3: /dev/null, so opening it would work)."""
    src = work / "euid.c"
    src.write_text(EUID_C)
    (root / "bin").mkdir(exist_ok=True)
    subprocess.run(
        ["gcc", "-static", "-O2", "-o", str(root / "bin/euid"), str(src)], check=True, timeout=120
    )
    (root / "bin/euid").chmod(0o4755)
    os.mknod(root / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.chmod(root / "null", 0o666)  # noqa: S103 - the hostile image under test


def flock_waiters(path: Path) -> int:
    """How many flock requests wait on ``path`` now (``/proc/locks``' blocked lines):
    what a test waits for instead of sleeping until others have queued."""
    ino = os.stat(path).st_ino
    return sum(
        1
        for line in Path("/proc/locks").read_text().splitlines()
        if "->" in line and line.split()[-3].endswith(f":{ino}")
    )


def wait_for(
    check: Callable[[], object], timeout: float = 30.0, what: str = "", interval: float = 0.02
) -> None:
    """Poll ``check`` every ``interval`` s until it holds (or fail the test after
    ``timeout`` s).  A check that asks Slurm wants a longer interval than 20 ms."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or check}")
        time.sleep(interval)


FIGURES = Path(__file__).resolve().parent.parent / "build" / "figures.txt"


def report_figure(line: str) -> None:
    """Keep a measurement a closing note quotes (``build/figures.txt``): run-all.sh
    prints each at its end, so a CI log, this host's or the other's, carries them
    where pytest -q would have hidden a print."""
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    with FIGURES.open("a") as f:
        f.write(line.replace("\n", " ").strip() + "\n")


def children(pid: int) -> list[int]:
    """``pid``'s children, of any of its threads: slurmd forks a prolog from a thread
    of its own, whose children /proc/PID/task/PID/children does not list."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out += [int(c) for c in (task / "children").read_text().split()]
    return out

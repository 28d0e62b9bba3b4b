"""`tfimage daemon`: a real daemon process on a real socket, spoken to as the plugin does."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the daemon runs as root: run as root")


def _ask(path: Path, *args: str) -> tuple[int, str, bytes]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(path))
        s.sendall(b"TFI1\0" + b"".join(a.encode() + b"\0" for a in args))
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status, elen = struct.unpack(">iI", data[:8])
    return status, data[8 : 8 + elen].decode(), data[8 + elen :]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    # Under /run, not pytest's 0700 tmp: another uid must be able to reach the socket.
    run = Path(f"/run/tfimage-test-{os.getpid()}-{tmp_path.name}")
    run.mkdir()
    run.chmod(0o755)  # root-owned, searchable: what a node's /run/tfimage is
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"registry: r.example\nstate_dir: {run}\ncache_dir: {tmp_path / 'cache'}\n")
    log = tmp_path / "daemon.log"
    p = subprocess.Popen(
        [sys.executable, "-m", "tfimage.agent.cli", "--config", str(cfg), "daemon"],
        stderr=log.open("w"),
    )
    sock = run / "daemon.sock"
    for _ in range(100):
        if sock.exists():
            break
        time.sleep(0.05)
    try:
        assert sock.exists(), log.read_text()
        assert sock.stat().st_mode & 0o777 == 0o600
        yield sock, cfg
    finally:
        p.kill()
        p.wait()
        shutil.rmtree(run, ignore_errors=True)


def test_step_prepare_answers_with_status_and_the_reason(daemon: tuple[Path, Path]) -> None:
    sock, cfg = daemon
    status, err, out = _ask(
        sock,
        "--config",
        str(cfg),
        "step-prepare",
        "--job",
        "7",
        "--step",
        "0",
        "--uid",
        "1000",
        "--image",
        "tiny:1.0",
        "--layout",
        "SLURM_NODEID=0",
    )
    assert status == 1 and out == b""
    assert err.strip() == "tfimage: step-prepare: unexpected --layout 'SLURM_NODEID'"


def test_only_step_prepare_is_served(daemon: tuple[Path, Path]) -> None:
    sock, cfg = daemon
    status, err, _ = _ask(sock, "--config", str(cfg), "push", "/etc/passwd", "x:1")
    assert status == 70 and "command 'push' is not served" in err
    status, err, _ = _ask(sock, "--config", str(cfg), "doctor")
    assert status == 70 and "not served" in err


def test_a_non_root_peer_gets_nothing(daemon: tuple[Path, Path], tmp_path: Path) -> None:
    sock, _ = daemon
    client = (
        "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
        "s.sendall(b'TFI1\\0step-prepare\\0'); s.shutdown(socket.SHUT_WR)\n"
        "try: print(len(s.recv(100)))\n"
        "except ConnectionResetError: print(0)"
    )
    nobody = {"user": 65534, "group": 65534, "capture_output": True, "text": True}
    # Another uid cannot even open the socket (mode 0600)...
    r = subprocess.run(["/usr/bin/python3", "-c", client, str(sock)], **nobody, check=False)  # type: ignore[call-overload]
    assert r.returncode != 0 and "Permission denied" in r.stderr
    # ...and with the mode opened up, the peer check refuses it.
    os.chmod(sock, 0o666)  # noqa: S103 - to get past the mode and reach the uid check
    r = subprocess.run(
        ["/usr/bin/python3", "-c", client, str(sock)],
        user=65534,
        group=65534,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"  # closed without a word
    assert "refused a non-root peer" in (tmp_path / "daemon.log").read_text()

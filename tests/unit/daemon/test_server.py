"""`tfimage daemon`: a real daemon process on a real socket, spoken to as the plugin does."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support import Registry, ask_daemon, started_daemon
from tfimage.agent.daemon.server import MAX_PINS_PER_UID

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the daemon runs as root: run as root")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    conf = f"registry: r.example\nstate_dir: {{run}}\ncache_dir: {tmp_path / 'cache'}\n"
    conf += f"usage_log: {tmp_path / 'usage.jsonl'}\nmetrics_dir: {tmp_path / 'metrics'}\n"
    with started_daemon(tmp_path, conf) as (run, cfg, _):
        yield run / "daemon.sock", cfg


def test_step_prepare_answers_with_status_and_the_reason(daemon: tuple[Path, Path]) -> None:
    sock, cfg = daemon
    status, err, out = ask_daemon(
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


@pytest.mark.parametrize(("flag", "value"), [("--array-job", "7x"), ("--array-task", "-1")])
def test_step_prepare_refuses_an_array_id_that_is_not_a_number(
    daemon: tuple[Path, Path], flag: str, value: str
) -> None:
    sock, cfg = daemon
    argv = ["--config", str(cfg), "step-prepare", "--job", "7", "--step", "0", "--uid", "1000"]
    status, err, out = ask_daemon(sock, *argv, "--image", "tiny:1.0", f"{flag}={value}")
    assert status == 1 and out == b""
    assert err.strip() == f"tfimage: step-prepare: {flag} must be a number, not {value!r}"


def test_only_step_prepare_is_served(daemon: tuple[Path, Path]) -> None:
    sock, cfg = daemon
    status, err, _ = ask_daemon(sock, "--config", str(cfg), "push", "/etc/passwd", "x:1")
    assert status == 70 and "command 'push' is not served" in err
    status, err, _ = ask_daemon(sock, "--config", str(cfg), "doctor")
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


# --- the pin socket: any local user, one request shape -------------------------

ASK_AS_USER = """
import socket, struct, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])
s.sendall(b"TFI1\\0" + b"".join(a.encode() + b"\\0" for a in sys.argv[2:]))
s.shutdown(socket.SHUT_WR)
data = b""
while chunk := s.recv(65536):
    data += chunk
status, n = struct.unpack(">iI", data[:8])
print(status); print(data[8:8 + n].decode().strip()); print(data[8 + n:].decode().strip())
"""


@pytest.fixture
def resolving(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> Iterator[tuple[Path, str]]:
    up = registry.client()
    digest = up.push_sif("library/viad", "1", make_sif({"d": "1"}))
    site = registry.write_site(tmp_path).read_text()
    conf = "\n".join(
        "state_dir: {run}" if line.startswith("state_dir:") else line for line in site.splitlines()
    )
    with started_daemon(tmp_path, conf + "\n") as (run, _, _):
        yield run / "pin.sock", digest


def _as_nobody(sock: Path, *args: str) -> tuple[int, str, str]:
    r = subprocess.run(
        ["/usr/bin/python3", "-c", ASK_AS_USER, str(sock), *args],
        user=65534,
        group=65534,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    status, err, out = [*r.stdout.split("\n"), "", ""][:3]
    return int(status), err, out


def test_any_user_gets_a_tag_pinned(resolving: tuple[Path, str], registry: Registry) -> None:
    sock, digest = resolving
    args = ("submit-check", "--tf-mount=", "--job-image=", "--", "viad:1")
    assert _as_nobody(sock, *args) == (0, "", f"{registry.host}/library/viad:1@{digest}")
    status, err, out = _as_nobody(sock, *args[:-1], "Bad:Name:x")
    assert status == 2 and out == "" and err.startswith("tfimage: ")


def test_the_pin_server_serves_nothing_else(resolving: tuple[Path, str], tmp_path: Path) -> None:
    sock, _ = resolving
    for args in (
        ("--config", "/etc/shadow", "submit-check", "--tf-mount=", "--job-image=", "--", "x"),
        ("step-prepare", "--job", "1", "--step", "0", "--uid", "0", "--image", "x"),
        ("tfimage-prolog",),
    ):
        status, err, out = _as_nobody(sock, *args)
        assert (status, out) == (75, "") and "malformed request" in err, args
    assert "pin uid 65534 -> 75" in (tmp_path / "daemon.log").read_text()


FLOOD = """
import socket, struct, sys, time
conns = []
for _ in range(16):
    c = socket.socket(socket.AF_UNIX)
    c.connect(sys.argv[1])
    c.sendall(b"T")
    conns.append(c)
print("connected", flush=True)
end = time.monotonic() + 4
while time.monotonic() < end:  # a byte every 0.5 s, never the whole request
    for c in conns:
        try:
            c.send(b"F", socket.MSG_DONTWAIT)
        except OSError:
            pass
    time.sleep(0.5)
for c in conns:
    c.settimeout(2)
    data = b""
    try:
        while chunk := c.recv(4096):
            data += chunk
    except OSError:
        pass
    status, n = struct.unpack(">iI", data[:8]) if len(data) >= 8 else (-1, 0)
    print(status, data[8:8 + n].decode().strip())
"""


def test_one_users_flood_leaves_the_pin_server_to_everyone_else(
    resolving: tuple[Path, str],
) -> None:
    sock, _ = resolving
    flood = subprocess.Popen(
        ["/usr/bin/python3", "-c", FLOOD, str(sock)],
        user=65534,
        group=65534,
        extra_groups=[],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flood.stdout is not None
        assert flood.stdout.readline().strip() == "connected"
        # The daemon accepts in order: the 16 are looked at before the request below.
        # Another user (root here) is answered at once, not told "busy".
        t = time.monotonic()
        status, err, _ = ask_daemon(
            sock, "submit-check", "--tf-mount=", "--job-image=", "--", "B A D"
        )
        assert status == 2 and "invalid image reference" in err, err
        assert time.monotonic() - t < 1.0
        answers = flood.stdout.read().splitlines()
    finally:
        flood.kill()
        flood.wait()
    # The flooder held MAX_PINS_PER_UID workers, each dropped when its request
    # was not whole within RESOLVE_READ (however often bytes came); the rest: busy.
    dropped = [a for a in answers if "not complete within 2 s" in a]
    busy = [a for a in answers if a.endswith("busy")]
    assert (len(dropped), len(busy)) == (MAX_PINS_PER_UID, 16 - MAX_PINS_PER_UID)
    assert all(a.startswith("75 ") for a in answers), answers


def test_the_pin_server_is_never_fuller_than_its_slots(
    resolving: tuple[Path, str], tmp_path: Path
) -> None:
    sock, _ = resolving
    log = tmp_path / "daemon.log"
    # Connections that never finish their request each hold a worker (for 2 s); past
    # a user's share, the next one is told "busy" at once, without a fork.  The daemon
    # accepts in order, so the share is taken before the next one is looked at.
    held = []
    try:
        for _ in range(MAX_PINS_PER_UID):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(str(sock))
            c.sendall(b"TFI1\0")
            held.append(c)
        t = time.monotonic()
        status, err, _ = ask_daemon(sock, "submit-check", "--tf-mount=", "--job-image=", "--", "x")
        assert status == 75 and "busy" in err
        assert time.monotonic() - t < 1.0
        # The held workers give up on their own (the whole request within 2 s)...
        for _ in range(100):
            if log.read_text().count("pin uid 0 -> 75") >= MAX_PINS_PER_UID:
                break
            time.sleep(0.1)
        else:
            pytest.fail(log.read_text())
    finally:
        for c in held:
            c.close()
    # ...and once the daemon has reaped them (it looks every second), it serves again.
    for _ in range(50):
        status, err, _ = ask_daemon(
            sock, "submit-check", "--tf-mount=", "--job-image=", "--", "B A D"
        )
        if status != 75:
            break
        time.sleep(0.1)
    assert status == 2, err


def test_sigterm_stops_it_cleanly_leaving_no_socket(tmp_path: Path) -> None:
    conf = f"registry: r.example\nstate_dir: {{run}}\ncache_dir: {tmp_path / 'cache'}\n"
    conf += f"usage_log: {tmp_path / 'usage.jsonl'}\nmetrics_dir: {tmp_path / 'metrics'}\n"
    with started_daemon(tmp_path, conf) as (run, _, proc):
        proc.terminate()  # systemctl stop
        assert proc.wait(10) == 0
        assert list(run.iterdir()) == []  # clients find no socket, not a dead one


ASK = (
    "import socket, struct, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
    "s.sendall(b'TFI1\\0' + b''.join(a.encode() + b'\\0' for a in sys.argv[2:])); "
    "s.shutdown(socket.SHUT_WR); d = b''\n"
    "while c := s.recv(65536): d += c\n"
    "st, n = struct.unpack('>iI', d[:8]); print(st); print(d[8:8 + n].decode())"
)


def _as(uid: int, sock: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/usr/bin/python3", "-c", ASK, str(sock), *args],
        user=uid,
        group=uid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_stage_socket_serves_slurms_user_the_stage_hook_alone(tmp_path: Path) -> None:
    """PrologSlurmctld runs as Slurm's user: the stage socket (its, 0600) runs the stage
    hook for it as root, and nothing else; no one else may connect."""
    import pwd

    slurm = pwd.getpwnam("slurm").pw_uid  # Debian's slurm-wlm packages make it
    log = tmp_path / "hooks.log"
    conf = f"registry: r.example\nstate_dir: {{run}}\ncache_dir: {tmp_path / 'cache'}\n"
    conf += f"usage_log: {tmp_path / 'usage.jsonl'}\nmetrics_dir: {tmp_path / 'metrics'}\n"
    conf += f"hook_log: {log}\nstage_dir: {tmp_path / 'stage'}\nslurm_user: slurm\n"
    conf += "stage: true\nrecord_digest: false\n"
    with started_daemon(tmp_path, conf) as (run, cfg, _):
        sock = run / "stage.sock"
        st = sock.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (slurm, 0o600)
        hook = ["tfimage-stage", f"--config={cfg}", "--job=7", "--image=tiny:1.0",
                "--nodes=n[1-2]", "--uid=1001", "--gid=1001"]  # fmt: skip
        r = _as(slurm, sock, *hook)
        assert r.returncode == 0 and r.stdout.split("\n")[0] == "0", r.stderr
        # It ran as root (as Slurm's user it would say so), and got as far as the image.
        text = log.read_text()
        assert "job 7: stage: not pinned at submit; each node pulls for itself" in text, text
        r = _as(slurm, sock, "tfimage-prolog", f"--config={cfg}", "--job=7")
        assert r.stdout.split("\n")[:2] == [
            "70",
            "tfimage: daemon: only tfimage-stage is served on the stage socket",
        ], r.stdout
        r = _as(65534, sock, *hook)
        assert r.returncode != 0 and "Permission denied" in r.stderr

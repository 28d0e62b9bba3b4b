"""What a forked worker of the daemon (server.py) does with one connection.

Each worker serves one request and exits: it checks the peer, reads the request
whole within its bound, runs the route with fds 1 and 2 captured (a hook's or
``step-prepare``'s stdout is its answer, at most ``wire.MAX_ANSWER`` bytes; the
tail of stderr explains a failure) and writes the answer (wire.py, section 1).  On
the pin socket it answers through pinserver.py instead.  ``scrub_environment`` is
what every worker inherits from the daemon: the service's own environment,
nothing of whoever started it by hand.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from tfimage.agent.core import wire
from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import RequestError, TfimageError, cause
from tfimage.agent.core.logtext import oneline
from tfimage.agent.hooks import orphan

Route = Callable[[list[str]], int]

PIN_READ = 2.0  # seconds for a whole request on the users' socket
ROOT_READ = 10.0  # and on the root socket
MAX_REQUEST = 1 << 20
COMMANDS = frozenset({wire.STEP_PREPARE})
HOOKS = frozenset(wire.HOOKS)
CLI = "tfimage"  # the route for COMMANDS: the tfimage command's main
MAX_STDERR = 65536  # the tail of a failed request's stderr that its client replays
_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}


def scrub_environment() -> None:
    """Leave the daemon (and so every worker) only the service's environment.

    Root's own SLURM_CONF and LD_LIBRARY_PATH (the service's, never a job's) stay: the
    prolog's GPU gate drains through scontrol, which needs slurm.conf where it is not
    in its default place, and reads NVML in a child (gpu/child.py), which needs the
    driver where the site's service unit says it is."""
    kept = {k: os.environ.get(k, "") for k in ("SLURM_CONF", "LD_LIBRARY_PATH")}
    os.environ.clear()
    os.environ.update(_ENV)
    os.environ.update({k: v for k, v in kept.items() if v.startswith("/")})


def peer_uid(conn: socket.socket) -> int:
    return peer(conn)[1]


def peer(conn: socket.socket) -> tuple[int, int]:
    """The peer's (pid, uid), as the kernel saw them when it connected."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def _read_argv(conn: socket.socket, limit: int, timeout: float) -> list[str] | None:
    """A request's arguments, all of it within ``timeout`` seconds; None for a probe
    (``tfimage doctor`` connects, sends nothing)."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RequestError(f"daemon: request not complete within {timeout:g} s")
        conn.settimeout(left)
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            raise RequestError(f"daemon: request not complete within {timeout:g} s") from None
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise RequestError("daemon: request too large")
    return wire.decode_request(data)


def _read_request(conn: socket.socket) -> list[str] | None:
    """A root peer's request: a node hook or ``step-prepare``, nothing else."""
    argv = _read_argv(conn, MAX_REQUEST, ROOT_READ)
    if argv is None:
        return None
    if argv and argv[0] in HOOKS:
        return argv
    command = next((a for a in argv if not a.startswith("-") and a not in _option_values(argv)), "")
    if command not in COMMANDS:
        raise RequestError(f"daemon: command {command[:40]!r} is not served")
    return argv


def _option_values(argv: list[str]) -> set[str]:
    """Values of the global options before the command (``--config PATH``)."""
    return {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"}


class Trace:
    """--trace: each request and answer as a JSON line (argv as sent, stdout in
    base64: step-prepare's answer is NUL-separated)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def write(self, socket_kind: str, argv: list[str] | None, status: int, out: bytes) -> None:
        if self.path is None or argv is None:
            return
        line = json.dumps(
            {
                "socket": socket_kind,
                "argv": argv,
                "status": status,
                "stdout": base64.b64encode(out).decode(),
            }
        )
        with contextlib.suppress(OSError):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)


def work(
    conn: socket.socket,
    routes: Mapping[str, Route],
    trace: Trace,
    stage_peer: int | None = None,
) -> None:
    """In the forked worker: run one request with stdout and stderr captured.
    ``stage_peer`` (the stage socket's): Slurm's user's uid, whom it serves the
    controller's stage hook and nothing else, as it serves root."""
    started = time.monotonic()
    status, out, err = 70, b"", b""
    what = ["?"]
    hook = False
    argv: list[str] | None = None
    try:
        if peer_uid(conn) not in (0, stage_peer):
            print("tfimage: daemon: refused a non-root peer", file=sys.stderr, flush=True)
            return  # not root: say nothing
        argv = _read_request(conn)
        if argv is None:
            return
        if stage_peer is not None and argv[0] != wire.STAGE_HOOK:
            raise RequestError(f"only {wire.STAGE_HOOK} is served on the stage socket")
        hook = argv[0] in HOOKS
        if hook:  # its slurmd is its client's (tfimage-hook), not this daemon's parent
            orphan.watch_peer(peer(conn)[0])
        what = [argv[0] if hook else wire.STEP_PREPARE, *_ids(argv)]
        route: Route = routes[argv[0]] if hook else routes[CLI]
        status, out, err = _captured(route, argv[1:] if hook else argv)
    except Exception as e:  # the daemon's own trouble: one line, never a traceback
        err = f"tfimage: daemon: {cause(e)}\n".encode()
        status = 0 if hook else 70  # a hook's outcome is never the daemon's fault
    answer(conn, status, err, out)
    trace.write("root", argv, status, out)
    took = (time.monotonic() - started) * 1000
    print(
        f"tfimage: daemon: {oneline(' '.join(what))} -> {status} in {took:.0f} ms",
        file=sys.stderr,
        flush=True,
    )


def _ids(argv: list[str]) -> list[str]:
    """``job N step M`` from a request's ``--job=N --step=M`` (for the log line)."""
    out: list[str] = []
    for a in argv:
        for name in ("job", "step"):
            if a.startswith(f"--{name}="):
                out += [name, a.split("=", 1)[1]]
    return out[:4]


def _captured(route: Route, argv: list[str]) -> tuple[int, bytes, bytes]:
    """Run ``route(argv)`` with fds 1 and 2 captured: (status, stdout, the tail of
    stderr, which explains a failure)."""
    out_fd, err_fd = os.memfd_create("out"), os.memfd_create("err")
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    try:
        try:
            status = route(argv)
        except SystemExit as e:  # argparse's usage errors
            status = e.code if isinstance(e.code, int) else 2
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    out = os.pread(out_fd, wire.MAX_ANSWER, 0)
    size = os.fstat(err_fd).st_size
    err = os.pread(err_fd, MAX_STDERR, max(0, size - MAX_STDERR))
    return status, out, err


def pin(conn: socket.socket, cfg: Config, trace: Trace) -> None:
    """In the forked worker: pin one reference for any local user (pinserver.py)."""
    from tfimage.agent.daemon import pinserver

    started = time.monotonic()
    uid = -1
    argv: list[str] | None = None
    status, out, err = pinserver.RETRY_YOURSELF, "", ""
    try:
        uid = peer_uid(conn)
        argv = _read_argv(conn, pinserver.MAX_REQUEST, PIN_READ)
        if argv is None:
            return
        status, out, err = pinserver.answer(cfg, wire.decode_submit_check(argv), uid)
    except TfimageError as e:
        err = f"tfimage: {e}\n"
    except Exception as e:  # a bug: one line, and the plugin pins by itself
        err = f"tfimage: pin server: internal error: {type(e).__name__}: {e}\n"
    answer(conn, status, err.encode(), out.encode())
    trace.write("pin", argv, status, out.encode())
    took = (time.monotonic() - started) * 1000
    print(f"tfimage: daemon: pin uid {uid} -> {status} in {took:.0f} ms", file=sys.stderr)


def answer(conn: socket.socket, status: int, err: bytes, out: bytes) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(wire.encode_answer(status, err, out))

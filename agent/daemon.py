"""``tfimage daemon``: a warm, root-only helper for the plugin on a compute node.

Every step of a ``--tf-image`` job needs ``step-prepare`` as root on each node.  As
a fresh Python process that costs ~100 ms of interpreter start and imports before
any work; this daemon imports everything once and forks a worker per request,
which answers in a few milliseconds.  The plugin (spank/daemon.c) falls back to
running the helper itself whenever no daemon answers, so the daemon is an
accelerator, never a dependency.

Trust: the socket is created mode 0600 in a root-owned directory, and each peer's
uid is checked (SO_PEERCRED): only root (slurmstepd) is served.  Only the
``step-prepare`` command and the node hooks (``tfimage-prolog``/``-epilog``, via
spank/hook.c) are accepted, their arguments parsed by the same strict parsers as
when they run as programs.  Each worker runs under the config's hook deadline.

Protocol: see spank/daemon.c.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import struct
import sys
import time
from pathlib import Path

from tfimage.agent.errors import TfimageError

MAGIC = b"TFI1\0"
MAX_REQUEST = 1 << 20
COMMANDS = frozenset({"step-prepare"})
# The node hooks, run through spank/hook.c (tfimage-hook) from prolog.d/epilog.d.
HOOKS = frozenset({"tfimage-prolog", "tfimage-epilog"})
_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}


def _bind(path: Path) -> socket.socket:
    parent = path.parent
    st = parent.stat()
    if st.st_uid != 0 or st.st_mode & 0o022:
        raise TfimageError(f"daemon: {parent} must be owned by root and not writable by others")
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()  # a previous daemon's
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    s.listen(64)
    return s


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _read_request(conn: socket.socket) -> list[str] | None:
    """The request's arguments; None for a probe (``tfimage doctor`` connects, sends nothing)."""
    conn.settimeout(10)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
        if len(data) > MAX_REQUEST:
            raise TfimageError("daemon: request too large")
    if not data:
        return None
    if not data.startswith(MAGIC) or not data.endswith(b"\0"):
        raise TfimageError("daemon: malformed request")
    argv = [t.decode("utf-8", "surrogateescape") for t in data[len(MAGIC) : -1].split(b"\0")]
    if argv and argv[0] in HOOKS:
        return argv
    command = next((a for a in argv if not a.startswith("-") and a not in _option_values(argv)), "")
    if command not in COMMANDS:
        raise TfimageError(f"daemon: command {command[:40]!r} is not served")
    return argv


def _run(argv: list[str]) -> int:
    """The entry point a request names: a node hook, or the ``tfimage`` CLI."""
    if argv and argv[0] == "tfimage-prolog":
        from tfimage.prolog.main import main as prolog

        return prolog(argv[1:])
    if argv and argv[0] == "tfimage-epilog":
        from tfimage.epilog.main import main as epilog

        return epilog(argv[1:])
    from tfimage.agent.cli import main

    return main(argv)


def _option_values(argv: list[str]) -> set[str]:
    """Values of the global options before the command (``--config PATH``)."""
    return {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"}


def _work(conn: socket.socket) -> None:
    """In the forked worker: run one request with stdout and stderr captured."""
    started = time.monotonic()
    status, out, err = 70, b"", b""
    what = ["?"]
    try:
        if _peer_uid(conn) != 0:
            print("tfimage: daemon: refused a non-root peer", file=sys.stderr, flush=True)
            return  # not root: say nothing
        request = _read_request(conn)
        if request is None:
            return
        argv = request
        ids = [a for i, a in enumerate(argv) if i > 0 and argv[i - 1] in ("--job", "--step")]
        what = [argv[0] if argv[0] in HOOKS else "step-prepare", "job", *ids[:1]]
        what += ["step", *ids[1:2]] if len(ids) > 1 else []
        out_fd, err_fd = os.memfd_create("out"), os.memfd_create("err")
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        try:
            try:
                status = _run(argv)
            except SystemExit as e:  # argparse's usage errors
                status = e.code if isinstance(e.code, int) else 2
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
        out = os.pread(out_fd, MAX_REQUEST, 0)
        size = os.fstat(err_fd).st_size
        err = os.pread(err_fd, 65536, max(0, size - 65536))  # the tail explains
    except (TfimageError, OSError) as e:
        err = f"tfimage: {e}\n".encode()
        status = 70
    header = struct.pack(">iI", status, len(err))
    with contextlib.suppress(OSError):
        conn.sendall(header + err + out)
    took = (time.monotonic() - started) * 1000
    print(
        f"tfimage: daemon: {' '.join(what)[:200]} -> {status} in {took:.0f} ms",
        file=sys.stderr,
        flush=True,
    )


def serve(path: Path, deadline: float) -> int:
    # Everything a step needs, imported once, before the first request.
    import tfimage.agent.cli
    import tfimage.agent.step
    import tfimage.agent.tfenv
    import tfimage.epilog.main
    import tfimage.prolog.main  # noqa: F401

    os.environ.clear()
    os.environ.update(_ENV)
    sock = _bind(path)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    print(f"tfimage: daemon listening on {path}", file=sys.stderr, flush=True)
    while True:
        try:
            conn, _ = sock.accept()
        except InterruptedError:
            continue
        pid = os.fork()
        if pid == 0:
            sock.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.alarm(max(1, int(deadline)))
            try:
                _work(conn)
            finally:
                conn.close()
                os._exit(0)
        conn.close()

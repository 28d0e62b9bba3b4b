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
when they run as programs.  The hooks and step-prepare give up by themselves at
the config's ``hook_deadline``; the daemon kills a worker still running
``HOOK_GRACE`` seconds later, and its clients wait no longer than that either, so
no hook ever runs twice at once.  A hook's answer is 0 whatever went wrong inside
the daemon (hooklog.py: only a node fault may drain a node).

A second socket, ``resolve.sock`` (mode 0666), serves every local user one thing:
pinning a reference at submit (see pinserver.py for its request and its trust).
A request must arrive whole within ``RESOLVE_READ`` seconds (not per read: a byte
every second holds nothing for long); at most ``MAX_RESOLVERS`` run at once and at
most ``MAX_RESOLVERS_PER_UID`` for one user, so one user's flood leaves the other
slots to everyone else.  Beyond those, a request is answered "busy" at once and
the plugin pins by itself.

Protocol: see spank/daemon.c.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import stat
import struct
import sys
import time
from pathlib import Path

from tfimage.agent.config import HOOK_GRACE, Config
from tfimage.agent.errors import TfimageError
from tfimage.agent.logtext import oneline

MAGIC = b"TFI1\0"
MAX_RESOLVERS = 16
MAX_RESOLVERS_PER_UID = 4
RESOLVE_DEADLINE = 60  # seconds; the plugin gives up sooner (submit_timeout)
RESOLVE_READ = 2.0  # seconds for a whole request on the users' socket
ROOT_READ = 10.0  # and on the root socket
MAX_REQUEST = 1 << 20
COMMANDS = frozenset({"step-prepare"})
# The node hooks, run through spank/hook.c (tfimage-hook) from prolog.d/epilog.d.
HOOKS = frozenset({"tfimage-prolog", "tfimage-epilog"})
_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}


def _bind(path: Path, mode: int = 0o600) -> socket.socket:
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
    os.chmod(path, mode)
    s.listen(64)
    return s


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _read_argv(conn: socket.socket, limit: int, timeout: float) -> list[str] | None:
    """A request's arguments, all of it within ``timeout`` seconds; None for a probe
    (``tfimage doctor`` connects, sends nothing)."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TfimageError(f"daemon: request not complete within {timeout:g} s")
        conn.settimeout(left)
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            raise TfimageError(f"daemon: request not complete within {timeout:g} s") from None
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise TfimageError("daemon: request too large")
    if not data:
        return None
    if not data.startswith(MAGIC) or not data.endswith(b"\0"):
        raise TfimageError("daemon: malformed request")
    return [t.decode("utf-8", "surrogateescape") for t in data[len(MAGIC) : -1].split(b"\0")]


def _read_request(conn: socket.socket) -> list[str] | None:
    """A root peer's request: a node hook or ``step-prepare``, nothing else."""
    argv = _read_argv(conn, MAX_REQUEST, ROOT_READ)
    if argv is None:
        return None
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
    from tfimage.agent.cli.main import main

    return main(argv)


def _option_values(argv: list[str]) -> set[str]:
    """Values of the global options before the command (``--config PATH``)."""
    return {argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"}


def _work(conn: socket.socket) -> None:
    """In the forked worker: run one request with stdout and stderr captured."""
    started = time.monotonic()
    status, out, err = 70, b"", b""
    what = ["?"]
    hook = False
    try:
        if _peer_uid(conn) != 0:
            print("tfimage: daemon: refused a non-root peer", file=sys.stderr, flush=True)
            return  # not root: say nothing
        request = _read_request(conn)
        if request is None:
            return
        argv = request
        hook = argv[0] in HOOKS
        what = [argv[0] if hook else "step-prepare", *_ids(argv)]
        status, out, err = _captured(argv)
    except Exception as e:  # the daemon's own trouble: one line, never a traceback
        cause = str(e) if isinstance(e, TfimageError) else f"{type(e).__name__}: {e}"
        err = f"tfimage: daemon: {cause}\n".encode()
        status = 0 if hook else 70  # a hook's outcome is never the daemon's fault
    _answer(conn, status, err, out)
    took = (time.monotonic() - started) * 1000
    print(
        f"tfimage: daemon: {oneline(' '.join(what))} -> {status} in {took:.0f} ms",
        file=sys.stderr,
        flush=True,
    )


def _ids(argv: list[str]) -> list[str]:
    """``job N step M`` from a request's ``--job=N --step=M`` (for the log line)."""
    out: list[str] = []
    for i, a in enumerate(argv):
        for name in ("job", "step"):
            if a.startswith(f"--{name}="):
                out += [name, a.split("=", 1)[1]]
            elif a == f"--{name}" and i + 1 < len(argv):
                out += [name, argv[i + 1]]
    return out[:4]


def _captured(argv: list[str]) -> tuple[int, bytes, bytes]:
    """Run ``argv``'s entry point with fds 1 and 2 captured: (status, stdout, the
    tail of stderr, which explains a failure)."""
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
    err = os.pread(err_fd, 65536, max(0, size - 65536))
    return status, out, err


def _resolve(conn: socket.socket, cfg: Config) -> None:
    """In the forked worker: pin one reference for any local user (pinserver.py)."""
    from tfimage.agent.daemon import pinserver

    started = time.monotonic()
    uid = -1
    status, out, err = pinserver.RETRY_YOURSELF, "", ""
    try:
        uid = _peer_uid(conn)
        argv = _read_argv(conn, pinserver.MAX_REQUEST, RESOLVE_READ)
        if argv is None:
            return
        status, out, err = pinserver.answer(cfg, pinserver.parse_request(argv), uid)
    except (TfimageError, OSError) as e:
        err = f"tfimage: {e}\n"
    except Exception as e:  # a bug: one line, and the plugin pins by itself
        err = f"tfimage: resolver: internal error: {type(e).__name__}: {e}\n"
    _answer(conn, status, err.encode(), out.encode())
    took = (time.monotonic() - started) * 1000
    print(f"tfimage: daemon: resolve uid {uid} -> {status} in {took:.0f} ms", file=sys.stderr)


def _answer(conn: socket.socket, status: int, err: bytes, out: bytes) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(struct.pack(">iI", status, len(err)) + err + out)


def serve(path: Path, cfg: Config, resolve_path: Path | None = None) -> int:
    # Everything a step or a pin needs, imported once, before the first request
    # (a forked worker would otherwise import it again each time: the registry
    # client and its hashlib are ~8 ms).
    import tfimage.agent.cache.download
    import tfimage.agent.cli.main
    import tfimage.agent.daemon.pinserver
    import tfimage.agent.registry.client
    import tfimage.agent.registry.credentials
    import tfimage.agent.registry.transport
    import tfimage.agent.step.binds
    import tfimage.agent.step.plan
    import tfimage.agent.step.taskenv
    import tfimage.agent.submit.pin
    import tfimage.epilog.main
    import tfimage.prolog.main  # noqa: F401

    os.environ.clear()
    os.environ.update(_ENV)
    listeners = {_bind(path): "root"}
    if resolve_path is not None:
        listeners[_bind(resolve_path, 0o666)] = "resolve"
    sel = selectors.DefaultSelector()
    for sock, kind in listeners.items():
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, (sock, kind))
    print(f"tfimage: daemon listening on {path}", file=sys.stderr, flush=True)
    if resolve_path is not None:
        print(f"tfimage: daemon resolving on {resolve_path}", file=sys.stderr, flush=True)
    parent = os.getpid()
    # systemctl stop (SIGTERM): leave no socket behind for clients to find dead.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        _loop(sel, listeners, cfg)
    finally:
        if os.getpid() == parent:
            for p in (path, resolve_path):
                if p is not None:
                    with contextlib.suppress(OSError):
                        p.unlink()
    return 0


class _Workers:
    """The forked workers: when each must be done by, and whose pin each serves."""

    def __init__(self) -> None:
        self.due: dict[int, float] = {}
        self.resolving: dict[int, int] = {}  # pid -> the peer's uid

    def add(self, pid: int, limit: float, uid: int | None) -> None:
        self.due[pid] = time.monotonic() + limit
        if uid is not None:
            self.resolving[pid] = uid

    def busy(self, uid: int) -> bool:
        """Whether a pin for ``uid`` must wait: all slots taken, or this user's."""
        mine = sum(1 for u in self.resolving.values() if u == uid)
        return len(self.resolving) >= MAX_RESOLVERS or mine >= MAX_RESOLVERS_PER_UID

    def reap(self) -> None:
        """Forget the workers that ended; kill those past their limit (a worker
        whose own deadline failed must not outlive what its client waits for)."""
        now = time.monotonic()
        for pid, due in list(self.due.items()):
            if now > due:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        while self.due:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.due.clear()
                self.resolving.clear()
                return
            if pid == 0:
                return
            self.due.pop(pid, None)
            self.resolving.pop(pid, None)


def _loop(
    sel: selectors.BaseSelector,
    listeners: dict[socket.socket, str],
    cfg: Config,
) -> None:
    workers = _Workers()
    # A hook or step gives up by itself at hook_deadline; its worker is killed a
    # little later, before the client (HOOK_GRACE beyond the deadline) stops waiting.
    root_limit = cfg.hook_deadline + HOOK_GRACE * 2 / 3
    while True:
        ready = sel.select(timeout=1.0)
        workers.reap()
        for key, _ in ready:
            sock, kind = key.data
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            conn.setblocking(True)
            uid = None
            if kind == "resolve":
                try:
                    uid = _peer_uid(conn)
                except OSError:
                    conn.close()
                    continue
                if workers.busy(uid):
                    # One user's flood must not fork root processes without bound,
                    # nor take everyone's slots.  What the client sent is drained,
                    # never waited for: unread data would turn the answer into a
                    # reset (the plugin pins by itself either way).
                    with contextlib.suppress(OSError):
                        conn.recv(MAX_REQUEST, socket.MSG_DONTWAIT)
                    _answer(conn, 75, b"tfimage: resolver: busy\n", b"")
                    conn.close()
                    continue
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                for s in listeners:
                    s.close()
                try:
                    if kind == "root":
                        _work(conn)
                    else:
                        _resolve(conn, cfg)
                finally:
                    conn.close()
                    sys.stderr.flush()
                    os._exit(0)
            workers.add(pid, root_limit if kind == "root" else RESOLVE_DEADLINE, uid)
            conn.close()

"""``tfimage daemon``: a warm helper for the plugin and the hooks on a node.

Every step of a ``--tf-image`` job needs ``step-prepare`` as root on each node, and
every job a prolog.  As a fresh Python process each costs ~100 ms of interpreter
start and imports before any work; this daemon imports everything once and forks a
worker per request.  The plugin (spank/client.c) and ``tfimage-hook`` run the
program themselves whenever no daemon listens, so the daemon is an accelerator,
never a dependency.

It serves what its starter routes to it (``routes``: ``tfimage.main`` passes the
CLI, the prolog and the epilog), so this library never imports its callers.

Trust: the root socket is created mode 0600 in a root-owned directory, and each
peer's uid is checked (SO_PEERCRED): only root (slurmstepd, the hooks) is served,
and only ``step-prepare`` and the node hooks, their arguments parsed by the same
strict parsers as when they run as programs (agent/wire.py).  The hooks and
step-prepare give up by themselves at the config's ``hook_deadline``; the daemon
kills a worker (and what it started) still running two thirds of ``HOOK_GRACE``
later, and its clients wait ``HOOK_GRACE``, so no hook ever runs twice at once.  A
hook's answer is 0 whatever went wrong inside the daemon (hooklog.py: only a node
fault may drain a node).

The pin socket, ``pin.sock`` (mode 0666), serves every local user one thing:
pinning a reference at submit (pinserver.py: its request and its trust).  A request
must arrive whole within ``PIN_READ`` seconds (not per read: a byte every second
holds nothing for long); at most ``MAX_PINS`` run at once and at most
``MAX_PINS_PER_UID`` for one user, so one user's flood leaves the other slots to
everyone else.  Beyond those, a request is answered "busy" at once and the plugin
pins by itself.

``--trace FILE`` (an operator's, and the wire tests') appends each request and its
answer to FILE as a JSON line, mode 0600.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import os
import selectors
import signal
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from tfimage.agent import wire
from tfimage.agent.config import Config, load_config
from tfimage.agent.errors import RequestError, TfimageError, cause
from tfimage.agent.logtext import oneline

Route = Callable[[list[str]], int]

MAX_PINS = 16
MAX_PINS_PER_UID = 4
PIN_DEADLINE = 60  # seconds; the plugin gives up sooner (submit_timeout)
PIN_READ = 2.0  # seconds for a whole request on the users' socket
ROOT_READ = 10.0  # and on the root socket
MAX_REQUEST = 1 << 20
COMMANDS = frozenset({wire.STEP_PREPARE})
HOOKS = frozenset(wire.HOOKS)
CLI = "tfimage"  # the route for COMMANDS: the tfimage command's main
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


class _Trace:
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


def _work(conn: socket.socket, routes: Mapping[str, Route], trace: _Trace) -> None:
    """In the forked worker: run one request with stdout and stderr captured."""
    started = time.monotonic()
    status, out, err = 70, b"", b""
    what = ["?"]
    hook = False
    argv: list[str] | None = None
    try:
        if _peer_uid(conn) != 0:
            print("tfimage: daemon: refused a non-root peer", file=sys.stderr, flush=True)
            return  # not root: say nothing
        argv = _read_request(conn)
        if argv is None:
            return
        hook = argv[0] in HOOKS
        what = [argv[0] if hook else wire.STEP_PREPARE, *_ids(argv)]
        route: Route = routes[argv[0]] if hook else routes[CLI]
        status, out, err = _captured(route, argv[1:] if hook else argv)
    except Exception as e:  # the daemon's own trouble: one line, never a traceback
        err = f"tfimage: daemon: {cause(e)}\n".encode()
        status = 0 if hook else 70  # a hook's outcome is never the daemon's fault
    _answer(conn, status, err, out)
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
    out = os.pread(out_fd, MAX_REQUEST, 0)
    size = os.fstat(err_fd).st_size
    err = os.pread(err_fd, 65536, max(0, size - 65536))
    return status, out, err


def _pin(conn: socket.socket, cfg: Config, trace: _Trace) -> None:
    """In the forked worker: pin one reference for any local user (pinserver.py)."""
    from tfimage.agent.daemon import pinserver

    started = time.monotonic()
    uid = -1
    argv: list[str] | None = None
    status, out, err = pinserver.RETRY_YOURSELF, "", ""
    try:
        uid = _peer_uid(conn)
        argv = _read_argv(conn, pinserver.MAX_REQUEST, PIN_READ)
        if argv is None:
            return
        status, out, err = pinserver.answer(cfg, wire.decode_submit_check(argv), uid)
    except TfimageError as e:
        err = f"tfimage: {e}\n"
    except Exception as e:  # a bug: one line, and the plugin pins by itself
        err = f"tfimage: pin server: internal error: {type(e).__name__}: {e}\n"
    _answer(conn, status, err.encode(), out.encode())
    trace.write("pin", argv, status, out.encode())
    took = (time.monotonic() - started) * 1000
    print(f"tfimage: daemon: pin uid {uid} -> {status} in {took:.0f} ms", file=sys.stderr)


def _answer(conn: socket.socket, status: int, err: bytes, out: bytes) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(wire.encode_answer(status, err, out))


def serve(
    path: Path,
    cfg: Config,
    routes: Mapping[str, Route],
    pin_path: Path | None = None,
    *,
    config_path: Path | None = None,
    trace: Path | None = None,
) -> int:
    """Serve until SIGTERM.  ``routes``: the entry points for the hooks (by program
    name) and for ``CLI``; ``config_path``: read again at each root request for
    its deadline (an edited config is honoured without a restart)."""
    # Everything a step or a pin needs, imported once, before the first request
    # (a forked worker would otherwise import it again each time: the registry
    # client and its hashlib are ~8 ms; ssl's hostname codec, ~1 ms).
    import encodings.idna  # noqa: F401

    import tfimage.agent.cache.download
    import tfimage.agent.daemon.pinserver
    import tfimage.agent.registry.access
    import tfimage.agent.registry.client
    import tfimage.agent.registry.credentials
    import tfimage.agent.registry.transport
    import tfimage.agent.step.binds
    import tfimage.agent.step.plan
    import tfimage.agent.step.taskenv
    import tfimage.agent.submit.pin

    # The registry's TLS context too (~2 ms a connection): a bad CA bundle is the
    # worker's to report, one request at a time.
    with contextlib.suppress(Exception):
        tfimage.agent.registry.transport.tls_context(cfg.ca_bundle or True)
    # What is loaded now is never collected: a worker's collections then leave the
    # parent's objects alone instead of touching (and copying) their pages.
    gc.collect()
    gc.freeze()

    # Root's own SLURM_CONF and LD_LIBRARY_PATH (the service's, never a job's) stay: the
    # prolog's GPU gate drains through scontrol, which needs slurm.conf where it is not
    # in its default place, and reads NVML in a child (gpu/child.py), which needs the
    # driver where the site's service unit says it is.
    kept = {k: os.environ.get(k, "") for k in ("SLURM_CONF", "LD_LIBRARY_PATH")}
    os.environ.clear()
    os.environ.update(_ENV)
    os.environ.update({k: v for k, v in kept.items() if v.startswith("/")})
    listeners = {_bind(path): "root"}
    if pin_path is not None:
        listeners[_bind(pin_path, 0o666)] = "pin"
    sel = selectors.DefaultSelector()
    for sock, kind in listeners.items():
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, (sock, kind))
    print(f"tfimage: daemon listening on {path}", file=sys.stderr, flush=True)
    if pin_path is not None:
        print(f"tfimage: daemon pinning on {pin_path}", file=sys.stderr, flush=True)
    parent = os.getpid()
    # systemctl stop (SIGTERM): leave no socket behind for clients to find dead.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        _loop(sel, listeners, cfg, routes, config_path, _Trace(trace))
    finally:
        if os.getpid() == parent:
            for p in (path, pin_path):
                if p is not None:
                    with contextlib.suppress(OSError):
                        p.unlink()
    return 0


class _Workers:
    """The forked workers: when each must be done by, and whose pin each serves."""

    def __init__(self) -> None:
        self.due: dict[int, float] = {}
        self.pinning: dict[int, int] = {}  # pid -> the peer's uid

    def add(self, pid: int, limit: float, uid: int | None) -> None:
        self.due[pid] = time.monotonic() + limit
        if uid is not None:
            self.pinning[pid] = uid

    def busy(self, uid: int) -> bool:
        """Whether a pin for ``uid`` must wait: all slots taken, or this user's."""
        mine = sum(1 for u in self.pinning.values() if u == uid)
        return len(self.pinning) >= MAX_PINS or mine >= MAX_PINS_PER_UID

    def reap(self) -> None:
        """Forget the workers that ended; kill those past their limit, with what they
        started (each worker leads its own process group): a worker whose own
        deadline failed must not outlive what its client waits for."""
        now = time.monotonic()
        for pid, due in list(self.due.items()):
            if now > due:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        while self.due:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.due.clear()
                self.pinning.clear()
                return
            if pid == 0:
                return
            self.due.pop(pid, None)
            self.pinning.pop(pid, None)


def _root_limit(cfg: Config, config_path: Path | None) -> float:
    """How long a root request's worker may run: its hook_deadline (as the config
    says now), and two thirds of the grace its client waits beyond that."""
    deadline = cfg.hook_deadline
    if config_path is not None:
        with contextlib.suppress(TfimageError):
            deadline = load_config(config_path).hook_deadline
    return deadline + wire.HOOK_GRACE * 2 / 3


def _loop(
    sel: selectors.BaseSelector,
    listeners: dict[socket.socket, str],
    cfg: Config,
    routes: Mapping[str, Route],
    config_path: Path | None,
    trace: _Trace,
) -> None:
    workers = _Workers()
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
            if kind == "pin":
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
                    _answer(conn, 75, b"tfimage: pin server: busy\n", b"")
                    conn.close()
                    continue
            limit = _root_limit(cfg, config_path) if kind == "root" else PIN_DEADLINE
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.setpgid(0, 0)  # so that a kill takes the tools it started too
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                for s in listeners:
                    s.close()
                try:
                    if kind == "root":
                        _work(conn, routes, trace)
                    else:
                        _pin(conn, cfg, trace)
                finally:
                    conn.close()
                    sys.stderr.flush()
                    os._exit(0)
            with contextlib.suppress(OSError):  # the child may have done it already
                os.setpgid(pid, pid)
            workers.add(pid, limit, uid)
            conn.close()

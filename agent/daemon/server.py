"""``tfimage daemon``: a warm helper for the plugin and the hooks on a node.

Every step of a ``--tf-image`` job needs ``step-prepare`` as root on each node, and
every job a prolog.  As a fresh Python process each costs ~100 ms of interpreter
start and imports before any work; this daemon imports everything once and forks a
worker per request (worker.py: what a worker does with its connection; this module
is the sockets, the loop and the workers' limits).  The plugin (spank/client.c)
and ``tfimage-hook`` run the program themselves whenever no daemon listens, so the
daemon is an accelerator, never a dependency.

It serves what its starter routes to it (``routes``: ``tfimage.main`` passes the
CLI, the prolog and the epilog), so this library never imports its callers.

Trust: the root socket is created mode 0600 in a root-owned directory, and each
peer's uid is checked (SO_PEERCRED): only root (slurmstepd, the hooks) is served,
and only ``step-prepare`` and the node hooks, their arguments parsed by the same
strict parsers as when they run as programs (agent/core/wire.py).  The hooks and
step-prepare give up by themselves at the config's ``hook_deadline``; the daemon
kills a worker (and what it started) still running two thirds of ``HOOK_GRACE``
later, and its clients wait ``HOOK_GRACE``, so no hook ever runs twice at once.  A
hook's answer is 0 whatever went wrong inside the daemon (hooks/log.py: only a node
fault may drain a node).

The stage socket, ``stage.sock`` (mode 0600, Slurm's user's: config ``slurm_user``),
serves the controller's stage hook (``PrologSlurmctld`` runs as that user) and
nothing else, to that user and root, exactly as the root socket does: the hook
then runs as root, which the staging cache and the credentials need.

The pin socket, ``pin.sock`` (mode 0666), serves every local user one thing:
pinning a reference at submit (pinserver.py: its request and its trust).  A request
must arrive whole within ``PIN_READ`` seconds (not per read: a byte every second
holds nothing for long); at most ``MAX_PINS`` run at once and at most
``MAX_PINS_PER_UID`` for one user, so one user's flood leaves the other slots to
everyone else.  Beyond those, a request is answered "busy" (``wire.PIN_BUSY``) at
once; the plugin asks again, backing off, within its share of submit_timeout, and
then pins by itself.

``--trace FILE`` (an operator's, and the wire tests') appends each request and its
answer to FILE as a JSON line, mode 0600.
"""

from __future__ import annotations

import contextlib
import gc
import os
import selectors
import signal
import socket
import stat
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from tfimage.agent.core import layout, wire
from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.errors import TfimageError
from tfimage.agent.daemon import worker

MAX_PINS = 16
MAX_PINS_PER_UID = 4
PIN_DEADLINE = 60  # seconds; the plugin gives up sooner (submit_timeout)


def _slurm_uid(cfg: Config) -> int | None:
    """Slurm's user's uid (config ``slurm_user``), where this host knows that user."""
    import pwd

    try:
        return pwd.getpwnam(cfg.slurm_user).pw_uid
    except KeyError:
        print(
            f"tfimage: daemon: slurm_user {cfg.slurm_user!r} is no user here: no stage socket",
            file=sys.stderr,
            flush=True,
        )
        return None


def _bind(path: Path, mode: int = 0o600, owner: int = 0) -> socket.socket:
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
    if owner:
        os.chown(path, owner, -1)
    s.listen(64)
    return s


def serve(
    path: Path,
    cfg: Config,
    routes: Mapping[str, worker.Route],
    pin_path: Path | None = None,
    *,
    config_path: Path | None = None,
    trace: Path | None = None,
) -> int:
    """Serve until SIGTERM.  ``routes``: the entry points for the hooks (by program
    name) and for ``worker.CLI``; ``config_path``: read again at each root request for
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
    import tfimage.agent.stage.job  # the controller's: a warm job's answer is a ledger read
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

    worker.scrub_environment()
    listeners = {_bind(path): "root"}
    if pin_path is not None:
        listeners[_bind(pin_path, 0o666)] = "pin"
    stage_path = path.parent / layout.STAGE_SOCKET
    slurm_uid = _slurm_uid(cfg)
    if slurm_uid is not None:
        listeners[_bind(stage_path, 0o600, owner=slurm_uid)] = "stage"
    sel = selectors.DefaultSelector()
    for sock, kind in listeners.items():
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, (sock, kind))
    print(f"tfimage: daemon listening on {path}", file=sys.stderr, flush=True)
    if pin_path is not None:
        print(f"tfimage: daemon pinning on {pin_path}", file=sys.stderr, flush=True)
    if slurm_uid is not None:
        print(f"tfimage: daemon staging on {stage_path}", file=sys.stderr, flush=True)
    parent = os.getpid()
    # systemctl stop (SIGTERM): leave no socket behind for clients to find dead.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        _loop(sel, listeners, cfg, routes, config_path, worker.Trace(trace), slurm_uid)
    finally:
        if os.getpid() == parent:
            for p in (path, pin_path, stage_path if slurm_uid is not None else None):
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
    routes: Mapping[str, worker.Route],
    config_path: Path | None,
    trace: worker.Trace,
    slurm_uid: int | None = None,
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
                    uid = worker.peer_uid(conn)
                except OSError:
                    conn.close()
                    continue
                if workers.busy(uid):
                    # One user's flood must not fork root processes without bound,
                    # nor take everyone's slots.  What the client sent is drained,
                    # never waited for: unread data would turn the answer into a
                    # reset (the plugin pins by itself either way).
                    with contextlib.suppress(OSError):
                        conn.recv(worker.MAX_REQUEST, socket.MSG_DONTWAIT)
                    worker.answer(conn, wire.PIN_BUSY, b"tfimage: pin server: busy\n", b"")
                    conn.close()
                    continue
            limit = _root_limit(cfg, config_path) if kind != "pin" else PIN_DEADLINE
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.setpgid(0, 0)  # so that a kill takes the tools it started too
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                for s in listeners:
                    s.close()
                try:
                    if kind == "root":
                        worker.work(conn, routes, trace)
                    elif kind == "stage":
                        worker.work(conn, routes, trace, stage_peer=slurm_uid)
                    else:
                        worker.pin(conn, cfg, trace)
                finally:
                    conn.close()
                    sys.stderr.flush()
                    os._exit(0)
            with contextlib.suppress(OSError):  # the child may have done it already
                os.setpgid(pid, pid)
            workers.add(pid, limit, uid)
            conn.close()

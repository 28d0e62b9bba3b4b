"""Paths from a job, resolved as the job's user, never as root.

A ``--tf-mount`` host path is checked against the admin's prefixes; checked by name, a
link under an allowed prefix (``/home/u/etc -> /etc``) would pass.  Root must not
follow the user's links to find out where they lead (that would let a user make root
look anywhere, and stat what the user may not), so a child process takes the user's
uid, gid and groups and resolves them there; root only reads the answers.
"""

from __future__ import annotations

import json
import os
import pwd
import select
import signal
import time
from collections.abc import Sequence

from tfimage.agent.core.errors import BindError, RuntimeSetupError
from tfimage.agent.core.logtext import oneline

TIMEOUT = 10.0  # a hung network filesystem must not hang a step's preparation
MAX_ANSWER = 1 << 20


def realpaths_as(uid: int, paths: Sequence[str], timeout: float = TIMEOUT) -> list[str]:
    """For each path, its real path as ``uid`` sees it (links resolved, strictly).
    A path the user cannot resolve raises :class:`BindError` saying why (missing,
    no permission): a host path left for later could be re-pointed in between."""
    if not paths:
        return []
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        raise RuntimeSetupError(f"uid {uid} has no passwd entry on this node") from None
    groups = os.getgrouplist(pw.pw_name, pw.pw_gid)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become the user, answer, leave
        status = 1
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(pw.pw_gid)
            os.setuid(uid)
            out: list[list[str]] = []
            for p in paths:
                try:
                    out.append(["", os.path.realpath(p, strict=True)])
                except OSError as e:
                    out.append([e.strerror or "cannot be resolved", ""])
                except ValueError:
                    out.append(["cannot be resolved", ""])
            data = json.dumps(out).encode()
            while data:
                data = data[os.write(w, data) :]
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                raise RuntimeSetupError(
                    f"--tf-mount: resolving the host paths as uid {uid} took over {timeout:.0f} s"
                )
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_ANSWER:
                os.kill(pid, signal.SIGKILL)
                raise RuntimeSetupError("--tf-mount: the host paths' answer is too large")
    finally:
        os.close(r)
        _reap(pid)
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, list) or len(answer) != len(paths):
        raise RuntimeSetupError(f"--tf-mount: could not resolve the host paths as uid {uid}")
    real: list[str] = []
    for p, a in zip(paths, answer, strict=True):
        if not (isinstance(a, list) and len(a) == 2 and all(isinstance(x, str) for x in a)):
            raise RuntimeSetupError(f"--tf-mount: could not resolve the host paths as uid {uid}")
        if a[0] or not a[1]:
            raise BindError(f"--tf-mount host path {oneline(p)}: {a[0] or 'cannot be resolved'}")
        real.append(a[1])
    return real


def _reap(pid: int) -> None:
    """Wait for the child briefly; one stuck in the kernel is left to init's reaping
    when this process ends, rather than hanging it."""
    for _ in range(50):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.01)

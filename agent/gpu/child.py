"""NVML read in a child process with a deadline: no hook may hang a node.

A GPU fallen off the bus can block ``nvmlInit`` or any call after it for minutes,
in the kernel, where no signal reaches it.  The gate's reading therefore runs in a
child (``python -I -m tfimage.agent.gpu.child SELECTION``), which prints ``READY``
just before it touches NVML and then the :class:`NodeReading` as JSON.  Past
``gpu.timeout`` the child's process group is killed and, if the kernel holds it,
abandoned rather than waited for; the child also arms its own alarm, so that it
dies even where its parent was killed first (a daemon worker past its deadline).

What each ending means (only a GPU fault may drain a node):

    the reading, in time              judged as usual (verdict.py)
    READY, then no answer in time     NVML init finding: a hung driver (drain-class)
    killed by SIGSEGV, SIGBUS,        NVML init finding: the driver library crashed
    SIGABRT, SIGILL or SIGFPE
    after READY
    anything else (no READY in time:  TfimageError: tfimage's or the machine's own
    a slow Python start; another      trouble, logged, never a drain
    signal: the OOM killer; bad
    output; a Python error)
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from tfimage.agent.core.errors import TfimageError
from tfimage.agent.gpu.probe import NodeReading, Reading, Selection, probe

READY = b"READY\n"
MAX_OUTPUT = 4 << 20  # 64 GPUs' readings are some tens of KiB
REAP_SECONDS = 2.0
# What a fault inside the driver library kills a process with.
CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}


def _reading(doc: dict[str, Any]) -> NodeReading:
    gpus = [Reading(**g) for g in doc.pop("gpus")]
    return NodeReading(**doc, gpus=gpus)


def _collect(child: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bytes, bool]:
    """stdout and stderr until both end or ``timeout`` passes (then: False), bounded."""
    assert child.stdout is not None and child.stderr is not None
    out = {child.stdout.fileno(): bytearray(), child.stderr.fileno(): bytearray()}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        for fd in out:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out[child.stdout.fileno()]), bytes(out[child.stderr.fileno()]), False
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk or len(out[key.fd]) > MAX_OUTPUT:
                    sel.unregister(key.fd)
                else:
                    out[key.fd] += chunk
    return bytes(out[child.stdout.fileno()]), bytes(out[child.stderr.fileno()]), True


def probe_bounded(selection: Selection, timeout: float) -> NodeReading:
    """:func:`probe` in a child process, given ``timeout`` seconds."""
    argv = [sys.executable, "-I", "-m", __name__, json.dumps(asdict(selection)), str(timeout)]
    # The caller's environment: root's (a hook's or an operator's), with the
    # LD_LIBRARY_PATH that finds the driver's libnvidia-ml where the site needs one.
    child = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err, ended = _collect(child, timeout)
        if not ended:
            os.killpg(child.pid, signal.SIGKILL)
            # In the kernel's hands (D state) it stays behind; never waited for.
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=REAP_SECONDS)
            if not out.startswith(READY):
                raise TfimageError(
                    f"gpu: the NVML reading did not start within {timeout:g} s "
                    "(a slow or starved machine, not a GPU)"
                )
            return NodeReading(
                init_error=f"NVML did not answer within {timeout:g} s (a hung driver or GPU)",
                seconds=timeout,
            )
        code = child.wait(timeout=REAP_SECONDS)
    finally:
        for pipe in (child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()
    if code < 0 and out.startswith(READY) and -code in CRASHES:
        return NodeReading(init_error=f"NVML crashed the reading ({signal.Signals(-code).name})")
    if code != 0 or not out.startswith(READY):
        lines = err.decode(errors="replace").strip().splitlines()
        why = lines[-1][:200] if lines else f"exit status {code}"
        raise TfimageError(f"gpu: the NVML reading failed: {why}")
    try:
        return _reading(json.loads(out[len(READY) :]))
    except (ValueError, TypeError, KeyError) as e:
        raise TfimageError(f"gpu: the NVML reading was unreadable: {e}") from None


def main(argv: list[str]) -> int:
    asked = json.loads(argv[0])
    selection = Selection(bool(asked["everything"]), tuple(asked["tokens"]), asked["mapping"])
    # Dies by itself past its parent's deadline, should the parent be gone.
    signal.alarm(int(float(argv[1])) + 5)
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    json.dump(asdict(probe(selection)), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""NVML read in a child process with a deadline: no hook may hang a node.

A GPU fallen off the bus can block ``nvmlInit`` or any call after it for minutes,
in the kernel, where no signal reaches it.  The gate's reading therefore runs in a
child (``python -I -m tfimage.agent.gpu.child SELECTION``, which prints the
:class:`NodeReading` as JSON); past ``gpu.timeout`` the child's process group is
killed and, if the kernel holds it, abandoned rather than waited for.

What each ending means:

    the reading, in time             judged as usual (verdict.py)
    no answer in time                NVML init finding: a hung driver (drain-class)
    killed by a signal               NVML init finding: the driver library crashed
    anything else (bad output,       TfimageError: tfimage's own trouble, logged,
    a Python error in the child)     never a drain (only a GPU fault drains a node)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from typing import Any

from tfimage.agent.errors import TfimageError
from tfimage.agent.gpu.probe import NodeReading, Reading, Selection, probe

MAX_OUTPUT = 4 << 20  # 64 GPUs' readings are some tens of KiB
REAP_SECONDS = 2.0


def _reading(doc: dict[str, Any]) -> NodeReading:
    gpus = [Reading(**g) for g in doc.pop("gpus")]
    return NodeReading(**doc, gpus=gpus)


def probe_bounded(selection: Selection, timeout: float) -> NodeReading:
    """:func:`probe` in a child process, given ``timeout`` seconds."""
    argv = [sys.executable, "-I", "-m", __name__, json.dumps(asdict(selection))]
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
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        # In the kernel's hands (D state) it stays behind; never waited for.
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.communicate(timeout=REAP_SECONDS)
        return NodeReading(
            init_error=f"NVML did not answer within {timeout:g} s (a hung driver or GPU)",
            seconds=timeout,
        )
    if child.returncode < 0:
        name = signal.Signals(-child.returncode).name
        return NodeReading(init_error=f"NVML crashed the reading ({name})")
    if child.returncode != 0 or len(out) > MAX_OUTPUT:
        lines = err.decode(errors="replace").strip().splitlines()
        why = lines[-1][:200] if lines else f"exit status {child.returncode}"
        raise TfimageError(f"gpu: the NVML reading failed: {why}")
    try:
        return _reading(json.loads(out))
    except (ValueError, TypeError, KeyError) as e:
        raise TfimageError(f"gpu: the NVML reading was unreadable: {e}") from None


def main(argv: list[str]) -> int:
    asked = json.loads(argv[0])
    selection = Selection(bool(asked["everything"]), tuple(asked["tokens"]), asked["mapping"])
    json.dump(asdict(probe(selection)), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

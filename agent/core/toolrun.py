"""Run a helper program with a deadline and no shell; never hang a hook."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from typing import Any

from tfimage.agent.core.errors import RuntimeSetupError

# A fixed, minimal environment: nothing from a job leaks into root-side tools.
SAFE_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    what: str,
    env: dict[str, str] | None = None,
    as_user: tuple[int, int] | None = None,
    pass_fds: Sequence[int] = (),
) -> str:
    """Run ``argv``; return stdout.  Failure or timeout raises with the tool's last line.
    ``env`` adds to the fixed environment (a tool's own work directories, never a job's);
    ``as_user`` (uid, gid) runs it as that user alone, with no other groups;
    ``pass_fds`` it inherits besides its standard three."""
    who: dict[str, Any] = {}
    if as_user is not None:
        who = {"user": as_user[0], "group": as_user[1], "extra_groups": []}
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**SAFE_ENV, **(env or {})},
            stdin=subprocess.DEVNULL,
            check=False,
            pass_fds=tuple(pass_fds),
            **who,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeSetupError(f"{what}: {argv[0]} did not finish in {timeout:.0f} s") from None
    except FileNotFoundError:
        raise RuntimeSetupError(f"{what}: {argv[0]} is not installed") from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        last = lines[-1] if lines else f"exit status {done.returncode}"
        raise RuntimeSetupError(f"{what}: {last}")
    return str(done.stdout)


def slurm_tool(name: str, slurm_bin: str) -> str:
    """Slurm's command ``name`` in the site's Slurm directory (the config's
    gpu.slurm_bin), else found on the fixed PATH of every root-side tool."""
    return os.path.join(slurm_bin, name) if slurm_bin else name


def slurm_env() -> dict[str, str]:
    """For a Slurm command: the hook's own SLURM_CONF (slurmd's, slurmctld's front's,
    or the operator's shell), never a job's."""
    conf = os.environ.get("SLURM_CONF", "")
    return {"SLURM_CONF": conf} if conf.startswith("/") else {}

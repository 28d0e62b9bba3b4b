"""The node hooks' arguments, built from the wire's one table (``wire.HOOK_FLAGS``).

Run through the node daemon (``tfimage-hook``), a hook gets every value as
``--name=VALUE`` from the role's script; run directly as Slurm's Prolog or Epilog,
each defaults to the Slurm variable the table names for it.  Either way the value
is the job's (any user can submit a job with a control environment of their
choosing through Slurm's API), and one starting with ``-`` must stay a value.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from tfimage.agent.core import wire
from tfimage.agent.core.config import DEFAULT_PATH


def hook_parser(
    prog: str, description: str | None, environ: Mapping[str, str] | None = None
) -> argparse.ArgumentParser:
    """``prog``'s parser (one of ``wire.HOOKS``): ``--config`` and its table's flags."""
    env = os.environ if environ is None else environ
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--config", default=str(DEFAULT_PATH))
    for flag in wire.HOOK_FLAGS[prog]:
        p.add_argument(flag.name, dest=flag.dest, default=wire.hook_default(flag, env))
    return p


def parse_hook_args(
    prog: str, description: str | None, argv: Sequence[str] | None
) -> argparse.Namespace:
    return hook_parser(prog, description).parse_args(argv)

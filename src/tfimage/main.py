"""The installed ``tfimage`` command, and the one place that knows every entry point.

The node daemon serves the plugin's step preparation and the node hooks from a warm
process; it learns those entry points from here, so that ``tfimage.agent`` never
imports its callers (``tfimage.prolog``, ``tfimage.epilog``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tfimage.agent.cli.main import build_parser, dispatch
from tfimage.agent.cli.main import main as cli
from tfimage.agent.core.errors import TfimageError


def daemon(args: argparse.Namespace) -> int:
    """``tfimage daemon``: serve the CLI's step-prepare and the hooks."""
    from tfimage.agent.core import layout
    from tfimage.agent.core.config import load_config
    from tfimage.agent.daemon.server import serve
    from tfimage.agent.daemon.worker import CLI
    from tfimage.epilog.main import main as epilog
    from tfimage.prolog.main import main as prolog
    from tfimage.prolog.stage import main as stage

    if os.geteuid() != 0:
        raise TfimageError("daemon: runs as root on a compute, login or controller node")
    cfg = load_config(args.config)
    pin = None if args.no_pin_server else Path(args.pin_socket or layout.pin_socket(cfg.state_dir))
    # Built once, here: a forked worker would build it again, importing every
    # command on the way (~10 ms of each step's launch).
    parser = build_parser()
    return serve(
        Path(args.socket or layout.daemon_socket(cfg.state_dir)),
        cfg,
        {
            CLI: lambda argv: dispatch(parser.parse_args(argv)),
            "tfimage-prolog": prolog,
            "tfimage-epilog": epilog,
            "tfimage-stage": stage,
        },
        pin,
        config_path=Path(args.config),
        trace=Path(args.trace) if args.trace else None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return cli(argv, daemon=daemon)


if __name__ == "__main__":
    sys.exit(main())

"""The ``tfimage`` command: operators' view of a node (the plugin's two hidden
commands are in plugin.py; ``tfimage.main`` is the installed entry point).

One contract for every subcommand: exit statuses from exits.py's table; every
error one ``tfimage: SUBCOMMAND: cause`` line on stderr and, under ``--json``, a
JSON object on stdout as well; ``--config`` before or after the subcommand.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import tfimage
from tfimage.agent.cli import exits
from tfimage.agent.core import wire
from tfimage.agent.core.config import DEFAULT_PATH, Config, load_config
from tfimage.agent.core.errors import InputError, TfimageError
from tfimage.agent.core.reference import Reference

EXIT_INTERNAL = exits.INTERNAL


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one line and exit 64 (EX_USAGE)."""

    def error(self, message: str) -> NoReturn:
        where = self.prog.removeprefix("tfimage").strip()
        print(
            f"tfimage: {where + ': ' if where else ''}{message} (see '{self.prog} --help')",
            file=sys.stderr,
        )
        sys.exit(exits.USAGE)


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config)


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, sort_keys=True) if getattr(args, "json", False) else text)


def _pin(cfg: Config, ref: Reference, job_image: str | None = None) -> tuple[Reference, str | None]:
    """Pin ``ref`` to its digest; a fallback's warning goes to stderr, for the user."""
    from tfimage.agent.submit.pin import pin

    pinned, warning = pin(cfg, ref, job_image=job_image)
    if warning:
        print(f"tfimage: {warning}", file=sys.stderr)
    return pinned, warning


def cmd_resolve(args: argparse.Namespace) -> int:
    cfg = _config(args)
    ref = cfg.reference(args.ref)
    warning = None
    if not args.offline:
        ref, warning = _pin(cfg, ref)
    _emit(
        args,
        {
            "reference": str(ref),
            "registry": ref.registry,
            "repository": ref.repository,
            "tag": ref.tag,
            "digest": ref.digest,
            "warning": warning,
        },
        str(ref),
    )
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from tfimage.agent.step.gpushare import LIMIT as MPS_LIMIT
    from tfimage.agent.step.taskenv import task_env

    cfg = _config(args)
    # Recompute from the step alone, then compare with what this task really has.
    ours = {"TF_CONFIG", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", MPS_LIMIT, *cfg.site_env}
    base = {k: v for k, v in os.environ.items() if k not in ours}
    te = task_env(
        base,
        site_env=cfg.site_env,
        port_range=cfg.tf_port_range,
        single_task_tf_config=cfg.single_task_tf_config,
        limit=cfg.step_max_tasks,
        ib_sysfs=Path(cfg.ib_sysfs),
    )
    rows = []
    for name, d in sorted(te.set.items()):
        cur = os.environ.get(name)
        if cur is None:
            state = "not set here (tfimage sets it in --tf-image steps)"
        elif cur == d.value:
            state = "set by tfimage"
        else:
            state = "set by the user; tfimage left it alone"
        rows.append(
            {
                "name": name,
                "value": cur if cur is not None else d.value,
                "state": state,
                "why": d.why,
            }
        )
    if args.json:
        print(json.dumps(rows, sort_keys=True))
        return 0
    for r in rows:
        print(f"{r['name']}={r['value']}")
        if args.explain:
            print(f"    {r['state']}: {r['why']}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from tfimage.agent.cache.pull import Puller
    from tfimage.agent.cache.store import ImageCache
    from tfimage.agent.cli.progress import ProgressBar

    cfg = _config(args)
    cache = ImageCache(cfg.staging() if getattr(args, "stage", False) else cfg)
    got = Puller(cache).ensure(cfg.reference(args.ref), progress=ProgressBar())
    _emit(
        args,
        {
            "reference": str(got.ref),
            "path": str(got.path),
            "size": got.size,
            "hit": got.hit,
            "source": got.source,
            "seconds": round(got.seconds, 3),
        },
        f"{got.ref} {'(cached)' if got.hit else f'pulled from {got.source}'} -> {got.path}",
    )
    return 0


def _check_sif(sif: Path) -> None:
    from tfimage.agent.core.sif import has_magic

    try:
        with sif.open("rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise InputError(f"{sif}: not a regular file")
            head = f.read(64)
    except OSError as e:
        raise InputError(f"{sif}: {e.strerror or e}") from None
    if not has_magic(head):
        raise InputError(f"{sif}: not a SIF file (build one with apptainer build)")


def cmd_push(args: argparse.Namespace) -> int:
    from tfimage.agent.registry.access import client_for

    cfg = _config(args)
    ref = cfg.reference(args.ref)
    if ref.digest or not ref.tag:
        raise InputError(f"{args.ref}: give a tag to push to, and no digest")
    sif = Path(args.sif)
    _check_sif(sif)  # all of the input, before the registry is asked anything
    digest = client_for(cfg, ref.registry).push_sif(ref.repository, ref.tag, sif)
    _emit(args, {"reference": str(ref.pinned(digest))}, str(ref.pinned(digest)))
    return 0


def cmd_tags(args: argparse.Namespace) -> int:
    from tfimage.agent.submit.tags import tags

    ref, found = tags(_config(args), args.repository)
    name = f"{ref.registry}/{ref.repository}"
    if args.json:
        print(json.dumps({"repository": name, "tags": found}, sort_keys=True))
    else:
        print("\n".join(f"{ref.repository}:{t}" for t in found) or f"{name}: no tags")
    return 0


def cmd_config_compile(args: argparse.Namespace) -> int:
    from tfimage.agent.core.config import compile_config

    try:
        out = compile_config(args.config)
    except OSError as e:  # writing the JSON beside it; reading is ConfigError
        raise TfimageError(f"{args.config}: cannot compile: {e.strerror}") from None
    _emit(args, {"config": args.config, "compiled": str(out)}, f"compiled {args.config} -> {out}")
    return 0


Handler = Callable[[argparse.Namespace], int]


def _no_daemon(args: argparse.Namespace) -> int:
    raise TfimageError("start it with the installed 'tfimage' command")


def cmd_doctor(args: argparse.Namespace) -> int:
    from tfimage.agent.cli.doctor import Context, exit_status, run_checks
    from tfimage.agent.cli.slurmconf import slurm_conf_path

    ctx = Context(
        Path(args.config),
        Path(args.slurm_conf or slurm_conf_path()),
        login=args.login,
        controller=args.controller,
    )
    diagnoses = run_checks(ctx)
    status = exit_status(diagnoses)
    if args.json:
        verdict = ("ok", "warning", "error")[status]
        print(json.dumps({"status": verdict, "diagnoses": [f.as_dict() for f in diagnoses]}))
        return status
    for f in diagnoses:
        print(f"{f.level.upper():8} {f.check:9} {f.message}")
        if f.fix and f.level in ("warning", "error"):
            print(f"{'':18}fix: {f.fix}")
    return status


def build_parser(daemon: Handler | None = None) -> argparse.ArgumentParser:
    """The parser; ``daemon`` serves ``tfimage daemon`` (tfimage.main gives it: the
    daemon serves entry points this library does not import)."""
    p: argparse.ArgumentParser = Parser(
        prog="tfimage",
        description="Inspect and manage a node's tfimage cache; helpers for the Slurm plugin.",
        epilog=exits.EPILOG,
    )
    p.add_argument("--version", action="version", version=f"tfimage {tfimage.__version__}")
    p.add_argument(
        "--config",
        default=os.environ.get(wire.CONFIG_VAR) or str(DEFAULT_PATH),
        help=f"site config file (default ${wire.CONFIG_VAR} or {DEFAULT_PATH})",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("resolve", help="print the pinned (@sha256) form of an image reference")
    r.add_argument("ref", help="image reference, e.g. tf-custom:2.0")
    r.add_argument(
        "--offline",
        action="store_true",
        help="only check and expand the reference; do not contact the registry",
    )
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(func=cmd_resolve)

    ev = sub.add_parser("env", help="inside a job step: the TF/NCCL variables of this task")
    ev.add_argument("--explain", action="store_true", help="say why each value was chosen")
    ev.add_argument("--json", action="store_true", help="machine-readable output")
    ev.set_defaults(func=cmd_env)

    pl = sub.add_parser("pull", help="pull an image into this node's cache")
    pl.add_argument("ref", help="image reference")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=cmd_pull)

    ps = sub.add_parser("push", help="push a SIF file as an ORAS artifact (Apptainer's format)")
    ps.add_argument("sif", help="path of the .sif file")
    ps.add_argument("ref", help="destination reference with a tag")
    ps.add_argument("--json", action="store_true", help="machine-readable output")
    ps.set_defaults(func=cmd_push)

    tg = sub.add_parser(
        "tags",
        help="list the tags of a repository you may run",
        description="List a repository's tags, read with your own credentials, as "
        "--tf-image would name them. A repository you may not run is answered as one "
        "that does not exist.",
    )
    tg.add_argument("repository", help="a repository as --tf-image names it, e.g. tf-custom")
    tg.add_argument("--json", action="store_true", help="machine-readable output")
    tg.set_defaults(func=cmd_tags)

    cc = sub.add_parser(
        "config-compile",
        help="(admin) check the config and write its JSON form beside it, for fast starts",
        description="Check --config and write CONFIG.json beside it. Hooks and helpers read "
        "the JSON (no YAML parser to load) while it matches the YAML's inode, size and "
        "mtime; after an edit they read the YAML again until this is rerun.",
    )
    cc.add_argument("--json", action="store_true", help="machine-readable output")
    cc.set_defaults(func=cmd_config_compile)

    dm = sub.add_parser(
        "daemon",
        help="(root, compute and login nodes) answer the plugin from a warm process",
        description="Listen on a root-only unix socket for the SPANK plugin's step-prepare "
        "and the node hooks, and on a socket open to every local user for pinning at "
        "submit, answering each request from a worker forked off an already started "
        "Python. Optional: without it the plugin runs the helper itself.",
    )
    dm.add_argument("--socket", default="", help="socket path (default STATE_DIR/daemon.sock)")
    dm.add_argument(
        "--pin-socket",
        default="",
        help="the pin server's socket, for every local user (default STATE_DIR/pin.sock)",
    )
    dm.add_argument("--no-pin-server", action="store_true", help="serve no pinning for users")
    dm.add_argument(
        "--trace",
        default="",
        metavar="FILE",
        help="append each request and answer to FILE as JSON lines (0600; for debugging "
        "the plugin's wire, agent/core/wire.py)",
    )
    dm.set_defaults(func=daemon or _no_daemon)

    dr = sub.add_parser(
        "doctor",
        help="check this node: config, plugin, hooks, runtime, registry, cache, NVML",
        description="Check how tfimage is wired into this node. Exit 0: all in order; "
        "1: warnings; 2: errors. Each problem comes with what to fix.",
    )
    dr.add_argument("--json", action="store_true", help="machine-readable output")
    who = dr.add_mutually_exclusive_group()
    who.add_argument(
        "--login", action="store_true", help="a login node: only config, plugin and registry"
    )
    who.add_argument(
        "--controller",
        action="store_true",
        help="slurmctld's host: config, the stage hook (PrologSlurmctld, its deadline, the "
        "staging cache, sbcast) and registry",
    )
    dr.add_argument("--slurm-conf", default="", help="slurm.conf (default $SLURM_CONF)")
    dr.set_defaults(func=cmd_doctor)

    from tfimage.agent.cli.cache import register

    register(sub, cmd_pull)

    from tfimage.agent.cli.gpu import register as register_gpu

    register_gpu(sub)

    from tfimage.agent.cli.usage import register as register_usage

    register_usage(sub)

    from tfimage.agent.cli.partitioncheck import register as register_partition_check

    register_partition_check(sub)

    from tfimage.agent.cli.convertscript import register as register_convert

    register_convert(sub)

    from tfimage.agent.cli.plugin import register as register_plugin

    register_plugin(sub)
    _every_command(p, "", hidden=frozenset({wire.SUBMIT_CHECK, wire.STEP_PREPARE}))
    return p


def _every_command(p: argparse.ArgumentParser, name: str, hidden: frozenset[str]) -> None:
    """Name each command for its error lines, and let ``--config`` follow it too.

    The plugin's own commands keep unprefixed errors: the plugin prints them after
    its own ``tfimage: submit:``."""
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        if name and name not in hidden:  # the plugin's flags are exactly wire.py's
            p.set_defaults(command_name=name)
            p.add_argument(
                "--config", default=argparse.SUPPRESS, help="site config file (as before COMMAND)"
            )
        return
    if p.epilog is None:
        p.epilog = exits.EPILOG
    for sub_name, sp in subs[0].choices.items():
        if sp.epilog is None:
            sp.epilog = exits.EPILOG
        _every_command(sp, f"{name} {sub_name}".strip(), hidden)


def main(argv: Sequence[str] | None = None, *, daemon: Handler | None = None) -> int:
    return dispatch(build_parser(daemon).parse_args(argv))


def dispatch(args: argparse.Namespace) -> int:
    """Run a parsed command: its exit status, and one ``tfimage: COMMAND:`` line on
    failure (under ``--json``, also a JSON object on stdout)."""
    try:
        return int(args.func(args))
    except TfimageError as e:
        return _failed(args, str(e), e.exit_code)
    except KeyboardInterrupt:
        return _failed(args, "interrupted", exits.INTERRUPTED)
    except Exception as e:  # one line for a person, never a traceback
        return _failed(args, f"internal error: {type(e).__name__}: {e}", exits.INTERNAL)


def _failed(args: argparse.Namespace, message: str, status: int) -> int:
    name = getattr(args, "command_name", "")
    print(f"tfimage: {name + ': ' if name else ''}{message}", file=sys.stderr)
    if getattr(args, "json", False):
        doc = {"command": name, "error": message, "exit": status}
        print(json.dumps(doc, sort_keys=True))
    return status


if __name__ == "__main__":
    sys.exit(main())

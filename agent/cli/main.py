"""The ``tfimage`` command: operators' view of a node, and the plugin's helper.

Exit codes: 0 ok; 1 usage or unexpected state; 2 bad config, credentials or
reference; 3 the image or runtime could not be prepared; 70 internal error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tfimage
from tfimage.agent.config import DEFAULT_PATH, Config, load_config
from tfimage.agent.errors import TfimageError
from tfimage.agent.reference import Reference

EXIT_INTERNAL = 70


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config)


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, sort_keys=True) if getattr(args, "json", False) else text)


class _Bar:
    """A progress bar on stderr, only when stderr is a terminal."""

    def __init__(self) -> None:
        self.on = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, got: int, total: int) -> None:
        now = time.monotonic()
        if not self.on or (now - self.last < 0.1 and got < total):
            return
        self.last = now
        frac = got / total if total else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(f"\r[{bar:<30}] {frac:6.1%} {got >> 20}/{total >> 20} MiB")
        if got >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


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


def cmd_submit_check(args: argparse.Namespace) -> int:
    from tfimage.agent.step.binds import parse_mounts

    cfg = _config(args)
    ref = cfg.reference(args.ref)
    parse_mounts(args.mounts, cfg.mount_prefixes)
    if not args.offline:
        # Set by Slurm in a job whose submission pinned an image (see spank/submit.c).
        ref, _ = _pin(cfg, ref, job_image=os.environ.get("SLURM_SPANK_TFIMAGE_IMAGE"))
    print(ref)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from tfimage.agent.step.taskenv import task_env

    cfg = _config(args)
    # Recompute from the step alone, then compare with what this task really has.
    ours = {"TF_CONFIG", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", *cfg.site_env}
    base = {k: v for k, v in os.environ.items() if k not in ours}
    te = task_env(
        base,
        site_env=cfg.site_env,
        port_range=cfg.tf_port_range,
        single_task_tf_config=cfg.single_task_tf_config,
        limit=cfg.step_max_tasks,
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
    from tfimage.agent.cache.store import ImageCache

    cfg = _config(args)
    got = ImageCache(cfg).ensure(cfg.reference(args.ref), progress=_Bar())
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


def cmd_push(args: argparse.Namespace) -> int:
    from tfimage.agent.registry.access import client_for

    cfg = _config(args)
    ref = cfg.reference(args.ref)
    if ref.digest or not ref.tag:
        raise TfimageError("push needs a reference with a tag and no digest")
    sif = Path(args.sif)
    digest = client_for(cfg, ref.registry).push_sif(ref.repository, ref.tag, sif)
    _emit(args, {"reference": str(ref.pinned(digest))}, str(ref.pinned(digest)))
    return 0


def cmd_step_prepare(args: argparse.Namespace) -> int:
    from tfimage.agent.deadline import deadline
    from tfimage.agent.step.plan import LAYOUT_VARS, StepRequest, plan_step

    if os.geteuid() != 0:
        raise TfimageError("step-prepare runs as root, from the SPANK plugin")
    layout = {}
    for item in args.layout:
        name, sep, value = item.partition("=")
        if not sep or name not in LAYOUT_VARS:
            raise TfimageError(f"step-prepare: unexpected --layout {name[:40]!r}")
        layout[name] = value
    req = StepRequest(
        job_id=args.job,
        step_id=args.step,
        uid=args.uid,
        image=args.image,
        workdir=args.workdir or None,
        script=args.script or None,
        gpus=args.gpus,
        layout=layout,
        node_id=args.node_id,
        local_tasks=args.local_tasks,
        tf_mount=args.mounts,
    )
    cfg = _config(args)
    with deadline(cfg.hook_deadline, "step preparation"):
        plan = plan_step(cfg, req)
    # A NUL-separated token stream for the plugin:
    #   argv N a1 .. aN        the runtime's prefix
    #   env L NAME VALUE       set NAME=VALUE in local task L, unless the user set it
    #   src PATH               a --tf-mount source each task checks, as the user
    tokens = ["argv", str(len(plan.argv)), *plan.argv]
    for src in plan.sources:
        tokens += ["src", src]
    for local, env in sorted(plan.env.items()):
        for name, value in sorted(env.items()):
            tokens += ["env", str(local), name, value]
    sys.stdout.write("\0".join(tokens) + "\0")
    return 0


def cmd_config_compile(args: argparse.Namespace) -> int:
    from tfimage.agent.config import compile_config

    try:
        out = compile_config(args.config)
    except OSError as e:  # writing the JSON beside it; reading is ConfigError
        raise TfimageError(f"{args.config}: cannot compile: {e.strerror}") from None
    _emit(args, {"config": args.config, "compiled": str(out)}, f"compiled {args.config} -> {out}")
    return 0


def cmd_daemon(args: argparse.Namespace) -> int:
    from tfimage.agent.daemon.server import serve

    if os.geteuid() != 0:
        raise TfimageError("daemon: runs as root on a compute or login node")
    cfg = _config(args)
    state = Path(cfg.state_dir)
    resolve = None if args.no_resolver else Path(args.resolve_socket or state / "resolve.sock")
    return serve(Path(args.socket or state / "daemon.sock"), cfg, resolve)


def cmd_doctor(args: argparse.Namespace) -> int:
    from tfimage.agent.cli.doctor import Context, exit_status, run_checks
    from tfimage.agent.cli.slurmconf import slurm_conf_path

    ctx = Context(Path(args.config), Path(args.slurm_conf or slurm_conf_path()), login=args.login)
    findings = run_checks(ctx)
    status = exit_status(findings)
    if args.json:
        verdict = ("ok", "warning", "error")[status]
        print(json.dumps({"status": verdict, "findings": [f.as_dict() for f in findings]}))
        return status
    for f in findings:
        print(f"{f.level.upper():8} {f.check:9} {f.message}")
        if f.fix and f.level in ("warning", "error"):
            print(f"{'':18}fix: {f.fix}")
    return status


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfimage",
        description="Inspect and manage a node's tfimage cache; helpers for the Slurm plugin.",
        epilog="Exit codes: 0 ok, 1 error, 2 bad config/credentials/reference, "
        "3 image or runtime not ready, 70 internal error.",
    )
    p.add_argument("--version", action="version", version=f"tfimage {tfimage.__version__}")
    p.add_argument(
        "--config",
        default=os.environ.get("TFIMAGE_CONFIG") or str(DEFAULT_PATH),
        help=f"site config file (default $TFIMAGE_CONFIG or {DEFAULT_PATH})",
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

    sc = sub.add_parser(
        "submit-check", help="(plugin helper) check --tf-image and --tf-mount at submit"
    )
    sc.add_argument("ref", help="image reference")
    sc.add_argument("--mounts", default="", help="the --tf-mount value")
    sc.add_argument("--offline", action="store_true", help="check only; do not pin the tag")
    sc.set_defaults(func=cmd_submit_check)

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
        "--resolve-socket",
        default="",
        help="users' pinning socket (default STATE_DIR/resolve.sock)",
    )
    dm.add_argument("--no-resolver", action="store_true", help="serve no pinning for users")
    dm.set_defaults(func=cmd_daemon)

    dr = sub.add_parser(
        "doctor",
        help="check this node: config, plugin, hooks, runtime, registry, cache, NVML",
        description="Check how tfimage is wired into this node. Exit 0: all in order; "
        "1: warnings; 2: errors. Each problem comes with what to fix.",
    )
    dr.add_argument("--json", action="store_true", help="machine-readable output")
    dr.add_argument(
        "--login", action="store_true", help="a login node: only config, plugin and registry"
    )
    dr.add_argument("--slurm-conf", default="", help="slurm.conf (default $SLURM_CONF)")
    dr.set_defaults(func=cmd_doctor)

    from tfimage.agent.cli.cache import register

    register(sub, cmd_pull)

    sp = sub.add_parser(
        "step-prepare", help="(plugin helper, root) ready the image for a step, print its argv"
    )
    sp.add_argument("--job", required=True)
    sp.add_argument("--step", required=True)
    sp.add_argument("--uid", required=True, type=int)
    sp.add_argument("--image", required=True)
    sp.add_argument("--workdir", default="")
    sp.add_argument("--script", default="")
    sp.add_argument("--gpus", action="store_true")
    sp.add_argument(
        "--layout",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a step variable (SLURM_STEP_NODELIST and friends)",
    )
    sp.add_argument("--node-id", type=int, default=0)
    sp.add_argument("--mounts", default="", help="the step's --tf-mount value")
    sp.add_argument("--local-tasks", type=int, default=0)
    sp.set_defaults(func=cmd_step_prepare)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except TfimageError as e:
        print(f"tfimage: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one line for a person, never a traceback
        print(f"tfimage: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())

"""The plugin's two hidden commands, as agent/core/wire.py describes them.

``submit-check`` (srun/sbatch/salloc, as the user, when no pin server answers) and
``step-prepare`` (slurmstepd, as root, when no daemon answers; the daemon runs the
same code).  Neither is for people: ``tfimage --help`` lists them as the plugin's.
"""

from __future__ import annotations

import argparse
import os
import sys

from tfimage.agent.core import wire
from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.errors import TfimageError
from tfimage.agent.core.reference import Reference


def pin_for_user(cfg: Config, ref: Reference, job_image: str) -> tuple[str, str | None]:
    """``ref`` pinned as this process's user; a fallback's warning."""
    from tfimage.agent.submit.pin import pin

    pinned, warning = pin(cfg, ref, job_image=job_image or None)
    return str(pinned), warning


def cmd_submit_check(args: argparse.Namespace) -> int:
    from tfimage.agent.step.binds import parse_user_binds

    cfg = load_config(args.config)
    ref = cfg.reference(args.ref)
    parse_user_binds(args.tf_mount, cfg.bind_prefixes, cfg.default_binds)
    if args.offline:
        print(ref)
        return 0
    pinned, warning = pin_for_user(cfg, ref, args.job_image)
    if warning:
        print(f"tfimage: {warning}", file=sys.stderr)
    print(pinned)
    return 0


def cmd_step_prepare(args: argparse.Namespace) -> int:
    from tfimage.agent.core.deadline import deadline
    from tfimage.agent.step.plan import StepRequest, plan_step

    if os.geteuid() != 0:
        raise TfimageError("step-prepare runs as root, from the SPANK plugin")
    layout = {}
    for item in args.layout:
        name, sep, value = item.partition("=")
        if not sep or name not in wire.LAYOUT_VARS:
            raise TfimageError(f"step-prepare: unexpected --layout {name[:40]!r}")
        layout[name] = value
    for flag, value in (("--array-job", args.array_job), ("--array-task", args.array_task)):
        if value and not (value.isascii() and value.isdigit() and len(value) <= 10):
            raise TfimageError(f"step-prepare: {flag} must be a number, not {value[:40]!r}")
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
        tf_mount=args.tf_mount,
        array_job=args.array_job,
        array_task=args.array_task,
    )
    cfg = load_config(args.config)
    with deadline(cfg.hook_deadline, "step preparation"):
        plan = plan_step(cfg, req)
    sys.stdout.buffer.write(wire.encode_step_answer(plan.argv, plan.host_paths, plan.env))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The two commands, their flags exactly wire.py's.  Without ``help=`` argparse
    leaves them out of ``tfimage --help``: they are the plugin's, not a person's
    (``tfimage submit-check --help`` still explains each)."""
    sc = sub.add_parser(
        wire.SUBMIT_CHECK,
        description="What the SPANK plugin runs at submit when no pin server answers: "
        "check the reference and the --tf-mount value, and print the reference pinned "
        "to its digest (with the user's own credentials).",
    )
    sc.add_argument("ref", help="image reference")
    sc.add_argument("--tf-mount", default="", help="the job's --tf-mount value")
    sc.add_argument("--job-image", default="", help="the pinned image of the job it runs in")
    sc.add_argument("--offline", action="store_true", help="check only; do not pin the tag")
    sc.set_defaults(func=cmd_submit_check)

    sp = sub.add_parser(
        wire.STEP_PREPARE,
        description="What the SPANK plugin runs as root for each step when no daemon "
        "answers: ready the image and print the runtime's argv and each task's "
        "variables (agent/core/wire.py).",
    )
    sp.add_argument("--job", required=True)
    sp.add_argument("--step", required=True)
    sp.add_argument("--uid", required=True, type=int)
    sp.add_argument("--image", required=True)
    sp.add_argument("--node-id", type=int, default=0)
    sp.add_argument("--local-tasks", type=int, default=0)
    sp.add_argument("--workdir", default="")
    sp.add_argument("--script", default="")
    sp.add_argument("--tf-mount", default="", help="the step's --tf-mount value")
    sp.add_argument("--gpus", action="store_true", help="Slurm allocated GPUs to the step")
    sp.add_argument("--array-job", default="", help="the job array's id (a task of one)")
    sp.add_argument("--array-task", default="", help="the task's index in its array")
    sp.add_argument(
        "--layout",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a step variable (SLURM_STEP_NODELIST and friends)",
    )
    sp.set_defaults(func=cmd_step_prepare)

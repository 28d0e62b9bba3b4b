"""``tfimage partition-check``: at submit, whether the job's partition runs its image.

The site's cli_filter (the role's ``cli_filter_tfimage.lua``) calls it from srun,
sbatch and salloc, as the user, with ``--partition`` as the job asked (``-p``,
``#SBATCH -p``, ``SLURM_PARTITION``: cli_filter sees them all, where the SPANK
plugin sees none) and the ``--tf-image`` text as written.  A refusal is one
``tfimage: partition-check: partition ...`` line and exit 2, and the cli_filter stops
the job before it is queued.  The rules are the config's ``partitions:``, by name
only (core/partition.py's check_name): the size and whether an image is OCI need
its manifest, and the node's prolog judges those (as it judges everything again:
this check spares a user a queued job that would fail, it is not the enforcement).

A job that names no partition goes to Slurm's default one, asked of scontrol; a
job that names several is refused when any of them refuses (Slurm may start it in
that one).
"""

from __future__ import annotations

import argparse
import json
import re

from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.errors import InputError, TfimageError
from tfimage.agent.core.partition import check_name, rules_for
from tfimage.agent.core.toolrun import run, slurm_env, slurm_tool

_PARTITION = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
MAX_PARTITIONS = 16


def partitions(text: str) -> list[str]:
    """``prod`` or ``prod,dev`` as Slurm takes ``--partition``, checked."""
    names = [p for p in text.split(",") if p]
    if len(names) > MAX_PARTITIONS or not all(_PARTITION.match(p) for p in names):
        raise InputError(f"{text[:80]!r} is not a list of partition names")
    return names


def default_partition(slurm_bin: str = "") -> str:
    """Slurm's default partition ("" when it has none)."""
    out = run(
        [slurm_tool("scontrol", slurm_bin), "-o", "show", "partition"],
        timeout=10.0,
        what="scontrol",
        env=slurm_env(),
    )
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("Default") == "YES":
            return fields.get("PartitionName", "")
    return ""


def check(cfg: Config, image: str, partition_text: str) -> list[str]:
    """The partitions checked (none: no rule applies); PolicyError (exit 2, one
    line: dispatch prints it) for a refusal.  A reference that does not parse, or
    one the rest of the config refuses, passes here: the SPANK plugin's own check at
    submit, which runs next, says what is wrong with it, once."""
    if not cfg.partitions or not image:
        return []
    names = partitions(partition_text) or [default_partition(cfg.gpu.slurm_bin)]
    ruled = [(n, rules_for(cfg.partitions, n)) for n in names if n]
    ruled = [(n, rules) for n, rules in ruled if rules]
    if not ruled:
        return []
    try:
        ref = cfg.reference(image)
    except TfimageError:
        return []
    for name, rules in ruled:
        check_name(rules, name, ref, image)
    return [n for n, _ in ruled]


def cmd_partition_check(args: argparse.Namespace) -> int:
    checked = check(load_config(args.config), args.image, args.partition)
    if args.json:
        print(json.dumps({"image": args.image, "allowed": True, "partitions": checked}))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sc = sub.add_parser(
        "partition-check",
        help="at submit: does the job's partition run this image (the cli_filter's call)",
        description="Check --tf-image against the config's partitions: rules, by name (the "
        "registry, the repository, a digest where one is required, docker:// where "
        "conversion is off), as srun, sbatch and salloc submit; exit 2 with the reason "
        "when a partition refuses it.  The node's prolog checks again, size included.",
    )
    sc.add_argument("image", help="the --tf-image text as the user wrote it")
    sc.add_argument(
        "--partition",
        default="",
        help="the job's partition, or several comma-separated (default: Slurm's default one)",
    )
    sc.add_argument("--json", action="store_true", help="machine-readable output")
    sc.set_defaults(func=cmd_partition_check)

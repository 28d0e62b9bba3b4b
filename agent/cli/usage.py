"""``tfimage usage report``: what ran, from the usage records of many nodes.

Reads the files and directories given (default: this node's usage log).  One view
at a time: the summary ``--by`` image, user, account, partition or node; ``--top-failing N``;
``--trend day|week``.  A table on a terminal, JSON with ``--json``; ``--plot`` also
draws the duration trend and the failing images to a PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tfimage.agent.cli import report
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import InputError

SUMMARY = [
    ("key", ""),
    ("jobs", "JOBS"),
    ("failures", "FAILED"),
    ("failure_rate", "FAIL%"),
    ("median_seconds", "MEDIAN"),
    ("p90_seconds", "P90"),
    ("gpu_hours", "GPU-H"),
    ("energy_kwh", "KWH"),
]
FAILING = [
    ("image", "IMAGE"),
    ("jobs", "JOBS"),
    ("failures", "FAILED"),
    ("failure_rate", "FAIL%"),
    ("rank_score", "AT LEAST"),
]
TRENDS = [
    ("period", ""),
    ("jobs", "JOBS"),
    ("failures", "FAILED"),
    ("mean_seconds", "MEAN"),
    ("median_seconds", "MEDIAN"),
]


def cmd_report(args: argparse.Namespace) -> int:
    paths = args.paths or [load_config(args.config).usage_log]
    if not all(paths):
        raise InputError("no usage log configured here; give files or directories")
    since = report.parse_when(args.since) if args.since else None
    until = report.parse_when(args.until) if args.until else None
    if since and until and since >= until:
        raise InputError("--since must be before --until")
    loaded = report.load(paths, by=args.by, since=since, until=until)
    doc: dict[str, Any] = {
        "files": loaded.files,
        "records": len(loaded.jobs),
        "skipped_lines": loaded.skipped,
        "duplicates": loaded.duplicates,
        "damaged_files": len(loaded.damaged),
        "since": since.isoformat() if since else None,
        "until": until.isoformat() if until else None,
    }
    if args.top_failing is not None:
        doc["top_failing"] = rows = report.top_failing(loaded.jobs, args.top_failing)
        text = report.table(rows, FAILING)
    elif args.trend:
        doc["trend"] = rows = report.trend(loaded.jobs, args.trend)
        text = report.table(rows, TRENDS)
    else:
        doc["by"] = args.by
        doc["groups"] = rows = report.summarize(loaded.jobs)
        text = report.table(rows, [(k, h or args.by.upper()) for k, h in SUMMARY])
    if args.plot:
        from tfimage.agent.cli.plot import plot

        doc["plot"] = str(
            plot(
                Path(args.plot),
                report.trend(loaded.jobs, args.trend or "day"),
                report.top_failing(loaded.jobs, args.top_failing or 10),
            )
        )
    for what in loaded.damaged:
        print(f"tfimage: usage report: {what}: read what it had", file=sys.stderr)
    if loaded.skipped:
        print(f"tfimage: usage report: skipped {loaded.skipped} line(s) that are not usage "
              "records", file=sys.stderr)  # fmt: skip
    if args.json:
        print(json.dumps(doc, sort_keys=True))
    elif not loaded.jobs:
        print(f"no usage records in {loaded.files} file(s)"
              + (" for that period" if since or until else ""))  # fmt: skip
    else:
        print(text if rows else "no such jobs")
    return 0


def register(sub: Any) -> None:
    u = sub.add_parser(
        "usage",
        help="what ran: jobs, failures, durations, GPU-hours from usage records",
        description=__doc__,
    )
    usub = u.add_subparsers(dest="usage_command", required=True, metavar="COMMAND")
    r = usub.add_parser(
        "report",
        help="aggregate usage records from one or many nodes",
        description="Aggregate usage records (one JSON line per job per node, written by "
        "the epilog). PATHS are files or directories of many nodes' logs; rotated "
        "(.1) and compressed (.gz) logs are read too. Times are UTC.",
        epilog="Examples: tfimage usage report /shared/usage --since 7d --by user;  "
        "tfimage usage report /shared/usage --top-failing 5;  "
        "tfimage usage report /shared/usage --trend week --plot trend.png",
    )
    r.add_argument("paths", nargs="*", metavar="PATH", help="files or directories "
                   "(default: this node's usage_log)")  # fmt: skip
    r.add_argument("--since", help="from this time: 2026-12-01, 2026-12-01T08:00, or 7d, 12h")
    r.add_argument("--until", help="up to (not including) this time; same forms")
    r.add_argument("--by", default="image", choices=report.BY,
                   help="group the summary by this (default image)")  # fmt: skip
    view = r.add_mutually_exclusive_group()
    view.add_argument("--top-failing", type=int, metavar="N",
                      help="the N images with the highest failure rate (ranked so that "
                      "1 failure in 1 job does not top the list)")  # fmt: skip
    view.add_argument("--trend", choices=report.TREND,
                      help="average training duration per day or ISO week")  # fmt: skip
    r.add_argument("--plot", metavar="FILE.png",
                   help="also draw the duration trend and failing images (matplotlib)")  # fmt: skip
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(func=cmd_report)

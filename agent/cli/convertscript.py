"""``tfimage convert-script``: a batch script's singularity/apptainer lines as tfimage's
(agent/submit/script.py does the converting; this is the command around it)."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

from tfimage.agent.core.errors import InputError
from tfimage.agent.submit.script import convert

MAX_SCRIPT = 1 << 20  # Slurm's own limit on a batch script is 4 MiB; 1 MiB is generous


def _read(name: str) -> str:
    try:
        data = sys.stdin.buffer.read(MAX_SCRIPT + 1) if name == "-" else _read_file(Path(name))
    except OSError as e:
        raise InputError(f"{name}: {e.strerror or e}") from None
    if len(data) > MAX_SCRIPT:
        raise InputError(f"{name}: larger than {MAX_SCRIPT} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise InputError(f"{name}: not UTF-8 text") from None


def _read_file(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(MAX_SCRIPT + 1)


def _write(path: Path, text: str) -> Path:
    """Replace ``path`` with ``text`` (same mode), keeping the original as FILE.bak, or
    FILE.bak.N when that exists: an earlier backup is never lost."""
    real = Path(os.path.realpath(path))
    mode = real.stat().st_mode & 0o7777
    tmp = real.with_name(f".{real.name}.tfimage-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "w", encoding="utf-8") as f:
            os.fchmod(fd, mode)  # the umask has no say: the script keeps its own mode
            f.write(text)
        for n in range(1000):
            backup = real.with_name(real.name + (f".bak.{n}" if n else ".bak"))
            try:
                os.link(real, backup)
                break
            except FileExistsError:
                continue
        else:
            raise InputError(f"{path}: 1000 backups already: remove some")
        os.replace(tmp, real)
    finally:
        tmp.unlink(missing_ok=True)
    return backup


def cmd_convert_script(args: argparse.Namespace) -> int:
    if args.write and args.file == "-":
        raise InputError("--write needs a file, not -")
    before = _read(args.file)
    got = convert(before)
    name = args.file
    if args.json:
        print(json.dumps({"file": name, "image": got.image, "binds": got.binds,
                          "converted": got.changed, "problems": got.problems,
                          "text": got.text}))  # fmt: skip
    elif args.diff:
        sys.stdout.writelines(difflib.unified_diff(
            before.splitlines(keepends=True), got.text.splitlines(keepends=True),
            f"a/{name}", f"b/{name}"))  # fmt: skip
    elif not args.write:
        sys.stdout.write(got.text)
    for problem in got.problems:
        print(f"tfimage: convert-script: {name}: {problem}", file=sys.stderr)
    if args.write and got.text != before:
        backup = _write(Path(name), got.text)
        print(f"tfimage: convert-script: {name}: {got.changed} line(s) converted; "
              f"the original is {backup}", file=sys.stderr)  # fmt: skip
    if not got.changed and not got.problems:
        print(f"tfimage: convert-script: {name}: no singularity or apptainer exec line",
              file=sys.stderr)  # fmt: skip
    return 1 if got.problems else 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cs = sub.add_parser(
        "convert-script",
        help="rewrite a batch script's singularity/apptainer exec lines for --tf-image",
        description="Rewrite a batch script's `singularity exec` / `apptainer exec|run` "
        "lines into #SBATCH --tf-image and --tf-mount lines and the bare command, keeping "
        "everything else as it is. A construct it cannot convert (several images, an "
        "image in a variable, an exec in a loop, a local .sif) is left as is with a "
        "comment saying why, and the exit status is 1.",
    )
    cs.add_argument("file", help="the batch script (- for standard input)")
    how = cs.add_mutually_exclusive_group()
    how.add_argument("--diff", action="store_true", help="print a unified diff")
    how.add_argument(
        "--write", action="store_true", help="replace the file (the original kept as FILE.bak)"
    )
    how.add_argument("--json", action="store_true", help="machine-readable output")
    cs.set_defaults(func=cmd_convert_script)

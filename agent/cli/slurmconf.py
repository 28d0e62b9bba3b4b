"""Just enough of slurm.conf and plugstack.conf to check how tfimage is wired in.

Read-only and strict about what it understands: ``Key=Value`` words, ``#`` comments,
``Include`` lines (relative to the including file's directory).  Keys are
case-insensitive in Slurm, so they are folded to lower case here.
"""

from __future__ import annotations

import glob
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SLURM_CONF = Path("/etc/slurm/slurm.conf")
_MAX_BYTES = 4 << 20
_MAX_DEPTH = 8


def slurm_conf_path() -> Path:
    return Path(os.environ.get("SLURM_CONF") or DEFAULT_SLURM_CONF)


def _text(path: Path) -> str:
    with path.open("rb") as f:
        return f.read(_MAX_BYTES).decode("utf-8", "replace")


def read_slurm_conf(path: Path, _depth: int = 0) -> dict[str, str]:
    """``{key.lower(): value}``; the last setting wins, as in Slurm.  Node and
    partition lines (several words) keep only their first word's value."""
    out: dict[str, str] = {}
    for raw in _text(path).splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        word, _, rest = line.partition(" ")
        if word.lower() == "include" and _depth < _MAX_DEPTH:
            pattern = rest.strip()
            base = pattern if pattern.startswith("/") else str(path.parent / pattern)
            for inc in sorted(glob.glob(base)):
                out.update(read_slurm_conf(Path(inc), _depth + 1))
            continue
        key, eq, value = word.partition("=")
        if eq:
            out[key.lower()] = value
    return out


@dataclass(frozen=True)
class SpankEntry:
    required: bool
    path: str
    args: tuple[str, ...]
    conf_file: Path  # the plugstack file that names it


def read_plugstack(path: Path, _depth: int = 0) -> list[SpankEntry]:
    """Every plugin line, following ``include`` globs."""
    out: list[SpankEntry] = []
    for raw in _text(path).splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        head = words[0].lower()
        if head == "include" and len(words) > 1 and _depth < _MAX_DEPTH:
            for inc in sorted(glob.glob(words[1])):
                out.extend(read_plugstack(Path(inc), _depth + 1))
        elif head in ("required", "optional") and len(words) > 1:
            out.append(SpankEntry(head == "required", words[1], tuple(words[2:]), path))
    return out


def hook_scripts(value: str) -> list[Path]:
    """The programs a ``Prolog=``/``Epilog=`` value runs (it may be a glob)."""
    out: list[Path] = []
    for part in value.split(","):
        part = part.strip()
        if part:
            out.extend(Path(p) for p in sorted(glob.glob(part)))
    return out

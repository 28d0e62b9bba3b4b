"""A batch script's ``singularity exec`` / ``apptainer exec|run`` lines as tfimage's.

Pure: text in, text out.  What changes::

    #SBATCH ...                        kept
    #SBATCH --tf-image=IMAGE           added after the last #SBATCH line (or the #!)
    #SBATCH --tf-mount=SRC:DST[:ro],.. added, from every --bind/-B
    module load singularity/3.8        commented out: nothing to load any more
    [srun ...] singularity exec [flags] IMAGE CMD...
                                       [srun ...] [env K=V ...] CMD...

``--nv`` goes (a GPU step gets the host's driver by itself), ``--env K=V`` becomes
``env K=V`` before the command, ``--pwd DIR`` a ``sh -c 'cd DIR && exec "$0" "$@"'``
before it, ``--cleanenv`` goes with a comment (a task keeps the job's environment:
TF_CONFIG and NCCL's variables are set there).  The command itself, and every
other line, is kept byte for byte.  Where the script's job has several tasks, its
batch script runs on the host (``--tf-batch=auto``), so a bare exec line becomes
``srun --ntasks=1 --nodes=1 CMD``: one task in the image, as the exec was one
process.

Left untouched, with a ``# tfimage convert-script:`` comment above saying why, and
the conversion reported as incomplete: several images in one script, an image in
a shell variable, an exec inside a loop, a local ``.sif`` file (push it first),
``run`` with no command (the image's runscript), a flag with no tfimage
equivalent, and two binds onto one destination.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field

MARK = "# tfimage convert-script:"
_RUNTIMES = ("singularity", "apptainer")
_DROPPED = {"--nv", "--nvccli"}
_CLEANENV = {"--cleanenv", "-e"}
_WITH_VALUE = {"--bind", "-B", "--pwd", "--env"}
_LOOP = re.compile(r"\s*(for|while|until)\b")
_DONE = re.compile(r"(^|[;\s])done\b")
_MODULE = re.compile(r"\s*module\s+(load|add)\s+(singularity|apptainer)\S*\s*$")
_SBATCH = re.compile(r"#SBATCH\s")
_TASKS = re.compile(
    r"#SBATCH\s+(?:-n\s*|--ntasks[= ]|-N\s*|--nodes[= ]|--ntasks-per-node[= ])(\d+)"
)


@dataclass
class Converted:
    text: str
    image: str | None = None
    binds: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # one per construct left as is
    changed: int = 0  # exec lines converted


@dataclass(frozen=True)
class _Word:
    text: str  # unquoted
    start: int
    end: int


def _words(line: str) -> Iterator[_Word]:
    """Shell words of one logical line with their spans; stops at a comment."""
    i, n = 0, len(line)
    while i < n:
        while i < n and line[i] in " \t":
            i += 1
        if i >= n or line[i] == "#":
            return
        start, out = i, []
        while i < n and line[i] not in " \t":
            c = line[i]
            if c == "\\" and i + 1 < n:
                out.append(line[i + 1])
                i += 2
            elif c in "'\"":
                close = line.find(c, i + 1)
                if close < 0:
                    raise ValueError("an unclosed quote")
                out.append(line[i + 1 : close])
                i = close + 1
            elif c in ";&|<>()" and out == [] and i == start:
                out.append(c)
                i += 1
                break
            else:
                out.append(c)
                i += 1
        yield _Word("".join(out), start, i)


@dataclass
class _Exec:
    image: str
    binds: list[str]
    env: list[str]
    pwd: str | None
    cleanenv: bool
    prefix: str  # the line before the runtime, verbatim (srun ..., time, ...)
    command: str  # the line after the image, verbatim


def _parse(line: str) -> _Exec | str | None:
    """The exec on this logical line; a reason when it cannot be converted; None when
    there is none."""
    if not any(r in line for r in _RUNTIMES):
        return None
    try:
        words = list(_words(line))
    except ValueError as e:
        return f"{e} on a line that names {' or '.join(_RUNTIMES)}"
    at = next(
        (
            i
            for i, w in enumerate(words[:-1])
            if w.text.rsplit("/", 1)[-1] in _RUNTIMES and words[i + 1].text in ("exec", "run")
        ),
        None,
    )
    if at is None:
        return None
    sub = words[at + 1].text
    binds: list[str] = []
    env: list[str] = []
    pwd: str | None = None
    cleanenv = False
    i = at + 2
    while i < len(words) and words[i].text.startswith("-"):
        flag, eq, value = words[i].text.partition("=")
        if flag.startswith("-B") and flag != "-B":
            flag, eq, value = "-B", "=", flag[2:]
        if flag in _DROPPED:
            i += 1
            continue
        if flag in _CLEANENV and not eq:
            cleanenv = True
            i += 1
            continue
        if flag not in _WITH_VALUE:
            return f"{flag} has no tfimage equivalent"
        if not eq:
            if i + 1 >= len(words):
                return f"{flag} has no value"
            value = words[i + 1].text
            i += 1
        i += 1
        if flag in ("--bind", "-B"):
            binds += [b for b in value.split(",") if b]
        elif flag == "--env":
            env += [e for e in value.split(",") if e]
        else:
            pwd = value
    if i >= len(words):
        return "no image on the line"
    image = words[i].text
    if "$" in line[words[i].start : words[i].end] or "`" in image:
        return "the image is a shell variable: name it in --tf-image yourself"
    if not image.startswith(("docker://", "oras://", "library://", "shub://")) and (
        image.endswith(".sif") or image.startswith(("/", ".", "~"))
    ):
        return (
            f"{image} is a local file: push it (tfimage push {image} NAME:TAG), "
            "then use --tf-image=NAME:TAG"
        )
    if image.startswith(("library://", "shub://")):
        return f"{image.split('://')[0]}:// images are not served by the site's registry"
    if i + 1 >= len(words):
        if sub == "run":
            return "run without a command runs the image's runscript: name the command"
        return "exec without a command"
    prefix = line[: words[at].start]
    command = line[words[i + 1].start :]
    return _Exec(image, binds, env, pwd, cleanenv, prefix, command)


def _bind(spec: str) -> tuple[str, str, str]:
    src, _, rest = spec.partition(":")
    dst, _, opts = rest.partition(":")
    return src, dst or src, opts


def _logical(lines: list[str]) -> Iterator[tuple[int, int]]:
    """(first, last) physical line of each logical line (backslash continuations)."""
    i = 0
    while i < len(lines):
        j = i
        while lines[j].rstrip("\n").endswith("\\") and j + 1 < len(lines):
            j += 1
        yield i, j
        i = j + 1


def convert(text: str) -> Converted:
    lines = text.splitlines(keepends=True)
    multi = any(
        int(m.group(1)) > 1 for line in lines if (m := _TASKS.match(line.strip()))
    )
    out: list[str] = []
    found: list[tuple[int, _Exec]] = []  # (index into out, the exec)
    problems: list[str] = []
    modules: list[int] = []  # index into out of each `module load singularity`
    depth = 0
    for first, last in _logical(lines):
        chunk = lines[first : last + 1]
        joined = "".join(chunk)
        logical = "".join(c.rstrip("\n").removesuffix("\\") + " " for c in chunk)
        stripped = logical.strip()
        if _LOOP.match(logical):
            depth += 1
        got = None if stripped.startswith("#") else _parse(logical)
        if isinstance(got, _Exec) and depth:
            got = "an exec inside a loop may run other images: convert it by hand"
        if isinstance(got, str):
            problems.append(f"line {first + 1}: {got}")
            out.append(f"{MARK} left as is: {got}\n")
            out.append(joined)
        elif isinstance(got, _Exec):
            found.append((len(out), got))
            out.append(joined)
        elif _MODULE.match(logical.rstrip()):
            modules.append(len(out))
            out.append(joined)
        else:
            out.append(joined)
        if depth and _DONE.search(logical):
            depth -= 1
    result = Converted("", problems=problems)
    images = sorted({e.image for _, e in found})
    if len(images) > 1:
        why = f"several images in one script ({', '.join(images)}): one --tf-image per job"
        for at, _ in reversed(found):
            out.insert(at, f"{MARK} left as is: {why}\n")
        result.problems.append(why)
        found = []
    binds: dict[str, tuple[str, str]] = {}
    for at, e in found:
        for spec in e.binds:
            src, dst, opts = _bind(spec)
            if binds.get(dst, (src, opts)) != (src, opts):
                why = f"two binds onto {dst}"
                out.insert(at, f"{MARK} left as is: {why}\n")
                result.problems.append(why)
                found = []
                break
            binds[dst] = (src, opts)
    if not found:
        result.text = "".join(out)
        return result
    for at in modules:
        out[at] = f"# {out[at].rstrip()}  # tfimage: not needed with --tf-image\n"
    for at, e in found:
        new = e.prefix
        if not e.prefix.strip() and multi:
            new += "srun --ntasks=1 --nodes=1 "
        if e.pwd:
            inner = f'cd {shlex.quote(e.pwd)} && exec "$0" "$@"'
            new += f"sh -c {shlex.quote(inner)} "
        if e.env:
            new += "env " + " ".join(shlex.quote(v) for v in e.env) + " "
        new += e.command.rstrip() + "\n"
        note = f"{MARK} --cleanenv dropped: a task keeps the job's environment\n"
        out[at] = (note if e.cleanenv else "") + new
    result.image = images[0]
    result.binds = [f"{s}:{d}" + (f":{o}" if o else "") for d, (s, o) in binds.items()]
    result.changed = len(found)
    header = [f"#SBATCH --tf-image={result.image}\n"]
    if result.binds:
        header.append(f"#SBATCH --tf-mount={','.join(result.binds)}\n")
    last_sbatch = max((i for i, line in enumerate(out) if _SBATCH.match(line)), default=-1)
    if last_sbatch < 0:
        last_sbatch = 0 if out and out[0].startswith("#!") else -1
    if last_sbatch >= 0 and not out[last_sbatch].endswith("\n"):
        out[last_sbatch] += "\n"
    out[last_sbatch + 1 : last_sbatch + 1] = header
    result.text = "".join(out)
    return result

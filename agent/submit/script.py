"""A batch script's ``singularity exec`` / ``apptainer exec|run`` lines as tfimage's.

Pure: text in, text out.  What changes::

    #SBATCH ...                        kept
    #SBATCH --tf-image=IMAGE           added after the script's last leading #SBATCH
    #SBATCH --tf-mount=SRC:DST[:ro],..   line (where sbatch still reads them), from
    #SBATCH --tf-batch=container|host    every --bind/-B; see below for --tf-batch
    module load singularity/3.8        commented out: nothing to load any more
    [srun ...] singularity exec [flags] docker://IMAGE CMD...
                                       [srun ...] [env K=V ...] CMD...

``--nv`` goes (a GPU step gets the host's driver by itself), ``--env K=V`` becomes
``env K=V`` before the command, ``--pwd DIR`` a ``sh -c 'cd DIR && exec "$0" "$@"'``
before it, ``--cleanenv`` goes with a comment (a task keeps the job's environment:
TF_CONFIG and NCCL's variables are set there).  The command itself, and every
other line, is kept byte for byte.

Where the command runs is said explicitly, whatever the job's task count: bare
exec lines (what ran once, on the batch host) make ``--tf-batch=container`` (the
whole batch script runs in the image); exec lines behind ``srun`` make
``--tf-batch=host`` (the script on the host, each step in the image).

Left untouched, with a ``# tfimage convert-script:`` comment above saying why, and
the conversion reported as incomplete: several images in one script, bare and
``srun`` exec lines in one script, an image in a shell variable or without
``docker://`` or ``oras://`` (singularity reads that as a local image: push it
first), a shell expansion in a flag (``$``, a backquote, ``~``), a relative bind,
an exec inside a loop or one it cannot read (in ``$(...)``, a second one on a
line), ``mpirun`` in front, ``run`` with no command (the image's runscript), a
flag with no tfimage equivalent, and two binds onto one destination.
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
_LOOP = re.compile(r"(^|[;&|])\s*(for|while|until)\s")
_DONE = re.compile(r"(^|[;&|])\s*done\b")
_ANY_EXEC = re.compile(r"(^|[^\w.-])(singularity|apptainer)\s+(exec|run)\b")
_EXPANDS = re.compile(r"[$`~]")
_MPI = ("mpirun", "mpiexec", "orterun")
_MODULE = re.compile(r"\s*module\s+(load|add)\s+(singularity|apptainer)\S*\s*$")
_SBATCH = re.compile(r"#SBATCH\s")


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
    step: bool  # srun in front: a step of the job, from a batch script on the host


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
        raw = line[words[i].start : words[i].end]
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
            raw = line[words[i + 1].start : words[i + 1].end]
            i += 1
        i += 1
        if _EXPANDS.search(raw):
            return f"{flag} {raw} uses the shell ($, `, ~): convert it by hand"
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
    if image.startswith(("library://", "shub://")):
        return f"{image.split('://')[0]}:// images are not served by the site's registry"
    if not image.startswith(("docker://", "oras://")):
        return (
            f"{image} is a local image: push it (tfimage push {image} NAME:TAG), "
            "then use --tf-image=NAME:TAG"
        )
    for spec in binds:
        src, dst, _ = _bind(spec)
        if not (src.startswith("/") and dst.startswith("/")):
            return f"the bind {spec} is not absolute: --tf-mount takes absolute paths"
    if i + 1 >= len(words):
        if sub == "run":
            return "run without a command runs the image's runscript: name the command"
        return "exec without a command"
    before = [w.text.rsplit("/", 1)[-1] for w in words[:at]]
    if any(w in _MPI for w in before):
        return "mpirun in front: use srun, whose steps run in the job's image"
    prefix = line[: words[at].start]
    command = line[words[i + 1].start :]
    if _ANY_EXEC.search(command):
        return "a second exec on the line: convert it by hand"
    return _Exec(image, binds, env, pwd, cleanenv, prefix, command, "srun" in before)


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
    out: list[str] = []
    found: list[tuple[int, _Exec]] = []  # (index into out, the exec)
    problems: list[str] = []
    modules: list[int] = []  # index into out of each `module load singularity`
    depth = 0
    leading = True  # still in the leading comment block, where sbatch reads #SBATCH
    header_at = 0  # where the tfimage #SBATCH lines go

    def refuse(first: int, why: str, joined: str) -> None:
        problems.append(f"line {first + 1}: {why}")
        out.append(f"{MARK} left as is: {why}\n")
        out.append(joined)

    for first, last in _logical(lines):
        chunk = lines[first : last + 1]
        joined = "".join(chunk)
        logical = "".join(c.rstrip("\n").removesuffix("\\") + " " for c in chunk)
        stripped = logical.strip()
        comment = stripped.startswith("#")
        if leading and not (comment or not stripped):
            leading = False
        if leading and (_SBATCH.match(stripped) or (first == 0 and stripped.startswith("#!"))):
            header_at = len(out) + 1
        if not comment and _LOOP.search(logical):
            depth += 1
        got = None if comment else _parse(logical)
        if isinstance(got, _Exec) and depth:
            got = "an exec inside a loop may run other images: convert it by hand"
        if got is None and not comment and _ANY_EXEC.search(logical):
            got = "an exec it cannot read here (inside $(...), or after another command)"
        if isinstance(got, str):
            refuse(first, got, joined)
        elif isinstance(got, _Exec):
            found.append((len(out), got))
            out.append(joined)
        elif _MODULE.match(logical.rstrip()):
            modules.append(len(out))
            out.append(joined)
        else:
            out.append(joined)
        if depth and not comment and _DONE.search(logical):
            depth -= 1
    result = Converted("", problems=problems)
    why = ""
    images = sorted({e.image for _, e in found})
    if len(images) > 1:
        why = f"several images in one script ({', '.join(images)}): one --tf-image per job"
    elif len({e.step for _, e in found}) > 1:
        why = "bare and srun exec lines in one script: its batch script runs in one place"
    binds: dict[str, tuple[str, str]] = {}
    for _, e in found:
        for spec in e.binds:
            src, dst, opts = _bind(spec)
            if binds.get(dst, (src, opts)) != (src, opts):
                why = why or f"two binds onto {dst}"
            binds[dst] = (src, opts)
    if why:
        for at, _ in reversed(found):
            out.insert(at, f"{MARK} left as is: {why}\n")
        result.problems.append(why)
        found = []
    if not found:
        result.text = "".join(out)
        return result
    for at in modules:
        out[at] = f"# {out[at].rstrip()}  # tfimage: not needed with --tf-image\n"
    for at, e in found:
        new = e.prefix
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
    where = "host" if found[0][1].step else "container"
    header.append(f"#SBATCH --tf-batch={where}\n")
    if header_at and not out[header_at - 1].endswith("\n"):
        out[header_at - 1] += "\n"
    out[header_at:header_at] = header
    result.text = "".join(out)
    return result

"""``tfimage(1)``, written from the CLI's own parser, so the page cannot name an
option the command does not take (``make man``; the role writes it on each node
from the installed version).

    python -m tfimage.agent.cli.manpage > tfimage.1

The plugin's two commands are left out, as from ``tfimage --help``: they are the
plugin's, and tfimage-spank(8) describes the plugin.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import tfimage
from tfimage.agent.cli import exits
from tfimage.agent.core import wire

HIDDEN = frozenset({wire.SUBMIT_CHECK, wire.STEP_PREPARE, "daemon"})
DATE = "2026-12-06"


def roff(text: str) -> str:
    """Text as roff reads it literally: backslashes doubled, no line begins a request."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(("\\&" + ln if ln[:1] in ".'" else ln) for ln in text.splitlines())


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _helps(p: argparse.ArgumentParser) -> dict[str, str]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return {c.dest: c.help or "" for c in a._choices_actions}
    return {}


def _option(a: argparse.Action) -> str:
    if a.option_strings:
        names = ", ".join(f"\\fB{roff(o)}\\fR" for o in a.option_strings)
        if a.nargs != 0:
            names += f" \\fI{roff(a.metavar or a.dest.upper())}\\fR"  # type: ignore[arg-type]
        return names
    return f"\\fI{roff(str(a.metavar or a.dest))}\\fR"


def _command(name: str, p: argparse.ArgumentParser, summary: str) -> Iterator[str]:
    subs = _subparsers(p)
    if subs:
        helps = _helps(p)
        for sub, sp in subs.items():
            if sub not in HIDDEN:
                yield from _command(f"{name} {sub}", sp, helps.get(sub, ""))
        return
    usage = p.format_usage().removeprefix("usage: ").strip()
    yield ".TP"
    yield f"\\fB{roff(name)}\\fR"
    yield roff(" ".join((p.description or summary).split()))
    yield ".RS"
    yield ".PP"
    yield f"Usage: \\f(CW{roff(' '.join(usage.split()))}\\fR"
    for a in p._actions:
        if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:
            continue
        yield ".TP"
        yield _option(a)
        yield roff(" ".join((a.help or "").split()) or "\\&")
    yield ".RE"


def render(parser: argparse.ArgumentParser) -> str:
    lines = [
        f'.TH TFIMAGE 1 "{DATE}" "tfimage {tfimage.__version__}" "User Commands"',
        ".SH NAME",
        "tfimage \\- run Slurm TensorFlow jobs in cached, verified SIF images",
        ".SH SYNOPSIS",
        "\\fBtfimage\\fR [\\fB\\-\\-config\\fR \\fIFILE\\fR] \\fICOMMAND\\fR "
        "[\\fIOPTIONS\\fR] [\\fIARGS\\fR]",
        ".SH DESCRIPTION",
        roff(" ".join((parser.description or "").split())),
        ".PP",
        "Users add \\fB\\-\\-tf\\-image\\fR to sbatch, srun or salloc (see "
        "\\fBtfimage\\-spank\\fR(8)); this command pushes and resolves images, and lets "
        "operators inspect a node's cache and GPUs.",
        "Every command takes \\fB\\-\\-help\\fR, and \\fB\\-\\-config\\fR before or after "
        "its name.",
        ".SH COMMANDS",
    ]
    lines += _command("tfimage", parser, "")
    lines += [".SH EXIT STATUS", "The same for every command:"]
    for code, name, meaning in exits.TABLE:
        lines += [".TP", f"\\fB{code}\\fR ({name})", roff(meaning)]
    lines += [
        ".PP",
        "Each error is one line on standard error, \\f(CWtfimage: COMMAND: cause\\fR; "
        "with \\fB\\-\\-json\\fR it is also a JSON object on standard output with the "
        "keys \\fBcommand\\fR, \\fBerror\\fR and \\fBexit\\fR.",
        ".SH ENVIRONMENT",
        ".TP",
        f"\\fB{roff(wire.CONFIG_VAR)}\\fR",
        f"the site config file when \\fB\\-\\-config\\fR is not given (default "
        f"{roff(wire.DEFAULT_CONFIG)})",
        ".SH FILES",
        ".TP",
        roff(wire.DEFAULT_CONFIG),
        "the site config; every key is in docs/config.md",
        ".SH SEE ALSO",
        "\\fBtfimage\\-spank\\fR(8), \\fBsbatch\\fR(1), \\fBsrun\\fR(1), \\fBslurm.conf\\fR(5)",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    from tfimage.agent.cli.main import build_parser

    sys.stdout.write(render(build_parser()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

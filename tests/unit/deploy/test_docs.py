"""The docs against the code: every ``tfimage`` command line in a code block parses
with the command's own parser, every ``--tf-*`` option is one the plugin registers,
every role variable named is one the role has, and every link leads to a file.  A
renamed option or command fails here (the cluster tier runs the user-facing ones:
tests/cluster/test_first_week.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from tfimage.agent.cli.main import build_parser

REPO = Path(__file__).resolve().parents[3]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CODE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _commands(program: str) -> list[tuple[str, list[str]]]:
    """Each line of a code block that runs ``program``, split as a shell would."""
    out = []
    for page in PAGES:
        for lang, body in CODE.findall(page.read_text()):
            if lang not in ("", "bash", "console", "sh"):
                continue
            for line in body.replace("\\\n", " ").splitlines():
                if line.startswith("$ ") or (lang == "console" and line.startswith("# ")):
                    line = line[2:]
                elif lang == "console":
                    continue
                if line.split(" ", 1)[0] != program:
                    continue
                words = shlex.split(line, comments=True)
                if words:
                    out.append((f"{page.name}: {line.strip()}", words[1:]))
    return out


# cli.md shows one failing on purpose: test_the_failing_example_in_cli_md_fails_as_shown
FAILING = ["cache", "frobnicate"]
TFIMAGE = [(where, args) for where, args in _commands("tfimage") if args[:2] != FAILING]


def test_the_docs_show_the_commands_users_and_operators_run() -> None:
    shown = {args[0] for _, args in TFIMAGE if args}
    assert {"push", "tags", "resolve", "cache", "gpu", "usage"} <= shown, shown


@pytest.mark.parametrize(("where", "args"), TFIMAGE, ids=[w for w, _ in TFIMAGE])
def test_each_tfimage_command_in_the_docs_parses(where: str, args: list[str]) -> None:
    try:
        build_parser().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{where}: the parser refuses it (exit {e.code})")


def test_the_failing_example_in_cli_md_fails_as_shown() -> None:
    assert "$ tfimage " + " ".join(FAILING) in (REPO / "docs" / "cli.md").read_text()
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(FAILING)
    assert e.value.code == 64


def _plugin_options() -> set[str]:
    source = (REPO / "spank" / "tfimage.c").read_text()
    table = source.split("tfi_options[] = {", 1)[1].split("SPANK_OPTIONS_TABLE_END", 1)[0]
    return {f"--{o}" for o in re.findall(r'\{ "([a-z-]+)", "', table)}


def test_every_tf_option_in_the_docs_is_one_the_plugin_registers() -> None:
    options = _plugin_options()
    for page in PAGES:
        named = set(re.findall(r"--tf-[a-z-]+", page.read_text()))
        assert named <= options, f"{page.name}: {named - options}"


def test_every_role_variable_in_the_docs_is_one_the_role_has() -> None:
    role = REPO / "deploy" / "ansible" / "roles" / "tfimage"
    known = set(yaml.safe_load((role / "defaults" / "main.yml").read_text()))
    from tfimage.agent.usage.metrics import EXPORTED  # the metrics share the prefix

    for page in PAGES:
        named = set(re.findall(r"\btfimage_[a-z0-9_]+\b", page.read_text()))
        unknown = {n for n in named - known if n.removesuffix("_total") not in EXPORTED}
        assert not unknown, f"{page.name}: {unknown}"


def test_every_relative_link_leads_to_a_file() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_the_front_page_is_short_and_links_every_guide() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 100
    for guide in ("user", "admin", "operator", "developer", "config", "cli", "scale", "hybrid"):
        assert f"(docs/{guide}.md)" in readme


def test_every_test_the_docs_name_exists() -> None:
    named = [
        (page.name, path, name)
        for page in PAGES
        for path, name in re.findall(r"(tests/[\w/]+\.py)::(\w+)", page.read_text())
    ]
    assert len(named) >= 8
    for page, path, name in named:
        source = REPO / path
        assert source.exists() and f"def {name}(" in source.read_text(), f"{page}: {path}::{name}"

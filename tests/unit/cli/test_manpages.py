"""The man pages: tfimage(1) written from the parser names every command and option
a person can give, tfimage-spank(8) every plugin option and plugstack argument, and
``man -l`` renders both without a warning."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from pathlib import Path

import pytest

from tfimage.agent.cli.main import build_parser
from tfimage.agent.cli.manpage import HIDDEN, render
from tfimage.agent.core import wire

REPO = Path(__file__).resolve().parents[3]
SPANK_PAGE = REPO / "docs" / "man" / "tfimage-spank.8"


def man(page: Path) -> tuple[str, str]:
    """The page as ``man -l`` shows it, and groff's warnings."""
    r = subprocess.run(
        ["man", "--warnings=w", "-l", str(page)],
        env={**os.environ, "MANWIDTH": "80", "LC_ALL": "C.UTF-8", "MAN_KEEP_FORMATTING": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return re.sub(r".\x08", "", r.stdout), r.stderr


@pytest.fixture(scope="module")
def tfimage_1(tmp_path_factory: pytest.TempPathFactory) -> str:
    page = tmp_path_factory.mktemp("man") / "tfimage.1"
    page.write_text(render(build_parser()))
    text, warnings = man(page)
    assert warnings == ""
    return text


def _leaves(p: argparse.ArgumentParser, name: str) -> list[tuple[str, argparse.ArgumentParser]]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return [
                leaf
                for n, sp in a.choices.items()
                if n not in HIDDEN
                for leaf in _leaves(sp, f"{name} {n}")
            ]
    return [(name, p)]


def test_tfimage_1_names_every_command_and_each_of_its_options(tfimage_1: str) -> None:
    flat = " ".join(re.sub(r"\u2010\n\s*", "", tfimage_1).split())
    leaves = _leaves(build_parser(), "tfimage")
    assert len(leaves) >= 15
    for name, p in leaves:
        section = flat.split(f" {name} ", 1)
        assert len(section) == 2, f"{name} is not in tfimage(1)"
        for a in p._actions:
            for opt in a.option_strings:
                if opt not in ("-h", "--help"):
                    assert opt in section[1], f"{name} {opt} is not in tfimage(1)"


def test_tfimage_1_leaves_out_the_plugins_own_commands(tfimage_1: str) -> None:
    assert wire.STEP_PREPARE not in tfimage_1 and wire.SUBMIT_CHECK not in tfimage_1


def test_tfimage_1_prints_the_exit_table(tfimage_1: str) -> None:
    from tfimage.agent.cli.exits import TABLE

    section = tfimage_1.split("EXIT STATUS", 1)[1]
    for code, name, _ in TABLE:
        assert f"{code} ({name})" in section


def test_tfimage_spank_8_names_every_option_and_plugstack_argument() -> None:
    text, warnings = man(SPANK_PAGE)
    assert warnings == ""
    flat = " ".join(re.sub(r"\u2010\n\s*", "", text).split())
    source = (REPO / "spank" / "tfimage.c").read_text()
    table = source.split("tfi_options[] = {", 1)[1].split("SPANK_OPTIONS_TABLE_END", 1)[0]
    options = re.findall(r'\{ "([a-z-]+)", "', table)
    assert options == ["tf-image", "tf-mount", "tf-batch"]
    for o in options:
        assert f"--{o}" in flat
    for key in wire.PLUGSTACK_KEYS:
        assert f"{key}=" in flat, key
    assert wire.OFF_SWITCH in flat

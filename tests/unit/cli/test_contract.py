"""One contract for every subcommand: exits.py's table, one ``tfimage: COMMAND:``
line per error, JSON on the error path under ``--json``, and ``--config`` after the
command as well as before it.  Each row of the table is reached as a user reaches it."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tfimage.agent.cli import exits
from tfimage.agent.cli.main import build_parser, dispatch

CLI = (sys.executable, "-m", "tfimage.main")
DOCS = Path(__file__).resolve().parents[3] / "docs"


def run(*args: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TFIMAGE_CONFIG": str(config) if config else "/nonexistent"}
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A site whose registry refuses connections: nothing here reaches a registry."""
    p = tmp_path / "config.yaml"
    p.write_text(
        "registry: 127.0.0.1:9\nproject: library\n"
        f"cache_dir: {tmp_path}/cache\nstate_dir: {tmp_path}/state\n"
    )
    return p


def test_ok_is_0(site: Path) -> None:
    assert run("resolve", "--offline", "tf:1", config=site).returncode == exits.OK


def test_a_problem_found_in_the_nodes_state_is_1(site: Path) -> None:
    keep = site.parent / "cache" / "keep.json"
    keep.parent.mkdir()
    keep.write_text(json.dumps(["127.0.0.1:9/library/gone:1"]))
    r = run("cache", "warm", config=site)
    assert r.returncode == exits.STATE, r.stderr
    assert r.stderr.startswith("tfimage: warm 127.0.0.1:9/library/gone:1: ")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["resolve", "--offline", "Bad Ref"], r"tfimage: resolve: .*whitespace"),
        (["cache", "rm", "nothing:1"], r"tfimage: cache rm: 'nothing:1' names no cached image"),
        (["cache", "unkeep", "sha256:"], r"tfimage: cache unkeep: 'sha256:': give at least 4 "),
        (["cache", "rm", "sha256:ab"], r"tfimage: cache rm: 'sha256:ab': give at least 4 "),
        (["push", "/nonexistent.sif", "x:1"], r"tfimage: push: /nonexistent.sif: No such file"),
        (["push", "/etc/hostname", "x:1"], r"tfimage: push: /etc/hostname: not a SIF file"),
        (["push", "/etc", "x:1"], r"tfimage: push: /etc: "),
        (["push", "/etc/hostname", "x@sha256:" + "a" * 64], r"tfimage: push: .*give a tag"),
        (["convert-script", "/nonexistent"], r"tfimage: convert-script: /nonexistent: "),
        (["usage", "report", "/nonexistent"], r"tfimage: usage report: /nonexistent: no such"),
    ],
)
def test_bad_input_is_2_in_one_line_naming_the_command(
    site: Path, argv: list[str], line: str
) -> None:
    """Each is refused before the registry is asked: the registry here refuses
    connections, which would be 3."""
    r = run(*argv, config=site)
    assert r.returncode == exits.INPUT, r.stderr
    assert r.stderr.count("\n") == 1 and re.match(line, r.stderr), r.stderr


def test_a_missing_config_is_bad_input_naming_the_command() -> None:
    r = run("cache", "ls")
    assert r.returncode == exits.INPUT
    assert r.stderr.startswith("tfimage: cache ls: ") and "no such config file" in r.stderr


def test_an_image_that_cannot_be_had_is_3(site: Path) -> None:
    r = run("pull", "tf:1", config=site)
    assert r.returncode == exits.NOT_READY, r.stderr
    assert r.stderr.startswith("tfimage: pull: ") and r.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "argv",
    [["cache", "frobnicate"], ["resolve"], ["pull", "--bogus", "x:1"], ["nosuchcommand"]],
)
def test_a_command_line_not_understood_is_64_in_one_line(argv: list[str]) -> None:
    r = run(*argv)
    assert r.returncode == exits.USAGE, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("tfimage: ")
    assert "--help'" in r.stderr


def _raising(exc: BaseException) -> argparse.Namespace:
    def func(args: argparse.Namespace) -> int:
        raise exc

    return argparse.Namespace(func=func, command_name="cache ls", json=True)


def test_a_bug_is_70_in_one_line_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert dispatch(_raising(ZeroDivisionError("division by zero"))) == exits.INTERNAL
    out, err = capsys.readouterr()
    assert err == "tfimage: cache ls: internal error: ZeroDivisionError: division by zero\n"
    assert json.loads(out)["exit"] == 70


def test_ctrl_c_is_130(capsys: pytest.CaptureFixture[str]) -> None:
    assert dispatch(_raising(KeyboardInterrupt())) == exits.INTERRUPTED
    assert capsys.readouterr().err == "tfimage: cache ls: interrupted\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["cache", "rm", "--json", "nothing:1"],
        ["pull", "--json", "tf:1"],
        ["resolve", "--json", "--offline", "Bad Ref"],
        ["push", "--json", "/etc/hostname", "x:1"],
        ["cache", "ls", "--json"],
    ],
)
def test_json_answers_in_json_on_the_error_path_too(site: Path, argv: list[str]) -> None:
    config = None if argv[:2] == ["cache", "ls"] else site  # no config file at all
    r = run(*argv, config=config)
    doc = json.loads(r.stdout)
    assert r.returncode != 0 and doc["exit"] == r.returncode
    assert doc["command"] == " ".join(a for a in argv[:2] if not a.startswith("-")).strip()
    assert r.stderr == f"tfimage: {doc['command']}: {doc['error']}\n"


def test_config_may_follow_the_command(site: Path) -> None:
    before = run("--config", str(site), "resolve", "--offline", "tf:1")
    after = run("resolve", "--offline", "tf:1", "--config", str(site))
    assert before.returncode == after.returncode == 0, after.stderr
    assert before.stdout == after.stdout == "127.0.0.1:9/library/tf:1\n"


def _leaves(
    p: argparse.ArgumentParser, name: str = ""
) -> list[tuple[str, argparse.ArgumentParser]]:
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(name, p)]
    return [
        leaf for n, sp in subs[0].choices.items() for leaf in _leaves(sp, f"{name} {n}".strip())
    ]


def test_every_person_facing_command_takes_config_and_names_itself() -> None:
    hidden = {"submit-check", "step-prepare"}
    leaves = [(n, p) for n, p in _leaves(build_parser()) if n not in hidden]
    assert len(leaves) >= 20
    for name, p in leaves:
        opts = {o for a in p._actions for o in a.option_strings}
        assert "--config" in opts, name
        assert p.get_default("command_name") == name


def test_the_table_in_the_docs_is_the_table_in_the_code() -> None:
    page = (DOCS / "cli.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (.+?) \|$", page, re.M)
    assert [(int(c), n) for c, n, _ in rows] == [(c, n) for c, n, _ in exits.TABLE]

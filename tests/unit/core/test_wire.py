"""One wire between the plugin and the Python side: agent/core/wire.py, and the C side
following it (spank/wire.h's constants, the C files using them), both ways."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tfimage.agent.cli.main import build_parser
from tfimage.agent.core import wire
from tfimage.agent.core.errors import RequestError

SPANK = Path(__file__).resolve().parents[3] / "spank"


def _header_constants() -> dict[str, str | int]:
    out: dict[str, str | int] = {}
    for m in re.finditer(
        r"^#define (TFI_\w+) (.+?)\s*(?:/\*.*)?$", (SPANK / "wire.h").read_text(), re.M
    ):
        name, value = m.group(1), m.group(2).strip()
        if value.startswith('"'):
            out[name] = value.strip('"')
        elif value.isdigit():
            out[name] = int(value)
    return out


def test_the_c_header_defines_every_constant_of_the_wire_and_no_other() -> None:
    assert _header_constants() == wire.C_CONSTANTS


def test_the_c_side_spells_no_flag_or_token_itself() -> None:
    """node.c and submit.c build their argv from wire.h, never from a literal."""
    for name in ("node.c", "submit.c", "client.c", "hook.c"):
        text = (SPANK / name).read_text()
        code = re.sub(r"/\*.*?\*/", "", text, flags=re.S)  # comments may name them
        literals = set(re.findall(r'"(--[a-z-]+=?)"', code))
        assert literals <= {"--config", "--"}, (name, literals)
        assert '"TFI1"' not in code and '"argv"' not in code and '"env"' not in code


def _parser_flags(command: str) -> dict[str, bool]:
    """The flags the Python side accepts for ``command``: name -> takes a value."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cmd = sub.choices[command]
    out = {}
    for action in cmd._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and opt != "--help":
                out[opt] = action.nargs != 0
    return out


def test_step_prepare_accepts_exactly_the_flags_the_plugin_may_send() -> None:
    sent = {f.name: f.value for f in wire.STEP_PREPARE_FLAGS}
    assert _parser_flags(wire.STEP_PREPARE) == sent


def test_submit_check_accepts_the_plugins_flags_and_one_operator_flag() -> None:
    sent = {f.name: f.value for f in wire.SUBMIT_CHECK_FLAGS}
    accepted = _parser_flags(wire.SUBMIT_CHECK)
    assert accepted == {**sent, "--offline": False}  # --offline: operators' only


def test_a_step_answer_reads_back_as_written() -> None:
    env = {0: {"TF_CONFIG": '{"a": 1}', "X": "with\nnewline"}, 1: {"X": ""}}
    data = wire.encode_step_answer(["/usr/bin/ch-run", "--no-passwd", "/r", "--"], ["/d"], env)
    got = wire.decode_step_answer(data)
    assert (got.argv, got.host_paths, got.env) == (
        ["/usr/bin/ch-run", "--no-passwd", "/r", "--"],
        ["/d"],
        env,
    )


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"argv\x001\x00relative\x00",
        b"argv\x002\x00/a\x00",
        b"argv\x001\x00/a\x00x\x00",
        b"argv\x001\x00/a\x00env\x00L\x00N\x00V\x00",
        b"argv\x001\x00/a",
    ],
)
def test_an_answer_the_plugin_would_refuse_is_refused(data: bytes) -> None:
    with pytest.raises(RequestError):
        wire.decode_step_answer(data)


def test_step_prepare_flags_are_checked_name_for_name() -> None:
    args = ["--job=1", "--step=0", "--uid=5", "--image=-x", "--gpus", "--layout=A=b"]
    assert wire.step_prepare_flags(args) == [
        "--job",
        "--step",
        "--uid",
        "--image",
        "--gpus",
        "--layout",
    ]
    for bad in (["--job", "1"], ["--gpus=1"], ["--mounts=x"], ["--config=/etc/shadow"]):
        with pytest.raises(RequestError):
            wire.step_prepare_flags(bad)


def test_requests_frame_and_unframe() -> None:
    args = ["step-prepare", "--image=a b", "--layout=X=\u00e9"]
    assert wire.decode_request(wire.encode_request(args)) == args
    assert wire.decode_request(b"") is None
    for bad in (b"TFI0\0a\0", b"TFI1\0a"):
        with pytest.raises(RequestError):
            wire.decode_request(bad)
    assert wire.decode_answer(wire.encode_answer(-1, b"why\n", b"out")) == (-1, b"why\n", b"out")


def test_the_plugin_reads_exactly_the_wires_plugstack_keys() -> None:
    """args.c's ``strncmp(a, "KEY=", N)`` chain against :data:`wire.PLUGSTACK_KEYS`,
    each length right (a wrong N would match a longer key's prefix), and the role's
    plugstack line writes none other."""
    code = (SPANK / "args.c").read_text()
    found = re.findall(r'strncmp\(a, "([a-z_]+)=", (\d+)\)', code)
    assert [k for k, _ in found] == list(wire.PLUGSTACK_KEYS)
    assert all(int(n) == len(k) + 1 for k, n in found), found
    template = SPANK.parent / "deploy/ansible/roles/tfimage/templates/plugstack-tfimage.conf.j2"
    written = set(re.findall(r" ([a-z_]+)=\{\{", template.read_text()))
    assert written and written <= set(wire.PLUGSTACK_KEYS), written

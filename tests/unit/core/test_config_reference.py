"""docs/config.md lists every config key, and every key of its gpu: section, with
the type and default the parser has: a key added, renamed or given a new default
in the code fails here until the reference says so too."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from tfimage.agent.core.config import Config
from tfimage.agent.core.gpuconfig import GpuPolicy

DOC = Path(__file__).resolve().parents[3] / "docs" / "config.md"

TYPES = {
    "str": "string",
    "str | None": "string or null",
    "int": "integer",
    "int | None": "integer or null",
    "float": "number",
    "bool": "boolean",
    "tuple[str, ...]": "list of strings",
    "tuple[int, ...]": "list of integers",
    "tuple[int, int]": "[integer, integer]",
    "dict[str, str]": "mapping of strings",
    "tuple[Rule, ...]": "mapping of globs to names",
    "tuple[PartitionRule, ...]": "mapping of partition globs to rules",
    "Tiers": "mapping of hostlists to lists of strings",
    "GpuPolicy": "mapping (below)",
    "bool | tuple[str, ...]": "boolean or list of strings",
}


def _default(f: dataclasses.Field[object]) -> str:
    if f.name == "gpu":
        return "(below)"
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if f.name in ("access", "partitions", "rack_mirrors"):
        return "{}"
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def _rows(section: str) -> dict[str, tuple[str, str, str]]:
    """{key: (type, default, meaning)} of the table under ``## section``."""
    text = DOC.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    rows = {}
    for line in text[start : end if end > 0 else None].splitlines():
        m = re.match(r"\| `([a-z_]+)` \| ([^|]+) \| `([^`]*)` \| (.+) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2).strip(), m.group(3), m.group(4).strip())
    return rows


@pytest.mark.parametrize(
    ("section", "cls"), [("Keys", Config), ("The gpu: section", GpuPolicy)], ids=["top", "gpu"]
)
def test_the_reference_lists_every_key_with_the_parsers_type_and_default(
    section: str, cls: type
) -> None:
    rows = _rows(section)
    fields = [f for f in dataclasses.fields(cls) if f.metadata.get("setting", True)]
    assert list(rows) == [f.name for f in fields]
    for f in fields:
        kind, default, meaning = rows[f.name]
        assert kind == TYPES[str(f.type)], f.name
        assert default == _default(f), f.name
        assert len(meaning) > 20, f.name


def test_doctor_points_to_the_reference_that_exists() -> None:
    doctor = Path(__file__).resolve().parents[3] / "agent" / "cli" / "doctor.py"
    assert "README: config" not in doctor.read_text()
    assert "docs/config.md" in doctor.read_text()

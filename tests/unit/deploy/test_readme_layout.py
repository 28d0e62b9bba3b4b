"""The developer guide's Layout table and the import contract against the tree: a module or
package added, moved or removed without its line there fails here, so the table
stays a map a newcomer can trust and no folder escapes the layers."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _layout_rows() -> dict[str, set[str]]:
    text = (REPO / "docs" / "developer.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        m = re.match(r"\| `(agent/[a-z]+/)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`([a-z_]+\.py)`", m.group(2)))
    return rows


def test_every_agent_package_has_a_row_naming_exactly_its_modules() -> None:
    rows = _layout_rows()
    packages = {
        f"agent/{p.parent.name}/": {m.name for m in p.parent.glob("*.py")} - {"__init__.py"}
        for p in (REPO / "agent").glob("*/__init__.py")
    }
    assert set(rows) == set(packages), "a package without a row, or a row without a package"
    for package, modules in packages.items():
        assert rows[package] == modules, f"{package}: docs {rows[package]} != tree {modules}"


def test_no_module_is_left_at_the_top_of_agent() -> None:
    """The core is a folder (the import contract names it), not loose files."""
    assert [p.name for p in (REPO / "agent").glob("*.py")] == ["__init__.py"]


def test_every_agent_package_is_in_a_layer_of_the_import_contract() -> None:
    """A new folder outside the layers would escape the contract unchecked."""
    import tomllib

    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in conf["contracts"] if c["type"] == "layers")["layers"]
    named = {m.strip() for layer in layers for m in layer.split("|")}
    packages = {f"tfimage.agent.{p.parent.name}" for p in (REPO / "agent").glob("*/__init__.py")}
    assert packages <= named, packages - named

"""The Grafana dashboard names only metrics tfimage exports, every panel has a unit,
and every query is PromQL that Prometheus's own promtool accepts."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from support import need
from tfimage.agent.usage.metrics import EXPORTED

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy/grafana/tfimage.json"
ASKED = ("failure rate", "duration", "cache hit ratio", "pull time", "gpu drains")


def _panels() -> list[dict[str, object]]:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "tfimage"
    panels: list[dict[str, object]] = doc["panels"]
    return panels


def _exprs() -> list[str]:
    return [t["expr"] for p in _panels() for t in p["targets"]]  # type: ignore[attr-defined]


def test_every_query_names_only_metrics_the_code_exports() -> None:
    used = set()
    for expr in _exprs():
        names = re.findall(r"\btfimage_[a-z_]+", expr)
        assert names, expr
        used |= {n.removesuffix("_total") for n in names}
    assert used <= set(EXPORTED), used - set(EXPORTED)


def test_every_panel_has_a_unit_and_the_issues_panels_are_there() -> None:
    titles = []
    for p in _panels():
        unit = p["fieldConfig"]["defaults"].get("unit")  # type: ignore[index]
        assert unit, p["title"]
        titles.append(str(p["title"]).lower())
    for want in ASKED:
        assert any(want in t for t in titles), want


def test_every_query_is_promql_prometheus_accepts(tmp_path: Path) -> None:
    need("promtool")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    # Grafana's own variables are replaced as Grafana does before sending.
                    {
                        "record": f"tfimage:panel{i}",
                        "expr": e.replace("$__range", "7d").replace("$__rate_interval", "1m"),
                    }
                    for i, e in enumerate(_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_exprs())} rules found" in r.stdout

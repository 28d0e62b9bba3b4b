"""usage: `tfimage usage report` over 100,000 records from 8 nodes (plain, rotated and
gzipped logs), end to end as an operator runs it, against the floor measured in the
same run: the same files read and every line parsed with json.loads, nothing else.
Goal: each report < 3 s.  Needs no cluster."""

from __future__ import annotations

import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

RECORDS, NODES, GOAL_S = 100_000, 8, 3.0


def floor(root: Path) -> None:
    for f in sorted(root.rglob("usage.jsonl*")):
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rb") as fh:
            for line in fh:
                json.loads(line)


def main(runs: int) -> None:
    from usagegen import generate

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        generate(root, RECORDS, nodes=NODES)
        size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        cmd = [sys.executable, "-m", "tfimage.main", "usage", "report", str(root)]
        views = {
            "report --by image": [*cmd],
            "report --top-failing 5": [*cmd, "--top-failing", "5"],
            "report --trend week --json": [*cmd, "--trend", "week", "--json"],
        }
        samples: dict[str, list[float]] = {"floor: read + json.loads": [], **{k: [] for k in views}}
        for _ in range(runs):  # interleaved: drift hits all alike
            t = time.perf_counter()
            floor(root)
            samples["floor: read + json.loads"].append(time.perf_counter() - t)
            for name, argv in views.items():
                t = time.perf_counter()
                subprocess.run(argv, check=True, capture_output=True, timeout=120)
                samples[name].append(time.perf_counter() - t)
        print(f"usage: {RECORDS:,} records from {NODES} nodes, {size / 1e6:.1f} MB in "
              f"{len(list(root.rglob('usage.jsonl*')))} files; median of {runs}")  # fmt: skip
        base = statistics.median(samples["floor: read + json.loads"])
        worst = 0.0
        for name, vals in samples.items():
            m = statistics.median(vals)
            worst = max(worst, m) if name in views else worst
            print(f"  {name:<32} {m:6.2f} s  ({m / base:4.2f}x the floor)")
        print(f"usage: slowest report {worst:.2f} s; goal < {GOAL_S:.0f} s -> "
              f"{'MET' if worst < GOAL_S else 'NOT MET'}")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)

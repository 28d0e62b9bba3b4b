"""Usage records as many nodes' epilogs write them, for the report's tests and bench.

Each generated job is kept as plain numbers too (``Gen``), so that a test computes
what the report must say from those, not from the files the report reads.
"""

from __future__ import annotations

import gzip
import random
from dataclasses import dataclass
from pathlib import Path

from tfimage.agent.usage import record

IMAGES = [
    f"reg.example/library/tf-{name}:{v}"
    for name in ("custom", "nlp", "vision")
    for v in ("2.0", "2.1")
]
IMAGES += ["reg.example/team/bert:1", "reg.example/team/flaky:3"]
USERS = [f"user{i}" for i in range(12)]
PARTITIONS = ["gpu", "debug", "long"]
ACCOUNTS = ["team-a", "team-b"]
T0 = 1_764_547_200.0  # 2025-12-01T00:00:00Z


@dataclass
class Gen:
    job_id: str
    node: str
    image: str
    user: str
    partition: str
    account: str
    start: float
    end: float
    failed: bool
    gpus: int
    energy_j: float


def generate(root: Path, jobs: int, nodes: int = 8, seed: int = 7) -> list[Gen]:
    """``jobs`` records spread over ``nodes`` nodes' directories under ``root``: each
    node's log in three files, as logrotate leaves them (``usage.jsonl``, ``.1``,
    ``.2.gz``)."""
    rng = random.Random(seed)
    out: list[Gen] = []
    lines: dict[str, list[bytes]] = {f"n{i:02d}": [] for i in range(nodes)}
    for i in range(jobs):
        node = f"n{i % nodes:02d}"
        image = rng.choice(IMAGES)
        rate = 0.5 if "flaky" in image else 0.05
        exit_code = 1 if rng.random() < rate else 0
        image_error = "registry unreachable" if rng.random() < 0.01 else None
        start = T0 + i * 60.0 + rng.random()
        wall = round(rng.uniform(30, 7200), 3)
        gpus = rng.choice([0, 1, 2, 4])
        energy = [round(rng.uniform(100, 900) * wall / 60, 3) for _ in range(gpus)]
        rec = record.build(
            {
                "job_id": str(1000 + i),
                "user": rng.choice(USERS),
                "uid": "1001",
                "partition": rng.choice(PARTITIONS),
                "node": node,
                "account": rng.choice(ACCOUNTS),
                "exit": f"{exit_code}:0",
                "image": image,
                "image_asked": image.split("/", 1)[1],
            },
            {"prolog_start": start, "image": image, "cache": "hit", "image_error": image_error},
            end=start + wall,
            gpus=[{"uuid": f"GPU-{g}", "energy_j": e} for g, e in enumerate(energy)],
            epilog_health="ok" if gpus else None,
        )
        lines[node].append(record.line_of(rec))
        failed = bool(exit_code or image_error)
        out.append(
            Gen(rec["job_id"], node, image, rec["user"], rec["partition"], rec["account"], start,
                start + wall, failed, gpus, sum(energy))
        )  # fmt: skip
    for node, ls in lines.items():
        d = root / node
        d.mkdir(parents=True, exist_ok=True)
        third = len(ls) // 3
        with gzip.open(d / "usage.jsonl.2.gz", "wb") as f:
            f.writelines(ls[:third])
        (d / "usage.jsonl.1").write_bytes(b"".join(ls[third : 2 * third]))
        (d / "usage.jsonl").write_bytes(b"".join(ls[2 * third :]))
    return out

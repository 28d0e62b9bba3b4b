"""The soak's run: the work and the faults together, then the account."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .account import account, problems, table
from .faults import Injector, small_cache
from .site import Site
from .work import KINDS, Array, Refusals, expected_output, plan, soak_image, submit_wave


@dataclasses.dataclass
class Work:
    """What the run submits, and what each kind's task must print."""

    seed: int
    token: str
    images: dict[str, str]
    waves: list[dict[str, int]]
    refused: Refusals = dataclasses.field(default_factory=Refusals)

    def expected(self) -> dict[str, list[str]]:
        return {k: expected_output(k, self.images[k], self.token) for k in KINDS}


def soak(
    env: dict[str, str],
    tasks: int,
    seed: int,
    nodes: int,
    hold: tuple[float, float] = (5, 60),
    waves: int = 0,
    timeout: float = 3600,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the soak; its report (``problems(report)`` says what failed)."""
    site = Site(env, nodes)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        fourth = soak_image(site, seed, Path(tmp))
    work = Work(
        seed,
        f"soak-{seed}-{rng.randrange(10**6)}",
        {
            "batch": "tiny:1.0",
            "steps": "tf-custom:2.0",
            "mount": "team-a/tiny:1.0",
            "other": "tiny:1.0",
            "multi": fourth,
        },
        plan(tasks, waves or max(1, min(20, tasks // 50))),
    )
    t0 = time.time()
    # A round of faults (each kind once) per 500 tasks: the 2,000-task run meets
    # each fault four times, the CI's 60 tasks once.
    injector = Injector(site, rng, t0 + timeout, hold, log, rounds=max(1, tasks // 500))
    small_cache(site, injector.full_node, True)
    try:
        return _run(site, injector, work, t0, log)
    finally:
        # However the run ended: no fault left on (each undoes itself once stopped).
        injector.stop.set()
        if injector.thread:
            injector.thread.join(timeout=120)
        small_cache(site, injector.full_node, False)


def _run(
    site: Site, injector: Injector, work: Work, t0: float, log: Callable[[str], None]
) -> dict[str, Any]:
    thread = injector.thread = threading.Thread(target=injector.run, daemon=True)
    thread.start()
    arrays: list[Array] = []
    # Waves spread over the faults' expected span, so that submits meet faults too.
    gap = max(2.0, sum(injector.hold) * len(injector.plan) / len(work.waves))
    for i, split in enumerate(work.waves):
        arrays += submit_wave(site, work.images, split, work.seed, work.token, work.refused)
        log(f"wave {i + 1}/{len(work.waves)}: {sum(split.values())} tasks submitted")
        if i + 1 < len(work.waves):
            time.sleep(gap)
    ids = ",".join(a.job for a in arrays if a.job)
    # The work ends, and the faults: every one had its turn.
    while time.time() < injector.until:
        r = site.run(["squeue", "-h", "-o", "%i", "-j", ids]) if ids else None
        if (r is None or not r.stdout.strip()) and not thread.is_alive():
            break
        time.sleep(2)
    injector.stop.set()
    thread.join(timeout=120)
    t1 = time.time()
    left: list[str] = []
    if t1 >= injector.until and ids:
        left = leftovers(site, ids)
        site.run(["scancel", *ids.split(",")])
        log("soak: the timeout ran out; what was left was cancelled and counts as lost")
    _settle(site)
    report = account(
        site, arrays, injector.done, (t0, t1), work.expected(), work.refused, work.images
    )
    for d in {a.workdir for a in arrays}:  # every output is in the report now
        shutil.rmtree(d, ignore_errors=True)
    report["seed"] = work.seed
    report["nodes"] = site.nodes
    report["injector_errors"] = injector.errors
    report["left_at_timeout"] = left
    return report


def leftovers(site: Site, ids: str) -> list[str]:
    """What was still queued when the timeout ran out, and what the logs last said of
    it: the jobs and their steps as squeue has them, and each one's last lines in
    slurmctld's, its nodes' slurmd and tfimage daemon logs (a lost task's why)."""
    jobs = site.run(["squeue", "-h", "-j", ids, "-o", "%i %T %r %N %M"]).stdout.split("\n")
    steps = site.run(["squeue", "-h", "-s", "-j", ids, "-o", "%i %j %N %M"]).stdout.split("\n")
    out = [f"job {j}" for j in jobs if j.strip()] + [f"step {s}" for s in steps if s.strip()]
    logs = site.state / "log"
    for line in [j for j in jobs if j.strip()][:4]:
        job, *_rest = line.split()
        word = re.compile(rf"(?<![\d.:_]){re.escape(job.split('_')[0])}(?![\d.:])")
        names = ["slurmctld"] + [f"{w}-{n}" for n in site.nodes for w in ("slurmd", "daemon")]
        for name in names:
            hits = [h for h in _tail(logs / f"{name}.log") if word.search(h)]
            out += [f"{name}.log: {h}" for h in hits[-4:]]
    return out


def _tail(path: Path, size: int = 1 << 20) -> list[str]:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - size))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def _settle(site: Site) -> None:
    """Until no job completes on the soak's nodes (the last epilog has run)."""
    for _ in range(300):
        r = site.run(["squeue", "-h", "-t", "CG", "-o", "%i"])
        if not r.stdout.strip():
            return
        time.sleep(0.5)


def main(env: dict[str, str], tasks: int, seed: int, nodes: int, as_json: bool) -> int:
    log: Callable[[str], None] = (lambda m: print(m, file=sys.stderr)) if as_json else print
    report = soak(env, tasks, seed, nodes, log=log)
    print(json.dumps(report, indent=1) if as_json else table(report))
    return 1 if problems(report) else 0

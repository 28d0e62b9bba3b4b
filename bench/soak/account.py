"""The soak's account: every task, node, leak and usage record."""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from .faults import CACHE, Fault
from .site import Site, hostnames
from .work import Array, Refusals, reason, slurm_reason

FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


# -D: every attempt of a task, the one Slurm requeued (after a slurmd killed under
# its prolog: NODE_FAIL) before the one that ran, oldest first.
SACCT = ["sacct", "-n", "-P", "-X", "-D", "-o", "JobIDRaw,JobID,State,ExitCode,NodeList,Start,End"]
Row = dict[str, str]


def _sacct(site: Site, arrays: list[Array], wait: float = 60) -> tuple[dict[str, Row], list[Row]]:
    """Each array task's last row (JobIDRaw -> fields) and every attempt's, once
    Slurm's accounting has every task's end (slurmctld sends them to slurmdbd after
    the jobs end: seconds, more after slurmdbd or slurmd came back), or ``wait``
    seconds have gone."""
    ids = ",".join(a.job for a in arrays if a.job)
    if not ids:
        return {}, []
    want = {f"{a.job}_{i}" for a in arrays if a.job for i in range(a.tasks)}
    deadline = time.monotonic() + wait
    while True:
        attempts = []
        for line in site.run([*SACCT, "-j", ids]).stdout.splitlines():
            raw, jid, st, code, nodes, start, end = line.split("|")
            attempts.append(
                {
                    "JobIDRaw": raw,
                    "JobID": jid,
                    "State": st.split()[0],
                    "ExitCode": code,
                    "NodeList": nodes,
                    "Start": start,
                    "End": end,
                }
            )
        rows = {r["JobIDRaw"]: r for r in attempts}  # the last attempt stays
        ended = {r["JobID"] for r in rows.values() if r["State"] in FINISHED}
        if want <= ended or time.monotonic() > deadline:
            return rows, attempts
        time.sleep(1)


def _usage(site: Site, since: float) -> list[dict[str, Any]]:
    out = []
    for node in site.nodes:
        path = site.state / "nodes" / node / "log" / "usage.jsonl"
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                out.append({"bad": line[:80]})
                continue
            if _ts(rec.get("end", "")) >= since:
                out.append(rec)
    return out


def _ts(iso: str) -> float:
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _local_ts(text: str) -> float:
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return 0.0


def _image_key(image: str) -> str:
    """An image as usage records name it, less the registry: Docker Hub's
    ``library/`` for a one-part name (``tiny:1.0`` is ``library/tiny:1.0``)."""
    return image if "/" in image else f"library/{image}"


def match_records(
    runs: list[tuple[str, str, str]], seen: Counter[tuple[str, str]]
) -> dict[str, Any]:
    """Slurm's tries (``runs``: job id, node, that try's state) against the usage
    records (``seen``: how many per job id and node).  Every try has one record but a
    NODE_FAIL one, which has one if its prolog ran (its slurmd died after) and none if
    its launch died first.  Returns the duplicates, the gaps, the strays, the tries
    with a record (``recorded``: what the usage report is held to) and the count of
    NODE_FAIL tries without one (``unlaunched``)."""
    tries: dict[tuple[str, str], list[str]] = {}
    for raw, node, state in runs:
        tries.setdefault((raw, node), []).append(state)
    duplicates, gaps, recorded = [], [], []
    unlaunched = 0
    for (raw, node), states in tries.items():
        got = seen.get((raw, node), 0)
        must = [st for st in states if st != "NODE_FAIL"]
        may = [st for st in states if st == "NODE_FAIL"]
        if got > len(states):
            duplicates.append(f"{raw}@{node} x{got}")
        elif got < len(must):
            gaps.append(f"{raw}@{node}")
        kept = may[: max(0, got - len(must))]
        unlaunched += len(may) - len(kept)
        recorded += [(raw, node, st) for st in must + kept]
    strays = sorted(f"{j}@{n}" for (j, n) in seen if (j, n) not in tries)
    return {
        "duplicates": sorted(duplicates),
        "gaps": sorted(gaps),
        "strays": strays,
        "recorded": recorded,
        "unlaunched": unlaunched,
    }


def report_vs_slurm(
    site: Site,
    since: float,
    runs: list[tuple[str, str, str]],
    image_of: dict[str, str],
) -> dict[str, Any]:
    """What ``tfimage usage report --by image`` says of the soak's nodes' usage logs,
    against Slurm's accounting (``compare_usage``)."""
    logs = [
        str(p)
        for n in site.nodes
        if (p := site.state / "nodes" / n / "log" / "usage.jsonl").exists()
    ]
    when = datetime.fromtimestamp(since).astimezone().isoformat(timespec="seconds")
    r = site.run(["tfimage", "usage", "report", *logs, "--by", "image", "--since", when, "--json"])
    if r.returncode != 0 or not logs:
        said = r.stderr.strip()[-200:] or "no usage log on the soak's nodes"
        return {"slurm": {}, "report": {}, "disagree": [f"the report: {said}"]}
    return compare_usage(json.loads(r.stdout)["groups"], runs, image_of)


def compare_usage(
    groups: list[dict[str, Any]],
    runs: list[tuple[str, str, str]],
    image_of: dict[str, str],
) -> dict[str, Any]:
    """Per image, the report's jobs and failures (``groups``: its JSON's) against
    Slurm's: each job-node run (sacct's job id, node and that attempt's state in
    ``runs``), with its job's image in ``image_of``, failed where it did not
    complete.  The images by name less the registry, so that an image that never
    came (named as asked) is the same."""
    slurm: dict[str, dict[str, int]] = {}
    node_fail: Counter[str] = Counter()
    for raw, _node, state in runs:
        key = _image_key(image_of.get(raw, "?"))
        row = slurm.setdefault(key, {"jobs": 0, "failures": 0})
        row["jobs"] += 1
        # A try requeued (by the prolog whose slurmd died) is neither: "REQUEUED" in
        # both.  A NODE_FAIL try's record says what Slurm gave its epilog: a signal
        # on 22.05 (failed), 0:0 on 24.11 (completed); either agrees.
        row["failures"] += state not in ("COMPLETED", "REQUEUED", "NODE_FAIL")
        node_fail[key] += state == "NODE_FAIL"
    ours: dict[str, dict[str, int]] = {}
    for g in groups:
        key = str(g["key"])
        first = key.split("/")[0]
        if "/" in key and ("." in first or ":" in first or first == "localhost"):
            key = key.split("/", 1)[1]  # less the registry
        row = ours.setdefault(_image_key(key), {"jobs": 0, "failures": 0})
        row["jobs"] += int(g["jobs"])
        row["failures"] += int(g["failures"])

    def agree(k: str) -> bool:
        mine, theirs = ours.get(k), slurm.get(k)
        if mine is None or theirs is None or mine["jobs"] != theirs["jobs"]:
            return False
        return theirs["failures"] <= mine["failures"] <= theirs["failures"] + node_fail[k]

    disagree = [
        f"{k}: report {ours.get(k)}, Slurm {slurm.get(k)}"
        + (f" and {node_fail[k]} NODE_FAIL" if node_fail[k] else "")
        for k in sorted(set(ours) | set(slurm))
        if not agree(k)
    ]
    return {"slurm": slurm, "report": ours, "disagree": disagree}


def node_state(sinfo_out: str) -> str:
    """A node's state from ``sinfo -N -n NODE -o %T``, which answers once per
    partition the node is in: each state once, in sinfo's order."""
    return " ".join(dict.fromkeys(sinfo_out.split())) or "not in sinfo"


def is_out_of_service(state: str) -> bool:
    """Drained, draining, down or failed, in any of the node's partitions."""
    return any(
        "drain" in st or st.rstrip("*~#!%$@^-") in ("down", "fail", "failing")
        for st in state.split()
    )


def leaks(site: Site, ran: set[tuple[str, str]]) -> dict[str, list[str]]:
    """What the soak's jobs (``ran``: each job id and node that ran it) left on its
    nodes once none runs (each list must be empty).  A hold of another job is not
    the soak's: one a crash ended before it, its id used again since (the local
    cluster's ids start again at each ``up``), which the cache drops at its next
    prune (cache/evict.py's reclaim).  A partial download a failed pull kept is
    its job's epilog's to drop (cache/evict.py's abandoned_downloads)."""
    found: dict[str, list[str]] = {
        k: [] for k in ("mounts", "loops", "fuse", "holds", "job-state", "partials", "temp")
    }
    for node in site.nodes:
        mounts = site.on_node(node, ["findmnt", "-rn", "-o", "TARGET"]).stdout.split()
        found["mounts"] += [
            f"{node}:{m}"
            for m in mounts
            if m.startswith("/run/tfimage/") or m.startswith("/var/cache/tfimage/")
        ]
        root = Path(f"/proc/{site.pid(f'slurmd-{node}')}/root")
        run = root / "run/tfimage"
        found["job-state"] += [
            f"{node}:{p.relative_to(run)}"
            for p in (*run.glob("jobs/*"), *run.glob("usage/[0-9]*"), *run.glob("gpu/jobs/*"))
        ]
        cache = root / CACHE.lstrip("/")  # as the node sees it (small_cache's)
        for meta in cache.glob("images/*.json"):
            try:
                holders = json.loads(meta.read_text()).get("holders", [])
            except ValueError:
                holders = ["(unreadable)"]
            found["holds"] += [f"{node}:{meta.stem}:{h}" for h in holders if (h, node) in ran]
        for p in cache.glob("tmp/*"):
            (found["partials"] if p.name.endswith(".partial") else found["temp"]).append(
                f"{node}:{p.name} ({p.lstat().st_size} bytes)"
            )
    loops = site.run(["losetup", "-a"]).stdout.splitlines()
    found["loops"] = [x for x in loops if "/var/cache/tfimage" in x or str(site.state) in x]
    fuse = site.run(["pgrep", "-a", "squashfuse"]).stdout.splitlines()
    found["fuse"] = [x for x in fuse if "tfimage" in x]
    return found


def account(
    site: Site,
    arrays: list[Array],
    faults: list[Fault],
    span: tuple[float, float],
    expected: dict[str, list[str]],
    refused: Refusals,
    images: dict[str, str],
) -> dict[str, Any]:
    """The report: see the package's docstring."""
    t0, t1 = span
    rows, attempts = _sacct(site, arrays)
    by_id = {r["JobID"]: (raw, r) for raw, r in rows.items()}
    tries = Counter(r["JobID"] for r in attempts)
    tasks: Counter[str] = Counter()
    reasons: Counter[str] = Counter(refused.reasons)
    lost: list[str] = []
    wrong: list[str] = []
    requeued: list[str] = []
    ends: list[float] = []
    tasks["refused at submit"] = sum(refused.kinds.values())
    for a in arrays:
        if not a.job:
            continue
        for i in range(a.tasks):
            tid = f"{a.job}_{i}"
            _, row = by_id.get(tid, ("", {}))
            out = a.workdir / f"{a.kind}-{a.job}_{i}.out"
            text = out.read_text(errors="replace") if out.exists() else ""
            state = row.get("State", "")
            if tries[tid] > 1:  # a fault of its node's (NODE_FAIL), whatever came after
                requeued.append(f"{tid} ({a.kind}): {tries[tid]} tries, then {state}")
            if state == "COMPLETED":
                if text.split() == expected[a.kind]:
                    tasks["completed"] += 1
                    ends.append(_local_ts(row["End"]))
                else:
                    wrong.append(f"{tid} ({a.kind}): {text[:120]!r}")
            elif state in FINISHED and "tfimage:" in text:
                tasks["failed with a reason"] += 1
                reasons[reason(text)] += 1
            elif state in FINISHED and slurm_reason(text):
                # A fault below tfimage (a slurmd killed under a step's launch): the
                # user was told why, by Slurm; counted apart from tfimage's reasons.
                tasks["failed with Slurm's reason"] += 1
                reasons[slurm_reason(text)] += 1
            elif tries[tid] > 1 and state in ("PENDING", "REQUEUED", "CANCELLED"):
                # Requeued, then waiting out Slurm's delay (EligibleTime: CredExpire
                # and a second, 121 s) when the run ended: Slurm has it still.
                tasks["requeued, not run again by the end"] += 1
            else:
                lost.append(f"{tid} ({a.kind}): {state or 'not in sacct'}: {text[:120]!r}")
    states = {n: node_state(site.run(["sinfo", "-h", "-N", "-n", n, "-o", "%T"]).stdout)
              for n in site.nodes}  # fmt: skip
    drained = [n for n, st in states.items() if is_out_of_service(st)]

    # One usage record per job and node that ran it (Slurm's NodeList), each attempt.
    records = _usage(site, t0 - 5)
    runs: list[tuple[str, str, str]] = []
    for r in attempts:
        if r["NodeList"] in ("", "None assigned") or r["Start"] in ("", "Unknown", "None"):
            continue
        runs += [(r["JobIDRaw"], n, r["State"]) for n in hostnames(site, r["NodeList"])]
    seen = Counter(
        (str(rec.get("job_id")), str(rec.get("node"))) for rec in records if "bad" not in rec
    )
    ours = Counter({k: v for k, v in seen.items() if k[0] in rows})
    matched = match_records(runs, ours)
    kind_of = {a.job: a.kind for a in arrays if a.job}
    image_of = {raw: images[kind_of[r["JobID"].split("_")[0]]] for raw, r in rows.items()
                if r["JobID"].split("_")[0] in kind_of}  # fmt: skip
    rec_states = Counter(str(rec.get("state")) for rec in records if str(rec.get("job_id")) in rows)
    slurm_states = Counter(st for _raw, _n, st in runs)
    # The kinds whose batch script runs on the host (more than one task): no step of
    # theirs has trustworthy array ids, and the epilog gets none (22.05 and 24.11).
    host_batch = {"steps", "multi"}

    # Throughput: tasks finished per minute while a fault was on, and while none was;
    # each fault's cost: from its end until a task finished again.
    def faulty(t: float) -> bool:
        return any(f.start <= t <= f.end for f in faults)

    on = sum(f.end - f.start for f in faults)
    off = max(1.0, (t1 - t0) - on)
    during = sum(1 for t in ends if faulty(t))
    # Each fault's own (a kind hits a node more than once in a long soak).
    costs: list[float | None] = []
    for f in faults:
        after = [t - f.end for t in ends if t >= f.end]
        costs.append(round(min(after), 1) if after else None)
    return {
        "tasks": {"submitted": sum(a.tasks for a in arrays), **tasks},
        "lost": lost,
        "requeued_by_slurm": requeued,
        "wrong_output": wrong,
        "reasons": dict(reasons.most_common()),
        "drained": drained,
        "node_states": states,
        "leaks": leaks(site, {(raw, n) for raw, n, _st in runs}),
        "usage": {
            "records": len(records),
            "expected": len(matched["recorded"]),
            "duplicates": matched["duplicates"],
            "gaps": matched["gaps"],
            "strays": matched["strays"],
            # Tries whose launch died with their slurmd before any prolog ran on the
            # node (Slurm: NODE_FAIL): no tfimage hook ran there, so no record.
            "unlaunched": matched["unlaunched"],
            "bad_lines": sum(1 for rec in records if "bad" in rec),
            # slurmd gives its Prolog and Epilog no SLURM_ARRAY_*: the batch step
            # hands the record Slurm's own ids (spank/node.c); a job of more than
            # one task runs its batch script on the host, no step of ours.
            "without_array_ids": sum(
                1
                for rec in records
                if str(rec.get("job_id")) in rows
                and rec.get("array_job_id") is None
                # Only a try that completed surely ran its batch step; one whose
                # launch a killed slurmd failed, or the prolog requeued, never did.
                and rec.get("state") == "COMPLETED"
                and rows[str(rec.get("job_id"))]["State"] == "COMPLETED"
                and kind_of.get(rows[str(rec.get("job_id"))]["JobID"].split("_")[0])
                not in host_batch
            ),
            # Ids that are not the task's own (a job's environment taken for Slurm's).
            "wrong_array_ids": sorted(
                f"{rec.get('job_id')}: {rec.get('array_job_id')}_{rec.get('array_task_id')}"
                for rec in records
                if str(rec.get("job_id")) in rows
                and rec.get("array_job_id") is not None
                and f"{rec.get('array_job_id')}_{rec.get('array_task_id')}"
                != rows[str(rec.get("job_id"))]["JobID"]
            ),
            "record_states": dict(rec_states),
            "slurm_states": dict(slurm_states),
            # `tfimage usage report`, what a site reads, against sacct.
            "report_vs_slurm": report_vs_slurm(site, t0 - 5, matched["recorded"], image_of),
        },
        "throughput_per_min": {
            "without_faults": round((len(ends) - during) / off * 60, 1),
            "with_a_fault": round(during / on * 60, 1) if on else None,
        },
        "faults": [
            dataclasses.asdict(f) | {"task_after_s": c} for f, c in zip(faults, costs, strict=True)
        ],
        "seconds": round(t1 - t0, 1),
    }


def problems(report: dict[str, Any]) -> list[str]:
    """What makes the soak fail: any loss, wrong output, drain, leak, duplicate or gap."""
    out = []
    if report["lost"]:
        out.append(f"{len(report['lost'])} tasks lost: {report['lost'][:3]}")
    if report["wrong_output"]:
        out.append(
            f"{len(report['wrong_output'])} tasks with wrong output: {report['wrong_output'][:3]}"
        )
    if report["drained"]:
        out.append(f"nodes drained: {report['drained']} ({report['node_states']})")
    for what, items in report["leaks"].items():
        if items:
            out.append(f"leaked {what}: {items[:3]}")
    u = report["usage"]
    for what in ("duplicates", "gaps", "strays"):
        if u[what]:
            out.append(f"usage records: {len(u[what])} {what}: {u[what][:3]}")
    if u.get("wrong_array_ids"):
        out.append(f"usage records: array ids not the task's own: {u['wrong_array_ids'][:3]}")
    if u.get("without_array_ids"):
        out.append(f"usage records: {u['without_array_ids']} array tasks' without the array's ids")
    for d in u.get("report_vs_slurm", {}).get("disagree", []):
        out.append(f"tfimage usage report disagrees with Slurm: {d}")
    if u["bad_lines"]:
        out.append(f"usage records: {u['bad_lines']} unreadable lines")
    for err in report.get("injector_errors", []):
        out.append(f"fault injector: {err}")
    return out


def table(report: dict[str, Any]) -> str:
    t = report["tasks"]
    lines = [
        f"soak: seed {report['seed']}, nodes {','.join(report['nodes'])}, {report['seconds']} s",
        "tasks: " + ", ".join(f"{k} {v}" for k, v in t.items()),
        f"  lost {len(report['lost'])}, wrong output {len(report['wrong_output'])}",
    ]
    requeued = report.get("requeued_by_slurm", [])
    if requeued:
        lines.append(f"  requeued by Slurm ({len(requeued)}): " + "; ".join(requeued[:5]))
    lines += [f"  {n:>5}  {r}" for r, n in report["reasons"].items()]
    lines.append(
        f"nodes drained: {len(report['drained'])}; states: "
        + ", ".join(f"{n} {s}" for n, s in report["node_states"].items())
    )
    lines.append("leaks: " + ", ".join(f"{k} {len(v)}" for k, v in report["leaks"].items()))
    u = report["usage"]
    lines.append(
        f"usage records: {u['records']} for {u['expected']} job-node runs "
        f"({u.get('unlaunched', 0)} more tries never launched); duplicates "
        f"{len(u['duplicates'])}, gaps {len(u['gaps'])}, strays {len(u['strays'])}, "
        f"without the array's ids {u['without_array_ids']}; "
        f"states {u['record_states']} (Slurm: {u['slurm_states']})"
    )
    vs = u.get("report_vs_slurm", {})
    lines.append(
        "tfimage usage report --by image (jobs/failed), against Slurm: "
        + ", ".join(
            f"{k} {v['jobs']}/{v['failures']}"
            + ("" if vs["slurm"].get(k) == v else f" (Slurm {vs['slurm'].get(k)})")
            for k, v in vs.get("report", {}).items()
        )
    )
    tp = report["throughput_per_min"]
    lines.append(
        f"throughput: {tp['without_faults']} tasks/min without a fault, "
        f"{tp['with_a_fault']} with one"
    )
    for f in report["faults"]:
        cost = f.get("task_after_s")
        lines.append(
            f"  fault {f['kind']:<16} {f['node']:<4} {f['end'] - f['start']:5.0f} s; "
            f"a task finished {cost if cost is not None else '-'} s after; {f['detail']}"
        )
    left = report.get("left_at_timeout", [])
    if left:
        lines.append("left when the timeout ran out (cancelled; the logs' last words on it):")
        lines += [f"  {x[:240]}" for x in left]
    bad = problems(report)
    lines.append("soak: " + ("PASSED" if not bad else "FAILED: " + "; ".join(bad)))
    return "\n".join(lines)

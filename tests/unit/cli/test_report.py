"""``tfimage usage report``: what it says equals what the test computes itself from
the generated jobs (never from the files the report reads)."""

from __future__ import annotations

import gzip
import json
import math
import statistics
import struct
import subprocess
import sys
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from usagegen import Gen, generate

from tfimage.agent.cli import report
from tfimage.agent.cli.main import main as cli
from tfimage.agent.core.errors import InputError
from tfimage.agent.usage import record

RECORDS = 100_000


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Gen]]:
    root = tmp_path_factory.mktemp("usage")
    # The size: 100,000 records from 8 nodes (its speed is bench/run.py usage's).
    return root, generate(root, RECORDS, nodes=8)


def _p90(values: list[float]) -> float:
    s = sorted(values)
    return s[math.ceil(0.9 * len(s)) - 1]


@pytest.mark.parametrize("by", report.BY)
def test_the_summary_equals_an_independent_computation(
    logs: tuple[Path, list[Gen]], by: str
) -> None:
    root, gens = logs
    loaded = report.load([str(root)], by=by)
    assert loaded.files == 24 and len(loaded.jobs) == RECORDS and loaded.skipped == 0
    want: dict[str, list[Gen]] = defaultdict(list)
    for g in gens:
        want[
            {
                "image": g.image,
                "user": g.user,
                "account": g.account,
                "partition": g.partition,
                "node": g.node,
            }[by]
        ].append(g)
    rows = {r["key"]: r for r in report.summarize(loaded.jobs)}
    assert set(rows) == set(want)
    for key, gs in want.items():
        walls = [g.end - g.start for g in gs]
        r = rows[key]
        assert r["jobs"] == len(gs)
        assert r["failures"] == sum(g.failed for g in gs)
        assert r["median_seconds"] == pytest.approx(statistics.median(walls), abs=0.002)
        assert r["p90_seconds"] == pytest.approx(_p90(walls), abs=0.002)
        gpu_h = sum((g.end - g.start) * g.gpus for g in gs) / 3600
        assert r["gpu_hours"] == pytest.approx(gpu_h, abs=0.01)
        assert r["energy_kwh"] == pytest.approx(sum(g.energy_j for g in gs) / 3.6e6, rel=1e-4)


def test_the_top_failing_image_is_the_flaky_one_and_one_failure_of_one_does_not_top_it(
    logs: tuple[Path, list[Gen]], tmp_path: Path
) -> None:
    root, gens = logs
    once = tmp_path / "once.jsonl"
    rec = record.build({"job_id": "9", "exit": "1:0", "node": "n9"},
                       {"image": "reg.example/x/once:1", "prolog_start": 1.8e9},
                       end=1.8e9 + 5, gpus=[], epilog_health=None)  # fmt: skip
    record.append(once, rec)
    loaded = report.load([str(root), str(once)])
    top = report.top_failing(loaded.jobs, 3)
    flaky = [g for g in gens if "flaky" in g.image]
    assert top[0]["image"] == "reg.example/team/flaky:3"
    assert (top[0]["jobs"], top[0]["failures"]) == (len(flaky), sum(g.failed for g in flaky))
    once_row = next(r for r in report.top_failing(loaded.jobs, 20) if "once" in r["image"])
    # by its rate alone (100 %) it would top the list; by what its count supports it does not
    assert once_row["failure_rate"] == 1.0 > top[0]["failure_rate"]
    assert once_row["rank_score"] < top[0]["rank_score"]


@pytest.mark.parametrize("per", report.TREND)
def test_the_trend_is_the_mean_duration_per_period(logs: tuple[Path, list[Gen]], per: str) -> None:
    root, gens = logs
    rows = report.trend(report.load([str(root)]).jobs, per)
    want: dict[str, list[float]] = defaultdict(list)
    for g in gens:
        t = datetime.fromtimestamp(round(g.end, 3), UTC)
        want[report.period_of(t, per)].append(g.end - g.start)
    assert [r["period"] for r in rows] == sorted(want)
    for r in rows:
        walls = want[r["period"]]
        assert r["jobs"] == len(walls)
        assert r["mean_seconds"] == pytest.approx(sum(walls) / len(walls), abs=0.002)


def test_since_and_until_keep_the_jobs_that_ended_between(logs: tuple[Path, list[Gen]]) -> None:
    root, gens = logs
    since, until = "2025-12-02", "2025-12-03T12:00"
    lo = datetime(2025, 12, 2, tzinfo=UTC).timestamp()
    hi = datetime(2025, 12, 3, 12, tzinfo=UTC).timestamp()
    loaded = report.load(
        [str(root)], since=report.parse_when(since), until=report.parse_when(until)
    )
    assert len(loaded.jobs) == sum(lo <= round(g.end, 3) < hi for g in gens) > 0


def test_relative_times_and_bad_ones(tmp_path: Path) -> None:
    now = datetime(2026, 12, 3, 12, tzinfo=UTC)
    assert report.parse_when("7d", now) == datetime(2026, 11, 26, 12, tzinfo=UTC)
    assert report.parse_when("90m", now) == datetime(2026, 12, 3, 10, 30, tzinfo=UTC)
    with pytest.raises(InputError, match="not a time"):
        report.parse_when("last tuesday")


def test_bad_lines_are_counted_and_skipped_and_a_record_seen_twice_counts_once(
    tmp_path: Path,
) -> None:
    good = record.line_of(record.build({"job_id": "1", "exit": "0:0", "node": "n1"},
                                       {"image": "r/a:1", "prolog_start": 1.8e9},
                                       end=1.8e9 + 1, gpus=[], epilog_health=None))  # fmt: skip
    log = tmp_path / "usage.jsonl"
    log.write_bytes(good + b"not json\n" + b'{"schema": 2}\n' + good[:40] + b"\n" + good)
    (tmp_path / "copy.jsonl").write_bytes(good)
    (tmp_path / "notes.txt").write_text("not a usage log: not read")
    loaded = report.load([str(tmp_path)])
    assert (len(loaded.jobs), loaded.skipped, loaded.duplicates, loaded.files) == (1, 3, 2, 2)


def test_dateext_rotations_damaged_gzips_and_requeued_jobs(tmp_path: Path) -> None:
    def line(job: str, start: float, **over: object) -> bytes:
        rec = record.build({"job_id": job, "exit": "0:0", "node": "n1"},
                           {"image": "r/a:1", "prolog_start": start},
                           end=start + 10, gpus=[], epilog_health=None)  # fmt: skip
        return json.dumps({**rec, **over}).encode() + b"\n"

    (tmp_path / "usage.jsonl-20261201").write_bytes(line("1", 1.8e9))  # logrotate dateext
    # A requeued job: the same id on the same node, run again later, is two runs.
    (tmp_path / "usage.jsonl").write_bytes(line("1", 1.8e9 + 100) + line("2", 1.8e9 + 5))
    whole = gzip.compress(line("3", 1.8e9) + line("4", 1.8e9) * 200)
    (tmp_path / "usage.jsonl-20261124.gz").write_bytes(whole[: len(whole) // 2])  # cut short
    naive = line("5", 1.8e9, end="2027-01-15T08:00:10.000")  # no zone: UTC
    nan = line("6", 1.8e9, wall_seconds=float("nan"))
    (tmp_path / "usage.jsonl.3").write_bytes(naive + nan)
    loaded = report.load([str(tmp_path)], since=report.parse_when("2027-01-01"))
    ids = sorted(j.job_id for j in loaded.jobs if j.job_id not in ("3", "4"))
    assert ids == ["1", "1", "2", "5"] and loaded.skipped == 1, (ids, loaded.skipped)
    # the cut gzip gave what it had (a prefix: job 3 first), and is named
    assert [j.job_id for j in loaded.jobs if j.job_id in ("3", "4")] in (["3"], ["3", "4"])
    assert len(loaded.damaged) == 1 and "usage.jsonl-20261124.gz" in loaded.damaged[0]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tfimage.main", "usage", "report", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_the_command_prints_a_table_a_person_reads_and_json_for_scripts(
    logs: tuple[Path, list[Gen]],
) -> None:
    root, _ = logs
    r = _run(str(root), "--by", "partition")
    assert r.returncode == 0, r.stderr
    head, *rows = r.stdout.splitlines()
    assert head.split() == ["PARTITION", "JOBS", "FAILED", "FAIL%", "MEDIAN", "P90", "GPU-H", "KWH"]
    assert sorted(row.split()[0] for row in rows) == ["debug", "gpu", "long"]
    j = _run(str(root), "--trend", "week", "--json")
    doc: dict[str, Any] = json.loads(j.stdout)
    assert doc["records"] == RECORDS and sum(r["jobs"] for r in doc["trend"]) == RECORDS


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent"], "tfimage: usage report: /nonexistent: no such file or directory"),
        (["--since", "yesterday", "/tmp"], "tfimage: usage report: 'yesterday' is not a time"),
        (["--since", "2026-12-02", "--until", "2026-12-01", "/tmp"], "--since must be before"),
        (["--top-failing", "0", "/tmp"], "--top-failing: give a count of at least 1"),
        (["--plot", "out.jpg", "/tmp"], "give a file name ending in .png"),
    ],
)
def test_a_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    r = _run(*args)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    return w, h


def test_the_plot_is_a_png_of_the_promised_size(
    logs: tuple[Path, list[Gen]], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is not installed in this venv")
    root, _ = logs
    out = tmp_path / "usage.png"
    assert cli(["usage", "report", str(root), "--trend", "day", "--plot", str(out)]) == 0
    from tfimage.agent.cli.plot import HEIGHT, WIDTH

    assert _png_size(out) == (WIDTH, HEIGHT) == (1200, 900)


def test_without_matplotlib_the_plot_says_how_to_get_it_in_one_line(
    logs: tuple[Path, list[Gen]], tmp_path: Path
) -> None:
    root, _ = logs
    # A Python where importing matplotlib fails, as where it was never installed.
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from tfimage.main import main; sys.exit(main())")  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-c", code, "usage", "report", str(root), "--plot", f"{tmp_path}/x.png"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert (
        r.stderr == "tfimage: usage report: --plot needs matplotlib: "
        "pip install 'tfimage[plot]' (or python3-matplotlib)\n"
    )
    assert not (tmp_path / "x.png").exists()

"""The README's sample closing lines of `bash tests/run-all.sh`, rendered again by the
scripts' own code: tests/summary.sh's host_summary (run-all.sh's line) and
other-host.sh's report (the other host's line).  A change to what the run prints that
the sample does not follow, or a sample edited into a shape the run never prints,
fails here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

HOST = re.compile(
    r"Debian \d+ \((?P<code>[a-z]+)\) host: Slurm (?P<slurm>[0-9.]+): (?P<unit>\d+) unit"
    r"(?: \((?P<uskip>\d+) skipped\))?, (?P<cluster>\d+) cluster"
    r"(?: \((?P<cskip>\d+) skipped\))? passed"
)
STEPS = re.compile(r", (demo|tests) passed \(([^)]*)\)")
TOTAL = re.compile(r"; ([^;]*) in all$")


def sample() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("Its last lines name both host generations", 1)[1]
    body = block.split("```\n", 2)[1]
    return body.splitlines()


def seconds(text: str) -> int:
    m = re.fullmatch(r"(?:(\d+) min )?(\d+) s", text)
    assert m, f"not a run-all duration: {text!r}"
    return int(m.group(1) or 0) * 60 + int(m.group(2))


def host_summary(line: str) -> str:
    """run-all.sh's line for the values LINE names, from tests/summary.sh."""
    m = HOST.match(line)
    assert m, f"not the shape of a host's line: {line!r}"
    args = [m["code"], m["slurm"], m["unit"], m["uskip"] or "0"]
    args += [m["cluster"], m["cskip"] or "0", m["slurm"]]
    done = subprocess.run(
        ["bash", "-c", '. tests/summary.sh && host_summary "$@"', "_", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return done.stdout.rstrip("\n")


def test_the_sample_is_three_lines_ending_in_all_passed() -> None:
    lines = sample()
    assert len(lines) == 3, lines
    assert all(line.startswith("tests: ") for line in lines)
    assert lines[2] == "tests: all passed"


def test_this_hosts_line_is_what_run_all_prints_for_its_numbers() -> None:
    line = sample()[0].removeprefix("tests: ")
    assert host_summary(line) == line


def test_the_other_hosts_line_is_what_other_host_reports(tmp_path: Path) -> None:
    line = sample()[1].removeprefix("tests: ")
    inner = host_summary(line)
    assert line.startswith(inner + ", ")
    steps = dict(STEPS.findall(line))
    total = TOTAL.search(line)
    assert set(steps) == {"demo", "tests"} and total, line
    (tmp_path / "test-summary.txt").write_text(inner + "\n")
    (tmp_path / "result").write_text(
        "host=unused\n"
        f"demo=0 {seconds(steps['demo'])}\n"
        f"tests=0 {seconds(steps['tests'])}\n"
        "slurm=unused\n"
    )
    done = subprocess.run(
        [
            "bash",
            "-c",
            '. deploy/local/other-host.sh && OUT=$1 STEPS="demo tests" && report 0 "$2"',
            "_",
            str(tmp_path),
            str(seconds(total.group(1))),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "summary.txt").read_text() == line + "\n"


def test_the_sample_names_two_generations_and_two_slurms() -> None:
    first, second = (HOST.match(line.removeprefix("tests: ")) for line in sample()[:2])
    assert first and second
    assert first["code"] != second["code"]
    assert first["slurm"].rsplit(".", 1)[0] != second["slurm"].rsplit(".", 1)[0]


def test_run_all_prints_its_line_with_host_summary() -> None:
    text = (REPO / "tests" / "run-all.sh").read_text()
    assert re.search(r'^line=\$\(host_summary "\$THIS" "\$HOST_SLURM" ', text, re.M)
    assert 'echo "tests: $line"' in text

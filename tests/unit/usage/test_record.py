"""The usage record: what the epilog appends, and that no writer, rotation or link
ever tears, loses or redirects a line."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import subprocess
import time
from pathlib import Path

import pytest

from support import need
from tfimage.agent.usage import record

REPO = Path(__file__).resolve().parents[3]
ROLE_LOGROTATE = REPO / "deploy/ansible/roles/tfimage/templates/logrotate.j2"
SLURM = {
    "job_id": "42",
    "user": "alice",
    "uid": "1001",
    "account": "proj1",
    "partition": "gpu",
    "node": "n1",
    "array_job_id": "40",
    "array_task_id": "2",
    "exit": "3:0",
    "image_asked": "tf-custom:2.0",
}
FACTS = {
    "prolog_start": 1_764_780_000.25,
    "image": "reg.example/library/tf-custom:2.0@sha256:" + "a" * 64,
    "repository": "library/tf-custom",
    "runtime": "charliecloud",
    "cache": "miss",
    "pull_seconds": 4.2,
    "pull_bytes": 1 << 20,
    "source": "reg.example",
    "gpu_prolog": "ok",
    "tf_workers": 4,
}


@pytest.mark.parametrize(
    ("code2", "raw", "want", "state"),
    [
        ("3:0", "768", (3, 0), "FAILED"),
        ("0:0", "0", (0, 0), "COMPLETED"),
        ("0:9", "9", (0, 9), "SIGNALED"),  # scancel's SIGKILL
        ("", "768", (3, 0), "FAILED"),  # only the raw wait status
        ("", "15", (0, 15), "SIGNALED"),
        ("x:y", "nope", None, "UNKNOWN"),  # neither parses: not invented
        ("", "", None, "UNKNOWN"),  # Slurm gave none
    ],
)
def test_the_state_and_exit_code_come_from_what_slurm_gives_the_epilog(
    code2: str, raw: str, want: tuple[int, int] | None, state: str
) -> None:
    assert record.exit_status(code2, raw) == want
    assert record.state_of(want) == state


def test_a_record_carries_every_field_of_the_schema_and_the_job_as_it_ran() -> None:
    gpus = [{"uuid": "GPU-1", "energy_j": 12.5}]
    rec = record.build(SLURM, FACTS, end=FACTS["prolog_start"] + 100, gpus=gpus,
                       epilog_health="ok")  # fmt: skip
    assert list(rec) == list(record.FIELDS)
    assert rec["start"] == "2025-12-03T16:40:00.250Z"
    assert rec["wall_seconds"] == 100.0
    assert (rec["state"], rec["exit_code"], rec["signal"]) == ("FAILED", 3, 0)
    assert (rec["array_job_id"], rec["array_task_id"], rec["uid"]) == ("40", "2", 1001)
    assert rec["image"] == FACTS["image"] and rec["image_asked"] == "tf-custom:2.0"
    assert rec["gpus"] == gpus and rec["gpu_health"] == {"prolog": "ok", "epilog": "ok"}
    assert (rec["cache"], rec["pull_bytes"], rec["tf_workers"]) == ("miss", 1 << 20, 4)


def test_a_record_of_the_longest_hostile_values_still_fits_one_line() -> None:
    # Every text a job controls, as long as it may be, in characters JSON escapes to
    # 6 bytes each: still one line, so the epilog never skips a job's record.
    worst = 'é"\\\n' * 5000
    slurm = {k: worst for k in SLURM} | {"job_id": "42", "exit": "1:0"}
    facts = {k: worst for k in FACTS} | {"prolog_start": 1.0}
    gpus = [{"uuid": worst, "energy_j": float("nan")}] * 100
    rec = record.build(slurm, facts, end=2.0, gpus=gpus, epilog_health="ok")
    line = record.line_of(rec)
    assert len(line) <= record.MAX_LINE and json.loads(line)["image_asked"].startswith("\\xe9")
    assert len(rec["gpus"]) == 64 and rec["gpus"][0]["energy_j"] is None  # no NaN in JSON


def test_an_array_tasks_record_names_its_array_when_slurm_gave_the_epilog_none() -> None:
    """The soak's finding: 22.05's slurmd gives Prolog and Epilog no SLURM_ARRAY_*;
    the job's steps noted Slurm's own ids (step/plan.py), and the record takes those."""
    slurm = {**SLURM, "array_job_id": "", "array_task_id": ""}
    facts = {**FACTS, "array_job_id": "207", "array_task_id": "0"}
    rec = record.build(slurm, facts, end=FACTS["prolog_start"] + 1, gpus=[], epilog_health=None)
    assert (rec["array_job_id"], rec["array_task_id"]) == ("207", "0")
    # What the epilog was given, where it was, wins over what the steps noted.
    rec = record.build(SLURM, facts, end=FACTS["prolog_start"] + 1, gpus=[], epilog_health=None)
    assert (rec["array_job_id"], rec["array_task_id"]) == ("40", "2")


def test_a_try_the_prolog_requeued_is_recorded_requeued_not_as_its_exit_code() -> None:
    """Its slurmd died under the prolog (hooks/orphan.py): Slurm's 0:0 for a job whose
    script never ran must not read as a success, nor as the image's failure."""
    slurm = {**SLURM, "exit": "0:0"}
    rec = record.build(slurm, {**FACTS, "requeued": True}, end=2e9, gpus=[], epilog_health=None)
    assert rec["state"] == "REQUEUED" and not record.failed(rec)
    for flag in (False, "yes", 1):  # only the prolog's own True
        rec = record.build(slurm, {**FACTS, "requeued": flag}, end=2e9, gpus=[], epilog_health=None)
        assert rec["state"] == "COMPLETED"


def test_a_job_that_no_prolog_readied_is_recorded_with_nulls_not_guesses() -> None:
    slurm = {**SLURM, "uid": "x", "array_job_id": "", "array_task_id": "", "exit": "0:0"}
    rec = record.build(slurm, {"image_error": "reg: unreachable\nFAKE"}, end=2e9, gpus=[],
                       epilog_health=None)  # fmt: skip
    assert rec["cache"] is None and rec["uid"] is None and rec["array_job_id"] is None
    assert rec["image_error"] == "reg: unreachable\\nFAKE"  # one line, always
    assert rec["wall_seconds"] == 0.0 and rec["start"] == rec["end"]  # no start known


def _writer(path: str, who: int, n: int, pause: float = 0.0) -> None:
    for i in range(n):
        rec = {**dict.fromkeys(record.FIELDS), "job_id": f"{who}-{i}", "pad": "x" * (i % 3000)}
        record.append(Path(path), rec)
        if pause:
            time.sleep(pause)


def _lines(*paths: Path) -> list[bytes]:
    out: list[bytes] = []
    for p in paths:
        data = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        assert b"\0" not in data  # no hole where a writer wrote past a truncation
        out += data.splitlines(keepends=True)
    return out


def _check_whole(lines: list[bytes]) -> set[str]:
    ids = set()
    for line in lines:
        assert line.endswith(b"\n")
        ids.add(json.loads(line)["job_id"])  # a torn or interleaved line fails here
    return ids


def test_concurrent_epilogs_never_interleave_their_lines(tmp_path: Path) -> None:
    log = tmp_path / "usage.jsonl"
    procs = [multiprocessing.Process(target=_writer, args=(str(log), w, 400)) for w in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    lines = _lines(log)
    assert len(lines) == 2400 and len(_check_whole(lines)) == 2400
    assert log.stat().st_mode & 0o777 == 0o640


def _logrotate(tmp_path: Path, conf_text: str) -> None:
    conf = tmp_path / "logrotate.conf"
    conf.write_text(conf_text)
    conf.chmod(0o644)
    r = subprocess.run(
        ["logrotate", "-f", "-s", str(tmp_path / "logrotate.state"), str(conf)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def _rotating(tmp_path: Path, log: Path, conf: str, lines: int, every: float) -> int:
    """Four writers append ``lines`` lines each, 1 ms apart (a second or more on any
    machine), while logrotate runs every ``every`` s on the non-empty log; how many
    times it ran."""
    writers = [
        multiprocessing.Process(target=_writer, args=(str(log), w, lines, 0.001)) for w in range(4)
    ]
    for p in writers:
        p.start()
    rotations = 0
    while any(p.is_alive() for p in writers):
        if log.exists() and log.stat().st_size:
            _logrotate(tmp_path, conf)
            rotations += 1
        time.sleep(every)
    for p in writers:
        p.join(60)
    return rotations


def test_the_roles_logrotate_renames_while_epilogs_append_and_no_line_is_lost(
    tmp_path: Path,
) -> None:
    need("logrotate")
    log = tmp_path / "usage.jsonl"
    conf = ROLE_LOGROTATE.read_text().replace("{{ ansible_managed }}", "test")
    conf = conf.replace("{{ tfimage_usage_log }}", str(log))
    conf = conf.replace("{{ tfimage_usage_logrotate_keep }}", "50")
    assert "{{" not in conf
    # A rotation period, however short, between the rename and the compression
    # (delaycompress: the next rotation): the role's is a week.
    rotations = _rotating(tmp_path, log, conf, 1500, every=0.2)
    files = sorted(tmp_path.glob("usage.jsonl*"))
    assert rotations >= 2 and len(files) >= 3, (rotations, files)
    assert any(f.suffix == ".gz" for f in files)  # compress, delaycompress as the role says
    lines = _lines(*files)
    # Every line, whole; one written twice (its file compressed away meanwhile) is fine.
    assert len(_check_whole(lines)) == 6000 and len(lines) <= 6000 + 4


def test_copytruncate_loses_no_line_written_after_it_and_leaves_no_hole(tmp_path: Path) -> None:
    need("logrotate")
    log = tmp_path / "usage.jsonl"
    _writer(str(log), 0, 100)
    _logrotate(tmp_path, f"{log} {{\n  copytruncate\n  rotate 5\n}}\n")
    _writer(str(log), 1, 7)
    # O_APPEND: the next line lands at the new end (0), not at the old offset after a
    # run of zeros, which is what a writer holding its offset leaves.
    assert _check_whole(_lines(tmp_path / "usage.jsonl.1")) == {f"0-{i}" for i in range(100)}
    assert _check_whole(_lines(log)) == {f"1-{i}" for i in range(7)}


def test_copytruncate_while_epilogs_append_tears_at_most_a_copys_last_line(
    tmp_path: Path,
) -> None:
    need("logrotate")
    log = tmp_path / "usage.jsonl"
    conf = f"{log} {{\n  copytruncate\n  rotate 100000\n}}\n"  # every copy kept
    # Back to back, tens of times, not hundreds: copytruncate's window is the point.
    rotations = _rotating(tmp_path, log, conf, 1000, every=0.02)
    copies = sorted(tmp_path.glob("usage.jsonl.*"))
    assert rotations >= 2 and len(copies) == rotations
    ids = _check_whole(_lines(log))  # the live file: every line whole, no hole
    torn = 0
    for copy in copies:
        lines = _lines(copy)
        # logrotate reads while an epilog writes: the copy's last line may be cut off
        # (that line is then lost with the truncate).  Never any other line, and the
        # next line starts at the live file's new end.  usage report skips such a line.
        if lines and not lines[-1].endswith(b"\n"):
            torn += 1
            lines = lines[:-1]
        ids |= _check_whole(lines)
    assert len(ids) <= 4000
    # Lines written while logrotate copies are lost with its truncate (logrotate's
    # documented window; thousands here, where four writers append as fast as they
    # can; an epilog writes one line per job): why the role renames instead, which
    # loses nothing (the test above).


def test_a_usage_log_that_is_a_link_is_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "shadow"
    target.write_text("root:x:0:0\n")
    log = tmp_path / "usage.jsonl"
    log.symlink_to(target)
    with pytest.raises(OSError):
        record.append(log, dict.fromkeys(record.FIELDS))
    assert target.read_text() == "root:x:0:0\n"


def test_a_record_too_long_for_one_line_is_refused_not_split() -> None:
    with pytest.raises(ValueError, match="over"):
        record.line_of({"x": "y" * record.MAX_LINE})

"""A prolog whose slurmd died under it requeues its job (hooks/orphan.py).

Scenario "slurmd killed under a prolog" (the soak's, bench/soak, 24.11 in CI): Slurm
keeps such a job in its prolog with no end, since the restarted slurmd knows nothing
of it.  Here slurmd is a shell named ``slurmd`` (a symlink's name is the process's
comm, as Slurm's own is) that runs the hook as slurmd runs a Prolog, as its child; the
prolog is slow because its registry trickles; ``scontrol`` is a stand-in that records
its arguments (no slurmctld here; tests/cluster/test_crashed_slurmd.py has the real one).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostile import Server

from support import children, started_daemon
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import TfimageError
from tfimage.agent.hooks import orphan
from tfimage.agent.usage import jobfacts

REPO = Path(__file__).resolve().parents[3]
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def hook_binary() -> Path:
    subprocess.run(["make", "-s", "-C", str(REPO / "spank"), "all"], check=True, timeout=300)
    return REPO / "spank" / "build" / "tfimage-hook"


def _fake_slurmd(tmp_path: Path, name: str = "slurmd") -> Path:
    exe = tmp_path / "sbin" / name
    exe.parent.mkdir()
    exe.symlink_to("/bin/sh")
    return exe


def _scontrol(tmp_path: Path, status: int = 0, listed: str | None = None) -> tuple[Path, Path]:
    """Stand-ins: scontrol records its arguments; squeue lists ``listed`` (by default,
    the job it is asked for as no array's)."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    record = tmp_path / "scontrol.args"
    (bin_dir / "scontrol").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" >> {record}\n'
        f'[ {status} = 0 ] || echo "Requeue of this job is disabled" >&2\nexit {status}\n'
    )
    if listed is None:
        listing = 'echo "$3|$3|N/A"'  # squeue -h -j ID -o FORMAT
    else:
        (tmp_path / "squeue.out").write_text(listed)
        listing = f"cat {tmp_path / 'squeue.out'}"
    (bin_dir / "squeue").write_text(f"#!/bin/sh\n{listing}\n")
    for tool in ("scontrol", "squeue"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir, record


# `squeue -h -j 61 -o '%A|%F|%K'` on 22.05.8 while array 61 (0-9) ran its tasks 0-7:
# every task of the array, the pending rest under the array's own id.
ARRAY_61 = "61|61|8-9\n70|61|7\n69|61|6\n64|61|1\n63|61|0\n"


@pytest.mark.parametrize(
    ("job_id", "listed", "name"),
    [
        ("62", "62|62|N/A\n", "62"),
        ("64", "64|61|1\n", "61_1"),
        ("61", ARRAY_61.replace("8-9", "9"), "61_9"),  # the array's own id: its last task
    ],
    ids=["a job of no array", "a task with an id of its own", "the task with the array's id"],
)
def test_an_array_task_is_requeued_by_its_array_and_task_never_as_the_whole_array(
    job_id: str, listed: str, name: str
) -> None:
    assert orphan.alone(job_id, listed) == name


@pytest.mark.parametrize(
    "listed",
    ["", "63|61|0\n", "61|61|8-9\n", "61|61|x;y\n", "61|61\n"],
    ids=["not listed", "only a sibling", "the pending rest", "not numbers", "no task field"],
)
def test_a_listing_that_does_not_name_one_task_of_the_job_is_no_requeue(listed: str) -> None:
    with pytest.raises(TfimageError, match="squeue: job 61"):
        orphan.alone("61", listed)


def test_an_orphaned_array_task_with_the_arrays_id_requeues_that_task_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The soak on 24.11 (CI, 2026-12-07): slurmd killed under task 140_1's prolog,
    # whose job id was 140; `scontrol requeue 140` requeued 140_0 as well.
    bin_dir, record = _scontrol(tmp_path, listed=ARRAY_61.replace("8-9", "9"))
    path = tmp_path / "config.yaml"
    path.write_text(f'registry: "registry.invalid"\ngpu:\n  slurm_bin: {bin_dir}\n')
    log = logging.getLogger("test-orphan")
    with caplog.at_level(logging.INFO, logger="test-orphan"):
        assert orphan.requeue(orphan.Process(1, 0), load_config(str(path)), "61", log)
    assert record.read_text().splitlines() == ["requeue", "61_9"]
    assert "requeued (scontrol requeue 61_9)" in caplog.text


def _first_child(pid: int) -> int:
    for _ in range(300):
        if children(pid):
            break
        time.sleep(0.01)
    (child,) = children(pid)
    return child


def test_the_nearest_slurmd_ancestor_is_found_and_known_gone_by_pid_and_start(
    tmp_path: Path,
) -> None:
    slurmd = subprocess.Popen([str(_fake_slurmd(tmp_path)), "-c", "sleep 60 & wait"])
    try:
        child = _first_child(slurmd.pid)
        found = orphan.slurmd_of(child)
        assert found is not None and found.pid == slurmd.pid
        assert not orphan.gone(found)
        assert orphan.slurmd_of(os.getpid()) is None  # pytest runs under no slurmd
        assert orphan.gone(orphan.Process(found.pid, found.start + 1))  # a pid used again
    finally:
        slurmd.kill()
        slurmd.wait()
    assert orphan.gone(found)


def test_debians_slurmd_wlm_re_executed_by_a_24_11_reconfigure_is_still_its_slurmd(
    tmp_path: Path,
) -> None:
    # Scenario "slurmd killed under a prolog after a reconfigure" (trixie, 24.11.5):
    # `scontrol reconfigure` re-executes slurmd in place by its real path,
    # /usr/sbin/slurmd-wlm, and the hook under it found no slurmd: no requeue, the job
    # in its prolog for good (tests/cluster/test_crashed_slurmd.py, "a reconfigure").
    slurmd = subprocess.Popen([str(_fake_slurmd(tmp_path, "slurmd-wlm")), "-c", "sleep 60 & wait"])
    try:
        child = _first_child(slurmd.pid)
        assert Path(f"/proc/{slurmd.pid}/comm").read_text().strip() == "slurmd-wlm"
        found = orphan.slurmd_of(child)
        assert found is not None and found.pid == slurmd.pid
    finally:
        slurmd.kill()
        slurmd.wait()


def test_the_daemon_is_found_above_slurms_launcher_not_the_launcher(tmp_path: Path) -> None:
    """Slurm 23.11+ runs a prolog through a launcher (run_command.c): slurmd's own
    program again, between the daemon and the script, alive as long as the script.
    Here the daemon and the launcher are both shells named slurmd."""
    exe = _fake_slurmd(tmp_path)
    daemon = subprocess.Popen([str(exe), "-c", f'{exe} -c "sleep 60 & wait" & wait'])
    try:
        launcher = _first_child(daemon.pid)
        script = _first_child(launcher)
        found = orphan.slurmd_of(script)
        assert found is not None and found.pid == daemon.pid  # not the launcher
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(launcher)], check=False)
        daemon.kill()
        daemon.wait()


def test_an_orphaned_prolog_asks_for_the_requeue_and_a_refused_one_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bin_dir, record = _scontrol(tmp_path, status=1)
    path = tmp_path / "config.yaml"
    path.write_text(f'registry: "registry.invalid"\ngpu:\n  slurm_bin: {bin_dir}\n')
    cfg = load_config(str(path))
    log = logging.getLogger("test-orphan")
    slurmd = subprocess.Popen([str(_fake_slurmd(tmp_path)), "-c", "sleep 60 & wait"])
    try:
        found = orphan.slurmd_of(_first_child(slurmd.pid))
        assert not orphan.orphaned(found)  # alive: nothing to ask
        assert not record.exists()
    finally:
        slurmd.kill()
        slurmd.wait()
    assert found is not None and orphan.orphaned(found)
    with caplog.at_level(logging.INFO, logger="test-orphan"):
        assert not orphan.requeue(found, cfg, "46", log)
    assert record.read_text().splitlines() == ["requeue", "46"]
    assert "the requeue failed: scontrol requeue: Requeue of this job is disabled" in caplog.text


@pytest.mark.parametrize("killed", [True, False], ids=["slurmd killed", "slurmd alive"])
@pytest.mark.parametrize("through", ["tfimage-hook and the daemon", "the program"])
def test_a_prolog_whose_slurmd_is_killed_under_it_requeues_its_job_and_only_then(
    tls: Path, tmp_path: Path, hook_binary: Path, killed: bool, through: str
) -> None:
    bin_dir, record = _scontrol(tmp_path)
    s = Server(tls)
    (tmp_path / "node").mkdir()
    try:
        s.serve(os.urandom(8 << 20), delay=1.0)  # the pull outlasts the kill
        conf = (
            f'registry: "{s.host}"\nca_bundle: {tls / "ca.crt"}\n'
            f"cache_dir: {tmp_path / 'cache'}\nstate_dir: {{run}}\n"
            f"hook_log: {tmp_path / 'hooks.log'}\nread_timeout: 5\nhook_deadline: 3\n"
            f"gpu:\n  slurm_bin: {bin_dir}\n"
        )
        with started_daemon(tmp_path / "node", conf) as (run, cfg, _):
            prolog = [str(VENV_BIN / "tfimage-prolog"), f"--config={cfg}", "--job=7", "--image=x:1"]
            argv = [str(hook_binary), str(run / "daemon.sock"), "3", *prolog]
            if through == "the program":
                argv = prolog
            slurmd = subprocess.Popen(
                [str(_fake_slurmd(tmp_path)), "-c", '"$@" & wait', "slurmd", *argv],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for _ in range(300):
                if children(slurmd.pid):
                    break
                time.sleep(0.01)
            (hook,) = children(slurmd.pid)
            for _ in range(300):  # the pull under way: the prolog knows its slurmd
                if s.b.seen:
                    break
                time.sleep(0.01)
            assert s.b.seen
            if killed:
                slurmd.send_signal(signal.SIGKILL)
            slurmd.wait(timeout=30)
            for _ in range(300):  # the orphaned hook is no child of ours: watch it end
                if not Path(f"/proc/{hook}").exists() or _zombie(hook):
                    break
                time.sleep(0.05)
            log = (tmp_path / "hooks.log").read_text()
            with jobfacts.claimed(str(run), "7") as facts:  # what the epilog records
                requeued = facts.get("requeued")
    finally:
        s.httpd.shutdown()
    assert "prolog: gave up after 3 s (hook_deadline)" in log, log
    if killed:
        assert record.read_text().splitlines() == ["requeue", "7"]
        assert requeued is True  # the record says REQUEUED: this try never ran
        assert f"job 7: slurmd (pid {slurmd.pid}) died under the prolog" in log, log
    else:
        assert not record.exists()
        assert requeued is None
        assert "died under the prolog" not in log


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True

"""The node hooks never fail a node for tfimage.

Slurm drains a node whose Prolog or Epilog exits non-zero.  Whatever a job, an image
or a registry does, and whatever breaks on the node's side of tfimage, the hooks log
one line and exit 0: run directly, through the node daemon, and through the role's
own prolog script and ``tfimage-hook``.  A hook has one deadline; a prolog that
reaches it gives up once (never a second run beside the first) and the job's steps
report why at once.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jinja2
import pytest
from gpus import FakeNvml, build_fake_nvml
from gpus import node as gpus_node
from hostile import Server

from support import (
    Registry,
    ask_daemon,
    hook_site,
    need,
    push_oci_image,
    started_daemon,
    wait_for,
)
from tfimage.agent.core import wire
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import ImageError, NodeFault
from tfimage.agent.hooks.log import guarded, hook_logger
from tfimage.agent.step.plan import _ready
from tfimage.agent.step.runtime import runtime_for
from tfimage.epilog.main import main as epilog
from tfimage.prolog.main import main as prolog
from tokenauth import TokenService

REPO = Path(__file__).resolve().parents[3]
ROLE = REPO / "deploy/ansible/roles/tfimage/templates"
VENV_BIN = Path(sys.executable).parent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the hooks run as root: run as root")


def _log(tmp_path: Path) -> list[str]:
    path = tmp_path / "hooks.log"
    return path.read_text().splitlines() if path.exists() else []


# --- hostile values and every kind of failure -----------------------------------------


@pytest.mark.parametrize("image", ["-x", "--help", "-h", "--job=1"])
def test_an_image_value_starting_with_a_dash_stays_a_value(tmp_path: Path, image: str) -> None:
    cfg = hook_site(tmp_path)
    assert prolog([f"--config={cfg}", "--job=7", f"--image={image}"]) == 0
    lines = _log(tmp_path)
    assert len(lines) == 1 and "job 7: image " in lines[0] and "invalid image reference" in lines[0]


@pytest.fixture(scope="session")
def hook_binary() -> Path:
    """spank/build/tfimage-hook, built with the plugin (make spank)."""
    subprocess.run(["make", "-s", "-C", str(REPO / "spank"), "all"], check=True, timeout=300)
    return REPO / "spank" / "build" / "tfimage-hook"


def _render(template: str, tmp_path: Path, hook: Path, daemon: bool) -> Path:
    """The role's own prolog/epilog script, rendered for this test's node."""
    env = jinja2.Environment(keep_trailing_newline=True, autoescape=False)  # noqa: S701 - shell
    env.filters.update(bool=bool, int=int)  # Ansible's, as the role uses them
    text = env.from_string((ROLE / template).read_text()).render(
        ansible_managed="test",
        tfimage_daemon=daemon,
        tfimage_plugin_dir=str(hook.parent),
        tfimage_state_dir=str(tmp_path / "run"),
        tfimage_hook_deadline=30,
        tfimage_prefix=str(VENV_BIN.parent),
        tfimage_config_dir=str(tmp_path),
    )
    script = tmp_path / template.removesuffix(".j2")
    script.write_text(text)
    return script


@pytest.mark.parametrize("through", ["the program", "tfimage-hook and the daemon"])
def test_the_roles_prolog_never_fails_for_a_hostile_image_value(
    tmp_path: Path, hook_binary: Path, through: str
) -> None:
    daemon = through != "the program"
    (tmp_path / "node").mkdir()
    cfg = hook_site(tmp_path)
    script = _render("prolog.j2", tmp_path, hook_binary, daemon)
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "9", "SPANK_TFIMAGE_IMAGE": "-x"}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["/bin/sh", str(script)], env=env, capture_output=True, text=True, timeout=120
        )

    if daemon:
        conf_text = cfg.read_text().replace(str(tmp_path / "state"), "{run}")
        with started_daemon(tmp_path / "node", conf_text) as (run_dir, _, _):
            (tmp_path / "run").symlink_to(run_dir)
            r = run()
        assert "tfimage-prolog job 9 -> 0" in (tmp_path / "node" / "daemon.log").read_text()
    else:
        r = run()
    assert r.returncode == 0, r.stderr
    assert "invalid image reference '-x'" in r.stderr


@pytest.mark.parametrize("through", ["the program", "tfimage-hook and the daemon"])
def test_the_roles_prolog_exits_non_zero_for_a_gpu_fault_and_only_for_that(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, hook_binary: Path, through: str
) -> None:
    daemon = through != "the program"
    (tmp_path / "node").mkdir()
    (tmp_path / "kmsg").touch()
    cfg = hook_site(tmp_path, gpu={"kmsg": str(tmp_path / "kmsg")})
    script = _render("prolog.j2", tmp_path, hook_binary, daemon)
    lib = build_fake_nvml(tmp_path_factory.mktemp("nvml"))
    nvml = FakeNvml(lib, lib / "state.json")  # the daemon clears FAKE_NVML_STATE
    # slurmd's environment for a GPU job without --tf-image; SLURM_CONF: scontrol fails at once
    env = {
        "PATH": "/usr/bin:/bin",
        "SLURM_JOB_ID": "9",
        "SLURMD_NODENAME": "n1",
        "SLURM_JOB_GPUS": "1",
        "SLURM_CONF": "/dev/null",
        "LD_LIBRARY_PATH": str(nvml.lib_dir),
        "FAKE_NVML_STATE": str(nvml.state),
    }

    def run() -> list[int]:
        codes = []
        for state in (gpus_node(2), gpus_node(2, init="DRIVER_NOT_LOADED")):
            nvml.write(state)
            r = subprocess.run(
                ["/bin/sh", str(script)], env=env, capture_output=True, text=True, timeout=120
            )
            codes.append(r.returncode)
        return codes

    if daemon:  # the daemon's workers read NVML: the daemon has the node's environment
        conf_text = cfg.read_text().replace(str(tmp_path / "state"), "{run}")
        with started_daemon(tmp_path / "node", conf_text, env={**os.environ, **env}) as (rd, _, _):
            (tmp_path / "run").symlink_to(rd)
            codes = run()
        log = (tmp_path / "node" / "daemon.log").read_text()
        assert "tfimage-prolog job 9 -> 0" in log and "tfimage-prolog job 9 -> 1" in log
    else:
        codes = run()
    assert codes == [0, 1]
    assert any(
        "tfimage: nvml: NVML does not initialise: Driver Not Loaded" in line
        for line in _log(tmp_path)
    )


@contextlib.contextmanager
def _full_tmpfs(path: Path) -> Iterator[Path]:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], check=True)
    try:
        fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError:
            pass  # full
        finally:
            os.close(fd)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def cached_image(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> str:
    """A small image in the registry, pinned: the prolog's usual input."""
    digest = registry.client().push_sif("library/hooky", "1", make_sif({"m": "1"}))
    return f"{registry.host}/library/hooky:1@{digest}"


def _registry_site(registry: Registry, tmp_path: Path, **extra: object) -> Path:
    cfg = registry.write_site(tmp_path)
    text = cfg.read_text() + f"hook_log: {tmp_path / 'hooks.log'}\n"
    text += "".join(f"{k}: {v}\n" for k, v in extra.items())
    cfg.write_text(text)
    return cfg


@pytest.mark.parametrize("case", ["cache_dir is a file", "/run is full"])
def test_a_node_side_failure_is_one_line_and_exit_0(
    registry: Registry, cached_image: str, tmp_path: Path, case: str
) -> None:
    cfg = _registry_site(registry, tmp_path)
    argv = [f"--config={cfg}", "--job=7", f"--image={cached_image}"]
    if case == "cache_dir is a file":
        (tmp_path / "cache").write_text("a file where a directory is expected")
        want = "FileExistsError"
        assert prolog(argv) == 0
    else:
        want = "No space left on device"
        with _full_tmpfs(tmp_path / "state"):
            assert prolog(argv) == 0
    lines = _log(tmp_path)
    if case == "/run is full":  # the job's usage facts could not be kept either: once
        unkept = [line for line in lines if "job 7: usage: not kept:" in line]
        assert len(unkept) == 1 and want in unkept[0], lines
        lines = [line for line in lines if line not in unkept]
    assert len(lines) == 1 and "job 7:" in lines[0] and want in lines[0], lines


def test_each_part_of_the_epilog_fails_alone_with_one_line_and_exit_0(tmp_path: Path) -> None:
    cfg = hook_site(tmp_path)
    (tmp_path / "state").write_text("a file where a directory is expected")
    # An entry job 7 holds, whose lock cannot be taken (locks/ is a file).
    images = tmp_path / "cache" / "images"
    images.mkdir(parents=True)
    (images / f"sha256-{'a' * 64}.sif").write_text("x")
    meta = {"digest": "sha256:" + "a" * 64, "holders": ["7"], "refs": []}
    (images / f"sha256-{'a' * 64}.json").write_text(json.dumps(meta))
    (tmp_path / "cache" / "locks").write_text("a file where a directory is expected")
    assert epilog([f"--config={cfg}", "--job=7"]) == 0
    lines = _log(tmp_path)
    assert len(lines) == 4, lines
    assert "job 7: cleanup: unmounting: NotADirectoryError" in lines[0]
    assert "job 7: cleanup: releasing its images: NotADirectoryError" in lines[1]
    assert "job 7: cleanup: dropping its GPU baseline: NotADirectoryError" in lines[2]
    assert "job 7: cleanup: forgetting its default image: NotADirectoryError" in lines[3]


def test_a_hostile_token_with_a_line_break_is_one_line_and_exit_0(
    tls: Path, tmp_path: Path
) -> None:
    s = Server(tls)
    try:
        s.serve(b"x", bearer=True, token_text="abc\r\nX-Injected: 1")
        creds = tmp_path / "creds.json"
        creds.write_text(f'{{"registries": {{"{s.host}": {{"username": "u", "password": "p"}}}}}}')
        creds.chmod(0o600)
        cfg = hook_site(tmp_path, registry=s.host, ca_bundle=tls / "ca.crt", credentials=creds)
        assert prolog([f"--config={cfg}", "--job=7", "--image=x:1"]) == 0
    finally:
        s.httpd.shutdown()
    lines = _log(tmp_path)
    assert len(lines) == 1 and "token service sent an unusable token" in lines[0], lines


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad\nvalue"),
        OSError(28, "No space left on device"),
        MemoryError(),
        RuntimeError("a bug"),
        KeyboardInterrupt(),
        SystemExit(2),
    ],
)
def test_guarded_turns_anything_but_a_node_fault_into_one_line_and_0(
    exc: BaseException, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = hook_logger("prolog", log_file=None)

    def body() -> int:
        raise exc

    assert guarded(log, "prolog", body) == 0
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "tfimage-prolog: prolog: " in err, err


def test_a_node_fault_is_the_one_non_zero_exit(capsys: pytest.CaptureFixture[str]) -> None:
    log = hook_logger("prolog", log_file=None)

    def body() -> int:
        raise NodeFault("gpu0 GPU-1234: volatile uncorrected ECC")

    assert guarded(log, "prolog", body) == 1


def test_sigterm_ends_a_prolog_with_one_line_and_exit_0(tls: Path, tmp_path: Path) -> None:
    s = Server(tls)
    try:
        blob = os.urandom(4 << 20)
        s.serve(blob, delay=0.5)  # a trickle: the prolog is busy downloading
        cfg = hook_site(tmp_path, registry=s.host, ca_bundle=tls / "ca.crt")
        p = subprocess.Popen(
            [str(VENV_BIN / "tfimage-prolog"), f"--config={cfg}", "--job=7", "--image=x:1"],
            stderr=subprocess.PIPE,
            text=True,
        )
        # Only once the download has begun: a SIGTERM before it would prove less.
        wait_for(
            lambda: bool(s.b.ranges) or any("/blobs/" in path for path, _ in s.b.seen),
            timeout=20,
            what="the prolog's download to begin",
        )
        assert p.poll() is None, "the prolog ended before it was signalled"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    finally:
        s.httpd.shutdown()
    assert p.returncode == 0, err
    lines = _log(tmp_path)
    assert len(lines) == 1 and "terminated (SIGTERM)" in lines[0], lines


def test_a_hostile_image_text_is_logged_on_one_line(tmp_path: Path) -> None:
    cfg = hook_site(tmp_path)
    assert prolog([f"--config={cfg}", "--job=7", "--image=x:1\nFAKE tfimage-prolog: ok"]) == 0
    lines = _log(tmp_path)
    assert len(lines) == 1 and "\\nFAKE" in lines[0], lines


def test_a_download_a_failed_pull_kept_is_dropped_by_its_jobs_epilog(
    tls: Path, tmp_path: Path
) -> None:
    # The soak on Debian 13 (CI at bbc5ef3): the registry killed under a 1 GB pull,
    # the job failed, and its partial download stayed on the node after the last
    # epilog.  Kept to resume while the job lived; nothing of it once it ended.
    s = Server(tls)
    try:
        s.serve(os.urandom(1 << 20), cut_after=300_000, cuts=1000)  # every try cut
        cfg = tmp_path / "config.yaml"
        cfg.write_text(
            f'registry: "{s.host}"\nca_bundle: {tls / "ca.crt"}\n'
            f"cache_dir: {tmp_path / 'cache'}\nstate_dir: {tmp_path / 'state'}\n"
            f"hook_log: {tmp_path / 'hooks.log'}\nread_timeout: 5\n"
        )
        assert prolog([f"--config={cfg}", "--job=7", "--image=x:1", "--node=n1"]) == 0
        [kept] = (tmp_path / "cache" / "tmp").iterdir()
        assert kept.name.endswith(".partial") and kept.stat().st_size >= 4096
        assert "broke off" in "\n".join(_log(tmp_path))

        assert epilog([f"--config={cfg}", "--job=7", "--image=x:1", "--exit=0:0"]) == 0
    finally:
        s.httpd.shutdown()
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []
    assert f"job 7: dropped {kept.name}, a download a failed pull left" in _log(tmp_path)[-1]


# --- one deadline: the prolog gives up once, and the steps say why at once ------------


def test_a_trickling_registry_ends_the_prolog_at_its_deadline_once(
    tls: Path, tmp_path: Path, hook_binary: Path
) -> None:
    s = Server(tls)
    (tmp_path / "node").mkdir()
    try:
        # A byte every few seconds would do; 64 KiB every second is the same for the
        # client (each read well inside read_timeout) and the same for the deadline.
        s.serve(os.urandom(8 << 20), delay=1.0)
        conf = (
            f'registry: "{s.host}"\nca_bundle: {tls / "ca.crt"}\n'
            f"cache_dir: {tmp_path / 'cache'}\nstate_dir: {{run}}\n"
            f"hook_log: {tmp_path / 'hooks.log'}\nread_timeout: 5\nhook_deadline: 3\n"
        )
        with started_daemon(tmp_path / "node", conf) as (run, cfg, _):
            started = time.monotonic()
            r = subprocess.run(
                [
                    str(hook_binary),
                    str(run / "daemon.sock"),
                    "3",
                    str(VENV_BIN / "tfimage-prolog"),
                    f"--config={cfg}",
                    "--job=7",
                    "--image=x:1",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            took = time.monotonic() - started
            assert r.returncode == 0, r.stderr
            assert 3 <= took < 3 + 10, took  # the deadline, not the registry's pace
            daemon_log = (tmp_path / "node" / "daemon.log").read_text()
            assert daemon_log.count("tfimage-prolog job 7 -> 0") == 1, daemon_log
            lines = [line for line in _log(tmp_path) if "job 7" in line]
            assert len(lines) == 1 and "prolog: gave up after 3 s (hook_deadline)" in lines[0]
            assert "not run again" not in r.stderr  # the daemon answered in time
            # The step asks nothing of the registry: it reports the prolog's reason.
            site = load_config(cfg)
            asked = len(s.b.seen)
            t = time.monotonic()
            with pytest.raises(ImageError, match=r"the prolog could not ready it .* gave up"):
                _ready(site, "7", "x:1", runtime_for("charliecloud"), None, None)
            assert time.monotonic() - t < 1.0 and len(s.b.seen) == asked
    finally:
        s.httpd.shutdown()


# --- no credential or token in a log, an argv or a job's environment ------------------


@contextlib.contextmanager
def execs_traced(pid: int, out: Path) -> Iterator[None]:
    """Every execve of ``pid`` and its descendants from now on, with whole argv and
    environment (strace -f -v -s): short-lived helpers that a sampler of /proc misses
    included."""
    need("strace")
    tracer = subprocess.Popen(
        ["strace", "-f", "-v", "-s", "65536", "-e", "trace=execve", "-o", str(out),
         "-p", str(pid)],
        stderr=subprocess.PIPE,
    )  # fmt: skip
    assert tracer.stderr is not None
    # strace says it attached before it traces anything
    wait_for(lambda: out.exists() or tracer.poll() is not None, timeout=20, what="strace")
    time.sleep(0.3)
    try:
        yield
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=30)


def _secrets_in(text: str, secrets: list[str], users: list[str]) -> list[str]:
    """Each secret found in ``text`` as is or base64-encoded (alone, or as the
    ``user:password`` of a Basic header or an auth file)."""
    found = []
    for secret in secrets:
        forms = {secret, base64.b64encode(secret.encode()).decode()}
        forms |= {base64.b64encode(f"{u}:{secret}".encode()).decode() for u in users}
        found += [secret[:4] + "..." for form in forms if form in text]
    return found


def test_no_credential_or_token_reaches_a_log_an_argv_or_a_job(
    token_registry: Registry,
    token_service: TokenService,
    make_sif: Callable[[dict[str, str]], Path],
    tmp_path: Path,
) -> None:
    """A SIF pull and a docker:// conversion (skopeo, with an auth file), every
    execve traced."""
    need("umoci", "skopeo", "busybox")
    token_registry.client().push_sif("library/secretive", "1", make_sif({"s": "1"}))
    (tmp_path / "oci").mkdir()
    push_oci_image(token_registry, tmp_path / "oci", "library/secret-oci")
    (tmp_path / "site").mkdir()
    site = token_registry.write_site(tmp_path / "site")
    conf = site.read_text().replace(f"state_dir: {tmp_path / 'site' / 'state'}", "state_dir: {run}")
    conf += f"hook_log: {tmp_path / 'hooks.log'}\n"
    (tmp_path / "node").mkdir()
    trace = tmp_path / "execve.trace"
    issued = len(token_service.issued)
    with started_daemon(tmp_path / "node", conf) as (run, cfg, daemon):
        with execs_traced(daemon.pid, trace):
            for job, image in (("7", "secretive:1"), ("8", "docker://secret-oci:1")):
                status, err, _ = ask_daemon(
                    run / "daemon.sock",
                    "tfimage-prolog",
                    f"--config={cfg}",
                    f"--job={job}",
                    f"--image={image}",
                    timeout=120,
                )
                assert status == 0, err
            status, err, out = ask_daemon(
                run / "daemon.sock",
                "--config",
                str(cfg),
                "step-prepare",
                "--job=7",
                "--step=0",
                "--uid=65534",
                "--image=secretive:1",
                "--local-tasks=2",
                "--layout=SLURM_STEP_NODELIST=n1",
                "--layout=SLURM_STEP_TASKS_PER_NODE=2",
                "--layout=SLURM_JOB_ID=7",
                "--layout=SLURM_STEP_ID=0",
            )
            assert status == 0, err
        for job in ("7", "8"):
            ask_daemon(run / "daemon.sock", "tfimage-epilog", f"--config={cfg}", f"--job={job}")
        daemon_log = (tmp_path / "node" / "daemon.log").read_text()
    tokens = token_service.issued[issued:]
    assert tokens  # the pull did go through the token flow
    execs = trace.read_text()
    assert "skopeo" in execs and "umoci" in execs  # the conversion ran, traced
    job_env = out.decode()  # the argv prefix and every task's variables
    assert "TF_CONFIG" in job_env
    hooks_log = (tmp_path / "hooks.log").read_text()
    assert "job 7: " in hooks_log and "pulled from" in hooks_log
    assert "job 8: docker://" in hooks_log and "pulled from" in hooks_log.split("job 8: ")[1]
    for where, text in [
        ("hooks.log", hooks_log),
        ("daemon log", daemon_log),
        ("step-prepare's answer", job_env + err),
        ("an execve's argv or environment", execs),
    ]:
        secrets = [token_registry.password, *tokens]
        assert not _secrets_in(text, secrets, [token_registry.username]), f"a secret in {where}"


def test_the_secret_search_finds_each_form_it_looks_for() -> None:
    """The oracle above, shown to see a secret in each form it claims to."""
    pw, users = "s3cret-pass", ["robot$x"]
    basic = base64.b64encode(b"robot$x:" + pw.encode()).decode()
    assert _secrets_in(f'execve("/bin/x", ["x", "{pw}"])', [pw], users)
    assert _secrets_in(f'"AUTH=Basic {basic}"', [pw], users)
    assert _secrets_in(base64.b64encode(pw.encode()).decode(), [pw], users)
    assert not _secrets_in("nothing here", [pw], users)


# --- tfimage-hook and the daemon: never a second run, never a worker past its time ----


def test_tfimage_hook_never_runs_a_hook_the_daemon_took_a_second_time(
    tmp_path: Path, hook_binary: Path
) -> None:
    marker = tmp_path / "ran"
    program = tmp_path / "hook.sh"
    program.write_text(f"#!/bin/sh\ntouch {marker}\n")
    program.chmod(0o755)
    sock_path = tmp_path / "daemon.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sock_path))
    server.listen(1)

    def take_and_die() -> None:  # a daemon whose worker died: the request taken, no answer
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)

    taker = threading.Thread(target=take_and_die, daemon=True)
    taker.start()
    try:
        r = subprocess.run(
            [str(hook_binary), str(sock_path), "5", str(program), "--job=1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.close()
        taker.join(5)
    assert r.returncode == 0 and "not run again" in r.stderr, r.stderr
    assert not marker.exists()
    # With no daemon listening at all, the hook runs itself.
    sock_path.unlink()
    r = subprocess.run(
        [str(hook_binary), str(sock_path), "5", str(program)], capture_output=True, timeout=60
    )
    assert r.returncode == 0 and marker.exists()


ROUTED_DAEMON = """
import subprocess, sys, time
from pathlib import Path
from tfimage.agent.core import wire
from tfimage.agent.core.config import load_config
from tfimage.agent.daemon.server import serve
from tfimage.agent.daemon.worker import CLI

def hang(argv):
    subprocess.Popen(["sleep", sys.argv[3]])  # a tool it started, to be killed with it
    time.sleep(600)
    return 0

def bug(argv):
    raise RuntimeError("a bug in the daemon's route")

serve(Path(sys.argv[1]), load_config(sys.argv[2]),
      {CLI: bug, "tfimage-prolog": hang, "tfimage-epilog": bug}, None)
"""


def test_the_daemon_ends_a_worker_past_its_time_and_never_fails_a_hook(tmp_path: Path) -> None:
    cfg = hook_site(tmp_path, hook_deadline=1)
    run = Path(f"/run/tfimage-test-routes-{os.getpid()}")
    run.mkdir(mode=0o755)
    sleep_for = str(3000 + os.getpid() % 1000)  # a sleep only this test starts
    log = tmp_path / "daemon.log"
    daemon = subprocess.Popen(
        [sys.executable, "-c", ROUTED_DAEMON, str(run / "daemon.sock"), str(cfg), sleep_for],
        stderr=log.open("w"),
    )
    try:
        for _ in range(100):
            if "listening" in log.read_text():
                break
            time.sleep(0.05)
        # A route that fails is the daemon's fault: a hook still answers 0, a
        # step-prepare 70 (the plugin reports it; no node is drained).
        status, err, _ = ask_daemon(run / "daemon.sock", "tfimage-epilog", "--job=1")
        assert status == 0 and "a bug in the daemon's route" in err
        status, err, _ = ask_daemon(run / "daemon.sock", "step-prepare", "--job=1")
        assert status == 70 and "a bug in the daemon's route" in err
        # A hook that ignores its deadline (1 s) is killed at two thirds of the grace
        # beyond it, with the tool it started, before its client stops waiting.
        started = time.monotonic()
        with pytest.raises(struct.error):  # closed without an answer
            ask_daemon(run / "daemon.sock", "tfimage-prolog", "--job=1", timeout=60)
        took = time.monotonic() - started
        assert 1 + wire.HOOK_GRACE * 2 / 3 <= took < 1 + wire.HOOK_GRACE, took
        for _ in range(50):
            if not subprocess.run(
                ["pgrep", "-f", f"^sleep {sleep_for}$"], capture_output=True
            ).stdout:
                break
            time.sleep(0.1)
        assert not subprocess.run(
            ["pgrep", "-f", f"^sleep {sleep_for}$"], capture_output=True
        ).stdout
    finally:
        daemon.kill()
        daemon.wait()
        shutil.rmtree(run, ignore_errors=True)


@pytest.mark.parametrize(("node", "served_by"), [("n2", "rack"), ("n9", "registry")])
def test_the_prolog_asks_the_rack_mirror_of_the_node_slurm_names(
    tls: Path,
    tmp_path: Path,
    make_sif: Callable[[dict[str, str]], Path],
    node: str,
    served_by: str,
) -> None:
    registry, rack = Server(tls), Server(tls)
    try:
        blob = make_sif({"etc/marker": node}).read_bytes()
        registry.serve(blob)
        rack.serve(blob)
        cfg = hook_site(
            tmp_path,
            registry=registry.host,
            ca_bundle=tls / "ca.crt",
            credentials=tmp_path / "none.yaml",
            rack_mirrors={"n[1-2]": [rack.host]},
            pull_jitter=0.2,
        )
        argv = [f"--config={cfg}", "--job=7", "--image=x:1", f"--node={node}", "--nodes=n[2,9]"]
        assert prolog(argv) == 0
    finally:
        registry.httpd.shutdown()
        rack.httpd.shutdown()
        # The image's shared mount outlives the job (the node's prune takes it).
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split()[4] for line in f]
        for target in mounts:
            if target.startswith(f"{tmp_path}/"):
                subprocess.run(["umount", "-l", target], check=False)
    host = rack.host if served_by == "rack" else registry.host
    assert any(f" pulled from {host} in " in line for line in _log(tmp_path)), _log(tmp_path)
    assert (rack.b.seen != []) == (served_by == "rack")

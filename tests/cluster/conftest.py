"""The cluster tier: real jobs on the local cluster that `make cluster-up` starts.

Without a cluster these tests skip and say why; CI sets TFIMAGE_REQUIRE_CLUSTER=1
so a missing cluster is a failure there, never a silent pass.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hostile import Server

from support import Registry
from support import busybox_sif as busybox_sif  # the cluster tests import it from here

REPO = Path(__file__).resolve().parents[2]
# A job's states once it has ended (Slurm's IS_JOB_FINISHED), as scontrol names them.
FINISHED = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
    }
)
ENV_FILE = REPO / "build" / "cluster.env"


@dataclass(frozen=True)
class Cluster:
    env: dict[str, str]
    user: str
    state: Path
    # The other Slurm generation's tree (SLURM_FLAVOR=other): its clients run there.
    chroot: str = ""

    def run(
        self,
        argv: list[str],
        *,
        cwd: Path | None = None,
        timeout: float = 120,
        as_root: bool = False,
        extra_env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command, as the test user unless ``as_root``."""
        env = {**self.env, **(extra_env or {})}
        kw: dict[str, object] = {}
        pw = pwd.getpwnam(self.user)
        if not as_root:
            env.update(HOME=pw.pw_dir, USER=self.user, LOGNAME=self.user)
        if cwd is not None:
            env["PWD"] = str(cwd)  # as a shell would
        if self.chroot:
            # chroot needs root; it then becomes the user, and env -C enters cwd there.
            user = [] if as_root else [f"--userspec={pw.pw_uid}:{pw.pw_gid}", "--groups="]
            argv = ["/usr/sbin/chroot", *user, self.chroot, "env", "-C", str(cwd or "/"), *argv]
            cwd = None
        elif not as_root:
            kw = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        return subprocess.run(  # type: ignore[call-overload, no-any-return]
            argv,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            **kw,
        )

    def start(self, argv: list[str], cwd: Path) -> subprocess.Popen[str]:
        """``argv`` as the test user, in the background, its stdout and stderr piped
        (see run)."""
        pw = pwd.getpwnam(self.user)
        env = {**self.env, "HOME": pw.pw_dir, "USER": self.user, "LOGNAME": self.user}
        env["PWD"] = str(cwd)
        kw: dict[str, object] = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        if self.chroot:
            user = [f"--userspec={pw.pw_uid}:{pw.pw_gid}", "--groups="]
            argv = ["/usr/sbin/chroot", *user, self.chroot, "env", "-C", str(cwd), *argv]
            kw = {}
        return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
            argv,
            cwd=None if self.chroot else cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **kw,
        )

    def sbatch(
        self, workdir: Path, name: str, script: str, out: str, timeout: float = 180
    ) -> tuple[subprocess.CompletedProcess[str], str]:
        """Write ``script`` as the user, submit it from ``workdir`` and wait for its
        end (``sbatch_wait``), and return the result and the job's output file ``out``."""
        write_script(workdir, name, script, self.user)
        r, _ = self.sbatch_wait(workdir, name, timeout=timeout)
        path = workdir / out
        return r, path.read_text() if path.exists() else ""

    def sbatch_wait(
        self, workdir: Path, *args: str, timeout: float = 180
    ) -> tuple[subprocess.CompletedProcess[str], str]:
        """``sbatch --parsable ARGS`` as the user from ``workdir``, then the job's end
        as ``sbatch --wait`` gives it: sbatch's own output, and as its status the
        job's exit code (1 where a signal ended it); and the job's id ("" if the
        submission failed).  ``sbatch --wait`` sleeps 2, 8, then 32 s between looks,
        so a job of 3 s took 10 s and one of 11 s took 42; this looks every 0.2 s,
        and waits for the epilog too (COMPLETING is not the end here)."""
        deadline = time.monotonic() + timeout
        r = self.run(["sbatch", "--parsable", *args], cwd=workdir, timeout=timeout)
        if r.returncode != 0:
            return r, ""
        job = r.stdout.strip().split(";")[0]
        while True:
            shown = self.run(["scontrol", "-o", "show", "job", job], as_root=True).stdout
            state = re.search(r"\bJobState=(\S+)", shown)
            if state and state[1] in FINISHED:
                code = re.search(r"\bExitCode=(\d+):(\d+)", shown)
                assert code, shown
                status = int(code[1]) if code[2] == "0" else 1
                return subprocess.CompletedProcess(r.args, status, r.stdout, r.stderr), job
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(r.args, timeout, shown)
            time.sleep(0.2)

    def submit(self, workdir: Path, *args: str) -> str:
        """``sbatch --parsable ARGS`` as the user from ``workdir``; the job's id."""
        r = self.run(["sbatch", "--parsable", *args], cwd=workdir)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().split(";")[0]

    def node_pid(self, node: str) -> int:
        return int((self.state / "run" / f"slurmd-{node}.pid").read_text())

    def on_node(
        self, node: str, argv: list[str], timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as root inside the node's namespaces (its /opt, /etc, network),
        with what its daemons have (the fake GPUs' NVML library)."""
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "SLURM_CONF": self.env["SLURM_CONF"],
            "TFIMAGE_CONFIG": self.env["TFIMAGE_CONFIG"],
            "LD_LIBRARY_PATH": str(self.state / "gpu" / "lib"),
        }
        pid = str(self.node_pid(node))
        return subprocess.run(
            ["nsenter", "-t", pid, "-m", "-u", "-n", "--", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    def hooks_log(self, node: str) -> list[str]:
        """The node's hook log, a line each (it outlives the cluster: job ids repeat)."""
        path = self.state / "nodes" / node / "log" / "hooks.log"
        return path.read_text().splitlines() if path.exists() else []

    @contextlib.contextmanager
    def config_with(self, **changes: object) -> Iterator[None]:
        """Every node's and the login node's config with ``changes``, put back after
        (same inode, size and mtime: its compiled form is valid again).  A change to
        None removes the key."""
        path = Path(self.env["TFIMAGE_CONFIG"])
        text, st = path.read_text(), path.stat()
        cfg = yaml.safe_load(text)
        cfg.update(changes)
        for key in [k for k, v in changes.items() if v is None]:
            del cfg[key]
        path.write_text(yaml.safe_dump(cfg))
        daemon = ["bash", str(REPO / "deploy/local/cluster.sh"), "daemon", "login"]
        try:
            subprocess.run(daemon, check=True, timeout=60)  # the pin server reads it at start
            yield
        finally:
            path.write_text(text)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            subprocess.run(daemon, check=True, timeout=60)

    def node_mounts(self, node: str) -> list[str]:
        """Mount points as seen inside the node's own mount namespace."""
        with open(f"/proc/{self.node_pid(node)}/mountinfo") as f:
            return [line.split()[4] for line in f]

    def job_mounts(self, node: str, job: str) -> dict[str, tuple[str, set[str]]]:
        """{mount point: (fstype, options)} of what ``job`` has mounted on ``node``: its
        own (step roots, a private image) and the shared image mounts its roots lie on."""
        found: dict[str, tuple[str, set[str]]] = {}
        lower: set[str] = set()
        every: dict[str, tuple[str, set[str]]] = {}
        with open(f"/proc/{self.node_pid(node)}/mountinfo") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                target, fstype = fields[4], fields[sep + 1]
                every[target] = (fstype, set(fields[5].split(",")))
                if target.startswith(f"/run/tfimage/jobs/{job}/"):
                    found[target] = every[target]
                    for opt in fields[sep + 3].split(","):
                        if opt.startswith("lowerdir="):
                            lower.update(opt.removeprefix("lowerdir=").split(":"))
        found.update({t: every[t] for t in lower if t.startswith("/run/tfimage/images/")})
        return found

    def node_state(self, node: str) -> str:
        """The node's state once a finished job has left it (30 s at most)."""
        for _ in range(150):
            r = self.run(["sinfo", "-h", "-n", node, "-o", "%T"], as_root=True, timeout=30)
            if r.stdout.strip() != "completing":
                break
            time.sleep(0.2)
        return r.stdout.strip()

    def assert_never_drained(self, node: str) -> None:
        """Any state that still takes jobs passes: idle or mixed, and also 24.11's
        "planned" (idle, with a pending job's start planned there by backfill)."""
        state = self.node_state(node)
        unhealthy = ("drain", "down", "fail", "not_responding", "unknown")
        assert state and not any(word in state for word in unhealthy), f"{node} is {state!r}"

    def job_ids(self) -> set[str]:
        r = self.run(["squeue", "-h", "-a", "--states=all", "-o", "%i"], as_root=True)
        return set(r.stdout.split())


def _load_env() -> dict[str, str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    for line in ENV_FILE.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            k, v = line[len("export ") :].split("=", 1)
            env[k] = v.replace("$PATH", env["PATH"])
    return env


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    if not ENV_FILE.exists():
        msg = f"no local cluster ({ENV_FILE} missing): run `make cluster-up` as root"
        if os.environ.get("TFIMAGE_REQUIRE_CLUSTER") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    if os.geteuid() != 0:
        pytest.skip("the cluster tier runs as root (it submits as the test user)")
    env = _load_env()
    c = Cluster(
        env,
        env["TFIMAGE_TEST_USER"],
        Path(env["TFIMAGE_LOCAL_STATE"]),
        env.get("TFIMAGE_CHROOT", ""),
    )
    ping = c.run(["scontrol", "ping"], as_root=True, timeout=30)
    if "UP" not in ping.stdout:
        pytest.fail(f"slurmctld is not answering: {ping.stdout}{ping.stderr}")
    return c


def home_dir(user: str) -> Iterator[Path]:
    """A fresh directory in ``user``'s home, theirs (not under /tmp, which ch-run
    binds), removed after."""
    pw = pwd.getpwnam(user)
    d = Path(pw.pw_dir) / "tfimage-tests" / uuid.uuid4().hex[:10]
    d.mkdir(parents=True)
    os.chown(d.parent, pw.pw_uid, pw.pw_gid)
    os.chown(d, pw.pw_uid, pw.pw_gid)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def workdir(cluster: Cluster) -> Iterator[Path]:
    """A fresh directory in the test user's home."""
    yield from home_dir(cluster.user)


def site_registry(cluster: Cluster) -> Registry:
    """The cluster's registry with its robot's credentials, to push OCI images with
    skopeo (skipped, saying why, where umoci, skopeo or busybox is missing)."""
    for tool in ("umoci", "skopeo", "busybox"):
        if not shutil.which(tool):
            pytest.skip(f"needs {tool} (deploy/local/packages.sh installs it)")
    site = yaml.safe_load(Path(cluster.env["TFIMAGE_CONFIG"]).read_text())
    creds = yaml.safe_load(Path(site["credentials"]).read_text())["registries"][site["registry"]]
    return Registry(site["registry"], Path(site["ca_bundle"]), creds["username"], creds["password"])


def write_script(d: Path, name: str, text: str, user: str) -> Path:
    p = d / name
    p.write_text(text)
    pw = pwd.getpwnam(user)
    os.chown(p, pw.pw_uid, pw.pw_gid)
    return p


def push(cluster: Cluster, sif: Path, ref: str) -> str:
    """Push from the machine itself (as an admin would), whatever Slurm flavor is up."""
    r = tfimage_here(cluster, "push", str(sif), ref)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().rsplit("@", 1)[1]


def tfimage_here(
    cluster: Cluster, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """The installed ``tfimage ARGS`` on this machine (the login and controller host),
    with the cluster's config."""
    return subprocess.run(
        ["/opt/tfimage/bin/tfimage", *args],
        env={**cluster.env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def daemon_pid(cluster: Cluster, node: str) -> int | None:
    """The pid of the tfimage daemon in ``node``'s mount namespace, if one runs."""
    ns = os.readlink(f"/proc/{cluster.node_pid(node)}/ns/mnt")
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
            ours = b"daemon" in cmd and any(c.endswith(b"/tfimage") for c in cmd)
            if ours and os.readlink(p / "ns" / "mnt") == ns:
                return int(p.name)
        except OSError:
            continue
    return None


@contextlib.contextmanager
def bridge_server(cluster: Cluster, tmp_path: Path) -> Iterator[Server]:
    """A hostile registry (tests/hostile.py) on the cluster's bridge, with a
    certificate from the cluster's CA: the nodes trust it as they trust the real one."""
    pki = cluster.state / "pki"
    addr = cluster.env["TFIMAGE_REGISTRY"].split(":")[0]
    (tmp_path / "ext.cnf").write_text(f"subjectAltName=IP:{addr}\nextendedKeyUsage=serverAuth\n")
    key, csr, crt = (str(tmp_path / n) for n in ("srv.key", "srv.csr", "srv.crt"))
    ca = ["-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"), "-CAcreateserial"]
    for argv in (
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=t", "-keyout", key, "-out", csr],
        ["x509", "-req", "-in", csr, *ca, "-extfile", str(tmp_path / "ext.cnf"), "-out", crt],
    ):
        subprocess.run(["openssl", *argv], check=True, capture_output=True, timeout=60)
    server = Server(tmp_path, address=addr)
    try:
        yield server
    finally:
        server.httpd.shutdown()

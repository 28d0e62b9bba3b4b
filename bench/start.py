"""start: what a TensorFlow user feels between "job started" and "training started":
`import tensorflow` inside the image, as the test user with ch-run, with the image
mounted by each of tfimage's drivers against the same tree unpacked in a directory
(the limit), warm and cold (page cache dropped), 1 task and 4 at once.  Interleaved
rounds, medians.  Goals (issue 16): the default driver's and kernel's warm import
<= 1.1x the directory, kernel's cold <= 1.2x; 4 concurrent tasks <= 1.3x one task.

What bounds a FUSE driver here, measured in the same run: a warm import still makes
~10,000 FUSE requests (open, release, ioctl, opendir, readdir: squashfuse 0.1.x
caches none of them in the kernel), each a round trip to squashfuse_ll's one
thread.  Across two CPUs of this VM a round trip costs ~50 us more than on one (an
idle vCPU halts and is woken through the hypervisor: haltpoll's guest_halt_poll_ns
is 0), so the bench counts the requests (strace on the FUSE process, an untimed
import), times a pipe round trip on one CPU and across two, and imports once more
with the task and the FUSE process on one CPU against the directory on that CPU:
the driver's cost without this machine's wakeups.

Needs root, the test user, charliecloud, strace, taskset, CPUs 0 and 1, and
build/images/tf-custom.sif (made by
`make cluster-up` or `make images`); no cluster.  The launch overhead of --tf-image
is `bench/run.py launch` (it needs the cluster).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIF = REPO / "build" / "images" / "tf-custom.sif"
USER = os.environ.get("TFIMAGE_TEST_USER", "tfuser")
DRIVERS = ("directory", "kernel", "squashfuse_ll", "squashfuse")


def _offset(sif: Path) -> int:
    from tfimage.agent.core.sif import root_partition

    with sif.open("rb") as f:
        return root_partition(f, sif.stat().st_size).offset


def _mount(driver: str, sif: Path, offset: int, target: Path) -> None:
    opts = f"ro,nosuid,nodev,offset={offset}"
    if driver == "kernel":
        argv = ["mount", "-t", "squashfs", "-o", f"{opts},loop", str(sif), str(target)]
    else:
        argv = [driver, "-o", f"{opts},allow_other", str(sif), str(target)]
    subprocess.run(argv, check=True, timeout=60)


def _import(root: Path, cpu: int | None = None) -> float:
    pw = pwd.getpwnam(USER)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "USER": USER, "HOME": "/tmp", "LANG": "C.UTF-8"}
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    t = time.perf_counter()
    subprocess.run(
        [*pin, "ch-run", "--no-passwd", str(root), "--", "python3", "-c", "import tensorflow"],
        check=True, capture_output=True, timeout=600, env=env, cwd="/tmp",
        user=pw.pw_uid, group=pw.pw_gid, extra_groups=[],
    )  # fmt: skip
    return time.perf_counter() - t


def _fuse_pid(target: Path) -> int:
    """The FUSE process serving the mount at ``target`` (its command line names it)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(target).encode() in argv and argv[0].endswith(b"squashfuse_ll"):
                return int(proc.name)
    raise SystemExit(f"bench start: no squashfuse_ll process serves {target}")


def _fuse_requests(root: Path, pid: int) -> int:
    """FUSE requests one warm import makes: the replies the FUSE process writes
    (strace -c on it during an untimed import; FORGETs get no reply, so a few
    are not counted)."""
    with tempfile.NamedTemporaryFile("r", prefix="tfimage-bench-strace-") as out:
        tracer = subprocess.Popen(["strace", "-c", "-f", "-e", "trace=writev", "-o", out.name,
                                   "-p", str(pid)], stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            time.sleep(0.5)  # attached
            _import(root)
        finally:  # never left attached to the FUSE process
            tracer.send_signal(signal.SIGINT)
            try:
                tracer.wait(timeout=60)
            except subprocess.TimeoutExpired:
                tracer.kill()
                tracer.wait()
        for line in out.read().splitlines():
            if line.rstrip().endswith("writev"):
                return int(line.split()[3])
    raise SystemExit("bench start: strace counted no FUSE replies")


def _pin_all(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (a multithreaded FUSE process too)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cpus)


def _round_trip_us(cpu_a: int, cpu_b: int, n: int = 20000) -> float:
    """One pipe round trip between two processes on ``cpu_a`` and ``cpu_b``, in us:
    what a FUSE request costs at the least (a wakeup each way)."""
    a_r, b_w = os.pipe()
    b_r, a_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(b_w)
            os.close(b_r)
            os.sched_setaffinity(0, {cpu_b})
            for _ in range(n):
                os.read(a_r, 1)
                os.write(a_w, b"x")
            status = 0
        finally:  # never back into the bench's own code (its cleanup is the parent's)
            os._exit(status)
    os.close(a_r)
    os.close(a_w)
    mask = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu_a})
        time.sleep(0.05)
        t = time.perf_counter()
        for _ in range(n):
            os.write(b_w, b"x")
            if not os.read(b_r, 1):
                raise SystemExit("bench start: the round-trip child ended early")
        took = time.perf_counter() - t
    finally:
        os.sched_setaffinity(0, mask)
        os.close(b_w)
        os.close(b_r)
        os.waitpid(pid, 0)
    return took / n * 1e6


def _halt_poll() -> str:
    p = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    return f"guest_halt_poll_ns={p.read_text().strip()}" if p.exists() else "no haltpoll"


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main(runs: int) -> None:
    default = "squashfuse_ll"
    if os.geteuid() != 0:
        sys.exit("bench start: run as root")
    if not SIF.exists():
        sys.exit(f"bench start: {SIF} missing; run `make images` first")
    for tool in ("ch-run", "strace", "taskset", *DRIVERS[2:]):
        if not shutil.which(tool):
            sys.exit(f"bench start: {tool} is not installed (deploy/local/packages.sh)")
    if not {0, 1} <= os.sched_getaffinity(0):
        sys.exit("bench start: needs CPUs 0 and 1 (the round trip across two CPUs)")
    offset = _offset(SIF)
    with tempfile.TemporaryDirectory(prefix="tfimage-bench-start-") as d:
        base = Path(d)
        os.chmod(base, 0o755)  # noqa: S103 - the test user walks to the mounts
        roots: dict[str, Path] = {}
        try:
            for driver in DRIVERS[1:]:
                roots[driver] = base / driver
                roots[driver].mkdir()
                _mount(driver, SIF, offset, roots[driver])
            unpacked = base / "directory"
            subprocess.run(["cp", "-a", f"{roots['squashfuse_ll']}/.", str(unpacked)], check=True,
                           timeout=1200)  # fmt: skip
            roots = {"directory": unpacked, **roots}
            for root in roots.values():
                _import(root)  # warm every one once, untimed
            warm: dict[str, list[float]] = {k: [] for k in roots}
            cold: dict[str, list[float]] = {k: [] for k in roots if k != "directory"}
            four: dict[str, list[float]] = {k: [] for k in roots}
            fuse = _fuse_pid(roots[default])
            requests = _fuse_requests(roots[default], fuse)
            one_cpu: dict[str, list[float]] = {"directory": [], default: []}
            for _ in range(runs):  # interleaved: drift hits every driver alike
                for name, root in roots.items():
                    warm[name].append(_import(root))
                    with ThreadPoolExecutor(4) as pool:
                        four[name].append(max(pool.map(_import, [root] * 4)))
                # The task (and the FUSE process) on CPU 0: no cross-CPU wakeups.
                one_cpu["directory"].append(_import(roots["directory"], cpu=0))
                mask = os.sched_getaffinity(fuse)
                _pin_all(fuse, {0})
                try:
                    one_cpu[default].append(_import(roots[default], cpu=0))
                finally:
                    _pin_all(fuse, mask)
                for name in cold:
                    _drop_caches()
                    cold[name].append(_import(roots[name]))
            trips = {k: statistics.median(_round_trip_us(0, cpu) for _ in range(3))
                     for k, cpu in (("one", 0), ("two", 1))}  # fmt: skip
        finally:
            for driver in DRIVERS[1:]:
                if driver in roots:
                    subprocess.run(["umount", str(roots[driver])], check=False, timeout=60)
            shutil.rmtree(base / "directory", ignore_errors=True)
    lim = statistics.median(warm["directory"])
    cold_kernel = statistics.median(cold["kernel"])
    print(f"start: `import tensorflow` in tf-custom:2.0 as {USER} with ch-run; median of {runs}")
    print(f"  {'mounted with':<14} {'warm':>7} {'x dir':>6} {'cold':>7} {'x kernel':>9}"
          f" {'4 at once':>10} {'x 1 task':>9}")  # fmt: skip
    for name in roots:
        w, f4 = statistics.median(warm[name]), statistics.median(four[name])
        c = statistics.median(cold[name]) if name in cold else None
        cold_txt = f"{c:6.2f}s {c / cold_kernel:8.2f}x" if c else f"{'-':>7} {'-':>9}"
        print(f"  {name:<14} {w:6.2f}s {w / lim:5.2f}x {cold_txt} {f4:9.2f}s {f4 / w:8.2f}x")
    # The machine's bound for FUSE (the module's docstring).
    lim1, ll1 = (statistics.median(one_cpu[k]) for k in ("directory", default))
    extra = requests * (trips["two"] - trips["one"]) / 1e6
    warm_ll = statistics.median(warm[default])
    print(f"start: bound: a warm import makes {requests} FUSE requests; a round trip "
          f"costs {trips['one']:.0f} us on one CPU, {trips['two']:.0f} us across two "
          f"({_halt_poll()})")  # fmt: skip
    print(f"  so ~{extra:.2f} s of {default}'s {warm_ll - lim:.2f} s over the directory "
          f"are this machine's cross-CPU wakeups")  # fmt: skip
    print(f"  task and FUSE process on CPU 0: directory {lim1:.2f}s, {default} {ll1:.2f}s "
          f"= {ll1 / lim1:.2f}x")  # fmt: skip
    goals = [
        ("kernel warm <= 1.1x directory", statistics.median(warm["kernel"]) / lim <= 1.1),
        (f"{default} warm <= 1.1x directory", statistics.median(warm[default]) / lim <= 1.1),
        (f"{default} warm <= 1.1x directory, no cross-CPU wakeups (bound)", ll1 / lim1 <= 1.1),
        ("4 tasks <= 1.3x one (default)",
         statistics.median(four[default]) / statistics.median(warm[default]) <= 1.3),
    ]  # fmt: skip
    for text, met in goals:
        print(f"start: {text} -> {'MET' if met else 'NOT MET'}")
    print(f"start: {os.cpu_count()} CPUs here: 4 concurrent imports share them")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)

"""start: what a TensorFlow user feels between "job started" and "training started":
`import tensorflow` inside the image, as the test user with ch-run, with the image
mounted by each of tfimage's drivers against the same tree unpacked in a directory
(the limit), warm and cold (page cache dropped), 1 task and 4 at once.  Interleaved
rounds, medians.  Goals (issue 16): the default driver's and kernel's warm import
<= 1.1x the directory, kernel's cold <= 1.2x; 4 concurrent tasks <= 1.3x one task.

Needs root, the test user, charliecloud and build/images/tf-custom.sif (made by
`make cluster-up` or `make images`); no cluster.  The launch overhead of --tf-image
is `bench/run.py launch` (it needs the cluster).
"""

from __future__ import annotations

import os
import pwd
import shutil
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
    from tfimage.agent.sif import root_partition

    with sif.open("rb") as f:
        return root_partition(f, sif.stat().st_size).offset


def _mount(driver: str, sif: Path, offset: int, target: Path) -> None:
    opts = f"ro,nosuid,nodev,offset={offset}"
    if driver == "kernel":
        argv = ["mount", "-t", "squashfs", "-o", f"{opts},loop", str(sif), str(target)]
    else:
        argv = [driver, "-o", f"{opts},allow_other", str(sif), str(target)]
    subprocess.run(argv, check=True, timeout=60)


def _import(root: Path) -> float:
    pw = pwd.getpwnam(USER)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "USER": USER, "HOME": "/tmp", "LANG": "C.UTF-8"}
    t = time.perf_counter()
    subprocess.run(
        ["ch-run", "--no-passwd", str(root), "--", "python3", "-c", "import tensorflow"],
        check=True, capture_output=True, timeout=600, env=env, cwd="/tmp",
        user=pw.pw_uid, group=pw.pw_gid, extra_groups=[],
    )  # fmt: skip
    return time.perf_counter() - t


def _drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main(runs: int) -> None:
    if os.geteuid() != 0:
        sys.exit("bench start: run as root")
    if not SIF.exists():
        sys.exit(f"bench start: {SIF} missing; run `make images` first")
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
            for _ in range(runs):  # interleaved: drift hits every driver alike
                for name, root in roots.items():
                    warm[name].append(_import(root))
                    with ThreadPoolExecutor(4) as pool:
                        four[name].append(max(pool.map(_import, [root] * 4)))
                for name in cold:
                    _drop_caches()
                    cold[name].append(_import(roots[name]))
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
    default = "squashfuse_ll"
    goals = [
        ("kernel warm <= 1.1x directory", statistics.median(warm["kernel"]) / lim <= 1.1),
        (f"{default} warm <= 1.1x directory", statistics.median(warm[default]) / lim <= 1.1),
        ("4 tasks <= 1.3x one (default)",
         statistics.median(four[default]) / statistics.median(warm[default]) <= 1.3),
    ]  # fmt: skip
    for text, met in goals:
        print(f"start: {text} -> {'MET' if met else 'NOT MET'}")
    print(f"start: {os.cpu_count()} CPUs here: 4 concurrent imports share them")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)

"""The GPU smoke check on a real GPU machine (``bench/gpu-smoke`` installs what it
needs, then runs this as root).  In one go, each step timed:

1. ``tfimage gpu check`` on every GPU: findings as an operator sees them;
2. the prolog's gate on every GPU as job 1 (the baseline it keeps);
3. a short load on each GPU through the driver alone (libcuda: a context, 1 GiB,
   memsets for ``--load`` seconds), then the same readings again: the energy each
   GPU used, in J, as the usage record will compute it;
4. a charliecloud container with the host's driver bound in by tfimage
   (step/gpudriver.py) running a program that calls NVML inside: its GPU count and
   UUIDs must be the host's.

``--fake DIR``: the fake libnvidia-ml.so.1 in DIR stands in for the driver (no load
step: the fake has no libcuda); the unit suite runs it so that this script does
not rot between GPU machines.  Exit 0 when every step passed.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from gpus import nvmlcount_rootfs  # noqa: E402  (the image the unit test builds too)

JOB = "1"


def step(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **kw: Any) -> Any:
            started = time.monotonic()
            try:
                out = fn(*a, **kw)
            except Exception as e:
                print(f"gpu-smoke: {name}: FAILED: {e}", flush=True)
                raise SystemExit(1) from None
            print(f"gpu-smoke: {name}: ok ({(time.monotonic() - started) * 1000:.0f} ms)")
            return out

        return run

    return wrap


def _tfimage(cfg: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tfimage.main", "--config", str(cfg), *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@step("1 gpu check")
def check(cfg: Path, env: dict[str, str]) -> list[str]:
    r = _tfimage(cfg, "gpu", "check", "--json", env=env)
    if r.returncode not in (0, 1, 2) or not r.stdout.strip():
        raise RuntimeError(f"exit {r.returncode}: {r.stderr.strip()[-300:]}")
    doc = json.loads(r.stdout)
    print(f"gpu-smoke:   driver {doc['driver']}, {len(doc['gpus'])} GPU(s), {doc['status']}")
    for f in doc["findings"]:
        print(f"gpu-smoke:   {f['severity']:8} {f['gpu']} {f['check']}: {f['cause']}")
    if not doc["gpus"]:
        raise RuntimeError("NVML shows no GPU")
    return [g["uuid"] for g in doc["gpus"]]


@step("2 prolog gate and baseline")
def baseline(cfg: Path, state: Path, n: int, env: dict[str, str]) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "tfimage.prolog.main", f"--config={cfg}", f"--job={JOB}",
         f"--node={os.uname().nodename.split('.')[0]}", "--gpus=" + ",".join(map(str, range(n)))],
        env={**env, "SLURM_CONF": "/dev/null"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    log = (state / "hooks.log").read_text() if (state / "hooks.log").exists() else ""
    for line in log.splitlines()[-3:]:
        print(f"gpu-smoke:   {line.split(' ', 2)[-1]}")
    if r.returncode != 0:
        raise RuntimeError(f"the prolog failed (a drain-class finding?): exit {r.returncode}")
    doc: dict[str, Any] = json.loads((state / "gpu" / "jobs" / f"{JOB}.json").read_text())
    return doc


def _cuda_load(index: int, seconds: float) -> None:
    """Memsets over 1 GiB on one GPU for ``seconds``, through libcuda alone."""
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()

    def ok(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what}: CUDA error {code}")

    ok(cuda.cuInit(0), "cuInit")
    ok(cuda.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    ok(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
    size = 1 << 30
    ok(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)), "cuMemAlloc")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(50):
            ok(
                cuda.cuMemsetD32_v2(ptr, ctypes.c_uint(0xDEADBEEF), ctypes.c_size_t(size // 4)),
                "memset",
            )
        ok(cuda.cuCtxSynchronize(), "cuCtxSynchronize")
    cuda.cuMemFree_v2(ptr)
    cuda.cuCtxDestroy_v2(ctx)


@step("3 load and energy delta")
def energy(cfg: Path, base: dict[str, Any], seconds: float, fake: str | None) -> None:
    from tfimage.agent.core.config import load_config
    from tfimage.agent.gpu.gate import check as gate_check

    if fake:
        # No libcuda to load a fake GPU with: its counter moves by i+1 J instead.
        state = Path(fake) / "state.json"
        doc = json.loads(state.read_text())
        for i, d in enumerate(doc["devices"]):
            d["energy_mj"] = d.get("energy_mj", 0) + 1000 * (i + 1)
        state.write_text(json.dumps(doc))
        print("gpu-smoke:   (fake driver: no load; each GPU's counter moved by i+1 J)")
    else:
        n = len(base)
        for i in range(n):
            _cuda_load(i, seconds / n)
    got = gate_check(load_config(str(cfg)), (), expect_idle=False)
    for r in got.gpus:
        before = base.get(r.uuid, {}).get("energy_mj")
        after = r.values.get("energy_mj")
        if before is None or after is None:
            print(f"gpu-smoke:   gpu{r.index} {r.uuid}: energy not reported")
            continue
        print(f"gpu-smoke:   gpu{r.index} {r.uuid}: {(after - before) / 1000:.1f} J")


def _image(work: Path, fake_state: Path | None, driver: tuple[str, ...]) -> Path:
    """A SIF with the NVML-calling program and the host libraries it links (and,
    with the fake driver, its state: the fake reads it inside the container)."""
    from tfimage.agent.core.sif import build_commands

    root = nvmlcount_rootfs(work / "rootfs", driver)
    if fake_state:
        shutil.copy(fake_state, root / "etc" / "nvml-state.json")
    sif = work / "smoke.sif"
    for argv in build_commands(root, work / "smoke.sqfs", sif):
        subprocess.run(argv, check=True, capture_output=True, timeout=300)
    return sif


@step("4 NVML inside a charliecloud container")
def container(
    work: Path, uuids: list[str], env: dict[str, str], libs: tuple[str, ...], fake: str | None
) -> None:
    from tfimage.agent.step import imagemount
    from tfimage.agent.step.gpudriver import LIB_DIR, driver_binds
    from tfimage.agent.step.runtime import Charliecloud, StepSpec

    binds = driver_binds(libs)
    libs_bound = tuple(b.src for b in binds if b.dst.startswith(LIB_DIR))
    sif = _image(work, Path(fake) / "state.json" if fake else None, libs_bound)
    inside = {"FAKE_NVML_STATE": "/etc/nvml-state.json"} if fake else {}
    state = work / "mounts"
    img = imagemount.mount_image(str(state), JOB, sif, "sha256:" + "5" * 64)
    try:
        print(f"gpu-smoke:   {len(binds)} driver file(s) bound, e.g. {binds[0].dst}")
        spec = StepSpec(workdir=None, home=None, gpus=True, driver=tuple(binds))
        ch = Charliecloud()
        root = imagemount.step_root(
            str(state), JOB, "0", img, [*ch.required_dirs, *spec.mountpoints()], spec.files()
        )
        r = subprocess.run(
            [*ch.prefix(root, spec), "/bin/nvmlcount"],
            env={**env, **inside, "PATH": "/usr/bin:/bin", "USER": "nobody",
                 "LD_LIBRARY_PATH": LIB_DIR},
            user=65534, group=65534, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        lines = r.stdout.split()
        print(f"gpu-smoke:   inside: {' '.join(lines[:3])}{' ...' if len(lines) > 3 else ''}")
        if r.returncode != 0 or lines[1:] != uuids or lines[0] != f"count={len(uuids)}":
            raise RuntimeError(f"expected the host's {len(uuids)} GPU(s): {r.stdout}{r.stderr}")
    finally:
        imagemount.release_job(str(state), JOB)
        imagemount.release_images(str(state), lambda digest: False)


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tfimage-gpu-smoke-", dir="/var/tmp"))
    d.chmod(0o755)  # the container's user reaches the bound files and the mounts
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=float, default=10.0, help="seconds of load in all (10)")
    ap.add_argument("--fake", metavar="DIR", help="the fake libnvidia-ml.so.1's directory")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("gpu-smoke: run as root (the prolog, the mounts)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    libs: tuple[str, ...] = ()
    if args.fake:
        env["LD_LIBRARY_PATH"] = args.fake
        os.environ["LD_LIBRARY_PATH"] = args.fake  # for the in-process readings' child
        libs = (str(Path(args.fake) / "libnvidia-ml.so.1"),)
    with workdir() as work:
        state = work / "state"
        cfg = work / "config.yaml"
        kmsg = str(work / "kmsg") if args.fake else "/dev/kmsg"
        if args.fake:
            Path(kmsg).touch()
        cfg.write_text(json.dumps({
            "state_dir": str(state), "hook_log": str(state / "hooks.log"),
            "cache_dir": str(work / "cache"), "gpu": {"kmsg": kmsg},
        }))  # fmt: skip
        started = time.monotonic()
        uuids = check(cfg, env)
        base = baseline(cfg, state, len(uuids), env)
        energy(cfg, base, args.load, args.fake)
        container(work, uuids, env, libs, args.fake)
    print(f"gpu-smoke: all passed in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

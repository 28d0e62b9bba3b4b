"""GPU gate benchmark: the full check of 8 (fake) GPUs, in process and as the prolog.

The gate reads NVML in a child process with a deadline (agent/gpu/child.py), so
three figures: the reading and judging in process (the child's own work), the
check with its child (what the prolog pays), and the prolog end to end.

The fake libnvidia-ml.so.1 (tests/fakenvml) answers from a JSON file, so what is
measured is tfimage's own cost plus nvidia-ml-py's ctypes calls, not a driver's.
Baselines from the same run: the same NVML reads done bare with pynvml (what any
health check must pay), and a bare ``python3 -c pass``.

With the local cluster up (``make cluster-up``: its registry), also the prolog end
to end as a job with a cached image and 8 GPUs sees it: the gate, the cache hit
on the pinned reference, the image's mount (released by the epilog, untimed).

Goals: the check < 100 ms in process; the prolog's GPU gate end to end < 500 ms, and
with a cached image < 500 ms.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from gpus import build_fake_nvml, node  # noqa: E402

IN_PROCESS = r"""
import json, statistics, sys, time
import pynvml
from tfimage.agent.core.config import config_from_mapping
from tfimage.agent.gpu.gate import check
from tfimage.agent.gpu.probe import Selection, probe
from tfimage.agent.gpu.verdict import judge
cfg = config_from_mapping(json.loads(sys.argv[1]))
runs = int(sys.argv[2])

def bare():
    pynvml.nvmlInit()
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        pynvml.nvmlDeviceGetUUID(h); pynvml.nvmlDeviceGetPciInfo(h)
        pynvml.nvmlDeviceGetTotalEccErrors(h, 1, 0); pynvml.nvmlDeviceGetRemappedRows(h)
        pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h)
        pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
    pynvml.nvmlShutdown()

out = {}
ALL = tuple(map(str, range(8)))
def in_process():
    node = probe(Selection(True))
    judge(node, node.gpus, [], cfg.gpu, idle=set(range(8)), xids={})

for name, fn in (
    ("bare", bare),
    ("inproc", in_process),
    ("check", lambda: check(cfg, ALL, expect_idle=True)),
):
    fn()
    t = []
    for _ in range(runs):
        s = time.perf_counter(); fn(); t.append((time.perf_counter() - s) * 1000)
    out[name] = statistics.median(t)
got = check(cfg, ALL, expect_idle=True)
assert got.verdict.status == 0 and len(got.gpus) == 8, got.verdict
print(json.dumps(out))
"""


def _median_ms(argv: list[str], env: dict[str, str], runs: int) -> float:
    t = []
    for _ in range(runs):
        s = time.perf_counter()
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        t.append((time.perf_counter() - s) * 1000)
        if r.returncode != 0:
            sys.exit(f"bench: gpu: {' '.join(argv[:4])} failed: {r.stderr[-400:]}")
    return statistics.median(t)


def _with_image(d: Path, env: dict[str, str], runs: int) -> tuple[float, float] | None:
    """Median prolog with a cached, pinned image and 8 GPUs, and the same without an
    image, interleaved; None without a local cluster."""
    import yaml

    cluster_env = REPO / "build" / "cluster.env"
    if not cluster_env.exists():
        return None
    site = next(
        line.split("=", 1)[1]
        for line in cluster_env.read_text().splitlines()
        if line.startswith("export TFIMAGE_CONFIG=")
    )
    cfg = yaml.safe_load(Path(site).read_text())
    cfg.update(
        state_dir=str(d / "istate"),
        cache_dir=str(d / "icache"),
        hook_log=str(d / "ihooks.log"),
        gpu={"kmsg": str(d / "kmsg")},
    )
    config = d / "image-config.yaml"
    config.write_text(json.dumps(cfg))
    tfimage = [sys.executable, "-m", "tfimage.main", "--config", str(config)]
    r = subprocess.run([*tfimage, "pull", "--json", "tiny:1.0"], env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    if r.returncode != 0:
        sys.exit(f"bench: gpu: pulling tiny:1.0 from the local cluster failed: {r.stderr[-400:]}")
    pinned = json.loads(r.stdout)["reference"]
    samples: dict[str, list[float]] = {"image": [], "none": []}
    for i in range(runs):
        for kind in ("image", "none"):
            job = str(100 + 2 * i + (kind == "none"))
            argv = [sys.executable, "-m", "tfimage.prolog.main", f"--config={config}",
                    f"--job={job}", "--node=n1", "--gpus=0,1,2,3,4,5,6,7"]  # fmt: skip
            if kind == "image":
                argv.append(f"--image={pinned}")
            samples[kind].append(_median_ms(argv, env, 1))
            subprocess.run(
                [sys.executable, "-m", "tfimage.epilog.main", f"--config={config}", f"--job={job}"],
                env=env, capture_output=True, timeout=120, check=False,
            )  # fmt: skip
    shutil.rmtree(d / "icache", ignore_errors=True)
    return statistics.median(samples["image"]), statistics.median(samples["none"])


def main(runs: int) -> None:
    with tempfile.TemporaryDirectory(prefix="tfimage-bench-gpu-") as tmp:
        d = Path(tmp)
        lib = build_fake_nvml(d / "lib")
        (d / "state.json").write_text(json.dumps(node(8)))
        (d / "kmsg").touch()
        settings = {
            "state_dir": str(d / "state"),
            "hook_log": str(d / "hooks.log"),
            "gpu": {"kmsg": str(d / "kmsg")},
        }
        (d / "config.yaml").write_text(json.dumps(settings))
        env = {
            **os.environ,
            "LD_LIBRARY_PATH": str(lib),
            "FAKE_NVML_STATE": str(d / "state.json"),
            "SLURM_CONF": "/dev/null",
        }
        r = subprocess.run(
            [sys.executable, "-c", IN_PROCESS, json.dumps(settings), str(runs * 10)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode != 0:
            sys.exit(f"bench: gpu: in-process check failed: {r.stderr[-600:]}")
        inproc = json.loads(r.stdout)
        prolog = [
            sys.executable,
            "-m",
            "tfimage.prolog.main",
            f"--config={d / 'config.yaml'}",
            "--job=7",
            "--node=n1",
            "--gpus=0,1,2,3,4,5,6,7",
        ]
        bare_py = _median_ms([sys.executable, "-c", "pass"], env, runs)
        hook = _median_ms(prolog, env, runs)
        with_image = _with_image(d, env, runs) if os.geteuid() == 0 else None
    ratio = inproc["inproc"] / inproc["bare"]
    print(
        f"gpu: check of 8 GPUs in process   median {inproc['inproc']:7.2f} ms  "
        f"(the same NVML reads bare: {inproc['bare']:.2f} ms, {ratio:.1f}x)"
        f"; goal < 100 ms -> {'MET' if inproc['inproc'] < 100 else 'NOT MET'}"
    )
    print(
        f"gpu: the same in its child process median {inproc['check']:6.1f} ms  "
        f"(python3 -c pass: {bare_py:.1f} ms; the price of a deadline on NVML)"
    )
    print(
        f"gpu: prolog GPU gate end to end    median {hook:7.1f} ms  "
        f"(python3 -c pass: {bare_py:.1f} ms, {hook / bare_py:.1f}x)"
        f"; goal < 500 ms -> {'MET' if hook < 500 else 'NOT MET'}"
    )
    if with_image is None:
        print("gpu: prolog with a cached image     skipped: needs root and the local cluster")
    else:
        img, none = with_image
        print(
            f"gpu: prolog, cached image, 8 GPUs  median {img:7.1f} ms  "
            f"(the same prolog without an image: {none:.1f} ms, +{img - none:.0f} ms for the "
            f"cache hit and the mount); goal < 500 ms -> {'MET' if img < 500 else 'NOT MET'}"
        )

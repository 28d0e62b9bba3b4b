"""GPU gate benchmark: the full check of 8 (fake) GPUs, in process and as the prolog.

The gate reads NVML in a child process with a deadline (agent/gpu/child.py), so
three figures: the reading and judging in process (the child's own work), the
check with its child (what the prolog pays), and the prolog end to end.

The fake libnvidia-ml.so.1 (tests/fakenvml) answers from a JSON file, so what is
measured is tfimage's own cost plus nvidia-ml-py's ctypes calls, not a driver's.
Baselines from the same run: the same NVML reads done bare with pynvml (what any
health check must pay), and a bare ``python3 -c pass``.

Goals: the check < 100 ms in process; the prolog's GPU gate end to end < 500 ms.
"""

from __future__ import annotations

import json
import os
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
from tfimage.agent.config import config_from_mapping
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

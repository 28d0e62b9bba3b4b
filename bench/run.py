"""tfimage benchmarks: one command, ratios against baselines measured in the same run.

    python bench/run.py [all|launch|pull|gpu|usage|start|stage|fleet|soak] [--runs N]
                        [--mib N] [--nodes N] [--tasks N] [--seed S] [--json]

- gpu: see bench/gpu.py (the GPU gate on 8 fake GPUs, in process and as the
  prolog, against the same NVML reads bare).  Needs no cluster.

- usage: see bench/usage.py (`tfimage usage report` over 100,000 records from 8
  nodes against reading and parsing the same lines).  Needs no cluster.

- start: see bench/start.py (`import tensorflow` in the image with each mount
  driver against the unpacked tree, warm, cold and 4 at once), then the launch
  overhead below when the local cluster is up.

- pull: see bench/pull.py (verified pull against curl and oras-py, 16 at once,
  warm hits, cache ls over 10,000 entries).

- stage: see bench/stage.py (a cold 4-node job's time and registry egress with
  the controller's stage hook and without, as ratios to one node's cold pull).
  Needs TFIMAGE_NODES=4 and a shaped registry (TFIMAGE_REGISTRY_RATE=200mbit).

- fleet: see bench/fleet.py (a cold N-node job three ways: each node from the
  registry, through the rack mirror, one pull down Slurm's tree; time until every
  node holds the image and the registry's egress, as ratios to one node's pull).
  Needs TFIMAGE_NODES=16 (--nodes) and a shaped registry.

- soak: see bench/soak.py (a job array of --tasks short tasks over four images and
  two users while seeded faults hit the registry, the rack mirror, the node daemons,
  slurmd, a cache file system and the pin socket; then every task, node, leak and
  usage record accounted for).  Exits 1 on any loss, drain, leak or duplicate.

- launch: added cost of --tf-image on a step with a warm cache,
  `srun -N2 -n4 --tf-image=tiny:1.0 /bin/sh -c true` against the same srun without it,
  (":" itself is srun's heterogeneous-job separator, so the step runs `true`),
  beside a bare `python3 -c pass` and `python3 -c "import requests"` start.
  Goal: the step's median grows by <= 50 ms.

Needs the local cluster (`make cluster-up`).  Machines here are noisy (2 cores):
medians, and ratios within one run, are what to compare.
"""

from __future__ import annotations

import argparse
import os
import pwd
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTLE = 0.3  # seconds between a job's end and the next srun (launch)


def cluster_env() -> dict[str, str]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    path = REPO / "build" / "cluster.env"
    if not path.exists():
        sys.exit("bench: no local cluster; run `make cluster-up` first")
    for line in path.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            k, v = line[len("export ") :].split("=", 1)
            env[k] = v.replace("$PATH", env["PATH"])
    return env


def timed(
    argv: list[str], env: dict[str, str], runs: int, user: str | None = None, cwd: str | None = None
) -> list[float]:
    kw: dict[str, object] = {}
    if user:
        pw = pwd.getpwnam(user)
        env = {**env, "HOME": pw.pw_dir, "USER": user, "PWD": cwd or pw.pw_dir}
        kw = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
    chroot = env.get("TFIMAGE_CHROOT", "")
    if chroot and argv[0] == "srun":
        # SLURM_FLAVOR=other: the other Slurm's clients run in its tree, as the tests do.
        ids = [f"--userspec={kw['user']}:{kw['group']}", "--groups="] if user else []
        argv = ["/usr/sbin/chroot", *ids, chroot, "env", "-C", cwd or "/", *argv]
        kw, cwd = {}, None
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, timeout=300, **kw)  # type: ignore[call-overload]
        out.append((time.perf_counter() - t) * 1000)
        if r.returncode != 0:
            sys.exit(f"bench: {' '.join(argv)} failed: {r.stderr.decode()[-500:]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "what",
        nargs="?",
        choices=("all", "launch", "pull", "gpu", "usage", "start", "stage", "fleet", "soak"),
        default="all",
    )
    ap.add_argument("--runs", type=int, default=0, help="runs per measurement")
    ap.add_argument(
        "--mib", type=int, default=0, help="stage, fleet: each image's size in MiB (512, 1024)"
    )
    ap.add_argument(
        "--nodes", type=int, default=0, help="fleet: the job's nodes (16); soak: its nodes (4)"
    )
    ap.add_argument("--tasks", type=int, default=2000, help="soak: the array tasks")
    ap.add_argument("--seed", type=int, default=1, help="soak: the faults' and the work's seed")
    ap.add_argument("--json", action="store_true", help="soak: the account as JSON")
    args = ap.parse_args()
    if args.what in ("all", "gpu"):
        import gpu

        gpu.main(args.runs or 15)
    if args.what in ("all", "usage"):
        import usage

        usage.main(args.runs or 5)
    if args.what in ("all", "start"):
        import start

        start.main(args.runs or 3)
    if args.what in ("gpu", "usage"):
        return
    if args.what == "start" and not (REPO / "build" / "cluster.env").exists():
        print("\nlaunch: skipped: the local cluster is not up (make cluster-up)")
        return
    env = cluster_env()
    if args.what == "stage":  # not in "all": it wants 4 nodes and a shaped link
        import stage

        stage.main(env, args.mib or 512)
        return
    if args.what == "fleet":  # not in "all": it wants 16 nodes and a shaped link
        import fleet

        fleet.main(env, args.nodes or 16, args.mib or 1024)
        return
    if args.what == "soak":  # not in "all": an hour on 4 nodes by default
        import soak

        sys.exit(soak.main(env, args.tasks, args.seed, args.nodes or 4, args.json))
    if args.what in ("all", "pull"):
        import pull

        pull.main(env, args.runs or 5)
    if args.what in ("all", "launch", "start"):
        launch(env, 15 if args.what == "start" else args.runs or 15)


def launch(env: dict[str, str], runs: int) -> None:
    user = env["TFIMAGE_TEST_USER"]
    cwd = pwd.getpwnam(user).pw_dir
    # Warm the cache and the mounts path once, untimed.
    timed(["srun", "-N2", "-n4", "--tf-image=tiny:1.0", "/bin/sh", "-c", "true"], env, 1, user, cwd)
    results = {}
    order = [
        ("python3 -c pass", ["python3", "-c", "pass"], None),
        ("python3 -c 'import requests'", [sys.executable, "-c", "import requests"], None),
        ("srun -N2 -n4 sh -c true", ["srun", "-N2", "-n4", "/bin/sh", "-c", "true"], user),
        (
            "srun -N2 -n4 --tf-image=tiny:1.0 sh -c true",
            ["srun", "-N2", "-n4", "--tf-image=tiny:1.0", "/bin/sh", "-c", "true"],
            user,
        ),
    ]
    logs = Path(env.get("TFIMAGE_LOCAL_STATE", "/var/lib/tfimage-local")) / "log"
    seen = {p: p.stat().st_size for p in logs.glob("daemon-*.log")}
    # Interleave the two srun variants so drift on a noisy machine hits both alike.
    samples: dict[str, list[float]] = {name: [] for name, _, _ in order}
    for _ in range(runs):
        for name, argv, who in order:
            if argv[0] == "srun":
                # Each srun starts on settled nodes: the job before it (a plain one
                # before every --tf-image one) is still in its epilog and Slurm's
                # cleanup for ~100 ms after srun returns, on the same two cores.
                settle(env)
            samples[name] += timed(argv, env, 1, who, cwd if who else None)
    for name, vals in samples.items():
        results[name] = statistics.median(vals)
        print(f"{name:<45} median {results[name]:8.1f} ms  (n={len(vals)})")
    base = results["srun -N2 -n4 sh -c true"]
    tf = results["srun -N2 -n4 --tf-image=tiny:1.0 sh -c true"]
    print(
        f"\nlaunch: --tf-image adds {tf - base:+.1f} ms per step "
        f"({tf / base:.2f}x the plain step); goal <= +50 ms -> "
        f"{'MET' if tf - base <= 50 else 'NOT MET'}"
    )
    where(seen, tf - base)


def settle(env: dict[str, str]) -> None:
    """SETTLE seconds, then until Slurm has no job completing (its epilog done)."""
    time.sleep(SETTLE)
    argv = ["squeue", "-h", "-t", "CG", "-o", "%i"]
    if env.get("TFIMAGE_CHROOT"):
        argv = ["/usr/sbin/chroot", env["TFIMAGE_CHROOT"], *argv]
    until = time.monotonic() + 10
    while time.monotonic() < until:
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and not r.stdout.strip():
            return
        time.sleep(0.05)
    sys.exit("bench: a job stayed completing for 10 s: " + " ".join(argv))


_DAEMON_LINE = re.compile(
    r"tfimage: daemon: (pin) uid \d+ -> 0 in (\d+) ms"
    r"|tfimage: daemon: (tfimage-stage|tfimage-prolog|step-prepare)"
    r" job (\d+)(?: step \d+)? -> 0 in (\d+) ms"
)


def where(seen: dict[Path, int], added: float) -> None:
    """Where the added time goes, from the daemons' own logs of these rounds: the
    pin (login node), the stage hook (the controller's, where it runs), the prolog
    and the step's preparation (the slower node of
    each job, as the step waits for both).  Each is the worker's own time, from
    its request read to its answer."""
    pins: list[float] = []
    per_job: dict[tuple[str, str], float] = {}
    for path, size in seen.items():
        with path.open(errors="replace") as f:
            f.seek(size)
            for m in _DAEMON_LINE.finditer(f.read()):
                if m.group(1):
                    pins.append(float(m.group(2)))
                else:
                    key = (m.group(3), m.group(4))
                    per_job[key] = max(per_job.get(key, 0.0), float(m.group(5)))
    phases = {
        "pin": pins,
        "stage (controller)": [v for (k, _), v in per_job.items() if k == "tfimage-stage"],
        "prolog": [v for (k, _), v in per_job.items() if k == "tfimage-prolog"],
        "step preparation": [v for (k, _), v in per_job.items() if k == "step-prepare"],
    }
    if not phases["stage (controller)"]:
        del phases["stage (controller)"]  # the cluster runs without the stage hook
    if not all(phases.values()):
        print("launch: where it goes: no daemon log lines for these rounds")
        return
    med = {k: statistics.median(v) for k, v in phases.items()}
    text = ", ".join(f"{k} {v:.0f} ms" for k, v in med.items())
    print(
        f"launch: where it goes (the daemons' logs, medians; the slower node): {text}; "
        f"the other ~{added - sum(med.values()):.0f} ms (an estimate: medians of different "
        "rounds): forking the daemons' workers, the hooks' and the plugin's sockets, ch-run, "
        "Slurm"
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()

"""The fleet: a cold N-node job, three ways, against one node's cold pull, all
measured in the same run.

    python bench/run.py fleet [--nodes 16] [--mib 1024]

Needs the local cluster with at least N nodes, its rack mirror and the stage hook,
the registry's link shaped so that the link, not this machine's memory, is what a
pull waits for:

    TFIMAGE_NODES=16 TFIMAGE_REGISTRY_RATE=1gbit make cluster-up

The ways, each with an image of its own (on no node, in no mirror or staging cache):

- direct: every node pulls from the registry (the stage hook off: ``stage.off``;
  no rack mirrors);
- mirror: every node asks the rack mirror first (``rack_mirrors`` naming all N, one
  rack), which fetches from the registry once (deploy/local/mirror.sh);
- tree: the controller pulls once and ``sbcast`` sends it down Slurm's tree
  (PrologSlurmctld: stage/).

For each: the seconds from submit until the last node's prolog had published the
image (each node's hook log), and the bytes the registry served of the image's
blob (its own access log, the mirror's fetches included), each as a ratio to one
node's cold pull.  Images are removed from every cache after their case, so a
16-node run of 1 GiB images needs about 20 GB of disk at its peak.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _site(env: dict[str, str], way: str, nodes: int) -> Iterator[None]:
    """The cluster's config and stage switch set for ``way``, put back after."""
    path = Path(env["TFIMAGE_CONFIG"])
    text, st = path.read_text(), path.stat()
    cfg = yaml.safe_load(text)
    cfg.pop("rack_mirrors", None)
    if way == "mirror":
        cfg["rack_mirrors"] = {f"n[1-{nodes}]": [env["TFIMAGE_MIRROR"]]}
    off = path.parent / "stage.off"
    try:
        path.write_text(yaml.safe_dump(cfg))
        if way != "tree":
            off.write_text("bench/fleet.py: each node pulls for itself\n")
        yield
    finally:
        off.unlink(missing_ok=True)
        path.write_text(text)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # its compiled form is good again


def _published(env: dict[str, str], job: str, names: list[str], since: float) -> list[float]:
    """When each node's prolog had the job's image (epoch seconds), from its hook log
    (which outlives the cluster, whose job ids start again at 1: only lines after
    ``since``, the first on each node)."""
    state = Path(env["TFIMAGE_LOCAL_STATE"])
    pat = re.compile(
        rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) tfimage-prolog: job {job}: \S+ "
        r"(pulled from|adopted the copy|cache hit)"
    )
    when = []
    for node in names:
        log = state / "nodes" / node / "log" / "hooks.log"
        for line in log.read_text(errors="replace").splitlines():
            if m := pat.match(line):
                t = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f")
                at = t.replace(tzinfo=datetime.UTC).timestamp()
                if at >= since - 1:  # the log's stamps are to the millisecond
                    when.append(at)
                    break
    return when


def _forget(env: dict[str, str], image: str, names: list[str]) -> None:
    """The image out of every node's cache and the staging cache (disk, not time)."""
    state = Path(env["TFIMAGE_LOCAL_STATE"])
    base = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "TFIMAGE_CONFIG": env["TFIMAGE_CONFIG"]}
    for node in names:
        pid = (state / "run" / f"slurmd-{node}.pid").read_text().strip()
        subprocess.run(
            ["nsenter", "-t", pid, "-m", "-u", "-n", "--", "/opt/tfimage/bin/tfimage",
             "cache", "rm", image],
            env=base, capture_output=True, timeout=120, check=False,
        )  # fmt: skip
    subprocess.run(
        ["/opt/tfimage/bin/tfimage", "cache", "--stage", "rm", image],
        env={**env, **base}, capture_output=True, timeout=120, check=False,
    )  # fmt: skip


def _job(env: dict[str, str], image: str, nodes: int) -> tuple[str, float]:
    """Submit an N-node job that reads the image on each node; its id and when it
    was submitted (it is waited for)."""
    import pwd

    user = env["TFIMAGE_TEST_USER"]
    pw = pwd.getpwnam(user)
    started = time.time()
    r = subprocess.run(
        ["sbatch", "--parsable", "--wait", "-p", "all", f"-N{nodes}", f"-n{nodes}",
         f"--tf-image={image}", "--tf-batch=host", "-o", "/dev/null",
         "--wrap", "srun cat /etc/tfimage-test-image"],
        env={**env, "HOME": pw.pw_dir, "USER": user}, cwd=pw.pw_dir, user=pw.pw_uid,
        group=pw.pw_gid, extra_groups=[], capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if r.returncode != 0:
        sys.exit(f"bench: fleet: the {nodes}-node job failed: {(r.stderr or r.stdout)[-500:]}")
    return r.stdout.strip().split(";")[0], started


def main(env: dict[str, str], nodes: int, mib: int) -> None:
    from stage import _egress, _image

    names = env.get("TFIMAGE_NODE_NAMES", "").strip('"').split()[:nodes]
    if len(names) < nodes or env.get("TFIMAGE_STAGE") != "1" or not env.get("TFIMAGE_MIRROR"):
        sys.exit(
            f"bench: fleet needs {nodes} nodes, the rack mirror and the stage hook: "
            f"TFIMAGE_NODES={nodes} TFIMAGE_REGISTRY_RATE=1gbit make cluster-up"
        )
    rate = env.get("TFIMAGE_REGISTRY_RATE") or "unshaped"
    print(
        f"\nfleet: {mib} MiB images, {nodes} nodes, registry link {rate}, "
        f"{os.cpu_count()} cores, one disk"
    )
    rows: dict[str, tuple[float, int]] = {}
    with tempfile.TemporaryDirectory(prefix="tfimage-bench-fleet-") as d:
        for case, n, way in (
            ("1 node (baseline)", 1, "direct"),
            (f"{nodes} nodes, each from the registry", nodes, "direct"),
            (f"{nodes} nodes, through the rack mirror", nodes, "mirror"),
            (f"{nodes} nodes, one pull down Slurm's tree", nodes, "tree"),
        ):
            image, blob = _image(env, Path(d), mib, f"bench-fleet-{way}")
            with _site(env, way, nodes):
                job, started = _job(env, image, n)
            when = _published(env, job, names[:n], started)
            if len(when) != n:
                sys.exit(f"bench: fleet: job {job}: {len(when)} of {n} prologs had the image")
            time.sleep(1)  # the access log's last line
            rows[case] = (max(when) - started, _egress(env, blob))
            _forget(env, image, names[:n])
    one_t, one_b = rows["1 node (baseline)"]
    print(f"{'':<44} {'until all hold it':>22}  {'registry egress':>24}")
    for case, (took, sent) in rows.items():
        print(
            f"{case:<44} {took:8.1f} s ({took / one_t:5.2f}x)  "
            f"{sent / 1e6:9.1f} MB ({sent / one_b:5.2f}x)"
        )
    print(
        f"bound: the registry's link ({rate}) for the registry's egress; for time, this "
        f"machine's {os.cpu_count()} cores (TLS, sha256 and sbcast for every node) and "
        "its one disk (every node's cache), which a real fleet has per node"
    )

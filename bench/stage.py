"""One pull per multi-node job: a cold 4-node job's time and registry egress with the
controller's stage hook and without it, each as a ratio to one node's cold pull,
all measured in the same run.

    python bench/run.py stage [--mib N]

Needs the local cluster with 4 nodes, its registry's link shaped so that the link
and not this machine's memory is what a pull waits for:

    TFIMAGE_NODES=4 TFIMAGE_REGISTRY_RATE=200mbit make cluster-up

Each case gets an image of its own (N MiB of random bytes in a busybox SIF, on no
node and in no staging cache), so every case is cold.  "Without" is the same cluster
with the admin's switch (``stage.off`` beside the config) in place: each node pulls
for itself, as before the stage hook.  Egress is what the registry's access log
says it served of the image's blob.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def _image(env: dict[str, str], tmp: Path, mib: int, what: str) -> tuple[str, str]:
    """A fresh image ``what-<hex>:1`` with ``mib`` MiB of random bytes; its name and
    its SIF blob's digest."""
    from support import busybox_sif

    marker = f"{what}-{os.urandom(4).hex()}"
    sif = busybox_sif(tmp, marker, payload_mib=mib)
    shutil.rmtree(tmp / f"root-{marker}")
    out = subprocess.run(
        ["/opt/tfimage/bin/tfimage", "push", str(sif), f"{marker}:1"],
        env=env, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    sif.unlink()
    assert "@sha256:" in out.stdout, out.stdout
    return f"{marker}:1", _blob(env, marker)


def _blob(env: dict[str, str], marker: str) -> str:
    """The SIF layer's digest, from the manifest the site's registry serves."""
    import yaml

    from support import Registry

    site = yaml.safe_load(Path(env["TFIMAGE_CONFIG"]).read_text())
    creds = yaml.safe_load(Path(site["credentials"]).read_text())["registries"][site["registry"]]
    reg = Registry(site["registry"], Path(site["ca_bundle"]), creds["username"], creds["password"])
    raw = reg.manifest_bytes(f"library/{marker}", "1")
    return str(json.loads(raw)["layers"][0]["digest"])


def _egress(env: dict[str, str], blob: str) -> int:
    log = Path(env["TFIMAGE_LOCAL_STATE"]) / "log" / "registry.log"
    pat = re.compile(rf'"GET /v2/[^ ]*/blobs/{re.escape(blob)} HTTP/[0-9.]+" (?:200|206) (\d+)')
    return sum(int(m[1]) for m in pat.finditer(log.read_text(errors="replace")))


def _job(env: dict[str, str], image: str, nodes: int) -> float:
    """Seconds from submit to the end of a job on ``nodes`` nodes that reads the
    image on each (its prolog pulled it first)."""
    from run import timed

    user = env["TFIMAGE_TEST_USER"]
    cwd = f"/home/{user}"
    argv = [
        "srun",
        "-p",
        "all",
        f"-N{nodes}",
        f"--tf-image={image}",
        "cat",
        "/etc/tfimage-test-image",
    ]
    return timed(argv, env, 1, user, cwd)[0] / 1000


def main(env: dict[str, str], mib: int) -> None:
    names = env.get("TFIMAGE_NODE_NAMES", "").split()
    if len(names) < 4 or env.get("TFIMAGE_STAGE") != "1":
        sys.exit("bench: stage needs TFIMAGE_NODES=4 and the stage hook (TFIMAGE_STAGE=1)")
    rate = env.get("TFIMAGE_REGISTRY_RATE") or "unshaped"
    off = Path(env["TFIMAGE_CONFIG"]).parent / "stage.off"
    print(f"\nstage: {mib} MiB images, registry link {rate}, {len(names)} nodes")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="tfimage-bench-stage-") as d:
        for case, nodes, staged in (
            ("1 node, cold", 1, True),
            ("4 nodes, cold, staged", 4, True),
            ("4 nodes, cold, each node pulls", 4, False),
        ):
            image, blob = _image(env, Path(d), mib, "bench-stage")
            if not staged:
                off.write_text("bench/stage.py: each node pulls for itself\n")
            try:
                took = _job(env, image, nodes)
            finally:
                off.unlink(missing_ok=True)
            time.sleep(1)  # the access log's last line
            rows[case] = (took, _egress(env, blob))
    one_t, one_b = rows["1 node, cold"]
    for case, (took, sent) in rows.items():
        print(
            f"{case:<32} {took:7.1f} s ({took / one_t:4.2f}x)  "
            f"registry egress {sent / 1e6:8.1f} MB ({sent / one_b:4.2f}x)"
        )

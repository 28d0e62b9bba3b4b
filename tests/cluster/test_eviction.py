"""Eviction under load: prune, run again and again on a node while other images are
pulled into its cache, never removes the image a running job holds."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import yaml
from conftest import Cluster, write_script

from support import build_sif

NODE = "n1"
TFIMAGE = "/opt/tfimage/bin/tfimage"


def _push_fillers(cluster: Cluster, tmp: Path, n: int) -> list[str]:
    """``n`` small, distinct SIF images pushed to the local registry."""
    refs = []
    for i in range(n):
        root = tmp / f"root{i}"
        (root / "etc").mkdir(parents=True)
        (root / "etc" / "tfimage-test-image").write_text(f"filler {i} {time.time_ns()}\n")
        sif = build_sif(root, tmp / f"filler{i}.sif")
        ref = f"evict-filler-{i}:1"
        r = subprocess.run(
            ["tfimage", "push", str(sif), ref],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        refs.append(ref)
    return refs


def _cache_ls(cluster: Cluster, config: str) -> list[dict[str, object]]:
    r = cluster.on_node(NODE, [TFIMAGE, "--config", config, "cache", "ls", "--json"])
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout))


def test_prune_under_load_never_removes_a_held_image(
    cluster: Cluster, workdir: Path, tmp_path: Path
) -> None:
    # The node's own config, squeezed: a 1-byte limit and a 10 ms minimum age, so every
    # prune wants to evict everything it may.
    cfg = yaml.safe_load(Path(cluster.env["TFIMAGE_CONFIG"]).read_text())
    cfg.update(cache_max_bytes=1, cache_min_age=0.01)
    squeezed = cluster.state / "run" / "evict-config.yaml"  # seen by the nodes too
    squeezed.write_text(yaml.safe_dump(cfg))
    fillers = _push_fillers(cluster, tmp_path, 4)

    write_script(
        workdir,
        "hold.sh",
        "#!/bin/sh\n#SBATCH --tf-image=tiny:1.0\n#SBATCH -w n1\n#SBATCH -o hold.out\n"
        "echo start $(cat /etc/tfimage-test-image)\nsleep 12\n"
        "echo end $(cat /etc/tfimage-test-image)\n",
        cluster.user,
    )
    job = cluster.submit(workdir, "hold.sh")
    try:
        out = workdir / "hold.out"
        for _ in range(150):
            if out.exists() and "start" in out.read_text():
                break
            time.sleep(0.2)
        held = [e for e in _cache_ls(cluster, str(squeezed)) if job in (e.get("holders") or [])]
        assert len(held) == 1, "the running job holds no cache entry"
        digest = held[0]["digest"]

        removed: list[str] = []
        errors: list[str] = []

        def pull(ref: str) -> None:
            r = cluster.on_node(NODE, [TFIMAGE, "--config", str(squeezed), "cache", "pull", ref])
            if r.returncode != 0:
                errors.append(f"pull {ref}: {r.stderr.strip()}")

        # Load: pulls of the fillers while prune runs over and over on the same node.
        pullers = [threading.Thread(target=pull, args=(ref,)) for ref in fillers]
        for t in pullers:
            t.start()
        rounds = 0
        while any(t.is_alive() for t in pullers) or rounds < 5:
            r = cluster.on_node(
                NODE, [TFIMAGE, "--config", str(squeezed), "cache", "prune", "--json"]
            )
            assert r.returncode == 0, r.stderr
            removed += json.loads(r.stdout)["removed"]
            rounds += 1
        for t in pullers:
            t.join()
        assert errors == []
        assert digest not in removed
        assert any(e["digest"] == digest for e in _cache_ls(cluster, str(squeezed)))
        assert removed, "prune evicted nothing: the test did not exercise eviction"
        print(
            f"eviction under load: {rounds} prunes, {len(removed)} entries evicted, held one kept"
        )

        for _ in range(150):
            done = cluster.run(["squeue", "-h", "-j", job], as_root=True)
            if not done.stdout.strip():
                break
            time.sleep(0.2)
        text = out.read_text()
        assert "start tiny:1.0" in text and "end tiny:1.0" in text, text
        assert cluster.node_state(NODE) == "idle"

        # Released by the epilog, the same image is now fair game.
        r = cluster.on_node(NODE, [TFIMAGE, "--config", str(squeezed), "cache", "prune", "--json"])
        assert digest in json.loads(r.stdout)["removed"], r.stdout
    finally:
        cluster.run(["scancel", job], as_root=True)
        squeezed.unlink(missing_ok=True)
        shutil.rmtree(tmp_path, ignore_errors=True)

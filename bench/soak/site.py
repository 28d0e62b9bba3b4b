"""The local cluster as the soak drives it."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class Site:
    """The local cluster as the soak drives it: Slurm's commands as root or as a
    user, a node's namespaces, the harness's own switches (cluster.sh)."""

    def __init__(self, env: dict[str, str], nodes: int) -> None:
        if env.get("TFIMAGE_CHROOT"):
            sys.exit(
                "soak: the cluster runs the other Slurm in a chroot; bring it up with "
                "SLURM_FLAVOR=host"
            )
        # Root's tools too (losetup, findmnt): cluster.env's PATH is a user's.
        self.env = {**env, "PATH": env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"}
        self.state = Path(env["TFIMAGE_LOCAL_STATE"])
        names = env["TFIMAGE_NODE_NAMES"].strip('"').split()
        if not 2 <= nodes <= len(names):
            sys.exit(f"soak: --nodes must be from 2 to the cluster's {len(names)}, not {nodes}")
        self.nodes = names[-nodes:]
        self.others = [n for n in names if n not in self.nodes]
        self.users = (env["TFIMAGE_TEST_USER"], env["TFIMAGE_TEST_USER2"])
        self.mirror = env.get("TFIMAGE_MIRROR", "")
        behind = set(hostnames(self, env.get("TFIMAGE_MIRROR_NODES", "")))
        self.mirrored = bool(self.mirror) and bool(behind & set(self.nodes))

    def run(
        self,
        argv: list[str],
        user: str | None = None,
        cwd: Path | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        kw: dict[str, Any] = {}
        env = dict(self.env)
        if user:
            pw = pwd.getpwnam(user)
            env |= {"HOME": pw.pw_dir, "USER": user}
            kw = {
                "user": pw.pw_uid,
                "group": pw.pw_gid,
                "extra_groups": os.getgrouplist(user, pw.pw_gid),
            }
        return subprocess.run(
            argv,
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kw,
        )

    def harness(self, *args: str) -> None:
        """``cluster.sh ARGS`` in a clean environment: cluster.env's TFIMAGE_MIRROR is
        an address, where cluster.sh wants a switch."""
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "TFIMAGE_LOCAL_STATE": str(self.state)}
        r = subprocess.run(
            ["bash", str(REPO / "deploy/local/cluster.sh"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if r.returncode != 0:
            raise RuntimeError(f"cluster.sh {' '.join(args)}: {r.stderr.strip()[-300:]}")

    def pid(self, name: str) -> int:
        return int((self.state / "run" / f"{name}.pid").read_text())

    def on_node(
        self, node: str, argv: list[str], timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return self.run(
            ["nsenter", "-t", str(self.pid(f"slurmd-{node}")), "-m", "-u", "-n", "--", *argv],
            timeout=timeout,
        )


def hostnames(site: Site, hostlist: str) -> list[str]:
    """Slurm's expansion of ``hostlist`` (none for an empty one)."""
    if not hostlist:
        return []
    return site.run(["scontrol", "show", "hostnames", hostlist]).stdout.split()

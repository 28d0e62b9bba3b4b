"""The soak's faults: seeded, one at a time, each logged with its start and end."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from .site import Site

FAULTS = (
    "registry-stop",
    "registry-kill",
    "mirror-5xx-hang",
    "daemon-kill",
    "slurmd-kill",
    "cache-full",
    "evict",
    "pin-flood",
)
CACHE = "/var/cache/tfimage"
TFIMAGE = "/opt/tfimage/bin/tfimage"
CACHE_SIZE = "3g"  # the full node's cache file system (a tmpfs: the images it pulls)


@dataclasses.dataclass
class Fault:
    kind: str
    node: str
    start: float
    end: float = 0.0
    detail: str = ""


class Injector:
    """The seeded faults, one at a time, each kind once in each of ``rounds``, within
    ``until``."""

    def __init__(
        self,
        site: Site,
        rng: random.Random,
        until: float,
        hold: tuple[float, float],
        log: Callable[[str], None],
        rounds: int = 1,
    ) -> None:
        self.site, self.rng, self.until, self.hold, self.log = site, rng, until, hold, log
        self.done: list[Fault] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        kinds = [k for k in FAULTS if k != "mirror-5xx-hang" or site.mirrored]
        # Every kind once a round, in a new order each round: a long soak meets each
        # fault again, after other faults and at other loads.
        self.plan = [k for _ in range(rounds) for k in self.rng.sample(kinds, len(kinds))]
        self.full_node = site.nodes[-1]

    def run(self) -> None:
        self.stop.wait(self.hold[1])  # a quiet start: throughput without a fault
        for kind in self.plan:
            if self.stop.is_set() or time.time() > self.until:
                self.errors.append(f"{kind}: not injected: the run ended first")
                continue
            node = self.rng.choice(self.site.nodes)
            if kind == "cache-full":  # the node whose cache has a file system of its own
                node = self.full_node
            held = self.rng.uniform(*self.hold)
            fault = Fault(kind, node, time.time())
            self.log(f"fault {kind} on {node} for {held:.0f} s")
            try:
                fault.detail = getattr(self, "_" + kind.replace("-", "_"))(node, held)
            except Exception as e:  # a fault that could not be made is reported, not hidden
                self.errors.append(f"{kind} on {node}: {e}")
                fault.detail = f"failed: {e}"
            fault.end = time.time()
            self.done.append(fault)
            self.log(f"fault {kind} on {node} over: {fault.detail}")
            self.stop.wait(self.rng.uniform(*self.hold) / 2)

    def _registry_stop(self, node: str, held: float) -> str:
        pid = self.site.pid("registry")
        os.kill(pid, signal.SIGSTOP)
        try:
            self.stop.wait(held)
        finally:
            os.kill(pid, signal.SIGCONT)
        return f"registry {pid} stopped {held:.0f} s"

    def _registry_kill(self, node: str, held: float) -> str:
        pid = self.site.pid("registry")
        os.kill(pid, signal.SIGKILL)
        self.stop.wait(held)
        self.site.harness("registry", "start")
        return f"registry {pid} killed, restarted after {held:.0f} s"

    def _mirror_5xx_hang(self, node: str, held: float) -> str:
        # Its registry gone, nginx answers 502 for what it has not cached; then nginx
        # itself stopped: connections accepted by the kernel, never answered.
        os.kill(self.site.pid("mirror-registry"), signal.SIGKILL)
        self.stop.wait(held / 2)
        group = os.getpgid(self.site.pid("mirror"))
        os.killpg(group, signal.SIGSTOP)
        try:
            self.stop.wait(held / 2)
        finally:
            os.killpg(group, signal.SIGCONT)
        self.site.harness("mirror", "stop")
        self.site.harness("mirror", "start")
        return f"rack mirror 5xx {held / 2:.0f} s, hung {held / 2:.0f} s, rebuilt empty"

    def _daemon_kill(self, node: str, held: float) -> str:
        # Mid-request: once a forked worker serves one (up to ``held`` s for one to
        # come), as a unit's KillMode=process leaves that worker running.
        pid = self.site.pid(f"daemon-{node}")
        deadline = time.time() + held
        workers: list[str] = []
        while time.time() < deadline and not self.stop.is_set():
            workers = _children(pid)
            if workers:
                break
            self.stop.wait(0.05)
        os.kill(pid, signal.SIGKILL)
        self.stop.wait(2)  # the unit's RestartSec
        self.site.harness("daemon", node)
        when = f"mid-request (worker {workers[0]} left running)" if workers else "idle"
        return f"daemon {pid} killed {when}, restarted"

    def _slurmd_kill(self, node: str, held: float) -> str:
        pid = self.site.pid(f"slurmd-{node}")
        os.kill(pid, signal.SIGKILL)
        self.stop.wait(min(held, 10))
        self.site.harness("slurmd", node)
        return f"slurmd {pid} killed, restarted"

    def _cache_full(self, node: str, held: float) -> str:
        # The node whose cache has a file system of its own (small_cache, run()'s
        # choice): filled to the last byte, as a disk is by another writer, then freed.
        # A pull may take space between df and fallocate (the 2,000-task run's first
        # try failed so): each try takes what is free then, until nothing is.
        taken = 0
        for i in range(20):
            free = int(
                self.site.on_node(node, ["df", "--output=avail", "-B1", CACHE]).stdout.split()[-1]
            )
            if free < 1 << 20:
                break
            r = self.site.on_node(node, ["fallocate", "-l", str(free), f"{CACHE}/soak-fill{i}"])
            if r.returncode == 0:
                taken += free
        if taken == 0:
            raise RuntimeError(f"{CACHE} on {node}: nothing could be taken")
        try:
            self.stop.wait(held)
        finally:
            self.site.on_node(node, ["rm", "-f", *(f"{CACHE}/soak-fill{i}" for i in range(20))])
        return f"{CACHE} full ({taken >> 20} MiB taken) for {held:.0f} s"

    def _evict(self, node: str, held: float) -> str:
        # The node's config with its cache's limit and watermarks at the bottom, for
        # these prunes alone: everything not held is fair game, and what is held must
        # stay (the jobs running now still read it).
        site_cfg = yaml.safe_load(Path(self.site.env["TFIMAGE_CONFIG"]).read_text())
        site_cfg.update(
            cache_max_bytes=1, cache_min_age=0.001, cache_high_watermark=1, cache_low_watermark=1
        )
        cfg = self.site.state / "run" / "soak-evict.yaml"
        cfg.touch(mode=0o600)
        cfg.write_text(yaml.safe_dump(site_cfg))
        removed = 0
        deadline = time.time() + held
        try:
            while time.time() < deadline and not self.stop.is_set():
                r = self.site.on_node(
                    node, [TFIMAGE, "--config", str(cfg), "cache", "prune", "--json"]
                )
                if r.returncode != 0:
                    raise RuntimeError(f"cache prune: {r.stderr.strip()[-200:]}")
                removed += len(json.loads(r.stdout).get("removed", []))
                self.stop.wait(1)
        finally:
            cfg.unlink(missing_ok=True)
        return f"pruned to nothing held for {held:.0f} s, {removed} images evicted"

    def _pin_flood(self, node: str, held: float) -> str:
        flood = (
            "import socket, sys, time\n"
            "end = time.time() + float(sys.argv[2]); n = 0\n"
            "while time.time() < end:\n"
            "    try:\n"
            "        s = socket.socket(socket.AF_UNIX); s.settimeout(1); s.connect(sys.argv[1])\n"
            "        s.sendall(b'x' * 4096); s.close(); n += 1\n"
            "    except OSError:\n"
            "        n += 1\n"
            "print(n)\n"
        )
        # The system's Python: the flooding user may not read this one's venv.
        r = self.site.run(
            ["/usr/bin/python3", "-c", flood, "/run/tfimage/pin.sock", f"{held:.1f}"],
            user=self.site.users[1],
            timeout=held + 60,
        )
        return f"{r.stdout.strip() or '?'} connections from {self.site.users[1]} in {held:.0f} s"


def _children(pid: int) -> list[str]:
    """``pid``'s children, of any of its threads (/proc: no subprocess per poll)."""
    out: list[str] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out += (task / "children").read_text().split()
    return out


def small_cache(site: Site, node: str, on: bool) -> None:
    """A cache file system of its own on ``node`` for the run (``on``), that the
    cache-full fault can fill without filling this machine's disk; then the node's
    own again.  Its daemon restarts with each, as after a remount on a real node."""
    if on:
        argv = [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size={CACHE_SIZE},mode=0755,nosuid,nodev",
            "tfimage-soak-cache",
            CACHE,
        ]
    else:
        argv = ["umount", CACHE]
    daemon = site.pid(f"daemon-{node}")
    os.kill(daemon, signal.SIGTERM)
    for _ in range(100):
        if not Path(f"/proc/{daemon}").exists():
            break
        time.sleep(0.1)
    r = site.on_node(node, argv)
    site.harness("daemon", node)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} on {node}: {r.stderr.strip()}")

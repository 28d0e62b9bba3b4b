"""The TensorFlow and NCCL environment of one task, computed from its step.

Every task is a ``worker``.  Its index is its position in host-major order: the
nodes in ``SLURM_STEP_NODELIST`` order (Slurm's, never sorted as strings), each
contributing its ``SLURM_STEP_TASKS_PER_NODE`` tasks in ``SLURM_LOCALID`` order.
``SLURM_PROCID`` is not used: under cyclic or plane distribution it does not follow
host-major order, and TF needs every worker to agree on the list.

Ports: the step's reserved ports (``SLURM_STEP_RESV_PORTS``, from ``MpiParams=ports=``)
when Slurm gives them, local task L taking the L-th; otherwise

    port = lo + (crc32(f"{job_id}.{step_id}") + L) mod (hi - lo + 1)

over the configured range, so two steps of two jobs on one node rarely meet and a
given task always gets the same port on every node's view.

Nothing here overrides a variable the user set; the caller applies the result with
"set only if unset".
"""

from __future__ import annotations

import json
import re
import socket
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tfimage.agent.errors import StepLayoutError
from tfimage.agent.logtext import oneline

MAX_HOSTS = 65536


def _split_top(text: str) -> Iterator[str]:
    """The comma-separated names of a hostlist (commas inside brackets are not
    separators), one at a time: a caller stops at its limit without the rest."""
    depth = 0
    start = 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise StepLayoutError(f"unbalanced ']' in hostlist {oneline(text, 80)!r}")
        elif c == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    if depth:
        raise StepLayoutError(f"unbalanced '[' in hostlist {oneline(text, 80)!r}")
    yield text[start:]


def _ranges(body: str, text: str, limit: int) -> tuple[list[tuple[int, int, int]], int]:
    """A bracket's ranges as (lo, hi, width), and how many names they make; nothing
    expanded, and no more than ``limit`` names' worth even parsed."""
    out: list[tuple[int, int, int]] = []
    count = 0
    if body.count(",") >= limit:  # each item names a node at least
        return out, limit + 1
    for item in body.split(","):
        m = re.fullmatch(r"(\d{1,9})(?:-(\d{1,9}))?", item)
        if not m:
            raise StepLayoutError(
                f"bad range {oneline(item, 40)!r} in hostlist {oneline(text, 80)!r}"
            )
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise StepLayoutError(
                f"bad range {oneline(item, 40)!r} in hostlist {oneline(text, 80)!r}"
            )
        out.append((lo, hi, len(m.group(1))))
        count += hi - lo + 1
        if count > limit:
            break
    return out, count


def expand_hostlist(text: str, limit: int = MAX_HOSTS) -> list[str]:
    """``rack[1-2]-n[01-02],gpu9`` -> rack1-n01, rack1-n02, rack2-n01, rack2-n02, gpu9.

    The count (the product of each name's ranges, summed over names) is checked
    against ``limit`` before a single name is built: the text comes from a job."""
    parts = []
    total = 0
    for part in _split_top(text.strip()):
        if not part:
            raise StepLayoutError(f"empty name in hostlist {oneline(text, 80)!r}")
        pieces = re.split(r"(\[[^\]]*\])", part)
        parsed: list[str | list[tuple[int, int, int]]] = []
        count = 1
        for piece in pieces:
            if piece.startswith("["):
                ranges, n = _ranges(piece[1:-1], text, limit)
                count *= n
                parsed.append(ranges)
            else:
                parsed.append(piece)
            if count > limit:
                break
        total += count
        if total > limit:
            raise StepLayoutError(f"hostlist {oneline(text, 80)!r} names more than {limit} nodes")
        parts.append(parsed)
    hosts: list[str] = []
    for parsed in parts:
        names = [""]
        for piece in parsed:
            if isinstance(piece, str):
                names = [n + piece for n in names]
            else:
                names = [
                    n + str(i).zfill(w)
                    for n in names
                    for lo, hi, w in piece
                    for i in range(lo, hi + 1)
                ]
        hosts += names
    return hosts


def expand_counts(text: str, limit: int = MAX_HOSTS) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1]; at most ``limit`` nodes and ``limit`` tasks in
    all, checked before expanding."""
    items = []
    nodes = tasks = 0
    for item in text.strip().split(","):
        m = re.fullmatch(r"(\d{1,9})(?:\(x(\d{1,9})\))?", item)
        if not m:
            raise StepLayoutError(
                f"bad tasks-per-node item {oneline(item, 40)!r} in {oneline(text, 80)!r}"
            )
        n, times = int(m.group(1)), int(m.group(2) or 1)
        nodes += times
        tasks += n * times
        if nodes > limit or tasks > limit:
            raise StepLayoutError(f"tasks-per-node {oneline(text, 80)!r} is more than {limit}")
        items.append((n, times))
    return [n for n, times in items for _ in range(times)]


def expand_ports(text: str, limit: int = MAX_HOSTS) -> list[int]:
    """``20000-20003`` or ``20000,20002-20003`` -> the ports, in order (at most
    ``limit``, checked before expanding)."""
    ranges = []
    count = 0
    for item in text.strip().split(","):
        m = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", item)
        if not m:
            raise StepLayoutError(f"bad reserved port item {oneline(item, 40)!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if not 0 < lo <= hi < 65536:
            raise StepLayoutError(f"bad reserved port range {item!r}")
        count += hi - lo + 1
        if count > limit:
            raise StepLayoutError(f"reserved ports {oneline(text, 80)!r} are more than {limit}")
        ranges.append((lo, hi))
    return [p for lo, hi in ranges for p in range(lo, hi + 1)]


def hashed_ports(job_id: str, step_id: str, count: int, lo: int, hi: int) -> list[int]:
    span = hi - lo + 1
    if count > span:
        raise StepLayoutError(f"{count} tasks on a node but only {span} ports in {lo}-{hi}")
    h = zlib.crc32(f"{job_id}.{step_id}".encode())
    return [lo + (h + i) % span for i in range(count)]


@dataclass(frozen=True)
class Layout:
    hosts: list[str]
    tasks: list[int]
    node_id: int
    local_id: int
    ports: list[int]  # per local task id, the same on every node

    @property
    def index(self) -> int:
        return sum(self.tasks[: self.node_id]) + self.local_id

    @property
    def workers(self) -> list[str]:
        return [
            f"{h}:{self.ports[i]}"
            for h, n in zip(self.hosts, self.tasks, strict=True)
            for i in range(n)
        ]


def step_layout(
    env: Mapping[str, str],
    port_range: tuple[int, int] = (29000, 29999),
    limit: int = MAX_HOSTS,
) -> Layout:
    """Read a task's layout from its Slurm variables, strictly: at most ``limit``
    nodes and tasks, counted before anything is expanded."""

    def need(name: str) -> str:
        v = env.get(name)
        if v is None or v == "":
            raise StepLayoutError(
                f"{name} is not set: not inside a job step (the batch "
                "script itself has no step layout)"
            )
        return v

    hosts = expand_hostlist(need("SLURM_STEP_NODELIST"), limit)
    tasks = expand_counts(need("SLURM_STEP_TASKS_PER_NODE"), limit)
    if len(hosts) != len(tasks):
        raise StepLayoutError(
            f"SLURM_STEP_NODELIST has {len(hosts)} nodes but SLURM_STEP_TASKS_PER_NODE "
            f"describes {len(tasks)}"
        )
    try:
        node_id, local_id = int(need("SLURM_NODEID")), int(need("SLURM_LOCALID"))
    except ValueError:
        raise StepLayoutError("SLURM_NODEID and SLURM_LOCALID must be integers") from None
    if not 0 <= node_id < len(hosts) or not 0 <= local_id < tasks[node_id]:
        raise StepLayoutError(f"task {node_id}/{local_id} is outside the step's layout")
    most = max(tasks)
    if env.get("SLURM_STEP_RESV_PORTS"):
        ports = expand_ports(env["SLURM_STEP_RESV_PORTS"], limit)
        if len(ports) < most:
            raise StepLayoutError(
                f"Slurm reserved {len(ports)} port(s) ({env['SLURM_STEP_RESV_PORTS']}) but a "
                f"node runs {most} tasks; raise MpiParams=ports= or use fewer tasks per node"
            )
    else:
        ports = hashed_ports(need("SLURM_JOB_ID"), env.get("SLURM_STEP_ID", "0"), most, *port_range)
    return Layout(hosts, tasks, node_id, local_id, ports[:most])


def route_interface(host: str) -> str | None:
    """The interface this node uses to reach ``host`` (None if it can't be told)."""
    import psutil

    try:
        addr = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # no packet is sent: this only asks the routing table
            local = s.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name
    return None


def ib_hcas(sys_root: Path = Path("/sys/class/infiniband")) -> str | None:
    try:
        names = sorted(p.name for p in sys_root.iterdir())
    except OSError:
        return None
    return ",".join(names) or None


@dataclass
class Decision:
    value: str
    why: str


@dataclass
class TaskEnv:
    """What to set (only where unset), and why, for one task."""

    set: dict[str, Decision] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)  # user-set, left alone

    def offer(self, env: Mapping[str, str], name: str, value: str, why: str) -> None:
        if name in env:
            self.kept[name] = "set by the user; left alone"
        else:
            self.set[name] = Decision(value, why)


def task_env(
    env: Mapping[str, str],
    *,
    site_env: Mapping[str, str] | None = None,
    single_task_tf_config: bool = False,
    port_range: tuple[int, int] = (29000, 29999),
    interface_of: Callable[[str], str | None] = route_interface,
    limit: int = MAX_HOSTS,
) -> TaskEnv:
    out = TaskEnv()
    layout = step_layout(env, port_range, limit)
    total = sum(layout.tasks)
    if total > 1 or single_task_tf_config:
        cfg = {
            "cluster": {"worker": layout.workers},
            "task": {"type": "worker", "index": layout.index},
        }
        out.offer(
            env,
            "TF_CONFIG",
            json.dumps(cfg, separators=(",", ":")),
            f"worker {layout.index} of {total}, host-major over "
            f"{','.join(layout.hosts)}; ports "
            + (
                "reserved by Slurm"
                if env.get("SLURM_STEP_RESV_PORTS")
                else f"hashed from job and step in {port_range[0]}-{port_range[1]}"
            ),
        )
    ifname = interface_of(layout.hosts[0])
    if ifname:
        out.offer(
            env,
            "NCCL_SOCKET_IFNAME",
            f"={ifname}",
            f"the interface that routes to the step's first node {layout.hosts[0]}",
        )
    hcas = ib_hcas()
    if hcas:
        out.offer(env, "NCCL_IB_HCA", hcas, "from /sys/class/infiniband")
    for name, value in (site_env or {}).items():
        out.offer(env, name, value, "site default from the tfimage config")
    return out

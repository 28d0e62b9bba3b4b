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
import socket
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from tfimage.agent.core.errors import StepLayoutError
from tfimage.agent.core.hostlist import MAX_HOSTS, expand_counts, expand_hostlist, expand_ports
from tfimage.agent.step.gpushare import LIMIT, mps_memory_limit


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


_SIOCGIFADDR = 0x8915


def _ipv4_of(name: str) -> str | None:
    """An interface's (primary) IPv4 address, from the kernel (SIOCGIFADDR)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            got = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(got[20:24])


def route_interface(host: str) -> str | None:
    """The interface this node uses to reach ``host`` (None if it can't be told)."""
    try:
        addr = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # no packet is sent: this only asks the routing table
            local = s.getsockname()[0]
    except (OSError, ValueError):  # UnicodeError: a name no resolver takes
        return None
    return next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == local), None)


IB_SYSFS = Path("/sys/class/infiniband")


def _natural(p: Path) -> tuple[int, str]:
    """mlx5_2 before mlx5_10, port 2 before port 10: the kernel's numbering."""
    return len(p.name), p.name


_ACTIVE = "4"  # ib_port_state: "4: ACTIVE"


def ib_hcas(sys_root: Path = IB_SYSFS) -> str | None:
    """NCCL_IB_HCA for this node: each HCA port whose state is ACTIVE, as
    ``mlx5_0:1,mlx5_1:1`` (NCCL's syntax); None when there is none.  A port that is
    down is left out: NCCL would try it and time out."""
    try:
        devices = sorted(sys_root.iterdir(), key=_natural)
    except OSError:
        return None
    active = []
    for dev in devices:
        try:
            ports = sorted((dev / "ports").iterdir(), key=_natural)
        except OSError:
            continue
        for port in ports:
            try:
                state = (port / "state").read_text(errors="replace")
            except OSError:
                continue
            if state.split(":")[0].strip() == _ACTIVE:
                active.append(f"{dev.name}:{port.name}")
    return ",".join(active) or None


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


def _hosts_shown(hosts: list[str]) -> str:
    return ",".join(hosts) if len(hosts) <= 8 else ",".join(hosts[:8]) + f",... ({len(hosts)})"


def task_env(
    env: Mapping[str, str],
    *,
    site_env: Mapping[str, str] | None = None,
    single_task_tf_config: bool = False,
    port_range: tuple[int, int] = (29000, 29999),
    interface_of: Callable[[str], str | None] = route_interface,
    limit: int = MAX_HOSTS,
    layout: Layout | None = None,
    ib_sysfs: Path = IB_SYSFS,
) -> TaskEnv:
    """The variables of the task ``env`` describes (or of ``layout``, already read
    from it: a step's tasks share one)."""
    out = TaskEnv()
    if layout is None:
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
            f"{_hosts_shown(layout.hosts)}; ports "
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
    hcas = ib_hcas(ib_sysfs)
    if hcas:
        out.offer(env, "NCCL_IB_HCA", hcas, f"the active InfiniBand ports in {ib_sysfs}")
    share = mps_memory_limit(env)
    if share:
        out.offer(env, LIMIT, *share)
    for name, value in (site_env or {}).items():
        out.offer(env, name, value, "site default from the tfimage config")
    return out


def step_task_envs(
    step: Mapping[str, str],
    node_id: int,
    local_tasks: int,
    *,
    site_env: Mapping[str, str],
    single_task_tf_config: bool,
    port_range: tuple[int, int],
    limit: int,
    max_bytes: int,
    ib_sysfs: Path = IB_SYSFS,
) -> dict[int, dict[str, str]]:
    """Each local task's variables, the step's layout read once.  Refused before
    it is built when every task's TF_CONFIG together would be more than
    ``max_bytes`` (what the plugin takes in one answer): such a step could not
    start anyway."""
    base = {**step, "SLURM_NODEID": str(node_id), "SLURM_LOCALID": "0"}
    layout = step_layout(base, port_range, limit)
    if local_tasks > layout.tasks[node_id]:
        raise StepLayoutError(
            f"{local_tasks} local tasks, but the step's layout gives node {node_id} "
            f"{layout.tasks[node_id]}"
        )
    per_task = sum(len(h) + 8 for h, n in zip(layout.hosts, layout.tasks, strict=True)) * max(
        layout.tasks
    )
    if per_task * local_tasks > max_bytes:
        raise StepLayoutError(
            f"the step's TF_CONFIG for {local_tasks} task(s) here would be about "
            f"{per_task * local_tasks >> 10} KiB; the plugin takes at most {max_bytes >> 10} KiB"
        )
    out = {}
    for local in range(local_tasks):
        te = task_env(
            {**base, "SLURM_LOCALID": str(local)},
            site_env=site_env,
            single_task_tf_config=single_task_tf_config,
            port_range=port_range,
            layout=replace(layout, local_id=local),
            ib_sysfs=ib_sysfs,
        )
        out[local] = {k: d.value for k, d in te.set.items()}
    return out

"""The ``gpu:`` section of the site config: what the GPU gate checks and what it does.

Every threshold, switch and severity has a default here, each citing where it comes from.
Unknown keys are errors, as in the rest of the config.

    gpu:
      checks: true          # the gate before GPU jobs (false: none at all)
      all_jobs: true        # GPU jobs without --tf-image are checked too
      scope: job            # job: the job's GPUs; node: every GPU of the node
      mapping: index        # how Slurm names a GPU: index, uuid or minor
      shared: false         # GPUs shared through gres/shard or gres/mps: true, or the
                            # nodes that do (names or globs: [n1, "gpu-s*"])
      retired_pages_max: 60
      retired_pages_dbe_max: 15
      remapped_rows_max: null
      xids: [48, 62, 64, 74, 79, 92, 95, 119, 120, 140]
      kmsg: /dev/kmsg
      timeout: 20           # seconds NVML may take before the gate calls the driver hung
      slurm_bin: ""         # where scontrol and sinfo are, if not /usr/bin or /usr/sbin
      severity: {persistence: "off"}   # any check: drain, warning or off
      nvccli: false         # apptainer: --nv --nvccli (nvidia-container-cli sets up the GPUs)
      driver_libs: []       # charliecloud: the driver's libraries (default: ldconfig -p)
      cdi_spec: ""          # charliecloud: or the site's CDI spec (/etc/cdi/nvidia.yaml)
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tfimage.agent.core.errors import ConfigError

# What each check is, in the order the gate runs them; the severity each has unless
# the site says otherwise.  Drain-class findings drain the node (the only reason a
# tfimage hook exits non-zero); warnings are logged.
CHECKS: dict[str, str] = {
    "init": "drain",  # NVML does not initialise while GPUs are allocated
    "count": "drain",  # fewer GPUs visible than Slurm allocated
    "lost": "drain",  # GPU lost, or needing a reset (NVML's own answer)
    "inforom": "drain",  # nvmlDeviceValidateInforom: corrupt InfoROM
    "recovery": "drain",  # the driver's recovery action asks for a reset or a reboot
    "remap_failure": "drain",
    "remap_pending": "drain",
    "remapped_rows": "drain",  # over remapped_rows_max
    "retired_pending": "drain",
    "retired_pages": "drain",  # over retired_pages_max / retired_pages_dbe_max
    "ecc_dbe": "drain",  # volatile uncorrected ECC since the driver loaded
    "processes": "drain",  # compute processes from outside the job
    "nvlink": "drain",  # a link NVML knows of that is down
    "xid": "drain",  # a critical XID in the kernel log since the last check
    "persistence": "warning",
    "clocks": "warning",  # hardware slowdown, thermal or power-brake clock events
    "pcie": "warning",  # link narrower or slower than its maximum
}
SEVERITIES = ("drain", "warning", "off")
SCOPES = ("job", "node")
MAPPINGS = ("index", "uuid", "minor")


@dataclass(frozen=True)
class GpuPolicy:
    checks: bool = True
    # Default on: a job that lands on a broken GPU is what the gate is for, whether or
    # not it asked for an image (product decision 5).
    all_jobs: bool = True
    scope: str = "job"
    # index: AutoDetect=nvml numbers GPUs as NVML does; minor: File=/dev/nvidiaN
    # (DESIGN.md, GPUs and NVML).  UUIDs in the allocation are taken as UUIDs in any mode.
    mapping: str = "index"
    # Slurm does not keep gres/shard (or gres/mps) and whole-GPU allocations apart on
    # one GPU, so on such a node another job's processes are legitimate.  The prolog
    # cannot tell a shard job from a whole-GPU one (both get SLURM_JOB_GPUS alone, seen
    # on 22.05.8), so this is the node's: true, or the names (globs) of the nodes.
    shared: bool | tuple[str, ...] = False
    # DCGM_LIMIT_MAX_RETIRED_PAGES = 60 and its soft limit 15 for double-bit pages
    # (DCGM, dcgm_gpu_hardware_limits.h, "defined via bug 1665722").
    retired_pages_max: int = 60
    retired_pages_dbe_max: int = 15
    # NVIDIA gives a remap *failure* (checked above) as the replacement criterion
    # (GPU Memory Error Management, "Row Remapping"); a count limit is a site's early
    # warning, off unless set.
    remapped_rows_max: int | None = None
    # XIDs whose action in NVIDIA's "XID Errors" catalogue is a reset, a reboot or a
    # replacement: 48 DBE, 62 internal micro-controller halt, 64 row-remap failure,
    # 74 NVLink error, 79 fallen off the bus, 92 high single-bit ECC rate, 95
    # uncontained ECC, 119/120 GSP timeout/error, 140 unrecovered ECC.  Application
    # XIDs (13, 31, 43) are the job's, never the node's.
    xids: tuple[int, ...] = (48, 62, 64, 74, 79, 92, 95, 119, 120, 140)
    # The kernel log, read with a cursor per GPU (a test points it at a fixture).
    kmsg: str = "/dev/kmsg"
    # NVML is read in a child process killed after this many seconds: a GPU fallen off
    # the bus can block nvmlInit for minutes (nvidia-smi "hangs" reports, XID 79), and
    # no hook may hang a node.  20 s leaves the gate, the pull and a health check room
    # under Slurm's 60 s HealthCheckProgram kill; a driver that does not answer by then
    # is an "init" finding.
    timeout: float = 20.0
    # Where the site's scontrol and sinfo are (/opt/slurm/bin); empty: the fixed PATH
    # every root-side tool gets (/usr/sbin:/usr/bin:/sbin:/bin, toolrun.py).
    slurm_bin: str = ""
    severity: dict[str, str] = field(default_factory=dict)
    # Apptainer's --nvccli: nvidia-container-cli, not Apptainer's own list of files,
    # puts the driver into the container (Apptainer's GPU guide: where the site has
    # libnvidia-container installed).
    nvccli: bool = False
    # Charliecloud: the driver libraries bound into a GPU step (step/gpudriver.py);
    # empty: found in the host's linker cache, as nvidia-container-cli finds them.
    driver_libs: tuple[str, ...] = ()
    # Or the site's CDI spec (nvidia-ctk cdi generate), where it keeps one.
    cdi_spec: str = ""

    def shares(self, node: str) -> bool:
        """Whether ``node`` shares its GPUs between jobs (gres/shard, gres/mps)."""
        if isinstance(self.shared, bool):
            return self.shared
        return any(fnmatch.fnmatchcase(node, pattern) for pattern in self.shared)

    def severity_of(self, check: str) -> str:
        return self.severity.get(check, CHECKS[check])


def unknown_settings(given: Iterable[object], known: set[str]) -> str:
    """The keys of ``given`` that are not ``known``, each with the known key it most
    looks like ("runetime (did you mean runtime?)"); "" when there are none."""
    import difflib

    said = []
    for key in sorted(str(k) for k in given if k not in known):
        near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.7)
        said.append(f"{key} (did you mean {near[0]}?)" if near else key)
    return ", ".join(said)


_BOOLS = {"checks", "all_jobs", "nvccli"}
# Names and shell globs; no brackets: "gpu[01-04]" reads as a Slurm hostlist, which
# fnmatch would take for a character class and match nothing the admin meant.
_NODE = re.compile(r"[A-Za-z0-9_.*?-]{1,64}\Z")
_COUNTS = {"retired_pages_max", "retired_pages_dbe_max", "remapped_rows_max"}


def _one(key: str, value: Any, where: str) -> Any:
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: 'gpu.{key}' must be true or false")
        return value
    if key in _COUNTS:
        if value is None and key == "remapped_rows_max":
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 20:
            raise ConfigError(f"{where}: 'gpu.{key}' must be a count from 0 to {1 << 20}")
        return value
    if key in ("scope", "mapping"):
        allowed = SCOPES if key == "scope" else MAPPINGS
        if value not in allowed:
            raise ConfigError(f"{where}: 'gpu.{key}' must be one of {', '.join(allowed)}")
        return value
    if key == "xids":
        if not isinstance(value, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 < x < 1 << 16 for x in value
        ):
            raise ConfigError(f"{where}: 'gpu.xids' must be a list of XID numbers")
        return tuple(value)
    if key == "shared":
        if isinstance(value, bool):
            return value
        if (
            not isinstance(value, list)
            or len(value) > 256
            or not all(isinstance(n, str) and _NODE.match(n) for n in value)
        ):
            raise ConfigError(
                f"{where}: 'gpu.shared' must be true, false or a list of node names "
                "(globs with * and ?; write gpu0* for a hostlist such as gpu[01-04])"
            )
        return tuple(value)
    if key == "driver_libs":
        if (
            not isinstance(value, list)
            or len(value) > 64
            or not all(
                isinstance(p, str) and p.startswith("/") and os.path.normpath(p) == p for p in value
            )
        ):
            raise ConfigError(f"{where}: 'gpu.driver_libs' must be a list of absolute paths")
        return tuple(value)
    if key == "timeout":
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 300:
            raise ConfigError(f"{where}: 'gpu.timeout' must be seconds from 0 to 300")
        return float(value)
    if key in ("kmsg", "cdi_spec", "slurm_bin"):
        unset = key != "kmsg" and value == ""
        if not isinstance(value, str) or not (value.startswith("/") or unset):
            raise ConfigError(f"{where}: 'gpu.{key}' must be an absolute path")
        return value
    # severity
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: 'gpu.severity' must map check names to a severity")
    for check, level in value.items():
        if check not in CHECKS:
            raise ConfigError(
                f"{where}: 'gpu.severity': unknown check {str(check)[:40]!r} "
                f"(known: {', '.join(CHECKS)})"
            )
        if level not in SEVERITIES:
            raise ConfigError(
                f"{where}: 'gpu.severity.{check}' must be one of {', '.join(SEVERITIES)}"
            )
    return dict(value)


def gpu_policy(value: Any, path: Path) -> GpuPolicy:
    """The ``gpu:`` mapping of the config at ``path``, checked key by key."""
    if value is None:
        return GpuPolicy()
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: 'gpu' must be a mapping of settings")
    known = {f.name for f in fields(GpuPolicy)}
    if said := unknown_settings(value, known):
        raise ConfigError(f"{path}: unknown setting(s) under 'gpu': {said}")
    return GpuPolicy(**{k: _one(k, v, str(path)) for k, v in value.items()})

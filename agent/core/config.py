"""Site configuration, read from ``/etc/tfimage/config.yaml`` (root-owned).

Unknown keys are errors, so a typo never silently falls back to a default.
Hooks are told the path explicitly; nothing here reads a job's environment.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tfimage.agent.core import wire
from tfimage.agent.core.access import Rule, access_rules, segment_glob
from tfimage.agent.core.errors import ConfigError, ImageReferenceError, TfimageError
from tfimage.agent.core.gpuconfig import GpuPolicy, gpu_policy, unknown_settings
from tfimage.agent.core.mirrortiers import Tiers, for_node, rack_mirrors, this_node
from tfimage.agent.core.partition import PartitionRule, partition_rules
from tfimage.agent.core.reference import (
    DOCKER_HUB,
    Reference,
    check_allowed,
    check_rewrite,
    is_repository_path,
    parse_reference,
)

DEFAULT_PATH = Path(wire.DEFAULT_CONFIG)
RUNTIMES = ("charliecloud", "apptainer", "singularity")
MOUNT_DRIVERS = ("kernel", "squashfuse_ll", "squashfuse")


@dataclass(frozen=True)
class Config:
    registry: str = "harbor.example"
    project: str = "library"
    mirrors: tuple[str, ...] = ()
    # Pull-through caches per node group, asked before the registry (mirrortiers.py).
    rack_mirrors: Tiers = ()  # mapping in YAML
    allowed_registries: tuple[str, ...] = ()
    ca_bundle: str | None = None
    credentials: str = "/etc/tfimage/credentials.yaml"
    cache_dir: str = "/var/cache/tfimage"
    state_dir: str = "/run/tfimage"
    runtime: str = "charliecloud"
    runtime_path: str | None = None
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    # The one deadline of a hook's or a step's preparation (pull, convert, mount):
    # the prolog gives up at it; the daemon, tfimage-hook and the plugin wait a
    # little longer (wire.HOOK_GRACE), never starting a second run.  Keep it below
    # Slurm's PrologEpilogTimeout (the role and doctor check).
    hook_deadline: float = float(wire.DEFAULT_HOOK_DEADLINE)
    hook_log: str = "/var/log/tfimage/hooks.log"
    # Slurm's user (slurm.conf SlurmUser): besides root and the job's own user, the
    # one owner a copy staged for a job may have (cache/staged.py).
    slurm_user: str = "slurm"
    # Token services (Bearer realms) that may receive the registry credentials, by
    # host name, besides the registry's own host.
    token_realms: tuple[str, ...] = ()
    # The most tasks (and nodes) a step's layout may describe; checked before any
    # hostlist is expanded.
    step_max_tasks: int = 65536
    # SRC:DST[:ro|rw] bound into every container whose SRC exists on the node.
    default_binds: tuple[str, ...] = field(default_factory=tuple)
    # Where --tf-mount sources may come from.
    bind_prefixes: tuple[str, ...] = ("/home", "/data", "/scratch")
    # Set in every task where the user has not set them; TF wants exactly "true".
    site_env: dict[str, str] = field(default_factory=lambda: {"TF_FORCE_GPU_ALLOW_GROWTH": "true"})
    tf_port_range: tuple[int, int] = (29000, 29999)
    # Where NCCL_IB_HCA's active ports are read (a site with its HCAs elsewhere, or
    # a test, points it at another tree).
    ib_sysfs: str = "/sys/class/infiniband"
    # Eviction: from the high watermark down to the low one, as a percentage of
    # cache_max_bytes when set, else of the cache filesystem; never younger than
    # cache_min_age seconds since last use.
    cache_max_bytes: int | None = None
    cache_high_watermark: float = 85.0
    cache_low_watermark: float = 80.0
    cache_min_age: float = 3600.0
    single_task_tf_config: bool = False
    # A pull holds (pull_connections + 1) buffers of pull_stripe_bytes (cache/download.py).
    # With more than one connection, a blob of at least two stripes comes a stripe (a
    # Range request) at a time on each: worth it where one HTTPS stream is bound by
    # one core on each side (fast links, many cores), not on 2 cores, where one
    # stream was as fast and cost the registry a quarter less CPU (bench/pull.py).
    pull_connections: int = 1
    pull_stripe_bytes: int = 8 << 20
    # The most seconds a cold pull of a multi-node job waits, at random, before it
    # asks the registry: a hundred prologs that start in one second reach it spread
    # over this long.  0 for none; one-node jobs never wait.
    pull_jitter: float = 2.0
    # One JSON line per job per node (usage/record.py), for a log shipper; "" for none.
    usage_log: str = "/var/log/tfimage/usage.jsonl"
    # node_exporter's textfile collector directory (Debian's default), written where
    # it exists; "" for none.
    metrics_dir: str = "/var/lib/prometheus/node-exporter"
    # How an image is mounted for charliecloud, in order of preference; each one not
    # available on the node (no loop device, no squashfs module, not installed) is
    # skipped with a log line.  "kernel" (a loop device and the kernel's squashfs,
    # the fastest: no FUSE process) makes the kernel parse the image as root, so it
    # is tried only for repositories in image_mount_kernel (globs, e.g.
    # "library/tf-*"): images the admin trusts.  The FUSE drivers parse it in a
    # process of their own, as Apptainer does for unprivileged images by default.
    image_mount: tuple[str, ...] = ("squashfuse_ll", "squashfuse")
    image_mount_kernel: tuple[str, ...] = ()
    # Upstream registries served through the site's registry (Harbor proxy-cache
    # projects): the project Docker Hub names map to (docker://tensorflow/tensorflow,
    # docker.io/...), and other upstreams by prefix ({"nvcr.io": "harbor.site/nvcr"});
    # see reference.py.  The allowlist applies to what they map to.
    dockerhub_project: str = ""
    registry_rewrites: dict[str, str] = field(default_factory=dict)
    # The compute nodes' platform ("linux/arm64"): what a tag naming an image index
    # of SIFs resolves to, at submit and on a node, and the architecture a SIF is
    # checked against at submit.  "" for this machine's own: set it where the
    # login nodes that submit are not the architecture of the nodes that run.
    platform: str = ""
    # Who may run images of which repositories (core/access.py documents the rules):
    # {"team-a/*": ["@team-a"]}; a repository no rule matches is open to all.
    access: tuple[Rule, ...] = ()
    # Which images each partition runs (core/partition.py documents the rules):
    # {"prod": {"require_digest": true, ...}}; a partition no key matches runs any.
    partitions: tuple[PartitionRule, ...] = ()
    # The controller's one pull per multi-node job (stage/): PrologSlurmctld pulls
    # the job's image into stage_dir (a cache like a node's, on the controller) and
    # broadcasts it down Slurm's tree; stage_deadline bounds both together, and must
    # end before PrologEpilogTimeout (the role and `doctor --controller` check).
    # Past it, or on any failure, each node pulls for itself.
    stage_dir: str = "/var/cache/tfimage-stage"
    stage_deadline: float = 300.0
    # Whether PrologSlurmctld stages at all (the role's tfimage_stage), and whether
    # it writes the job's pinned image into its AdminComment for sacct
    # (stage/admincomment.py).
    stage: bool = False
    record_digest: bool = True
    # Images every node keeps (never evicted) and `cache warm` fetches, besides the
    # operator's own keep list on the node: what a new cloud node pulls before it
    # takes jobs (its disk, and so its keep list, came empty).
    keep_images: tuple[str, ...] = ()
    # The GPU gate (gpuconfig.py documents every key).
    gpu: GpuPolicy = field(default_factory=GpuPolicy)
    # The Slurm node this config is read on (the prolog's SLURMD_NODENAME): what
    # picks its rack mirrors.  Not a setting: "" is this host's short name.
    node_name: str = field(default="", compare=False, metadata={"setting": False})

    @property
    def allowlist(self) -> tuple[str, ...]:
        """The admin's allowlist; by default the registry and its mirrors."""
        return self.allowed_registries or (self.registry, *self.all_mirrors)

    @property
    def all_mirrors(self) -> tuple[str, ...]:
        """Every mirror any node may ask: ``mirrors`` and each group's rack mirrors."""
        racks = (m for _, group in self.rack_mirrors for m in group)
        return tuple(dict.fromkeys((*self.mirrors, *racks)))

    def on_node(self, name: str) -> Config:
        """This config as read on the Slurm node ``name`` (its rack mirrors)."""
        import dataclasses

        return dataclasses.replace(self, node_name=name)

    def node_mirrors(self) -> tuple[str, str, tuple[str, ...]]:
        """This node's name, the hostlist of its group ("" for none) and its rack
        mirrors."""
        return self._node_tier

    @functools.cached_property
    def _node_tier(self) -> tuple[str, str, tuple[str, ...]]:
        # Once per config (on_node makes another): a pull asks it for its sources and
        # again for each host that fails, and each ask expanded the groups' hostlists.
        node = self.node_name or this_node()
        return (node, *for_node(self.rack_mirrors, node))

    @property
    def node_platform(self) -> str:
        """``os/architecture`` the nodes run, in the image spec's words."""
        # Imported here: a hook that never resolves a tag does not load sif.py.
        from tfimage.agent.core.sif import this_platform

        return self.platform or this_platform()

    def staging(self) -> Config:
        """This config with the controller's staging cache where a node's cache is
        (the same pull, locks, checks and eviction: stage/)."""
        import dataclasses

        return dataclasses.replace(self, cache_dir=self.stage_dir)

    def staging_owners(self) -> frozenset[int]:
        """Root's uid and Slurm's user's, where this node knows that user."""
        import pwd

        try:
            return frozenset({0, pwd.getpwnam(self.slurm_user).pw_uid})
        except KeyError:
            return frozenset({0})

    def sources(self, ref: Reference) -> list[str]:
        """Where to fetch ``ref``: for the site's registry, this node's rack mirrors,
        the registry, then the mirrors, in order, each once; else its registry."""
        if ref.registry == self.registry:
            racks = self.node_mirrors()[2] if self.rack_mirrors else ()
            return list(dict.fromkeys((*racks, ref.registry, *self.mirrors)))
        return [ref.registry]

    def is_rack_mirror(self, host: str) -> bool:
        """Whether ``host`` is one of this node's rack mirrors (asked before the
        registry: whatever it fails with, the registry is asked next)."""
        return bool(self.rack_mirrors) and host in self.node_mirrors()[2]

    def mount_drivers(self, origin: str | None) -> tuple[str, ...]:
        """The image mount drivers to try for a cached image, in order.  ``origin`` is
        where its bytes were pulled from (``registry/repository``, the cache's
        metadata, never the name a later job used for the same digest): ``kernel``
        only for the site's registry (or a mirror) and a repository matching
        ``image_mount_kernel``, where ``*`` matches within one path segment."""
        host, _, repository = (origin or "").partition("/")
        trusted = host in (self.registry, *self.all_mirrors) and any(
            segment_glob(g).match(repository) for g in self.image_mount_kernel
        )
        return tuple(d for d in self.image_mount if d != "kernel" or trusted)

    def reference(self, text: str) -> Reference:
        """Parse ``text`` with this site's defaults and allowlist."""
        ref = parse_reference(
            text,
            self.registry,
            self.project,
            dockerhub_project=self.dockerhub_project or None,
            rewrites=tuple(self.registry_rewrites.items()),
        )
        check_allowed(ref, self.allowlist)
        return ref


_TUPLES = {
    "mirrors",
    "keep_images",
    "allowed_registries",
    "default_binds",
    "bind_prefixes",
    "token_realms",
    "image_mount_kernel",
}
_FLOATS = {
    "connect_timeout",
    "read_timeout",
    "hook_deadline",
    "stage_deadline",
    "cache_high_watermark",
    "cache_low_watermark",
    "cache_min_age",
}
# Settings that may be 0 (off).
_OFF_FLOATS = {"pull_jitter"}
_BOOLS = {"single_task_tf_config", "stage", "record_digest"}
_INTS = {
    "pull_connections": (1, 16),
    "pull_stripe_bytes": (1 << 16, 1 << 28),
    "step_max_tasks": (1, 1 << 20),
}

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _coerce(key: str, value: Any, path: Path) -> Any:
    if key == "gpu":
        return gpu_policy(value, path)
    if key == "access":
        return access_rules(value, path)
    if key == "rack_mirrors":
        return rack_mirrors(value, path)
    if key in _OFF_FLOATS:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 600:
            raise ConfigError(f"{path}: '{key}' must be a number of seconds from 0 to 600")
        return float(value)
    if key == "partitions":
        return partition_rules(value, path)
    if key == "image_mount":
        drivers = [value] if isinstance(value, str) else value
        if (
            not isinstance(drivers, list)
            or not drivers
            or not all(isinstance(d, str) and d in MOUNT_DRIVERS for d in drivers)
            or len(set(drivers)) != len(drivers)
        ):
            raise ConfigError(
                f"{path}: 'image_mount' must be one or more of {', '.join(MOUNT_DRIVERS)}, "
                "in order of preference, each once"
            )
        return tuple(drivers)
    if key == "site_env":
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and _ENV_NAME.match(k) and isinstance(v, str)
            for k, v in value.items()
        ):
            raise ConfigError(f"{path}: 'site_env' must map variable names to strings")
        return dict(value)
    if key == "dockerhub_project":
        if not isinstance(value, str) or not (value == "" or is_repository_path(value)):
            raise ConfigError(f"{path}: 'dockerhub_project' must be a project name, e.g. dockerhub")
        return value
    if key == "registry_rewrites":
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ConfigError(
                f"{path}: 'registry_rewrites' must map upstream prefixes to the site's, "
                "e.g. {nvcr.io: harbor.example.org/nvcr}"
            )
        for upstream, site in value.items():
            try:
                check_rewrite(upstream, site)
            except ImageReferenceError as e:
                raise ConfigError(f"{path}: 'registry_rewrites': {e}") from None
        return dict(value)
    if key == "tf_port_range":
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or not 1024 <= value[0] <= value[1] <= 65535
        ):
            raise ConfigError(f"{path}: 'tf_port_range' must be [low, high] within 1024-65535")
        return (value[0], value[1])
    if key == "cache_max_bytes":
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value <= 0
        ):
            raise ConfigError(f"{path}: 'cache_max_bytes' must be a positive integer")
        return value
    if key in _INTS:
        low, high = _INTS[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(f"{path}: '{key}' must be an integer from {low} to {high}")
        if key == "pull_stripe_bytes" and value % 4096:
            # O_DIRECT writes whole aligned blocks (cache/download.py)
            raise ConfigError(f"{path}: 'pull_stripe_bytes' must be a multiple of 4096")
        return value
    if key in _BOOLS:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: '{key}' must be true or false")
        return value
    if key in _TUPLES:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{path}: '{key}' must be a list of strings")
        return tuple(value)
    if key in _FLOATS:
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConfigError(f"{path}: '{key}' must be a positive number")
        return float(value)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{path}: '{key}' must be a string")
    return value


_PLATFORM = re.compile(r"linux/[a-z0-9]{1,16}\Z")


def config_from_mapping(data: dict[str, Any], path: Path = DEFAULT_PATH) -> Config:
    data = dict(data)
    known = {f.name for f in fields(Config) if f.metadata.get("setting", True)}
    if said := unknown_settings(data, known):
        raise ConfigError(f"{path}: unknown setting(s): {said}")
    values = {k: _coerce(k, v, path) for k, v in data.items()}
    cfg = Config(**values)
    if cfg.runtime not in RUNTIMES:
        raise ConfigError(f"{path}: runtime must be one of {', '.join(RUNTIMES)}")
    if not 0 < cfg.cache_low_watermark <= cfg.cache_high_watermark <= 100:
        raise ConfigError(f"{path}: watermarks need 0 < low <= high <= 100")
    _check_upstreams(cfg, path)
    if cfg.platform and not _PLATFORM.match(cfg.platform):
        raise ConfigError(
            f"{path}: 'platform' must be linux/<architecture> as OCI names it"
            f" (linux/amd64, linux/arm64), not {cfg.platform[:80]!r}"
        )
    for key in ("cache_dir", "state_dir", "hook_log", "ib_sysfs", "stage_dir"):
        if not str(getattr(cfg, key)).startswith("/"):
            raise ConfigError(f"{path}: '{key}' must be an absolute path")
    if os.path.normpath(cfg.stage_dir) == os.path.normpath(cfg.cache_dir):
        # Two caches with their own holders and eviction: a staging pull holds its
        # image only while it is broadcast.
        raise ConfigError(f"{path}: 'stage_dir' must not be 'cache_dir'")
    for key in ("usage_log", "metrics_dir"):
        value = getattr(cfg, key)
        if value is None or (value and not value.startswith("/")):
            raise ConfigError(f"{path}: '{key}' must be an absolute path, or \"\" for none")
    for text in cfg.keep_images:
        try:
            cfg.reference(text)
        except TfimageError as e:
            raise ConfigError(f"{path}: 'keep_images': {e}") from None
    for rule in cfg.partitions:
        if rule.default_image:
            try:
                cfg.reference(rule.default_image)
            except TfimageError as e:
                raise ConfigError(
                    f"{path}: 'partitions': {rule.glob!r}: 'default_image': {e}"
                ) from None
    return cfg


def _check_upstreams(cfg: Config, path: Path) -> None:
    """A rewrite never leads to another (a pinned name is parsed again on the node and
    must map to itself), and the kernel's squashfs is never trusted with what the
    site's registry only proxies: anyone may push to Docker Hub or ghcr.io."""
    upstreams = [*DOCKER_HUB, *cfg.registry_rewrites]
    for site in cfg.registry_rewrites.values():
        if any(site == u or site.startswith(f"{u}/") for u in upstreams):
            raise ConfigError(f"{path}: 'registry_rewrites': {site!r} is itself rewritten")
    proxied = [cfg.dockerhub_project] if cfg.dockerhub_project else []
    proxied += [
        site.partition("/")[2]
        for site in cfg.registry_rewrites.values()
        if site.partition("/")[0] in (cfg.registry, *cfg.all_mirrors)
    ]
    for glob in cfg.image_mount_kernel:
        parts = glob.split("/")
        for project in proxied:
            under = project.split("/")
            if len(parts) > len(under) and all(
                segment_glob(g).match(u) for g, u in zip(parts, under, strict=False)
            ):
                raise ConfigError(
                    f"{path}: 'image_mount_kernel': {glob!r} would trust {project}/, which "
                    "the registry only proxies from upstream: list the site's own projects"
                )


def compiled_path(path: Path) -> Path:
    """Where ``tfimage config-compile`` puts the JSON form of ``path``."""
    return path.with_name(path.name + ".json")


def _yaml_stamp(st: os.stat_result) -> dict[str, int]:
    return {"ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _compiled(p: Path, st: os.stat_result) -> dict[str, Any] | None:
    """The settings from the compiled JSON, if it was made from exactly this file.

    ``import yaml`` alone costs ~25 ms, paid by every hook and by the submit and
    step helpers on a job's launch path; the JSON costs ~1 ms.  It is used only when
    owned like the YAML, not writable by others, and recorded for the YAML's current
    inode, size and mtime: an edited config falls back to the YAML, never to stale
    settings.
    """
    import json

    c = compiled_path(p)
    try:
        cst = c.stat()
        if cst.st_uid != st.st_uid or cst.st_mode & 0o022:
            return None
        doc = json.loads(c.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("made_from") != _yaml_stamp(st):
        return None
    data = doc.get("settings")
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def _reading(p: Path) -> Iterator[None]:
    """One message for a config file that can't be read, whatever step hit it."""
    try:
        yield
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror}") from None


def _parse_yaml(p: Path) -> dict[str, Any]:
    import yaml

    with _reading(p):
        raw = p.read_text()
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{p}: not valid YAML: {where}{problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: must be a mapping of settings")
    return data


def _trusted(p: Path, st: os.stat_result) -> None:
    """Root reads only a config root owns and nobody else may write: the config
    names what root runs, mounts and trusts.  (A user's own helper may read any.)"""
    if os.geteuid() != 0:
        return
    if st.st_uid != 0:
        raise ConfigError(f"{p}: not owned by root; root reads only a root-owned config")
    if st.st_mode & 0o022:
        raise ConfigError(
            f"{p}: mode {stat.S_IMODE(st.st_mode):04o} lets others write it; chmod go-w it"
        )


def load_config(path: str | Path | None = None) -> Config:
    p = Path(path) if path else DEFAULT_PATH
    with _reading(p):
        st = p.stat()
    _trusted(p, st)
    data = _compiled(p, st)
    return config_from_mapping(_parse_yaml(p) if data is None else data, p)


def compile_config(path: str | Path | None = None) -> Path:
    """Check ``path`` and write its JSON form beside it, atomically, mode 0644."""
    import json
    import tempfile

    p = Path(path) if path else DEFAULT_PATH
    with _reading(p):
        st = p.stat()
    data = _parse_yaml(p)
    config_from_mapping(data, p)  # never compile what would not load
    out = compiled_path(p)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"made_from": _yaml_stamp(st), "settings": data}, f, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return out

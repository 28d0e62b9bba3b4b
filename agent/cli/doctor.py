"""``tfimage doctor``: is this node wired up the way tfimage needs?

Each check returns diagnoses; a diagnosis says what is wrong and what to do about it.
Exit status: 0 all in order, 1 warnings only, 2 at least one error.  Checks never
change anything on the node, and every program they run has a deadline.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import psutil

from tfimage.agent.cli.slurmconf import hook_scripts, read_plugstack, read_slurm_conf
from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.errors import TfimageError
from tfimage.agent.core.wire import HOOK_GRACE

Level = Literal["ok", "info", "warning", "error"]
_RANK = {"ok": 0, "info": 0, "warning": 1, "error": 2}
_DEADLINE = 20.0


@dataclass(frozen=True)
class Diagnosis:
    check: str
    level: Level
    message: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class Context:
    config_path: Path
    slurm_conf: Path
    login: bool = False
    controller: bool = False
    fuse_conf: Path = Path("/etc/fuse.conf")
    dev_dir: Path = Path("/dev")  # where a GPU node has nvidia0, nvidia1, ...
    cfg: Config | None = None
    # slurm.conf, read once for every check that needs it
    slurm: dict[str, str] | None = None
    slurm_error: str = ""


def exit_status(diagnoses: list[Diagnosis]) -> int:
    return max((_RANK[f.level] for f in diagnoses), default=0)


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=_DEADLINE, env=env, check=False
    )


def check_config(ctx: Context) -> Iterator[Diagnosis]:
    try:
        ctx.cfg = load_config(ctx.config_path)
    except TfimageError as e:
        yield Diagnosis("config", "error", str(e), f"fix {ctx.config_path} (see docs/config.md)")
        return
    yield Diagnosis("config", "ok", f"{ctx.config_path} is valid (registry {ctx.cfg.registry})")


def _slurm(ctx: Context) -> dict[str, str] | None:
    """slurm.conf's settings, or None (and ``ctx.slurm_error``) when it can't be read."""
    if ctx.slurm is None and not ctx.slurm_error:
        try:
            ctx.slurm = read_slurm_conf(ctx.slurm_conf)
        except OSError as e:
            ctx.slurm_error = f"{ctx.slurm_conf}: {e.strerror}"
    return ctx.slurm


def check_plugin(ctx: Context) -> Iterator[Diagnosis]:
    conf = _slurm(ctx)
    if conf is None:
        yield Diagnosis("plugin", "error", ctx.slurm_error, "set SLURM_CONF or install Slurm")
        return
    plugstack = Path(conf.get("plugstackconfig") or ctx.slurm_conf.parent / "plugstack.conf")
    try:
        entries = read_plugstack(plugstack)
    except OSError as e:
        yield Diagnosis(
            "plugin", "error", f"{plugstack}: {e.strerror}", "deploy the role (plugstack.conf)"
        )
        return
    mine = [e for e in entries if os.path.basename(e.path) == "spank_tfimage.so"]
    if not mine:
        yield Diagnosis(
            "plugin",
            "error",
            f"no spank_tfimage.so line in {plugstack} or its includes",
            "add plugstack.conf.d/tfimage.conf (the Ansible role does)",
        )
        return
    entry = mine[-1]
    so = Path(entry.path)
    if not so.is_absolute():
        so = Path(conf.get("plugindir", "/usr/lib/x86_64-linux-gnu/slurm-wlm")) / so
    if not so.is_file():
        yield Diagnosis(
            "plugin",
            "error",
            f"{so} (named in {entry.conf_file}) does not exist",
            "rebuild and install the plugin",
        )
        return
    yield Diagnosis("plugin", "ok", f"{so} listed in {entry.conf_file}")
    args = dict(a.split("=", 1) for a in entry.args if "=" in a)
    helper = args.get("helper", "")
    if helper and not os.access(helper, os.X_OK):
        yield Diagnosis(
            "plugin",
            "error",
            f"helper={helper} is not executable",
            "install the tfimage venv or fix helper= in the drop-in",
        )
    daemon = args.get("daemon", "")
    if daemon and not ctx.login:
        yield _daemon_diagnosis(daemon, "every step and hook starts Python itself")
    pin_socket = args.get("pin_socket", "")
    if pin_socket:
        yield _daemon_diagnosis(pin_socket, "every submission starts Python itself to pin")
    env = dict(os.environ, SLURM_CONF=str(ctx.slurm_conf))
    try:
        out = _run(["srun", "--help"], env)
    except FileNotFoundError:
        yield Diagnosis("plugin", "error", "srun is not installed", "install slurm-client")
        return
    except subprocess.TimeoutExpired:
        yield Diagnosis("plugin", "error", "srun --help did not finish", "check the plugin")
        return
    if "--tf-image" in out.stdout:
        yield Diagnosis("plugin", "ok", "srun --help lists --tf-image: Slurm loads the plugin")
    else:
        tail = (out.stderr.strip().splitlines() or [""])[-1][:200]
        yield Diagnosis(
            "plugin",
            "error",
            f"srun --help does not list --tf-image {tail}".strip(),
            "check plugstack.conf and the plugin's build against this Slurm",
        )


def _daemon_diagnosis(path: str, without: str) -> Diagnosis:
    """``without``: what happens while no daemon answers on ``path``."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(path)
        except OSError as e:
            return Diagnosis(
                "daemon",
                "warning",
                f"no tfimage daemon answers on {path} ({e.strerror or e}): {without} "
                "(slower, still correct)",
                "start it: systemctl start tfimage-daemon (the role installs the unit)",
            )
    return Diagnosis("daemon", "ok", f"tfimage daemon answers on {path}")


def _hook(conf: dict[str, str], key: str, program: str) -> Diagnosis:
    value = conf.get(key.lower(), "")
    if not value:
        return Diagnosis(
            "hooks",
            "error",
            f"{key}= is not set in slurm.conf",
            f"set {key}= to a script (or prolog.d-style glob) running {program}",
        )
    for script in hook_scripts(value):
        if _runs(script, program):
            return Diagnosis("hooks", "ok", f"{key} runs {program} ({script})")
    return Diagnosis(
        "hooks",
        "error",
        f"no script of {key}={value} runs {program}",
        f"add a {key.lower()}.d script that execs {program}",
    )


def check_hooks(ctx: Context) -> Iterator[Diagnosis]:
    conf = _slurm(ctx)
    if conf is None:
        return  # check_plugin reported it
    yield _hook(conf, "Prolog", "tfimage-prolog")
    yield _hook(conf, "Epilog", "tfimage-epilog")
    flags = [f.strip().lower() for f in conf.get("prologflags", "").split(",")]
    if "alloc" in flags:
        yield Diagnosis("hooks", "ok", "PrologFlags has Alloc")
    else:
        yield Diagnosis(
            "hooks",
            "error",
            "PrologFlags lacks Alloc: images are pulled too late",
            "add Alloc to PrologFlags in slurm.conf",
        )
    timeout = conf.get("prologepilogtimeout", "")
    if ctx.cfg is not None and timeout.isdigit():
        # slurmd kills a hook that outlives it, and drains the node.
        need = ctx.cfg.hook_deadline + HOOK_GRACE
        if need >= int(timeout):
            yield Diagnosis(
                "hooks",
                "error",
                f"hook_deadline ({ctx.cfg.hook_deadline:g} s) + {HOOK_GRACE} s of grace is not "
                f"below PrologEpilogTimeout ({timeout} s): a slow pull would drain the node",
                "lower hook_deadline in the tfimage config or raise PrologEpilogTimeout",
            )
        else:
            yield Diagnosis(
                "hooks", "ok", f"hook_deadline ends before PrologEpilogTimeout={timeout}"
            )


def check_stage(ctx: Context) -> Iterator[Diagnosis]:
    """The controller's one pull per multi-node job: PrologSlurmctld runs the stage
    hook, stage_deadline ends before PrologEpilogTimeout, the staging cache is root's
    alone on a local file system, and sbcast is there."""
    conf = _slurm(ctx)
    if ctx.cfg is None or conf is None:
        return
    values = conf.get("prologslurmctld", "")
    ours = [p for p in hook_scripts(values) if _runs(p, "tfimage-stage")]
    if ours:
        yield Diagnosis("stage", "ok", f"PrologSlurmctld runs tfimage-stage ({ours[0]})")
    else:
        yield Diagnosis(
            "stage",
            "warning",
            f"PrologSlurmctld={values or '(unset)'} does not run tfimage-stage: every node "
            "of a multi-node job pulls its image from the registry",
            "set tfimage_stage: true for the role's controller play",
        )
    timeout = conf.get("prologepilogtimeout", "")
    if timeout.isdigit() and ctx.cfg.stage_deadline + HOOK_GRACE >= int(timeout):
        yield Diagnosis(
            "stage",
            "error",
            f"stage_deadline ({ctx.cfg.stage_deadline:g} s) + {HOOK_GRACE} s is not below "
            f"PrologEpilogTimeout ({timeout} s): slurmctld would kill the hook and requeue the job",
            "lower stage_deadline in the tfimage config",
        )
    elif ours:
        yield Diagnosis("stage", "ok", "stage_deadline ends before PrologEpilogTimeout")
    yield from _stage_dir(Path(ctx.cfg.stage_dir))
    from tfimage.agent.core.toolrun import slurm_tool

    sbcast = slurm_tool("sbcast", ctx.cfg.gpu.slurm_bin)
    try:  # sbcast reads slurm.conf before it says its version
        out = _run([sbcast, "--version"], {**os.environ, "SLURM_CONF": str(ctx.slurm_conf)})
    except (OSError, subprocess.TimeoutExpired) as e:
        yield Diagnosis("stage", "error", f"{sbcast}: {e}", "install slurm-client")
        return
    version = (out.stdout or out.stderr).strip()
    yield Diagnosis("stage", "ok" if out.returncode == 0 else "error", f"sbcast: {version}")


def _stage_dir(path: Path) -> Iterator[Diagnosis]:
    try:
        st = path.lstat()
    except FileNotFoundError:
        yield Diagnosis(
            "stage", "warning", f"{path} does not exist yet", f"install -d -o root -m 0700 {path}"
        )
        return
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or mode & 0o077:
        yield Diagnosis(
            "stage",
            "error",
            f"{path} must be a directory root alone may enter (found mode {mode:o}, "
            f"uid {st.st_uid})",
            f"chown root:root {path}; chmod 0700 {path}",
        )
        return
    fs = _filesystem(path)
    if fs in _NETWORK_FS:
        yield Diagnosis(
            "stage",
            "warning",
            f"{path} is on {fs}: its per-digest locks and renames want a local disk",
            "point stage_dir at a local file system",
        )
    else:
        yield Diagnosis("stage", "ok", f"{path} is root's, on {fs or 'a local file system'}")


_NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs", "fuse.sshfs"})


def _filesystem(path: Path) -> str:
    """The file system type of the mount ``path`` is on (the longest mount point)."""
    best, kind = "", ""
    target = str(path.resolve())
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (target == mp or target.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
            best, kind = mp, part.fstype
    return kind


def _runs(script: Path, program: str) -> bool:
    try:
        with script.open("rb") as f:
            return program.encode() in f.read(1 << 16)
    except OSError:
        return False


def check_runtime(ctx: Context) -> Iterator[Diagnosis]:
    if ctx.cfg is None:
        return
    from tfimage.agent.step.runtime import runtime_for

    try:
        rt = runtime_for(ctx.cfg.runtime, ctx.cfg.runtime_path)
    except TfimageError as e:
        yield Diagnosis("runtime", "error", str(e), f"install {ctx.cfg.runtime}")
        return
    # ch-run refuses to start at all without $USER, which cron and hooks may lack.
    env = dict(os.environ, USER=os.environ.get("USER") or "root")
    try:
        out = _run([rt.exe, "--version"], env)
    except (OSError, subprocess.TimeoutExpired) as e:
        yield Diagnosis("runtime", "error", f"{rt.exe} --version failed: {e}", "reinstall it")
        return
    version = (out.stdout.strip() or out.stderr.strip()).splitlines()[:1]
    if out.returncode != 0:
        yield Diagnosis(
            "runtime",
            "error",
            f"{rt.exe} --version exited {out.returncode}",
            "reinstall the runtime",
        )
        return
    yield Diagnosis("runtime", "ok", f"{ctx.cfg.runtime}: {rt.exe} {' '.join(version)}")
    if rt.needs_mount:
        import shutil

        if not shutil.which("squashfuse", path="/usr/local/bin:/usr/bin:/bin"):
            yield Diagnosis(
                "runtime", "error", "squashfuse is not installed", "install squashfuse and fuse3"
            )
        try:
            fuse = ctx.fuse_conf.read_text()
        except OSError:
            fuse = ""
        if not any(line.strip() == "user_allow_other" for line in fuse.splitlines()):
            yield Diagnosis(
                "runtime",
                "error",
                f"{ctx.fuse_conf} lacks user_allow_other",
                "add user_allow_other: tasks read the root-made image mounts",
            )


def check_registry(ctx: Context) -> Iterator[Diagnosis]:
    if ctx.cfg is None:
        return
    from tfimage.agent.registry.access import client_for

    cfg = ctx.cfg
    node, group, racks = cfg.node_mirrors()
    order = list(dict.fromkeys((*racks, cfg.registry, *cfg.mirrors)))
    if cfg.rack_mirrors:
        rack = f"rack {group}" if group else "no rack_mirrors group"
        yield Diagnosis(
            "registry", "ok", f"node {node} ({rack}) pulls from {', then '.join(order)}"
        )
    for host in order:
        try:
            client_for(cfg, host, light=True).ping()
        except TfimageError as e:
            if host in racks:  # pulls go on to the registry, slower
                yield Diagnosis(
                    "registry", "warning", f"rack mirror: {e}", "pulls skip it; check the mirror"
                )
                continue
            yield Diagnosis(
                "registry", "error", str(e), "check the network, ca_bundle and the credentials file"
            )
        else:
            yield Diagnosis("registry", "ok", f"{host} reachable, credentials accepted")


def check_cache(ctx: Context) -> Iterator[Diagnosis]:
    if ctx.cfg is None:
        return
    root = Path(ctx.cfg.cache_dir)
    try:
        st = root.lstat()
    except FileNotFoundError:
        yield Diagnosis(
            "cache",
            "warning",
            f"{root} does not exist yet",
            f"create it: install -d -o root -m 0755 {root}",
        )
        return
    if not stat.S_ISDIR(st.st_mode):
        yield Diagnosis(
            "cache", "error", f"{root} is not a directory", "remove it; make a directory"
        )
    elif st.st_uid != 0:
        yield Diagnosis(
            "cache", "error", f"{root} is owned by uid {st.st_uid}, not root", f"chown root {root}"
        )
    elif st.st_mode & 0o022:
        yield Diagnosis(
            "cache",
            "error",
            f"{root} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})",
            f"chmod go-w {root}",
        )
    else:
        disk = psutil.disk_usage(str(root))
        level: Level = "ok"
        if disk.percent >= 95:
            level = "error"
        elif disk.percent >= ctx.cfg.cache_high_watermark:
            level = "warning"
        yield Diagnosis(
            "cache",
            level,
            f"{root} root-owned; its filesystem {disk.percent:.0f}% full, "
            f"{disk.free >> 30} GiB free",
            "tfimage cache prune (it runs from the maintenance timer), or make room"
            if level != "ok"
            else "",
        )


def check_leftovers(ctx: Context) -> Iterator[Diagnosis]:
    """squashfuse processes whose image mount is gone: a job's image that nothing
    unmounted (a killed epilog), still holding the image file open."""
    if ctx.cfg is None:
        return
    state = Path(ctx.cfg.state_dir)
    ours_under = (f"{state / 'jobs'}/", f"{state / 'images'}/")  # imagemount.py's
    with open("/proc/self/mountinfo") as f:
        mounted = {line.split()[4] for line in f}
    left = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        cmd = proc.info.get("cmdline") or []
        fuse = proc.info.get("name") in ("squashfuse", "squashfuse_ll")  # image_mount's
        ours = fuse and cmd and cmd[-1].startswith(ours_under)
        if ours and cmd[-1] not in mounted:
            left.append(f"{proc.info['pid']} ({cmd[-1]})")
    if left:
        yield Diagnosis(
            "mounts",
            "warning",
            f"squashfuse without its mount: {', '.join(left[:5])}",
            "kill those processes; tfimage-epilog unmounts the images no job uses",
        )
    else:
        yield Diagnosis("mounts", "ok", "no leftover image mount process")


def check_nvml(ctx: Context) -> Iterator[Diagnosis]:
    try:
        import pynvml
    except ImportError:
        yield Diagnosis("nvml", "warning", "nvidia-ml-py is not installed", "reinstall tfimage")
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        gpus = sorted(p.name for p in ctx.dev_dir.glob("nvidia[0-9]*"))
        if gpus:
            yield Diagnosis(
                "nvml",
                "error",
                f"{len(gpus)} GPU device file(s) in {ctx.dev_dir} ({', '.join(gpus[:4])}) "
                "but no NVML (libnvidia-ml.so.1 not found): GPU jobs cannot be checked",
                "install the NVIDIA driver's libnvidia-ml.so.1 (the driver's utils package)",
            )
        else:
            yield Diagnosis(
                "nvml",
                "info",
                "no NVIDIA driver here (no libnvidia-ml.so.1, no /dev/nvidia*): "
                "GPU checks are off on this node",
            )
        return
    except pynvml.NVMLError as e:
        yield Diagnosis(
            "nvml", "error", f"NVML does not initialise: {e}", "check the driver (nvidia-smi)"
        )
        return
    try:
        count = pynvml.nvmlDeviceGetCount()
        for i in range(count):
            pynvml.nvmlDeviceGetHandleByIndex(i)
        driver = pynvml.nvmlSystemGetDriverVersion()
        yield Diagnosis("nvml", "ok", f"driver {driver}, {count} GPU(s) answer")
    except pynvml.NVMLError as e:
        yield Diagnosis("nvml", "error", f"NVML: {e}", "check the GPUs (nvidia-smi -q)")
    finally:
        pynvml.nvmlShutdown()


Check = Callable[[Context], Iterator[Diagnosis]]
ALL: tuple[Check, ...] = (
    check_config,
    check_plugin,
    check_hooks,
    check_runtime,
    check_registry,
    check_cache,
    check_leftovers,
    check_nvml,
)
LOGIN: tuple[Check, ...] = (check_config, check_plugin, check_registry)
CONTROLLER: tuple[Check, ...] = (check_config, check_stage, check_registry)


def run_checks(ctx: Context) -> list[Diagnosis]:
    out: list[Diagnosis] = []
    for check in CONTROLLER if ctx.controller else LOGIN if ctx.login else ALL:
        try:
            out.extend(check(ctx))
        except Exception as e:  # one check's bug must not hide the others
            name = check.__name__.removeprefix("check_")
            out.append(Diagnosis(name, "error", f"check failed: {type(e).__name__}: {e}"))
    return out

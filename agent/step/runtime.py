"""Runtime adapters: the argv that puts a task inside the image.

Each adapter turns a :class:`StepSpec` into the argv prefix placed before the
task's own command.  Neither uses a "clean environment" mode: ``TF_CONFIG`` and
the rest of the task's environment must reach the task.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tfimage.agent.cache import imagefs
from tfimage.agent.core.errors import RuntimeSetupError


@dataclass(frozen=True, slots=True)
class Bind:
    src: str
    dst: str
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class StepSpec:
    """What a step needs from the runtime; every path is already validated."""

    workdir: str | None
    home: str | None
    binds: tuple[Bind, ...] = field(default_factory=tuple)
    gpus: bool = False
    # The host's GPU driver, file by file (gpudriver.py): charliecloud's alone.
    driver: tuple[Bind, ...] = field(default_factory=tuple)

    def files(self) -> list[str]:
        """Files that must exist in the container for the driver's binds to land."""
        return sorted({b.dst for b in self.driver})

    def mountpoints(self) -> list[str]:
        """Directories that must exist in the container for the binds to land."""
        points = [b.dst for b in self.all_binds()]
        return sorted(set(points))

    def all_binds(self) -> list[Bind]:
        out: list[Bind] = []
        for path in (self.home, self.workdir):
            if path and path != "/" and not any(b.dst == path for b in out):
                out.append(Bind(path, path))
        out.extend(b for b in self.binds if not any(o.dst == b.dst for o in out))
        return out


def _find(name: str, configured: str | None) -> str:
    path = configured or shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
    if not path:
        raise RuntimeSetupError(f"runtime '{name}' is not installed on this node")
    return path


class Charliecloud:
    """``ch-run`` on the squashfs partition the node mounted (needs a root dir)."""

    name = "charliecloud"
    needs_mount = True
    # ch-run mounts its own /dev, /proc, /sys and /tmp and fails when an image lacks
    # the directories (images converted from OCI layers often do).
    required_dirs = ("/dev", "/proc", "/sys", "/tmp")  # noqa: S108 - mount points, not files

    def __init__(self, ch_run: str | None = None) -> None:
        self.exe = _find("ch-run", ch_run)

    def prefix(self, root: Path, spec: StepSpec) -> list[str]:
        argv = [self.exe, "--no-passwd"]
        # The image's own environment (its config's Env, as the converter writes it):
        # ch-run reads /ch/environment inside the image.  Root follows no link of the
        # image's to look (cache/imagefs.py).
        if imagefs.is_regular(root, "ch/environment"):
            argv += ["--env-no-expand", "--set-env"]  # OCI Env values are literal
        for b in (*spec.all_binds(), *spec.driver):
            argv += ["-b", f"{b.src}:{b.dst}"]
        if spec.workdir:
            argv += ["-c", spec.workdir]
        return [*argv, str(root), "--"]


class Apptainer:
    """``apptainer exec`` (or ``singularity exec``) straight on the cached SIF."""

    needs_mount = False
    required_dirs: tuple[str, ...] = ()

    def __init__(
        self, name: str = "apptainer", exe: str | None = None, nvccli: bool = False
    ) -> None:
        self.name = name
        self.exe = _find(name, exe)
        self.nvccli = nvccli

    def prefix(self, sif: Path, spec: StepSpec) -> list[str]:
        argv = [self.exe, "exec"]
        if spec.gpus:
            argv += ["--nv", "--nvccli"] if self.nvccli else ["--nv"]
        for b in spec.binds:
            argv += ["-B", f"{b.src}:{b.dst}:{'ro' if b.read_only else 'rw'}"]
        if spec.workdir:
            argv += ["--pwd", spec.workdir]
        return [*argv, str(sif)]


Runtime = Charliecloud | Apptainer


def runtime_for(name: str, exe: str | None = None, *, nvccli: bool = False) -> Runtime:
    if name == "charliecloud":
        return Charliecloud(exe)
    if name in ("apptainer", "singularity"):
        return Apptainer(name, exe, nvccli)
    raise RuntimeSetupError(f"unknown runtime {name!r}")

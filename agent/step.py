"""Node side of a job: make the image ready and say how to run a task in it.

Called as root, by the prolog (once per job) and by the SPANK plugin's helper
(once per step).  Every input comes from a job and is checked before use.
"""

from __future__ import annotations

import pwd
from dataclasses import dataclass
from pathlib import Path

from tfimage.agent import mounts
from tfimage.agent.cache import CachedImage, ImageCache
from tfimage.agent.config import Config
from tfimage.agent.errors import RuntimeSetupError
from tfimage.agent.runtime import Bind, StepSpec, runtime_for


@dataclass(frozen=True, slots=True)
class StepRequest:
    job_id: str
    step_id: str
    uid: int
    image: str
    workdir: str | None = None
    script: str | None = None
    gpus: bool = False


def prepare_job(
    cfg: Config, job_id: str, image: str, cache: ImageCache | None = None
) -> CachedImage:
    """Prolog: pull the image into the node cache and mount it if the runtime needs it."""
    ref = cfg.reference(image)
    cached = (cache or ImageCache(cfg)).ensure(ref)
    if runtime_for(cfg.runtime, cfg.runtime_path).needs_mount:
        assert cached.ref.digest
        with mounts.job_lock(cfg.state_dir, job_id):
            mounts.mount_image(cfg.state_dir, job_id, cached.path, cached.ref.digest)
    return cached


def _home_of(uid: int) -> str | None:
    try:
        home = pwd.getpwuid(uid).pw_dir
    except KeyError:
        return None
    return home if home.startswith("/") and home != "/" else None


def prepare_step(cfg: Config, req: StepRequest, cache: ImageCache | None = None) -> list[str]:
    """Return the argv prefix that runs a task of this step inside its image."""
    if req.uid == 0:
        raise RuntimeSetupError("refusing to run a container task as root")
    workdir = mounts.safe_abspath(req.workdir, "working directory") if req.workdir else None
    binds: list[Bind] = []
    if req.script:
        script = mounts.safe_abspath(req.script, "batch script")
        # The script lives in the slurmd spool, which no runtime binds by itself.
        binds.append(Bind(str(Path(script).parent), str(Path(script).parent), read_only=True))
    spec = StepSpec(workdir=workdir, home=_home_of(req.uid), binds=tuple(binds), gpus=req.gpus)

    cached = prepare_job(cfg, req.job_id, req.image, cache)
    runtime = runtime_for(cfg.runtime, cfg.runtime_path)
    if not runtime.needs_mount:
        return runtime.prefix(cached.path, spec)
    assert cached.ref.digest
    with mounts.job_lock(cfg.state_dir, req.job_id):
        image_dir = mounts.mount_image(cfg.state_dir, req.job_id, cached.path, cached.ref.digest)
        root = mounts.step_root(
            cfg.state_dir, req.job_id, req.step_id, image_dir, spec.mountpoints()
        )
    return runtime.prefix(root, spec)

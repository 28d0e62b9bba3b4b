"""Node side of a job: make the image ready and say how to run a task in it.

Called as root, by the prolog (once per job) and by the SPANK plugin's helper
(once per step).  Every input comes from a job and is checked before use.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pwd
from dataclasses import dataclass, field
from pathlib import Path

from tfimage.agent.cache.pull import CachedImage, Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core import wire
from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import (
    BindError,
    ImageError,
    PolicyError,
    RuntimeSetupError,
    StepLayoutError,
    TfimageError,
)
from tfimage.agent.core.logtext import oneline
from tfimage.agent.core.partition import PartitionRule, check_image, check_name, rules_for
from tfimage.agent.step import imageaccess, imagemount, slurmstubs
from tfimage.agent.step.binds import parse_site_binds, parse_user_binds, under
from tfimage.agent.step.gpudriver import LIB_DIR as DRIVER_LIB_DIR
from tfimage.agent.step.gpudriver import driver_binds
from tfimage.agent.step.gpushare import LIMIT, mps_memory_limit
from tfimage.agent.step.jobimages import JobImages
from tfimage.agent.step.runtime import Bind, Runtime, StepSpec, runtime_for
from tfimage.agent.step.taskenv import step_task_envs
from tfimage.agent.step.userpath import realpaths_as
from tfimage.agent.usage import jobfacts


@dataclass(frozen=True, slots=True)
class StepRequest:
    job_id: str
    step_id: str
    uid: int
    image: str
    workdir: str | None = None
    script: str | None = None
    gpus: bool = False
    layout: dict[str, str] = field(default_factory=dict)
    node_id: int = 0
    local_tasks: int = 0
    tf_mount: str = ""
    array_job: str = ""  # Slurm's, for the usage record: empty outside a job array
    array_task: str = ""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The runtime's argv prefix, and per local task the variables to set if unset."""

    argv: list[str]
    env: dict[int, dict[str, str]]
    # --tf-mount host paths, checked by each task as the user (never followed as root)
    host_paths: list[str] = field(default_factory=list)


def step_env(cfg: Config, req: StepRequest) -> dict[int, dict[str, str]]:
    """TF_CONFIG, NCCL and site variables for each local task of the step.

    The batch script has no step layout: it gets the site variables only.
    """
    if not 0 <= req.local_tasks <= cfg.step_max_tasks:
        raise StepLayoutError(f"{req.local_tasks} local tasks: more than step_max_tasks")
    if "SLURM_STEP_NODELIST" not in req.layout:
        share = mps_memory_limit(req.layout)
        extra = {LIMIT: share[0]} if share else {}
        return {i: {**cfg.site_env, **extra} for i in range(max(1, req.local_tasks))}
    return step_task_envs(
        req.layout,
        req.node_id,
        req.local_tasks,
        site_env=cfg.site_env,
        single_task_tf_config=cfg.single_task_tf_config,
        port_range=cfg.tf_port_range,
        limit=cfg.step_max_tasks,
        max_bytes=wire.MAX_ANSWER,
        ib_sysfs=Path(cfg.ib_sysfs),
    )


def _ready(
    cfg: Config,
    job_id: str,
    image: str,
    runtime: Runtime,
    cache: ImageCache | None,
    uid: int | None,
    *,
    prolog: bool = False,
    policy: tuple[str, tuple[PartitionRule, ...], str] = ("", (), ""),
    jitter: float = 0.0,
) -> tuple[CachedImage, Path | None]:
    """The job's image in the node cache, and mounted when the runtime needs that,
    once ``uid`` (the job's user, as Slurm gives it) may run it (imageaccess.py) and
    the ``policy``'s partition rules admit it: (partition, its rules, asked)."""
    ref = cfg.reference(image)
    key = str(ref.unpinned)
    images = JobImages(cfg, job_id)
    known = images.pinned(key)
    if not known and not prolog and (why := images.failure(key)):
        # The user learns of it now, not after a second wait as long as the first.
        raise ImageError(f"the prolog could not ready it on this node: {why}")
    if known and not ref.digest:
        ref = cfg.reference(known)  # what the job was pinned to, not what the tag is now
    partition, rules, asked = policy
    try:
        check_name(rules, partition, ref, asked)
        imageaccess.check_named(cfg, ref, uid)
        cache = cache or ImageCache(cfg)
        # Refused before a download or a conversion, where it can be.
        admit = functools.partial(check_image, rules, partition, ref) if rules else None
        cached = Puller(cache, jitter=jitter).ensure(ref, job=job_id, uid=uid, admit=admit)
        assert cached.ref.digest
        digest = cached.ref.digest
        # Read once, for the partition rules, access and mount trust.
        needed = cfg.access or runtime.needs_mount
        entry = cache.read_entry(digest) if rules or needed else None
        if rules and entry:  # a cache hit, a staged copy, a converted image's size
            try:
                check_image(rules, partition, cached.ref, cached.size, entry.blob is None)
            except PolicyError:
                # The job will never run it: its hold would keep it from eviction.
                cache.update_entry(digest, lambda e: e.without_holders({job_id}))
                raise
        # Where the cached bytes came from.
        origin = entry.origin if entry and needed else None
        if cfg.access:
            confirm = imageaccess.registry_confirms(cfg)
            imageaccess.check_origin(cfg, ref, cached.ref.digest, origin, uid, confirm)
        if not known:
            images.set_pinned(key, str(cached.ref))
        if not runtime.needs_mount:
            return cached, None
        image_dir = imagemount.mount_image(
            cfg.state_dir,
            job_id,
            cached.path,
            cached.ref.digest,
            cfg.mount_drivers(origin),
            private_to=uid if cache.private(origin) else None,
        )
        return cached, image_dir
    except Exception as e:
        if prolog and not known:
            with contextlib.suppress(Exception):  # the reason is logged by the caller
                images.set_failed(key, str(e) if isinstance(e, TfimageError) else repr(e))
        raise


def prepare_job(
    cfg: Config,
    job_id: str,
    image: str,
    cache: ImageCache | None = None,
    uid: int | None = None,
    partition: str = "",
    asked: str = "",
    jitter: float = 0.0,
) -> CachedImage:
    """Prolog: pull the image into the node cache and mount it if the runtime needs it.

    The pinned reference is remembered for the job, so its steps reuse exactly the
    bytes the prolog fetched without asking the registry again; a failure is
    remembered too, and the job's steps report it at once instead of trying again.
    That is how a refusal by the rule for the job's ``partition`` (core/partition.py;
    ``asked``, the ``--tf-image`` text as written) reaches each step's stderr.
    A cold pull first waits up to ``jitter`` seconds (cache/pull.py).
    """
    runtime = runtime_for(cfg.runtime, cfg.runtime_path, nvccli=cfg.gpu.nvccli)
    policy = (partition, rules_for(cfg.partitions, partition), asked)
    return _ready(
        cfg, job_id, image, runtime, cache, uid, prolog=True, policy=policy, jitter=jitter
    )[0]


def _home_of(uid: int) -> str | None:
    try:
        home = pwd.getpwuid(uid).pw_dir
    except KeyError:
        return None
    return home if home.startswith("/") and home != "/" else None


def plan_step(cfg: Config, req: StepRequest, cache: ImageCache | None = None) -> StepPlan:
    """Ready the image; say how each local task of the step runs inside it."""
    if req.uid == 0:
        raise RuntimeSetupError("refusing to run a container task as root")
    env = step_env(cfg, req)  # layout errors first: they are the user's to fix
    asked = parse_user_binds(req.tf_mount, cfg.bind_prefixes, cfg.default_binds)
    user_binds = _resolved(cfg, req.uid, asked)
    runtime = runtime_for(cfg.runtime, cfg.runtime_path, nvccli=cfg.gpu.nvccli)
    argv = _step_argv(cfg, req, runtime, user_binds, cache)
    if runtime.name == "charliecloud":
        # ch-run refuses to start without $USER; a job started without one gets it.
        try:
            user = pwd.getpwuid(req.uid).pw_name
        except KeyError:
            user = str(req.uid)
        for task in env.values():
            task.setdefault("USER", user)
            if req.gpus:  # where the driver is bound (gpudriver.py), unless set
                task.setdefault("LD_LIBRARY_PATH", DRIVER_LIB_DIR)
    _note_workers(cfg, req, env)
    _note_array(cfg, req)
    return StepPlan(argv, env, [b.src for b in user_binds])


def _note_workers(cfg: Config, req: StepRequest, env: dict[int, dict[str, str]]) -> None:
    """The step's TF worker count, for the job's usage record (the largest step's)."""
    tf_config = next((e["TF_CONFIG"] for e in env.values() if "TF_CONFIG" in e), None)
    if tf_config is None:
        return
    with contextlib.suppress(Exception):  # bookkeeping never fails a step
        workers = len(json.loads(tf_config)["cluster"]["worker"])
        jobfacts.note_max(cfg.state_dir, req.job_id, "tf_workers", workers)


BATCH_STEP = str(0xFFFFFFFB)  # Slurm's SLURM_BATCH_SCRIPT
NO_VAL = 0xFFFFFFFE


def _note_array(cfg: Config, req: StepRequest) -> None:
    """The job array's ids, for the usage record: slurmd gives the epilog none on 22.05.
    The batch step's alone (the plugin sends no other's): a launch step's come from
    the job's environment, which the user sets."""
    if not req.array_job or req.step_id != BATCH_STEP:
        return
    if not (req.array_task.isdigit() and len(req.array_task) < 11 and int(req.array_task) < NO_VAL):
        return
    with contextlib.suppress(Exception):  # bookkeeping never fails a step
        jobfacts.note(
            cfg.state_dir, req.job_id, array_job_id=req.array_job, array_task_id=req.array_task
        )


def _resolved(cfg: Config, uid: int, binds: list[Bind]) -> list[Bind]:
    """The ``--tf-mount`` binds with their host paths resolved as the user (userpath.py)
    and checked against the prefixes again: a link must not lead outside them.  The
    real path is what is bound, and each task checks, as the user, that it still
    resolves to itself (spank/node.c) before the runtime binds it."""
    out = []
    for b, real in zip(binds, realpaths_as(uid, [b.src for b in binds]), strict=True):
        if ":" in real or "," in real or os.path.normpath(real) != real:
            # ch-run and apptainer split a bind at its first ':'.
            raise BindError(
                f"--tf-mount {b.src}: it leads to {oneline(real)!r}, not a bindable path"
            )
        if not any(under(real, p) for p in cfg.bind_prefixes):
            raise BindError(
                f"--tf-mount {b.src}: it leads to {oneline(real)}, outside the allowed "
                f"prefixes ({', '.join(cfg.bind_prefixes)})"
            )
        out.append(Bind(real, b.dst, b.read_only))
    return out


def _step_argv(
    cfg: Config,
    req: StepRequest,
    runtime: Runtime,
    user_binds: list[Bind],
    cache: ImageCache | None,
) -> list[str]:
    """The argv prefix that runs a task of this step inside its image."""
    workdir = imagemount.safe_abspath(req.workdir, "working directory") if req.workdir else None
    binds = list(user_binds)
    for d in parse_site_binds(cfg.default_binds):
        # The admin's defaults: skipped where the node lacks them, and the user's win.
        if Path(d.src).exists() and not any(b.dst == d.dst for b in binds):
            binds.append(d)
    if req.script:
        script = imagemount.safe_abspath(req.script, "batch script")
        # The script lives in the slurmd spool, which no runtime binds by itself.
        binds.append(Bind(str(Path(script).parent), str(Path(script).parent), read_only=True))
    driver: tuple[Bind, ...] = ()
    if req.gpus and runtime.name == "charliecloud":
        driver = tuple(driver_binds(cfg.gpu.driver_libs, cfg.gpu.cdi_spec))
    spec = StepSpec(
        workdir=workdir, home=_home_of(req.uid), binds=tuple(binds), gpus=req.gpus, driver=driver
    )

    cached, image_dir = _ready(cfg, req.job_id, req.image, runtime, cache, req.uid)
    if image_dir is None:
        return runtime.prefix(cached.path, spec)
    # A batch script in the image: srun and its kin say why they are missing.
    scripts = slurmstubs.stubs(image_dir) if req.script else {}
    with imagemount.job_lock(cfg.state_dir, req.job_id):
        root = imagemount.step_root(
            cfg.state_dir,
            req.job_id,
            req.step_id,
            image_dir,
            [*runtime.required_dirs, *spec.mountpoints()],
            spec.files(),
            scripts,
        )
    return runtime.prefix(root, spec)

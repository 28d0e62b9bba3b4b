"""Epilog: check the job's GPUs once more, unmount and release what the job used on
this node, and record what ran.

Cleanup and bookkeeping problems are logged, never fatal: a failing Epilog would
drain the node (hooks/log.py's guarded turns every exception into one log line and exit 0).
The one exception is a GPU fault found after the job (a compute process left on its
GPUs, an ECC error): the epilog drains the node itself with a ``tfimage:`` reason
(agent/gpu/gate.py).  Every part runs whatever the others did, and each is safe
twice: a second epilog, or one after a prolog killed halfway or never run, finds
nothing and leaves nothing.  Arguments come as ``--job=VALUE`` (see the prolog);
run directly, they default to Slurm's variables.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tfimage.agent.cache.evict import abandoned_downloads, in_use
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core import layout, wire
from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.errors import InputError, NodeFault, TfimageError, cause
from tfimage.agent.core.ids import check_node, valid_job_id
from tfimage.agent.gpu.alloc import parse_gpus
from tfimage.agent.gpu.gate import drop_baseline, epilog_gate, health, load_baseline
from tfimage.agent.hooks import vestigial
from tfimage.agent.hooks.args import parse_hook_args
from tfimage.agent.hooks.log import LOG_FILE, guarded, hook_logger, log_to
from tfimage.agent.step.imagemount import release_images, release_job
from tfimage.agent.usage import jobfacts, metrics, record

# Each argument's name in the usage record is its wire name (wire.HOOK_FLAGS).
SLURM_ARGS = tuple(f.dest for f in wire.HOOK_FLAGS["tfimage-epilog"])


def main(argv: Sequence[str] | None = None) -> int:
    log = hook_logger("epilog", log_file=None)
    return guarded(log, "epilog", lambda: _epilog(argv, log))


def _epilog(argv: Sequence[str] | None, log: logging.Logger) -> int:
    args = parse_hook_args("tfimage-epilog", __doc__, argv)
    job_id = args.job_id
    if not valid_job_id(job_id):
        return 0
    try:
        cfg = load_config(args.config)
    except TfimageError:
        log_to(LOG_FILE, "epilog")
        raise
    log_to(Path(cfg.hook_log), "epilog")
    slurm = {dest: getattr(args, dest) for dest in SLURM_ARGS}
    fault: NodeFault | None = None
    cleaned = False
    try:
        # Held to the end: of two epilogs at once, one records the job.
        with jobfacts.claimed(cfg.state_dir, job_id) as facts:
            fault = _cleanup(cfg, job_id, slurm, facts, log)
            cleaned = True
    except Exception as e:  # the facts' own trouble, before or after the cleanup
        log.error("job %s: cleanup: its usage facts: %s", job_id, cause(e))
        if not cleaned:
            fault = _cleanup(cfg, job_id, slurm, {}, log)
    try:
        _reclaim(cfg, job_id, slurm["node"], log)
    except Exception as e:
        log.error("job %s: looking for jobs whose epilog never came: %s", job_id, cause(e))
    if fault:
        raise fault  # the drain could not be made: Slurm drains on the exit status
    return 0


def _reclaim(cfg: Config, own_job: str, node: str, log: logging.Logger) -> None:
    """Clean up and record the jobs whose epilog never came (hooks/vestigial.py): no
    GPU check (their GPUs may be another job's now), and no exit code to record."""
    for job_id in vestigial.gone(cfg, node, own_job):
        log.warning(
            "job %s: its epilog never came (its slurmd gone as it ended?); reclaimed "
            "by job %s's", job_id, own_job,
        )  # fmt: skip
        slurm = {dest: "" for dest in SLURM_ARGS} | {"job_id": job_id, "node": node}
        with jobfacts.claimed(cfg.state_dir, job_id) as facts:
            _cleanup(cfg, job_id, slurm, facts, log, check_gpus=False)


def _cleanup(
    cfg: Config,
    job_id: str,
    slurm: dict[str, str],
    facts: dict[str, Any],
    log: logging.Logger,
    *,
    check_gpus: bool = True,
) -> NodeFault | None:
    after: dict[str, Any] = {"gpus": [], "health": None}
    stuck: list[str] = []
    fault: list[NodeFault] = []

    def gpus() -> None:
        if not check_gpus:
            return
        try:
            after.update(_gpu_check(cfg, job_id, slurm))
        except NodeFault as e:
            after["health"] = "drain"
            fault.append(e)

    # Each part runs whatever the others did: a hold the epilog leaves is an image
    # nobody may evict until the next reclaim, a mount left is a mount leaked.
    parts: tuple[tuple[str, Callable[[], object]], ...] = (
        ("checking its GPUs", gpus),
        ("unmounting", lambda: stuck.extend(release_job(cfg.state_dir, job_id))),
        ("releasing its images", lambda: ImageCache(cfg).release(job_id)),
        ("removing what was staged for it", lambda: discard_staged_of_job(cfg, job_id)),
        ("unmounting images no job uses", lambda: stuck.extend(_unused(cfg))),
        ("dropping downloads no pull is at", lambda: _abandoned(cfg, job_id, log)),
        ("dropping its GPU baseline", lambda: drop_baseline(cfg.state_dir, job_id)),
        ("forgetting its default image", lambda: _forget_default(cfg, job_id)),
        ("recording its usage", lambda: _record(cfg, slurm, facts, after)),
    )
    for part, run in parts:
        try:
            run()
        except Exception as e:
            log.error("job %s: cleanup: %s: %s", job_id, part, cause(e))
    for target in stuck:
        log.error("job %s: %s was busy; detached it lazily", job_id, target)
    return fault[0] if fault else None


def _forget_default(cfg: Config, job_id: str) -> None:
    """The partition's default image the prolog readied for it (prolog/main.py)."""
    layout.job_default_image(cfg.state_dir, job_id).unlink(missing_ok=True)


def discard_staged_of_job(cfg: Config, job_id: str) -> None:
    """What was staged for a job cancelled before its prolog took it (staged.py)."""
    for path in layout.cache_staged_of_job(cfg.cache_dir, job_id):
        if not path.is_dir():
            path.unlink(missing_ok=True)


def _abandoned(cfg: Config, job_id: str, log: logging.Logger) -> None:
    """What a failed pull kept to resume (cache/evict.py): a job's failure leaves
    nothing behind."""
    for path in abandoned_downloads(ImageCache(cfg)):
        log.info("job %s: dropped %s, a download a failed pull left", job_id, path.name)


def _unused(cfg: Config) -> list[str]:
    """Every shared image mount no running job holds, this job's and any an earlier
    epilog could not finish."""
    cache = ImageCache(cfg)
    return release_images(cfg.state_dir, lambda digest: in_use(cache, digest))


def _gpu_check(cfg: Config, job_id: str, slurm: dict[str, str]) -> dict[str, Any]:
    """The post-job GPU check over the job's GPUs the prolog saw (its baseline), and
    each one's energy; without a baseline, the GPUs Slurm names, unchecked."""
    baseline = load_baseline(cfg.state_dir, job_id)
    if not baseline or not cfg.gpu.checks:
        try:
            tokens = parse_gpus(slurm["gpus"])
        except InputError:
            tokens = ()
        gpus = [{"uuid": t if t.startswith("GPU-") else None, "energy_j": None} for t in tokens]
        return {"gpus": gpus}
    try:
        node = check_node(slurm["node"])
    except InputError:
        node = ""
    got = epilog_gate(cfg, job_id, node, baseline, shared=bool(slurm["mps"]))
    return {
        "gpus": [{"uuid": u, "energy_j": j} for u, j in got.energy_j.items()],
        "health": health(got.check),
    }


def _record(
    cfg: Config, slurm: dict[str, str], facts: dict[str, Any], after: dict[str, Any]
) -> None:
    """The job's usage line and the node's counters: for a ``--tf-image`` job whose
    prolog ran here (a second epilog finds its facts gone and records nothing).  The
    counters are kept even when the line cannot be written (a full /var/log)."""
    if not facts or not (facts.get("image") or slurm["image"]):
        return
    rec = record.build(
        slurm, facts, end=time.time(), gpus=after["gpus"], epilog_health=after["health"]
    )
    try:
        if cfg.usage_log:
            record.append(Path(cfg.usage_log), rec)
    finally:
        metrics.update(cfg.state_dir, cfg.metrics_dir, cfg.cache_dir, metrics.count_job(rec))


if __name__ == "__main__":
    sys.exit(main())

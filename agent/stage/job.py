"""PrologSlurmctld's work for one job: one pull on the controller, then Slurm's tree.

For a ``--tf-image`` job on more than one node, while it configures (the nodes'
prologs start only once this returns: docs/developer.md, "What Slurm itself does"):

1. the nodes that lack the image (ledger.py), from Slurm's node list, counted before
   it is expanded; none: nothing is pulled or sent;
2. the image, by the digest the job was pinned to at submit, pulled once into the
   staging cache (``stage_dir``: a cache like a node's, with the same pull, lock,
   checks and eviction), after the same access check a node makes (a user is never
   sent bytes they may not run) and the same partition rules (core/partition.py:
   an image the job's partition refuses is neither pulled nor sent; each node's
   prolog tells the job why);
3. its manifest and SIF sent with ``sbcast`` as the job's user (sbcast.py) to
   ``cache_dir/staged/`` on those nodes, where each node's prolog checks them as a
   download (cache/staged.py);
4. the ledger told who holds it now.

All of it within ``stage_deadline`` (and ``hook_deadline``: the daemon gives no hook
longer).  Whatever fails (the registry, the disk, the
broadcast, the deadline), the job goes on: :func:`stage` returns why, the hook logs
it, and each node pulls for itself.  A one-node job, a tag that was not pinned and an
OCI image (each node converts its own) keep the nodes' own path.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core import layout
from tfimage.agent.core.access import check
from tfimage.agent.core.config import Config
from tfimage.agent.core.deadline import deadline
from tfimage.agent.core.errors import PolicyError, RegistryUnreachable, TfimageError, cause
from tfimage.agent.core.hostlist import expand_hostlist
from tfimage.agent.core.ids import valid_job_id
from tfimage.agent.core.partition import PartitionRule, check_image, check_name, rules_for
from tfimage.agent.core.reference import Reference
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.stage import sbcast
from tfimage.agent.stage.ledger import Ledger

Broadcast = Callable[[list[str], int, float, tuple[int, int]], None]
ClientFactory = Callable[[str], RegistryClient]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the controller did for a job; ``sent`` the nodes the image went to."""

    nodes: int = 0
    sent: tuple[str, ...] = ()
    pulled: bool = False  # the staging cache had to fetch it from the registry
    seconds: float = 0.0
    skipped: str | None = None  # why the nodes keep their own path (no failure)
    failed: str | None = None  # why the broadcast did not happen: each node pulls
    held: bool = False  # every node holds it already: a warm job, nothing to say

    def line(self, job_id: str, image: str) -> str:
        """One log line for the hook."""
        if self.skipped:
            return f"job {job_id}: stage: {self.skipped}"
        if self.failed:
            why = self.failed.removeprefix("stage: ")
            return f"job {job_id}: stage: {why}; each node without a good copy pulls {image} itself"
        return (
            f"job {job_id}: stage: {image} sent to {len(self.sent)} of {self.nodes} nodes in "
            f"{self.seconds:.2f} s ({'pulled once' if self.pulled else 'from the staging cache'})"
        )


def stage(
    cfg: Config,
    job_id: str,
    image: str,
    nodelist: str,
    owner: tuple[int, int],
    *,
    broadcast: Broadcast = sbcast.broadcast,
    generation: Callable[[], tuple[int, int] | None] | None = None,
    client_factory: ClientFactory | None = None,
    now: Callable[[], float] = time.time,
    partition: str = "",
    asked: str = "",
) -> Outcome:
    """Stage ``image`` for ``job_id`` (its ``owner``'s uid and gid, as Slurm gave
    them; its ``partition``, and ``asked``, the ``--tf-image`` text) on ``nodelist``;
    never raises a TfimageError or an OSError (the outcome says why it fell back).
    ``broadcast``, ``generation`` and ``client_factory`` are sbcast's and the
    registry's unless a test gives its own."""
    started = time.monotonic()
    if not valid_job_id(job_id):
        return Outcome(skipped="no valid job id")
    try:
        nodes = expand_hostlist(nodelist, cfg.step_max_tasks)
    except TfimageError as e:
        return Outcome(skipped=f"not staged: {cause(e)}")
    if len(nodes) < 2:
        return Outcome(len(nodes), skipped="one node: it pulls for itself")
    try:
        ref = cfg.reference(image)
    except TfimageError as e:
        return Outcome(len(nodes), skipped=f"not staged: {cause(e)}")
    if not ref.digest or ref.transport == "docker":
        what = "not pinned at submit" if not ref.digest else "an OCI image: each node converts"
        return Outcome(len(nodes), skipped=f"{what}; each node pulls for itself")
    rules = rules_for(cfg.partitions, partition)
    try:
        if cfg.access:
            check(cfg.access, ref.repository, owner[0])
        check_name(rules, partition, ref, asked)
    except TfimageError as e:
        return Outcome(len(nodes), skipped=f"not staged: {cause(e)}")
    ledger = Ledger(cfg.stage_dir)
    lacking = ledger.lacking(ref.digest, nodes, now(), cfg.cache_min_age)
    if not lacking:
        return Outcome(
            len(nodes), skipped=f"all {len(nodes)} nodes hold {ref.digest[:19]}", held=True
        )
    # The daemon ends any hook's worker soon after hook_deadline.
    limit = min(cfg.stage_deadline, cfg.hook_deadline)
    try:
        with deadline(limit, "stage", "stage_deadline"):
            targets, pulled = _stage(
                cfg, job_id, ref, nodes, lacking, owner, started + limit,
                broadcast, generation, client_factory, (partition, rules),
            )  # fmt: skip
    except PolicyError as e:  # the nodes' prologs say it to the job
        return Outcome(len(nodes), skipped=f"not staged: {cause(e)}")
    except (TfimageError, OSError) as e:
        return Outcome(len(nodes), failed=cause(e), seconds=time.monotonic() - started)
    if not targets:
        return Outcome(len(nodes), skipped="an OCI image: each node converts")
    # Every node of the job holds it now: the ones it went to, and those that held it.
    ledger.record(ref.digest, nodes, now())
    return Outcome(len(nodes), tuple(targets), pulled, time.monotonic() - started)


def _stage(
    cfg: Config,
    job_id: str,
    ref: Reference,
    nodes: list[str],
    lacking: list[str],
    owner: tuple[int, int],
    ends: float,
    broadcast: Broadcast,
    generation: Callable[[], tuple[int, int] | None] | None,
    client_factory: ClientFactory | None,
    policy: tuple[str, tuple[PartitionRule, ...]],
) -> tuple[list[str], bool]:
    """The pull and the broadcast; the nodes it went to ([]: not a SIF), and whether
    the staging cache had to pull.  ``policy``: the job's partition and its rules,
    which may refuse the image by its size before it is pulled (PolicyError)."""
    assert ref.digest
    partition, rules = policy
    staging = ImageCache(cfg.staging())
    staging.make_dirs()
    os.chmod(staging.root, 0o700)  # the user reads one image through a descriptor, no path
    admit = functools.partial(check_image, rules, partition, ref) if rules else None
    got = Puller(staging, client_factory).ensure(ref, job=job_id, admit=admit)
    try:
        entry = staging.read_entry(ref.digest)
        check_image(rules, partition, ref, got.size, entry.blob is None)
        if entry.blob is None:  # converted there: nothing a node could check
            return [], not got.hit
        if cfg.access and entry.origin:
            # The bytes came as another repository's first: its rule judges too
            # (as step/imageaccess.py's check_origin, without asking the registry).
            check(cfg.access, entry.origin.partition("/")[2], owner[0])
        manifest = _manifest(cfg, staging, ref, client_factory)
        gen = (generation or (lambda: sbcast.version(cfg.gpu.slurm_bin)))()
        subset = len(lacking) < len(nodes) and sbcast.reaches_some(gen)
        targets = lacking if subset else nodes
        on_nodes = layout.cache_staged(cfg.cache_dir, ref.digest, job_id)
        for src, dst in zip((manifest, got.path), on_nodes, strict=True):
            fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                cmd = sbcast.argv(job_id, fd, str(dst), nodes=targets if subset else (),
                                  slurm_bin=cfg.gpu.slurm_bin)  # fmt: skip
                left = ends - time.monotonic()
                broadcast(cmd, fd, max(1.0, left), owner)
            finally:
                os.close(fd)
        return targets, not got.hit
    finally:
        with contextlib.suppress(TfimageError, OSError):
            staging.release(job_id)


def _manifest(
    cfg: Config, staging: ImageCache, ref: Reference, client_factory: ClientFactory | None
) -> Path:
    """The pinned manifest's bytes, kept beside the staging cache's image: asked of
    the registry once (the client checks them against the digest)."""
    assert ref.digest
    path = layout.stage_manifest(staging.root, ref.digest)
    if path.exists():
        return path
    factory = client_factory or light_clients(cfg)
    last: RegistryUnreachable | None = None
    for host in cfg.sources(ref):
        try:
            raw = factory(host).manifest(ref.repository, ref.digest).raw
        except RegistryUnreachable as e:
            last = e
            continue
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_suffix(".partial")
        tmp.write_bytes(raw)
        tmp.chmod(0o444)
        tmp.rename(path)
        return path
    assert last is not None
    raise last


def light_clients(cfg: Config) -> ClientFactory:
    """The controller's registry clients, one per host (the admin comment's too)."""
    from tfimage.agent.registry.access import client_for

    return lambda host: client_for(cfg, host, light=True)

"""The node's on-disk state, file by file: the one place that names a file or
directory under ``state_dir`` or ``cache_dir``.  Every layer asks here, so the
cache can find a job's file without importing ``step/``; only a lock that guards
one file is named where it is taken, from that file's path (``.lock`` beside it).

Under ``state_dir`` (root-owned, 0755; ``/run/tfimage`` by default: gone at boot)::

    daemon.sock                 the daemon's root socket (0600)
    pin.sock                    the pin server, open to every local user (0666)
    last-seen.json              the pin server's tag -> digest for registry outages
    images/                     0711
        sha256-<hex>/           an image's shared mount (step/imagemount.py)
        sha256-<hex>.lock       serialises mounting and unmounting that image
    jobs/                       0711
        <job>.images.json       the job's images on this node (step/jobimages.py);
                                its existence says the job is live here
        <job>.lock              serialises the job's mounts
        <job>.default-image     the partition's default image the prolog readied for
                                a job that named none (0644; the plugin's steps read it)
        <job>/                  0711
            img-<hex12>/        an image mounted for this job alone
            step-<step>/        skel/ and root/ (the step's overlay)
    usage/                      0700: what the usage record needs
        <job>.json, <job>.lock  the job's facts for its epilog (usage/jobfacts.py)
        counters.json, .lock    the node counters behind the metrics (usage/metrics.py)
    gpu/                        0700
        xid-cursor.json, .lock  the kernel log cursor per GPU (gpu/xid.py)
        jobs/<job>.json         a job's GPU baseline (gpu/gate.py)

Under ``cache_dir`` (root-owned, 0755; node-local disk)::

    images/sha256-<hex>.sif     published images, 0444, never rewritten
    images/sha256-<hex>.json    their metadata: the entry (cache/store.py Entry)
    keep.json                   the operator's keep list (cache/keep.py)
    locks/sha256-<hex>.lock     one flock per digest: one download per image
    locks/keep.lock             serialises changes to the keep list
    locks/tag-<sha256>.lock     one per tag name, its last answer inside (cache/coalesce.py)
    tmp/sha256-<hex>.partial    a download in progress or interrupted (cache/pull.py)
    tmp/sha256-<hex>.converted  a conversion's SIF before it is verified
    tmp/convert-sha256-<hex>-*/ a conversion's work directory (cache/convert.py)
    tmp/sha256-<hex>.adopting   a staged SIF taken by root while it is checked
    tmp/sha256-<hex>.adopted    root's own copy of a SIF the job's user staged
    staged/                     root's, 1733: anyone may add, no one may list or
                                take another's; what was staged for a job
        sha256-<hex>.<job>.manifest  the pinned manifest's bytes (cache/staged.py)
        sha256-<hex>.<job>.sif       its SIF layer

Under ``stage_dir`` (the controller's, root-owned, 0700; stage/): a cache as above
(``images/``, ``locks/``, ``tmp/``: the one pull per multi-node job, pruned by the
same eviction), and::

    sent/sha256-<hex>.json      the nodes the image was broadcast to, and when
                                (stage/ledger.py)
    sent/sha256-<hex>.lock      serialises changes to it
    sent/sha256-<hex>.manifest  the pinned manifest's bytes, sent with the SIF

An image's key is ``sha256-<hex>``: its digest with ``:`` made a path character.
Ids and digests are checked (``ids``) before they become a path: a ``ValueError``
says which was wrong.
"""

from __future__ import annotations

from pathlib import Path

from tfimage.agent.core.ids import DIGEST, valid_job_id, valid_step_id

StrPath = str | Path

DAEMON_SOCKET = "daemon.sock"
PIN_SOCKET = "pin.sock"
STAGE_SOCKET = "stage.sock"
KEY_PREFIX = "sha256-"
KEY_LENGTH = len(KEY_PREFIX) + 64


def key(digest: str) -> str:
    """``sha256:<hex>`` as a file name: ``sha256-<hex>``."""
    if not DIGEST.match(digest):
        raise ValueError(f"invalid image digest {digest[:80]!r}")
    return digest.replace(":", "-")


def digest_of_key(name: str) -> str | None:
    """The digest a file name's key names (``sha256-<hex>...``), or None."""
    digest = "sha256:" + name[len(KEY_PREFIX) : KEY_LENGTH]
    return digest if name.startswith(KEY_PREFIX) and DIGEST.match(digest) else None


def _job(job_id: str) -> str:
    if not valid_job_id(job_id):
        raise ValueError(f"invalid job id {job_id!r}")
    return job_id


# -- state_dir ------------------------------------------------------------------------


def daemon_socket(state_dir: StrPath) -> Path:
    return Path(state_dir) / DAEMON_SOCKET


def pin_socket(state_dir: StrPath) -> Path:
    return Path(state_dir) / PIN_SOCKET


def stage_socket(state_dir: StrPath) -> Path:
    """Slurm's user's way to the controller's stage hook (daemon/server.py)."""
    return Path(state_dir) / STAGE_SOCKET


def last_seen(state_dir: StrPath) -> Path:
    return Path(state_dir) / "last-seen.json"


def mounts_dir(state_dir: StrPath) -> Path:
    """``images/``: the shared image mounts."""
    return Path(state_dir) / "images"


def image_mount(state_dir: StrPath, digest: str) -> Path:
    return mounts_dir(state_dir) / key(digest)


def jobs_dir(state_dir: StrPath) -> Path:
    return Path(state_dir) / "jobs"


def job_dir(state_dir: StrPath, job_id: str) -> Path:
    return jobs_dir(state_dir) / _job(job_id)


def job_images(state_dir: StrPath, job_id: str) -> Path:
    return jobs_dir(state_dir) / f"{_job(job_id)}.images.json"


def job_default_image(state_dir: StrPath, job_id: str) -> Path:
    return jobs_dir(state_dir) / f"{_job(job_id)}.default-image"


def job_lock(state_dir: StrPath, job_id: str) -> Path:
    return jobs_dir(state_dir) / f"{_job(job_id)}.lock"


def job_image_mount(state_dir: StrPath, job_id: str, digest: str) -> Path:
    return job_dir(state_dir, job_id) / f"img-{key(digest)[len(KEY_PREFIX) :][:12]}"


def step_dir(state_dir: StrPath, job_id: str, step_id: str) -> Path:
    if not valid_step_id(step_id):
        raise ValueError(f"invalid step id {step_id!r}")
    return job_dir(state_dir, job_id) / f"step-{step_id}"


def usage_dir(state_dir: StrPath) -> Path:
    return Path(state_dir) / "usage"


def job_facts(state_dir: StrPath, job_id: str) -> Path:
    return usage_dir(state_dir) / f"{_job(job_id)}.json"


def counters(state_dir: StrPath) -> Path:
    return usage_dir(state_dir) / "counters.json"


def gpu_dir(state_dir: StrPath) -> Path:
    return Path(state_dir) / "gpu"


def xid_cursor(state_dir: StrPath) -> Path:
    return gpu_dir(state_dir) / "xid-cursor.json"


def gpu_baseline(state_dir: StrPath, job_id: str) -> Path:
    return gpu_dir(state_dir) / "jobs" / f"{_job(job_id)}.json"


# -- cache_dir ------------------------------------------------------------------------

CACHE_DIRS = ("images", "locks", "tmp")
CONVERT_PREFIX = "convert-"


def cache_images(cache_dir: StrPath) -> Path:
    return Path(cache_dir) / "images"


def cache_sif(cache_dir: StrPath, digest: str) -> Path:
    return cache_images(cache_dir) / f"{key(digest)}.sif"


def cache_entry(cache_dir: StrPath, digest: str) -> Path:
    return cache_images(cache_dir) / f"{key(digest)}.json"


def cache_entry_pair(path: Path) -> Path | None:
    """The other file of an entry's two in ``images/``: a ``.sif``'s metadata file,
    a ``.json``'s image; None for any other name."""
    other = {".sif": ".json", ".json": ".sif"}.get(path.suffix)
    return path.with_suffix(other) if other else None


def cache_lock(cache_dir: StrPath, name: str) -> Path:
    """``locks/<name>.lock``: a digest's (by its key) or another of the cache's."""
    return Path(cache_dir) / "locks" / f"{name.replace(':', '-')}.lock"


def cache_tmp(cache_dir: StrPath) -> Path:
    return Path(cache_dir) / "tmp"


def cache_partial(cache_dir: StrPath, digest: str) -> Path:
    return cache_tmp(cache_dir) / f"{key(digest)}.partial"


def cache_partials(cache_dir: StrPath) -> list[Path]:
    """Every download in progress or interrupted (``tmp/sha256-<hex>.partial``)."""
    return list(cache_tmp(cache_dir).glob(f"{KEY_PREFIX}*.partial"))


def cache_converted(cache_dir: StrPath, digest: str) -> Path:
    return cache_tmp(cache_dir) / f"{key(digest)}.converted"


def cache_convert_work(cache_dir: StrPath, digest: str) -> Path:
    """``tmp/convert-sha256-<hex>-``: what a conversion's work directory is named
    from (``tempfile.mkdtemp`` adds the rest)."""
    return cache_tmp(cache_dir) / f"{CONVERT_PREFIX}{key(digest)}-"


def cache_adopting(cache_dir: StrPath, digest: str) -> Path:
    return cache_tmp(cache_dir) / f"{key(digest)}.adopting"


def cache_adopted(cache_dir: StrPath, digest: str) -> Path:
    """Root's copy of a staged SIF its job's user owns (cache/staged.py)."""
    return cache_tmp(cache_dir) / f"{key(digest)}.adopted"


STAGED_MODE = 0o1733


def cache_staged_dir(cache_dir: StrPath) -> Path:
    return Path(cache_dir) / "staged"


def cache_staged(cache_dir: StrPath, digest: str, job_id: str) -> tuple[Path, Path]:
    """The manifest and the SIF staged for job ``job_id``'s image ``digest``."""
    stem = f"{key(digest)}.{_job(job_id)}"
    d = cache_staged_dir(cache_dir)
    return d / f"{stem}.manifest", d / f"{stem}.sif"


def cache_staged_of_job(cache_dir: StrPath, job_id: str) -> list[Path]:
    """Whatever was staged for job ``job_id``, any digest (the epilog removes it)."""
    d = cache_staged_dir(cache_dir)
    return sorted(d.glob(f"{KEY_PREFIX}*.{_job(job_id)}.*"))


def cache_leftovers(cache_dir: StrPath) -> list[Path]:
    """What pulls leave in ``tmp/`` (an interrupted one, for good) and what was
    staged and never adopted, by name alone, sorted: downloads, conversions' SIFs
    and their work directories, adoptions cut short, staged files."""
    tmp = cache_tmp(cache_dir)
    return sorted(
        [
            *cache_partials(cache_dir),
            *tmp.glob(f"{KEY_PREFIX}*.converted"),
            *tmp.glob(f"{KEY_PREFIX}*.adopting"),
            *tmp.glob(f"{KEY_PREFIX}*.adopted"),
            *tmp.glob(f"{CONVERT_PREFIX}{KEY_PREFIX}*"),
            *cache_staged_dir(cache_dir).glob(f"{KEY_PREFIX}*"),
        ]
    )


# -- stage_dir (the controller's) -------------------------------------------------------


def stage_sent(stage_dir: StrPath, digest: str) -> Path:
    """``sent/sha256-<hex>.json``: the nodes ``digest`` was broadcast to, and when."""
    return Path(stage_dir) / "sent" / f"{key(digest)}.json"


def stage_manifest(stage_dir: StrPath, digest: str) -> Path:
    """``sent/sha256-<hex>.manifest``: the manifest a broadcast sends with the SIF."""
    return Path(stage_dir) / "sent" / f"{key(digest)}.manifest"


def cache_keep_list(cache_dir: StrPath) -> Path:
    return Path(cache_dir) / "keep.json"


def cache_tag_lock(cache_dir: StrPath, name: str) -> Path:
    """``locks/tag-<sha256 of name>.lock``: the tag ``name`` (``host/repository:tag``)
    of any length or alphabet, as a file name."""
    import hashlib  # only a pull by tag needs it: a cache hit never loads OpenSSL

    return cache_lock(cache_dir, f"tag-{hashlib.sha256(name.encode()).hexdigest()}")

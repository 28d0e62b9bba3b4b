"""The bytes a job ran, in Slurm's own accounting: its AdminComment.

PrologSlurmctld (prolog/stage.py) writes the job's pinned image there, so that
``sacct -j JOB -o JobID,Account,Partition,AdminComment`` says which image ran, by
digest, months later (slurmdbd keeps the comment with the job's record)::

    AdminComment=<what was there before> tfimage=<registry/repo:tag>@sha256:<hex>

- What an admin or a job_submit plugin wrote first is kept, before ours, one space
  between; a ``tfimage=`` word already there (the job was requeued and its
  PrologSlurmctld runs again) is replaced, never repeated.
- Written with ``scontrol update JobId=J AdminComment=...`` (argv, no shell), which
  only Slurm's user and root may do: a job can read its AdminComment, never set it.
- The reference is the job's pinned image, parsed strictly (no space, no ``=``
  outside its digest can reach scontrol); a tag the submit side could not pin is
  resolved here, against the registry, within the hook's deadline.
- A comment tfimage cannot read back whole (one that holds a line break) is left as
  it is: never rewritten from a part.

Nothing here may hold a job: every failure is a TfimageError, which the hook logs in
one line before the job runs on.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from tfimage.agent.core.config import Config
from tfimage.agent.core.deadline import deadline
from tfimage.agent.core.errors import RegistryUnreachable, TfimageError
from tfimage.agent.core.ids import valid_job_id
from tfimage.agent.core.reference import Reference
from tfimage.agent.core.toolrun import run, slurm_env, slurm_tool
from tfimage.agent.registry.client import RegistryClient

WORD = "tfimage="
# Slurm keeps any length; a comment past this is not one tfimage adds a word to.
MAX_COMMENT = 4096
TIMEOUT = 10.0
# A tag not pinned at submit is asked of the registry for at most this long.
RESOLVE_SECONDS = 10.0

_FIELD = re.compile(r" +[A-Za-z][A-Za-z0-9_:/]*=")

Runner = Callable[[Sequence[str]], str]


def _scontrol(argv: Sequence[str]) -> str:
    return run(argv, timeout=TIMEOUT, what="scontrol", env=slurm_env())


def pinned(
    cfg: Config, image: str, client_factory: Callable[[str], RegistryClient] | None = None
) -> Reference:
    """The job's image (``SPANK_TFIMAGE_IMAGE``), parsed strictly, with its digest: the
    one pinned at submit, else the one its tag names now (the first of the registry
    and its mirrors that answers, within RESOLVE_SECONDS)."""
    ref = cfg.reference(image)
    if ref.digest:
        return ref
    if client_factory is None:
        from tfimage.agent.stage.job import light_clients

        client_factory = light_clients(cfg)
    from tfimage.agent.registry.platforms import tag_manifest

    last: RegistryUnreachable | None = None
    with deadline(min(RESOLVE_SECONDS, cfg.hook_deadline), "resolving its tag", "hook_deadline"):
        for host in cfg.sources(ref):
            try:
                return ref.pinned(tag_manifest(client_factory(host), ref, cfg.node_platform).digest)
            except RegistryUnreachable as e:
                last = e
    assert last is not None
    raise last


def word(ref: Reference) -> str:
    """``tfimage=<registry/repo:tag>@sha256:...``; ``ref`` must be pinned."""
    if not ref.digest:
        raise TfimageError(f"{ref} is not pinned to a digest")
    return f"{WORD}{ref}"


def merged(existing: str, ref: Reference) -> str:
    """``existing`` with this job's word: any earlier ``tfimage=`` word replaced."""
    kept = [w for w in existing.split(" ") if w and not w.startswith(WORD)]
    return " ".join([*kept, word(ref)])


def read(show_job: str) -> str | None:
    """The AdminComment in ``scontrol show job``'s output ("" for none); None when it
    cannot be read back whole: scontrol prints it on a line of its own, each line
    after it starting with its indent and a ``Key=``, which a line break inside the
    comment would not."""
    lines = show_job.splitlines()
    at = [i for i, line in enumerate(lines) if line.lstrip(" ").startswith("AdminComment=")]
    if not at:
        return ""
    if len(at) > 1:
        return None
    i = at[0]
    if i + 1 < len(lines) and not _FIELD.match(lines[i + 1]):
        return None
    return lines[i].strip(" ")[len("AdminComment=") :]


def record(
    job_id: str, ref: Reference, *, slurm_bin: str = "", runner: Runner | None = None
) -> str:
    """Write ``ref`` into job ``job_id``'s AdminComment; return the comment written.
    ``runner`` runs scontrol (argv in, stdout out) unless a test gives its own."""
    if not valid_job_id(job_id):
        raise TfimageError(f"{job_id[:20]!r} is not a job id")
    go = runner or _scontrol
    scontrol = slurm_tool("scontrol", slurm_bin)
    shown = go([scontrol, "show", "job", job_id])
    existing = read(shown)
    if existing is None:
        raise TfimageError(f"job {job_id}'s comment has a line break; left as it is")
    comment = merged(existing, ref)
    if len(comment) > MAX_COMMENT:
        raise TfimageError(
            f"job {job_id}'s comment would pass {MAX_COMMENT} characters; left as it is"
        )
    if comment != existing:
        go([scontrol, "update", f"JobId={job_id}", f"AdminComment={comment}"])
    return comment

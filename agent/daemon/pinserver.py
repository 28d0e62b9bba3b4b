"""The pin server: pinning for the submit side, served by the host's warm daemon.

``srun --tf-image`` pins the tag before anything is queued.  As a fresh Python that
costs ~100 ms of interpreter start and imports on every srun, sbatch and salloc;
the daemon (``tfimage daemon``, already running on compute and login nodes) answers
the same question in a few milliseconds from a warm process.  The plugin asks it
first and runs the helper itself whenever the answer is anything but a pinned
reference or a rejected input (spank/submit.c), so the pin server is an
accelerator: a stopped daemon costs speed, never a submission.

Trust: unlike the daemon's root-only socket, any local user may connect here,
so a request is one fixed shape and nothing else (agent/core/wire.py, 4)::

    submit-check --tf-mount=SPEC --job-image=REF -- REF

(the daemon's own config is used; no path, option or command comes from the
peer), bounded in size, parsed by the same strict parsers as everywhere.  The
pin uses this host's credentials: it reveals only the digest a tag names now,
which the same user learns by submitting a job, since the nodes pull with the
same credentials.  What this host saw last for a tag is kept in
``STATE_DIR/last-seen.json`` (core/layout.py) (until reboot) for when the registry is down, per user
and bounded (submit/lastseen.py): one user pinning a thousand tags pushes out only
their own.  A lookup may take another user's entry, so it reveals that someone on
this host pinned that tag, and the digest it named: no more than pinning it reveals.

Answers: 0 and the pinned reference; 2 when the reference or --tf-mount is wrong
(final: the user's input is wrong whoever checks it); 75 for anything else (the
registry refused this host's credentials, no answer and no remembered digest,
a fault): the plugin then pins with the user's own credentials, as before.
"""

from __future__ import annotations

from tfimage.agent.core import layout
from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import InputError, TfimageError
from tfimage.agent.core.wire import SubmitCheck

MAX_REQUEST = 16384
RETRY_YOURSELF = 75  # EX_TEMPFAIL: the plugin pins with the user's own view instead


def answer(cfg: Config, req: SubmitCheck, uid: int) -> tuple[int, str, str]:
    """(status, stdout, stderr) for the plugin: see the module's docstring."""
    from tfimage.agent.step.binds import parse_user_binds
    from tfimage.agent.submit.pin import pin

    try:
        ref = cfg.reference(req.ref)
        parse_user_binds(req.tf_mount, cfg.bind_prefixes, cfg.default_binds)
    except InputError as e:
        return 2, "", f"tfimage: {e}\n"
    try:
        store = layout.last_seen(cfg.state_dir)
        pinned, warning = pin(cfg, ref, store=store, job_image=req.job_image or None, uid=uid)
    except TfimageError as e:
        return RETRY_YOURSELF, "", f"tfimage: {e}\n"
    return 0, f"{pinned}\n", f"tfimage: {warning}\n" if warning else ""

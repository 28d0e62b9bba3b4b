"""Pinning at submit: a tag becomes the digest it names now, so every node of the job
runs the same bytes however the tag moves while the job waits.

When the registry does not answer, the last digest this host saw for the tag is used
(with a warning): lastseen.py, in ``~/.cache/tfimage/last-seen.json`` when the user
pins, in the daemon's ``STATE_DIR/last-seen.json`` when the pin server does.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import (
    AccessDenied,
    DeadlineExceeded,
    ImageNotFound,
    ImageReferenceError,
    RegistryError,
    RegistryUnreachable,
    VerificationError,
)
from tfimage.agent.core.reference import Reference
from tfimage.agent.submit import suggest
from tfimage.agent.submit.lastseen import LastSeen

if TYPE_CHECKING:
    from tfimage.agent.registry.client import Manifest, RegistryClient


def last_seen_file() -> Path:
    home = Path(pwd.getpwuid(os.geteuid()).pw_dir)
    return home / ".cache" / "tfimage" / "last-seen.json"


def _first_answer(
    cfg: Config, ref: Reference, client_factory: Callable[[str], RegistryClient]
) -> str:
    """The tag's digest from the first of the registry and its mirrors that answers."""
    last: RegistryUnreachable | None = None
    for host in cfg.sources(ref):
        client = client_factory(host)
        try:
            from tfimage.agent.registry.platforms import tag_manifest

            m = tag_manifest(client, ref, cfg.node_platform)
            _refuse_unrunnable(client, ref, m, cfg.node_platform.partition("/")[2])
            return m.digest
        except ImageNotFound:
            raise suggest.not_found(client, ref) from None
        except RegistryUnreachable as e:
            last = e
    assert last is not None
    raise last


def _refuse_unrunnable(client: RegistryClient, ref: Reference, m: Manifest, arch: str) -> None:
    """An image this machine cannot run is refused at submit with one line: OCI layers
    of squashfs, or a SIF artifact that core/sif.py's ``Layout.unfit`` names, read
    from the blob's first bytes (a registry that does not answer for them leaves the
    check to the node, as before)."""
    from tfimage.agent.registry.artifact import is_sif_artifact, sif_layer
    from tfimage.agent.registry.sifhead import unfit

    layers = m.body.get("layers")
    listed = layers if isinstance(layers, list) else []
    kinds = [str(x.get("mediaType", "")) for x in listed if isinstance(x, dict)]
    if any(k.endswith(".squashfs") for k in kinds):
        raise VerificationError(
            f"{ref.unpinned} is an OCI image with squashfs layers (SingularityCE's push"
            " of an OCI-SIF), which tfimage does not convert: push it with tar layers"
            " or as a SIF"
        )
    if ref.transport == "docker" or not is_sif_artifact(m.body):
        return  # an OCI image (or an index): converted on the node
    try:
        layer = sif_layer(m)
    except VerificationError as e:
        raise VerificationError(f"{ref.unpinned}: {e}") from None
    try:
        why = unfit(client, ref.repository, layer, arch)
    except RegistryError as e:
        if isinstance(e, ImageNotFound):
            raise VerificationError(f"{ref.unpinned}: its SIF layer is missing") from None
        return
    if why:
        raise VerificationError(f"{ref.unpinned} is {why}")


def _bounded() -> contextlib.AbstractContextManager[None]:
    """The registry's share of a pin (wire.PIN_REGISTRY_SECONDS): past it, a registry
    that accepted and never answered counts as unreachable.  Signals work only in
    the main thread; elsewhere (a caller's thread) the client's own timeouts bound it."""
    if threading.current_thread() is not threading.main_thread():
        return contextlib.nullcontext()
    from tfimage.agent.core.deadline import deadline
    from tfimage.agent.core.wire import PIN_REGISTRY_SECONDS

    return deadline(PIN_REGISTRY_SECONDS, "the registry", "its share of submit_timeout")


def refuse_unseen(cfg: Config, ref: Reference, uid: int) -> None:
    """ImageNotFound, worded as for a repository these credentials cannot read,
    unless ``uid`` may run images of ``ref``'s repository (the config's access:
    rules): a refused user learns nothing about what a private project holds."""
    if not cfg.access:
        return
    from tfimage.agent.core.access import check

    try:
        check(cfg.access, ref.repository, uid)
    except AccessDenied:
        raise ImageNotFound(suggest.message(ref, None)) from None


def user_clients(cfg: Config) -> Callable[[str], RegistryClient]:
    """A client per registry host, with the credentials this process may use; the
    stdlib transport (on srun's path: no requests)."""
    from tfimage.agent.registry.access import client_for

    def client_factory(host: str) -> RegistryClient:
        return client_for(cfg, host, light=True)

    return client_factory


def pin(
    cfg: Config,
    ref: Reference,
    client_factory: Callable[[str], RegistryClient] | None = None,
    store: Path | None = None,
    job_image: str | None = None,
    uid: int | None = None,
) -> tuple[Reference, str | None]:
    """Return ``ref`` pinned to a digest, and a warning for the user if any.

    ``job_image`` is the pinned image of the job this submission runs in (an srun
    inside an sbatch script): the same tag keeps the job's digest, so every step of
    a job runs the bytes pinned when the job was submitted.  ``uid``: whose pin this
    is (the pin server's peer; by default this process's).
    """
    uid = os.geteuid() if uid is None else uid
    refuse_unseen(cfg, ref, uid)
    if ref.digest:
        return ref, None
    if job_image:
        with contextlib.suppress(ImageReferenceError):
            job_ref = cfg.reference(job_image)
            if job_ref.digest and job_ref.unpinned == ref:
                return job_ref, None
    if client_factory is None:
        client_factory = user_clients(cfg)
    seen = LastSeen(store or last_seen_file())
    key = str(ref.unpinned)
    try:
        with _bounded():
            digest = _first_answer(cfg, ref, client_factory)
    except ImageNotFound as e:
        if ref.transport == "docker" and not cfg.dockerhub_project and ref.registry == cfg.registry:
            raise ImageNotFound(
                f"{e} (this site has no Docker Hub proxy: docker://NAME is looked up in "
                f"{cfg.registry}; copy the image there, or ask your admins for a proxy)"
            ) from None
        raise
    except (RegistryUnreachable, DeadlineExceeded) as e:
        known = seen.recall(key, uid)
        if not known:
            raise RegistryError(
                f"cannot pin {key}: {e}, and this host has never seen that tag"
            ) from None
        return ref.pinned(known), (
            f"warning: {e}; using the last digest this host saw for {key}: {known}"
        )
    seen.remember(key, digest, uid)
    return ref.pinned(digest), None

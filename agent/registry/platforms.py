"""An image index (OCI) or manifest list (Docker) of SIF artifacts, resolved to this
machine's platform: one SIF manifest per platform, as a site that builds for several
architectures pushes them under one tag.

A tag is resolved at submit (submit/pin.py) and on a node asked for a tag
(cache/pull.py), and what is pinned is the platform's own manifest digest, so every
node of a job runs the same bytes.  ``docker://`` images are left to their
converter, which picks the platform itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tfimage.agent.core.errors import VerificationError
from tfimage.agent.core.ids import valid_digest
from tfimage.agent.core.sif import this_platform
from tfimage.agent.registry.mediatypes import INDEX_TYPES

if TYPE_CHECKING:
    from tfimage.agent.core.reference import Reference
    from tfimage.agent.registry.client import Manifest, RegistryClient


def is_index(m: Manifest) -> bool:
    return m.media_type in INDEX_TYPES


def _platform_of(entry: dict[str, object]) -> str:
    p = entry.get("platform")
    if not isinstance(p, dict):
        return "?"
    return f"{p.get('os', '?')}/{p.get('architecture', '?')}"


def platform_manifest(
    client: RegistryClient, repository: str, m: Manifest, want: str | None = None
) -> Manifest:
    """``m`` itself, or, where it is an index, the manifest it names for ``want``
    (this machine's platform), fetched by digest (the client checks its bytes)."""
    if not is_index(m):
        return m
    want = want or this_platform()
    entries = m.body.get("manifests")
    if not isinstance(entries, list):
        raise VerificationError(f"{repository}: an image index without a manifest list")
    offered = [e for e in entries if isinstance(e, dict)]
    match = [e for e in offered if _platform_of(e) == want]
    if not match:
        have = ", ".join(sorted({_platform_of(e) for e in offered})) or "none"
        raise VerificationError(
            f"{repository}: no image for {want} in its index (it has {have}); "
            f"push one built for {want} under this tag"
        )
    digest = match[0].get("digest")
    if not isinstance(digest, str) or not valid_digest(digest):
        raise VerificationError(f"{repository}: the index's {want} entry has no sha256 digest")
    chosen = client.manifest(repository, digest)
    if is_index(chosen):
        raise VerificationError(f"{repository}: an index inside an index is not an image")
    return chosen


def tag_manifest(client: RegistryClient, ref: Reference, want: str | None = None) -> Manifest:
    """The manifest ``ref``'s tag names now; for a SIF reference (not ``docker://``)
    an index's entry for ``want`` (the config's ``node_platform``; by default this
    machine's).  What the pin and a node's own tag lookup both take the digest of."""
    m = client.manifest(ref.repository, ref.version)
    if ref.transport == "docker":
        return m
    return platform_manifest(client, ref.repository, m, want)

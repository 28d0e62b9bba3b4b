"""Image references: one strict parser used by the plugin helper, the hooks and the CLI.

Accepted forms (``[oras://|docker://]`` may prefix any of them)::

    name[:tag][@sha256:<64 hex>]                 -> <registry>/<project>/name
    project/name[:tag][@sha256:<64 hex>]         -> <registry>/project/name
    host[:port]/path[/...][:tag][@sha256:<64 hex>]

The first component is a host when it contains ``.`` or ``:`` or is ``localhost``
(Docker's rule).  A missing tag means ``latest``.  ``oras://`` names a SIF
artifact, ``docker://`` an OCI image; with neither, the manifest decides.

Where the site serves upstream registries through projects of its own (Harbor's
proxy caches), names are mapped onto them, before any allowlist::

    dockerhub_project: dockerhub
    docker://tensorflow/tensorflow:2.16.1  -> <registry>/dockerhub/tensorflow/tensorflow:2.16.1
    docker://ubuntu:22.04                  -> <registry>/dockerhub/library/ubuntu:22.04
    docker.io/ubuntu (index.docker.io, registry-1.docker.io) -> the same way

    rewrites: {nvcr.io: harbor.site/nvcr}
    nvcr.io/nvidia/tensorflow:24.01-tf2-py3 -> harbor.site/nvcr/nvidia/tensorflow:...

(``docker://name`` without a host means Docker Hub only with a ``dockerhub_project``,
as ``singularity exec docker://name`` does; without one it is the site's registry.)
The longest matching rewrite wins; it matches whole path components.

Everything here is pure: parsing never touches the network or the disk.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from tfimage.agent.core.errors import ImageReferenceError
from tfimage.agent.core.ids import DIGEST

MAX_REFERENCE = 512
MAX_REPOSITORY = 255

_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*\Z")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
_HOST = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
    r"(?::[0-9]{1,5})?\Z"
)
_TRANSPORTS = ("oras", "docker")
# Docker Hub's names for itself, as `docker pull` accepts them.
DOCKER_HUB = ("docker.io", "index.docker.io", "registry-1.docker.io")


@dataclass(frozen=True, slots=True)
class Reference:
    """A fully qualified reference.  ``str()`` gives the canonical form."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None
    transport: str | None = None

    def __str__(self) -> str:
        prefix = f"{self.transport}://" if self.transport else ""
        tag = f":{self.tag}" if self.tag else ""
        digest = f"@{self.digest}" if self.digest else ""
        return f"{prefix}{self.registry}/{self.repository}{tag}{digest}"

    @property
    def name(self) -> str:
        """Registry and repository, no tag or digest."""
        return f"{self.registry}/{self.repository}"

    @property
    def version(self) -> str:
        """What to ask the registry for: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def unpinned(self) -> Reference:
        """The same reference without its digest: what a tag names, not what it named."""
        return Reference(self.registry, self.repository, self.tag, None, self.transport)

    def pinned(self, digest: str) -> Reference:
        """This reference with ``digest`` attached (the tag is kept for the record)."""
        if not DIGEST.match(digest):
            raise ImageReferenceError(f"not a sha256 digest: {digest!r}")
        return Reference(self.registry, self.repository, self.tag, digest, self.transport)


def _shown(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


def _fail(text: str, why: str) -> ImageReferenceError:
    return ImageReferenceError(f"invalid image reference {_shown(text)!r}: {why}")


def _habits(text: str) -> None:
    """What users type from habit elsewhere, answered with what to type here."""
    shown = _shown(text)
    if text.startswith(("/", "./", "../", "~")) or text in (".", ".."):
        raise ImageReferenceError(
            f"{shown!r} is a file; --tf-image takes an image in the registry: push it"
            " first (tfimage push FILE NAME:TAG) and name NAME:TAG"
        )
    if "#" in text and "://" not in text:
        host, _, image = text.partition("#")
        raise ImageReferenceError(
            f"{shown!r} is enroot's and pyxis's form (registry#image); tfimage's is"
            f" registry/image: {host}/{image}"
        )


def parse_reference(
    text: str,
    default_registry: str,
    default_project: str,
    *,
    dockerhub_project: str | None = None,
    rewrites: Sequence[tuple[str, str]] = (),
) -> Reference:
    """Parse ``text`` strictly; raise :class:`ImageReferenceError` naming the problem.
    ``dockerhub_project`` and ``rewrites`` ({upstream prefix: site prefix}, checked
    with :func:`check_rewrite`) map upstream names onto the site's (see above)."""
    if not isinstance(text, str):
        raise ImageReferenceError("image reference must be a string")
    if not text:
        raise _fail(text, "it is empty")
    if len(text) > MAX_REFERENCE:
        raise _fail(text, f"longer than {MAX_REFERENCE} characters")
    if any(c.isspace() or not c.isprintable() for c in text):
        raise _fail(text, "it contains whitespace or control characters")
    _habits(text)

    rest = text
    transport: str | None = None
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme not in _TRANSPORTS:
            raise _fail(text, f"unknown prefix '{scheme}://' (use oras:// or docker://)")
        transport = scheme

    digest: str | None = None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not DIGEST.match(digest):
            raise _fail(text, "digest must be 'sha256:' followed by 64 lowercase hex digits")

    tag: str | None = None
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        rest, tag = rest[:colon], rest[colon + 1 :]
        if not _TAG.match(tag):
            raise _fail(text, f"tag {tag!r} must be 1-128 of letters, digits, '_', '.', '-'")

    if not rest:
        raise _fail(text, "no image name")
    parts = rest.split("/")
    first = parts[0]
    named = len(parts) > 1 and ("." in first or ":" in first or first == "localhost")
    if named:
        registry = first
        if not _HOST.match(registry):
            raise _fail(text, f"registry {registry!r} is not a valid host[:port]")
        port = registry.rpartition(":")[2] if ":" in registry else ""
        if port and not 0 < int(port) < 65536:
            raise _fail(text, f"registry port {port} is out of range")
        path = parts[1:]
    else:
        registry = default_registry
        path = parts if len(parts) > 1 else [default_project, *parts]

    hub = registry in DOCKER_HUB if named else transport == "docker"
    if dockerhub_project and hub:
        upstream = parts[1:] if named else parts
        registry = default_registry
        path = [
            *dockerhub_project.split("/"),
            *(upstream if len(upstream) > 1 else ["library", *upstream]),
        ]
    elif named:
        registry, path = _rewritten(registry, path, rewrites)

    for component in path:
        if not component:
            raise _fail(text, "empty path component ('//' or a trailing '/')")
        if not _COMPONENT.match(component):
            raise _fail(
                text,
                f"path component {component!r} must be lowercase letters and digits "
                "separated by '.', '_', '__' or '-'",
            )
    repository = "/".join(path)
    if len(repository) > MAX_REPOSITORY:
        raise _fail(text, f"repository name longer than {MAX_REPOSITORY} characters")
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, repository, tag, digest, transport)


def _rewritten(
    registry: str, path: list[str], rewrites: Sequence[tuple[str, str]]
) -> tuple[str, list[str]]:
    full = [registry, *path]
    best: tuple[list[str], list[str]] | None = None
    for upstream, site in rewrites:
        prefix = upstream.split("/")
        longer = best is None or len(prefix) > len(best[0])
        if full[: len(prefix)] == prefix and len(full) > len(prefix) and longer:
            best = (prefix, site.split("/"))
    if best is None:
        return registry, path
    prefix, target = best
    return target[0], [*target[1:], *full[len(prefix) :]]


def is_tag(text: str) -> bool:
    return bool(_TAG.match(text))


def is_repository_path(text: str) -> bool:
    """``project[/path]``: components as a repository's, e.g. a Harbor project."""
    return all(_COMPONENT.match(p) for p in text.split("/"))


def check_rewrite(upstream: str, site: str) -> None:
    """A rewrite's two sides: ``host[/path]`` each, the site's with a project."""
    for side, min_parts in ((upstream, 1), (site, 2)):
        parts = side.split("/") if isinstance(side, str) else []
        if (
            len(parts) < min_parts
            or not _HOST.match(parts[0])
            or (len(parts) > 1 and not is_repository_path("/".join(parts[1:])))
        ):
            shape = "host[/path]" if min_parts == 1 else "host/project[/path]"
            raise ImageReferenceError(f"rewrite {upstream!r}: {side!r} is not {shape}")


def check_allowed(ref: Reference, allowed: tuple[str, ...]) -> None:
    """Refuse registries that are not on the admin's allowlist."""
    if ref.registry in DOCKER_HUB and ref.registry not in allowed:
        # Only a site without a Docker Hub proxy gets here (with one, the name maps).
        raise ImageReferenceError(
            f"{ref.registry}/{ref.repository}: this site has no Docker Hub proxy; copy the "
            f"image to {allowed[0] if allowed else 'the site registry'} and name it there "
            "(tfimage push FILE NAME:TAG for a SIF)"
        )
    if ref.registry not in allowed:
        raise ImageReferenceError(
            f"registry {ref.registry!r} is not allowed here (allowed: {', '.join(allowed)})"
        )

"""The SIF artifact, wholly: Apptainer's ORAS shape of an OCI image manifest.

One config blob of Apptainer's config media type and exactly one layer, the SIF
file, named by its title annotation.  This module owns both directions: what a
pulled manifest must look like (:func:`sif_layer`, strictly; the shape Singularity
< 3.7 pushed, with its misspelt layer type, too) and what a pushed one looks like
(:func:`sif_manifest`, for ``RegistryClient.push_sif``).

The manifest's own media type is taken as Apptainer's pull takes it
(``internal/pkg/client/oras/pull.go`` checks the layer's type, not the
manifest's): OCI v1, which SingularityCE >= 4.4 and Apptainer >= 1.3.1 push;
Docker's schema 2, which SingularityCE 4.0-4.3 and Apptainer 1.3.0 pushed
(``internal/pkg/client/oras/image.go``); or none in the body.  What makes the
cache safe (one layer, its digest and size, then the SIF magic) is checked the
same for each.

So is the config's media type: Apptainer's pull does not check it ("prior
versions of Apptainer have not been consistent in setting this"), and the
clients a site has used pushed three -- Apptainer's own (:data:`SIF_CONFIG`),
ORAS's default (:data:`UNKNOWN_CONFIG`, from SingularityCE 3.9-3.11 and Apptainer
1.0-1.2, which let oras-go write the manifest) and, in principle, any other.  A
SIF artifact is known by its one layer's type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from tfimage.agent.core.errors import VerificationError
from tfimage.agent.core.ids import valid_digest
from tfimage.agent.registry.mediatypes import DOCKER_MANIFEST, INDEX_TYPES, OCI_MANIFEST

SIF_CONFIG = "application/vnd.sylabs.sif.config.v1+json"
SIF_LAYER = "application/vnd.sylabs.sif.layer.v1.sif"
# What Singularity < 3.7 pushed (typo and all; hpcng/singularity#4437).  Apptainer
# still pulls it, so do we; we push only SIF_LAYER.
SIF_LAYER_PROTO = "appliciation/vnd.sylabs.sif.layer.tar"
SIF_LAYER_TYPES = (SIF_LAYER, SIF_LAYER_PROTO)
# oras-go's config type when its caller names none (pkg/artifact/consts.go).
UNKNOWN_CONFIG = "application/vnd.unknown.config.v1+json"
TITLE = "org.opencontainers.image.title"
# A SIF's config blob, as pushed: nothing to configure, so an empty JSON object.
SIF_CONFIG_BLOB = b"{}"

MAX_SIF = 1 << 40
# The manifest types a SIF artifact arrives in ("": a body that names none).
SIF_MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST, "")


class FetchedManifest(Protocol):
    """What :func:`sif_layer` reads of a manifest (``client.Manifest`` has it): a
    protocol, as client.py imports this module and an import back would be a cycle."""

    @property
    def media_type(self) -> str: ...

    @property
    def body(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class SifLayer:
    digest: str
    size: int
    title: str


def sif_layer(m: FetchedManifest) -> SifLayer:
    """The manifest's one SIF layer, or a :class:`VerificationError` naming what is off."""
    if m.media_type in INDEX_TYPES:
        raise VerificationError(
            "an image index, not one image: name its tag (resolved to this platform's"
            " manifest) or the digest of one platform's manifest"
        )
    if m.media_type not in SIF_MANIFEST_TYPES:
        raise VerificationError(f"not a SIF artifact (manifest type {m.media_type!r})")
    if not isinstance(m.body.get("config"), dict):
        raise VerificationError("not a SIF artifact (the manifest has no config)")
    layers = m.body.get("layers")
    if not isinstance(layers, list) or len(layers) != 1:
        n = len(layers) if isinstance(layers, list) else 0
        raise VerificationError(f"a SIF artifact has exactly one layer, this one has {n}")
    layer = layers[0]
    if not isinstance(layer, dict) or layer.get("mediaType") not in SIF_LAYER_TYPES:
        raise VerificationError("the layer is not a SIF file")
    digest, size = layer.get("digest"), layer.get("size")
    if not isinstance(digest, str) or not valid_digest(digest):
        raise VerificationError("the SIF layer has no sha256 digest")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_SIF:
        raise VerificationError("the SIF layer has an impossible size")
    annotations = layer.get("annotations") or {}
    title = annotations.get(TITLE, "") if isinstance(annotations, dict) else ""
    return SifLayer(digest, size, str(title))


def is_sif_artifact(body: dict[str, Any]) -> bool:
    """Whether a manifest holds a SIF as Apptainer's pull knows one: by a layer's
    type, whatever its config says (:func:`sif_layer` then checks it strictly)."""
    layers = body.get("layers")
    return isinstance(layers, list) and any(
        isinstance(x, dict) and x.get("mediaType") in SIF_LAYER_TYPES for x in layers
    )


def sif_manifest(config_digest: str, layer_digest: str, layer_size: int, title: str) -> bytes:
    """The manifest that pushes a SIF (its blobs pushed already): ``config_digest``
    is :data:`SIF_CONFIG_BLOB`'s, the layer the SIF file named ``title``."""
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {
            "mediaType": SIF_CONFIG,
            "digest": config_digest,
            "size": len(SIF_CONFIG_BLOB),
        },
        "layers": [
            {
                "mediaType": SIF_LAYER,
                "digest": layer_digest,
                "size": layer_size,
                "annotations": {TITLE: title},
            }
        ],
    }
    return json.dumps(manifest, separators=(",", ":")).encode()

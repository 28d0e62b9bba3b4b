"""What a SIF artifact's manifest must look like (Apptainer's ORAS shape, or the one
Singularity < 3.7 pushed with a misspelt layer type), strictly."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tfimage.agent.errors import VerificationError
from tfimage.agent.registry.client import (
    OCI_MANIFEST,
    SIF_CONFIG,
    SIF_LAYER,
    SIF_LAYER_PROTO,
    Manifest,
)

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}\Z")
MAX_SIF = 1 << 40


@dataclass(frozen=True, slots=True)
class SifLayer:
    digest: str
    size: int
    title: str


def sif_layer(m: Manifest) -> SifLayer:
    """The manifest's one SIF layer, or a :class:`VerificationError` naming what is off."""
    if m.media_type not in (OCI_MANIFEST, ""):
        raise VerificationError(f"not a SIF artifact (manifest type {m.media_type!r})")
    config = m.body.get("config")
    if not isinstance(config, dict) or config.get("mediaType") != SIF_CONFIG:
        raise VerificationError("not a SIF artifact (config media type is not Apptainer's)")
    layers = m.body.get("layers")
    if not isinstance(layers, list) or len(layers) != 1:
        n = len(layers) if isinstance(layers, list) else 0
        raise VerificationError(f"a SIF artifact has exactly one layer, this one has {n}")
    layer = layers[0]
    if not isinstance(layer, dict) or layer.get("mediaType") not in (SIF_LAYER, SIF_LAYER_PROTO):
        raise VerificationError("the layer is not a SIF file")
    digest, size = layer.get("digest"), layer.get("size")
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise VerificationError("the SIF layer has no sha256 digest")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_SIF:
        raise VerificationError("the SIF layer has an impossible size")
    annotations = layer.get("annotations") or {}
    title = (
        annotations.get("org.opencontainers.image.title", "")
        if isinstance(annotations, dict)
        else ""
    )
    return SifLayer(digest, size, str(title))

"""The manifests that real Singularity, SingularityCE and Apptainer releases push
for ``oras://`` SIF artifacts, byte for byte.

Neither client is packaged here, so each shape is rebuilt from the Go that wrote
it: the client's push (which config and layer types, which config blob, what
title) and the library that serialised it (the struct's field order, read from
its source; ``encoding/json``'s compact output with map keys sorted).  Each entry
cites the release and file it reproduces.  Two serialisers matter:

- containerd-style ORAS (deislabs/oras v0.4-v0.8, oras-go v0.5-v1.2) marshals
  image-spec's ``ocispec.Manifest``: no ``mediaType`` in the body (omitempty,
  never set), descriptors ordered mediaType, digest, size; the manifest is PUT
  with the OCI manifest type;
- go-containerregistry (``v1.Manifest`` in pkg/v1/manifest.go, marshalled by
  ``partial.RawManifest``) writes ``mediaType`` and orders descriptors
  mediaType, size, digest; the PUT carries the body's type.

Layout of one push (what the fixtures create in the registry)::

    <repo>/blobs/<config digest>   config blob: b"" (Singularity 3.5-3.8) or b"{}"
    <repo>/blobs/<layer digest>    the SIF file itself, titled with its base name
    <repo>/manifests/<tag>         one of the bodies below
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
SIF_CONFIG_JSON = "application/vnd.sylabs.sif.config.v1+json"
SIF_CONFIG_BARE = "application/vnd.sylabs.sif.config.v1"
UNKNOWN_CONFIG = "application/vnd.unknown.config.v1+json"
SIF_LAYER = "application/vnd.sylabs.sif.layer.v1.sif"
SIF_LAYER_PROTO = "appliciation/vnd.sylabs.sif.layer.tar"
TITLE = "org.opencontainers.image.title"


def _go_json(value: Any) -> bytes:
    """``encoding/json.Marshal``: compact, UTF-8, ``<>&`` escaped (HTMLEscape)."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Push:
    """One client's push: ``manifest(layer digest, layer size, title)`` is the
    exact body it PUT with ``content_type``, after uploading ``config_blob``."""

    name: str
    clients: str
    source: str
    content_type: str
    config_type: str
    config_blob: bytes
    layer_type: str
    serialiser: str  # "ocispec" or "ggcr"

    def manifest(self, layer_digest: str, layer_size: int, title: str) -> bytes:
        config_digest, config_size = _sha256(self.config_blob), len(self.config_blob)
        annotations = {TITLE: title}
        if self.serialiser == "ocispec":
            # image-spec specs-go/v1: Manifest{Versioned, MediaType omitempty, Config,
            # Layers, Annotations omitempty}; Descriptor{MediaType, Digest, Size, URLs,
            # Annotations, Platform}
            return _go_json(
                {
                    "schemaVersion": 2,
                    "config": {
                        "mediaType": self.config_type,
                        "digest": config_digest,
                        "size": config_size,
                    },
                    "layers": [
                        {
                            "mediaType": self.layer_type,
                            "digest": layer_digest,
                            "size": layer_size,
                            "annotations": annotations,
                        }
                    ],
                }
            )
        # go-containerregistry pkg/v1/manifest.go: Manifest{SchemaVersion, MediaType,
        # Config, Layers, Annotations, Subject}; Descriptor{MediaType, Size, Digest,
        # Data, URLs, Annotations, Platform, ArtifactType}
        return _go_json(
            {
                "schemaVersion": 2,
                "mediaType": self.content_type,
                "config": {
                    "mediaType": self.config_type,
                    "size": config_size,
                    "digest": config_digest,
                },
                "layers": [
                    {
                        "mediaType": self.layer_type,
                        "size": layer_size,
                        "digest": layer_digest,
                        "annotations": annotations,
                    }
                ],
            }
        )


PUSHES = [
    Push(
        "singularity-3.5",
        "Singularity 3.5.0-3.6.4",
        "sylabs/singularity v3.5.0 internal/pkg/oras/oras.go (UploadImage: a /dev/null"
        " config, the misspelt layer type); deislabs/oras v0.4.0 pkg/oras/push.go pack",
        OCI_MANIFEST,
        SIF_CONFIG_JSON,
        b"",
        SIF_LAYER_PROTO,
        "ocispec",
    ),
    Push(
        "singularity-3.7",
        "Singularity 3.7.0-3.7.4",
        "sylabs/singularity v3.7.0 internal/pkg/client/oras/oras.go UploadImage;"
        " deislabs/oras v0.8.1 pkg/oras/push.go pack",
        OCI_MANIFEST,
        SIF_CONFIG_JSON,
        b"",
        SIF_LAYER,
        "ocispec",
    ),
    Push(
        "singularity-3.8",
        "Singularity 3.8.0-3.8.7",
        "sylabs/singularity v3.8.0 internal/pkg/client/oras/oras.go UploadImage (the"
        " config type without +json; oras-project/oras-go v0.1.0)",
        OCI_MANIFEST,
        SIF_CONFIG_BARE,
        b"",
        SIF_LAYER,
        "ocispec",
    ),
    Push(
        "oras-go-default",
        "SingularityCE 3.9.0-3.11.5, Apptainer 1.0.0-1.2.5; Singularity 3.8's retry"
        " for registries that refused its config (Harbor 2.2)",
        "apptainer v1.2.0 internal/pkg/client/oras/oras.go UploadImage:"
        " content.GenerateManifestAndConfig(nil, nil, desc); oras-go v1.2.3"
        " pkg/content/manifest.go GenerateConfig (artifact.UnknownConfigMediaType, {})",
        OCI_MANIFEST,
        UNKNOWN_CONFIG,
        b"{}",
        SIF_LAYER,
        "ocispec",
    ),
    Push(
        "ggcr-docker",
        "SingularityCE 4.0.0-4.3.x, Apptainer 1.3.0",
        "apptainer v1.3.0 internal/pkg/client/oras/image.go NewImageFromSIF"
        " (types.DockerManifestSchema2); go-containerregistry v0.19.0 pkg/v1/manifest.go",
        DOCKER_MANIFEST,
        SIF_CONFIG_JSON,
        b"{}",
        SIF_LAYER,
        "ggcr",
    ),
    Push(
        "ggcr-oci",
        "SingularityCE 4.4.0 and later, Apptainer 1.3.1 and later",
        "apptainer v1.3.1 internal/pkg/client/oras/image.go NewImageFromSIF"
        " (types.OCIManifestSchema1); sylabs/singularity v4.4.0 the same",
        OCI_MANIFEST,
        SIF_CONFIG_JSON,
        b"{}",
        SIF_LAYER,
        "ggcr",
    ),
]

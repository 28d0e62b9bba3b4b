"""SIF artifacts as the clients a site has used pushed them, pulled from a real
registry into the cache: every manifest media type Apptainer's own pull accepts
(its ``internal/pkg/client/oras/pull.go`` checks the layer's type, not the
manifest's), with the cache's checks (one layer, size, sha256, SIF magic) as
strict for each."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from support import Registry
from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core import layout
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import VerificationError
from tfimage.agent.registry.artifact import SIF_CONFIG, SIF_LAYER, TITLE
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.registry.credentials import Credential
from tfimage.agent.registry.mediatypes import DOCKER_MANIFEST, OCI_MANIFEST


def _client(reg: Registry) -> RegistryClient:
    return RegistryClient(
        reg.host,
        Credential(reg.username, reg.password),
        ca_bundle=str(reg.ca),
        connect_timeout=2,
        read_timeout=10,
    )


def _manifest(media_type: str | None, config: str, layer: str, size: int) -> bytes:
    body: dict[str, object] = {"schemaVersion": 2}
    if media_type is not None:
        body["mediaType"] = media_type
    body["config"] = {"mediaType": SIF_CONFIG, "digest": config, "size": 2}
    body["layers"] = [
        {
            "mediaType": SIF_LAYER,
            "digest": layer,
            "size": size,
            "annotations": {TITLE: "image.sif"},
        }
    ]
    return json.dumps(body).encode()


# (tag, the body's mediaType, the Content-Type of the push): who pushes it so
CLIENTS = [
    # SingularityCE >= 4.4.0 and Apptainer >= 1.4.0 ("oras: use OCI Manifest Schema 1")
    ("oci", OCI_MANIFEST, OCI_MANIFEST),
    # SingularityCE 4.0-4.3 and Apptainer 1.3.0 (internal/pkg/client/oras/image.go,
    # before "fixed the wrong mediaType in the oras push manifest")
    ("docker-schema2", DOCKER_MANIFEST, DOCKER_MANIFEST),
    # a body that names no type (older ORAS pushes): the registry's Content-Type rules
    ("untyped", None, OCI_MANIFEST),
]


@pytest.mark.parametrize(("tag", "body_type", "content_type"), CLIENTS, ids=[c[0] for c in CLIENTS])
def test_a_sif_pushed_with_each_manifest_type_a_client_used_is_pulled(
    registry: Registry,
    make_sif: Callable[[dict[str, str]], Path],
    tmp_path: Path,
    tag: str,
    body_type: str | None,
    content_type: str,
) -> None:
    up = _client(registry)
    sif = make_sif({"etc/tfimage-test-image": f"pushed as {tag}\n"})
    layer, size = up.push_blob("library/clients", sif)
    config = up.push_bytes("library/clients", b"{}")
    up.push_manifest(
        "library/clients", tag, _manifest(body_type, config, layer, size), content_type
    )
    cfg = load_config(registry.write_site(tmp_path))
    got = Puller(ImageCache(cfg)).ensure(cfg.reference(f"clients:{tag}"))
    assert got.path.read_bytes() == sif.read_bytes()


def test_a_docker_schema2_sif_is_checked_as_strictly_as_an_oci_one(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    up = _client(registry)
    sif = make_sif({"etc/tfimage-test-image": "strict\n"})
    layer, size = up.push_blob("library/strict", sif)
    config = up.push_bytes("library/strict", b"{}")
    # The size the manifest states is not the blob's: refused, and nothing cached.
    up.push_manifest(
        "library/strict", "1", _manifest(DOCKER_MANIFEST, config, layer, size + 1), DOCKER_MANIFEST
    )
    two_layers = json.loads(_manifest(DOCKER_MANIFEST, config, layer, size))
    two_layers["layers"] *= 2
    up.push_manifest("library/strict", "2", json.dumps(two_layers).encode(), DOCKER_MANIFEST)
    cfg = load_config(registry.write_site(tmp_path))
    with pytest.raises(VerificationError):
        Puller(ImageCache(cfg)).ensure(cfg.reference("strict:1"))
    with pytest.raises(VerificationError, match="exactly one layer, this one has 2"):
        Puller(ImageCache(cfg)).ensure(cfg.reference("strict:2"))
    assert not [p for p in layout.cache_images(cfg.cache_dir).iterdir() if p.suffix == ".sif"]

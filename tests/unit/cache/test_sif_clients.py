"""SIF artifacts as the clients a site has used pushed them, pulled from a real
registry into the cache: every manifest and config media type Apptainer's own pull accepts
(its ``internal/pkg/client/oras/oras.go`` DownloadImage checks the layer's type, not the
manifest's), with the cache's checks (one layer, size, sha256, SIF magic) as
strict for each."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from peers import PUSHES, Push
from support import Registry
from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core import layout
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import ConfigError, VerificationError
from tfimage.agent.core.sif import machine_arch, this_platform
from tfimage.agent.registry.artifact import SIF_CONFIG, SIF_LAYER, TITLE
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.registry.credentials import Credential
from tfimage.agent.registry.mediatypes import DOCKER_LIST, DOCKER_MANIFEST, OCI_INDEX, OCI_MANIFEST
from tfimage.agent.registry.transport import Response, StdlibTransport
from tfimage.agent.submit.pin import pin


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


@pytest.mark.parametrize("push", PUSHES, ids=[p.name for p in PUSHES])
def test_a_sif_as_each_client_release_pushed_it_is_pinned_and_pulled(
    registry: Registry,
    make_sif: Callable[[dict[str, str]], Path],
    tmp_path: Path,
    push: Push,
) -> None:
    """The exact bytes each release PUT (tests/peers.py cites its source): pinned
    at submit through the header check, then pulled, its bytes the SIF's own."""
    up = _client(registry)
    sif = make_sif({"etc/tfimage-test-image": f"pushed by {push.clients}\n"})
    layer, size = up.push_blob("library/clients", sif)
    assert up.push_bytes("library/clients", push.config_blob).startswith("sha256:")
    raw = push.manifest(layer, size, sif.name)
    digest = up.push_manifest("library/clients", push.name, raw, push.content_type)
    assert digest == "sha256:" + hashlib.sha256(raw).hexdigest()
    cfg = load_config(registry.write_site(tmp_path))
    pinned, warning = pin(
        cfg, cfg.reference(f"clients:{push.name}"), lambda _h: up, tmp_path / "seen"
    )
    assert (pinned.digest, warning) == (digest, None)
    got = Puller(ImageCache(cfg)).ensure(pinned)
    assert got.path.read_bytes() == sif.read_bytes()


def test_the_fixtures_match_the_example_manifest_apptainer_1_3_0_documents() -> None:
    """apptainer v1.3.0 internal/pkg/client/oras/image.go draws the manifest it
    pushes in a comment; the ggcr-docker fixture is that manifest, plus the
    ``mediaType`` the struct literal below the comment sets."""
    layer = "sha256:13e1552aaf6aa3916353730be52e06ec214ae8f8a89062cec1f33990b553a6c9"
    example = {
        "schemaVersion": 2,
        "config": {
            "mediaType": "application/vnd.sylabs.sif.config.v1+json",
            "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
            "size": 2,
        },
        "layers": [
            {
                "mediaType": "application/vnd.sylabs.sif.layer.v1.sif",
                "digest": layer,
                "size": 29814784,
                "annotations": {"org.opencontainers.image.title": "ubuntu_latest.sif"},
            }
        ],
    }
    (ggcr,) = [p for p in PUSHES if p.name == "ggcr-docker"]
    raw = ggcr.manifest(layer, 29814784, "ubuntu_latest.sif")
    body = json.loads(raw)
    assert body.pop("mediaType") == DOCKER_MANIFEST
    assert body == example
    # Go's encoding: compact, and the descriptor's size before its digest (ggcr's
    # field order), where image-spec's puts the digest first.
    assert raw.startswith(b'{"schemaVersion":2,"mediaType":"application/vnd.docker')
    assert b'"size":2,"digest":"sha256:44136fa' in raw
    (oras,) = [p for p in PUSHES if p.name == "oras-go-default"]
    empty_json = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
    assert f'"digest":"{empty_json}","size":2'.encode() in oras.manifest(empty_json, 1, "x.sif")


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


def _push_sif(up: RegistryClient, repo: str, sif: Path, tag: str) -> tuple[str, int]:
    """A SIF as an OCI v1 artifact under ``tag``: its manifest's digest and size."""
    layer, size = up.push_blob(repo, sif)
    config = up.push_bytes(repo, b"{}")
    raw = _manifest(OCI_MANIFEST, config, layer, size)
    return up.push_manifest(repo, tag, raw, OCI_MANIFEST), len(raw)


def _index(media_type: str, entries: list[tuple[str, int, str]]) -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": media_type,
            "manifests": [
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": digest,
                    "size": size,
                    "platform": {"os": "linux", "architecture": arch},
                }
                for digest, size, arch in entries
            ],
        }
    ).encode()


@pytest.mark.parametrize("index_type", [OCI_INDEX, DOCKER_LIST], ids=["oci-index", "docker-list"])
def test_an_index_of_sifs_pins_this_platforms_manifest_and_runs_its_bytes(
    registry: Registry,
    make_sif: Callable[[dict[str, str]], Path],
    tmp_path: Path,
    index_type: str,
) -> None:
    up = _client(registry)
    here = this_platform().split("/")[1]
    other = "s390x" if here != "s390x" else "arm64"
    ours = make_sif({"etc/tfimage-test-image": f"built for {here}\n"})
    theirs = make_sif({"etc/tfimage-test-image": f"built for {other}\n"})
    d_theirs, n_theirs = _push_sif(up, "library/multi", theirs, "theirs")
    d_ours, n_ours = _push_sif(up, "library/multi", ours, "ours")
    # Theirs first: the entry is chosen by platform, not by position.
    entries = [(d_theirs, n_theirs, other), (d_ours, n_ours, here)]
    index = up.push_manifest("library/multi", "2.0", _index(index_type, entries), index_type)
    cfg = load_config(registry.write_site(tmp_path))

    pinned, warning = pin(cfg, cfg.reference("multi:2.0"), lambda _h: up, tmp_path / "seen")
    assert warning is None
    assert pinned.digest == d_ours != index
    got = Puller(ImageCache(cfg)).ensure(pinned)
    assert got.path.read_bytes() == ours.read_bytes()
    # A node asked for the tag itself resolves it the same way.
    (tmp_path / "node").mkdir()
    fresh = load_config(registry.write_site(tmp_path / "node"))
    by_tag = Puller(ImageCache(fresh)).ensure(fresh.reference("multi:2.0"))
    assert by_tag.ref.digest == d_ours and by_tag.path.read_bytes() == ours.read_bytes()
    # The index's own digest names no one image: refused with what to name instead.
    with pytest.raises(VerificationError, match="an image index, not one image"):
        Puller(ImageCache(fresh)).ensure(fresh.reference(f"multi@{index}"))


def test_an_index_without_this_platform_is_refused_at_submit_naming_what_it_has(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    up = _client(registry)
    here = this_platform()
    d, n = _push_sif(up, "library/foreign", make_sif({"f": "arm\n"}), "arm")
    d2, n2 = _push_sif(up, "library/foreign", make_sif({"f": "ppc\n"}), "ppc")
    arches = ["arm64", "ppc64le"] if here != "linux/arm64" else ["s390x", "ppc64le"]
    entries = [(d, n, arches[0]), (d2, n2, arches[1])]
    up.push_manifest("library/foreign", "1", _index(OCI_INDEX, entries), OCI_INDEX)
    cfg = load_config(registry.write_site(tmp_path))
    with pytest.raises(VerificationError) as e:
        pin(cfg, cfg.reference("foreign:1"), lambda _h: up, tmp_path / "seen")
    want = f"no image for {here} in its index (it has linux/{min(arches)}, linux/{max(arches)})"
    assert want in str(e.value) and "\n" not in str(e.value)


class RecordingTransport(StdlibTransport):
    """The real transport, noting each blob request's Range header."""

    def __init__(self) -> None:
        super().__init__()
        self.blob_ranges: list[str] = []

    def request(self, method: str, url: str, **kw: Any) -> Response:
        if "/blobs/" in url and method == "GET":
            self.blob_ranges.append(kw["headers"].get("Range", "whole"))
        return super().request(method, url, **kw)


def _siftool_sif(tmp_path: Path, name: str, *, parttype: int, arch: int, pad: int = 0) -> Path:
    """A SIF as siftool writes one: a squashfs partition of ``parttype`` and ``arch``
    (siftool's numbers), ``pad`` bytes of incompressible data inside it."""
    root = tmp_path / f"root-{name}"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "marker").write_text(f"{name}\n")
    (root / "blob").write_bytes(os.urandom(pad))
    sqfs, sif = tmp_path / f"{name}.sqfs", tmp_path / f"{name}.sif"
    for argv in (
        ["mksquashfs", str(root), str(sqfs), "-noappend", "-quiet", "-all-root"],
        ["siftool", "new", str(sif)],
        ["siftool", "add", "--datatype", "4", "--parttype", str(parttype), "--partfs", "1",
         "--partarch", str(arch), str(sif), str(sqfs)],
    ):  # fmt: skip
        subprocess.run(argv, check=True, capture_output=True, timeout=60)
    return sif


def test_a_sif_it_cannot_run_is_refused_at_submit_from_its_first_bytes(
    registry: Registry, tmp_path: Path
) -> None:
    up = _client(registry)
    other, code = ("arm64", 4) if machine_arch() != "arm64" else ("s390x", 11)
    here_code = {"amd64": 2, "arm64": 4}.get(machine_arch(), 2)
    data_only = _siftool_sif(tmp_path, "data", parttype=3, arch=here_code, pad=4 << 20)
    foreign = _siftool_sif(tmp_path, "foreign", parttype=2, arch=code)
    fine = _siftool_sif(tmp_path, "fine", parttype=2, arch=here_code, pad=4 << 20)
    for tag, sif in (("data", data_only), ("foreign", foreign), ("fine", fine)):
        up.push_sif("library/kinds", tag, sif)
    cfg = load_config(registry.write_site(tmp_path))
    spy = RecordingTransport()
    reader = RegistryClient(
        registry.host,
        Credential(registry.username, registry.password),
        ca_bundle=str(registry.ca),
        transport=spy,
    )

    def pin_tag(tag: str) -> str:
        pinned, _ = pin(cfg, cfg.reference(f"kinds:{tag}"), lambda _h: reader, tmp_path / "seen")
        return str(pinned)

    with pytest.raises(VerificationError) as e:
        pin_tag("data")
    assert str(e.value).endswith(
        "library/kinds:data is a SIF with no system partition (data only, as"
        " `apptainer build --data` makes), not an image to run"
    )
    # The header and descriptor table only: one range of 64 KiB of a 4 MiB blob.
    assert spy.blob_ranges == [f"bytes=0-{(64 << 10) - 1}"]
    with pytest.raises(VerificationError, match=f"is a SIF built for {other}; the nodes run"):
        pin_tag("foreign")
    assert "@sha256:" in pin_tag("fine")
    # Refused ones were never remembered as seen: an outage cannot pin them either.
    assert "kinds:data" not in (tmp_path / "seen").read_text()


@pytest.mark.parametrize("transport", ["docker://", ""], ids=["docker", "bare"])
def test_an_oci_image_of_squashfs_layers_is_named_at_submit(
    registry: Registry, tmp_path: Path, transport: str
) -> None:
    """SingularityCE's OCI push of an OCI-SIF: an image config and squashfs layers
    (``application/vnd.sylabs.image.layer.v1.squashfs``), which skopeo and umoci
    cannot unpack."""
    up = _client(registry)
    layer = up.push_bytes("library/ocisif", b"hsqs" + os.urandom(1024))
    config_blob = b'{"architecture":"amd64","os":"linux"}'
    config = up.push_bytes("library/ocisif", config_blob)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config,
            "size": len(config_blob),
        },
        "layers": [
            {
                "mediaType": "application/vnd.sylabs.image.layer.v1.squashfs",
                "digest": layer,
                "size": 1028,
            }
        ],
    }
    up.push_manifest("library/ocisif", "1", json.dumps(manifest).encode(), OCI_MANIFEST)
    cfg = load_config(registry.write_site(tmp_path))
    with pytest.raises(VerificationError, match="is an OCI image with squashfs layers"):
        pin(cfg, cfg.reference(f"{transport}ocisif:1"), lambda _h: up, tmp_path / "seen")


def test_a_login_node_of_another_architecture_pins_the_nodes_platform_from_config(
    registry: Registry, tmp_path: Path
) -> None:
    """Login nodes on amd64 submitting for arm64 compute nodes (``platform:``): the
    index resolves to the nodes' entry and the SIF's architecture is checked against
    theirs, not against the machine that submits."""
    up = _client(registry)
    here = machine_arch()
    nodes, code = ("arm64", 4) if here != "arm64" else ("s390x", 11)
    here_code = {"amd64": 2, "arm64": 4}.get(here, 2)
    for_nodes = _siftool_sif(tmp_path, "nodes", parttype=2, arch=code)
    for_login = _siftool_sif(tmp_path, "login", parttype=2, arch=here_code)
    d_nodes = up.push_sif("library/cross", "nodes", for_nodes)
    d_login = up.push_sif("library/cross", "login", for_login)
    sizes = {d: len(up.manifest("library/cross", d).raw) for d in (d_nodes, d_login)}
    entries = [(d_login, sizes[d_login], here), (d_nodes, sizes[d_nodes], nodes)]
    up.push_manifest("library/cross", "1", _index(OCI_INDEX, entries), OCI_INDEX)
    (tmp_path / "default").mkdir()
    default = load_config(registry.write_site(tmp_path / "default"))
    cfg = load_config(registry.write_site(tmp_path, platform=f"linux/{nodes}"))
    assert cfg.node_platform == f"linux/{nodes}" != default.node_platform

    def pinned(c: Any, tag: str) -> str | None:
        return pin(c, c.reference(f"cross:{tag}"), lambda _h: up, tmp_path / "seen")[0].digest

    assert pinned(default, "1") == d_login
    assert pinned(cfg, "1") == d_nodes
    assert pinned(cfg, "nodes") == d_nodes
    with pytest.raises(VerificationError, match=f"a SIF built for {here}; the nodes run {nodes}"):
        pinned(cfg, "login")
    # A node given the same config resolves the tag to the same bytes.
    got = Puller(ImageCache(cfg)).ensure(cfg.reference("cross:1"))
    assert got.ref.digest == d_nodes and got.path.read_bytes() == for_nodes.read_bytes()


@pytest.mark.parametrize("bad", ["arm64", "linux/", "windows/amd64", "linux/arm64/v8 x"])
def test_a_platform_that_is_not_linux_and_an_architecture_is_refused_in_one_line(
    registry: Registry, tmp_path: Path, bad: str
) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(registry.write_site(tmp_path, platform=bad))
    assert "'platform' must be linux/<architecture>" in str(e.value)
    assert "\n" not in str(e.value)

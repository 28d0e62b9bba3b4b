"""Registry client and cache against a real TLS + htpasswd docker-registry."""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from support import Registry, at_once
from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import ImageError, RegistryError
from tfimage.agent.registry.access import client_for
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.registry.credentials import Credential
from tfimage.agent.registry.transport import RequestsTransport, StdlibTransport, Transport


def client(
    reg: Registry, password: str | None = None, transport: Transport | None = None
) -> RegistryClient:
    return RegistryClient(
        reg.host,
        Credential(reg.username, password or reg.password),
        ca_bundle=str(reg.ca),
        connect_timeout=2,
        read_timeout=10,
        transport=transport,
    )


TRANSPORTS = pytest.mark.parametrize("transport", [RequestsTransport, StdlibTransport])


def test_push_then_pull_through_cache(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    sif = make_sif({"etc/tfimage-test-image": "cache-test\n"})
    digest = client(registry).push_sif("library/cachetest", "1.0", sif)
    cfg = load_config(registry.write_site(tmp_path))
    cache = ImageCache(cfg)
    pull = Puller(cache)

    got = pull.ensure(cfg.reference("cachetest:1.0"))
    assert not got.hit
    assert got.ref.digest == digest
    assert got.path.read_bytes() == sif.read_bytes()
    assert stat.S_IMODE(got.path.stat().st_mode) == 0o444
    assert not any((tmp_path / "cache" / "tmp").iterdir())  # nothing half-published

    again = pull.ensure(cfg.reference("cachetest:1.0"))
    assert again.hit and again.path == got.path
    pinned = pull.ensure(cfg.reference(f"cachetest@{digest}"))
    assert pinned.hit
    [entry] = cache.entries()
    assert entry.digest == digest
    assert f"{registry.host}/library/cachetest:1.0" in entry.refs


@TRANSPORTS
def test_manifest_by_digest(
    registry: Registry, make_sif: Callable[..., Path], transport: type[Transport]
) -> None:
    c = client(registry, transport=transport())
    real = c.push_sif("library/digestcheck", "1", make_sif({"a": "1"}))
    assert c.manifest("library/digestcheck", real).digest == real
    assert c.manifest("library/digestcheck", "1").digest == real
    with pytest.raises(RegistryError, match="not found"):
        c.manifest("library/digestcheck", "sha256:" + "0" * 64)


@TRANSPORTS
def test_wrong_password_fails_fast(registry: Registry, transport: type[Transport]) -> None:
    started = time.monotonic()
    with pytest.raises(RegistryError, match="authentication refused") as e:
        client(registry, "wrong", transport()).manifest("library/anything", "1")
    assert time.monotonic() - started < 2.0
    assert "wrong" not in str(e.value)


def test_unknown_tag_is_a_clear_error(registry: Registry, tmp_path: Path) -> None:
    cfg = load_config(registry.write_site(tmp_path))
    with pytest.raises(RegistryError, match="not found"):
        Puller(ImageCache(cfg)).ensure(cfg.reference("does-not-exist:9"))


def test_broken_oci_image_fails_and_nothing_published(registry: Registry, tmp_path: Path) -> None:
    c = client(registry)
    blob = c.push_bytes("library/notsif", b"hello")
    cfg_digest = c.push_bytes("library/notsif", b"{}")
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": cfg_digest,
            "size": 2,
        },
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": blob, "size": 5}
        ],
    }
    c.push_manifest(
        "library/notsif",
        "1",
        json.dumps(manifest).encode(),
        "application/vnd.oci.image.manifest.v1+json",
    )
    cfg = load_config(registry.write_site(tmp_path))
    # An OCI image whose layer is not a tar: conversion fails, clearly, and leaves nothing.
    with pytest.raises(ImageError, match="unpacking the OCI image"):
        Puller(ImageCache(cfg)).ensure(cfg.reference("notsif:1"))
    assert not list((tmp_path / "cache" / "images").glob("*.sif"))
    assert not any((tmp_path / "cache" / "tmp").iterdir())


def test_concurrent_ensures_download_once(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    client(registry).push_sif("library/conc", "1", make_sif({"x": "y" * 100000}))
    cfg = load_config(registry.write_site(tmp_path))
    results, errors = at_once(
        lambda: Puller(ImageCache(cfg)).ensure(cfg.reference("conc:1")).hit, 8
    )
    assert not errors
    assert sorted(results) == [False] + [True] * 7  # exactly one download


def test_client_for_reads_site_credentials(registry: Registry, tmp_path: Path) -> None:
    cfg = load_config(registry.write_site(tmp_path))
    c = client_for(cfg, registry.host)
    with pytest.raises(RegistryError, match="not found"):
        c.manifest("library/none", "1")  # authenticated: 404, not 401


def test_first_registry_down_the_mirror_serves(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    sif = make_sif({"etc/tfimage-test-image": "mirrored\n"})
    digest = client(registry).push_sif("library/mirrored", "1", sif)
    # The site's primary is down (nothing listens on port 1); the mirror has the image.
    cfg_path = registry.write_site(tmp_path)
    text = cfg_path.read_text().replace(f'registry: "{registry.host}"', 'registry: "127.0.0.1:1"')
    cfg_path.write_text(text + f'mirrors: ["{registry.host}"]\nconnect_timeout: 1\n')
    cfg = load_config(cfg_path)
    got = Puller(ImageCache(cfg)).ensure(cfg.reference("mirrored:1"))
    assert (got.source, got.ref.digest, got.ref.registry) == (registry.host, digest, "127.0.0.1:1")
    assert got.path.read_bytes() == sif.read_bytes()
    # The entry's record says which one served it (`tfimage cache ls --json`).
    assert ImageCache(cfg).read_entry(digest).source == registry.host


WRITEBACK_PROBE = """
import os, sys
from tfimage.agent.cache.download import _start_writeback
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o600)
os.write(fd, b"x" * (1 << 20))
_start_writeback(fd, 0, 1 << 20)
_start_writeback(987654, 0, 1)  # a bad descriptor: ignored, the fsync decides
print("done")
"""


def test_the_writeback_hint_reaches_the_kernel(tmp_path: Path) -> None:
    """Page-cache writes get sync_file_range(SYNC_FILE_RANGE_WRITE) every 64 MiB, so
    the fsync before publishing does not wait for a whole image: seen in the
    syscalls themselves (the kernel's own counters are system-wide, too noisy)."""
    r = subprocess.run(
        [
            "strace",
            "-f",
            "-e",
            "trace=sync_file_range",
            "-o",
            str(tmp_path / "trace"),
            sys.executable,
            "-c",
            WRITEBACK_PROBE,
            str(tmp_path / "blob"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr
    calls = [
        line for line in (tmp_path / "trace").read_text().splitlines() if "sync_file_range" in line
    ]
    assert any(
        re.search(r"sync_file_range\(\d+, 0, 1048576, SYNC_FILE_RANGE_WRITE\) = 0", c)
        for c in calls
    ), calls
    assert any("987654" in c and "EBADF" in c for c in calls), calls


def _refuses_unaligned_o_direct(d: Path) -> bool | None:
    """Whether d's filesystem refuses an O_DIRECT write from memory not aligned to a
    block (EINVAL), as the fallback below needs; None when it refuses O_DIRECT at
    open.  tmpfs takes such writes since Linux 6.6 (and /tmp is a tmpfs on Debian
    13); ext4, xfs and btrfs on a block device refuse them."""
    import errno
    import mmap
    import os

    from tfimage.agent.cache.download import ALIGN

    probe = d / "o_direct-probe"
    probe.touch()
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return None
    try:
        os.pwrite(fd, memoryview(mmap.mmap(-1, 2 * ALIGN))[1 : 1 + ALIGN], 0)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return True
    finally:
        os.close(fd)
        probe.unlink()
    return False


def test_appender_falls_back_when_o_direct_refuses_a_write(tmp_path: Path) -> None:
    """O_DIRECT opened, then a write refused (EINVAL: here a buffer not aligned in
    memory, as after a short write): that write goes through the page cache, and
    the file still holds exactly the bytes given, in place.

    The refusal must be real: where tmp_path's filesystem does not refuse (tmpfs),
    the file goes on a small ext4 of the test's own, on a loop device."""
    import mmap
    import os
    import shutil
    import subprocess

    from tfimage.agent.cache.download import ALIGN, _Appender

    where = tmp_path
    own_fs: Path | None = None
    if os.statvfs(tmp_path).f_bsize > ALIGN or not _refuses_unaligned_o_direct(tmp_path):
        fstype = subprocess.run(
            ["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True
        ).stdout.strip()
        why = f"{tmp_path} ({fstype}) does not refuse an unaligned O_DIRECT write"
        if os.geteuid() != 0:
            pytest.skip(f"{why}, and mounting an ext4 that does needs root")
        if shutil.which("mkfs.ext4") is None:
            pytest.skip(f"{why}, and making an ext4 that does needs mkfs.ext4 (e2fsprogs)")
        image = tmp_path / "ext4.img"
        with image.open("wb") as f:
            f.truncate(32 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-b", str(ALIGN), str(image)], check=True)
        where = tmp_path / "ext4"
        where.mkdir()
        mount = ["mount", "-o", "loop,nosuid,nodev", str(image), str(where)]
        done = subprocess.run(mount, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"{why}, and mounting an ext4 that does failed: {done.stderr.strip()}")
        own_fs = where
    try:
        assert _refuses_unaligned_o_direct(where), f"{where}: the unaligned write was taken"
        path = where / "partial"
        path.touch()
        data = os.urandom(3 * ALIGN)
        buf = mmap.mmap(-1, 4 * ALIGN)
        buf[1 : 1 + len(data)] = data
        view = memoryview(buf)
        with _Appender(path) as out:
            assert out.direct is not None  # the probe above opened it with O_DIRECT
            out.write(view[1 : 1 + ALIGN], 0)  # aligned length and offset, unaligned memory
            assert out.flushed == 0  # it went through the page cache
            buf[0:ALIGN] = data[ALIGN : 2 * ALIGN]
            out.write(view[0:ALIGN], ALIGN)  # aligned in every way: O_DIRECT again
            out.write(view[1 + 2 * ALIGN : 1 + 3 * ALIGN], 2 * ALIGN)
        assert path.read_bytes() == data
    finally:
        if own_fs is not None:  # the loop device goes with it (autoclear)
            subprocess.run(["umount", str(own_fs)], check=True)


def test_a_sif_pushed_by_old_singularity_is_pulled_and_a_near_miss_refused(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    """Singularity < 3.7 pushed its SIF layer as ``appliciation/vnd.sylabs.sif.layer.tar``
    (sic): Apptainer still pulls those, and so does the cache.  A type merely like it
    is not a SIF layer."""
    import json

    from tfimage.agent.core.errors import VerificationError
    from tfimage.agent.registry.artifact import SIF_CONFIG
    from tfimage.agent.registry.mediatypes import OCI_MANIFEST

    up = client(registry)
    sif = make_sif({"etc/tfimage-test-image": "old singularity\n"})
    layer, size = up.push_blob("library/oldsing", sif)
    config = up.push_bytes("library/oldsing", b"{}")
    cfg = load_config(registry.write_site(tmp_path))
    for tag, media_type in (
        ("1", "appliciation/vnd.sylabs.sif.layer.tar"),
        ("2", "application/vnd.sylabs.sif.layer.tar"),
    ):
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": SIF_CONFIG, "digest": config, "size": 2},
            "layers": [{"mediaType": media_type, "digest": layer, "size": size}],
        }
        up.push_manifest("library/oldsing", tag, json.dumps(manifest).encode(), OCI_MANIFEST)
    got = Puller(ImageCache(cfg)).ensure(cfg.reference("oldsing:1"))
    assert got.path.read_bytes() == sif.read_bytes()
    with pytest.raises(VerificationError, match="the layer is not a SIF file"):
        Puller(ImageCache(cfg)).ensure(cfg.reference("oldsing:2"))

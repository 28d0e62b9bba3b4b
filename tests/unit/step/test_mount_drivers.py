"""Image mount drivers by policy: each one mounts a real SIF nosuid,nodev and goes
with the job; one a node lacks is skipped, saying so; ``kernel`` only where trusted."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from support import Registry, build_sif
from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core.config import config_from_mapping, load_config
from tfimage.agent.core.errors import ConfigError, RuntimeSetupError
from tfimage.agent.step import elfname, imagemount, slurmstubs, squashcomp

FSTYPE = {
    "kernel": "squashfs",
    "squashfuse_ll": "fuse.squashfuse_ll",
    "squashfuse": "fuse.squashfuse",
}


def _mount_of(target: Path) -> tuple[str, set[str]]:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(target):
                sep = fields.index("-")
                return fields[sep + 1], set(fields[5].split(","))
    raise AssertionError(f"{target} is not mounted")


def _loops_of(sif: Path) -> str:
    return subprocess.run(["losetup", "-j", str(sif)], capture_output=True, text=True,
                          timeout=30).stdout  # fmt: skip


@pytest.mark.parametrize("driver", sorted(FSTYPE))
def test_each_driver_mounts_the_image_nosuid_nodev_and_leaves_with_the_job(
    root_with_fuse: None, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path, driver: str
) -> None:
    sif = make_sif({"etc/marker": f"via {driver}\n"})
    state = tmp_path / "state"
    img = imagemount.mount_image(str(state), "61", sif, "sha256:" + "a" * 64, (driver,))
    try:
        fstype, options = _mount_of(img)
        assert fstype == FSTYPE[driver] and {"ro", "nosuid", "nodev"} <= options
        assert (img / "etc/marker").read_text() == f"via {driver}\n"
        if driver == "kernel":
            assert str(sif) in _loops_of(sif)
    finally:
        assert imagemount.release_job(str(state), "61") == []
        assert imagemount.release_images(str(state), lambda digest: False) == []
    assert not imagemount.mounted(img) and _loops_of(sif) == ""  # the loop device went too


def _marked_sif(tmp_path: Path, marker: str, comp: str) -> Path:
    """A SIF whose /etc/marker says ``marker``, its squashfs compressed with ``comp``."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "marker").write_text(marker)
    return build_sif(root, tmp_path / "img.sif", comp)


# What builders write: gzip (mksquashfs's and Apptainer's default), xz, lz4 (ours),
# zstd (Apptainer >= 1.4 with --mksquashfs-args), lzo.
COMPRESSIONS = ["gzip", "xz", "lz4", "zstd", "lzo"]
# squashfs's compression ids (squashfs_fs.h): what the superblock says it was built with
COMPRESSIONS_ID = {"gzip": 1, "lzo": 3, "xz": 4, "lz4": 5, "zstd": 6}


@pytest.mark.parametrize("comp", COMPRESSIONS)
@pytest.mark.parametrize("driver", sorted(FSTYPE))
def test_each_driver_reads_every_compression_a_builder_writes(
    root_with_fuse: None, tmp_path: Path, driver: str, comp: str
) -> None:
    sif = _marked_sif(tmp_path, f"{comp} via {driver}\n", comp)
    with open(sif, "rb") as f:  # the squashfs superblock's compressor id, in the SIF
        data = f.read()
    at = data.index(b"hsqs")
    assert int.from_bytes(data[at + 20 : at + 22], "little") == COMPRESSIONS_ID[comp]
    state = tmp_path / "state"
    img = imagemount.mount_image(str(state), "63", sif, "sha256:" + "c" * 64, (driver,))
    try:
        assert _mount_of(img)[0] == FSTYPE[driver]
        assert (img / "etc/marker").read_text() == f"{comp} via {driver}\n"
    finally:
        assert imagemount.release_job(str(state), "63") == []
        assert imagemount.release_images(str(state), lambda digest: False) == []


def test_a_node_without_loop_devices_falls_back_to_fuse_and_says_so(
    root_with_fuse: None, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    sif = make_sif({"etc/marker": "x\n"})
    state = tmp_path / "state"
    code = (
        "import logging, sys\n"
        "from pathlib import Path\n"
        "from tfimage.agent.step import imagemount\n"
        "logging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
        f"img = imagemount.mount_image({str(state)!r}, '62', Path({str(sif)!r}),"
        " 'sha256:' + 'b' * 64, ('kernel', 'squashfuse_ll'))\n"
        "print(open('/proc/self/mountinfo').read())\n"
        f"imagemount.release_images({str(state)!r}, lambda digest: False)\n"
    )
    old = tmp_path / "olddev"
    old.mkdir()
    # A mount namespace whose /dev has FUSE and null but no loop device at all.
    script = (
        f"mount --rbind /dev {old} && mount -t tmpfs -o mode=0755 tmpfs /dev && "
        f"for d in fuse null; do touch /dev/$d && mount --bind {old}/$d /dev/$d; done && "
        f'umount -l {old} && exec {sys.executable} -c "$0"'
    )
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, code],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    mounted = [line for line in r.stdout.splitlines() if "/images/sha256-bbbb" in line]
    assert len(mounted) == 1 and "fuse.squashfuse_ll" in mounted[0], r.stdout[-2000:]
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith("image mount: kernel: ") and "trying the next driver" in r.stderr


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "one or more of kernel, squashfuse_ll, squashfuse"),
        (["zfs"], "one or more of"),
        (["kernel", "kernel"], "each once"),
        (7, "one or more of"),
    ],
)
def test_a_bad_image_mount_is_one_line_naming_the_choices(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        config_from_mapping({"image_mount": value}, Path("/etc/tfimage/config.yaml"))
    assert "\n" not in str(e.value) and "image_mount" in str(e.value)


def test_kernel_is_tried_only_for_the_trusted_repositories_of_the_sites_registry() -> None:
    cfg = config_from_mapping(
        {
            "registry": "harbor.example",
            "mirrors": ["mirror.example"],
            "image_mount": ["kernel", "squashfuse_ll", "squashfuse"],
            "image_mount_kernel": ["library/tf-*"],
        }
    )
    fuse = ("squashfuse_ll", "squashfuse")
    assert cfg.mount_drivers("harbor.example/library/tf-custom") == ("kernel", *fuse)
    assert cfg.mount_drivers("mirror.example/library/tf-custom") == ("kernel", *fuse)
    assert cfg.mount_drivers("harbor.example/library/tiny") == fuse
    assert cfg.mount_drivers("harbor.example/alice/tf-custom") == fuse
    # "*" stays within one path segment; another registry's same name is not trusted
    assert cfg.mount_drivers("harbor.example/library/tf-x/evil") == fuse
    assert cfg.mount_drivers("elsewhere.example/library/tf-custom") == fuse
    assert cfg.mount_drivers(None) == fuse  # an entry from before origins were kept
    single = config_from_mapping({"image_mount": "squashfuse"})
    assert single.mount_drivers("harbor.example/library/tf-custom") == ("squashfuse",)
    assert config_from_mapping({}).image_mount == fuse  # FUSE: the safe default


def test_trust_follows_where_the_bytes_came_from_not_the_name_a_job_uses(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    # alice's image, pulled once on the node, then asked for by a trusted name and
    # its digest: a cache hit that never asks the registry must not make it trusted.
    digest = registry.client().push_sif("alice/evil", "1", make_sif({"m": "evil"}))
    cfg = load_config(
        registry.write_site(
            tmp_path, image_mount="[kernel, squashfuse_ll]", image_mount_kernel="['library/tf-*']"
        )
    )
    cache = ImageCache(cfg)
    Puller(cache).ensure(cfg.reference(f"alice/evil@{digest}"))
    hit = Puller(cache).ensure(cfg.reference(f"library/tf-custom@{digest}"))
    assert hit.hit
    origin = cache.read_entry(digest).origin
    assert origin == f"{registry.host}/alice/evil"
    assert cfg.mount_drivers(origin) == ("squashfuse_ll",)


def test_a_bind_where_a_stand_in_would_go_wins_and_the_others_run(
    root_with_fuse: None, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    sif = make_sif({"usr/local/bin/.keep": "", "bin/.keep": ""})
    state = tmp_path / "state"
    img = imagemount.mount_image(str(state), "64", sif, "sha256:" + "d" * 64, ("squashfuse_ll",))
    try:
        scripts = slurmstubs.stubs(img)
        root = imagemount.step_root(
            str(state), "64", "4294967294", img, ["/usr/local/bin/srun"], [], scripts
        )
        assert (root / "usr/local/bin/srun").is_dir()  # the bind's mount point
        sbatch = root / "usr/local/bin/sbatch"
        assert sbatch.stat().st_mode & 0o777 == 0o755
        assert sbatch.read_text() == slurmstubs.script("sbatch")
    finally:
        assert imagemount.release_job(str(state), "64") == []
        imagemount.release_images(str(state), lambda digest: False)


def _config_without(option: str) -> str:
    """This node's kernel config with one squashfs compressor turned off, as a
    kernel built without it has it."""
    config = squashcomp.node_kernel_config()
    if config is None:
        pytest.skip("this kernel publishes no build config (/proc/config.gz, /boot/config-*)")
    assert f"CONFIG_SQUASHFS_{option}=y" in config
    return config.replace(f"CONFIG_SQUASHFS_{option}=y", f"# CONFIG_SQUASHFS_{option} is not set")


def test_this_nodes_drivers_read_every_compression_by_their_own_account() -> None:
    config = squashcomp.node_kernel_config()
    assert config is not None
    assert squashcomp.kernel_reads(config) == {"gzip", "xz", "lz4", "zstd", "lzo"}
    readers = squashcomp.Readers()
    for driver in sorted(FSTYPE):
        for comp in COMPRESSIONS:
            assert readers.cannot_read(driver, comp) is None, (driver, comp)
    libraries = elfname.needed("/usr/bin/squashfuse_ll")
    assert libraries is not None and "libzstd.so.1" in libraries
    assert squashcomp.linked_reads(libraries) >= set(COMPRESSIONS)


def test_a_squashfuse_not_linked_with_libzstd_is_known_not_to_read_zstd() -> None:
    # A minimal build: zlib and liblzma only.
    old = squashcomp.linked_reads(["libz.so.1", "liblzma.so.5", "libfuse.so.2", "libc.so.6"])
    assert old == {"gzip", "xz", "lzma"}
    assert squashcomp.kernel_reads("CONFIG_SQUASHFS_ZSTD=y\n") == set()  # no squashfs at all


def test_a_kernel_without_zstd_is_skipped_naming_why_and_fuse_mounts_the_image(
    root_with_fuse: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    readers = squashcomp.Readers(kernel_config=_config_without("ZSTD"))
    sif = _marked_sif(tmp_path, "zstd\n", "zstd")
    state = tmp_path / "state"
    with caplog.at_level("WARNING", logger="tfimage.mount"):
        img = imagemount.mount_image(
            str(state), "64", sif, "sha256:" + "d" * 64, ("kernel", "squashfuse_ll"), readers
        )
    try:
        assert _mount_of(img)[0] == "fuse.squashfuse_ll"
        assert (img / "etc/marker").read_text() == "zstd\n"
    finally:
        imagemount.release_images(str(state), lambda digest: False)
    assert [r.getMessage() for r in caplog.records] == [
        "image mount: kernel: kernel cannot read zstd squashfs: this kernel was built"
        " without CONFIG_SQUASHFS_ZSTD; trying the next driver"
    ]
    assert _loops_of(sif) == ""  # the kernel was never asked


def test_an_image_no_driver_here_reads_is_named_with_each_driver_and_nothing_mounted(
    root_with_fuse: None, tmp_path: Path
) -> None:
    readers = squashcomp.Readers(kernel_config=_config_without("XZ"))
    sif = _marked_sif(tmp_path, "xz\n", "xz")
    state = tmp_path / "state"
    with pytest.raises(RuntimeSetupError) as e:
        imagemount.mount_image(str(state), "65", sif, "sha256:" + "e" * 64, ("kernel",), readers)
    assert str(e.value) == (
        "the image's squashfs is xz-compressed, which no image mount driver here reads:"
        " kernel (this kernel was built without CONFIG_SQUASHFS_XZ); rebuild it with gzip"
        " (mksquashfs's default) or install a driver that reads it"
    )
    assert not imagemount.mounted(imagemount.shared_dir(str(state), "sha256:" + "e" * 64))
    assert _loops_of(sif) == ""

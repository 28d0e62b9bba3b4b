"""Which squashfs compressions an image mount driver here can read, known before it
is tried, so that an image it cannot read is named with the driver and the cause.

Builders write gzip (mksquashfs's and Apptainer's default), xz, lz4, lzo, and zstd
(Apptainer >= 1.4's ``--mksquashfs-args``).  The image says which in its squashfs
superblock (``u16`` at byte 20, squashfs_fs.h's ids).  The kernel reads those its
build config enables (``CONFIG_SQUASHFS_ZLIB`` ... ``_ZSTD``, from /proc/config.gz or
/boot/config-<release>); squashfuse and squashfuse_ll read those their binary is
linked with (``DT_NEEDED``: libz, liblzma, liblzo2, liblz4, libzstd), so an old
squashfuse built before zstd support, or a minimal build, is known by what it lacks.
Where neither source says (no config, a static binary), the driver is tried and its
failure names the compression.
"""

from __future__ import annotations

import gzip
import io
import os
import re
import shutil
from dataclasses import dataclass
from typing import BinaryIO

from tfimage.agent.step.elfname import needed

SQUASHFS_MAGIC = b"hsqs"
COMPRESSORS = {1: "gzip", 2: "lzma", 3: "lzo", 4: "xz", 5: "lz4", 6: "zstd"}
# The kernel's option for each (it never read squashfs's old lzma).
_KERNEL_OPTION = {"gzip": "ZLIB", "lzo": "LZO", "xz": "XZ", "lz4": "LZ4", "zstd": "ZSTD"}
_LIBRARY = {"libz": "gzip", "liblzma": "xz", "liblzo2": "lzo", "liblz4": "lz4", "libzstd": "zstd"}
_LIB_STEM = re.compile(r"(lib[a-z0-9]+)\.so")
MAX_CONFIG = 4 << 20  # a kernel config is ~250 KiB uncompressed
FUSE_DRIVERS = ("squashfuse_ll", "squashfuse")
TOOL_PATH = "/usr/local/bin:/usr/bin:/bin"


def compression(f: BinaryIO, offset: int) -> str | None:
    """The compression of the squashfs at ``offset`` of ``f``, or None where the
    bytes there are no squashfs superblock (the mount then says what is wrong)."""
    f.seek(offset)
    head = f.read(22)
    if len(head) < 22 or head[:4] != SQUASHFS_MAGIC:
        return None
    return COMPRESSORS.get(int.from_bytes(head[20:22], "little"), f"compressor {head[20]}")


def kernel_reads(config: str) -> frozenset[str]:
    """The compressions a kernel built with ``config`` (a .config's text) reads."""
    enabled = {
        m.group(1) for m in re.finditer(r"^CONFIG_SQUASHFS_([A-Z0-9]+)=[ym]$", config, re.MULTILINE)
    }
    if not re.search(r"^CONFIG_SQUASHFS=[ym]$", config, re.MULTILINE):
        return frozenset()
    return frozenset(c for c, option in _KERNEL_OPTION.items() if option in enabled)


def linked_reads(libraries: list[str]) -> frozenset[str]:
    """The compressions a squashfuse linked with ``libraries`` (its DT_NEEDED) reads."""
    stems = {m.group(1) for lib in libraries if (m := _LIB_STEM.match(lib))}
    reads = {c for stem, c in _LIBRARY.items() if stem in stems}
    if "xz" in reads:
        reads.add("lzma")  # squashfuse reads both through liblzma
    return frozenset(reads)


def node_kernel_config() -> str | None:
    """This node's kernel build config as text, or None where it publishes none."""
    for path in ("/proc/config.gz", f"/boot/config-{os.uname().release}"):
        try:
            with open(path, "rb") as raw:
                data = raw.read(MAX_CONFIG)
            if path.endswith(".gz"):
                with gzip.GzipFile(fileobj=io.BytesIO(data)) as z:
                    data = z.read(MAX_CONFIG)
            return data.decode("utf-8", "replace")
        except (OSError, EOFError):
            continue
    return None


def fuse_tool(driver: str) -> str | None:
    """Where ``driver`` (squashfuse_ll, squashfuse) is installed, on root's fixed path."""
    return shutil.which(driver, path=TOOL_PATH)


@dataclass
class Readers:
    """What each driver on this node reads.  ``kernel_config`` is the kernel's
    build config as text; by default this node's, read only when the kernel driver
    is asked about ("" where the node has none)."""

    kernel_config: str | None = None

    def _kernel(self) -> str:
        if self.kernel_config is None:
            self.kernel_config = node_kernel_config() or ""
        return self.kernel_config

    def cannot_read(self, driver: str, comp: str | None) -> str | None:
        """Why ``driver`` cannot read a ``comp`` squashfs here, or None (it can, or
        nothing says it cannot)."""
        if comp is None:
            return None
        if driver == "kernel":
            config = self._kernel()
            if not config or comp in kernel_reads(config):
                return None
            option = _KERNEL_OPTION.get(comp)
            if option is None:
                return f"the kernel's squashfs never read {comp}"
            return f"this kernel was built without CONFIG_SQUASHFS_{option}"
        if driver in FUSE_DRIVERS:
            tool = fuse_tool(driver)
            libraries = needed(os.path.realpath(tool)) if tool else None
            if not libraries or not any(_LIB_STEM.match(lib) for lib in libraries):
                return None  # not installed (the mount says so), or static: tried
            if comp in linked_reads(libraries):
                return None
            lib = next((stem for stem, c in _LIBRARY.items() if c == comp), comp)
            return f"{tool} is not linked with {lib} (an old or minimal build)"
        return None

"""The host's NVIDIA driver, bound into a charliecloud container for a GPU step.

Apptainer's ``--nv`` finds the driver by itself; ``ch-run`` does not.  For a step
Slurm gave GPUs, each driver file is bound read-only, one by one, at::

    /usr/local/nvidia/lib64/<soname>    each user-space driver library
    /usr/local/nvidia/bin/<name>        nvidia-smi and the MPS tools the host has

which is where NVIDIA's CUDA images, and TensorFlow's ``-gpu`` images built on them,
look (their ``LD_LIBRARY_PATH`` and ``PATH`` name it); other images' tasks get
``LD_LIBRARY_PATH=/usr/local/nvidia/lib64`` unless the task already has one.  The
empty files the binds land on are made in the step's skeleton (imagemount.py), never
in the image.  The device files need nothing: ch-run binds the host's ``/dev``.

Where the libraries come from, the first that applies:

    gpu.driver_libs    the admin's list of files (the name in the container is the
                       file's own name: list the soname links, libcuda.so.1)
    gpu.cdi_spec       the site's CDI spec (``nvidia-ctk cdi generate``, YAML or
                       JSON): its mounts of those libraries, each bound under its
                       soname (read from the file: the spec names libcuda.so.550.54.15)
    ldconfig -p        the host's linker cache, as nvidia-container-cli finds them:
                       its "compute" and "utility" libraries, for this machine's ABI

Each file is the host's (the admin's ``/usr/lib``, never a job's or an image's), and
is bound only if its real path is a regular file owned by root that nobody else may
write.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import stat
from collections.abc import Iterable

from tfimage.agent.core import toolrun
from tfimage.agent.core.errors import RuntimeSetupError
from tfimage.agent.step import elfname
from tfimage.agent.step.runtime import Bind

LIB_DIR = "/usr/local/nvidia/lib64"
BIN_DIR = "/usr/local/nvidia/bin"
# libnvidia-container's nvc_info.c: utility_libs and compute_libs (what
# `nvidia-container-cli --compute --utility` mounts), without the graphics stack.
LIBS = (
    "libnvidia-ml.so",
    "libnvidia-cfg.so",
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-opencl.so",
    "libnvidia-gpucomp.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-fatbinaryloader.so",
    "libnvidia-allocator.so",
    "libnvidia-compiler.so",
    "libnvidia-pkcs11.so",
    "libnvidia-pkcs11-openssl3.so",
    "libnvidia-nvvm.so",
)
# nvc_info.c: utility_bins and compute_bins.
BINS = ("nvidia-smi", "nvidia-debugdump", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
# ldconfig -p's tag for this machine's 64-bit libraries (glibc's elf/cache.c).
ABI = {"x86_64": "libc6,x86-64", "aarch64": "libc6,AArch64", "ppc64le": "libc6,64bit"}
LDCONFIG_TIMEOUT = 10.0
_LINE = re.compile(r"\t(\S+) \(([^)]*)\) => (/\S+)\Z")


def from_ldconfig(text: str, abi: str) -> dict[str, str]:
    """``soname -> path`` for the driver's libraries in ``ldconfig -p`` output: only
    versioned names (``libcuda.so.1``, not the development link), only ``abi``'s."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name, tags, path = m.groups()
        if tags.split(",")[:2] != abi.split(",")[:2] or name in found:
            continue
        if _is_driver_lib(name):
            found[name] = path
    return found


MAX_CDI_BYTES = 4 << 20


def _is_driver_lib(name: str) -> bool:
    return any(name.startswith(lib + ".") for lib in LIBS)


def from_cdi(text: str, where: str) -> tuple[dict[str, str], dict[str, str]]:
    """``(soname -> path, tool -> path)`` from a CDI spec's mounts (the spec-wide
    ``containerEdits`` and each device's): the driver's libraries and tools only."""
    import yaml  # only where a site keeps a CDI spec: 25 ms a step otherwise

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        why = " ".join(str(e).split())[:160]
        raise RuntimeSetupError(f"gpu: CDI spec {where}: not YAML or JSON ({why})") from None
    if not isinstance(doc, dict):
        raise RuntimeSetupError(f"gpu: CDI spec {where}: not a CDI spec")
    edits = [doc.get("containerEdits")]
    devices = doc.get("devices")
    if isinstance(devices, list):
        edits += [d.get("containerEdits") for d in devices if isinstance(d, dict)]
    libs: dict[str, str] = {}
    tools: dict[str, str] = {}
    for edit in edits:
        mounts = edit.get("mounts") if isinstance(edit, dict) else None
        for m in mounts if isinstance(mounts, list) else []:
            host = m.get("hostPath") if isinstance(m, dict) else None
            if not isinstance(host, str) or not host.startswith("/"):
                continue
            name = os.path.basename(host)
            if name in BINS:
                tools.setdefault(name, host)
            elif _is_driver_lib(name):
                # the name in the file, read only from a file root alone may write
                real = _trusted(host)
                libs.setdefault((elfname.soname(real) if real else None) or name, host)
    return libs, tools


def _read_cdi(path: str) -> str:
    try:
        with open(path, "rb") as f:  # the admin's file, not a job's
            data = f.read(MAX_CDI_BYTES + 1)
    except OSError as e:
        raise RuntimeSetupError(f"gpu: CDI spec {path}: {e.strerror}") from None
    if len(data) > MAX_CDI_BYTES:
        raise RuntimeSetupError(f"gpu: CDI spec {path}: larger than {MAX_CDI_BYTES} bytes")
    return data.decode("utf-8", errors="replace")


def _trusted(path: str) -> str | None:
    """The real file behind ``path`` if root owns it and only root may write it."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        return None
    return real


def _binds(pairs: Iterable[tuple[str, str]]) -> list[Bind]:
    out: list[Bind] = []
    for dst, src in pairs:
        real = _trusted(src)
        if real is None:
            raise RuntimeSetupError(
                f"gpu: driver file {src} is not a regular file that only root may write"
            )
        if ":" in real or "," in real:  # ch-run splits a bind at its first ':'
            raise RuntimeSetupError(f"gpu: driver file {real} has a name ch-run cannot bind")
        out.append(Bind(real, dst, read_only=True))
    return out


def driver_binds(
    driver_libs: tuple[str, ...] = (),
    cdi_spec: str = "",
    ldconfig_output: str | None = None,
) -> list[Bind]:
    """The binds that put the host's driver into a GPU step's container.

    ``ldconfig_output``: ``ldconfig -p``'s text, read here when not given.
    """
    tools: dict[str, str] = {}
    if driver_libs:
        libs = {os.path.basename(p): p for p in driver_libs}
    elif cdi_spec:
        libs, tools = from_cdi(_read_cdi(cdi_spec), cdi_spec)
    else:
        if ldconfig_output is None:
            ldconfig_output = toolrun.run(
                ["ldconfig", "-p"], timeout=LDCONFIG_TIMEOUT, what="finding the GPU driver"
            )
        libs = from_ldconfig(ldconfig_output, ABI.get(platform.machine(), ""))
    if not any(n.startswith(("libcuda.so.", "libnvidia-ml.so.")) for n in libs):
        raise RuntimeSetupError(
            "gpu: the step has GPUs but this node has no NVIDIA driver library "
            "(neither libcuda.so.1 nor libnvidia-ml.so.1 in gpu.driver_libs, "
            "gpu.cdi_spec or ldconfig -p)"
        )
    pairs = [(f"{LIB_DIR}/{name}", path) for name, path in sorted(libs.items())]
    for name in BINS:
        path = tools.get(name) or shutil.which(name, path="/usr/bin:/usr/sbin:/bin:/sbin")
        if path:
            pairs.append((f"{BIN_DIR}/{name}", path))
    return _binds(pairs)

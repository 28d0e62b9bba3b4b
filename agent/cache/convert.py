"""OCI image -> SIF, for ``docker://`` references and any manifest of image layers.

With ``apptainer`` installed it does the conversion (``apptainer build``); otherwise
Debian's tools do: ``skopeo copy`` (pinned by digest) -> ``umoci raw unpack`` ->
``mksquashfs -all-root`` -> ``siftool``.  The image config's ``Env``, ``WorkingDir``
and ``Entrypoint``/``Cmd`` are kept where Apptainer keeps them, under
``/.singularity.d/`` (``env/90-environment.sh`` and ``runscript``), and as
``/ch/environment`` for charliecloud.  Credentials reach skopeo through a private
auth file, never through argv.

The unpacked tree is the image's, so hostile: tfimage writes into it only through
imagefs.py (no link followed), takes its ``Env`` as data (names checked, values
quoted), and strips setuid/setgid bits and device nodes before mksquashfs.  With
Apptainer doing the build, the mount flags (``nosuid,nodev``) and Apptainer's own
``nosuid`` runtime are what make such files harmless.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import shlex
import shutil
import tempfile
from pathlib import Path

from tfimage.agent.cache import imagefs
from tfimage.agent.core import toolrun
from tfimage.agent.core.errors import ImageError, RuntimeSetupError
from tfimage.agent.core.logtext import oneline
from tfimage.agent.core.reference import Reference
from tfimage.agent.core.sif import build_commands
from tfimage.agent.registry.credentials import Credential

CONVERT_TIMEOUT = 3600.0
log = logging.getLogger(__name__)


IMAGE_CONFIGS = (
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.docker.container.image.v1+json",
)


def is_image_manifest(body: dict[str, object]) -> bool:
    """An OCI or Docker image (an image config and tar layers), not a SIF artifact."""
    config, layers = body.get("config"), body.get("layers")
    return (
        isinstance(config, dict)
        and config.get("mediaType") in IMAGE_CONFIGS
        and isinstance(layers, list)
        and all(isinstance(x, dict) and "tar" in str(x.get("mediaType", "")) for x in layers)
    )


def _run(argv: list[str], what: str, env: dict[str, str] | None = None) -> str:
    try:
        return toolrun.run(argv, timeout=CONVERT_TIMEOUT, what=what, env=env)
    except RuntimeSetupError as e:
        raise ImageError(str(e)) from None


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def image_env(config: dict[str, object]) -> list[tuple[str, str]]:
    """The image config's ``Env`` as (name, value) pairs.  It is data, never shell:
    a name that is not a shell variable name is dropped with a warning."""
    cfg = config.get("config") or {}
    raw = cfg.get("Env") if isinstance(cfg, dict) else None
    out: list[tuple[str, str]] = []
    for item in raw if isinstance(raw, list) else []:
        if not isinstance(item, str) or "=" not in item:
            continue
        name, _, value = item.partition("=")
        if not _ENV_NAME.match(name) or "\0" in value:
            log.warning("convert: dropped the image's Env entry %s", oneline(repr(name), 80))
            continue
        out.append((name, value))
    return out


def _keep_metadata(rootfs: Path, config: dict[str, object]) -> None:
    """The image config's environment and command, where runtimes look for them.
    Written as root into a tree the image made: never through its links
    (imagefs.py)."""
    cfg = config.get("config") or {}
    assert isinstance(cfg, dict)
    env = image_env(config)
    entry = [str(x) for x in cfg.get("Entrypoint") or []] + [str(x) for x in cfg.get("Cmd") or []]
    workdir = cfg.get("WorkingDir") or ""
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env]
    imagefs.write_file(
        rootfs,
        ".singularity.d/env/90-environment.sh",
        ("#!/bin/sh\n" + "\n".join(lines) + "\n").encode(),
    )
    run = "#!/bin/sh\n"
    if workdir:
        run += f"cd {shlex.quote(str(workdir))}\n"
    run += f'exec {shlex.join(entry)} "$@"\n' if entry else 'exec "$@"\n'
    imagefs.write_file(rootfs, ".singularity.d/runscript", run.encode(), 0o755)
    # ch-run's --set-env file: KEY=VALUE lines, one pair of outer quotes stripped and
    # nothing else interpreted (with --env-no-expand), so single quotes around every
    # value keep it exact.  A newline cannot be written there at all.
    ch_env = []
    for k, v in env:
        if "\n" in v or "\r" in v:
            log.warning("convert: %s holds a line break; charliecloud cannot be given it", k)
            continue
        ch_env.append(f"{k}='{v}'")
    imagefs.write_file(rootfs, "ch/environment", ("\n".join(ch_env) + "\n").encode())
    for name in ("hosts", "resolv.conf"):  # ch-run binds the host's only over existing files
        if not imagefs.lexists(rootfs, f"etc/{name}"):
            imagefs.write_file(rootfs, f"etc/{name}", b"")


def apptainer_build(apptainer: str, work: Path) -> tuple[list[str], dict[str, str]]:
    """``apptainer build`` of the OCI layout skopeo fetched (so apptainer needs neither
    the credentials nor the CA), its cache and temporary files kept in ``work``."""
    env = {"APPTAINER_CACHEDIR": str(work / "cache"), "APPTAINER_TMPDIR": str(work / "tmp")}
    return [apptainer, "build", "--force", str(work / "img.sif"), f"oci:{work / 'oci'}:img"], env


def _unpack_and_build(work: Path) -> None:
    """Debian's tools: umoci unpacks, the config's metadata is kept, mksquashfs + siftool."""
    _run(
        ["umoci", "raw", "unpack", "--image", f"{work / 'oci'}:img", str(work / "rootfs")],
        "unpacking the OCI image",
    )
    config = json.loads(
        _run(
            ["skopeo", "inspect", "--config", f"oci:{work / 'oci'}:img"],
            "reading the image config",
        )
    )
    stripped = imagefs.strip_privileges(work / "rootfs")
    if stripped.setid or stripped.devices:
        log.warning(
            "convert: removed setuid/setgid bits from %d file(s) and %d device node(s) "
            "of the image (first: %s)",
            len(stripped.setid),
            len(stripped.devices),
            oneline(", ".join([*stripped.setid, *stripped.devices][:3]), 200),
        )
    _keep_metadata(work / "rootfs", config)
    for argv in build_commands(work / "rootfs", work / "root.sqfs", work / "img.sif"):
        _run(argv, "making the SIF")


def oci_to_sif(
    ref: Reference,
    digest: str,
    dest: Path,
    work_prefix: Path,
    *,
    credential: Credential | None,
    ca_bundle: str | None,
) -> None:
    """Convert the image ``ref`` pinned at ``digest`` into the SIF file ``dest``, in
    a new work directory named from ``work_prefix`` (``layout.cache_convert_work``)."""
    # Named for the digest: cache prune tells an abandoned one (its digest's lock
    # free, old) from one at work (the converting pull holds that lock).
    work = Path(tempfile.mkdtemp(prefix=work_prefix.name, dir=work_prefix.parent))
    try:
        image_url = f"docker://{ref.registry}/{ref.repository}@{digest}"
        argv = ["skopeo", "copy", "--quiet"]
        if credential:
            auth = work / "auth.json"
            token = base64.b64encode(f"{credential.username}:{credential.password}".encode())
            fd = os.open(auth, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"auths": {ref.registry: {"auth": token.decode()}}}, f)
            argv += ["--src-authfile", str(auth)]
        if ca_bundle:
            certs = work / "certs"
            certs.mkdir()
            shutil.copy(ca_bundle, certs / "ca.crt")
            argv += ["--src-cert-dir", str(certs)]
        _run([*argv, image_url, f"oci:{work / 'oci'}:img"], "fetching the OCI image")
        apptainer = shutil.which("apptainer", path=toolrun.SAFE_ENV["PATH"])
        if apptainer:
            build, env = apptainer_build(apptainer, work)
            (work / "cache").mkdir()
            (work / "tmp").mkdir()
            _run(build, "building the SIF with apptainer", env)
        else:
            _unpack_and_build(work)
        sif = work / "img.sif"
        with sif.open("rb") as f:
            os.fsync(f.fileno())
        sif.chmod(0o444)
        os.rename(sif, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)

"""OCI image -> SIF, for ``docker://`` references and any manifest of image layers.

With ``apptainer`` installed it does the conversion (``apptainer build``); otherwise
Debian's tools do: ``skopeo copy`` (pinned by digest) -> ``umoci raw unpack`` ->
``mksquashfs -all-root`` -> ``siftool``.  The image config's ``Env``, ``WorkingDir``
and ``Entrypoint``/``Cmd`` are kept where Apptainer keeps them, under
``/.singularity.d/`` (``env/90-environment.sh`` and ``runscript``), and as
``/ch/environment`` for charliecloud.  Credentials reach skopeo through a private
auth file, never through argv.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path

from tfimage.agent import proc
from tfimage.agent.credentials import Credential
from tfimage.agent.errors import ImageError, RuntimeSetupError
from tfimage.agent.reference import Reference
from tfimage.agent.sif import build_commands

CONVERT_TIMEOUT = 3600.0


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
        return proc.run(argv, timeout=CONVERT_TIMEOUT, what=what, env=env)
    except RuntimeSetupError as e:
        raise ImageError(str(e)) from None


def _keep_metadata(rootfs: Path, config: dict[str, object]) -> None:
    """The image config's environment and command, where runtimes look for them."""
    cfg = config.get("config") or {}
    assert isinstance(cfg, dict)
    env = [e for e in cfg.get("Env") or [] if isinstance(e, str) and "=" in e]
    entry = [str(x) for x in cfg.get("Entrypoint") or []] + [str(x) for x in cfg.get("Cmd") or []]
    workdir = cfg.get("WorkingDir") or ""
    sd = rootfs / ".singularity.d"
    (sd / "env").mkdir(parents=True, exist_ok=True)
    lines = [f"export {k}={shlex.quote(v)}" for k, _, v in (e.partition("=") for e in env)]
    (sd / "env" / "90-environment.sh").write_text("#!/bin/sh\n" + "\n".join(lines) + "\n")
    run = "#!/bin/sh\n"
    if workdir:
        run += f"cd {shlex.quote(str(workdir))}\n"
    run += f'exec {shlex.join(entry)} "$@"\n' if entry else 'exec "$@"\n'
    (sd / "runscript").write_text(run)
    (sd / "runscript").chmod(0o755)
    (rootfs / "ch").mkdir(exist_ok=True)
    (rootfs / "ch" / "environment").write_text("\n".join(env) + "\n")
    for name in ("hosts", "resolv.conf"):  # ch-run binds the host's only over existing files
        p = rootfs / "etc" / name
        if not p.exists() and not p.is_symlink():
            p.parent.mkdir(exist_ok=True)
            p.write_text("")


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
    _keep_metadata(work / "rootfs", config)
    for argv in build_commands(work / "rootfs", work / "root.sqfs", work / "img.sif"):
        _run(argv, "making the SIF")


def oci_to_sif(
    ref: Reference,
    digest: str,
    dest: Path,
    work_dir: Path,
    *,
    credential: Credential | None,
    ca_bundle: str | None,
) -> None:
    """Convert the image ``ref`` pinned at ``digest`` into the SIF file ``dest``."""
    work = Path(tempfile.mkdtemp(prefix="convert-", dir=work_dir))
    try:
        source = f"docker://{ref.registry}/{ref.repository}@{digest}"
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
        _run([*argv, source, f"oci:{work / 'oci'}:img"], "fetching the OCI image")
        apptainer = shutil.which("apptainer", path=proc.SAFE_ENV["PATH"])
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

"""Which images each partition runs: the config's ``partitions:`` rules.

    partitions:
      prod:                                  # a partition's name, or a glob: "gpu-*"
        registries: [harbor.site]            # the only registries (default: any allowed)
        repositories: [library/*, team-a/*]  # the only repositories (default: any)
        require_digest: true                 # --tf-image must name NAME@sha256:...
        allow_conversion: false              # no docker:// or other OCI image
        max_image_bytes: 20GiB               # the largest SIF (bytes, or K/M/G/TiB)
      dev: {}                                # any image the site allows
      train:
        default_image: tf-custom:2.0         # a job here without --tf-image runs in it

Every key that matches the partition Slurm runs the job in applies (the prolog's
``SLURM_JOB_PARTITION``, which slurmd sets; nothing the job says picks one), as
``access:`` rules do: a rule only ever narrows, so the order of the keys never
matters (the role writes them sorted).  A partition no key matches runs any image,
as before; a rule never widens what the rest of the config allows
(``allowed_registries``, ``access:``).  Its name checks (registry, repository,
digest, a ``docker://`` name) come before anything is pulled; the SIF's size (the
manifest's) and whether it is an OCI image, before a download or a conversion, and
again for an image already cached.  A refusal is a :class:`PolicyError` that names
the partition and the rule.

``default_image`` (off unless set) is the image a job that names none runs in: the
node's prolog readies it as if the job had asked (the other rules judge it as
written, so a partition that requires a digest needs a pinned default), and tells
the job's steps (layout.job_default_image).  Several matching keys that name
different defaults give none, and the prolog says why.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tfimage.agent.core.access import is_repository_glob, segment_glob
from tfimage.agent.core.errors import ConfigError, PolicyError
from tfimage.agent.core.reference import Reference

# Slurm's partition names as sites write them, and "*" within one.
_PARTITION_GLOB = re.compile(r"[A-Za-z0-9_.*-]{1,64}\Z")
_HOST = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?(:[0-9]{1,5})?\Z")
_SIZE = re.compile(r"([0-9]{1,15})\s?(|K|M|G|T|KiB|MiB|GiB|TiB)\Z")
_UNITS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}
MAX_RULES = 256
MAX_GLOBS = 256
MAX_BYTES = 1 << 50  # a PiB: anything larger is a typo
KEYS = (
    "registries",
    "repositories",
    "require_digest",
    "allow_conversion",
    "max_image_bytes",
    "default_image",
)
MAX_DEFAULT = 512  # as long as a --tf-image reference may be (spank/tfimage.h)


@dataclass(frozen=True, slots=True)
class PartitionRule:
    glob: str
    registries: tuple[str, ...] = ()
    repositories: tuple[str, ...] = ()
    require_digest: bool = False
    allow_conversion: bool = True
    max_image_bytes: int | None = None
    default_image: str = ""

    def matches(self, partition: str) -> bool:
        return segment_glob(self.glob).match(partition) is not None


def partition_rules(value: Any, path: Path) -> tuple[PartitionRule, ...]:
    """The ``partitions:`` mapping parsed strictly: one ConfigError line per fault."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: 'partitions' must map partition names or globs to rules")
    if len(value) > MAX_RULES:
        raise ConfigError(f"{path}: 'partitions' has more than {MAX_RULES} rules")
    return tuple(_rule(glob, body, path) for glob, body in value.items())


def _rule(glob: Any, body: Any, path: Path) -> PartitionRule:
    where = f"{path}: 'partitions': {str(glob)[:80]!r}"
    if not isinstance(glob, str) or not _PARTITION_GLOB.match(glob):
        raise ConfigError(f"{where} is not a partition name or glob (letters, digits, _.-*)")
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ConfigError(f"{where} must be a mapping of {', '.join(KEYS)}")
    if unknown := sorted(str(k)[:40] for k in body if k not in KEYS):
        raise ConfigError(f"{where}: unknown setting(s): {', '.join(unknown)}")
    return PartitionRule(
        glob,
        registries=_strings(body, "registries", where, _HOST.match, "a registry host[:port]"),
        repositories=_strings(body, "repositories", where, is_repository_glob, "a repository glob"),
        require_digest=_flag(body, "require_digest", where, False),
        allow_conversion=_flag(body, "allow_conversion", where, True),
        max_image_bytes=None if body.get("max_image_bytes") is None
        else parse_size(body["max_image_bytes"], f"{where}: 'max_image_bytes'"),
        default_image=_default_image(body, where),
    )  # fmt: skip


def _default_image(body: dict[Any, Any], where: str) -> str:
    """Its text, bounded and printable; Config.reference checks it as a reference."""
    value = body.get("default_image", "")
    if (
        not isinstance(value, str)
        or len(value) > MAX_DEFAULT
        or not value.isprintable()
        or " " in value
    ):
        raise ConfigError(f"{where}: 'default_image' must be an image reference, e.g. tiny:1.0")
    return value


def _strings(
    body: dict[Any, Any], key: str, where: str, valid: Callable[[str], object], what: str
) -> tuple[str, ...]:
    value = body.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not value or len(value) > MAX_GLOBS:
        raise ConfigError(f"{where}: '{key}' must list one or more, at most {MAX_GLOBS}")
    for item in value:
        if not isinstance(item, str) or not valid(item):
            raise ConfigError(f"{where}: '{key}': {str(item)[:80]!r} is not {what}")
    return tuple(value)


def _flag(body: dict[Any, Any], key: str, where: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: '{key}' must be true or false")
    return value


def parse_size(value: Any, where: str) -> int:
    """Bytes from an integer or ``"20GiB"`` (also ``20G``: K, M, G and T are 1024's
    powers); ConfigError for anything else, ``20GB`` included (which would it be?)."""
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be a size: bytes, or a number and K, M, G or T(iB)")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.match(value) if isinstance(value, str) else None
        if not m:
            raise ConfigError(
                f"{where} must be a size: bytes, or a number and K, M, G or T(iB),"
                f" not {str(value)[:40]!r}"
            )
        size = int(m[1]) << _UNITS[m[2][:1]]
    if not 0 < size <= MAX_BYTES:
        raise ConfigError(f"{where} must be from 1 byte to 1 PiB")
    return size


def default_image(rules: tuple[PartitionRule, ...], partition: str) -> str:
    """The image a job of ``partition`` that names none runs in ("" for none); a
    PolicyError when its matching keys name different ones."""
    found = sorted({r.default_image for r in rules if r.default_image})
    if len(found) > 1:
        raise PolicyError(
            f"partition {partition} has {len(found)} default images ({', '.join(found)}): "
            "its partitions: keys must agree on one"
        )
    return found[0] if found else ""


def rules_for(rules: tuple[PartitionRule, ...], partition: str) -> tuple[PartitionRule, ...]:
    """Every rule matching ``partition``: each must admit a job's image (none: any)."""
    if not partition:
        return ()
    return tuple(r for r in rules if r.matches(partition))


def check_name(
    rules: tuple[PartitionRule, ...], partition: str, ref: Reference, asked: str
) -> None:
    """PolicyError unless every rule of ``partition`` runs ``ref`` by its name;
    ``asked`` is the ``--tf-image`` text as the user wrote it (did it name a digest)."""
    for rule in rules:
        _name(rule, f"partition {partition}", ref, asked)


def _name(rule: PartitionRule, where: str, ref: Reference, asked: str) -> None:
    if rule.registries and ref.registry not in rule.registries:
        raise PolicyError(
            f"{where} runs images from {', '.join(rule.registries)} only, not {ref.registry}"
        )
    if rule.repositories and not any(
        segment_glob(g).match(ref.repository) for g in rule.repositories
    ):
        raise PolicyError(
            f"{where} runs images of {', '.join(rule.repositories)} only, not {ref.repository}"
        )
    if rule.require_digest and "@sha256:" not in asked:
        raise PolicyError(
            f"{where} requires a digest: --tf-image={asked or ref.unpinned}@sha256:..."
            " (`tfimage resolve NAME` prints it; or use a partition that takes tags)"
        )
    if not rule.allow_conversion and ref.transport == "docker":
        raise PolicyError(f"{where} runs SIF images only: {ref.unpinned} is a docker:// image")


def check_image(
    rules: tuple[PartitionRule, ...], partition: str, ref: Reference, size: int, converted: bool
) -> None:
    """PolicyError unless every rule of ``partition`` runs the image now in the cache:
    its SIF's ``size``, and whether it was ``converted`` from an OCI image."""
    for rule in rules:
        _image(rule, f"partition {partition}", ref, size, converted)


def _image(rule: PartitionRule, where: str, ref: Reference, size: int, converted: bool) -> None:
    if not rule.allow_conversion and converted:
        raise PolicyError(
            f"{where} runs SIF images only: {ref.unpinned} is an OCI image (push it as a SIF)"
        )
    if rule.max_image_bytes is not None and size > rule.max_image_bytes:
        raise PolicyError(
            f"{where} runs images of at most {_human(rule.max_image_bytes)}:"
            f" {ref.unpinned} is {_human(size)}"
        )


def _human(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"

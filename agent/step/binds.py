"""``--tf-mount=SRC:DST[:ro|rw][,...]`` and the site's default binds, parsed strictly.

Sources must lie under one of the admin's allowed prefixes (``bind_prefixes``),
compared on whole path components, so ``/data`` allows ``/data/x`` but not
``/database``.  Destinations may not cover the container's system directories,
nor lie inside (or cover) a destination the site binds into every container
(``default_binds``): the site's bind would hide the user's, or the user's would
need a mount point made inside the site's directory.  The same destination is
allowed: the user's replaces the site's.
"""

from __future__ import annotations

import os

from tfimage.agent.core.errors import BindError
from tfimage.agent.step.runtime import Bind

MAX_BINDS = 32
# Names of the image's system directories, compared as strings, never opened.
_RESERVED = tuple(
    "/" + d
    for d in ("", "proc", "sys", "dev", "etc", "usr", "bin", "sbin", "lib", "lib64", "run", "tmp")
)


def _path(p: str, what: str, spec: str) -> str:
    if not p.startswith("/") or os.path.normpath(p) != p or p.startswith("//") or "\0" in p:
        raise BindError(f"--tf-mount {spec!r}: {what} {p!r} must be a normal absolute path")
    return p


def under(path: str, prefix: str) -> bool:
    prefix = prefix.rstrip("/") or "/"
    return path == prefix or path.startswith(prefix + "/") or prefix == "/"


def parse_binds(text: str, allowed_prefixes: tuple[str, ...]) -> list[Bind]:
    """Parse a comma-separated mount list; raise :class:`BindError` naming the problem."""
    if not text:
        return []
    items = text.split(",")
    if len(items) > MAX_BINDS:
        raise BindError(f"--tf-mount: at most {MAX_BINDS} mounts")
    out: list[Bind] = []
    for spec in items:
        parts = spec.split(":")
        if len(parts) not in (2, 3) or any(not p for p in parts):
            raise BindError(f"--tf-mount {spec!r}: expected SRC:DST or SRC:DST:ro|rw")
        src, dst = _path(parts[0], "host path", spec), _path(parts[1], "destination", spec)
        mode = parts[2] if len(parts) == 3 else "rw"
        if mode not in ("ro", "rw"):
            raise BindError(f"--tf-mount {spec!r}: mode must be ro or rw, not {mode!r}")
        if not any(under(src, p) for p in allowed_prefixes):
            raise BindError(
                f"--tf-mount {spec!r}: host path {src} is outside the allowed prefixes "
                f"({', '.join(allowed_prefixes) or 'none configured'})"
            )
        if any(under(r, dst) or (r != "/" and under(dst, r)) for r in _RESERVED):
            raise BindError(
                f"--tf-mount {spec!r}: destination {dst} would cover a system "
                "directory of the image"
            )
        if any(b.dst == dst for b in out):
            raise BindError(f"--tf-mount: destination {dst} is given twice")
        out.append(Bind(src, dst, read_only=(mode == "ro")))
    return out


def parse_site_binds(site_binds: tuple[str, ...]) -> list[Bind]:
    """The admin's ``default_binds``: parsed as strictly, whoever wrote them (the admin)."""
    return parse_binds(",".join(site_binds), ("/",))


def parse_user_binds(
    text: str, prefixes: tuple[str, ...], site_binds: tuple[str, ...]
) -> list[Bind]:
    """``--tf-mount`` parsed as :func:`parse_binds` does, and checked against the
    destinations of the site's ``site_binds`` (see the module's docstring)."""
    binds = parse_binds(text, prefixes)
    site = [d.dst for d in parse_site_binds(site_binds)] if binds else []
    for b in binds:
        for dst in site:
            if b.dst == dst:
                continue
            if under(b.dst, dst) or under(dst, b.dst):
                how = "lies inside" if under(b.dst, dst) else "covers"
                raise BindError(
                    f"--tf-mount {b.src}:{b.dst}: destination {b.dst} {how} {dst}, which "
                    "the site binds into every container; choose another destination"
                )
    return binds

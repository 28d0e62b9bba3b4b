"""Mirror tiers: a pull-through cache per rack or region, chosen by node name.

``rack_mirrors`` in the config maps Slurm hostlists to the mirrors their nodes ask
first, before the registry::

    rack_mirrors:
      "n[001-064]": [mirror-r1.site:5000]      # rack 1's pull-through cache
      "n[065-128]": [mirror-r2.site:5000]
      "cloud-[1-32]": [mirror.region.cloud]    # a cloud region's replica

A node asks, in order: its group's mirrors, the registry, then ``mirrors`` (the
site-wide fallbacks, for every node).  The first group whose hostlist names the
node wins; a node no group names asks the registry first, as before.  A rack
mirror makes a pull cheaper, never possible: whatever it answers short of the
image (down, refused, not found, bytes that fail their digest), the registry is
asked next (cache/pull.py).

A node's name is the one Slurm gives it: the prolog's ``SLURMD_NODENAME``; the
daemon and the CLI use the host's short name, which is Slurm's default NodeName.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

from tfimage.agent.core.errors import ConfigError, StepLayoutError
from tfimage.agent.core.hostlist import expand_hostlist

# Bounds what one config may make a hook expand (a typo such as n[1-99999999]).
MAX_GROUP_HOSTS = 1 << 16
MAX_GROUPS = 256
# host[:port], as `mirrors` and `registry` are written (no scheme, no path).
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})(:[0-9]{1,5})?\Z")

Tiers = tuple[tuple[str, tuple[str, ...]], ...]


def rack_mirrors(value: Any, path: Path) -> Tiers:
    """The config's ``rack_mirrors``, checked: hostlists that expand (bounded) to
    non-empty lists of ``host[:port]``."""
    said = f"{path}: 'rack_mirrors' must map Slurm hostlists to lists of mirrors"
    if not isinstance(value, dict) or len(value) > MAX_GROUPS:
        raise ConfigError(f'{said}, e.g. {{"n[1-64]": [mirror-r1.site:5000]}}')
    tiers = []
    for hosts, mirrors in value.items():
        if not isinstance(hosts, str) or not hosts:
            raise ConfigError(f"{said}: a key is not a hostlist")
        try:
            expand_hostlist(hosts, MAX_GROUP_HOSTS)
        except StepLayoutError as e:
            raise ConfigError(f"{path}: 'rack_mirrors': {hosts[:80]!r}: {e}") from None
        if (
            not isinstance(mirrors, list)
            or not mirrors
            or not all(isinstance(m, str) and _HOST.match(m) for m in mirrors)
        ):
            raise ConfigError(f"{said}: {hosts[:80]!r} needs a list of host[:port]")
        tiers.append((hosts, tuple(mirrors)))
    return tuple(tiers)


def for_node(tiers: Tiers, node: str) -> tuple[str, tuple[str, ...]]:
    """The first group naming ``node``, and its mirrors; ("", ()) for none."""
    for hosts, mirrors in tiers:
        if node in expand_hostlist(hosts, MAX_GROUP_HOSTS):
            return hosts, mirrors
    return "", ()


def this_node() -> str:
    """This host's short name: Slurm's NodeName where the site did not set another."""
    return socket.gethostname().split(".")[0]

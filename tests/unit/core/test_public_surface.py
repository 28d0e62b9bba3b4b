"""tfimage.agent's deliberate public surface, pinned; importing it stays light."""

from __future__ import annotations

import subprocess
import sys

import tfimage.agent


def test_the_public_surface_is_exactly_this() -> None:
    assert tfimage.agent.__all__ == [
        "Config",
        "ImageError",
        "ImageReferenceError",
        "InputError",
        "Reference",
        "TfimageError",
        "load_config",
        "parse_reference",
    ]
    for name in tfimage.agent.__all__:
        assert getattr(tfimage.agent, name).__module__.startswith("tfimage.agent.")


def test_importing_it_loads_only_the_core_and_no_heavy_library() -> None:
    code = (
        "import sys, tfimage.agent; "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('tfimage.agent.') "
        "or m.split('.')[0] in ('yaml', 'requests', 'oras', 'psutil', 'pynvml'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert loaded == [
        "tfimage.agent.core",
        "tfimage.agent.core.access",  # the config's access: rules: pure, no NSS lookup
        "tfimage.agent.core.config",
        "tfimage.agent.core.errors",
        "tfimage.agent.core.gpuconfig",  # the config's gpu: section: pure, no pynvml
        "tfimage.agent.core.hostlist",  # the config's rack_mirrors: hostlists
        "tfimage.agent.core.ids",  # the digest pattern the parser checks
        "tfimage.agent.core.logtext",  # hostlist's one-line quotes
        "tfimage.agent.core.mirrortiers",  # the config's rack_mirrors: pure
        "tfimage.agent.core.partition",  # the config's partitions: rules: pure
        "tfimage.agent.core.reference",
        "tfimage.agent.core.wire",  # the config's defaults are the plugin's
    ]

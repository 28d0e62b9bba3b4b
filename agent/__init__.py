"""tfimage's machinery, for the hooks, the daemon, the plugin's helper and the CLI.

The public surface is what a site script needs to read the config and check an
image reference the way the plugin does; everything else is reached through its
subpackage (core/, registry/, usage/, hooks/, cache/, gpu/, submit/, step/, daemon/,
cli/) and may change.
tests/unit/core/test_public_surface.py pins this list.
"""

from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.errors import ImageError, ImageReferenceError, InputError, TfimageError
from tfimage.agent.core.reference import Reference, parse_reference

__all__ = [
    "Config",
    "ImageError",
    "ImageReferenceError",
    "InputError",
    "Reference",
    "TfimageError",
    "load_config",
    "parse_reference",
]

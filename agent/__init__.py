"""Shared machinery for the hooks, the SPANK helper and the operator CLI.

Public names are re-exported here; the modules behind them are private details.
"""

from tfimage.agent.config import Config, load_config
from tfimage.agent.errors import (
    CacheError,
    ConfigError,
    CredentialsError,
    ImageError,
    ImageReferenceError,
    RegistryError,
    RuntimeSetupError,
    TfimageError,
    VerificationError,
)
from tfimage.agent.reference import Reference, parse_reference

__all__ = [
    "CacheError",
    "Config",
    "ConfigError",
    "CredentialsError",
    "ImageError",
    "ImageReferenceError",
    "Reference",
    "RegistryError",
    "RuntimeSetupError",
    "TfimageError",
    "VerificationError",
    "load_config",
    "parse_reference",
]

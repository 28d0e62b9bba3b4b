"""Types shared by the fixtures and the tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Registry:
    host: str
    ca: Path
    username: str
    password: str

    def write_site(self, d: Path, **extra: str) -> Path:
        """A tfimage config + credentials for this registry; returns the config path."""
        creds = d / "credentials.yaml"
        creds.write_text(
            f'registries:\n  "{self.host}":\n    username: "{self.username}"\n'
            f'    password: "{self.password}"\n'
        )
        creds.chmod(0o600)
        lines = [
            f'registry: "{self.host}"',
            "project: library",
            f"ca_bundle: {self.ca}",
            f"credentials: {creds}",
            f"cache_dir: {d / 'cache'}",
            f"state_dir: {d / 'state'}",
        ]
        lines += [f"{k}: {v}" for k, v in extra.items()]
        cfg = d / "config.yaml"
        cfg.write_text("\n".join(lines) + "\n")
        return cfg

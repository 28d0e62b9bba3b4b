"""Types shared by the fixtures and the tests."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


def build_sif(root: Path, sif: Path) -> Path:
    """A real SIF of the directory tree ``root``: mksquashfs, then siftool."""
    sqfs = sif.with_suffix(".sqfs")
    for argv in (
        ["mksquashfs", str(root), str(sqfs), "-all-root", "-quiet", "-noappend", "-comp", "lz4"],
        ["siftool", "new", str(sif)],
        [
            "siftool",
            "add",
            "--datatype",
            "4",
            "--parttype",
            "1",
            "--partfs",
            "1",
            "--partarch",
            "2",
            str(sif),
            str(sqfs),
        ],
    ):
        subprocess.run(argv, check=True, capture_output=True, timeout=120)
    return sif


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

"""The compiled (JSON) config: used only while it matches the YAML exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tfimage.agent.cli.main import main
from tfimage.agent.config import compile_config, compiled_path, load_config
from tfimage.agent.errors import ConfigError


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


def test_compiled_config_loads_the_same_settings(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "config.yaml", "registry: h.example\nmirrors: [m1, m2]\n")
    out = compile_config(cfg)
    assert out == compiled_path(cfg) and oct(out.stat().st_mode & 0o777) == "0o644"
    assert load_config(cfg) == load_config(cfg)  # stable
    assert load_config(cfg).mirrors == ("m1", "m2")


def test_an_edited_yaml_wins_over_a_stale_compiled_form(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "config.yaml", "registry: old.example\n")
    compile_config(cfg)
    _write(cfg, "registry: new.example\nproject: ml\n")  # size and mtime change
    assert load_config(cfg).registry == "new.example"


def test_a_compiled_form_writable_by_others_is_ignored(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "config.yaml", "registry: real.example\n")
    out = compile_config(cfg)
    out.write_text(out.read_text().replace("real.example", "evil.example"))
    os.chmod(out, 0o666)  # noqa: S103 - the fault under test
    assert load_config(cfg).registry == "real.example"


def test_the_compiled_path_does_not_load_yaml(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "config.yaml", "registry: h.example\n")
    compile_config(cfg)
    code = (
        "import sys; from tfimage.agent.config import load_config; "
        f"load_config({str(cfg)!r}); print('yaml' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_a_bad_config_is_never_compiled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _write(tmp_path / "config.yaml", "registry: h\nrunetime: apptainer\n")
    with pytest.raises(ConfigError, match="unknown setting"):
        compile_config(cfg)
    assert not compiled_path(cfg).exists()
    assert main(["--config", str(cfg), "config-compile"]) == 2
    assert "unknown setting(s): runetime" in capsys.readouterr().err

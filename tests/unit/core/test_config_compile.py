"""The compiled (JSON) config: used only while it matches the YAML exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tfimage.agent.cli.main import main
from tfimage.agent.core.config import compile_config, compiled_path, load_config
from tfimage.agent.core.errors import ConfigError


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


YAML = """\
registry: h.example
project: team
mirrors: [m1, m2]
hook_deadline: 300
bind_prefixes: [/home, /scratch]
site_env: {TF_FORCE_GPU_ALLOW_GROWTH: "true", OMP_NUM_THREADS: "4"}
tf_port_range: [30000, 30999]
cache_max_bytes: 1073741824
single_task_tf_config: true
"""


def test_the_compiled_form_holds_the_yamls_settings_field_by_field(tmp_path: Path) -> None:
    import json

    import yaml

    cfg = _write(tmp_path / "config.yaml", YAML)
    out = compile_config(cfg)
    assert out == compiled_path(cfg) and oct(out.stat().st_mode & 0o777) == "0o644"
    settings = json.loads(out.read_text())["settings"]
    assert settings == yaml.safe_load(YAML)  # every key and value, as written
    loaded = load_config(cfg)  # from the JSON (the next test proves no yaml import)
    for key, value in yaml.safe_load(YAML).items():
        got = getattr(loaded, key)
        assert got == (tuple(value) if isinstance(value, list) else value), key


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
        "import sys; from tfimage.agent.core.config import load_config; "
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


NOBODY = 65534
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="chown and root's own check need root")


@pytest.mark.parametrize(
    "mode", [0o620, 0o602, 0o666], ids=["group-writable", "other-writable", "both"]
)
def test_a_compiled_form_writable_by_group_or_others_is_ignored(tmp_path: Path, mode: int) -> None:
    cfg = _write(tmp_path / "config.yaml", "registry: real.example\n")
    out = compile_config(cfg)
    out.write_text(out.read_text().replace("real.example", "evil.example"))
    os.chmod(out, mode)
    assert load_config(cfg).registry == "real.example"


@ROOT_ONLY
def test_a_compiled_form_owned_by_another_user_is_ignored(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "config.yaml", "registry: real.example\n")
    out = compile_config(cfg)
    out.write_text(out.read_text().replace("real.example", "evil.example"))
    os.chown(out, NOBODY, NOBODY)
    assert load_config(cfg).registry == "real.example"


@ROOT_ONLY
@pytest.mark.parametrize(
    ("mode", "owner", "said"),
    [
        (0o664, 0, "mode 0664 lets others write it; chmod go-w it"),
        (0o646, 0, "mode 0646 lets others write it; chmod go-w it"),
        (0o644, NOBODY, "not owned by root"),
    ],
    ids=["group-writable", "other-writable", "another owner"],
)
def test_root_refuses_a_config_others_may_write(
    tmp_path: Path, mode: int, owner: int, said: str
) -> None:
    cfg = _write(tmp_path / "config.yaml", "registry: real.example\n")
    os.chmod(cfg, mode)
    os.chown(cfg, owner, 0)
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert str(e.value) == f"{cfg}: {said}" or str(e.value).startswith(f"{cfg}: {said}")

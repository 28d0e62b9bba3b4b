"""``--tf-mount`` host paths resolved as the job's user, and checked where they lead."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import BindError
from tfimage.agent.step.binds import parse_binds
from tfimage.agent.step.plan import _resolved
from tfimage.agent.step.userpath import realpaths_as

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="taking another uid needs root")
NOBODY = 65534


@pytest.fixture
def tree() -> Iterator[Path]:
    """Under /run (pytest's tmp is 0700: another uid could not look): an allowed
    prefix holding a real directory, a link to /etc, and a directory only root reads."""
    base = Path(f"/run/tfimage-userpath-{os.getpid()}")
    (base / "data" / "real").mkdir(parents=True)
    (base / "data" / "etc").symlink_to("/etc")
    (base / "data" / "in").symlink_to(base / "data" / "real")
    (base / "data" / "secret").mkdir(mode=0o700)
    (base / "data" / "secret" / "x").mkdir()
    base.chmod(0o755)
    (base / "data").chmod(0o755)
    yield base
    shutil.rmtree(base)


def test_links_are_resolved_as_the_user(tree: Path) -> None:
    d = tree / "data"
    assert realpaths_as(NOBODY, [str(d / "in"), str(d / "etc")]) == [str(d / "real"), "/etc"]
    # The secret directory's inside is root's to see, not the user's.
    with pytest.raises(BindError, match="secret/x: Permission denied"):
        realpaths_as(NOBODY, [str(d / "secret/x")])
    with pytest.raises(BindError, match="/no/such: No such file or directory"):
        realpaths_as(NOBODY, ["/no/such"])


def test_a_link_under_an_allowed_prefix_leading_out_of_it_is_refused(tree: Path) -> None:
    d = tree / "data"
    cfg = Config(registry="r.invalid", bind_prefixes=(str(d),))
    binds = parse_binds(f"{d / 'etc'}:/mnt/etc,{d / 'in'}:/mnt/in", cfg.bind_prefixes)
    with pytest.raises(BindError, match=r"leads to /etc, outside the allowed prefixes"):
        _resolved(cfg, NOBODY, binds)
    ok = _resolved(cfg, NOBODY, parse_binds(f"{d / 'in'}:/mnt/in:ro", cfg.bind_prefixes))
    assert [(b.src, b.dst, b.read_only) for b in ok] == [(str(d / "real"), "/mnt/in", True)]


def test_a_source_the_user_cannot_reach_fails_the_step_at_once(tree: Path) -> None:
    """Left for the task to find, it could be re-pointed in between."""
    d = tree / "data"
    cfg = Config(registry="r.invalid", bind_prefixes=(str(d),))
    with pytest.raises(BindError, match="Permission denied"):
        _resolved(cfg, NOBODY, parse_binds(f"{d / 'secret/x'}:/mnt/x", cfg.bind_prefixes))


def test_a_real_path_with_a_colon_is_never_bound(tree: Path) -> None:
    """ch-run splits -b SRC:DST at the first ':': '/P/..:/etc' would bind /P/.. ."""
    d = tree / "data"
    (d / "..:etc").mkdir()
    (d / "colon").symlink_to(d / "..:etc")
    cfg = Config(registry="r.invalid", bind_prefixes=(str(d),))
    with pytest.raises(BindError, match="not a bindable path"):
        _resolved(cfg, NOBODY, parse_binds(f"{d / 'colon'}:/mnt/c", cfg.bind_prefixes))

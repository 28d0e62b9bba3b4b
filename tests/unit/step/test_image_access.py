"""access: enforced root-side against a real registry and a real node cache: at
submit (the pin), in the prolog (before any pull), on a cache hit, and through a
digest swap, with this machine's own users: ``nobody`` (in the rule's group) may
run ``team-a/*``, ``daemon`` (not in it) may not."""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import io
import json
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import Registry
from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.cli.main import main
from tfimage.agent.core import layout
from tfimage.agent.core.access import identity
from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.errors import AccessDenied, ImageNotFound
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.registry.credentials import Credential
from tfimage.agent.step import imagemount
from tfimage.agent.step.plan import prepare_job
from tfimage.agent.submit.pin import pin

NOBODY = pwd.getpwnam("nobody")
DAEMON = pwd.getpwnam("daemon")
TEAM = grp.getgrgid(NOBODY.pw_gid).gr_name  # nogroup on Debian


@dataclass
class Site:
    cfg: Config
    up: RegistryClient
    digests: dict[str, str]
    private: Path  # team-a's SIF file


@pytest.fixture
def site(
    registry: Registry,
    make_sif: Callable[[dict[str, str]], Path],
    root_with_fuse: None,
) -> Iterator[Site]:
    # Where other users may read the cache's metadata (pytest's tmp_path is 0700).
    shared = Path(tempfile.mkdtemp(prefix="tfimage-access-"))
    shared.chmod(0o755)
    up = RegistryClient(
        registry.host,
        Credential(registry.username, registry.password),
        ca_bundle=str(registry.ca),
    )
    private = make_sif({"etc/tfimage-test-image": "team-a's own\n"})
    public = make_sif({"etc/tfimage-test-image": "everyone's\n"})
    digests = {
        "team-a/tiny": up.push_sif("team-a/tiny", "1.0", private),
        "library/tiny": up.push_sif("library/tiny", "1.0", public),
    }
    assert TEAM in identity(NOBODY.pw_uid).groups
    assert TEAM not in identity(DAEMON.pw_uid).groups
    cfg = load_config(registry.write_site(shared, access=f'{{"team-a/*": ["@{TEAM}"]}}'))
    yield Site(cfg, up, digests, private)
    state = cfg.state_dir
    for job in ("1", "2", "3", "4"):
        imagemount.release_job(state, job)
    imagemount.release_images(state, lambda digest: False)
    shutil.rmtree(shared)


def _cached(cfg: Config) -> list[str]:
    return sorted(p.name for p in layout.cache_images(cfg.cache_dir).glob("*.sif"))


def test_a_refused_user_pulls_nothing_and_is_told_why_in_one_line(
    site: Site,
) -> None:
    cfg = site.cfg
    with pytest.raises(AccessDenied) as e:
        prepare_job(cfg, "1", "team-a/tiny:1.0", uid=DAEMON.pw_uid)
    assert str(e.value) == (
        f"team-a/tiny: daemon may not run it: access rule team-a/* (for @{TEAM})"
    )
    assert _cached(cfg) == []


def test_a_cache_hit_after_the_permitted_users_job_is_still_refused(
    site: Site,
) -> None:
    cfg, digests = site.cfg, site.digests
    got = prepare_job(cfg, "1", "team-a/tiny:1.0", uid=NOBODY.pw_uid)
    assert got.ref.digest == digests["team-a/tiny"] and not got.hit
    with pytest.raises(AccessDenied, match="daemon may not run it"):
        prepare_job(cfg, "2", f"team-a/tiny@{digests['team-a/tiny']}", uid=DAEMON.pw_uid)
    again = prepare_job(cfg, "3", "team-a/tiny:1.0", uid=NOBODY.pw_uid)
    assert again.hit


def test_a_private_digest_named_in_an_open_repository_is_refused_on_a_hit(
    site: Site,
) -> None:
    cfg, digests = site.cfg, site.digests
    prepare_job(cfg, "1", "team-a/tiny:1.0", uid=NOBODY.pw_uid)
    swap = f"library/tiny@{digests['team-a/tiny']}"
    with pytest.raises(AccessDenied) as e:
        prepare_job(cfg, "2", swap, uid=DAEMON.pw_uid)
    assert str(e.value) == (
        f"library/tiny@{digests['team-a/tiny']}: the registry does not hold that digest in"
        " library/tiny, and the bytes on this node came from a repository this user may"
        " not run"
    )


def test_the_same_bytes_public_in_the_repository_named_are_confirmed_and_run(
    site: Site,
    make_sif: Callable[[dict[str, str]], Path],
) -> None:
    cfg, up, digests = site.cfg, site.up, site.digests
    prepare_job(cfg, "1", "team-a/tiny:1.0", uid=NOBODY.pw_uid)
    # The team published the same SIF in library/ as well: the registry confirms it.
    assert up.push_sif("library/shared", "1.0", site.private) == digests["team-a/tiny"]
    got = prepare_job(cfg, "2", f"library/shared@{digests['team-a/tiny']}", uid=DAEMON.pw_uid)
    assert got.hit and ImageCache(cfg).read_entry(got.ref.digest or "").origin == (
        f"{cfg.registry}/team-a/tiny"
    )


def test_at_submit_a_refused_user_hears_what_a_missing_repository_says(
    site: Site, tmp_path: Path
) -> None:
    cfg, up, digests = site.cfg, site.up, site.digests
    seen = tmp_path / "seen"

    def said(text: str, uid: int) -> str:
        with pytest.raises(ImageNotFound) as e:
            pin(cfg, cfg.reference(text), lambda _h: up, seen, uid=uid)
        return str(e.value)

    refused = said("team-a/tiny:1.0", DAEMON.pw_uid)
    missing = said("team-b/tiny:1.0", DAEMON.pw_uid)
    assert refused == missing.replace("team-b", "team-a")
    assert refused == (
        f"{cfg.registry}/team-a/tiny: no such repository, or not readable with the credentials used"
    )
    # Not by digest either, and the tag it would pin is never remembered for anyone.
    said(f"team-a/tiny@{digests['team-a/tiny']}", DAEMON.pw_uid)
    assert not seen.exists() or "team-a" not in seen.read_text()
    pinned, _ = pin(cfg, cfg.reference("team-a/tiny:1.0"), lambda _h: up, seen, uid=NOBODY.pw_uid)
    assert pinned.digest == digests["team-a/tiny"]


def _ls_as(user: pwd.struct_passwd, cfg_path: Path) -> list[str]:
    """``tfimage cache ls --json`` run as ``user``: the CLI's own main, in a child
    that has become the user (uid, gid and groups), the modules it needs loaded by
    root first (the checkout may lie where the user cannot read, as /root)."""
    argv = ["--config", str(cfg_path), "cache", "ls", "--json"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            os.close(r)
            os.setgroups(os.getgrouplist(user.pw_name, user.pw_gid))
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = main(argv)
            os.write(w, out.getvalue().encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, text
    return sorted(e["origin"].partition("/")[2] for e in json.loads(text))


def test_cache_ls_shows_a_user_only_what_they_may_run_and_root_everything(
    site: Site,
) -> None:
    cfg = site.cfg
    prepare_job(cfg, "1", "team-a/tiny:1.0", uid=NOBODY.pw_uid)
    prepare_job(cfg, "2", "library/tiny:1.0", uid=DAEMON.pw_uid)
    cfg_path = Path(cfg.cache_dir).parent / "config.yaml"
    assert _ls_as(NOBODY, cfg_path) == ["library/tiny", "team-a/tiny"]
    assert _ls_as(DAEMON, cfg_path) == ["library/tiny"]
    assert _ls_as(pwd.getpwuid(0), cfg_path) == ["library/tiny", "team-a/tiny"]


def _reads_as(user: pwd.struct_passwd, path: Path) -> bool:
    r = subprocess.run(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups",
         "head", "-c", "4", str(path)],
        capture_output=True, timeout=60,
    )  # fmt: skip
    return r.returncode == 0


def test_a_private_images_file_metadata_and_mount_are_closed_to_other_users(
    site: Site,
) -> None:
    cfg, digests = site.cfg, site.digests
    private = prepare_job(cfg, "1", "team-a/tiny:1.0", uid=NOBODY.pw_uid)
    public = prepare_job(cfg, "2", "library/tiny:1.0", uid=DAEMON.pw_uid)
    cache = ImageCache(cfg)
    entry = cache.entry_path(digests["team-a/tiny"])
    assert _reads_as(NOBODY, private.path) and _reads_as(NOBODY, entry)
    assert not _reads_as(DAEMON, private.path) and not _reads_as(DAEMON, entry)
    assert _reads_as(DAEMON, public.path) and _reads_as(NOBODY, public.path)
    # The mount is the job's own, in a directory only its user traverses; the
    # shared one is never made for a private image.
    digest = digests["team-a/tiny"]
    mount = layout.job_image_mount(cfg.state_dir, "1", digest)
    assert imagemount.mounted(mount)
    assert not imagemount.mounted(imagemount.shared_dir(cfg.state_dir, digest))
    marker = mount / "etc/tfimage-test-image"
    assert _reads_as(NOBODY, marker) and not _reads_as(DAEMON, marker)
    shared_public = imagemount.shared_dir(cfg.state_dir, digests["library/tiny"])
    assert _reads_as(NOBODY, shared_public / "etc/tfimage-test-image")


def test_an_image_cached_before_its_rule_follows_the_rule_at_its_next_use(
    site: Site, registry: Registry, tmp_path: Path
) -> None:
    # Cached by a node with no rules: 0444, as before.
    (tmp_path / "open").mkdir()
    open_cfg = load_config(registry.write_site(tmp_path / "open"))
    open_cfg = dataclasses.replace(open_cfg, cache_dir=site.cfg.cache_dir)
    got = Puller(ImageCache(open_cfg)).ensure(open_cfg.reference("team-a/tiny:1.0"))
    assert _reads_as(DAEMON, got.path)
    # The rule comes; the next use closes it.
    prepare_job(site.cfg, "3", "team-a/tiny:1.0", uid=NOBODY.pw_uid)
    assert not _reads_as(DAEMON, got.path) and _reads_as(NOBODY, got.path)
    # And goes: the next use opens it again.
    open_node = dataclasses.replace(site.cfg, access=())
    Puller(ImageCache(open_node)).ensure(open_node.reference("team-a/tiny:1.0"))
    assert _reads_as(DAEMON, got.path)

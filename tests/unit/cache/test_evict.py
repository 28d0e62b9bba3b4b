"""Eviction, holders, the keep list, verify and warm on a real cache fed by a real
registry."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from support import Registry, flock_waiters, wait_for
from tfimage.agent.cache.evict import fill, prune, remove
from tfimage.agent.cache.keep import set_kept
from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.cache.verify import verify
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import CacheError, ConfigError

DAY = 86400.0
CLI = (sys.executable, "-m", "tfimage.main")


@pytest.fixture
def filled(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> tuple[ImageCache, dict[str, str], Path]:
    """Images a, b, c, d in a cache, each used a day ago or more (a the longest)."""
    up = registry.client()
    cfg_path = registry.write_site(tmp_path)
    cache = ImageCache(load_config(cfg_path))
    digests = {}
    for i, name in enumerate("abcd"):
        up.push_sif(f"library/ev{name}", "1", make_sif({"f": os.urandom(30000).hex() + name}))
        got = Puller(cache).ensure(cache.cfg.reference(f"ev{name}:1"))
        assert got.ref.digest
        digests[name] = got.ref.digest
        used = time.time() - (10 - i) * DAY
        cache.update_entry(got.ref.digest, lambda e, t=used: replace(e, last_used=t))
    return cache, digests, cfg_path


def limited(cfg_path: Path, cache: ImageCache, fraction: float) -> ImageCache:
    """The same cache with a size limit that puts it at ``fraction`` full."""
    total = fill(cache).cache_bytes
    cfg_path.write_text(cfg_path.read_text() + f"cache_max_bytes: {int(total / fraction)}\n")
    return ImageCache(load_config(cfg_path))


def cache_cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`tfimage --config CONFIG cache ARGS...` as an operator runs it."""
    return subprocess.run(
        [*CLI, "--config", str(config), "cache", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def hold(cache: ImageCache, digest: str, job: str, live: bool) -> None:
    cache.update_entry(digest, lambda e: replace(e, holders=(*e.holders, job)))
    if live:  # what the prolog leaves for a running job on this node
        jobs = Path(cache.cfg.state_dir) / "jobs"
        jobs.mkdir(parents=True, exist_ok=True)
        (jobs / f"{job}.images.json").write_text("{}")


def test_prune_lru_never_kept_held_or_young(
    filled: tuple[ImageCache, dict[str, str], Path],
) -> None:
    cache, d, cfg_path = filled
    cache = limited(cfg_path, cache, 0.95)  # above the 85% high watermark
    set_kept(cache, d["a"], True)  # oldest, but kept
    hold(cache, d["b"], "77", live=True)  # next oldest, held by a running job
    cache.update_entry(d["d"], lambda e: replace(e, last_used=time.time()))  # young
    gone = [g.digest for g in prune(cache)]
    assert gone == [d["c"]]  # 95% -> ~71% after one of four: stops under 80%
    assert {e.digest for e in cache.entries()} == {d["a"], d["b"], d["d"]}
    assert not cache.path_of(d["c"]).exists()


def test_below_high_watermark_nothing_goes(filled: tuple[ImageCache, dict[str, str], Path]) -> None:
    cache, _, cfg_path = filled
    assert prune(limited(cfg_path, cache, 0.84)) == []


def test_stale_holder_is_reclaimed(filled: tuple[ImageCache, dict[str, str], Path]) -> None:
    cache, d, cfg_path = filled
    cache = limited(cfg_path, cache, 0.95)
    hold(cache, d["a"], "99", live=False)  # its job crashed away: no state left
    assert [g.digest for g in prune(cache)] == [d["a"]]


def with_settings(cfg_path: Path, **settings: float) -> ImageCache:
    """A cache under the same site file with ``settings`` added to it."""
    cfg_path.write_text(cfg_path.read_text() + "".join(f"{k}: {v}\n" for k, v in settings.items()))
    return ImageCache(load_config(cfg_path))


def size_of(cache: ImageCache, digest: str) -> int:
    return cache.read_entry(digest).size


def test_exactly_at_the_high_watermark_prune_starts(
    filled: tuple[ImageCache, dict[str, str], Path],
) -> None:
    cache, d, cfg_path = filled
    used = fill(cache).cache_bytes
    # 100 * used / (2 * used) is exactly 50.0: at the mark, not below it
    cache = with_settings(
        cfg_path, cache_max_bytes=2 * used, cache_high_watermark=50, cache_low_watermark=40
    )
    assert fill(cache).percent == 50.0
    assert [g.digest for g in prune(cache)][:1] == [d["a"]]


def test_prune_stops_as_soon_as_it_reaches_the_low_watermark(
    filled: tuple[ImageCache, dict[str, str], Path],
) -> None:
    cache, d, cfg_path = filled
    used = fill(cache).cache_bytes
    # the low mark lands exactly where the oldest image's bytes leave: a alone goes
    after_a = used - size_of(cache, d["a"])
    cache = with_settings(
        cfg_path, cache_max_bytes=2 * after_a, cache_high_watermark=50, cache_low_watermark=50
    )
    assert [g.digest for g in prune(cache)] == [d["a"]]
    assert cache.path_of(d["b"]).exists()


def test_an_image_exactly_min_age_old_may_go_and_a_second_younger_may_not(
    filled: tuple[ImageCache, dict[str, str], Path],
) -> None:
    cache, d, cfg_path = filled
    cache = limited(cfg_path, cache, 0.95)
    now = 1_000_000_000.0
    age = cache.cfg.cache_min_age
    for name, last in (("a", now - age), ("b", now - age + 1), ("c", now), ("d", now)):
        cache.update_entry(d[name], lambda e, t=last: replace(e, last_used=t))
    assert [g.digest for g in prune(cache, dry_run=True, now=now)] == [d["a"]]


def test_a_dry_run_lists_neither_kept_nor_held_images(
    filled: tuple[ImageCache, dict[str, str], Path],
) -> None:
    cache, d, cfg_path = filled
    cache = limited(cfg_path, cache, 0.95)
    set_kept(cache, d["a"], True)
    hold(cache, d["b"], "77", live=True)
    listed = [g.digest for g in prune(cache, dry_run=True)]
    assert d["a"] not in listed and d["b"] not in listed
    assert listed[:1] == [d["c"]]


def test_reclaiming_drops_only_the_holders_whose_jobs_are_gone(
    filled: tuple[ImageCache, dict[str, str], Path],
) -> None:
    from tfimage.agent.cache.evict import reclaim_holders

    cache, d, _ = filled
    hold(cache, d["a"], "10", live=True)
    hold(cache, d["a"], "11", live=False)
    hold(cache, d["b"], "12", live=False)
    assert reclaim_holders(cache) == 2
    assert cache.read_entry(d["a"]).holders == ("10",)
    assert cache.read_entry(d["b"]).holders == ()
    assert reclaim_holders(cache) == 0


def test_refusals_name_the_short_digest_and_why(
    filled: tuple[ImageCache, dict[str, str], Path],
) -> None:
    cache, d, _ = filled
    short = re.escape(d["a"][:19])  # "sha256:" and 12 hex digits, as `cache ls` shows
    hold(cache, d["a"], "5", live=True)
    with pytest.raises(CacheError, match=rf"^{short} is held by running job\(s\) 5$"):
        remove(cache, d["a"])
    set_kept(cache, d["b"], True)
    with pytest.raises(CacheError, match=rf"^{re.escape(d['b'][:19])} is kept;"):
        remove(cache, d["b"])
    remove(cache, d["b"], force=True)
    with pytest.raises(CacheError, match=rf"^{re.escape(d['b'][:19])} is not in the cache$"):
        remove(cache, d["b"])


def test_rm_refuses_held_and_kept(filled: tuple[ImageCache, dict[str, str], Path]) -> None:
    cache, d, _ = filled
    hold(cache, d["a"], "5", live=True)
    with pytest.raises(CacheError, match="held by running job"):
        remove(cache, d["a"])
    set_kept(cache, d["b"], True)
    with pytest.raises(CacheError, match="kept"):
        remove(cache, d["b"])
    remove(cache, d["b"], force=True)
    assert not cache.path_of(d["b"]).exists()


def test_release_drops_the_jobs_holds(filled: tuple[ImageCache, dict[str, str], Path]) -> None:
    cache, d, _ = filled
    hold(cache, d["a"], "8", live=True)
    assert cache.release("8") == [d["a"]]
    assert cache.read_entry(d["a"]).holders == ()


def test_verify_finds_a_corrupted_image(filled: tuple[ImageCache, dict[str, str], Path]) -> None:
    cache, d, cfg_path = filled
    assert verify(cache) == []
    path = cache.path_of(d["c"])
    path.chmod(0o644)
    with path.open("r+b") as f:
        f.seek(-10, 2)
        f.write(b"corrupted!")
    assert verify(cache) == [(d["c"], "content does not match its sha256")]
    cli = cache_cli(cfg_path, "verify", "--json")
    assert cli.returncode == 1
    assert json.loads(cli.stdout) == [
        {"digest": d["c"], "problem": "content does not match its sha256"}
    ]


def test_keep_and_warm_follow_a_moved_tag(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    up = registry.client()
    cfg = registry.write_site(tmp_path)
    up.push_sif("library/warm", "1", make_sif({"v": "1"}))

    def tfimage(*args: str) -> subprocess.CompletedProcess[str]:
        return cache_cli(cfg, *args)

    assert tfimage("keep", "warm:1").returncode == 0
    new = up.push_sif("library/warm", "1", make_sif({"v": "2"}))
    r = tfimage("warm", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["digest"] == new
    entries = json.loads(tfimage("ls", "--json").stdout)
    assert {e["digest"]: e["kept"] for e in entries}[new] is True
    assert len(entries) == 2  # the old bytes stay, kept too, until unkept


def test_a_new_nodes_warm_fetches_and_keeps_the_sites_images_with_its_own(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    """A cloud node's disk comes empty, keep list and all: the config's keep_images
    are what it warms before it takes jobs, once each beside the node's own."""
    up = registry.client()
    site = up.push_sif("library/site", "1", make_sif({"v": "site"}))
    own = up.push_sif("library/own", "1", make_sif({"v": "own"}))
    cfg = registry.write_site(tmp_path)
    cfg.write_text(cfg.read_text() + 'keep_images: ["site:1"]\n')
    assert cache_cli(cfg, "keep", "own:1").returncode == 0
    assert cache_cli(cfg, "rm", own).returncode != 0  # kept: rm refuses without --force
    r = cache_cli(cfg, "warm", "--json")
    assert r.returncode == 0, r.stderr
    warmed = json.loads(r.stdout)
    assert [w["ref"] for w in warmed] == ["site:1", f"{registry.host}/library/own:1"]
    assert [w["digest"] for w in warmed] == [site, own]
    entries = {e["digest"]: e["kept"] for e in json.loads(cache_cli(cfg, "ls", "--json").stdout)}
    assert entries == {site: True, own: True}


def test_a_keep_image_that_is_not_a_reference_is_one_config_line(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text('keep_images: ["Not A Name!"]\n')
    with pytest.raises(ConfigError, match="'keep_images': "):
        load_config(tmp_path / "config.yaml")


def test_the_old_pin_spelling_is_refused_and_keep_is_named(
    filled: tuple[ImageCache, dict[str, str], Path],
) -> None:
    """'pin' is a tag fixed at submit; no release ever shipped 'cache pin', so it is
    gone rather than kept as a second name for keep."""
    cache, d, cfg_path = filled
    r = cache_cli(cfg_path, "pin", "eva:1")
    # argparse's own usage error; the choices are quoted up to Python 3.11, bare after
    assert r.returncode == 64 and re.search(r"invalid choice: 'pin'.*\bkeep\b", r.stderr), r.stderr
    assert cache.read_entry(d["a"]).kept is False
    listing = cache_cli(cfg_path, "--help").stdout
    assert re.search(r"^\s+keep\s", listing, re.M)


def test_concurrent_keeps_lose_none(filled: tuple[ImageCache, dict[str, str], Path]) -> None:
    """Operators (or the warm timer) changing the keep list at once: each change waits
    for its lock, and none is lost."""
    import fcntl

    cache, _, cfg_path = filled
    lock = cache.root / "locks" / "keep.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        procs = [
            subprocess.Popen(
                [*CLI, "--config", str(cfg_path), "cache", "keep", f"ev{name}:1"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name in "abcd"
        ]
        wait_for(lambda: flock_waiters(lock) == 4, what="four keeps queued on the lock")
        assert not (cache.root / "keep.json").exists()
    finally:
        os.close(fd)
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    kept = json.loads((cache.root / "keep.json").read_text())
    assert kept == sorted(str(cache.cfg.reference(f"ev{n}:1")) for n in "abcd")
    assert all(e.kept for e in cache.entries())


def test_prune_drops_interrupted_downloads_nobody_resumed(
    filled: tuple[ImageCache, dict[str, str], Path], tmp_path: Path
) -> None:
    import fcntl

    from tfimage.agent.cache.evict import stale_partials

    cache, _, cfg_path = filled
    tmp = cache.root / "tmp"
    old, young, busy = (f"sha256-{c * 64}" for c in "abc")
    for name in (old, young, busy):
        (tmp / f"{name}.partial").write_bytes(b"x" * 100)
    day_ago = time.time() - DAY
    for name in (old, busy):
        os.utime(tmp / f"{name}.partial", (day_ago, day_ago))
    # A pull resuming `busy` holds its digest's lock: not touched however old.
    fd = os.open(cache.root / "locks" / f"{busy}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert [p.name for p in stale_partials(cache, dry_run=True)] == [f"{old}.partial"]
        assert (tmp / f"{old}.partial").exists()
        r = cache_cli(cfg_path, "prune", "--json")
    finally:
        os.close(fd)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["partials"] == [f"{old}.partial"]
    left = sorted(p.name for p in tmp.iterdir())
    assert left == sorted([f"{busy}.partial", f"{young}.partial"])  # marks went too


def test_an_epilog_drops_every_download_no_pull_is_at_and_nothing_else(
    filled: tuple[ImageCache, dict[str, str], Path],
) -> None:
    import fcntl

    from tfimage.agent.cache.evict import abandoned_downloads

    cache, _, _ = filled
    tmp = cache.root / "tmp"
    young, busy = (f"sha256-{c * 64}" for c in "ab")
    for name in (young, busy):
        (tmp / f"{name}.partial").write_bytes(b"x" * 8192)
    converting = tmp / f"sha256-{'c' * 64}.converted"  # its pull discards it itself
    converting.write_bytes(b"sif")
    (cache.root / "staged").mkdir(exist_ok=True)
    staged = cache.root / "staged" / f"sha256-{'d' * 64}.sif"  # for a job yet to start
    staged.write_bytes(b"sif")
    fd = os.open(cache.root / "locks" / f"{busy}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a pull resuming it now
    try:
        assert [p.name for p in abandoned_downloads(cache)] == [f"{young}.partial"]
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp.iterdir()) == sorted([f"{busy}.partial", converting.name])
    assert staged.exists()


# --- an entry is its image and its metadata: never one without the other -------------


def test_an_image_is_never_published_without_its_metadata(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    digest = registry.client().push_sif("library/halfway", "1", make_sif({"h": "1"}))
    cache = ImageCache(load_config(registry.write_site(tmp_path)))
    cache.make_dirs()
    # The metadata cannot be written (a directory in its way, as a full disk would).
    cache.entry_path(digest).mkdir()
    with pytest.raises(CacheError, match="cannot record"):
        Puller(cache).ensure(cache.cfg.reference("halfway:1"))
    assert not cache.path_of(digest).exists()  # not published
    assert not list((cache.root / "tmp").iterdir())  # and nothing left behind
    cache.entry_path(digest).rmdir()
    got = Puller(cache).ensure(cache.cfg.reference("halfway:1"))  # the next pull publishes both
    assert got.path.exists() and cache.entry_path(digest).exists()
    assert [e.digest for e in cache.entries()] == [digest]


def test_orphans_are_reported_by_verify_and_removed_by_prune(
    filled: tuple[ImageCache, dict[str, str], Path],
) -> None:
    cache, digests, cfg_path = filled
    images = cache.root / "images"
    lone_sif = images / f"sha256-{'1' * 64}.sif"  # an older tfimage's half-published entry
    lone_sif.write_bytes(cache.path_of(digests["a"]).read_bytes())
    lone_json = images / f"sha256-{'2' * 64}.json"  # a crash between the two steps
    lone_json.write_text(json.dumps({"digest": "sha256:" + "2" * 64, "holders": []}))
    assert {d for d, _ in verify(cache)} == {"sha256:" + "1" * 64, "sha256:" + "2" * 64}
    assert len(cache.entries()) == 4  # neither counts as an entry
    r = cache_cli(cfg_path, "prune", "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(r.stdout)["orphans"]) == sorted([lone_sif.name, lone_json.name])
    assert not lone_sif.exists() and not lone_json.exists()
    assert verify(cache) == [] and len(cache.entries()) == 4  # the real entries untouched


def test_leftovers_exactly_min_age_old_go_and_a_link_there_is_never_followed(
    filled: tuple[ImageCache, dict[str, str], Path], tmp_path: Path
) -> None:
    from tfimage.agent.cache.evict import stale_partials

    cache, _, _ = filled
    tmp = cache.root / "tmp"
    now = time.time()
    edge = tmp / f"sha256-{'e' * 64}.partial"
    edge.write_bytes(b"x")
    mtime = edge.lstat().st_mtime
    # Only root writes tmp/; a link there (a bug, an intruder) is left for an operator.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    link = tmp / f"convert-sha256-{'f' * 64}"
    link.symlink_to(outside, target_is_directory=True)
    os.utime(link, (now - DAY, now - DAY), follow_symlinks=False)
    gone = stale_partials(cache, now=mtime + cache.cfg.cache_min_age)
    assert gone == [edge]
    assert not edge.exists()
    assert link.is_symlink() and (outside / "precious").read_text() == "keep me"


@pytest.mark.parametrize("unkept_as", ["name", "digest", "prefix", "full name"])
def test_an_unkept_image_stays_unkept_through_the_next_warm(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path, unkept_as: str
) -> None:
    """Kept as ``cold:1``, unkept by any name of the same image: the next ``cache
    warm`` must not keep it again (it did when unkept by digest)."""
    up = registry.client()
    cfg = registry.write_site(tmp_path)
    up.push_sif("library/cold", "1", make_sif({"v": "1"}))
    assert cache_cli(cfg, "keep", "cold:1").returncode == 0
    digest = json.loads(cache_cli(cfg, "ls", "--json").stdout)[0]["digest"]
    name = {
        "name": "cold:1",
        "digest": digest,
        "prefix": digest[:15],
        "full name": str(load_config(cfg).reference("cold:1")),
    }[unkept_as]
    r = cache_cli(cfg, "unkeep", name)
    assert r.returncode == 0, r.stderr
    warm = cache_cli(cfg, "warm", "--json")
    assert warm.returncode == 0 and json.loads(warm.stdout) == [], warm.stdout
    assert json.loads(cache_cli(cfg, "ls", "--json").stdout)[0]["kept"] is False

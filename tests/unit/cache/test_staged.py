"""A copy staged for a job (cache/staged.py), against a real registry: adopted only
when it is exactly the pinned image, else refused in one line and pulled as ever;
never followed through a link, never blocked on a FIFO, never taken from another
user, and taken from the job's own user only as root's copy."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import Registry
from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.cache.verify import verify
from tfimage.agent.core import layout
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import VerificationError
from tfimage.agent.core.reference import Reference

JOB = "4242"
NOBODY = 65534
JOB_UID = 4321  # the job's user: no name needed, only a uid
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root owns what is adopted")


@dataclass
class Pushed:
    cache: ImageCache
    ref: Reference  # pinned
    manifest: bytes
    sif: bytes

    @property
    def staged(self) -> tuple[Path, Path]:
        assert self.ref.digest
        return layout.cache_staged(self.cache.root, self.ref.digest, JOB)

    def stage(self, manifest: bytes | None = None, sif: bytes | None = None) -> None:
        """Both files as the controller's sbcast would leave them (root's here, 0644)."""
        self.cache.make_dirs()
        m, s = self.staged
        m.write_bytes(self.manifest if manifest is None else manifest)
        s.write_bytes(self.sif if sif is None else sif)
        for p in (m, s):
            p.chmod(0o644)


def _push(registry: Registry, sif: Path, tmp_path: Path, repo: str) -> Pushed:
    client = registry.client()
    digest = client.push_sif(f"library/{repo}", "1", sif)
    raw = client.manifest(f"library/{repo}", "1").raw
    cfg = load_config(registry.write_site(tmp_path))
    return Pushed(ImageCache(cfg), cfg.reference(f"{repo}@{digest}"), raw, sif.read_bytes())


@pytest.fixture
def pushed(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> Pushed:
    return _push(registry, make_sif({"etc/staged": "yes\n"}), tmp_path, "stg")


def test_a_good_staged_copy_is_adopted_without_the_registry(pushed: Pushed) -> None:
    pushed.stage()
    ref = pushed.ref
    offline = Puller(pushed.cache, client_factory=_no_registry)
    got = offline.ensure(ref, job=JOB)
    assert (got.hit, got.source, got.refused) == (False, "staged", None)
    assert got.path.read_bytes() == pushed.sif
    entry = pushed.cache.read_entry(ref.digest or "")
    assert (entry.source, entry.origin, JOB in entry.holders) == ("staged", ref.name, True)
    st = got.path.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o444)
    assert not any(p.exists() for p in pushed.staged)  # both staged files gone
    assert verify(pushed.cache) == []


def _no_registry(host: str) -> object:
    raise AssertionError(f"the registry {host} was asked")


def _refused_then_pulled(p: Pushed, uid: int | None = None) -> str:
    got = Puller(p.cache).ensure(p.ref, job=JOB, uid=uid)
    assert got.source == p.ref.registry and got.path.read_bytes() == p.sif
    assert not any(os.path.lexists(x) for x in p.staged), "staged files left behind"
    assert not layout.cache_adopting(p.cache.root, p.ref.digest or "").exists()
    assert not layout.cache_adopted(p.cache.root, p.ref.digest or "").exists()
    assert got.refused
    return got.refused


def test_a_short_copy_is_refused_and_the_image_pulled(pushed: Pushed) -> None:
    pushed.stage(sif=pushed.sif[:-1])
    assert _refused_then_pulled(pushed) == (
        f"staged copy refused: SIF: {len(pushed.sif) - 1} bytes, not the layer's {len(pushed.sif)}"
    )


def test_a_copy_with_another_sha256_is_refused_and_the_image_pulled(pushed: Pushed) -> None:
    evil = bytearray(pushed.sif)
    evil[-1] ^= 0xFF
    pushed.stage(sif=bytes(evil))
    assert _refused_then_pulled(pushed) == "staged copy refused: SIF: its sha256 is not the layer's"


def test_a_manifest_that_is_not_the_pinned_digest_is_refused(pushed: Pushed) -> None:
    pushed.stage(manifest=pushed.manifest + b" ")
    assert _refused_then_pulled(pushed) == "staged copy refused: manifest is not the pinned digest"


def test_a_staged_sif_that_is_a_link_is_never_followed(pushed: Pushed, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.sif"
    target.write_bytes(pushed.sif)
    pushed.stage()
    pushed.staged[1].unlink()
    pushed.staged[1].symlink_to(target)
    assert (
        _refused_then_pulled(pushed)
        == "staged copy refused: SIF: Too many levels of symbolic links"
    )
    assert target.read_bytes() == pushed.sif and target.stat().st_uid == 0  # untouched


def test_a_staged_fifo_is_refused_without_blocking(pushed: Pushed) -> None:
    pushed.stage()
    pushed.staged[1].unlink()
    os.mkfifo(pushed.staged[1], 0o644)
    assert _refused_then_pulled(pushed) == "staged copy refused: SIF: not a regular file"


def test_a_copy_owned_by_a_user_is_refused(pushed: Pushed) -> None:
    pushed.stage()
    os.chown(pushed.staged[1], NOBODY, NOBODY)
    assert _refused_then_pulled(pushed) == f"staged copy refused: SIF: owned by uid {NOBODY}"


def test_a_copy_another_user_put_under_the_jobs_name_is_refused(pushed: Pushed) -> None:
    pushed.stage()
    for p in pushed.staged:
        os.chown(p, NOBODY, NOBODY)
    refused = _refused_then_pulled(pushed, uid=JOB_UID)
    assert refused == f"staged copy refused: manifest: owned by uid {NOBODY}"


def test_the_job_users_copy_is_adopted_as_roots_own_copy(big: Pushed) -> None:
    """sbcast on Slurm 22.05 writes as the job's user, who could keep a descriptor
    open and write after the check: what is published is root's copy, and a write
    to the user's file afterwards cannot reach it."""
    big.stage()
    for p in big.staged:
        os.chown(p, JOB_UID, JOB_UID)
    fd = os.open(big.staged[1], os.O_RDWR)  # opened before the node takes it
    try:
        got = Puller(big.cache, client_factory=_no_registry).ensure(big.ref, job=JOB, uid=JOB_UID)
        os.pwrite(fd, b"\0" * 4096, 0)  # the user's file, after its adoption
    finally:
        os.close(fd)
    assert (got.hit, got.source, got.refused) == (False, "staged", None)
    st = got.path.stat()
    assert (st.st_uid, st.st_mode & 0o777, st.st_nlink) == (0, 0o444, 1)
    assert got.path.read_bytes() == big.sif
    assert verify(big.cache) == []
    assert not layout.cache_adopted(big.cache.root, big.ref.digest or "").exists()


def test_the_job_users_copy_that_is_longer_is_refused(pushed: Pushed) -> None:
    pushed.stage()
    with open(pushed.staged[1], "ab") as f:
        f.write(b"x")
    for p in pushed.staged:
        os.chown(p, JOB_UID, JOB_UID)
    refused = _refused_then_pulled(pushed, uid=JOB_UID)
    n = len(pushed.sif)
    assert refused == f"staged copy refused: SIF: {n + 1} bytes, not the layer's {n}"


def test_the_job_users_corrupt_copy_is_refused(pushed: Pushed) -> None:
    evil = bytearray(pushed.sif)
    evil[-1] ^= 0xFF
    pushed.stage(sif=bytes(evil))
    for p in pushed.staged:
        os.chown(p, JOB_UID, JOB_UID)
    refused = _refused_then_pulled(pushed, uid=JOB_UID)
    assert refused == "staged copy refused: SIF: its sha256 is not the layer's"


def test_a_copy_others_may_write_is_refused(pushed: Pushed) -> None:
    pushed.stage()
    pushed.staged[0].chmod(0o664)
    assert (
        _refused_then_pulled(pushed)
        == "staged copy refused: manifest: mode 0664 lets others write it"
    )


def test_a_copy_that_is_not_a_sif_is_refused_and_so_is_its_pull(
    registry: Registry, tmp_path: Path
) -> None:
    text = tmp_path / "notes.txt"
    text.write_bytes(b"not a SIF at all\n" * 100)
    p = _push(registry, text, tmp_path, "notsif")
    p.stage()
    with pytest.raises(VerificationError, match="not a SIF file"):
        Puller(p.cache).ensure(p.ref, job=JOB)  # refused, then the pull fails the same
    assert not any(os.path.lexists(x) for x in p.staged)


@pytest.fixture
def big(registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path) -> Pushed:
    return _push(registry, make_sif({"blob": os.urandom(48 << 20).hex()}), tmp_path, "big")


def test_a_copy_that_changes_while_it_is_checked_is_refused(big: Pushed) -> None:
    """A writer that opened it before the node took it writes its own first byte
    back, over and over: the bytes stay right, the mtime moves."""
    big.stage()
    stop = threading.Event()
    fd = os.open(big.staged[1], os.O_RDWR)
    first = os.pread(fd, 1, 0)

    def rewrite() -> None:
        while not stop.is_set():
            os.pwrite(fd, first, 0)

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    try:
        refused = _refused_then_pulled(big)
    finally:
        stop.set()
        writer.join(timeout=30)
        os.close(fd)
    assert refused == "staged copy refused: SIF: changed while it was checked"


def test_a_node_that_holds_the_image_discards_the_staged_copy(pushed: Pushed) -> None:
    Puller(pushed.cache).ensure(pushed.ref)  # cached before
    pushed.stage()
    got = Puller(pushed.cache, client_factory=_no_registry).ensure(pushed.ref, job=JOB)
    assert got.hit and got.source is None
    assert not any(p.exists() for p in pushed.staged)


def test_without_a_staged_copy_nothing_changes(pushed: Pushed) -> None:
    with pytest.raises(AssertionError, match="was asked"):
        Puller(pushed.cache, client_factory=_no_registry).ensure(pushed.ref, job=JOB)
    got = Puller(pushed.cache).ensure(pushed.ref, job=JOB)
    assert (got.source, got.refused) == (pushed.ref.registry, None)


def test_staged_is_roots_sticky_and_leftovers_are_prune_s(pushed: Pushed) -> None:
    staged = layout.cache_staged_dir(pushed.cache.root)
    staged.parent.mkdir(parents=True, exist_ok=True)
    staged.mkdir(mode=0o777)
    os.chown(staged, NOBODY, NOBODY)  # as an older version or a mistake left it
    pushed.cache.make_dirs()
    st = staged.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, layout.STAGED_MODE)
    pushed.stage()
    assert set(pushed.staged) <= set(layout.cache_leftovers(pushed.cache.root))


def test_cache_ls_v_shows_an_adopted_entrys_source(pushed: Pushed, tmp_path: Path) -> None:
    import subprocess
    import sys

    pushed.stage()
    Puller(pushed.cache, client_factory=_no_registry).ensure(pushed.ref, job=JOB)
    r = subprocess.run(
        [sys.executable, "-m", "tfimage.main", "--config", str(tmp_path / "config.yaml"),
         "cache", "ls", "-v"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    head, row = r.stdout.splitlines()
    assert head.split()[7:9] == ["SOURCE", "ORIGIN"]  # after LAST USED and HELD BY
    assert row.split()[6:8] == ["staged", pushed.ref.name]


def test_the_prolog_says_it_adopted_and_the_usage_record_says_staged(
    pushed: Pushed, tmp_path: Path
) -> None:
    import json

    from tfimage.epilog.main import main as epilog
    from tfimage.prolog.main import main as prolog

    cfg = tmp_path / "config.yaml"
    cfg.write_text(cfg.read_text() + f"hook_log: {tmp_path / 'hooks.log'}\n")
    pushed.stage()
    assert prolog([f"--config={cfg}", f"--job={JOB}", f"--image={pushed.ref}"]) == 0
    log = (tmp_path / "hooks.log").read_text()
    assert f"job {JOB}: {pushed.ref} adopted the copy staged for the job in " in log, log
    assert epilog([f"--config={cfg}", f"--job={JOB}", f"--image={pushed.ref}"]) == 0
    (rec,) = [json.loads(line) for line in (tmp_path / "usage.jsonl").read_text().splitlines()]
    assert (rec["cache"], rec["pull_bytes"], rec["source"]) == ("staged", 0, "staged")


def test_the_epilog_removes_what_was_staged_for_a_job_that_never_started(
    pushed: Pushed, tmp_path: Path
) -> None:
    from tfimage.epilog.main import main as epilog

    pushed.stage()
    other = layout.cache_staged(pushed.cache.root, pushed.ref.digest or "", "99")
    other[0].write_bytes(b"another job's")
    assert epilog([f"--config={tmp_path / 'config.yaml'}", f"--job={JOB}"]) == 0
    assert not any(p.exists() for p in pushed.staged)
    assert other[0].exists()  # another job's is its own epilog's

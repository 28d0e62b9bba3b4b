"""The controller's one pull per multi-node job (stage/job.py), against the real
registry, with the broadcast given as sbcast's stand-in: it reads the image through
the descriptor root opened, as sbcast does, and writes it into each node's staged/
as the job's user, as slurmd does.  Then each node's own pull takes the copy."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from support import Registry
from tfimage.agent.cache import staged
from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core import layout
from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.errors import RuntimeSetupError
from tfimage.agent.stage import sbcast
from tfimage.agent.stage.job import stage
from tfimage.agent.stage.ledger import Ledger

NODES = ("n1", "n2", "n3", "n4")
OWNER = (4321, 4321)  # the job's user, as Slurm gives it
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root stages, as slurmctld's hook")


class Tree:
    """sbcast's stand-in: what it was asked, and the bytes where slurmd writes them."""

    def __init__(self, tmp_path: Path, cfg: Config, fail: str | None = None) -> None:
        self.tmp_path, self.cfg, self.fail = tmp_path, cfg, fail
        self.calls: list[list[str]] = []

    def node_cfg(self, node: str) -> Config:
        return dataclasses.replace(self.cfg, cache_dir=str(self.tmp_path / node))

    def __call__(self, cmd: list[str], fd: int, timeout: float, owner: tuple[int, int]) -> None:
        assert owner == OWNER  # sbcast runs as the job's owner, as Slurm said
        assert cmd[-2] == f"/dev/fd/{fd}"  # the image through root's descriptor, no path
        self.calls.append(cmd)
        if self.fail:
            raise RuntimeSetupError(f"stage: sbcast: {self.fail}")
        data = os.pread(fd, 1 << 30, 0)
        listed = [a.removeprefix("--nodelist=") for a in cmd if a.startswith("--nodelist=")]
        for node in listed[0].split(",") if listed else NODES:
            out = Path(self.node_cfg(node).cache_dir) / Path(cmd[-1]).relative_to(
                self.cfg.cache_dir
            )
            ImageCache(self.node_cfg(node)).make_dirs()  # staged/, root's 1733
            out.write_bytes(data)
            os.chown(out, *owner)
            out.chmod(0o444)


@pytest.fixture
def site(registry: Registry, tmp_path: Path) -> Config:
    return load_config(registry.write_site(tmp_path, stage_dir=str(tmp_path / "stage")))


def _push(registry: Registry, make_sif: Callable[[dict[str, str]], Path], name: str) -> str:
    sif = make_sif({f"etc/{name}": name})
    return registry.client().push_sif(f"library/{name}", "1", sif)


def test_a_four_node_job_is_pulled_once_and_each_node_adopts_the_checked_copy(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], site: Config, tmp_path: Path
) -> None:
    digest = _push(registry, make_sif, "stfour")
    image = f"stfour@{digest}"
    tree = Tree(tmp_path, site)
    out = stage(site, "7", image, "n[1-4]", OWNER, broadcast=tree, generation=lambda: (22, 5))
    assert (out.failed, out.skipped, out.pulled, out.sent) == (None, None, True, NODES)
    manifest_cmd, sif_cmd = tree.calls
    staged_on_node = layout.cache_staged(site.cache_dir, digest, "7")
    assert manifest_cmd[:3] == sif_cmd[:3] == ["sbcast", "--jobid=7", "--force"]
    assert (manifest_cmd[-1], sif_cmd[-1]) == tuple(str(p) for p in staged_on_node)
    for node in NODES:
        got = Puller(ImageCache(tree.node_cfg(node))).ensure(
            site.reference(image), job="7", uid=OWNER[0]
        )
        assert (got.source, got.refused) == (staged.SOURCE, None), node
    # Staging keeps it for the next job, and no longer holds it for this one.
    [entry] = ImageCache(site.staging()).entries()
    assert entry.digest == digest and entry.holders == ()
    assert os.stat(site.stage_dir).st_mode & 0o777 == 0o700
    assert set(Ledger(site.stage_dir).sent(digest)) == set(NODES)


def test_a_job_on_nodes_that_were_just_sent_the_image_pulls_and_sends_nothing(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], site: Config, tmp_path: Path
) -> None:
    digest = _push(registry, make_sif, "stheld")
    tree = Tree(tmp_path, site)
    stage(site, "8", f"stheld@{digest}", "n[1-4]", OWNER, broadcast=tree, generation=lambda: None)
    again = stage(site, "9", f"stheld@{digest}", "n[1-4]", OWNER, broadcast=tree)
    assert (again.skipped, again.held) == (f"all 4 nodes hold {digest[:19]}", True)
    assert len(tree.calls) == 2  # the first job's manifest and SIF, nothing since


def test_on_24_11_only_the_nodes_that_lack_it_are_sent_it(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], site: Config, tmp_path: Path
) -> None:
    digest = _push(registry, make_sif, "stsome")
    tree = Tree(tmp_path, site)
    image = f"stsome@{digest}"
    stage(site, "10", image, "n[1-2]", OWNER, broadcast=tree, generation=lambda: (24, 11))
    out = stage(site, "11", image, "n[1-4]", OWNER, broadcast=tree, generation=lambda: (24, 11))
    assert (out.sent, out.pulled) == (("n3", "n4"), False)
    assert "--nodelist=n3,n4" in tree.calls[-1]
    # 22.05 cannot name nodes: every node of the job gets it (those holding it drop it).
    out = stage(site, "12", image, "n[1-5]", OWNER, broadcast=tree, generation=lambda: (22, 5))
    assert out.sent == (*NODES, "n5")
    assert not any(a.startswith("--nodelist") for a in tree.calls[-1])


def test_a_refused_broadcast_says_why_and_records_no_node(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], site: Config, tmp_path: Path
) -> None:
    digest = _push(registry, make_sif, "strefused")
    tree = Tree(tmp_path, site, fail="Job 13 not found")
    out = stage(
        site, "13", f"strefused@{digest}", "n[1-4]", OWNER, broadcast=tree, generation=lambda: None
    )
    assert out.failed == "stage: sbcast: Job 13 not found"
    assert out.line("13", "x") == (
        "job 13: stage: sbcast: Job 13 not found; each node without a good copy pulls x itself"
    )
    assert Ledger(site.stage_dir).sent(digest) == {}
    assert ImageCache(site.staging()).read_entry(digest).holders == ()


def test_an_unreachable_registry_falls_back_without_raising(site: Config, tmp_path: Path) -> None:
    cfg = dataclasses.replace(site, registry="127.0.0.1:9", connect_timeout=0.5)
    tree = Tree(tmp_path, cfg)
    out = stage(
        cfg, "14", f"x@sha256:{'1' * 64}", "n[1-2]", OWNER, broadcast=tree, generation=lambda: None
    )
    assert out.failed and "127.0.0.1:9" in out.failed and not tree.calls


def test_a_stage_past_its_deadline_gives_up_and_says_which_setting(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], site: Config, tmp_path: Path
) -> None:
    import time

    digest = _push(registry, make_sif, "stslow")
    cfg = dataclasses.replace(site, stage_deadline=0.5)

    def slow(cmd: list[str], fd: int, timeout: float, owner: tuple[int, int]) -> None:
        time.sleep(5)

    out = stage(cfg, "17", f"stslow@{digest}", "n[1-2]", OWNER, broadcast=slow,
                generation=lambda: None)  # fmt: skip
    assert out.failed == "stage: gave up after 0 s (stage_deadline)"
    assert ImageCache(site.staging()).read_entry(digest).holders == ()


def test_a_user_the_access_rules_refuse_is_sent_nothing(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    """sbcast writes the file as the job's user: sending a private image to a user who
    may not run it would hand them its bytes, whatever the node decides later."""
    digest = _push(registry, make_sif, "stprivate")
    cfg = load_config(
        registry.write_site(
            tmp_path, stage_dir=str(tmp_path / "stage"), access='{"library/stprivate": ["root"]}'
        )
    )
    tree = Tree(tmp_path, cfg)
    nobody = (65534, 65534)  # a real user the rule does not name
    out = stage(cfg, "18", f"stprivate@{digest}", "n[1-2]", nobody, broadcast=tree)
    assert "not staged" in (out.skipped or "") and "stprivate" in (out.skipped or "")
    assert not tree.calls and not Path(cfg.stage_dir).exists()


def test_an_image_the_jobs_partition_refuses_is_neither_pulled_nor_sent(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    """Each node's prolog tells the job why; the controller only keeps its bytes home:
    by name before anything, by the manifest's size before the download."""
    digest = _push(registry, make_sif, "stpolicy")
    rules = '{"prod": {"require_digest": true, "max_image_bytes": 4096}}'
    cfg = load_config(
        registry.write_site(tmp_path, stage_dir=str(tmp_path / "stage"), partitions=rules)
    )
    tree = Tree(tmp_path, cfg)
    image = f"stpolicy:1@{digest}"
    out = stage(
        cfg, "19", image, "n[1-2]", OWNER, broadcast=tree, partition="prod", asked="stpolicy:1"
    )
    assert (out.skipped or "").startswith("not staged: partition prod requires a digest"), out
    assert not tree.calls and not Path(cfg.stage_dir).exists()
    out = stage(cfg, "20", image, "n[1-2]", OWNER, broadcast=tree, partition="prod", asked=image)
    assert (out.skipped or "").startswith(
        "not staged: partition prod runs images of at most 4.0 KiB"
    )
    assert not tree.calls and not list(layout.cache_images(cfg.stage_dir).glob("*.sif"))
    out = stage(cfg, "21", image, "n[1-2]", OWNER, broadcast=tree, partition="dev", asked=image,
                generation=lambda: None)  # fmt: skip
    assert out.sent == ("n1", "n2") and not out.failed, out  # another partition: staged


@pytest.mark.parametrize(
    ("image", "nodes", "skipped"),
    [
        ("tiny:1.0", "n[1-2]", "not pinned at submit; each node pulls for itself"),
        (f"tiny@sha256:{'2' * 64}", "n1", "one node: it pulls for itself"),
        (f"docker://ubuntu@sha256:{'3' * 64}", "n[1-2]", "an OCI image"),
        ("Bad Name!", "n[1-2]", "not staged"),
        (f"tiny@sha256:{'4' * 64}", "n[1-99999999]", "not staged"),
    ],
    ids=["a-tag", "one-node", "docker", "bad-reference", "a-huge-hostlist"],
)
def test_what_is_not_staged_keeps_the_nodes_own_path(
    site: Config, tmp_path: Path, image: str, nodes: str, skipped: str
) -> None:
    cfg = dataclasses.replace(site, dockerhub_project="dockerhub")
    tree = Tree(tmp_path, cfg)
    out = stage(cfg, "15", image, nodes, OWNER, broadcast=tree, generation=lambda: None)
    assert skipped in (out.skipped or ""), out
    assert not tree.calls and not Path(site.stage_dir).exists()


def test_a_job_id_that_is_no_job_id_is_refused_before_any_path(
    site: Config, tmp_path: Path
) -> None:
    out = stage(
        site, "../1", f"t@sha256:{'6' * 64}", "n[1-2]", OWNER, broadcast=Tree(tmp_path, site)
    )
    assert out.skipped == "no valid job id"


def test_the_ledger_forgets_a_node_after_the_caches_minimum_age(tmp_path: Path) -> None:
    ledger, digest = Ledger(tmp_path), "sha256:" + "7" * 64
    ledger.record(digest, ["n1", "n2"], now=1000.0)
    assert ledger.lacking(digest, ["n1", "n2", "n3"], now=1500.0, fresh=3600) == ["n3"]
    assert ledger.lacking(digest, ["n1", "n2", "n3"], now=5000.0, fresh=3600) == ["n1", "n2", "n3"]
    assert ledger.lacking(digest, ["n1"], now=900.0, fresh=3600) == ["n1"]  # a clock set back
    layout.stage_sent(tmp_path, digest).write_text("[not, a, ledger")
    assert ledger.sent(digest) == {}


@pytest.mark.parametrize(
    ("text", "gen"),
    [("slurm-wlm 22.05.8\n", (22, 5)), ("slurm 24.11.5\n", (24, 11)), ("what?\n", None)],
)
def test_sbcast_s_generation_is_read_from_its_version(
    tmp_path: Path, text: str, gen: tuple[int, int] | None
) -> None:
    fake = tmp_path / "sbcast"
    fake.write_text(f"#!/bin/sh\nprintf '{text}'\n")
    fake.chmod(0o755)
    assert sbcast.version(str(tmp_path)) == gen
    assert sbcast.reaches_some(gen) == (gen == (24, 11))


def test_an_sbcast_that_cannot_say_its_version_gets_the_form_every_generation_knows(
    tmp_path: Path,
) -> None:
    fake = tmp_path / "sbcast"
    fake.write_text(
        "#!/bin/sh\necho 'sbcast: fatal: Could not establish a configuration source' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    assert sbcast.version(str(tmp_path)) is None


def test_the_broadcast_runs_as_the_job_user_with_only_roots_descriptor(tmp_path: Path) -> None:
    """A stand-in sbcast records who ran it and reads the image through /dev/fd/N from
    a directory the user could never enter (pytest's, root's 0700)."""
    import shutil
    import tempfile

    image = tmp_path / "image.sif"
    image.write_bytes(b"SIF bytes")
    image.chmod(0o444)
    bin_dir = Path(tempfile.mkdtemp(prefix="tfimage-sbcast-", dir="/tmp"))
    try:
        bin_dir.chmod(0o777)  # the user runs the stand-in and leaves what it saw here
        fake = bin_dir / "sbcast"
        seen = f'id -u >{bin_dir}/uid; id -G >{bin_dir}/groups; cat "$3" >{bin_dir}/data'
        fake.write_text(f"#!/bin/sh\n{seen}\n")
        fake.chmod(0o755)
        fd = os.open(image, os.O_RDONLY)
        try:
            sbcast.broadcast(sbcast.argv("5", fd, "/dst", slurm_bin=str(bin_dir)), fd, 10, OWNER)
        finally:
            os.close(fd)
        assert (bin_dir / "uid").read_text().split() == [str(OWNER[0])]
        assert (bin_dir / "groups").read_text().split() == [str(OWNER[1])]
        assert (bin_dir / "data").read_bytes() == b"SIF bytes"
        with pytest.raises(RuntimeSetupError, match="Permission denied"):
            cmd = sbcast.argv("5", 99, "/dst", slurm_bin=str(bin_dir))
            cmd[-2] = str(image)  # by its path, the user is refused
            fake.write_text('#!/bin/sh\ncat "$3" >/dev/null\n')
            sbcast.run(cmd, timeout=10, what="stage: sbcast", as_user=OWNER)
    finally:
        shutil.rmtree(bin_dir)

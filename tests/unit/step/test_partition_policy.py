"""partitions: enforced by the prolog against a real registry and a real node cache:
the rule of the job's partition refuses by name before anything is pulled, by size
and conversion once the image is cached, and the refusal is what the job's steps
are told; a partition without a rule runs the same job."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import Registry, push_oci_image
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core import layout
from tfimage.agent.core.config import Config, load_config
from tfimage.agent.core.errors import ImageError, PolicyError
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.registry.credentials import Credential
from tfimage.agent.step import imagemount
from tfimage.agent.step.jobimages import JobImages
from tfimage.agent.step.plan import StepRequest, plan_step, prepare_job

UID = 65534  # nobody: the job's user
RULES = (
    '{"prod": {"repositories": ["library/*", "team-a/*"], "require_digest": true,'
    ' "allow_conversion": false, "max_image_bytes": %d}, "dev*": {}}'
)


@dataclass
class Site:
    cfg: Config
    digest: str  # library/tiny:1.0's
    size: int  # its SIF's bytes


@pytest.fixture
def site(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], root_with_fuse: None
) -> Iterator[Site]:
    d = Path(tempfile.mkdtemp(prefix="tfimage-partition-"))
    up = RegistryClient(
        registry.host, Credential(registry.username, registry.password), ca_bundle=str(registry.ca)
    )
    sif = make_sif({"etc/tfimage-test-image": "tiny\n"})
    digest = up.push_sif("library/tiny", "1.0", sif)
    up.push_sif("team-b/tiny", "1.0", sif)
    size = sif.stat().st_size
    cfg = load_config(registry.write_site(d, partitions=RULES % (1 << 30)))
    yield Site(cfg, digest, size)
    for job in ("1", "2", "3", "4"):
        imagemount.release_job(cfg.state_dir, job)
    imagemount.release_images(cfg.state_dir, lambda digest: False)
    shutil.rmtree(d)


def _cached(cfg: Config) -> list[str]:
    return sorted(p.name for p in layout.cache_images(cfg.cache_dir).glob("*.sif"))


def _prod(site: Site, job: str, image: str, asked: str) -> str:
    with pytest.raises(PolicyError) as e:
        prepare_job(site.cfg, job, image, uid=UID, partition="prod", asked=asked)
    return str(e.value)


def test_a_tag_in_prod_is_refused_before_a_pull_and_its_steps_are_told(site: Site) -> None:
    pinned = f"tiny:1.0@{site.digest}"  # as the plugin pins it at submit
    said = _prod(site, "1", pinned, "tiny:1.0")
    assert said.startswith("partition prod requires a digest: --tf-image=tiny:1.0@sha256:...")
    assert _cached(site.cfg) == []
    key = str(site.cfg.reference(pinned).unpinned)
    assert JobImages(site.cfg, "1").failure(key) == said
    with pytest.raises(ImageError) as e:  # the job's step, on this node
        plan_step(site.cfg, StepRequest("1", "0", UID, pinned))
    assert str(e.value) == f"the prolog could not ready it on this node: {said}"


def test_the_same_job_runs_in_dev_and_with_its_digest_in_prod(site: Site) -> None:
    pinned = f"tiny:1.0@{site.digest}"
    got = prepare_job(site.cfg, "1", pinned, uid=UID, partition="dev-gpu", asked="tiny:1.0")
    assert got.ref.digest == site.digest
    again = prepare_job(site.cfg, "2", pinned, uid=UID, partition="prod", asked=pinned)
    assert again.hit and again.ref.digest == site.digest
    # a partition no key matches runs anything, as before partitions: existed
    prepare_job(site.cfg, "3", pinned, uid=UID, partition="debug", asked="tiny:1.0")


def test_a_repository_prod_does_not_run_is_refused_before_a_pull(site: Site) -> None:
    image = f"team-b/tiny:1.0@{site.digest}"
    assert _prod(site, "1", image, image) == (
        "partition prod runs images of library/*, team-a/* only, not team-b/tiny"
    )
    assert _cached(site.cfg) == []


def test_an_image_over_prods_size_is_never_downloaded_and_a_cached_one_stays_evictable(
    registry: Registry, site: Site
) -> None:
    d = Path(site.cfg.cache_dir).parent
    small = Site(
        load_config(registry.write_site(d, partitions=RULES % (site.size - 1))),
        site.digest,
        site.size,
    )
    pinned = f"tiny:1.0@{site.digest}"
    said = _prod(small, "1", pinned, pinned)
    assert said.startswith("partition prod runs images of at most ") and " is " in said
    assert _cached(small.cfg) == []  # refused by the manifest's size: nothing came
    prepare_job(small.cfg, "2", pinned, uid=UID, partition="dev", asked=pinned)
    assert _prod(small, "3", pinned, pinned) == said  # a cache hit: judged by its file
    entry = ImageCache(small.cfg).read_entry(site.digest)
    assert entry.size == site.size and entry.holders == ("2",)  # never held by job 3


def test_a_docker_name_and_an_oci_image_are_refused_where_conversion_is_off(
    registry: Registry, site: Site, tmp_path: Path
) -> None:
    image = f"docker://tiny:1.0@{site.digest}"
    assert _prod(site, "1", image, image) == (
        f"partition prod runs SIF images only: docker://{registry.host}/library/tiny:1.0"
        " is a docker:// image"
    )
    push_oci_image(registry, tmp_path / "oci", "library/oci")
    got = prepare_job(site.cfg, "2", "oci:1", uid=UID, partition="dev")  # converted here
    pinned = str(got.ref)
    said = _prod(site, "3", pinned, pinned)
    assert said == (
        f"partition prod runs SIF images only: {registry.host}/library/oci:1 is an OCI image"
        " (push it as a SIF)"
    )


def test_a_hostile_asked_text_is_kept_to_one_bounded_line_for_the_jobs_steps(site: Site) -> None:
    """--asked is the job's own text (any user can set a job's SPANK options through
    Slurm's API): a forged log line and 100 kB in it stay one line of the failure the
    steps read, and nothing is pulled."""
    pinned = f"tiny:1.0@{site.digest}"
    hostile = "tiny:1.0\n2026-12-06 00:00:00,000 tfimage-prolog: job 9: fine" + "A" * 100_000
    said = _prod(site, "1", pinned, hostile)
    assert said.startswith("partition prod requires a digest: --tf-image=tiny:1.0\n")
    kept = JobImages(site.cfg, "1").failure(str(site.cfg.reference(pinned).unpinned)) or ""
    assert kept.startswith("partition prod requires a digest: --tf-image=tiny:1.0")
    assert "\n" not in kept and len(kept) <= 500
    assert _cached(site.cfg) == []

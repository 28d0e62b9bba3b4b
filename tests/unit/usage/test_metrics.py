"""The node's metrics: Prometheus's own parser reads what tfimage writes, the values
are the records' sums, and the label set stays bounded whatever jobs submit."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tfimage.agent.usage import metrics

REC = {"repository": "library/tf-custom", "state": "COMPLETED", "wall_seconds": 60.0,
       "cache": "miss", "pull_bytes": 1000, "pull_seconds": 2.5, "image_error": None}  # fmt: skip


def _parsed(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[str, str, str]:
    (tmp_path / "metrics").mkdir()
    images = tmp_path / "cache" / "images"
    images.mkdir(parents=True)
    (images / f"sha256-{'a' * 64}.sif").write_bytes(b"x" * 300)
    (images / f"sha256-{'b' * 64}.sif").write_bytes(b"x" * 700)
    (images / f"sha256-{'b' * 64}.json").write_text("{}")  # metadata is not an image
    return str(tmp_path / "state"), str(tmp_path / "metrics"), str(tmp_path / "cache")


def test_records_add_up_in_metrics_prometheus_parses(dirs: tuple[str, str, str]) -> None:
    state, out, cache = dirs
    metrics.update(state, out, cache, metrics.count_job(REC))
    failed = {**REC, "state": "FAILED", "cache": "hit", "pull_bytes": 0, "pull_seconds": 0.01}
    metrics.update(state, out, cache, metrics.count_job(failed))
    no_image = {**REC, "image_error": "gone", "cache": None, "pull_bytes": 0}
    metrics.update(state, out, cache, metrics.count_job(no_image))
    unknown = {**REC, "state": "UNKNOWN", "cache": "hit", "pull_bytes": 0, "pull_seconds": 0}
    metrics.update(state, out, cache, metrics.count_job(unknown))
    metrics.update(state, out, cache, metrics.add("cache_evictions", 2))
    metrics.update(state, out, cache, metrics.gpu_health({"GPU-1": (0, True), "GPU-2": (1, False)}))
    text = (Path(out) / "tfimage.prom").read_text()
    got = _parsed(text)
    repo = (("repository", "library/tf-custom"),)
    assert got[("tfimage_jobs_total", repo)] == 4
    assert got[("tfimage_job_failures_total", repo)] == 2  # FAILED and no image; not UNKNOWN
    assert got[("tfimage_image_failures_total", repo)] == 1
    assert got[("tfimage_job_duration_seconds_total", repo)] == 240.0
    assert got[("tfimage_pull_bytes_total", repo)] == 1000
    assert got[("tfimage_pull_seconds_total", repo)] == 2.5  # the miss's: a hit is no pull
    assert got[("tfimage_cache_hits_total", repo)] == 2
    assert got[("tfimage_cache_misses_total", repo)] == 1
    assert got[("tfimage_cache_evictions_total", ())] == 2
    assert got[("tfimage_gpu_drains_total", ())] == 0
    assert got[("tfimage_cache_size_bytes", ())] == 1000
    assert got[("tfimage_cache_images", ())] == 2
    assert got[("tfimage_gpu_healthy", (("gpu", "0"), ("uuid", "GPU-1")))] == 1
    assert got[("tfimage_gpu_healthy", (("gpu", "1"), ("uuid", "GPU-2")))] == 0
    fams = _families(text)
    for name in metrics.EXPORTED:
        assert name in fams, name
        assert fams[name].documentation, name
    for name in ("tfimage_jobs", "tfimage_cache_evictions"):
        assert fams[name].type == "counter"  # the parser drops the _total of a counter
    assert (Path(out) / "tfimage.prom").stat().st_mode & 0o777 == 0o644
    assert os.listdir(out) == ["tfimage.prom"]  # no temporary file left behind
    counters = Path(state) / "usage" / "counters.json"
    assert counters.stat().st_mode & 0o777 == 0o600
    assert counters.parent.stat().st_mode & 0o777 == 0o700


def test_a_hostile_repository_name_stays_one_escaped_label(dirs: tuple[str, str, str]) -> None:
    state, out, cache = dirs
    evil = 'x"} 1\ntfimage_gpu_drains_total 99\n#'
    metrics.update(state, out, cache, metrics.count_job({**REC, "repository": evil}))
    got = _parsed((Path(out) / "tfimage.prom").read_text())
    assert got[("tfimage_jobs_total", (("repository", evil),))] == 1
    assert got[("tfimage_gpu_drains_total", ())] == 0


def test_a_name_that_never_pulled_gets_no_label_of_its_own(dirs: tuple[str, str, str]) -> None:
    state, out, cache = dirs
    # Anyone may submit made-up names that fail to pull: they must not fill the
    # bounded label set and push real images into "other".
    for i in range(metrics.MAX_REPOSITORIES + 5):
        bogus = {**REC, "repository": f"made/up{i}", "cache": None, "image_error": "not found"}
        metrics.update(state, out, cache, metrics.count_job(bogus))
    metrics.update(state, out, cache, metrics.count_job(REC))
    got = _parsed((Path(out) / "tfimage.prom").read_text())
    jobs = {dict(k[1])["repository"]: v for k, v in got.items() if k[0] == "tfimage_jobs_total"}
    assert jobs == {"other": metrics.MAX_REPOSITORIES + 5, "library/tf-custom": 1}


def test_repositories_beyond_the_bound_are_counted_as_other(dirs: tuple[str, str, str]) -> None:
    state, out, cache = dirs

    def many(counters: dict[str, Any]) -> None:
        for i in range(metrics.MAX_REPOSITORIES + 25):
            metrics.count_job({**REC, "repository": f"u/img{i}"})(counters)

    metrics.update(state, out, cache, many)
    got = _parsed((Path(out) / "tfimage.prom").read_text())
    jobs = {k[1]: v for k, v in got.items() if k[0] == "tfimage_jobs_total"}
    assert len(jobs) == metrics.MAX_REPOSITORIES + 1
    assert jobs[(("repository", "other"),)] == 25
    assert sum(jobs.values()) == metrics.MAX_REPOSITORIES + 25


def test_without_node_exporters_directory_the_counters_are_kept_alone(tmp_path: Path) -> None:
    state, out = str(tmp_path / "state"), str(tmp_path / "absent")
    metrics.update(state, out, str(tmp_path / "cache"), metrics.count_job(REC))
    metrics.update(state, out, str(tmp_path / "cache"), metrics.count_job(REC))
    assert not Path(out).exists()
    doc = json.loads((tmp_path / "state/usage/counters.json").read_text())
    assert doc["images"]["library/tf-custom"]["jobs"] == 2


def test_a_corrupt_counters_file_starts_again_from_zero(dirs: tuple[str, str, str]) -> None:
    state, out, cache = dirs
    metrics.update(state, out, cache, metrics.count_job(REC))
    (Path(state) / "usage/counters.json").write_text("{not json")
    metrics.update(state, out, cache, metrics.count_job(REC))
    got = _parsed((Path(out) / "tfimage.prom").read_text())
    assert got[("tfimage_jobs_total", (("repository", "library/tf-custom"),))] == 1

"""The node's on-disk names, spelled out: ``cache_dir`` survives upgrades and a
running node's ``state_dir`` is read by the next package's hooks, so a name changed
in core/layout.py would strand what is already there.  Each path here is written as
the README and the module's docstring draw it, never computed from layout itself."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tfimage.agent.core import layout

HEX = "ab" * 32
DIGEST = f"sha256:{HEX}"
S, C = "/run/tfimage", "/var/cache/tfimage"


@pytest.mark.parametrize(
    ("got", "want"),
    [
        (layout.daemon_socket(S), f"{S}/daemon.sock"),
        (layout.pin_socket(S), f"{S}/pin.sock"),
        (layout.last_seen(S), f"{S}/last-seen.json"),
        (layout.image_mount(S, DIGEST), f"{S}/images/sha256-{HEX}"),
        (layout.job_images(S, "42"), f"{S}/jobs/42.images.json"),
        (layout.job_lock(S, "42"), f"{S}/jobs/42.lock"),
        (layout.job_image_mount(S, "42", DIGEST), f"{S}/jobs/42/img-{HEX[:12]}"),
        (layout.step_dir(S, "42", "0"), f"{S}/jobs/42/step-0"),
        (layout.job_facts(S, "42"), f"{S}/usage/42.json"),
        (layout.counters(S), f"{S}/usage/counters.json"),
        (layout.xid_cursor(S), f"{S}/gpu/xid-cursor.json"),
        (layout.gpu_baseline(S, "42"), f"{S}/gpu/jobs/42.json"),
        (layout.cache_sif(C, DIGEST), f"{C}/images/sha256-{HEX}.sif"),
        (layout.cache_entry(C, DIGEST), f"{C}/images/sha256-{HEX}.json"),
        (layout.cache_lock(C, f"sha256-{HEX}"), f"{C}/locks/sha256-{HEX}.lock"),
        (layout.cache_partial(C, DIGEST), f"{C}/tmp/sha256-{HEX}.partial"),
        (layout.cache_converted(C, DIGEST), f"{C}/tmp/sha256-{HEX}.converted"),
        (layout.cache_adopting(C, DIGEST), f"{C}/tmp/sha256-{HEX}.adopting"),
        (layout.cache_staged_dir(C), f"{C}/staged"),
        (layout.cache_staged(C, DIGEST, "42")[0], f"{C}/staged/sha256-{HEX}.42.manifest"),
        (layout.cache_staged(C, DIGEST, "42")[1], f"{C}/staged/sha256-{HEX}.42.sif"),
        (layout.cache_convert_work(C, DIGEST), f"{C}/tmp/convert-sha256-{HEX}-"),
        (layout.cache_keep_list(C), f"{C}/keep.json"),
        (
            layout.cache_tag_lock(C, "reg/library/tiny:1.0"),
            f"{C}/locks/tag-{hashlib.sha256(b'reg/library/tiny:1.0').hexdigest()}.lock",
        ),
    ],
)
def test_each_file_keeps_the_name_nodes_already_have(got: Path, want: str) -> None:
    assert got == Path(want)


def test_an_entrys_two_files_name_each_other_and_nothing_else_pairs() -> None:
    sif, meta = Path(f"{C}/images/sha256-{HEX}.sif"), Path(f"{C}/images/sha256-{HEX}.json")
    assert (layout.cache_entry_pair(sif), layout.cache_entry_pair(meta)) == (meta, sif)
    for other in (f"{C}/images/sha256-{HEX}.partial", f"{C}/images/sha256-{HEX}", f"{C}/x.lock"):
        assert layout.cache_entry_pair(Path(other)) is None, other


def test_a_file_names_key_gives_its_digest_and_nothing_else_is_a_key() -> None:
    assert layout.key(DIGEST) == f"sha256-{HEX}"
    for name in (f"sha256-{HEX}", f"sha256-{HEX}.sif", f"sha256-{HEX}.lock"):
        assert layout.digest_of_key(name) == DIGEST, name
    for name in (f"sha256-{HEX.upper()}", f"sha256-{HEX[:-1]}", "sha256-", f"md5-{HEX}"):
        assert layout.digest_of_key(name) is None, name


@pytest.mark.parametrize("job", ["", "../1", "1/2", "4x", "1" * 11])
def test_a_bad_job_id_never_becomes_a_path(job: str) -> None:
    with pytest.raises(ValueError):
        layout.job_images(S, job)

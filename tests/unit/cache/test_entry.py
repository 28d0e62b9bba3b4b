"""A cache entry's metadata (agent/cache/store.py): read strictly, written as before."""

from __future__ import annotations

import json
from pathlib import Path

from tfimage.agent.cache.store import Entry, ImageCache
from tfimage.agent.core import layout
from tfimage.agent.core.config import config_from_mapping

DIGEST = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64


def test_metadata_tfimage_wrote_reads_and_writes_back_the_same() -> None:
    doc = {
        "digest": DIGEST,
        "refs": ["reg:5000/library/x:1"],
        "created": 1.5,
        "last_used": 2.5,
        "size": 4096,
        "kept": True,
        "holders": ["7"],
        "source": "reg:5000",
        "origin": "reg:5000/library/x",
        "blob": "sha256:" + "c" * 64,
    }
    assert Entry.parse(DIGEST, json.loads(json.dumps(doc))).to_json() == doc
    converted = {k: v for k, v in doc.items() if k != "blob"}  # an OCI image has none
    assert Entry.parse(DIGEST, converted).to_json() == converted


def test_hostile_or_old_metadata_is_neither_trusted_nor_fatal() -> None:
    doc = {
        "digest": OTHER,  # the file's name says which image it is, not its content
        "refs": "reg/x:1",
        "holders": ["7", 8, None],
        "size": "4096",
        "last_used": True,
        "created": float("nan"),
        "kept": "yes",
        "source": 5,
        "pinned": True,  # what tfimage wrote before "keep": no longer read
    }
    e = Entry.parse(DIGEST, doc)
    assert (e.digest, e.refs, e.holders, e.size, e.last_used, e.kept, e.source) == (
        DIGEST,
        (),
        ("7",),
        0,
        0.0,
        False,
        None,
    )
    assert "pinned" not in e.to_json()
    assert Entry.parse(DIGEST, ["not", "a", "record"]).holders == ()


def test_entries_are_named_by_their_files(tmp_path: Path) -> None:
    cache = ImageCache(config_from_mapping({"registry": "reg:5000", "cache_dir": str(tmp_path)}))
    cache.make_dirs()
    for digest, doc in ((DIGEST, {"digest": OTHER, "size": 1}), (OTHER, [])):
        layout.cache_entry(tmp_path, digest).write_text(json.dumps(doc))
        layout.cache_sif(tmp_path, digest).write_bytes(b"x")
    (layout.cache_images(tmp_path) / "stray.json").write_text("{}")
    (layout.cache_images(tmp_path) / "stray.sif").write_bytes(b"x")
    assert [(e.digest, e.size) for e in cache.entries()] == [(DIGEST, 1)]  # [] is no metadata

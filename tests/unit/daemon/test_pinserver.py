"""The daemon's pin server for the submit side: its one request shape (agent/core/wire.py,
4), and its answers against a real registry (pinned; input rejected: final; anything
else: the plugin pins by itself)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from support import Registry
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import RequestError
from tfimage.agent.core.wire import SubmitCheck, decode_submit_check
from tfimage.agent.daemon.pinserver import RETRY_YOURSELF, answer
from tfimage.agent.submit.lastseen import PER_UID, LastSeen

GOOD = ["submit-check", "--tf-mount=", "--job-image=", "--", "tiny:1"]


def test_the_one_request_shape_is_accepted() -> None:
    assert decode_submit_check(GOOD) == SubmitCheck(ref="tiny:1", tf_mount="", job_image="")
    req = decode_submit_check(["submit-check", "--tf-mount=/home/a:/a", "--job-image=x", "--", "r"])
    assert (req.tf_mount, req.job_image, req.ref) == ("/home/a:/a", "x", "r")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--config", "/etc/shadow", *GOOD],  # no path from the peer, ever
        ["--config=/etc/shadow", *GOOD],
        [*GOOD, "--offline"],
        ["resolve", *GOOD[1:]],
        ["step-prepare", *GOOD[1:]],
        ["submit-check", "--job-image=", "--tf-mount=", "--", "tiny:1"],
        ["submit-check", "--tf-mount=", "--job-image=", "x", "tiny:1"],
        ["submit-check", "--tf-mount", "", "--job-image", "", "--", "tiny:1"],
        [*GOOD[:-1], ""],
        [*GOOD[:-1], "a" * 5000],
        ["submit-check", "--tf-mount=a\0b", "--job-image=", "--", "tiny:1"],
    ],
)
def test_anything_else_is_refused(argv: list[str]) -> None:
    with pytest.raises(RequestError, match="malformed request"):
        decode_submit_check(argv)


def test_answers_against_a_real_registry(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    up = registry.client()
    digest = up.push_sif("library/resolveme", "1", make_sif({"r": "1"}))
    cfg = load_config(registry.write_site(tmp_path))
    (tmp_path / "state").mkdir()

    status, out, err = answer(cfg, SubmitCheck("resolveme:1", "", ""), 1000)
    assert (status, err) == (0, "")
    assert out == f"{registry.host}/library/resolveme:1@{digest}\n"
    # What this host saw is kept in its state dir (not root's home), for a registry outage.
    assert digest in (tmp_path / "state" / "last-seen.json").read_text()

    status, out, err = answer(cfg, SubmitCheck("Bad Name:1", "", ""), 1000)
    assert status == 2 and out == "" and err.startswith("tfimage: ") and err.count("\n") == 1
    status, _, err = answer(cfg, SubmitCheck("resolveme:1", "/etc:/x", ""), 1000)
    assert status == 2 and "--tf-mount" in err

    # Not there for this host: the plugin asks again as the user (who may see more).
    status, out, err = answer(cfg, SubmitCheck("nosuchimage:1", "", ""), 1000)
    assert status == RETRY_YOURSELF and out == "" and "nosuchimage" in err


def test_registry_down_uses_what_this_host_saw(registry: Registry, tmp_path: Path) -> None:
    site = registry.write_site(tmp_path)
    # The same site with its registry gone: nothing listens on port 1.
    dead = tmp_path / "dead.yaml"
    dead.write_text(site.read_text().replace(registry.host, "127.0.0.1:1"))
    cfg = load_config(dead)
    (tmp_path / "state").mkdir()
    status, _, err = answer(cfg, SubmitCheck("seen:1", "", ""), 1000)
    assert status == RETRY_YOURSELF and "never seen that tag" in err
    digest = "sha256:" + "c" * 64
    # Another user pinned it while the registry was up: a digest is the registry's
    # answer, as good for this user as for that one.
    LastSeen(tmp_path / "state" / "last-seen.json").remember(
        "127.0.0.1:1/library/seen:1", digest, 1001
    )
    status, out, err = answer(cfg, SubmitCheck("seen:1", "", ""), 1000)
    assert status == 0 and out.strip().endswith("@" + digest)
    assert "warning" in err and "last digest this host saw" in err


def test_one_user_pinning_a_thousand_tags_pushes_out_only_their_own(tmp_path: Path) -> None:
    seen = LastSeen(tmp_path / "last-seen.json")
    theirs = "sha256:" + "a" * 64
    seen.remember("reg/library/shared:1", theirs, 1002)
    for i in range(1000):
        seen.remember(f"reg/library/flood:{i}", "sha256:" + f"{i:064x}", 1001)
    assert seen.recall("reg/library/shared:1", 1002) == theirs  # still there
    assert seen.recall("reg/library/shared:1", 1001) == theirs  # and for anyone
    assert seen.recall("reg/library/flood:999", 1001) == "sha256:" + f"{999:064x}"
    assert seen.recall("reg/library/flood:0", 1001) is None  # the flooder's oldest went
    kept = [i for i in range(1000) if seen.recall(f"reg/library/flood:{i}", 1001)]
    assert kept == list(range(1000 - PER_UID, 1000))


def test_a_users_own_last_seen_digest_wins_over_anothers(tmp_path: Path) -> None:
    seen = LastSeen(tmp_path / "last-seen.json")
    mine, newer = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    seen.remember("reg/library/x:1", mine, 1001)
    seen.remember("reg/library/x:1", newer, 1002)
    assert seen.recall("reg/library/x:1", 1001) == mine
    assert seen.recall("reg/library/x:1", 1003) == newer  # the newest anyone saw

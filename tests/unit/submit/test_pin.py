"""Pinning at submit against a real registry, and the fallback when it is down."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hostile import Server

from support import Registry
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import ImageNotFound, RegistryError
from tfimage.agent.core.reference import Reference
from tfimage.agent.registry.client import RegistryClient
from tfimage.agent.submit.pin import pin
from tfimage.agent.submit.suggest import message


def down(host: str) -> RegistryClient:
    # Nothing listens on port 1: connection refused at once, one attempt.
    return RegistryClient("127.0.0.1:1", attempts=1, connect_timeout=1)


def test_pin_then_fall_back_to_last_seen(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    up = registry.client()
    digest = up.push_sif("library/pinme", "1", make_sif({"m": "1"}))
    cfg = load_config(registry.write_site(tmp_path))
    store = tmp_path / "last-seen.json"
    ref = cfg.reference("pinme:1")

    pinned, warning = pin(cfg, ref, lambda h: up, store)
    assert (pinned.digest, pinned.tag, warning) == (digest, "1", None)

    again, warning = pin(cfg, ref, down, store)
    assert again == pinned
    assert warning and "last digest this host saw" in warning and digest in warning

    with pytest.raises(RegistryError, match="never seen that tag"):
        pin(cfg, cfg.reference("other:1"), down, store)


def test_inner_srun_keeps_the_jobs_digest(tmp_path: Path) -> None:
    cfg = load_config(_cfg(tmp_path))
    job = "reg.site/library/tiny:1@sha256:" + "a" * 64
    pinned, _ = pin(cfg, cfg.reference("tiny:1"), down, tmp_path / "s.json", job_image=job)
    assert str(pinned) == job  # no registry asked (it is down), the job's bytes kept
    with pytest.raises(RegistryError):  # another tag is pinned afresh
        pin(cfg, cfg.reference("tiny:2"), down, tmp_path / "s.json", job_image=job)


def test_already_pinned_needs_no_registry(tmp_path: Path) -> None:
    cfg = load_config(_cfg(tmp_path))
    ref = cfg.reference("tiny@sha256:" + "b" * 64)
    assert pin(cfg, ref, down, tmp_path / "s.json") == (ref, None)


def _cfg(tmp_path: Path) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text("registry: reg.site\n")
    return p


# --- "did you mean" -----------------------------------------------------------------------------


@pytest.fixture
def tagged(registry: Registry, make_sif: Callable[[dict[str, str]], Path]) -> RegistryClient:
    up = registry.client()
    sif = make_sif({"m": "tags"})
    for tag in ("2.0", "2.0-gpu", "1.15", "latest", "nightly-20261201"):
        up.push_sif("library/didyou", tag, sif)
    return up


def test_a_tag_typo_is_answered_with_the_closest_tags(
    registry: Registry, tagged: RegistryClient, tmp_path: Path
) -> None:
    cfg = load_config(registry.write_site(tmp_path))
    with pytest.raises(ImageNotFound) as e:
        pin(cfg, cfg.reference("didyou:2.1"), lambda h: tagged, tmp_path / "s.json")
    said = str(e.value)
    assert said.startswith(f"{registry.host}/library/didyou:2.1: no such tag; did you mean ")
    near = said.split("did you mean ")[1].rstrip("?").replace(" or ", ", ").split(", ")
    assert near[0] == "didyou:2.0" and set(near) <= {"didyou:2.0", "didyou:2.0-gpu", "didyou:1.15"}
    assert "\n" not in said


def test_a_repository_that_is_not_there_is_said_so(
    registry: Registry, tagged: RegistryClient, tmp_path: Path
) -> None:
    cfg = load_config(registry.write_site(tmp_path))
    with pytest.raises(ImageNotFound) as e:
        pin(cfg, cfg.reference("didyuo:2.0"), lambda h: tagged, tmp_path / "s.json")
    assert str(e.value) == (
        f"{registry.host}/library/didyuo: no such repository, or not readable with the "
        "credentials used"
    )


def test_the_whole_tag_list_comes_from_a_real_registry(tagged: RegistryClient) -> None:
    every = tagged.tags("library/didyou")
    assert sorted(every) == ["1.15", "2.0", "2.0-gpu", "latest", "nightly-20261201"]
    with pytest.raises(ImageNotFound, match="no such repository"):
        tagged.tags("library/didyuo")


def _next(repo: str, last: str, host: str = "") -> str:
    return f'<{host}/v2/{repo}/tags/list?n=2&last={last}>; rel="next"'


def test_a_tag_list_is_followed_page_by_page_on_its_own_registry_and_no_further(
    tls: Path,
) -> None:
    # Debian's registry sends all tags at once; the pages (Link: rel="next", as
    # distribution and Harbor send them) come from the hostile registry.
    s = Server(tls)
    try:
        client = RegistryClient(s.host, ca_bundle=str(tls / "ca.crt"), attempts=1)
        s.b.tag_pages = [(["a", "b"], _next("x/y", "b")), (["c", "d"], _next("x/y", "d")),
                         (["e"], None)]  # fmt: skip
        assert client.tags("x/y") == ["a", "b", "c", "d", "e"]
        # A page that points elsewhere ends the list: another host, another repository.
        for link in (_next("x/y", "b", "https://evil.example"), _next("x/z", "b")):
            s.b.seen.clear()
            s.b.tag_pages = [(["a", "b"], link), (["c"], None)]
            assert client.tags("x/y") == ["a", "b"], link
        # What reaches the user's terminal is a real tag, nothing else.
        s.b.seen.clear()
        s.b.tag_pages = [(["ok", "bad\x1b[2J", "x" * 200, 7, "v1.0"], None)]  # type: ignore[list-item]
        assert client.tags("x/y") == ["ok", "v1.0"]
        # A registry that never stops: five requests, then what they gave.
        s.b.seen.clear()
        s.b.tag_pages = [([f"t{i}"], _next("x/y", f"t{i}")) for i in range(50)]
        assert client.tags("x/y") == ["t0", "t1", "t2", "t3", "t4"]
        assert sum(1 for path, _ in s.b.seen if "/tags/list" in path) == 5
    finally:
        s.httpd.shutdown()


@pytest.mark.parametrize(
    ("tags", "said"),
    [
        (["1.0", "2.0"], "r.site/library/x:9.9.9-rc: no such tag; it has 2: 1.0, 2.0"),
        ([f"v{i}" for i in range(9)], "no such tag; it has 9: v0, v1, v2, v3, v4, ..."),
        ([], "r.site/library/x:9.9.9-rc: no such tag; the repository has no tags"),
        (["9.9.9-rc"], "r.site/library/x:9.9.9-rc: not found"),  # it came meanwhile
    ],
)
def test_when_no_tag_is_close_the_user_sees_some_of_them(tags: list[str], said: str) -> None:
    assert said in message(Reference("r.site", "library/x", "9.9.9-rc"), tags)

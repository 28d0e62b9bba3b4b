"""Harbor's auth flow against a real registry: Bearer challenges, tokens fetched with
GET from the realm with the robot account's credentials, one token per repository,
a fresh one when the registry refuses an expired one.  The registry (Debian's
docker-registry with ``auth: token``) verifies each JWT itself; tokenauth.py issues
them (see conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from support import Registry
from tfimage.agent.cache.pull import Puller
from tfimage.agent.cache.store import ImageCache
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import RegistryError
from tfimage.agent.registry.transport import RequestsTransport, StdlibTransport, Transport
from tokenauth import TokenService


@pytest.fixture(params=[StdlibTransport, RequestsTransport], ids=["stdlib", "requests"])
def transport(request: pytest.FixtureRequest) -> type[Transport]:
    return request.param  # type: ignore[no-any-return]


def asked(tokens: TokenService, since: int) -> list[str]:
    return tokens.scopes[since:]


def test_push_then_pull_through_the_cache(
    token_registry: Registry,
    token_service: TokenService,
    make_sif: Callable[[dict[str, str]], Path],
    tmp_path: Path,
    transport: type[Transport],
) -> None:
    repo = f"library/tok-{transport.__name__.lower()}"
    sif = make_sif({"etc/tfimage-test-image": "behind tokens\n"})
    before = len(token_service.scopes)
    digest = token_registry.client(transport=transport()).push_sif(repo, "1", sif)
    assert any(
        s.startswith(f"repository:{repo}:") and "push" in s for s in asked(token_service, before)
    )
    cfg = load_config(
        token_registry.write_site(tmp_path, pull_connections="3", pull_stripe_bytes="65536")
    )
    before = len(token_service.scopes)
    got = Puller(ImageCache(cfg)).ensure(cfg.reference(f"{repo.removeprefix('library/')}:1"))
    assert got.ref.digest == digest and not got.hit
    assert got.path.read_bytes() == sif.read_bytes()
    # The manifest, then each stripe connection with a token of its own, all for
    # pulling this repository.
    scopes = asked(token_service, before)
    assert scopes and set(scopes) == {f"repository:{repo}:pull"}, scopes


def test_one_token_per_repository_reused_until_refused(
    token_registry: Registry,
    token_service: TokenService,
    make_sif: Callable[[dict[str, str]], Path],
    transport: type[Transport],
) -> None:
    up = token_registry.client(transport=RequestsTransport())
    for name in ("tok-a", "tok-b"):
        up.push_sif(f"library/{name}", "1", make_sif({"f": name}))
    c = token_registry.client(transport=transport())
    before = len(token_service.scopes)
    for name in ("tok-a", "tok-b", "tok-a", "tok-b"):
        assert c.manifest(f"library/{name}", "1").body["layers"]
    assert asked(token_service, before) == [
        "repository:library/tok-a:pull",
        "repository:library/tok-b:pull",
    ]


def test_an_expired_token_is_fetched_again(
    token_registry: Registry,
    token_service: TokenService,
    make_sif: Callable[[dict[str, str]], Path],
    transport: type[Transport],
) -> None:
    token_registry.client(transport=RequestsTransport()).push_sif(
        "library/tok-exp", "1", make_sif({"f": "exp"})
    )
    c = token_registry.client(transport=transport())
    before = len(token_service.scopes)
    token_service.short_lived = 1  # the next token expires in 5 s (LEEWAY included)
    assert c.manifest("library/tok-exp", "1")
    time.sleep(6)
    # The registry refuses the token now: one more is fetched, and the request succeeds.
    assert c.manifest("library/tok-exp", "1")
    assert asked(token_service, before) == ["repository:library/tok-exp:pull"] * 2


def test_wrong_password_fails_fast_at_the_token_service(
    token_registry: Registry, token_service: TokenService, transport: type[Transport]
) -> None:
    refused = token_service.refused
    t = time.monotonic()
    with pytest.raises(RegistryError, match=r"token service refused \(401\)"):
        token_registry.client(password="wrong", transport=transport()).manifest(
            "library/tok-a", "1"
        )
    assert time.monotonic() - t < 2.0
    assert token_service.refused == refused + 1


def test_a_project_robot_gets_nothing_elsewhere(
    token_registry: Registry, token_service: TokenService, transport: type[Transport]
) -> None:
    """A robot of project ``library`` asking for another project's image: the token
    grants nothing, the registry refuses it, and the error says so in one line."""
    with pytest.raises(RegistryError, match="authentication refused for repository:other/x:pull"):
        token_registry.client(transport=transport()).manifest("other/x", "1")

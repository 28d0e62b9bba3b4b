from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tfimage.agent.errors import ImageReferenceError
from tfimage.agent.reference import Reference, check_allowed, parse_reference

REG, PROJ = "harbor.example", "library"
D = "sha256:" + "ab" * 32


def p(text: str) -> Reference:
    return parse_reference(text, REG, PROJ)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("tf-custom:2.0", "harbor.example/library/tf-custom:2.0"),
        ("tf-custom", "harbor.example/library/tf-custom:latest"),
        ("ml/tf-custom:2.0", "harbor.example/ml/tf-custom:2.0"),
        ("reg.site:5000/a/b/c:v1", "reg.site:5000/a/b/c:v1"),
        ("localhost/x:1", "localhost/x:1"),
        ("127.0.0.1:5443/library/tiny:1.0", "127.0.0.1:5443/library/tiny:1.0"),
        (f"tiny@{D}", f"harbor.example/library/tiny@{D}"),
        (f"tiny:1.0@{D}", f"harbor.example/library/tiny:1.0@{D}"),
        ("oras://tiny:1.0", "oras://harbor.example/library/tiny:1.0"),
        ("docker://reg.site/lib/py:3.11", "docker://reg.site/lib/py:3.11"),
        ("a__b.c-d:T_a.g-1", "harbor.example/library/a__b.c-d:T_a.g-1"),
    ],
)
def test_accepted_forms_expand_to_canonical(text: str, canonical: str) -> None:
    assert str(p(text)) == canonical


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("Bad Ref", "whitespace"),
        ("tiny:1.0\n", "whitespace"),
        ("Tiny:1.0", "lowercase"),
        ("tiny:", "tag"),
        ("tiny:-x", "tag"),
        ("tiny:" + "a" * 129, "tag"),
        ("tiny@sha256:xyz", "digest"),
        ("tiny@md5:" + "a" * 32, "digest"),
        ("tiny@sha256:" + "A" * 64, "digest"),
        ("http://reg/x:1", "prefix"),
        ("reg.site//x:1", "empty path"),
        ("reg.site/x/:1", "empty path"),
        ("reg.site:99999/x:1", "port"),
        ("-bad.host/x:1", "registry"),
        ("a" * 600, "longer"),
        ("x/" * 130 + "y", "longer than 255"),
        (":1.0", "no image name"),
    ],
)
def test_malformed_references_name_the_problem(text: str, why: str) -> None:
    with pytest.raises(ImageReferenceError) as e:
        p(text)
    msg = str(e.value)
    assert why in msg
    assert "\n" not in msg
    assert msg.startswith("invalid image reference")


def test_allowlist_rejects_other_registries() -> None:
    check_allowed(p("tiny:1"), (REG,))
    with pytest.raises(ImageReferenceError, match="not allowed"):
        check_allowed(p("evil.example/x/y:1"), (REG,))


def test_pinned_keeps_tag_and_adds_digest() -> None:
    r = p("tiny:1.0").pinned(D)
    assert (r.tag, r.digest, r.version) == ("1.0", D, D)
    with pytest.raises(ImageReferenceError):
        p("tiny:1.0").pinned("sha256:nothex")


@given(st.text(max_size=300))
def test_parser_never_raises_anything_but_its_own_error(text: str) -> None:
    try:
        r = p(text)
    except ImageReferenceError:
        return
    assert p(str(r)) == r


_component = st.from_regex(r"[a-z0-9]{1,8}(?:[._-][a-z0-9]{1,8}){0,2}", fullmatch=True)


@given(
    host=st.sampled_from(["reg.example", "reg.example:5000", "10.0.0.1:443", "localhost"]),
    path=st.lists(_component, min_size=1, max_size=4),
    tag=st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)),
    digest=st.one_of(st.none(), st.from_regex(r"sha256:[0-9a-f]{64}", fullmatch=True)),
    transport=st.sampled_from([None, "oras", "docker"]),
)
def test_canonical_form_round_trips(
    host: str, path: list[str], tag: str | None, digest: str | None, transport: str | None
) -> None:
    ref = Reference(host, "/".join(path), tag if tag or digest else "latest", digest, transport)
    assert p(str(ref)) == ref

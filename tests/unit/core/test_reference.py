from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tfimage.agent.core.errors import ImageReferenceError
from tfimage.agent.core.reference import Reference, check_allowed, check_rewrite, parse_reference

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


def test_the_length_bound_is_exactly_512_characters() -> None:
    # Found by a mutant (512 -> 513) that no test killed.
    # The longest of each part: a 255-character repository, a 128-character tag, a
    # digest, and a host long enough to make 512.
    tail = "/" + "/".join(["a" * 127] * 2) + ":" + "t" * 128 + "@sha256:" + "0" * 64
    host = "h" * 40 + "." + "e" * (512 - len(tail) - 41)
    name = host + tail
    assert len(name) == 512 and p(name).digest
    with pytest.raises(ImageReferenceError, match="longer than 512 characters"):
        p(name + "0")


def test_a_long_bad_reference_is_shown_cut_to_80_characters() -> None:
    # Found by mutants of the message's cut (80, 77, <=) that no test killed.
    bad = "Bad" + "x" * 200
    with pytest.raises(ImageReferenceError) as e:
        p(bad)
    shown = str(e.value).split("'")[1]
    assert len(shown) == 80 and shown.endswith("...") and shown.startswith("Badxxx")
    exactly = "B" + "x" * 79
    with pytest.raises(ImageReferenceError) as e:
        p(exactly)
    assert str(e.value).split("'")[1] == exactly  # 80 characters: shown whole
    with pytest.raises(ImageReferenceError) as e:
        p(exactly + "x")
    assert str(e.value).split("'")[1] == exactly[:77] + "..."  # 81: cut


@pytest.mark.parametrize(
    ("port", "ok"), [("1", True), ("65535", True), ("0", False), ("65536", False)]
)
def test_a_registry_port_is_1_to_65535(port: str, ok: bool) -> None:
    text = f"reg.site:{port}/library/tiny:1"
    if ok:
        assert p(text).registry == f"reg.site:{port}"
    else:
        with pytest.raises(ImageReferenceError, match=f"registry port {port} is out of range"):
            p(text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("docker://oras://tiny:1", "registry 'oras:' is not a valid host"),  # split once
        ("tiny@sha256:" + "a" * 64 + "@sha256:" + "b" * 64, "digest must be"),
    ],
)
def test_a_second_prefix_or_digest_is_refused_not_split_again(text: str, why: str) -> None:
    # Found by mutants of the split's maxsplit (1 -> 2).
    with pytest.raises(ImageReferenceError, match=why):
        p(text)


# --- upstream names through the site's proxy-cache projects ------------------------------------

REWRITES = (("nvcr.io", "harbor.example/nvcr"), ("ghcr.io", "harbor.example/ghcr"),
            ("ghcr.io/acme", "harbor.example/acme-mirror"))  # fmt: skip


def hub(text: str, project: str | None = "dockerhub") -> Reference:
    return parse_reference(text, REG, PROJ, dockerhub_project=project, rewrites=REWRITES)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("docker://tensorflow/tensorflow:latest-gpu",
         "docker://harbor.example/dockerhub/tensorflow/tensorflow:latest-gpu"),
        ("docker://ubuntu:22.04", "docker://harbor.example/dockerhub/library/ubuntu:22.04"),
        ("docker://ubuntu", "docker://harbor.example/dockerhub/library/ubuntu:latest"),
        ("docker.io/ubuntu:22.04", "harbor.example/dockerhub/library/ubuntu:22.04"),
        ("index.docker.io/library/ubuntu", "harbor.example/dockerhub/library/ubuntu:latest"),
        (f"docker://registry-1.docker.io/nvidia/cuda@{D}",
         f"docker://harbor.example/dockerhub/nvidia/cuda@{D}"),
        # The site's own names are the site's: no docker:// and no Docker Hub host.
        ("tf-custom:2.0", "harbor.example/library/tf-custom:2.0"),
        ("oras://tf-custom:2.0", "oras://harbor.example/library/tf-custom:2.0"),
        ("docker://harbor.example/ml/x:1", "docker://harbor.example/ml/x:1"),
        # Other upstreams by prefix, whole components, the longest first.
        ("nvcr.io/nvidia/tensorflow:24.01-tf2-py3",
         "harbor.example/nvcr/nvidia/tensorflow:24.01-tf2-py3"),
        ("ghcr.io/acme/train:1", "harbor.example/acme-mirror/train:1"),
        ("ghcr.io/acmeco/train:1", "harbor.example/ghcr/acmeco/train:1"),
        ("nvcr.io.evil.example/nvidia/x:1", "nvcr.io.evil.example/nvidia/x:1"),
    ],
)  # fmt: skip
def test_upstream_names_map_onto_the_sites_projects(text: str, canonical: str) -> None:
    assert str(hub(text)) == canonical


def test_without_a_dockerhub_project_docker_names_stay_as_they_were() -> None:
    assert str(hub("docker://ubuntu:22.04", None)) == "docker://harbor.example/library/ubuntu:22.04"
    assert hub("docker.io/library/ubuntu", None).registry == "docker.io"  # the allowlist's call


@given(
    host=st.sampled_from([None, "docker.io", "index.docker.io", "nvcr.io", "ghcr.io"]),
    path=st.lists(_component, min_size=1, max_size=3),
    tag=st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True),
)
def test_a_mapped_name_is_the_sites_and_maps_to_itself(
    host: str | None, path: list[str], tag: str
) -> None:
    if host == "nvcr.io" and len(path) == 1:
        path = ["nvidia", *path]
    assume(host or len(path) == 1 or "." not in path[0])  # else it names a host (Docker's rule)
    text = f"docker://{host + '/' if host else ''}{'/'.join(path)}:{tag}"
    try:
        ref = hub(text)
    except ImageReferenceError as e:
        assert "longer than" in str(e)
        return
    assert ref.registry == REG and ref.tag == tag and ref.repository.endswith("/".join(path))
    assert hub(str(ref)) == ref  # the site's name is never mapped a second time


@pytest.mark.parametrize(
    ("upstream", "site"),
    [("nvcr.io", "harbor.example"), ("", "harbor.example/x"), ("nvcr.io", "harbor.example/X"),
     ("nvcr.io/", "harbor.example/x"), ("nv cr", "harbor.example/x")],
)  # fmt: skip
def test_a_bad_rewrite_is_named(upstream: str, site: str) -> None:
    with pytest.raises(ImageReferenceError, match="rewrite"):
        check_rewrite(upstream, site)


@pytest.mark.parametrize("text", ["/home/me/tf.sif", "./tf.sif", "../x/tf.sif", "~/tf.sif"])
def test_a_file_path_is_answered_with_how_to_push_it(text: str) -> None:
    with pytest.raises(ImageReferenceError) as e:
        parse_reference(text, "harbor.example", "library")
    assert str(e.value) == (
        f"{text!r} is a file; --tf-image takes an image in the registry: push it first"
        " (tfimage push FILE NAME:TAG) and name NAME:TAG"
    )


def test_pyxis_registry_hash_image_form_is_answered_with_the_slash_form() -> None:
    with pytest.raises(ImageReferenceError) as e:
        parse_reference("nvcr.io#nvidia/tensorflow:24.01-tf2-py3", "harbor.example", "library")
    assert str(e.value).endswith(
        "is enroot's and pyxis's form (registry#image); tfimage's is registry/image:"
        " nvcr.io/nvidia/tensorflow:24.01-tf2-py3"
    )
    # and what it suggests parses
    assert parse_reference("nvcr.io/nvidia/tensorflow:24.01-tf2-py3", "h", "p").registry == (
        "nvcr.io"
    )

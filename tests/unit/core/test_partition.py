"""The config's partitions: rules: parsed strictly, one line per fault; every key
matching the job's partition applies, whatever their order; each check refuses with
a line that names the partition and what it runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tfimage.agent.core.config import config_from_mapping
from tfimage.agent.core.errors import ConfigError, PolicyError
from tfimage.agent.core.partition import (
    PartitionRule,
    check_image,
    check_name,
    default_image,
    parse_size,
    partition_rules,
    rules_for,
)
from tfimage.agent.core.reference import Reference, parse_reference

P = Path("/etc/tfimage/config.yaml")
REG = "10.203.0.1:5443"
DIGEST = "sha256:" + "ab" * 32
PROD = {
    "registries": [REG],
    "repositories": ["library/*", "team-a/*"],
    "require_digest": True,
    "allow_conversion": False,
    "max_image_bytes": "1GiB",
}


def _ref(text: str) -> Reference:
    return parse_reference(text, REG, "library")


def test_the_seeds_prod_and_dev_pair_parses_in_order() -> None:
    rules = partition_rules({"prod": PROD, "dev": {}, "gpu-*": None}, P)
    assert rules == (
        PartitionRule("prod", (REG,), ("library/*", "team-a/*"), True, False, 1 << 30),
        PartitionRule("dev"),
        PartitionRule("gpu-*"),
    )
    assert config_from_mapping({"partitions": {"prod": PROD}}).partitions == rules[:1]
    assert config_from_mapping({}).partitions == ()


def test_every_matching_key_applies_in_any_order_and_no_key_means_none() -> None:
    strict = {"require_digest": True}
    small = {"max_image_bytes": 100}
    for order in ({"gpu-a100": strict, "gpu-*": small}, {"gpu-*": small, "gpu-a100": strict}):
        rules = partition_rules(order, P)
        both = rules_for(rules, "gpu-a100")
        assert {r.glob for r in both} == {"gpu-a100", "gpu-*"}
        assert [r.glob for r in rules_for(rules, "gpu-h100")] == ["gpu-*"]
        ref = _ref(f"tiny:1@{DIGEST}")
        with pytest.raises(PolicyError, match="requires a digest"):
            check_name(both, "gpu-a100", ref, "tiny:1")
        with pytest.raises(PolicyError, match="at most 100 bytes"):
            check_image(both, "gpu-a100", ref, 101, converted=False)
    assert rules_for(rules, "debug") == ()
    assert rules_for(rules, "") == ()  # no partition known: no rule


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (["prod"], "'partitions' must map partition names or globs to rules"),
        ({"pr od": {}}, "'pr od' is not a partition name or glob"),
        ({"p/q": {}}, "'p/q' is not a partition name or glob"),
        ({"prod": ["library/*"]}, "'prod' must be a mapping of registries, repositories"),
        ({"prod": {"repos": ["a/*"]}}, "'prod': unknown setting(s): repos"),
        ({"prod": {"registries": []}}, "'registries' must list one or more"),
        ({"prod": {"registries": ["https://h"]}}, "'https://h' is not a registry host[:port]"),
        ({"prod": {"repositories": ["Team/*"]}}, "'Team/*' is not a repository glob"),
        ({"prod": {"repositories": "library/*"}}, "'repositories' must list one or more"),
        ({"prod": {"require_digest": "yes"}}, "'require_digest' must be true or false"),
        ({"prod": {"allow_conversion": 0}}, "'allow_conversion' must be true or false"),
        ({"prod": {"max_image_bytes": "20GB"}}, "not '20GB'"),
        ({"prod": {"max_image_bytes": 0}}, "'max_image_bytes' must be from 1 byte to 1 PiB"),
        ({"prod": {"max_image_bytes": True}}, "'max_image_bytes' must be a size"),
        ({"prod": {"max_image_bytes": "2048T"}}, "must be from 1 byte to 1 PiB"),
        ({"train": {"default_image": 7}}, "'default_image' must be an image reference"),
        ({"train": {"default_image": "tiny:1 x"}}, "'default_image' must be an image reference"),
        ({"train": {"default_image": "tiny:\x01"}}, "'default_image' must be an image reference"),
        ({"train": {"default_image": "x" * 513}}, "'default_image' must be an image reference"),
        ({"train": {"default_image": "Tiny:1"}}, "'train': 'default_image': "),
    ],
)
def test_a_bad_rule_is_one_line_naming_it(value: object, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_mapping({"partitions": value}, P)
    assert says in str(e.value) and str(e.value).startswith(f"{P}: ")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("text", "size"),
    [(1, 1), ("512", 512), ("4K", 4096), ("3 MiB", 3 << 20), ("20GiB", 20 << 30), ("1T", 1 << 40)],
)
def test_sizes_are_bytes_or_binary_units(text: object, size: int) -> None:
    assert parse_size(text, "x") == size


@given(st.integers(min_value=1, max_value=1 << 20), st.sampled_from(["K", "M", "G", "KiB", "GiB"]))
def test_a_size_with_a_unit_is_its_number_times_the_units_power_of_1024(n: int, unit: str) -> None:
    shift = {"K": 10, "M": 20, "G": 30}[unit[0]]
    assert parse_size(f"{n}{unit}", "x") == n << shift


def _refused(rule: PartitionRule, ref_text: str, asked: str) -> str:
    with pytest.raises(PolicyError) as e:
        check_name((rule,), "prod", _ref(ref_text), asked)
    return str(e.value)


def test_a_pinned_image_of_an_allowed_repository_passes_by_name() -> None:
    (rule,) = partition_rules({"prod": PROD}, P)
    check_name((rule,), "prod", _ref(f"team-a/tiny:1.0@{DIGEST}"), f"team-a/tiny:1.0@{DIGEST}")
    check_image((rule,), "prod", _ref(f"tiny@{DIGEST}"), 1 << 30, converted=False)


def test_each_name_check_says_what_the_partition_runs() -> None:
    (rule,) = partition_rules({"prod": PROD}, P)
    pinned = f"@{DIGEST}"
    assert _refused(rule, f"other.site/library/x:1{pinned}", "other.site/library/x:1") == (
        f"partition prod runs images from {REG} only, not other.site"
    )
    assert _refused(rule, f"team-b/x:1{pinned}", f"team-b/x:1{pinned}") == (
        "partition prod runs images of library/*, team-a/* only, not team-b/x"
    )
    said = _refused(rule, f"tiny:1.0{pinned}", "tiny:1.0")
    assert said.startswith("partition prod requires a digest: --tf-image=tiny:1.0@sha256:...")
    assert _refused(rule, f"docker://tiny:1{pinned}", f"docker://tiny:1{pinned}") == (
        f"partition prod runs SIF images only: docker://{REG}/library/tiny:1 is a docker:// image"
    )


def test_a_job_without_its_asked_text_never_passes_a_digest_rule() -> None:
    (rule,) = partition_rules({"prod": {"require_digest": True}}, P)
    assert "requires a digest" in _refused(rule, f"tiny:1.0@{DIGEST}", "")


def test_the_image_checks_refuse_a_converted_image_and_one_over_the_size() -> None:
    (rule,) = partition_rules({"prod": PROD}, P)
    ref = _ref(f"tiny:1.0@{DIGEST}")
    with pytest.raises(PolicyError, match=r"runs SIF images only: .* is an OCI image"):
        check_image((rule,), "prod", ref, 10, converted=True)
    with pytest.raises(PolicyError) as e:
        check_image((rule,), "prod", ref, (1 << 30) + (1 << 29), converted=False)
    assert str(e.value) == (
        f"partition prod runs images of at most 1.0 GiB: {REG}/library/tiny:1.0 is 1.5 GiB"
    )


def test_an_empty_rule_runs_anything() -> None:
    (rule,) = partition_rules({"dev": {}}, P)
    ref = _ref(f"docker://other.site/team-b/x:1@{DIGEST}")
    check_name((rule,), "dev", ref, "docker://other.site/team-b/x:1")
    check_image((rule,), "dev", ref, 1 << 45, converted=True)


def test_a_partition_with_a_default_image_names_it_and_one_without_names_none() -> None:
    cfg = config_from_mapping(
        {"registry": REG, "partitions": {"train": {"default_image": "tiny:1.0"}, "dev": {}}}, P
    )
    assert default_image(rules_for(cfg.partitions, "train"), "train") == "tiny:1.0"
    assert default_image(rules_for(cfg.partitions, "dev"), "dev") == ""
    assert default_image(rules_for(cfg.partitions, "debug"), "debug") == ""


def test_keys_that_name_different_defaults_give_none_and_say_why() -> None:
    rules = partition_rules(
        {"gpu-*": {"default_image": "tiny:1.0"}, "gpu-a100": {"default_image": "big:2"}}, P
    )
    with pytest.raises(PolicyError, match="partition gpu-a100 has 2 default images"):
        default_image(rules_for(rules, "gpu-a100"), "gpu-a100")
    assert default_image(rules_for(rules, "gpu-v100"), "gpu-v100") == "tiny:1.0"
    same = partition_rules(
        {"gpu-*": {"default_image": "a:1"}, "gpu-x": {"default_image": "a:1"}}, P
    )
    assert default_image(rules_for(same, "gpu-x"), "gpu-x") == "a:1"

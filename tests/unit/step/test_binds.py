from __future__ import annotations

import pytest

from tfimage.agent.core.errors import BindError
from tfimage.agent.step.binds import parse_binds, parse_user_binds
from tfimage.agent.step.runtime import Bind

PREFIXES = ("/home", "/data")


def test_valid_mounts() -> None:
    assert parse_binds("/data/a:/mnt/a:ro,/home/u/x:/x", PREFIXES) == [
        Bind("/data/a", "/mnt/a", True),
        Bind("/home/u/x", "/x", False),
    ]
    assert parse_binds("", PREFIXES) == []


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("/etc:/x", "outside the allowed prefixes"),
        ("/database/x:/x", "outside the allowed prefixes"),  # prefix on whole components
        ("/data/../etc:/x", "normal absolute path"),
        ("data:/x", "normal absolute path"),
        ("/data/a", "expected SRC:DST"),
        ("/data/a:/x:rx", "mode must be ro or rw"),
        ("/data/a:/etc", "system directory"),
        ("/data/a:/", "system directory"),
        ("/data/a:/usr/lib", "system directory"),
        ("/data/a:/x,/data/b:/x", "given twice"),
        ("/data/a:/x,", "expected SRC:DST"),
    ],
)
def test_bad_mounts_name_the_problem(text: str, why: str) -> None:
    with pytest.raises(BindError, match=why) as e:
        parse_binds(text, PREFIXES)
    assert "\n" not in str(e.value)


def test_thirty_two_mounts_are_taken_and_thirty_three_refused() -> None:
    specs = [f"/data/d{i}:/m{i}" for i in range(33)]
    assert len(parse_binds(",".join(specs[:32]), PREFIXES)) == 32
    with pytest.raises(BindError, match="at most 32 mounts"):
        parse_binds(",".join(specs), PREFIXES)


def test_a_site_without_prefixes_says_none_are_configured() -> None:
    with pytest.raises(BindError, match=r"outside the allowed prefixes \(none configured\)"):
        parse_binds("/data/a:/x", ())


@pytest.mark.parametrize(
    ("text", "how"),
    [
        ("/data/a:/mnt/d", "destination /mnt/d lies inside /mnt"),  # the site's would hide it
        ("/data/a:/scratch", "destination /scratch covers /scratch/shared"),
    ],
)
def test_a_mount_inside_or_over_a_site_bind_is_refused(text: str, how: str) -> None:
    site = ("/srv/data:/mnt", "/srv/shared:/scratch/shared:ro")
    with pytest.raises(BindError, match=f"{how}, which the site binds into every container"):
        parse_user_binds(text, PREFIXES, site)


def test_the_site_binds_own_destination_is_the_users_to_replace() -> None:
    site = ("/srv/data:/mnt",)
    assert parse_user_binds("/data/a:/mnt,/data/b:/mnt2", PREFIXES, site) == [
        Bind("/data/a", "/mnt"),
        Bind("/data/b", "/mnt2"),
    ]

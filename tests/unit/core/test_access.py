"""The config's access: rules: parsed strictly, one line per fault; judged against
the identity this node's passwd and group databases give a uid; rules only narrow."""

from __future__ import annotations

import grp
import pwd
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tfimage.agent.core.access import Identity, Rule, access_rules, check, identity, rule_against
from tfimage.agent.core.config import config_from_mapping
from tfimage.agent.core.errors import AccessDenied, ConfigError

P = Path("/etc/tfimage/config.yaml")


def test_rules_name_users_and_groups_and_a_lone_name_is_a_list() -> None:
    rules = access_rules({"team-a/*": ["@team-a", "alice"], "team-b/sdk": "@team-b"}, P)
    assert rules == (
        Rule("team-a/*", frozenset({"alice"}), frozenset({"team-a"})),
        Rule("team-b/sdk", frozenset(), frozenset({"team-b"})),
    )
    assert [r.matches("team-a/tiny") for r in rules] == [True, False]
    assert not rules[0].matches("team-a/tiny/nested")  # '*' stays within one segment
    assert str(rules[0]) == "team-a/* (for alice, @team-a)"


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (["@team-a"], "'access' must map repository globs to users and @groups"),
        ({"Team-A/*": ["@a"]}, "'Team-A/*' is not a repository glob"),
        ({"team-a/**": ["@a"]}, "'team-a/**' is not a repository glob"),
        ({"/team-a": ["@a"]}, "'/team-a' is not a repository glob"),
        ({"team-a/*": []}, "'team-a/*' must list one or more users or @groups"),
        ({"team-a/*": ["@"]}, "'@' is not a user or @group name"),
        ({"team-a/*": ["1000"]}, "'1000' is not a user or @group name"),
        ({"team-a/*": ["al ice"]}, "'al ice' is not a user or @group name"),
        ({"team-a/*": [7]}, "'7' is not a user or @group name"),
        ({"team-a/*": {"x": 1}}, "must list one or more users or @groups"),
    ],
)
def test_each_bad_rule_is_refused_at_load_in_one_line(value: object, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_mapping({"access": value}, P)
    assert says in str(e.value) and str(e.value).startswith(str(P))
    assert "\n" not in str(e.value)


def test_a_site_without_access_rules_lets_everyone_run_everything() -> None:
    cfg = config_from_mapping({}, P)
    assert cfg.access == ()
    check(cfg.access, "team-a/tiny", 4_000_000)  # not even a user here: no rule, no question


def test_a_user_is_judged_by_this_nodes_groups_for_them() -> None:
    nobody = pwd.getpwnam("nobody")
    primary = grp.getgrgid(nobody.pw_gid).gr_name
    who = identity(nobody.pw_uid)
    assert who == Identity(nobody.pw_uid, "nobody", who.groups) and primary in who.groups
    rules = access_rules({"team-a/*": [f"@{primary}"], "team-b/*": ["@root"]}, P)
    check(rules, "team-a/tiny", nobody.pw_uid)
    check(rules, "library/tiny", nobody.pw_uid)  # no rule: open
    with pytest.raises(AccessDenied) as e:
        check(rules, "team-b/tiny", nobody.pw_uid)
    assert str(e.value) == "team-b/tiny: nobody may not run it: access rule team-b/* (for @root)"
    check(rules, "team-b/tiny", 0)  # root runs anything


def test_a_uid_this_node_does_not_know_is_refused_not_an_error() -> None:
    rules = access_rules({"team-a/*": ["@team-a"]}, P)
    with pytest.raises(AccessDenied, match="uid 4000000 is no user on this node"):
        check(rules, "team-a/tiny", 4_000_000)


_names = st.sampled_from(["alice", "bob", "carol"])
_groups = st.sampled_from(["team-a", "team-b", "ops"])
_globs = st.sampled_from(["team-a/*", "team-a/tiny", "*/tiny", "team-b/*", "library/*"])
_rules = st.builds(
    Rule, _globs, st.frozensets(_names, max_size=2), st.frozensets(_groups, max_size=2)
)
_who = st.builds(Identity, st.integers(1000, 1005), _names, st.frozensets(_groups, max_size=3))
_repos = st.sampled_from(["team-a/tiny", "team-b/tiny", "library/tiny", "team-a/sdk"])


@given(st.lists(_rules, max_size=4), _rules, _who, _repos)
def test_adding_a_rule_never_lets_in_anyone_it_kept_out(
    rules: list[Rule], extra: Rule, who: Identity, repo: str
) -> None:
    before = rule_against(tuple(rules), repo, who)
    after = rule_against((*rules, extra), repo, who)
    if before is not None:
        assert after is not None
    if after is None:
        assert all(r.admits(who) for r in (*rules, extra) if r.matches(repo))

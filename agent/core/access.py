"""Who may run what: the config's ``access:`` rules, and the identity they judge.

    access:
      "team-a/*": ["@team-a"]            # Unix group team-a
      "team-b/sdk": ["alice", "@team-b"] # user alice, or group team-b

A key is a repository glob (``*`` within one path segment, as
``image_mount_kernel`` has them), matched against the repository an image's bytes
came from; a value lists Unix users and ``@groups``.  A repository that no rule
matches is open to everyone, so a site without ``access:`` sees no change.  Where
several rules match, each must admit the user: a rule only ever narrows.

The identity is root's, never the job's: a uid that Slurm vouches for (the pin
server's peer, ``SLURM_JOB_UID`` in the prolog, the step's ``S_JOB_UID``), its
user name and its groups read from this node's passwd and group databases
(NSS: files, LDAP, sssd).  A uid without a user here is refused, never an error.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tfimage.agent.core.errors import AccessDenied, ConfigError

# POSIX's portable names, as useradd and LDAP sites have them (a Samba machine
# account's trailing "$" too); never all digits, which would read as an id.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}\$?\Z")
_GLOB = re.compile(r"[a-z0-9*][a-z0-9._*-]*(/[a-z0-9*][a-z0-9._*-]*)*\Z")
MAX_RULES = 1024
MAX_PRINCIPALS = 256


def is_repository_glob(text: str) -> bool:
    """Lowercase path segments, ``*`` within one (never ``**``)."""
    return bool(_GLOB.match(text)) and "**" not in text


def segment_glob(pattern: str) -> re.Pattern[str]:
    """``library/tf-*`` as a regex: ``*`` never crosses a ``/``; nothing else is special."""
    return re.compile("".join("[^/]*" if c == "*" else re.escape(c) for c in pattern) + r"\Z")


@dataclass(frozen=True, slots=True)
class Rule:
    glob: str
    users: frozenset[str]
    groups: frozenset[str]

    def matches(self, repository: str) -> bool:
        return segment_glob(self.glob).match(repository) is not None

    def admits(self, who: Identity) -> bool:
        return who.user in self.users or not self.groups.isdisjoint(who.groups)

    def __str__(self) -> str:
        names = sorted(self.users) + sorted(f"@{g}" for g in self.groups)
        return f"{self.glob} (for {', '.join(names)})"


@dataclass(frozen=True, slots=True)
class Identity:
    uid: int
    user: str
    groups: frozenset[str]


def access_rules(value: Any, path: Path) -> tuple[Rule, ...]:
    """The ``access:`` mapping parsed strictly: one ConfigError line per fault."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: 'access' must map repository globs to users and @groups")
    if len(value) > MAX_RULES:
        raise ConfigError(f"{path}: 'access' has more than {MAX_RULES} rules")
    rules = []
    for glob, names in value.items():
        where = f"{path}: 'access': {str(glob)[:80]!r}"
        if not isinstance(glob, str) or not is_repository_glob(glob):
            raise ConfigError(
                f"{where} is not a repository glob (lowercase path segments, '*' within one)"
            )
        if isinstance(names, str):
            names = [names]
        if not isinstance(names, list) or not names or len(names) > MAX_PRINCIPALS:
            raise ConfigError(f"{where} must list one or more users or @groups")
        users: set[str] = set()
        groups: set[str] = set()
        for n in names:
            is_group = isinstance(n, str) and n.startswith("@")
            name = n[1:] if is_group else n
            if not isinstance(name, str) or not _NAME.match(name) or name.isdigit():
                raise ConfigError(f"{where}: {str(n)[:40]!r} is not a user or @group name")
            (groups if is_group else users).add(name)
        rules.append(Rule(glob, frozenset(users), frozenset(groups)))
    return tuple(rules)


def identity(uid: int) -> Identity:
    """The user ``uid`` is on this node and their groups (AccessDenied where the
    node knows no such user: a refusal, not a fault)."""
    import grp
    import pwd

    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        raise AccessDenied(f"uid {uid} is no user on this node") from None
    names = set()
    for gid in os.getgrouplist(pw.pw_name, pw.pw_gid):
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue  # a gid with no name: no rule can name it
    return Identity(uid, pw.pw_name, frozenset(names))


def first_rule(rules: tuple[Rule, ...], repository: str) -> Rule | None:
    """The first rule matching ``repository``; None where it is open to all."""
    return next((r for r in rules if r.matches(repository)), None)


def rule_against(rules: tuple[Rule, ...], repository: str, who: Identity) -> Rule | None:
    """The first rule matching ``repository`` that does not admit ``who``, or None:
    they may run it (root always may)."""
    if who.uid == 0:
        return None
    return next((r for r in rules if r.matches(repository) and not r.admits(who)), None)


def check(rules: tuple[Rule, ...], repository: str, uid: int) -> None:
    """AccessDenied, naming the rule, unless ``uid`` may run images of ``repository``."""
    if uid == 0 or first_rule(rules, repository) is None:
        return
    who = identity(uid)
    rule = rule_against(rules, repository, who)
    if rule is not None:
        raise AccessDenied(f"{repository}: {who.user} may not run it: access rule {rule}")


def readers(rules: tuple[Rule, ...], repository: str) -> tuple[list[int], list[int]] | None:
    """The uids and gids the first rule matching ``repository`` names, as this
    node knows them (names it does not know are left out), for the ACL that keeps
    a private image's files to them; None where no rule matches (open to all)."""
    import grp
    import pwd

    rule = first_rule(rules, repository)
    if rule is None:
        return None
    uids, gids = [], []
    for name in sorted(rule.users):
        with contextlib.suppress(KeyError):
            uids.append(pwd.getpwnam(name).pw_uid)
    for name in sorted(rule.groups):
        with contextlib.suppress(KeyError):
            gids.append(grp.getgrnam(name).gr_gid)
    return uids, gids

#!/usr/bin/python
"""Wire tfimage's prolog and epilog into slurm.conf without clobbering the site's.

Prolog= and Epilog= become prolog.d-style globs (Slurm >= 21.08 runs every match):
- unset: set to ``DIR/*``;
- already a glob: kept; tfimage's script goes into that glob's directory;
- a single program: that program is linked as ``DIR/99-site-<kind>`` so it still
  runs first, and the key becomes ``DIR/*``; the old line stays, commented.
  slurmd runs a glob's matches in reverse order of their names (its list of them is
  built by pushing each at the front; seen on 22.05.8 and 24.11), so 99-site-prolog
  runs before tfimage's 50-tfimage.  A ``00-site-<kind>`` link an older tfimage
  made (which ran after tfimage's) is renamed.
PrologFlags gains ``Alloc`` (and anything else asked for); other flags are kept.
SchedulerParameters gains what is asked (``nohold_on_prolog_fail``: a job whose
prolog found a GPU fault is requeued to run elsewhere, not held); other values kept.
HealthCheckProgram (and HealthCheckInterval) are set only where the site has none:
a site's own health check (NHC, ...) is never replaced, and the result says so.
Nothing else in the file is touched.  Supports check mode and diff.  Returns the
file's PrologEpilogTimeout (seconds, or null when unset: Slurm then waits for ever)
so that the role can keep tfimage's hook deadline below it.
"""

from __future__ import annotations

import os
import re
import tempfile

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: tfimage_slurm_conf
short_description: Add tfimage's prolog.d/epilog.d globs and PrologFlags to slurm.conf
options:
  path: {description: slurm.conf to edit, type: path, required: true}
  prolog_dir: {description: directory for prolog programs, type: path, required: true}
  epilog_dir: {description: directory for epilog programs, type: path, required: true}
  prolog_flags:
    description: flags PrologFlags must contain
    type: list
    elements: str
    default: [Alloc]
  scheduler_parameters:
    description: values SchedulerParameters must contain
    type: list
    elements: str
    default: []
  health_check_program:
    description: HealthCheckProgram to set where the site has none (empty for none)
    type: str
    default: ""
  health_check_interval:
    description: HealthCheckInterval set with it (seconds; 0 runs it only when asked)
    type: int
    default: 300
"""

_GLOB = re.compile(r"[*?\[]")
MARK = "# tfimage: "


def _key_line(lines: list[str], key: str) -> int | None:
    pat = re.compile(rf"^\s*{key}\s*=", re.IGNORECASE)
    found = None
    for i, line in enumerate(lines):
        if pat.match(line):
            found = i  # the last one wins in Slurm
    return found


SITE_PREFIX = "99-site-"
OLD_SITE_PREFIX = "00-site-"  # before 2026-12-03: it ran after tfimage's


def renamed_site_links(dirs: dict[str, str]) -> dict[str, str]:
    """Links an older tfimage made that now must be named to run first: old -> new."""
    out = {}
    for key, d in dirs.items():
        old = f"{d.rstrip('/')}/{OLD_SITE_PREFIX}{key.lower()}"
        new = f"{d.rstrip('/')}/{SITE_PREFIX}{key.lower()}"
        if os.path.islink(old) and not os.path.lexists(new):
            out[old] = new
    return out


def _value(line: str) -> str:
    return line.split("#", 1)[0].split("=", 1)[1].strip()


def plan(
    text: str,
    prolog_dir: str,
    epilog_dir: str,
    flags: list[str],
    scheduler: tuple[str, ...] | list[str] = (),
    health_program: str = "",
    health_interval: int = 300,
) -> tuple[str, dict]:
    lines = text.splitlines()
    out = {"links": {}, "dirs": {}}
    for key, d in (("Prolog", prolog_dir), ("Epilog", epilog_dir)):
        want = f"{d.rstrip('/')}/*"
        i = _key_line(lines, key)
        if i is None:
            lines.append(f"{key}={want}")
            out["dirs"][key] = d
            continue
        value = _value(lines[i])
        if _GLOB.search(value):
            out["dirs"][key] = os.path.dirname(value)
            continue
        out["dirs"][key] = d
        if value:
            out["links"][f"{d.rstrip('/')}/{SITE_PREFIX}{key.lower()}"] = value
            lines[i : i + 1] = [
                f"#{lines[i].strip()}  {MARK}moved to {d}/{SITE_PREFIX}{key.lower()}",
                f"{key}={want}",
            ]
        else:
            lines[i] = f"{key}={want}"
    _ensure_values(lines, "PrologFlags", flags)
    _ensure_values(lines, "SchedulerParameters", list(scheduler))
    out["health_check_kept"] = None
    if health_program:
        i = _key_line(lines, "HealthCheckProgram")
        if i is None:
            lines.append(f"HealthCheckProgram={health_program}")
            if _key_line(lines, "HealthCheckInterval") is None:
                lines.append(f"HealthCheckInterval={health_interval}")
        elif _value(lines[i]) != health_program:
            out["health_check_kept"] = _value(lines[i])
    return "\n".join(lines) + "\n", out


def _ensure_values(lines: list[str], key: str, wanted: list[str]) -> None:
    """``key``'s comma-separated list gains what it lacks of ``wanted`` (case-blind)."""
    if not wanted:
        return
    i = _key_line(lines, key)
    if i is None:
        lines.append(f"{key}=" + ",".join(wanted))
        return
    have = [f for f in _value(lines[i]).split(",") if f]
    # SchedulerParameters' values may carry "=N"; compare on the name
    names = {h.split("=", 1)[0].lower() for h in have}
    missing = [f for f in wanted if f.split("=", 1)[0].lower() not in names]
    if missing:
        lines[i] = f"{key}=" + ",".join(have + missing)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "prolog_dir": {"type": "path", "required": True},
            "epilog_dir": {"type": "path", "required": True},
            "prolog_flags": {"type": "list", "elements": "str", "default": ["Alloc"]},
            "scheduler_parameters": {"type": "list", "elements": "str", "default": []},
            "health_check_program": {"type": "str", "default": ""},
            "health_check_interval": {"type": "int", "default": 300},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        with open(p["path"], encoding="utf-8") as f:
            before = f.read()
    except OSError as e:
        module.fail_json(msg=f"tfimage: cannot read {p['path']}: {e.strerror}")
    after, extra = plan(
        before,
        p["prolog_dir"],
        p["epilog_dir"],
        p["prolog_flags"],
        p["scheduler_parameters"],
        p["health_check_program"],
        p["health_check_interval"],
    )
    changed = after != before
    links_to_make = {
        link: target
        for link, target in extra["links"].items()
        if not (os.path.islink(link) and os.readlink(link) == target)
    }
    dirs_to_make = [d for d in set(extra["dirs"].values()) if not os.path.isdir(d)]
    renames = renamed_site_links(extra["dirs"])
    changed = changed or bool(links_to_make) or bool(dirs_to_make) or bool(renames)
    i = _key_line(before.splitlines(), "PrologEpilogTimeout")
    timeout = _value(before.splitlines()[i]) if i is not None else ""
    result = {
        "changed": changed,
        "prolog_epilog_timeout": int(timeout) if timeout.isdigit() else None,
        "prolog_dir": extra["dirs"]["Prolog"],
        "epilog_dir": extra["dirs"]["Epilog"],
        "site_links": extra["links"],
        "site_links_renamed": renames,
        "health_check_kept": extra["health_check_kept"],
        "diff": {
            "before": before,
            "after": after,
            "before_header": p["path"],
            "after_header": p["path"],
        },
    }
    if module.check_mode or not changed:
        module.exit_json(**result)
    for d in dirs_to_make:
        os.makedirs(d, mode=0o755, exist_ok=True)
    for old, new in renames.items():
        os.rename(old, new)
    for link, target in links_to_make.items():
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(target, link)
    if after != before:
        st = os.stat(p["path"])
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(p["path"]), prefix=".slurm.conf.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(after)
        os.chmod(tmp, st.st_mode & 0o7777)
        os.chown(tmp, st.st_uid, st.st_gid)
        os.replace(tmp, p["path"])
    module.exit_json(**result)


if __name__ == "__main__":
    main()

#!/usr/bin/python
"""Wire tfimage's PrologSlurmctld into slurm.conf without dropping the site's own.

- Slurm 24.11 and later (``several``: true) run every ``PrologSlurmctld=`` line:
  tfimage's gets a line of its own, and the site's stay as they are.
- Slurm 22.05 runs one program: where the site has one, its line is commented out
  with a mark, tfimage's program takes the key, and the result's ``chained`` names
  the site's program, which tfimage's front runs first (its exit status kept).  A
  re-run finds the mark and says the same.
- ``program`` empty (the role's ``tfimage_stage: false``): tfimage's line goes, and a
  chained site program gets its line back.

Nothing else in the file is touched.  Supports check mode and diff.  Returns
``changed_line`` (the key's lines changed: Slurm 22.05 reads them only when
slurmctld starts, 24.11 at reconfigure) and the file's PrologEpilogTimeout
(seconds, or null when unset), which bounds PrologSlurmctld too.
"""

from __future__ import annotations

import os
import re
import tempfile

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: tfimage_slurmctld_conf
short_description: Add tfimage's PrologSlurmctld to slurm.conf, chaining the site's
options:
  path: {description: slurm.conf to edit, type: path, required: true}
  program:
    description: tfimage's PrologSlurmctld program (empty to remove it)
    type: str
    default: ""
  several:
    description: whether this Slurm runs several PrologSlurmctld lines (24.11+)
    type: bool
    default: false
"""

KEY = "PrologSlurmctld"
MARK = "  # tfimage: chained from "
_LINE = re.compile(rf"^\s*{KEY}\s*=", re.IGNORECASE)
# The site's own line, as it was, commented out behind "#" and before the mark.
_CHAINED = re.compile(rf"^#(\s*{KEY}\s*=.*?){re.escape(MARK)}", re.IGNORECASE)


def _value(line: str) -> str:
    return line.split("#", 1)[0].split("=", 1)[1].strip()


def plan(text: str, program: str, several: bool) -> tuple[str, str | None]:
    """The new text, and the site's program tfimage's front must run first."""
    lines = text.splitlines()
    keyed = [i for i, line in enumerate(lines) if _LINE.match(line)]
    ours = [i for i in keyed if _value(lines[i]) == program] if program else []
    chained_at = next((i for i, line in enumerate(lines) if _CHAINED.match(line)), None)
    original = _CHAINED.match(lines[chained_at])[1] if chained_at is not None else None
    chained = _value(original) if original is not None else None
    if not program:
        mine = [i for i in keyed if _value(lines[i]).endswith("/tfimage-stage")]
        for i in reversed(mine):
            del lines[i]
        if original is not None:
            at = next(i for i, line in enumerate(lines) if _CHAINED.match(line))
            lines[at] = original
        return _text(lines), None
    if ours:
        return _text(lines), chained
    others = [_value(lines[i]) for i in keyed if _value(lines[i])]
    if several or not others:
        lines.append(f"{KEY}={program}")
        return _text(lines), None
    i = keyed[-1]  # the last one wins in Slurm
    site = _value(lines[i])
    lines[i : i + 1] = [f"#{lines[i]}{MARK}{program}", f"{KEY}={program}"]
    return _text(lines), site


def _text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _keyed(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if _LINE.match(line)]


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "program": {"type": "str", "default": ""},
            "several": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    p = module.params
    try:
        with open(p["path"], encoding="utf-8") as f:
            before = f.read()
    except OSError as e:
        module.fail_json(msg=f"tfimage: cannot read {p['path']}: {e.strerror}")
    after, chained = plan(before, p["program"], p["several"])
    timeout = next(
        (
            _value(line)
            for line in reversed(before.splitlines())
            if re.match(r"^\s*PrologEpilogTimeout\s*=", line, re.IGNORECASE)
        ),
        "",
    )
    result = {
        "changed": after != before,
        "changed_line": _keyed(after) != _keyed(before),
        "chained": chained,
        "prolog_epilog_timeout": int(timeout) if timeout.isdigit() else None,
        "diff": {
            "before": before,
            "after": after,
            "before_header": p["path"],
            "after_header": p["path"],
        },
    }
    if module.check_mode or after == before:
        module.exit_json(**result)
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

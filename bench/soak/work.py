"""The soak's work: waves of job arrays, one per kind, and what each task prints."""

from __future__ import annotations

import dataclasses
import os
import pwd
import re
import sys
from collections import Counter
from pathlib import Path

from .site import REPO, Site

KINDS = ("batch", "steps", "multi", "mount", "other")
WEIGHTS = {"batch": 35, "steps": 15, "multi": 15, "mount": 15, "other": 20}
THROTTLE = 4  # running tasks per array
NUMBERS = re.compile(r"\b(job |step )?\d+(\.\d+)?\b")


@dataclasses.dataclass
class Array:
    kind: str
    job: str  # the array's job id
    tasks: int
    user: str
    workdir: Path


@dataclasses.dataclass
class Refusals:
    """Tasks refused at submit (an answer too): per kind, and per reason."""

    kinds: Counter[str] = dataclasses.field(default_factory=Counter)
    reasons: Counter[str] = dataclasses.field(default_factory=Counter)


def plan(tasks: int, waves: int) -> list[dict[str, int]]:
    """``tasks`` spread over ``waves``, each split by kind (WEIGHTS), every task placed."""
    out = []
    left = tasks
    for w in range(waves):
        n = left // (waves - w)
        left -= n
        split = {k: n * v // 100 for k, v in WEIGHTS.items()}
        split["batch"] += n - sum(split.values())
        out.append(split)
    return out


def soak_image(site: Site, seed: int, tmp: Path) -> str:
    """An image of the soak's own, on no node yet: the fourth image."""
    sys.path.insert(0, str(REPO / "tests"))
    from support import busybox_sif  # type: ignore[import-not-found]  # the tests' image builder

    ref = f"soak-{seed}-{os.urandom(3).hex()}:1"
    sif = busybox_sif(tmp, ref.split(":")[0])
    r = site.run(["tfimage", "push", str(sif), ref])
    if r.returncode != 0:
        raise RuntimeError(f"pushing {ref}: {r.stderr.strip()[-300:]}")
    return ref


def _workdir(user: str, seed: int) -> Path:
    pw = pwd.getpwnam(user)
    d = Path(pw.pw_dir) / f"soak-{seed}"
    d.mkdir(exist_ok=True)
    os.chown(d, pw.pw_uid, pw.pw_gid)
    return d


def script_text(kind: str, image: str, nodes_excluded: list[str], workdir: Path) -> str:
    shape = {"steps": "-N1 -n2", "multi": "-N2 -n2"}.get(kind, "-N1 -n1")
    lines = [
        "#!/bin/sh",
        f"#SBATCH -p all {shape} --tf-image={image}",
        f"#SBATCH -o {kind}-%A_%a.out",
    ]
    if nodes_excluded:
        lines.append(f"#SBATCH -x {','.join(nodes_excluded)}")
    if kind == "mount":
        lines.append(f"#SBATCH --tf-mount={workdir}:/soak:ro")
        lines.append("cat /soak/token")
    elif kind in ("steps", "multi"):
        lines.append("srun cat /etc/tfimage-test-image")
    else:
        lines.append("cat /etc/tfimage-test-image")
    return "\n".join(lines) + "\n"


def expected_output(kind: str, image: str, token: str) -> list[str]:
    """A task's output, word by word: the image's marker (build.sh's, or the soak
    image's name) once per task, or the token a mount task reads."""
    marker = image.split(":")[0] if image.startswith("soak-") else image
    return {"mount": [token], "steps": [marker] * 2, "multi": [marker] * 2}.get(kind, [marker])


def submit_wave(
    site: Site,
    images: dict[str, str],
    per_kind: dict[str, int],
    seed: int,
    token: str,
    refused: Refusals,
) -> list[Array]:
    """One array per kind with tasks in this wave; a refused one is kept, job-less."""
    arrays = []
    for kind in KINDS:
        n = per_kind.get(kind, 0)
        if n <= 0:
            continue
        user = site.users[1] if kind == "other" else site.users[0]
        d = _workdir(user, seed)
        if kind == "mount":
            (d / "token").write_text(token + "\n")
        script = d / f"{kind}.sh"
        script.write_text(script_text(kind, images[kind], site.others, d))
        os.chown(script, *(lambda p: (p.pw_uid, p.pw_gid))(pwd.getpwnam(user)))
        r = site.run(
            ["sbatch", "--parsable", f"--array=0-{n - 1}%{THROTTLE}", script.name], user=user, cwd=d
        )
        if r.returncode != 0:
            # A refusal at submit is an answer too: counted, with its reason.
            arrays.append(Array(kind, "", n, user, d))
            refused.kinds[kind] += n
            refused.reasons[reason(r.stderr)] += n
            continue
        arrays.append(Array(kind, r.stdout.strip().split(";")[0], n, user, d))
    return arrays


SLURM_ERROR = re.compile(r"^(srun|sbatch|slurmstepd(-\S+)?): error: .+$", re.M)


def slurm_reason(text: str) -> str:
    """Slurm's first error line, its numbers and node names made alike ("" if none)."""
    m = SLURM_ERROR.search(text)
    if not m:
        return ""
    line = re.sub(r"\[\[?[\w.-]+\]?:\d+\]|slurmstepd-\S+", "NODE", m[0])
    return "(Slurm) " + NUMBERS.sub("N", line)[:150]


def reason(text: str) -> str:
    """The first ``tfimage:`` line, its numbers made alike so that one cause counts
    once; else the first line said, marked as not ours."""
    lines = [x for x in text.splitlines() if x.strip()]
    # Slurm puts its own prefix before a plugin's line ("sbatch: error: tfimage: ...").
    line = next((x[x.index("tfimage:") :] for x in lines if "tfimage:" in x), "")
    if not line:
        return (
            "(no tfimage: line) " + NUMBERS.sub("N", lines[0] if lines else "(nothing said)")[:140]
        )
    return NUMBERS.sub("N", line)[:160]

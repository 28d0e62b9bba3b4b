"""The job's pinned image in its AdminComment (stage/admincomment.py): what is kept,
what is replaced, what is refused; scontrol given as a runner that answers as
Slurm 22.05's and 24.11's ``scontrol show job`` do (the cluster tier runs the real
one, and sacct), the tag resolved against the real registry."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from support import Registry
from tfimage.agent.core.config import load_config
from tfimage.agent.core.errors import RegistryError, TfimageError
from tfimage.agent.core.reference import Reference
from tfimage.agent.stage import admincomment
from tfimage.agent.stage.admincomment import merged, read, record

DIGEST = "sha256:" + "ab" * 32
REF = Reference("harbor.example.org", "library/tf-custom", "2.0", DIGEST)
WORD = f"tfimage=harbor.example.org/library/tf-custom:2.0@{DIGEST}"


def _show(comment: str | None) -> str:
    """``scontrol show job`` as Slurm prints it: AdminComment on a line of its own."""
    lines = [
        "JobId=7 JobName=train",
        "   UserId=tfuser(1001) GroupId=tfuser(1001) MCS_label=N/A",
        "   Priority=1 Nice=0 Account=team-a QOS=normal",
    ]
    if comment is not None:
        lines.append(f"   AdminComment={comment} ")
    lines += ["   Comment=user's own ", "   StdErr=/home/tfuser/slurm-7.out", ""]
    return "\n".join(lines)


class Scontrol:
    """scontrol's stand-in: answers ``show job`` with ``comment``, records updates."""

    def __init__(self, comment: str | None) -> None:
        self.comment = comment
        self.updates: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> str:
        if list(argv[1:3]) == ["show", "job"]:
            return _show(self.comment)
        self.updates.append(list(argv))
        return ""


def test_the_word_names_the_registry_repository_tag_and_digest() -> None:
    assert admincomment.word(REF) == WORD


def test_a_reference_without_a_digest_is_never_written() -> None:
    with pytest.raises(TfimageError, match="not pinned"):
        admincomment.word(REF.unpinned)


def test_an_admins_comment_is_kept_before_the_word() -> None:
    assert merged("ticket 4711: reservation for the demo", REF) == (
        f"ticket 4711: reservation for the demo {WORD}"
    )


def test_an_earlier_tfimage_word_is_replaced_not_repeated() -> None:
    """A requeued job's PrologSlurmctld runs again, perhaps for another digest."""
    old = f"tfimage=harbor.example.org/library/tf-custom:2.0@sha256:{'cd' * 32}"
    assert merged(f"ticket 1 {old}", REF) == f"ticket 1 {WORD}"
    assert merged(WORD, REF) == WORD


@given(st.text(alphabet=st.characters(blacklist_characters="\n\r"), max_size=200))
def test_merging_keeps_every_other_word_and_adds_ours_once(existing: str) -> None:
    out = merged(existing, REF)
    assert out.split(" ").count(WORD) == 1
    assert [w for w in out.split(" ") if not w.startswith("tfimage=")] == [
        w for w in existing.split(" ") if w and not w.startswith("tfimage=")
    ]


def test_the_comment_is_read_from_its_own_line() -> None:
    assert read(_show("ticket 4711, x=1  two spaces")) == "ticket 4711, x=1  two spaces"
    assert read(_show(None)) == ""


def test_a_comment_with_a_line_break_cannot_be_read_back_whole() -> None:
    assert read(_show("first line\nsecond line")) is None


def test_record_keeps_the_admins_comment_and_updates_the_job_once() -> None:
    scontrol = Scontrol("ticket 4711")
    assert record("7", REF, runner=scontrol) == f"ticket 4711 {WORD}"
    assert scontrol.updates == [
        ["scontrol", "update", "JobId=7", f"AdminComment=ticket 4711 {WORD}"]
    ]


def test_record_writes_nothing_when_the_comment_says_it_already() -> None:
    scontrol = Scontrol(f"ticket 4711 {WORD}")
    record("7", REF, runner=scontrol)
    assert scontrol.updates == []


def test_record_leaves_a_comment_it_cannot_read_whole_as_it_is() -> None:
    scontrol = Scontrol("first line\nsecond line")
    with pytest.raises(TfimageError, match="line break; left as it is"):
        record("7", REF, runner=scontrol)
    assert scontrol.updates == []


def test_record_leaves_an_overlong_comment_as_it_is() -> None:
    scontrol = Scontrol("x" * admincomment.MAX_COMMENT)
    with pytest.raises(TfimageError, match="would pass 4096 characters"):
        record("7", REF, runner=scontrol)
    assert scontrol.updates == []


@pytest.mark.parametrize("job", ["", "7 JobId=8", "-1", "7;rm"])
def test_record_refuses_what_is_not_a_job_id_before_running_scontrol(job: str) -> None:
    scontrol = Scontrol("")
    with pytest.raises(TfimageError, match="is not a job id"):
        record(job, REF, runner=scontrol)
    assert scontrol.updates == []


def test_a_tag_not_pinned_at_submit_is_resolved_against_the_registry(
    registry: Registry, make_sif: Callable[[dict[str, str]], Path], tmp_path: Path
) -> None:
    digest = registry.client().push_sif("library/accomment", "1", make_sif({"etc/a": "a"}))
    cfg = load_config(registry.write_site(tmp_path))
    assert admincomment.pinned(cfg, "accomment:1").digest == digest
    assert admincomment.pinned(cfg, f"accomment:1@{DIGEST}").digest == DIGEST  # as pinned


def test_a_tag_the_registry_does_not_know_is_an_error_not_a_guess(
    registry: Registry, tmp_path: Path
) -> None:
    cfg = load_config(registry.write_site(tmp_path))
    with pytest.raises(RegistryError):
        admincomment.pinned(cfg, "no-such-image:1")


def test_hostile_image_text_never_reaches_scontrol(registry: Registry, tmp_path: Path) -> None:
    cfg = load_config(registry.write_site(tmp_path))
    for text in ("tiny:1 AdminComment=x", "tiny:1\nJobId=8", "../../etc/passwd"):
        with pytest.raises(TfimageError):
            admincomment.pinned(cfg, text)

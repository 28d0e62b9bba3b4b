"""The soak's pure parts (bench/soak/): its plan, the reasons it counts, the verdict
it gives.  The soak itself runs on the cluster (tests/cluster/test_soak.py)."""

from __future__ import annotations

import random
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from soak import FAULTS, problems
from soak.account import compare_usage, is_out_of_service, match_records, node_state
from soak.faults import Injector
from soak.work import expected_output, plan, reason, script_text, slurm_reason


@pytest.mark.parametrize(("tasks", "waves"), [(2000, 20), (60, 4), (7, 3), (1, 1)])
def test_the_plan_places_every_task_once_across_the_waves(tasks: int, waves: int) -> None:
    p = plan(tasks, waves)
    assert len(p) == waves
    assert sum(sum(w.values()) for w in p) == tasks
    sizes = [sum(w.values()) for w in p]
    assert max(sizes) - min(sizes) <= 1  # even waves
    if tasks >= 20 * waves:
        assert all(all(n > 0 for n in w.values()) for w in p)  # every kind in every wave


def test_a_reason_is_the_first_tfimage_line_with_its_numbers_made_alike() -> None:
    out = "hello\ntfimage: prolog: job 123: pull of x failed after 2.5 s\ntfimage: other\n"
    assert reason(out) == "tfimage: prolog: N: pull of x failed after N s"
    assert reason(out.replace("123", "9")) == reason(out)  # counted as one reason
    said = "\nsbatch: error: Batch job submission failed: job 12 refused\nmore\n"
    assert (
        reason(said) == "(no tfimage: line) sbatch: error: Batch job submission failed: N refused"
    )
    assert reason("") == "(no tfimage: line) (nothing said)"
    refused = "sbatch: error: tfimage: submit: --tf-mount a:/b: destination /b is bad\n"
    assert reason(refused) == "tfimage: submit: --tf-mount a:/b: destination /b is bad"


def test_a_step_slurm_failed_is_told_apart_by_slurms_own_line() -> None:
    out = (
        "srun: error: slurm_receive_msgs: [[n3]:6818] failed: Zero Bytes were transmitted\n"
        "srun: error: Task launch for StepId=28.0 failed on node n3\n"
    )
    assert slurm_reason(out) == (
        "(Slurm) srun: error: slurm_receive_msgs: NODE failed: Zero Bytes were transmitted"
    )
    assert slurm_reason("tiny:1.0\n") == ""


def test_a_mount_task_reads_the_token_and_others_print_their_images_marker() -> None:
    assert expected_output("mount", "team-a/tiny:1.0", "tok") == ["tok"]
    assert expected_output("batch", "tiny:1.0", "tok") == ["tiny:1.0"]
    assert expected_output("multi", "soak-1-abc:1", "tok") == ["soak-1-abc", "soak-1-abc"]
    script = script_text("mount", "team-a/tiny:1.0", ["n1", "n2"], Path("/home/u/soak-1"))
    assert "#SBATCH -x n1,n2\n" in script
    assert "#SBATCH --tf-mount=/home/u/soak-1:/soak:ro\n" in script
    assert script.endswith("cat /soak/token\n")


def _clean() -> dict[str, Any]:
    return {
        "lost": [],
        "wrong_output": [],
        "drained": [],
        "node_states": {"n1": "idle"},
        "leaks": {"mounts": [], "holds": []},
        "usage": {"duplicates": [], "gaps": [], "strays": [], "bad_lines": 0},
        "injector_errors": [],
    }


def test_a_clean_report_passes_and_each_kind_of_harm_fails_it_by_name() -> None:
    assert problems(_clean()) == []
    harms: list[tuple[str, Any, str]] = [
        ("lost", ["7_3 (batch): PENDING"], "1 tasks lost"),
        ("drained", ["n1"], "nodes drained: ['n1']"),
        ("leaks", {"mounts": ["n1:/run/tfimage/images/x"], "holds": []}, "leaked mounts"),
        ("usage", {**_clean()["usage"], "duplicates": ["7@n1 x2"]}, "1 duplicates"),
        ("injector_errors", ["evict: not injected"], "fault injector: evict"),
        ("usage", {**_clean()["usage"], "without_array_ids": 2}, "2 array tasks' without"),
    ]
    for key, value, said in harms:
        report = {**_clean(), key: value}
        found = problems(report)
        assert len(found) == 1 and said in found[0], (key, found)


def test_the_faults_come_in_the_seeds_order_each_kind_once_a_round() -> None:
    def plan_of(seed: int, mirrored: bool) -> list[str]:
        site: Any = types.SimpleNamespace(nodes=["n3", "n4"], mirrored=mirrored)
        return Injector(site, random.Random(seed), 0.0, (1, 2), print).plan

    assert plan_of(46, True) == plan_of(46, True)
    assert Counter(plan_of(46, True)) == Counter(FAULTS)
    assert set(plan_of(46, False)) == set(FAULTS) - {"mirror-5xx-hang"}
    assert any(plan_of(s, True) != plan_of(46, True) for s in range(1, 5))
    site: Any = types.SimpleNamespace(nodes=["n3", "n4"], mirrored=True)
    four = Injector(site, random.Random(46), 0.0, (1, 2), print, rounds=4).plan
    assert Counter(four) == Counter({k: 4 for k in FAULTS})
    assert all(Counter(four[i : i + len(FAULTS)]) == Counter(FAULTS) for i in (0, 8, 16, 24))


def test_the_usage_report_is_held_to_slurms_runs_per_image_less_the_registry() -> None:
    # Job 8 failed on a node (NODE_FAIL), then ran again; job 10's prolog requeued it
    # (its slurmd killed under it): that try is neither a success nor a failure.
    runs = [("7", "n3", "COMPLETED"), ("8", "n3", "NODE_FAIL"), ("8", "n4", "COMPLETED"),
            ("9", "n3", "COMPLETED"), ("9", "n4", "COMPLETED"), ("10", "n3", "REQUEUED"),
            ("10", "n3", "COMPLETED")]  # fmt: skip
    image_of = {"7": "tiny:1.0", "8": "tiny:1.0", "9": "team-a/tiny:1.0", "10": "tiny:1.0"}
    groups = [
        {"key": "10.203.0.1:5443/library/tiny:1.0", "jobs": 4, "failures": 0},
        {"key": "tiny:1.0", "jobs": 1, "failures": 1},  # never came: named as asked
        {"key": "10.203.0.1:5443/team-a/tiny:1.0", "jobs": 2, "failures": 0},
    ]
    agreed = compare_usage(groups, runs, image_of)
    assert agreed["disagree"] == []
    assert agreed["report"]["library/tiny:1.0"] == {"jobs": 5, "failures": 1}
    # 24.11 gives a NODE_FAIL try's epilog 0:0: its record says COMPLETED; agreed too.
    groups[1]["failures"] = 0
    assert compare_usage(groups, runs, image_of)["disagree"] == []
    groups[1]["failures"] = 1
    groups[2]["jobs"] = 1  # a record missing on one node of the two
    said = compare_usage(groups, runs, image_of)["disagree"]
    assert said == [
        "team-a/tiny:1.0: report {'jobs': 1, 'failures': 0}, Slurm {'jobs': 2, 'failures': 0}"
    ]


def test_every_try_has_one_record_but_a_node_fail_whose_launch_died_first() -> None:
    runs = [
        ("7", "n1", "COMPLETED"),
        ("8", "n2", "NODE_FAIL"),  # its slurmd died before any prolog: no record
        ("8", "n2", "COMPLETED"),
        ("9", "n2", "NODE_FAIL"),  # its prolog ran, then slurmd died: a record
        ("9", "n1", "COMPLETED"),
        ("10", "n1", "REQUEUED"),  # the prolog requeued it: a record
        ("10", "n1", "COMPLETED"),
    ]
    seen = Counter({("7", "n1"): 1, ("8", "n2"): 1, ("9", "n2"): 1, ("9", "n1"): 1,
                    ("10", "n1"): 2})  # fmt: skip
    m = match_records(runs, seen)
    assert (m["duplicates"], m["gaps"], m["strays"], m["unlaunched"]) == ([], [], [], 1)
    assert ("8", "n2", "NODE_FAIL") not in m["recorded"] and len(m["recorded"]) == 6
    seen[("7", "n1")] = 2
    seen[("10", "n1")] = 1
    seen[("11", "n1")] = 1
    m = match_records(runs, seen)
    assert (m["duplicates"], m["gaps"], m["strays"]) == (["7@n1 x2"], ["10@n1"], ["11@n1"])


def test_a_node_in_three_partitions_is_one_state_and_down_in_any_is_counted() -> None:
    # sinfo -N -n NODE answers once per partition: the first 2,000-task table said
    # "n1 planned planned planned", and a down node read "down\ndown" (not "down").
    assert node_state("planned\nplanned\nplanned\n") == "planned"
    assert node_state("idle\nmixed\n") == "idle mixed"
    assert node_state("") == "not in sinfo"
    for up in ("idle", "mixed", "allocated", "planned", "idle~", "completing", "not in sinfo"):
        assert not is_out_of_service(up), up
    for out in ("down\ndown", "down*", "drained", "draining", "fail", "idle drained"):
        assert is_out_of_service(node_state(out)), out

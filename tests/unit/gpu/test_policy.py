"""The ``gpu:`` config section and Slurm's GPU lists: parsed strictly, every bad
value refused with one line that names it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tfimage.agent.core.config import config_from_mapping
from tfimage.agent.core.errors import ConfigError, InputError
from tfimage.agent.core.gpuconfig import CHECKS, GpuPolicy
from tfimage.agent.gpu.alloc import parse_gpus


def test_the_defaults_check_every_gpu_job_and_cite_dcgms_limits() -> None:
    p = config_from_mapping({}).gpu
    assert p == GpuPolicy()
    assert (p.checks, p.all_jobs, p.scope, p.mapping, p.shared) == (
        True,
        True,
        "job",
        "index",
        False,
    )
    assert (p.retired_pages_max, p.retired_pages_dbe_max, p.remapped_rows_max) == (60, 15, None)
    assert 79 in p.xids and 13 not in p.xids
    assert [c for c in CHECKS if p.severity_of(c) == "warning"] == ["persistence", "clocks", "pcie"]


def test_a_site_sets_its_own_values() -> None:
    p = config_from_mapping(
        {
            "gpu": {
                "scope": "node",
                "mapping": "minor",
                "remapped_rows_max": 8,
                "xids": [79],
                "severity": {"pcie": "off", "nvlink": "warning"},
            }
        }
    ).gpu
    assert (p.scope, p.mapping, p.remapped_rows_max, p.xids) == ("node", "minor", 8, (79,))
    assert p.severity_of("pcie") == "off" and p.severity_of("nvlink") == "warning"
    assert p.severity_of("ecc_dbe") == "drain"


@pytest.mark.parametrize(
    ("gpu", "says"),
    [
        ("yes", "'gpu' must be a mapping"),
        ({"chekcs": True}, "unknown setting(s) under 'gpu': chekcs"),
        ({"checks": "yes"}, "'gpu.checks' must be true or false"),
        ({"shared": "n1"}, "'gpu.shared' must be true, false or a list of node names"),
        ({"shared": ["n1", "a b"]}, "'gpu.shared' must be true, false or a list"),
        ({"shared": ["gpu[01-04]"]}, "write gpu0* for a hostlist"),
        ({"timeout": 0}, "'gpu.timeout' must be seconds from 0 to 300"),
        ({"timeout": True}, "'gpu.timeout' must be seconds"),
        ({"scope": "rack"}, "'gpu.scope' must be one of job, node"),
        ({"mapping": "bus"}, "'gpu.mapping' must be one of index, uuid, minor"),
        ({"retired_pages_max": -1}, "'gpu.retired_pages_max' must be a count"),
        ({"retired_pages_max": True}, "'gpu.retired_pages_max' must be a count"),
        ({"retired_pages_max": None}, "'gpu.retired_pages_max' must be a count"),
        ({"xids": [79, "48"]}, "'gpu.xids' must be a list of XID numbers"),
        ({"kmsg": "dev/kmsg"}, "'gpu.kmsg' must be an absolute path"),
        ({"severity": {"ecc": "drain"}}, "unknown check 'ecc'"),
        ({"severity": {"ecc_dbe": "fatal"}}, "'gpu.severity.ecc_dbe' must be one of drain"),
    ],
)
def test_a_bad_gpu_setting_is_one_line_naming_it(gpu: Any, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_mapping({"gpu": gpu}, Path("/etc/tfimage/config.yaml"))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_slurms_gpu_lists_parse_in_order() -> None:
    assert parse_gpus("0,2,1") == ("0", "2", "1")
    assert parse_gpus("") == parse_gpus("NoDevFiles") == ()
    uuid = "GPU-8f1c2a3b-1111-2222-3333-444455556666"
    assert parse_gpus(f"{uuid},MIG-abc/1/2") == (uuid, "MIG-abc/1/2")


@pytest.mark.parametrize(
    "text", ["0,0", "0,,1", "01", "-1", "0 ,1", "GPU-", "gpu0", "0;1", "1" * 5, "a" * 9000]
)
def test_anything_else_in_a_gpu_list_is_refused(text: str) -> None:
    with pytest.raises(InputError):
        parse_gpus(text)


@given(st.lists(st.integers(0, 9999), unique=True, min_size=1, max_size=64))
def test_any_list_of_distinct_indices_round_trips(indices: list[int]) -> None:
    assert parse_gpus(",".join(map(str, indices))) == tuple(map(str, indices))

"""Task index, ports and TF_CONFIG from real Slurm layouts (TF's resolver breaks on these)."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest

from tfimage.agent.core.config import Config
from tfimage.agent.core.errors import StepLayoutError
from tfimage.agent.core.hostlist import expand_counts, expand_hostlist
from tfimage.agent.step.plan import StepRequest, step_env
from tfimage.agent.step.taskenv import (
    hashed_ports,
    ib_hcas,
    route_interface,
    step_layout,
    task_env,
)


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("n[9-10]", ["n9", "n10"]),
        ("n1", ["n1"]),
        ("n3,n1,n2", ["n3", "n1", "n2"]),  # Slurm's order kept, never sorted
        ("gpu[001-004]", ["gpu001", "gpu002", "gpu003", "gpu004"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("n[1,3-4]-ib", ["n1-ib", "n3-ib", "n4-ib"]),
        ("a[1-2],b[08-10]", ["a1", "a2", "b08", "b09", "b10"]),
    ],
)
def test_hostlist_expansion(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n]1[", "n[a-b]", "n[3-1]", "", "n1,,n2"])
def test_bad_hostlists(bad: str) -> None:
    with pytest.raises(StepLayoutError):
        expand_hostlist(bad)


def test_counts() -> None:
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]
    with pytest.raises(StepLayoutError):
        expand_counts("2(x)")


def env_for(nodes: str, tpn: str, node: int, local: int, **extra: str) -> dict[str, str]:
    return {
        "SLURM_STEP_NODELIST": nodes,
        "SLURM_STEP_TASKS_PER_NODE": tpn,
        "SLURM_NODEID": str(node),
        "SLURM_LOCALID": str(local),
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        **extra,
    }


def all_indices(nodes: str, tpn: str, **extra: str) -> list[tuple[str, int]]:
    hosts, counts = expand_hostlist(nodes), expand_counts(tpn)
    out = []
    for n, c in enumerate(counts):
        for local in range(c):
            lay = step_layout(env_for(nodes, tpn, n, local, **extra))
            assert lay.workers[lay.index].startswith(hosts[n] + ":")
            out.append((hosts[n], lay.index))
    return out


@pytest.mark.parametrize(
    ("nodes", "tpn"),
    [
        ("n[9-10]", "2,1"),
        ("rack[1-2]-n[01-02]", "2(x3),1"),
        ("gpu[001-004]", "1(x4)"),
        ("n3,n1,n2", "1,2,1"),
    ],
)
def test_every_task_gets_a_distinct_host_major_index(nodes: str, tpn: str) -> None:
    got = all_indices(nodes, tpn, SLURM_STEP_RESV_PORTS="20000-20003")
    assert sorted(i for _, i in got) == list(range(len(got)))
    assert [h for h, _ in sorted(got, key=lambda x: x[1])] == [h for h, _ in got]


def test_n9_comes_before_n10() -> None:
    lay = step_layout(env_for("n[9-10]", "2,1", 1, 0, SLURM_STEP_RESV_PORTS="20000-20001"))
    assert lay.workers == ["n9:20000", "n9:20001", "n10:20000"]
    assert lay.index == 2


def test_cyclic_procid_is_ignored() -> None:
    # Under cyclic distribution SLURM_PROCID would be 1 here; the index stays host-major.
    lay = step_layout(
        env_for("gpu[001-002]", "2,2", 0, 1, SLURM_PROCID="2", SLURM_STEP_RESV_PORTS="20000-20001")
    )
    assert lay.index == 1


def test_too_few_reserved_ports_is_a_clear_error() -> None:
    with pytest.raises(StepLayoutError, match="reserved 1 port"):
        step_layout(env_for("n1", "2", 0, 0, SLURM_STEP_RESV_PORTS="20000"))


def test_batch_step_has_no_layout() -> None:
    with pytest.raises(StepLayoutError, match="SLURM_STEP_NODELIST is not set"):
        step_layout({"SLURM_JOB_ID": "5", "SLURM_NODEID": "0"})


def test_hashed_ports_are_stable_and_differ_between_steps() -> None:
    a = hashed_ports("100", "0", 2, 29000, 29999)
    assert a == hashed_ports("100", "0", 2, 29000, 29999)
    assert a != hashed_ports("101", "0", 2, 29000, 29999)
    assert all(29000 <= p <= 29999 for p in a) and len(set(a)) == 2


def test_tf_config_nccl_and_site_defaults() -> None:
    env = env_for("n[1-2]", "1(x2)", 1, 0, SLURM_STEP_RESV_PORTS="20000")
    te = task_env(
        env,
        site_env={"TF_FORCE_GPU_ALLOW_GROWTH": "true"},
        interface_of=lambda host: "eth0" if host == "n1" else None,
    )
    cfg = json.loads(te.set["TF_CONFIG"].value)
    assert cfg == {
        "cluster": {"worker": ["n1:20000", "n2:20000"]},
        "task": {"type": "worker", "index": 1},
    }
    assert te.set["NCCL_SOCKET_IFNAME"].value == "=eth0"
    assert te.set["TF_FORCE_GPU_ALLOW_GROWTH"].value == "true"


OURS = ("TF_CONFIG", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "TF_FORCE_GPU_ALLOW_GROWTH")


def _offering_all(tmp_path: Path, **user: str) -> tuple[dict[str, str], dict[str, str]]:
    """A step for which tfimage offers every one of OURS: two nodes, an interface
    that routes, an active InfiniBand port and a site default."""
    root = tmp_path / "infiniband"
    _hca(root, "mlx5_0", {"1": "4: ACTIVE"})
    env = env_for("n[1-2]", "1(x2)", 0, 0, SLURM_STEP_RESV_PORTS="20000", **user)
    te = task_env(
        env,
        site_env={"TF_FORCE_GPU_ALLOW_GROWTH": "true"},
        interface_of=lambda host: "ib0",
        ib_sysfs=root,
    )
    return {k: v.value for k, v in te.set.items()}, te.kept


def test_without_user_values_tfimage_offers_each_variable(tmp_path: Path) -> None:
    offered, _ = _offering_all(tmp_path)
    assert set(OURS) <= set(offered)


@pytest.mark.parametrize("name", OURS)
def test_a_value_the_user_set_is_never_overridden(tmp_path: Path, name: str) -> None:
    offered, kept = _offering_all(tmp_path, **{name: "the-users-own"})
    assert name not in offered and name in kept, offered
    assert set(OURS) - {name} <= set(offered)  # the others are still offered


def test_single_task_gets_no_tf_config_unless_configured() -> None:
    env = env_for("n1", "1", 0, 0)
    assert "TF_CONFIG" not in task_env(env, interface_of=lambda h: None).set
    assert "TF_CONFIG" in task_env(env, single_task_tf_config=True, interface_of=lambda h: None).set


HUGE = "a[0-65535][0-65535]"


@pytest.mark.parametrize(
    ("var", "text"),
    [
        ("SLURM_STEP_NODELIST", HUGE),
        ("SLURM_STEP_NODELIST", ",".join([HUGE] * 20)),
        ("SLURM_STEP_NODELIST", "n[0-999999999]"),
        ("SLURM_STEP_NODELIST", ",".join(["x"] * 70000)),
        ("SLURM_STEP_NODELIST", "r[" + ",".join(["1"] * 200000) + "]"),
        ("SLURM_STEP_TASKS_PER_NODE", "1(x999999999)"),
        ("SLURM_STEP_TASKS_PER_NODE", ",".join(["999999999(x1)"] * 20)),
        ("SLURM_STEP_RESV_PORTS", ",".join(["1-65535"] * 20)),
        # few names, each long: 65536 of 10 KB would be 650 MB
        ("SLURM_STEP_NODELIST", "x" * 10000 + "[1-65536]"),
        ("SLURM_STEP_NODELIST", "x" * 65000 + "[1-9]"),
        ("SLURM_STEP_NODELIST", "x" * 70000),
        ("SLURM_STEP_TASKS_PER_NODE", "1," * 40000 + "1"),
    ],
)
def test_a_hostile_layout_is_refused_before_it_is_expanded(var: str, text: str) -> None:
    env = {
        "SLURM_JOB_ID": "1",
        "SLURM_STEP_NODELIST": "n1",
        "SLURM_STEP_TASKS_PER_NODE": "1",
        "SLURM_STEP_RESV_PORTS": "20000",
        "SLURM_NODEID": "0",
        "SLURM_LOCALID": "0",
        var: text,
    }
    # Time without tracemalloc (it slows every allocation several times), then memory.
    started = time.monotonic()
    why = "more than 65536|longer than"
    with pytest.raises(StepLayoutError, match=why):
        step_layout(env)
    took = time.monotonic() - started
    tracemalloc.start()
    try:
        with pytest.raises(StepLayoutError, match=why):
            step_layout(env)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert took < 1.0, took
    assert peak < 50 << 20, peak >> 20


def _request(nodelist: str, tasks: str, local: int) -> StepRequest:
    layout = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": tasks,
    }
    return StepRequest("7", "0", 1000, "x:1", layout=layout, node_id=0, local_tasks=local)


def test_a_steps_layout_is_bounded_by_the_sites_step_max_tasks() -> None:
    cfg = Config(registry="r.invalid", step_max_tasks=16)
    assert len(step_env(cfg, _request("n[1-16]", "1(x16)", 1))) == 1
    with pytest.raises(StepLayoutError, match="more than 16"):
        step_env(cfg, _request("n[1-17]", "1(x17)", 1))
    with pytest.raises(StepLayoutError, match="more than step_max_tasks"):
        step_env(cfg, _request("n1", "17", 17))


def test_every_task_of_a_step_shares_one_layout_and_one_answer_bound() -> None:
    cfg = Config(registry="r.invalid")
    env = step_env(cfg, _request("n[1-2]", "4(x2)", 4))
    workers = [json.loads(env[i]["TF_CONFIG"])["cluster"]["worker"] for i in range(4)]
    assert all(w == workers[0] for w in workers) and len(workers[0]) == 8
    assert [json.loads(env[i]["TF_CONFIG"])["task"]["index"] for i in range(4)] == [0, 1, 2, 3]
    # 64 tasks here, each with a TF_CONFIG of 60000 workers: more than the plugin
    # takes in one answer, refused before it is built.
    started = time.monotonic()
    with pytest.raises(StepLayoutError, match="the plugin takes at most 1024 KiB"):
        step_env(cfg, _request("n[10000-69999]", "64,1(x59999)", 64))
    assert time.monotonic() - started < 1.0
    with pytest.raises(StepLayoutError, match="local tasks, but the step's layout gives"):
        step_env(cfg, _request("n[1-2]", "1(x2)", 2))


def test_the_nccl_interface_is_the_one_routing_to_the_first_node() -> None:
    assert route_interface("localhost") == "lo"  # the kernel's answer, no psutil
    assert route_interface("x" * 300) is None  # a name no resolver takes: not a crash


def _hca(root: Path, name: str, ports: dict[str, str]) -> None:
    for port, state in ports.items():
        d = root / name / "ports" / port
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")


def test_nccl_ib_hca_names_the_active_ports_only(tmp_path: Path) -> None:
    """A fake /sys/class/infiniband as the kernel lays it out (ib_port_state)."""
    root = tmp_path / "infiniband"
    _hca(root, "mlx5_0", {"1": "4: ACTIVE"})
    _hca(root, "mlx5_1", {"1": "1: DOWN", "2": "4: ACTIVE"})
    _hca(root, "mlx5_2", {"1": "2: INIT"})
    _hca(root, "mlx5_10", {"1": "4: ACTIVE", "10": "4: ACTIVE", "2": "4: ACTIVE"})
    assert ib_hcas(root) == "mlx5_0:1,mlx5_1:2,mlx5_10:1,mlx5_10:2,mlx5_10:10"
    assert ib_hcas(tmp_path / "none") is None
    _hca(tmp_path / "down", "mlx5_0", {"1": "1: DOWN"})
    assert ib_hcas(tmp_path / "down") is None
    env = step_env(Config(registry="r.invalid", ib_sysfs=str(root)), _request("n[1-2]", "1(x2)", 1))
    assert env[0]["NCCL_IB_HCA"] == "mlx5_0:1,mlx5_1:2,mlx5_10:1,mlx5_10:2,mlx5_10:10"
    assert (
        "NCCL_IB_HCA"
        not in step_env(
            Config(registry="r.invalid", ib_sysfs=str(tmp_path / "down")), _request("n1", "2", 2)
        )[1]
    )


# --- edges: the last value allowed works, the first one past it is refused ----------


def test_a_node_may_use_every_port_of_the_default_range_and_no_other() -> None:
    env = env_for("n1", "1000", 0, 0)
    lay = step_layout(env)
    assert sorted(int(w.rsplit(":", 1)[1]) for w in lay.workers) == list(range(29000, 30000))
    got = task_env(env, interface_of=lambda h: None, ib_sysfs=Path("/nonexistent"))
    assert "hashed from job and step in 29000-29999" in got.set["TF_CONFIG"].why
    with pytest.raises(StepLayoutError, match="1001 tasks on a node but only 1000 ports"):
        step_layout(env_for("n1", "1001", 0, 0))


def test_a_task_outside_the_layout_is_refused_on_either_axis() -> None:
    for node, local in ((2, 0), (0, 2), (1, 1), (-1, 0)):
        with pytest.raises(StepLayoutError, match="outside the step's layout"):
            step_layout(env_for("n[1-2]", "2,1", node, local, SLURM_STEP_RESV_PORTS="20000-20001"))


def test_the_explanation_names_eight_nodes_and_counts_the_rest() -> None:
    def why(nodes: str, tpn: str) -> str:
        env = env_for(nodes, tpn, 0, 0, SLURM_STEP_RESV_PORTS="20000")
        return task_env(env, interface_of=lambda h: None).set["TF_CONFIG"].why

    eight = ",".join(f"n{i}" for i in range(1, 9))
    assert f"over {eight}; ports reserved by Slurm" in why("n[1-8]", "1(x8)")
    assert f"over {eight},... (9); ports" in why("n[1-9]", "1(x9)")


def test_a_hostlist_may_name_exactly_the_limit_and_not_one_more() -> None:
    assert len(expand_hostlist("n[1-65536]")) == 65536
    with pytest.raises(StepLayoutError, match="more than 65536 nodes"):
        expand_hostlist("n[0-65536]")
    assert expand_hostlist("a[1-2],b[1-2]", limit=4) == ["a1", "a2", "b1", "b2"]
    with pytest.raises(StepLayoutError, match="more than 4 nodes"):
        expand_hostlist("a[1-2],b[1-2],c", limit=4)


def test_a_host_name_of_255_bytes_is_taken_and_256_refused() -> None:
    assert expand_hostlist("a" * 255) == ["a" * 255]
    assert expand_hostlist("a" * 252 + "[1-2]") == ["a" * 252 + "1", "a" * 252 + "2"]
    for bad in ("a" * 256, "a" * 254 + "[9-10]"):
        with pytest.raises(StepLayoutError, match="longer than 255 bytes"):
            expand_hostlist(bad)


def test_a_layout_variable_may_be_64_kib_and_not_a_byte_more() -> None:
    names = "nn" + ",n" * 32767  # 65536 bytes, 32768 names
    assert len(names) == 65536 and len(expand_hostlist(names)) == 32768
    with pytest.raises(StepLayoutError, match="SLURM_STEP_NODELIST is longer than 65536 bytes"):
        expand_hostlist("n" + names)


def test_a_bracket_past_the_limit_is_refused_even_when_its_last_range_tips_it() -> None:
    assert expand_hostlist("n[1-2]", limit=2) == ["n1", "n2"]
    with pytest.raises(StepLayoutError, match="more than 2 nodes"):
        expand_hostlist("n[1-2,3]", limit=2)


def test_nccl_socket_ifname_says_it_routes_to_the_first_node() -> None:
    env = env_for("n[1-2]", "1,1", 1, 0, SLURM_STEP_RESV_PORTS="20000")
    got = task_env(env, interface_of=lambda h: {"n1": "ib0"}.get(h), ib_sysfs=Path("/nonexistent"))
    assert got.set["NCCL_SOCKET_IFNAME"].value == "=ib0"
    assert got.set["NCCL_SOCKET_IFNAME"].why.endswith("first node n1")

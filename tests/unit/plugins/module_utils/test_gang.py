# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""_gang: an instance over several hosts - its checks (each naming the field) and every member's rank arguments."""
from __future__ import annotations

import typing as t

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._units._gang import (
    INFINIBAND_DEVICE_ALLOW, GangError, across_hosts, launch_problems, member_args, member_launch, parse)

FIELD = "gpufleet_instances[0].gang"


def gang(**kw: t.Any) -> dict[str, t.Any]:
    return {"mode": "mp", "members": ["gpu-a1", "gpu-a2"], **kw}


def test_tp8_pp2_over_two_hosts_gives_each_node_its_rank_and_headless_follower():
    checked = parse(gang(address="10.0.0.11"), field=FIELD, serve_args={"tensor_parallel_size": 8, "pipeline_parallel_size": 2},
                    gpus={"gpu-a1": 8, "gpu-a2": 8})
    assert checked.leader == "gpu-a1" and checked.port == 29501 and checked.gpus_per_engine == 16
    assert member_args(checked, "gpu-a1") == ["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.11",
                                              "--master-port", "29501"]
    assert member_args(checked, "gpu-a2") == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.11",
                                              "--master-port", "29501", "--headless"]
    assert checked.serves_api("gpu-a1") and not checked.serves_api("gpu-a2")
    # vLLM numbers node 1's ranks 8-15 (node rank x ranks per node); the plan keys its floors so
    assert [checked.first_rank(h) for h in checked.members] == [0, 8]
    assert {k: member_launch(checked, "gpu-a2")[k] for k in ("first_rank", "ranks", "node_rank")} == {"first_rank": 8, "ranks": 8, "node_rank": 1}


def test_the_leader_is_node_rank_0_and_the_others_follow_in_their_order():
    checked = parse(gang(members=["b", "c", "a"], leader="c", port=29600), field=FIELD, serve_args={"tensor_parallel_size": 3},
                    gpus={"a": 1, "b": 1, "c": 1}, leader_address="10.0.0.3")
    assert checked.members == ("c", "b", "a") and checked.address == "10.0.0.3"
    assert [member_args(checked, h)[3] for h in ("c", "b", "a")] == ["0", "1", "2"]


def test_data_parallel_over_four_hosts_one_api_on_the_leader():
    members = ["d1", "d2", "d3", "d4"]
    checked = parse({"mode": "dp", "members": members}, field=FIELD, serve_args={"data-parallel-size": 16, "tensor_parallel_size": 2},
                    gpus=dict.fromkeys(members, 8), leader_address="10.0.1.1")
    assert [checked.local_engines(m) for m in members] == [4, 4, 4, 4]
    assert member_args(checked, "d1") == ["--data-parallel-size", "16", "--data-parallel-size-local", "4",
                                          "--data-parallel-address", "10.0.1.1", "--data-parallel-rpc-port", "29550"]
    assert member_args(checked, "d3") == ["--data-parallel-size", "16", "--data-parallel-size-local", "4",
                                          "--data-parallel-address", "10.0.1.1", "--data-parallel-rpc-port", "29550",
                                          "--data-parallel-start-rank", "8", "--headless"]
    # an engine's ranks are numbered from its data-parallel rank x TP x PP: d3's first engine is DP rank 8, its first rank 16
    assert [checked.first_rank(m) for m in members] == [0, 8, 16, 24]
    assert checked.first_rank("d3") == checked.start_rank("d3") * checked.gpus_per_engine


def test_hybrid_data_parallel_gives_every_member_its_api_and_start_rank():
    checked = parse({"mode": "dp-hybrid", "members": ["h1", "h2"], "address": "h1.internal"}, field=FIELD,
                    serve_args={"data_parallel_size": 3}, gpus={"h1": 2, "h2": 1})
    assert member_args(checked, "h1")[-3:] == ["--data-parallel-start-rank", "0", "--data-parallel-hybrid-lb"]
    assert member_args(checked, "h2") == ["--data-parallel-size", "3", "--data-parallel-size-local", "1",
                                          "--data-parallel-address", "h1.internal", "--data-parallel-rpc-port", "29550",
                                          "--data-parallel-start-rank", "2", "--data-parallel-hybrid-lb"]
    assert "--headless" not in member_args(checked, "h2") and checked.serves_api("h2")


@pytest.mark.parametrize(("given", "serve_args", "gpus", "message"), [
    ("mp", {}, {}, f"{FIELD}: expected a mapping with mode and members, got str"),
    (gang(mode="ray"), {}, {}, f"{FIELD}.mode: ray is not managed by the collection"),
    (gang(mode="tp"), {}, {}, f"{FIELD}.mode: expected one of mp, dp, dp-hybrid, got 'tp'"),
    (gang(members=["gpu-a1"]), {}, {}, f"{FIELD}.members: expected a list of two or more inventory hosts"),
    (gang(members=["gpu-a1", "gpu-a1"]), {}, {}, f"{FIELD}.members"),
    (gang(members=["gpu-a1", "bad\nhost"]), {}, {}, f"{FIELD}.members[1]"),
    (gang(leader="gpu-b9"), {}, {}, f"{FIELD}.leader: 'gpu-b9' is not one of the members (gpu-a1, gpu-a2)"),
    (gang(rank=1), {}, {}, f"{FIELD}: unknown key(s) rank; a gang takes mode, members, leader, address, port, addresses, interface"),
    (gang(), {}, {}, f"{FIELD}.address: the leader gpu-a1 has no address"),
    (gang(address="10.0.0.1 10.0.0.2"), {}, {}, f"{FIELD}.address: must not contain whitespace"),
    (gang(address="10.0.0.1", port=70000), {}, {}, f"{FIELD}.port"),
    (gang(address="10.0.0.1"), {"node_rank": 1}, {}, "gpufleet_serve_args: node_rank set(s) what the gang"),
    (gang(address="10.0.0.1"), {"tensor-parallel-size": 0}, {}, "gpufleet_serve_args.tensor_parallel_size"),
    (gang(address="10.0.0.1"), {"tensor_parallel_size": 8}, {"gpu-a1": 8},
     f"{FIELD}.members: gpu-a2 give(s) this instance no GPUs"),
    (gang(address="10.0.0.1"), {"tensor_parallel_size": 8, "pipeline_parallel_size": 2}, {"gpu-a1": 8, "gpu-a2": 4},
     f"{FIELD}: tensor_parallel_size 8 x pipeline_parallel_size 2 x data_parallel_size 1 = 16 GPUs, but the members hold 12 "
     "(gpu-a1: 8, gpu-a2: 4)"),
    (gang(address="10.0.0.1"), {"tensor_parallel_size": 3}, {"gpu-a1": 2, "gpu-a2": 1},
     f"{FIELD}: mode mp needs the same number of GPUs on every member"),
    (gang(address="10.0.0.1"), {"data_parallel_size": 2}, {"gpu-a1": 1, "gpu-a2": 1},
     f"{FIELD}.mode: mp runs one engine over the members; data_parallel_size 2 needs mode dp or dp-hybrid"),
    (gang(mode="dp", address="10.0.0.1"), {"data_parallel_size": 2, "tensor_parallel_size": 2}, {"gpu-a1": 3, "gpu-a2": 1},
     f"{FIELD}: mode dp runs whole engines of tensor_parallel_size x pipeline_parallel_size = 2 GPUs on each member; "
     "gpu-a1 holds 3, gpu-a2 holds 1"),
])
def test_what_cannot_run_is_refused_naming_the_field(given, serve_args, gpus, message):
    with pytest.raises(GangError) as exc:
        parse(given, field=FIELD, serve_args=serve_args, gpus=gpus)
    assert str(exc.value).startswith(message), str(exc.value)


def test_a_host_outside_the_gang_has_no_rank():
    checked = parse(gang(address="10.0.0.1"), field=FIELD, serve_args={"tensor_parallel_size": 2}, gpus={"gpu-a1": 1, "gpu-a2": 1})
    with pytest.raises(GangError, match="gpu-b1 is not a member of the gang"):
        member_args(checked, "gpu-b1")


def test_every_member_must_give_the_same_gang_and_a_host_joins_one_gang():
    one = gang(address="10.0.0.1")
    assert across_hosts({"gpu-a1": {"big": one}, "gpu-a2": {"big": dict(one)}, "gpu-a3": {}}) == []
    problems = across_hosts({"gpu-a1": {"big": one}, "gpu-a2": {"big": dict(one, port=29600)}})
    assert problems[0].startswith("gpu-a1: gpufleet_instances instance big: member gpu-a2 gives another gang")
    assert across_hosts({"gpu-a1": {"big": one}, "gpu-a2": {}})[0].startswith(
        "gpu-a1: gpufleet_instances instance big: member gpu-a2 gives no such instance")
    assert across_hosts({"gpu-a1": {"big": one}})[0] == "gpu-a1: gpufleet_instances instance big: member gpu-a2 is not a host of this run"
    assert across_hosts({"gpu-a3": {"big": one}})[0].startswith(
        "gpu-a3: gpufleet_instances instance big: this host is not one of the gang's members (gpu-a1, gpu-a2)")
    other = gang(members=["gpu-a1", "gpu-a3"], address="10.0.0.1")
    views = {"gpu-a1": {"big": one, "side": other}, "gpu-a2": {"big": one}, "gpu-a3": {"side": other}}
    assert across_hosts(views) == ["gpu-a1: a member of two gangs, big (members gpu-a1, gpu-a2) and side (members gpu-a1, gpu-a3)"]


def test_an_instance_check_without_the_gang_checks_refuses_a_gang_naming_the_field():
    from ansible_collections.gpufleet.vllm.plugins.filter.serve import FilterModule

    problems = FilterModule().filters()["vllm_instances_problems"](
        [{"name": "dsv3", "gpus": [0, 1], "port": 8000, "gang": gang(address="10.0.0.1")}], "gpufleet_instances")
    assert problems == ["gpufleet_instances[0].gang: an instance that spans hosts needs its member's rank: "
                        "vllm_service_gang_launch.dsv3 (docs/multi-host.md)"]


@pytest.mark.parametrize(("given", "message"), [
    (gang(address="10.0.0.1", addresses=["10.0.0.2"]), f"{FIELD}.addresses: expected a mapping of member -> its own address, got list"),
    (gang(address="10.0.0.1", addresses={"gpu-a2": "10.0.0.2 x"}), f"{FIELD}.addresses.gpu-a2: must not contain whitespace"),
    (gang(address="10.0.0.1", addresses={"gpu-a2": ""}), f"{FIELD}.addresses.gpu-a2"),
    (gang(address="10.0.0.1", interface="eth0,eth1"), f"{FIELD}.interface: expected one network interface name"),
    (gang(address="10.0.0.1", interface="a-name-longer-than-15"), f"{FIELD}.interface: expected one network interface name"),
    (gang(address="10.0.0.1", interface=3), f"{FIELD}.interface"),
])
def test_member_addresses_and_the_interface_are_checked_naming_the_field(given, message):
    with pytest.raises(GangError) as exc:
        parse(given, field=FIELD, serve_args={"tensor_parallel_size": 2}, gpus={"gpu-a1": 1, "gpu-a2": 1})
    assert str(exc.value).startswith(message), str(exc.value)


def test_a_members_launch_adds_its_rank_address_and_sandbox():
    checked = parse(gang(address="10.0.0.11", interface="bond0.100"), field=FIELD, serve_args={"tensor_parallel_size": 2},
                    gpus={"gpu-a1": 1, "gpu-a2": 1}, member_addresses={"gpu-a2": "10.0.0.12"})
    follower = member_launch(checked, "gpu-a2", infiniband=True)
    assert follower["args"] == member_args(checked, "gpu-a2")
    assert follower["environment"] == {"VLLM_HOST_IP": "10.0.0.12", "NCCL_SOCKET_IFNAME": "bond0.100", "GLOO_SOCKET_IFNAME": "bond0.100"}
    assert follower["device_allow"] == list(INFINIBAND_DEVICE_ALLOW) and follower["limit_memlock"] == "infinity"
    # without member addresses a follower is reached at its name, the leader at the gang's address
    bare = parse(gang(address="10.0.0.11"), field=FIELD, serve_args={"tensor_parallel_size": 2}, gpus={"gpu-a1": 1, "gpu-a2": 1})
    assert member_launch(bare, "gpu-a1")["environment"] == {"VLLM_HOST_IP": "10.0.0.11"}
    assert member_launch(bare, "gpu-a2")["environment"] == {"VLLM_HOST_IP": "gpu-a2"} and member_launch(bare, "gpu-a2")["device_allow"] == []


@pytest.mark.parametrize("key, value, message", [
    ("first_rank", -1, "launch.first_rank: must be an integer in >= 0, got -1"),
    ("ranks", 0, "launch.ranks: must be an integer in >= 1, got 0"),
    ("first_rank", "x", "launch.first_rank: expected an integer"),
    ("members", [], "launch.members: expected the gang's member hosts, a non-empty list"),
    ("members", ["gpu-a1", "gpu\na2"], "launch.members[1]:"),
])
def test_a_launchs_rank_place_is_checked_naming_the_field(key, value, message):
    checked = parse(gang(address="10.0.0.11"), field=FIELD, serve_args={"tensor_parallel_size": 2}, gpus={"gpu-a1": 1, "gpu-a2": 1})
    launch = dict(member_launch(checked, "gpu-a2"), **{key: value})
    problems = launch_problems(launch, "launch")
    assert any(p.startswith(message) for p in problems), problems
    assert launch_problems(member_launch(checked, "gpu-a2"), "launch") == []

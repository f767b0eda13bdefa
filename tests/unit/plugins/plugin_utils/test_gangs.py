# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A run's gangs from its hosts' variables (plugin_utils/_gangs): the inventory's checks across
members, what a follower resolves, and what the probe shows of every member."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _gangs


def member(gang: dict[str, Any], gpus: list[int], **more: Any) -> dict[str, Any]:
    return {"gpufleet_host_class": "h100-dsv3", "gpufleet_model": "/srv/models/dsv3", "ansible_host": more.pop("ansible_host", None),
            "gpufleet_serve_args": {"tensor_parallel_size": 8, "pipeline_parallel_size": 2, "max_model_len": 32768},
            "gpufleet_instances": [{"name": "dsv3", "port": 8000, "gpus": gpus, "gang": copy.deepcopy(gang)}], **more}


GANG = {"mode": "mp", "members": ["a1", "a2"]}


def two_hosts(gang: dict[str, Any] | None = None, **overrides: dict[str, Any]) -> dict[str, Any]:
    hv = {"a1": member(gang or GANG, list(range(8)), ansible_host="10.20.0.11"),
          "a2": member(gang or GANG, list(range(8)), ansible_host="10.20.0.12"),
          "solo": {"gpufleet_host_class": "l40s", "gpufleet_instances": [{"name": "main", "port": 8000, "gpus": [0]}]}}
    for host, values in overrides.items():
        hv[host].update(values)
    return hv


def test_a_gang_the_members_agree_on_has_no_problem_and_is_described_once():
    hv = two_hosts()
    assert _gangs.inventory_problems(hv, ["a1", "a2", "solo"]) == []
    assert _gangs.described(hv, ["a1", "a2", "solo"]) == [{
        "name": "dsv3", "mode": "mp", "members": ["a1", "a2"], "leader": "a1", "address": "10.20.0.11", "port": 29501,
        "tensor_parallel_size": 8, "pipeline_parallel_size": 2, "data_parallel_size": 1, "gpus": {"a1": 8, "a2": 8},
        "host_class": "h100-dsv3"}]


def test_the_leader_address_defaults_to_its_inventory_name_without_ansible_host():
    hv = two_hosts(a1={"ansible_host": None})
    del hv["a1"]["ansible_host"]
    assert _gangs.described(hv, ["a1", "a2"])[0]["address"] == "a1"
    assert _gangs.addresses_to_resolve(hv, "a2") == ["a1"] and _gangs.addresses_to_resolve(hv, "a1") == []


def test_a_follower_resolves_the_given_address_the_leader_nothing():
    hv = two_hosts({**GANG, "address": "dsv3-leader.example.net", "leader": "a2"})
    assert _gangs.addresses_to_resolve(hv, "a1") == ["dsv3-leader.example.net"]
    assert _gangs.addresses_to_resolve(hv, "a2") == [] and _gangs.addresses_to_resolve(hv, "solo") == []


@pytest.mark.parametrize("hv, hosts, expected", [
    (two_hosts({**GANG, "leader": "a3"}), ["a1", "a2"], "a1: gpufleet_instances[0].gang.leader: 'a3' is not one of the members (a1, a2)"),
    (two_hosts({**GANG, "mode": "ray"}), ["a1", "a2"], "a1: gpufleet_instances[0].gang.mode: ray is not managed"),
    (two_hosts(a2={"gpufleet_host_class": "h100-other"}), ["a1", "a2"],
     "a1: gpufleet_instances[0].gang: every member must give the same gpufleet_host_class (one engine runs over them), got "
     "a1: 'h100-dsv3'; a2: 'h100-other'"),
    (two_hosts(a2={"gpufleet_model": "/srv/models/other"}), ["a1", "a2"], "every member must give the same gpufleet_model"),
    (two_hosts(a2={"gpufleet_serve_args": {"tensor_parallel_size": 8, "pipeline_parallel_size": 2, "max_model_len": 8192}}), ["a1", "a2"],
     "every member must give the same gpufleet_serve_args"),
    (two_hosts(), ["a1"], "a1: gpufleet_instances instance dsv3: member a2 is not a host of this run"),
    (two_hosts(solo={"gpufleet_instances": [{"name": "dsv3", "port": 8000, "gpus": [0], "gang": GANG}]}), ["a1", "a2", "solo"],
     "solo: gpufleet_instances instance dsv3: this host is not one of the gang's members (a1, a2)"),
    (two_hosts(a2={"gpufleet_instances": [{"name": "dsv3", "port": 8000, "gpus": list(range(8)), "gang": GANG},
                                          {"name": "small", "port": 8001, "gpus": [8]}]}), ["a1", "a2"],
     "a2: gpufleet_instances: a member of an instance that spans hosts runs no other instance (got 2: dsv3, small); its class is "
     "planned as the gang's engine"),
])
def test_inventory_problems_name_the_host_and_field(hv, hosts, expected):
    problems = _gangs.inventory_problems(hv, hosts)
    assert any(p.startswith(expected) or expected in p for p in problems), problems


def test_a_gang_given_alike_by_both_members_is_named_once():
    problems = _gangs.inventory_problems(two_hosts({**GANG, "port": 70000}), ["a1", "a2"])
    assert problems == ["a1: gpufleet_instances[0].gang.port: must be an integer in 1..65535, got 70000"]


def test_sizes_against_the_gpus_of_every_member():
    hv = two_hosts()
    hv["a2"]["gpufleet_instances"][0]["gpus"] = [0, 1, 2, 3]
    problems = _gangs.inventory_problems(hv, ["a1", "a2"])
    assert problems == ["a1: gpufleet_instances[0].gang: tensor_parallel_size 8 x pipeline_parallel_size 2 x data_parallel_size 1 = 16 GPUs, "
                        "but the members hold 12 (a1: 8, a2: 4)"]


def probed(hv: dict[str, Any], names: dict[str, str], resolved: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    for host, model in names.items():
        hv[host]["gpufleet_probe_result"] = {"gpus": [{"index": i, "name": model} for i in range(8)], "resolved": []}
    hv["a2"]["gpufleet_probe_result"]["resolved"] = resolved if resolved is not None else [
        {"name": "10.20.0.11", "addresses": ["10.20.0.11"], "error": None}]
    return hv


def test_probed_members_with_one_model_and_a_resolved_address_pass():
    hv = probed(two_hosts(), {"a1": "NVIDIA H100 80GB HBM3", "a2": "NVIDIA H100 80GB HBM3"})
    assert _gangs.probed_problems(hv, ["a1", "a2", "solo"]) == []


def test_ranks_on_two_gpu_models_are_named_with_every_gpu():
    hv = probed(two_hosts(), {"a1": "NVIDIA H100 80GB HBM3", "a2": "NVIDIA H100 PCIe"})
    hv["a2"]["gpufleet_probe_result"]["gpus"][7]["name"] = "NVIDIA H100 80GB HBM3"
    (problem,) = _gangs.probed_problems(hv, ["a1", "a2"])
    assert problem.startswith("a1: gpufleet_instances instance dsv3: ranks on different GPU models (NVIDIA H100 80GB HBM3: "
                              "a1 GPU 0, a1 GPU 1, a1 GPU 2, a1 GPU 3, a1 GPU 4, a1 GPU 5, a1 GPU 6, a1 GPU 7, a2 GPU 7; "
                              "NVIDIA H100 PCIe: a2 GPU 0, "), problem


def test_a_gpu_index_one_member_does_not_have_is_named_as_such():
    hv = probed(two_hosts(), {"a1": "NVIDIA H100", "a2": "NVIDIA H100"})
    hv["a2"]["gpufleet_probe_result"]["gpus"] = hv["a2"]["gpufleet_probe_result"]["gpus"][:7]
    assert _gangs.probed_problems(hv, ["a1", "a2"]) == [
        "a2: gpufleet_instances instance dsv3: GPU(s) 7 of the gang are not on this host (the probe found 0, 1, 2, 3, 4, 5, 6)"]


def test_an_address_a_follower_cannot_resolve_names_the_follower_and_the_error():
    hv = probed(two_hosts(), {"a1": "NVIDIA H100", "a2": "NVIDIA H100"},
                resolved=[{"name": "10.20.0.11", "addresses": [], "error": "[Errno -2] Name or service not known"}])
    assert _gangs.probed_problems(hv, ["a1", "a2"]) == [
        "a2: gpufleet_instances instance dsv3: the gang's address 10.20.0.11 (the leader a1) does not resolve on this follower: "
        "[Errno -2] Name or service not known; set gang.address to an address every member resolves"]
    hv["a2"]["gpufleet_probe_result"]["resolved"] = []
    assert _gangs.probed_problems(hv, ["a1", "a2"]) == [
        "a2: gpufleet_instances instance dsv3: the snapshot did not resolve the gang's address 10.20.0.11"]


@pytest.mark.parametrize("result, why", [
    ({"unreachable": True, "msg": "Failed to connect to the host via ssh"}, "Failed to connect to the host via ssh"),
    ({"failed": True, "msg": "NVML: driver not loaded"}, "NVML: driver not loaded"),
    (None, "no snapshot"),
])
def test_a_member_the_probe_lost_fails_the_whole_gang(result, why):
    hv = probed(two_hosts(), {"a1": "NVIDIA H100", "a2": "NVIDIA H100"})
    if result is None:
        del hv["a2"]["gpufleet_probe_result"]
    else:
        hv["a2"]["gpufleet_probe_result"] = result
    assert _gangs.probed_problems(hv, ["a1", "a2"]) == [
        f"a2: gpufleet_instances instance dsv3: this member of the gang was not probed ({why}); a gang runs on all of its members or not at all"]


def test_a_gang_of_a_class_the_run_did_not_choose_is_not_looked_at():
    hv = two_hosts()
    for host in ("a1", "a2"):
        hv[host]["gpufleet_probe_result"] = {"skipped": True, "changed": False}
    assert _gangs.probed_problems(hv, ["a1", "a2"]) == []


@pytest.mark.parametrize("members, expected", [
    ([["a1", "a2"]], "gpufleet_instances[0].gang.members: expected a list of two or more inventory hosts"),
    ([{"host": "a1"}, "a2"], "gpufleet_instances[0].gang.members[0]: expected a string"),
])
def test_members_that_are_no_host_names_are_named_not_a_crash(members, expected):
    problems = _gangs.inventory_problems(two_hosts({"mode": "mp", "members": members}), ["a1", "a2"])
    assert any(expected in p for p in problems), problems


def test_serve_options_in_another_key_order_or_none_for_empty_are_the_same():
    hv = two_hosts(a2={"gpufleet_serve_args": {"max_model_len": 32768, "pipeline_parallel_size": 2, "tensor_parallel_size": 8}})
    assert _gangs.inventory_problems(hv, ["a1", "a2"]) == []
    hv = two_hosts()
    hv["a1"]["gpufleet_instances"][0]["gang"] = {"members": ["a1", "a2"], "mode": "mp"}  # the gang's keys in another order
    assert _gangs.inventory_problems(hv, ["a1", "a2"]) == []
    dp = {"mode": "dp", "members": ["a1", "a2"]}
    hv = two_hosts(dp, a1={"gpufleet_serve_args": None}, a2={"gpufleet_serve_args": {}})
    for host in ("a1", "a2"):
        hv[host]["gpufleet_instances"][0]["gpus"] = [0]
    assert _gangs.inventory_problems(hv, ["a1", "a2"]) == [
        "a1: gpufleet_instances[0].gang: tensor_parallel_size 1 x pipeline_parallel_size 1 x data_parallel_size 1 = 1 GPUs, "
        "but the members hold 2 (a1: 1, a2: 1)"]


def test_a_gang_gpu_the_member_does_not_have_is_named_even_when_every_rank_misses():
    hv = probed(two_hosts(), {"a1": "NVIDIA H100", "a2": "NVIDIA H100"})
    for host in ("a1", "a2"):
        hv[host]["gpufleet_probe_result"]["gpus"] = []
    problems = _gangs.probed_problems(hv, ["a1", "a2"])
    assert problems == [f"{h}: gpufleet_instances instance dsv3: GPU(s) 0, 1, 2, 3, 4, 5, 6, 7 of the gang are not on this host "
                        "(the probe found none)" for h in ("a1", "a2")]


def test_the_host_variables_are_read_once_per_call():
    class Counting(dict):
        reads = 0

        def get(self, key, default=None):
            Counting.reads += 1
            return super().get(key, default)

    names = [f"h{i}" for i in range(32)]
    gang = {"mode": "mp", "members": names}
    hv = Counting({n: member(gang, [0, 1]) for n in names})
    for n in names:
        hv[n]["gpufleet_serve_args"] = {"tensor_parallel_size": 2, "pipeline_parallel_size": 32}
        hv[n]["gpufleet_probe_result"] = {"gpus": [{"index": 0, "name": "NVIDIA H100"}, {"index": 1, "name": "NVIDIA H100"}],
                                          "resolved": [{"name": "h0", "addresses": ["10.0.0.1"], "error": None}]}
    assert _gangs.inventory_problems(hv, names) == [] and _gangs.probed_problems(hv, names) == []
    assert Counting.reads == 2 * len(names), "each host's variables once per call"


def test_each_member_launches_its_rank_at_its_own_address():
    """VLLM_HOST_IP is the member's own address (its ansible_host), the leader's the gang's address; the InfiniBand
    devices are allowed only on the member whose snapshot found them; a host outside every gang launches nothing."""
    hv = probed(two_hosts(dict(GANG, interface="ib0")), {"a1": "H100", "a2": "H100"})
    hv["a2"]["gpufleet_probe_result"]["infiniband"] = ["rdma_cm", "uverbs0"]
    leader, follower = _gangs.member_launches(hv, "a1")["dsv3"], _gangs.member_launches(hv, "a2")["dsv3"]
    assert leader["environment"] == {"VLLM_HOST_IP": "10.20.0.11", "NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}
    assert follower["environment"]["VLLM_HOST_IP"] == "10.20.0.12"
    assert leader["args"][-2:] == ["--master-port", "29501"] and follower["args"][-1] == "--headless"
    assert leader["device_allow"] == [] and follower["device_allow"] == ["char-infiniband_verbs rw", "/dev/infiniband/rdma_cm rw"]
    assert leader["limit_memlock"] == follower["limit_memlock"] == "infinity"
    assert (leader["node_rank"], follower["node_rank"], follower["leader"], follower["serves_api"]) == (0, 1, "a1", False)
    # every member knows the whole gang, leader first: its deploy goes on only with all of them
    assert leader["members"] == follower["members"] == ["a1", "a2"]
    assert _gangs.member_launches(hv, "solo") == {}


def test_the_gangs_addresses_override_each_members_own():
    hv = two_hosts(dict(GANG, address="10.30.0.11", addresses={"a2": "10.30.0.12"}))
    assert _gangs.member_launches(hv, "a1")["dsv3"]["environment"] == {"VLLM_HOST_IP": "10.30.0.11"}
    assert _gangs.member_launches(hv, "a2")["dsv3"]["environment"] == {"VLLM_HOST_IP": "10.30.0.12"}
    hv = two_hosts(dict(GANG, addresses={"a3": "10.30.0.13"}))
    assert _gangs.inventory_problems(hv, ["a1", "a2"]) == [
        "a1: gpufleet_instances[0].gang.addresses: a3 is/are not member(s) of the gang (a1, a2)"]
    with pytest.raises(ValueError, match=r"gang\.addresses: a3"):
        _gangs.member_launches(hv, "a2")


def test_a_gang_keys_its_reference_by_its_layout_and_the_canarys_infiniband():
    hv = probed(two_hosts(), {"a1": "H100", "a2": "H100"})
    hv["a1"]["gpufleet_probe_result"]["infiniband"] = ["uverbs0", "rdma_cm"]
    assert _gangs.key_fields(hv, "a1", "dsv3") == {"gang_mode": "mp", "nnodes": 2, "gang_layout": [8, 8],
                                                   "infiniband": ["uverbs0", "rdma_cm"]}
    # the follower's view of the same gang: its own devices (none found)
    assert _gangs.key_fields(hv, "a2", "dsv3")["infiniband"] == []
    # a one-host instance, or a name the host does not run, adds nothing to its key
    assert _gangs.key_fields(hv, "solo", "main") == {} and _gangs.key_fields(hv, "a1", "other") == {}


def test_a_data_parallel_gang_over_uneven_members_keys_each_members_gpus():
    gang = {"mode": "dp", "members": ["a1", "a2"]}
    hv = two_hosts(gang)
    hv["a1"]["gpufleet_serve_args"] = hv["a2"]["gpufleet_serve_args"] = {"tensor_parallel_size": 2, "data_parallel_size": 3}
    hv["a1"]["gpufleet_instances"][0]["gpus"] = [0, 1, 2, 3]
    hv["a2"]["gpufleet_instances"][0]["gpus"] = [0, 1]
    assert _gangs.inventory_problems(hv, ["a1", "a2"]) == []
    assert _gangs.key_fields(hv, "a2", "dsv3") == {"gang_mode": "dp", "nnodes": 2, "gang_layout": [4, 2], "infiniband": []}


def test_each_member_knows_its_gang_and_where_its_ranks_lie():
    """TP8 x PP2 over two hosts: the members leader first; the follower's ranks are 8-15 of one planning member."""
    hv = two_hosts({"mode": "mp", "members": ["a2", "a1"], "leader": "a2"})
    assert _gangs.members_of(hv, "a1", "dsv3") == ["a2", "a1"] == _gangs.members_of(hv, "a2", "dsv3")
    assert _gangs.members_of(hv, "solo", "main") == [] and _gangs.members_of(hv, "a1", "other") == []
    places = _gangs.rank_places(hv, ["a1", "a2", "solo"])
    assert places == {("a2", "dsv3"): _gangs.RankPlace("a2/dsv3", 0, ("a2", "a1")),
                      ("a1", "dsv3"): _gangs.RankPlace("a2/dsv3", 8, ("a2", "a1"))}


def test_a_class_canary_is_the_first_host_by_name_or_the_named_one_and_a_gang_runs_it_whole():
    """The canary host is gpufleet_canary_host (read on the class's first host by name), else that first host; when
    its first instance spans hosts, every member runs the canaries, the leader first. Each host read once."""
    hv = two_hosts({"mode": "mp", "members": ["a2", "a1"], "leader": "a2"})
    hv.update({"b2": {"gpufleet_instances": [{"name": "main", "gpus": [0]}]}, "b1": {"gpufleet_instances": []}})
    assert _gangs.canary_hosts(hv, ["b2", "b1"]) == ["b1"]
    assert _gangs.canary_hosts(hv, ["solo"]) == ["solo"]
    hv["b1"]["gpufleet_canary_host"] = "b2"
    assert _gangs.canary_hosts(hv, ["b1", "b2"]) == ["b2"]
    # a follower named, or first by name: the gang's leader decides, with every member
    assert _gangs.canary_hosts(hv, ["a2", "a1"]) == ["a2", "a1"]
    # a host named that is no host of the class comes back as it is: the planning play fails the class, naming it
    hv["b1"]["gpufleet_canary_host"] = "nowhere"
    assert _gangs.canary_hosts(hv, ["b1", "b2"]) == ["nowhere"]
    assert _gangs.canary_hosts(hv, []) == []

    class Counting(dict):
        reads = 0

        def get(self, key, default=None):
            Counting.reads += 1
            return super().get(key, default)

    counted = Counting(two_hosts())
    assert _gangs.canary_hosts(counted, ["a1", "a2"]) == ["a1", "a2"]
    assert Counting.reads == 2, "each host's variables once"


def test_a_gang_member_that_did_not_reach_a_step_is_named_with_what_stopped_it():
    """A member whose deploy failed recorded no later step: the others quote its registered result when that failed
    (a looped result names each failed item), else say it stopped before the step; members at the step are not named."""
    hv = {"a1": {"reached": "the stop"},
          "a2": {"reached": "its units read", "gate": {"failed": True, "msg": "Free-memory gate (before stop) failed on a2: rank 1 below"}},
          "a3": {"reached": "its units read", "gate": {"skipped": True}},
          "a4": {"reached": "the stop", "gate": {"failed": True, "msg": "stale"}},
          "a5": {"gate": {"failed": True, "msg": "One or more items failed",
                          "results": [{"failed": True, "msg": "unit vllm-x did not boot", "item": {"name": "x"}}]}},
          "a6": {"reached": "its units read", "gate": {"unreachable": True, "msg": "ssh: connection refused"}}}
    assert _gangs.stragglers(hv, ["a1", "a2", "a3", "a4", "a5", "a6"], "the stop", "reached", "gate") == [
        "a2: Free-memory gate (before stop) failed on a2: rank 1 below",
        "a3: it stopped before the stop (its own failure names why)",
        "a5: unit vllm-x did not boot",
        "a6: ssh: connection refused"]
    # a host that never ran the deploy has no step at all; without a result to quote, the generic words
    assert _gangs.stragglers({}, ["b"], "the boot check", "reached") == ["b: it stopped before the boot check (its own failure names why)"]
    assert _gangs.stragglers(hv, [], "the stop", "reached") == []


def test_hosts_go_one_at_a_time_but_a_gang_goes_whole():
    """rollback.yml's batches: each host alone, each gang's members together (the leader first) where its first
    member comes; a gang chosen without all of its members is refused, naming the missing ones."""
    hv = two_hosts()
    hv["solo2"] = dict(hv["solo"])
    assert _gangs.one_at_a_time(hv, ["solo", "a2", "solo2", "a1"]) == [["solo"], ["a1", "a2"], ["solo2"]]
    assert _gangs.one_at_a_time(hv, ["solo"]) == [["solo"]] and _gangs.one_at_a_time(hv, []) == []
    with pytest.raises(ValueError, match=r"instance dsv3 spans a1, a2: a2 must be chosen with the others"):
        _gangs.one_at_a_time(hv, ["solo", "a1"])

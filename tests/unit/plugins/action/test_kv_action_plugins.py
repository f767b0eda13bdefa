# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

import base64
import json
import os
import re
from unittest.mock import MagicMock

import pytest
from ansible.errors import AnsibleActionFail

from ansible_collections.gpufleet.vllm.plugins.action.kv_plan import ActionModule as KvPlan, members_from_group
from ansible_collections.gpufleet.vllm.plugins.action.kv_profile import ActionModule as KvProfile
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan import _launch
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import host_plan, plan_class

GIB = 1024**3
REFERENCE = {
    "ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB"}, {"rank": 1, "free_bytes": "42GiB", "kv_bytes": "30GiB"}],
    "total_bytes": "141GiB",
    "bytes_per_block": 2097152,
    "vllm_version": "0.32.0",
}


def gpu(index, free, **extra):
    return dict({"index": index, "name": "NVIDIA H200", "total_bytes": 141 * GIB, "free_bytes": free, "boot_free_bytes": free}, **extra)


def action(cls, args, check_mode=False, diff=False):
    task = MagicMock()
    task.args = args
    task.async_val = 0
    task.check_mode = check_mode
    task.diff = diff
    connection = MagicMock()
    connection._shell.tmpdir = "/nonexistent"
    return cls(task, connection, MagicMock(check_mode=check_mode), MagicMock(), MagicMock(), MagicMock())


def task_vars(hostvars):
    return {"groups": {"h200": sorted(hostvars), "all": sorted(hostvars)}, "hostvars": hostvars}


def test_members_from_group_default_instance_and_facts_paths():
    hv = {
        "a": {"gpufleet_gpus": [gpu(0, 42 * GIB), gpu(1, int(40.75 * GIB))]},
        "b": {"ansible_facts": {"gpufleet_gpus": [gpu(0, 42 * GIB), gpu(1, 42 * GIB)]}},
    }
    members = members_from_group("h200", task_vars(hv))
    assert sorted(members) == ["a/vllm", "b/vllm"]
    assert members["a/vllm"][1] == {"rank": 1, "boot_free_bytes": int(40.75 * GIB), "gpu_name": "NVIDIA H200", "total_bytes": 141 * GIB,
                                    "gpu": 1}
    # the card a probe named (UUID, PCI bus id) goes with the rank into the plan's per-rank table
    hv["a"]["gpufleet_gpus"][1].update(uuid="GPU-11111111-0000-4000-8000-000000000001", pci_bus_id="00000000:19:00.0")
    members = members_from_group("h200", task_vars(hv))
    plan = plan_class({"host_class": "h200", "reference": REFERENCE, "hosts": members, "max_model_len": 8192})
    row = next(r for r in plan["per_rank"] if r["host"] == "a/vllm" and r["rank"] == 1)
    assert (row["gpu"], row["uuid"], row["pci_bus_id"]) == (1, "GPU-11111111-0000-4000-8000-000000000001", "00000000:19:00.0")
    assert "uuid" not in next(r for r in plan["per_rank"] if r["host"] == "b/vllm")


def test_members_from_group_instances_take_their_gpus_in_order():
    hv = {
        "a": {
            "gpufleet_gpus": [gpu(0, 1), gpu(1, 2), gpu(2, 3), gpu(3, 4)],
            "gpufleet_instances": [{"name": "left", "gpus": [1, 0], "port": 8000}, {"name": "right", "gpus": [3, 2], "port": 8001}],
        }
    }
    members = members_from_group("h200", task_vars(hv))
    assert [r["boot_free_bytes"] for r in members["a/left"]] == [2, 1]
    assert [r["rank"] for r in members["a/right"]] == [0, 1]
    assert [r["boot_free_bytes"] for r in members["a/right"]] == [4, 3]


def gang_host(address, gpus, **extra):
    """A member of instance main, tensor parallel 4 over hosts a and b (two GPUs each)."""
    return {"ansible_host": address, "gpufleet_serve_args": {"tensor_parallel_size": 4}, "gpufleet_gpus": gpus,
            "gpufleet_instances": [{"name": "main", "gpus": [0, 1], "port": 8000, "gang": {"mode": "mp", "members": ["a", "b"]}}], **extra}


GANG_REFERENCE = dict(REFERENCE, ranks=[{"rank": r, "free_bytes": "42GiB", "kv_bytes": "30GiB", "host": "ab"[r // 2]} for r in range(4)])


def test_a_gang_is_planned_as_one_engine_over_every_rank_of_every_member():
    hv = {"a": gang_host("10.0.0.1", [gpu(0, 42 * GIB), gpu(1, 42 * GIB)]),
          "b": gang_host("10.0.0.2", [gpu(0, 42 * GIB), gpu(1, int(40.75 * GIB), uuid="GPU-b1")])}
    members = members_from_group("h200", task_vars(hv))
    # one planning member, named after the leader; the follower's ranks are 2 and 3, as vLLM numbers them
    assert list(members) == ["a/main"]
    assert [(r["rank"], r["member"], r["gpu"]) for r in members["a/main"]] == [(0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "b", 1)]
    plan = plan_class({"host_class": "h200", "reference": GANG_REFERENCE, "hosts": members, "guard_bytes": "0.5GiB", "max_model_len": 8192})
    assert plan["decision"] == "deploy", plan["reasons"]
    # the weakest rank is on the follower and sets the budget of every rank of the gang
    assert plan["weakest"] == {"host": "a/main", "rank": 3, "member": "b", "adjusted_bytes": int(28.25 * GIB)}
    assert "the weakest rank is host a/main rank 3 (on b)" in plan["reasons"][0], plan["reasons"]
    row = next(r for r in plan["per_rank"] if r["rank"] == 3)
    assert (row["member"], row["gpu"], row["uuid"], row["weakest"]) == ("b", 1, "GPU-b1", True)
    assert sorted(plan["launch"]["free_floor_bytes"]) == [0, 1, 2, 3]
    # each member's record keeps its own ranks' floors, numbered by its GPUs
    follower = _launch.for_member(plan["launch"], 2, 2)
    assert follower["free_floor_bytes"] == {0: plan["launch"]["free_floor_bytes"][2], 1: plan["launch"]["free_floor_bytes"][3]}
    assert follower["kv_cache_memory_bytes"] == plan["launch"]["kv_cache_memory_bytes"] and follower["expect"] == plan["launch"]["expect"]
    # a member flagged unstable makes the gang's plan auto_profile, as a host of its own would
    hv["b"]["gpufleet_unstable"] = True
    assert members_from_group("h200", task_vars(hv))["a/main"]["unstable"] is True


def test_a_gang_runs_one_plan_on_every_member_when_its_follower_is_unsteady():
    """Two gangs, (a, b) and (c, d); d is flagged unsteady: c and d run the unsteady group's plan together, a and b the
    class's (one engine runs one plan: a host group takes a gang's hosts all or none)."""
    def member(members, address):
        host = gang_host(address, [gpu(0, 42 * GIB), gpu(1, 42 * GIB)])
        host["gpufleet_instances"][0]["gang"]["members"] = members
        return host
    hv = {"a": member(["a", "b"], "10.0.0.1"), "b": member(["a", "b"], "10.0.0.2"),
          "c": member(["c", "d"], "10.0.0.3"), "d": dict(member(["c", "d"], "10.0.0.4"), gpufleet_unstable=True)}
    members = members_from_group("h200", task_vars(hv))
    assert sorted(members) == ["a/main", "c/main"]
    plan = plan_class({"host_class": "h200", "reference": GANG_REFERENCE, "hosts": members, "guard_bytes": "0.5GiB",
                       "max_model_len": 8192, "unstable_scope": "host"})
    assert [(g["hosts"], g["why"]) for g in plan["host_groups"]] == [(["c", "d"], "unstable")], plan["host_groups"]
    assert plan["decision"] == "deploy" and plan["host_groups"][0]["plan"]["decision"] == "auto_profile", plan["reasons"]
    assert host_plan(plan, "d") is host_plan(plan, "c") is not host_plan(plan, "b")


def test_a_gang_whose_member_is_not_in_the_group_is_not_planned():
    hv = {"a": gang_host("10.0.0.1", [gpu(0, 42 * GIB), gpu(1, 42 * GIB)]), "b": gang_host("10.0.0.2", [gpu(0, 42 * GIB), gpu(1, 42 * GIB)])}
    with pytest.raises(AnsibleActionFail, match=r"hosts_from h200: instance main spans hosts a, b: b not in the group; a gang is planned "
                                                r"on every rank of every member"):
        members_from_group("h200", {"groups": {"h200": ["a"]}, "hostvars": hv})
    # a gang the inventory gets wrong names its field
    hv["b"]["gpufleet_instances"][0]["gang"]["members"] = ["a", "b", "c"]
    hv["a"]["gpufleet_instances"][0]["gang"]["members"] = ["a", "b", "c"]
    with pytest.raises(AnsibleActionFail, match=r"hosts_from h200: gpufleet_instances\[0\]\.gang"):
        members_from_group("h200", task_vars(hv))


def test_a_plan_for_another_layout_gives_a_member_no_floors():
    one_host = {"a/vllm": [{"rank": 0, "boot_free_bytes": 42 * GIB}, {"rank": 1, "boot_free_bytes": 42 * GIB}]}
    launch = plan_class({"host_class": "h200", "reference": REFERENCE, "hosts": one_host, "max_model_len": 8192})["launch"]
    with pytest.raises(_launch.LaunchError, match=r"launch.free_floor_bytes: no floor for rank\(s\) 2, 3 of this member \(its ranks 2-3 of the "
                                                  r"instance; the plan has rank\(s\) 0, 1\): plan the gang across all of its members"):
        _launch.for_member(launch, 2, 2)


@pytest.mark.parametrize(
    "hv, group, match",
    [
        ({"a": {}}, "h200", "no gpufleet_gpus facts for a"),
        ({"a": {"gpufleet_gpus": [gpu(0, 1)]}}, "missing", "does not exist"),
        ({"a": {"gpufleet_gpus": [gpu(0, 1)], "gpufleet_instances": [{"name": "x", "gpus": [5]}]}}, "h200", "GPU 5 is not in"),
        ({"a": {"gpufleet_gpus": [gpu(0, 1)], "gpufleet_instances": [{"gpus": [0]}]}}, "h200", "needs a name"),
    ],
)
def test_members_from_group_errors(hv, group, match):
    with pytest.raises(AnsibleActionFail, match=match):
        members_from_group(group, task_vars(hv))


def test_kv_plan_action_with_hosts_from():
    hv = {"a": {"gpufleet_gpus": [gpu(0, 42 * GIB), gpu(1, int(40.75 * GIB))]}, "b": {"gpufleet_gpus": [gpu(0, 42 * GIB), gpu(1, 42 * GIB)]}}
    plugin = action(KvPlan, {"host_class": "h200", "reference": REFERENCE, "hosts_from": "h200", "guard_bytes": "0.5GiB", "max_model_len": 8192})
    result = plugin.run(task_vars=task_vars(hv))
    assert not result.get("failed"), result
    assert result["changed"] is False
    assert result["decision"] == "deploy"
    # the max safe bytes (the seed example's 28.25 GiB) less the default gate margin, 768 MiB: 27.5 GiB, a whole
    # number of 256 MiB granules and of blocks
    assert result["kv_cache_memory_bytes"] == int(28.25 * GIB) - 768 * 1024**2 == int(27.5 * GIB)
    assert result["weakest"] == {"host": "a/vllm", "rank": 1, "adjusted_bytes": int(28.25 * GIB)}
    assert result["budget_choice"]["gate_margin_bytes"] == 768 * 1024**2
    assert result["msg"].startswith("deploy: deploy 27.5GiB"), result["msg"]


def test_kv_plan_action_plan_error_is_a_clean_failure():
    plugin = action(KvPlan, {"host_class": "h200", "reference": REFERENCE, "hosts": {"a": [{"rank": 0}]}})
    result = plugin.run(task_vars={})
    assert result["failed"] is True
    assert result["msg"] == "kv_plan (h200): hosts.a[0] (rank 0): boot_free_bytes is required"


def test_kv_plan_action_needs_hosts():
    plugin = action(KvPlan, {"reference": REFERENCE})
    with pytest.raises(AnsibleActionFail, match="one of the following is required: hosts, hosts_from"):
        plugin.run(task_vars={})


def test_kv_plan_action_rejects_unknown_args():
    plugin = action(KvPlan, {"reference": REFERENCE, "hosts": {}, "bogus": 1})
    with pytest.raises(AnsibleActionFail, match="bogus"):
        plugin.run(task_vars={})


def test_kv_plan_action_host_given_twice():
    hv = {"a": {"gpufleet_gpus": [gpu(0, 42 * GIB), gpu(1, 42 * GIB)]}}
    plugin = action(KvPlan, {"reference": REFERENCE, "hosts_from": "h200", "hosts": {"a/vllm": []}})
    with pytest.raises(AnsibleActionFail, match="both in hosts and by hosts_from"):
        plugin.run(task_vars=task_vars(hv))


COMPAT = {"model": "tiny", "vllm_version": "0.32.0"}
PROFILE = {"ranks": [{"rank": 0, "free_bytes": 45 * GIB, "kv_bytes": 30 * GIB}]}


def test_kv_profile_present_check_mode_writes_nothing(tmp_path):
    store = str(tmp_path / "store")
    result = action(KvProfile, {"store": store, "state": "present", "host_class": "c", "compat": COMPAT, "profile": PROFILE}, check_mode=True, diff=True).run(
        task_vars={}
    )
    assert result["changed"] is True
    assert result["record"]["path"] is None
    assert "kv_bytes: 32212254720" in result["diff"]["after"]
    assert not os.path.exists(store)


def test_kv_profile_present_then_query(tmp_path):
    store = str(tmp_path / "store")
    rec = action(KvProfile, {"store": store, "state": "present", "host_class": "c", "compat": COMPAT, "profile": PROFILE}, diff=True).run(task_vars={})
    assert rec["changed"] is True and os.path.isfile(rec["record"]["path"])
    assert rec["diff"]["after_header"] == rec["record"]["path"]
    found = action(KvProfile, {"store": store, "host_class": "c", "compat": dict(COMPAT)}).run(task_vars={})
    assert found["status"] == "found" and found["changed"] is False
    assert found["profile"]["path"] == rec["record"]["path"]
    mismatch = action(KvProfile, {"store": store, "host_class": "c", "compat": dict(COMPAT, vllm_version="0.33.0")}).run(task_vars={})
    assert mismatch["status"] == "mismatch"
    assert "vllm_version" in mismatch["msg"]
    missing = action(KvProfile, {"store": store, "host_class": "other", "compat": COMPAT}).run(task_vars={})
    assert missing["status"] == "missing"


def test_kv_profile_corrupt_file_warns(tmp_path):
    store = tmp_path / "store"
    action(KvProfile, {"store": str(store), "state": "present", "host_class": "c", "compat": COMPAT, "profile": PROFILE}).run(task_vars={})
    bad = store / "c" / "c--0000000000000000--20990101T000000000000Z--00000000.yml"
    bad.write_text("{{{")
    result = action(KvProfile, {"store": str(store), "host_class": "c", "compat": COMPAT}).run(task_vars={})
    assert result["status"] == "found"
    assert len(result["warnings"]) == 1 and str(bad) in result["warnings"][0]


def test_kv_profile_errors(tmp_path):
    result = action(KvProfile, {"store": str(tmp_path), "state": "present", "host_class": "../x", "compat": COMPAT, "profile": PROFILE}).run(task_vars={})
    assert result["failed"] is True and "host_class" in result["msg"]
    with pytest.raises(AnsibleActionFail, match="profile"):
        action(KvProfile, {"store": str(tmp_path), "state": "present", "host_class": "c", "compat": COMPAT}).run(task_vars={})


@pytest.mark.parametrize(
    "extra, deployable",
    [
        ({}, True),
        ({"admission": {"tokens": 300_000}}, False),  # a shortfall is not deployable by default (as in the kv_plan role)
        ({"admission": {"tokens": 300_000}, "require_admission": False}, True),
        ({"admission": {"tokens": 300_000}, "require_admission": True}, False),
        ({"admission": {"tokens": 300_000}, "require_admission": False, "split_policy": "fail"}, True),
    ],
)
def test_kv_plan_action_says_whether_the_plan_is_deployable(extra, deployable):
    args = dict({"host_class": "h200", "reference": REFERENCE, "guard_bytes": "0.5GiB", "max_model_len": 8192,
                 "hosts": {"a": [{"rank": 0, "boot_free_bytes": 42 * GIB}, {"rank": 1, "boot_free_bytes": 42 * GIB}]}}, **extra)
    result = action(KvPlan, args).run(task_vars={})
    assert not result.get("failed"), result
    assert result["decision"] == "deploy"
    assert result["deployable"] is deployable
    assert "split_policy" not in result and "require_admission" not in result


def test_kv_plan_action_split_policy_decides_a_split():
    hosts = {f"h{i}": [{"rank": 0, "boot_free_bytes": 42 * GIB}, {"rank": 1, "boot_free_bytes": 42 * GIB}] for i in range(3)}
    hosts["weak"] = [{"rank": 0, "boot_free_bytes": 38 * GIB}, {"rank": 1, "boot_free_bytes": 42 * GIB}]
    args = {"host_class": "h200", "reference": REFERENCE, "guard_bytes": "0.5GiB", "max_model_len": 8192, "hosts": hosts}
    warn = action(KvPlan, dict(args, split_policy="warn")).run(task_vars={})
    assert warn["decision"] == "split" and warn["deployable"] is True and warn["host_groups"] == []
    fail = action(KvPlan, dict(args, split_policy="fail")).run(task_vars={})
    assert fail["decision"] == "split" and fail["deployable"] is False
    assert {k: v for k, v in fail.items() if k != "deployable"} == {k: v for k, v in warn.items() if k != "deployable"}
    # per_host (the default): the hosts other than the outlier run their own group's plan
    per_host = action(KvPlan, args).run(task_vars={})
    assert per_host["decision"] == "split" and per_host["deployable"] is True
    (group,) = per_host["host_groups"]
    assert group["hosts"] == ["h0", "h1", "h2"] and group["plan"]["kv_cache_memory_bytes"] > per_host["kv_cache_memory_bytes"]


def test_kv_plan_action_rejects_a_bad_split_policy():
    with pytest.raises(AnsibleActionFail, match="split_policy"):
        action(KvPlan, {"reference": REFERENCE, "hosts": {}, "split_policy": "maybe"}).run(task_vars={})


# ---------------------------------------------------------------- kv_profile canary (the profile built from a canary run)
CANARY_RUN = {
    "changed": False, "mode": "profiled", "verdict": "pass", "log_tail": "...", "invocation": {"module_args": {}},
    "ranks": [{"rank": 0, "initial_free_bytes": 44560285696, "suggested_kv_bytes_fit": 32212254720,
               "suggested_kv_bytes_full": 42949672960}],
    "block_size": 16, "num_blocks": 15360, "kv_cache_tokens": 245760, "max_concurrency": 30.0, "max_model_len": 8192,
}
PREBOOT = [{"index": 3, "name": "NVIDIA H200", "free_bytes": 45097156608, "total_bytes": 150754820096}]
TINY_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32, "hidden_size": 128, "torch_dtype": "bfloat16"}
FACTS = {"host": "gpu-a1", "instance": "vllm", "gpus": [3], "gpu_memory_utilization": 0.9}


def canary(**over):
    return dict({"result": CANARY_RUN, "preboot_gpus": PREBOOT, "gpus": ["3"], "serve_args": {"max_model_len": 8192},
                 "facts": FACTS}, **over)


def profile_action(args, check_mode=False, diff=False):
    """kv_profile with a real DataLoader (the canary's model_config may be a controller file)."""
    from ansible.parsing.dataloader import DataLoader  # pylint: disable=import-outside-toplevel

    plugin = action(KvProfile, args, check_mode=check_mode, diff=diff)
    plugin._loader = DataLoader()  # pylint: disable=protected-access
    return plugin


def test_kv_profile_build_is_what_the_kv_reference_filter_builds():
    from ansible_collections.gpufleet.vllm.plugins.filter.kv import kv_reference  # pylint: disable=import-outside-toplevel

    result = profile_action({"state": "build", "canary": canary(model_config=TINY_CONFIG)}).run(task_vars={})
    assert not result.get("failed"), result
    assert result["changed"] is False
    assert "record" not in result and "profile" not in result
    expected = kv_reference(CANARY_RUN, PREBOOT, [3], config=TINY_CONFIG, serve_args={"max_model_len": 8192}, canary=FACTS)
    assert result["reference_profile"] == expected
    built = result["reference_profile"]
    assert built["ranks"] == [{"rank": 0, "free_bytes": 45097156608, "kv_bytes": 32212254720, "kv_bytes_full": 42949672960}]
    assert built["geometry"] == {"config": TINY_CONFIG, "serve_args": {"max_model_len": 8192}}
    assert built["canary"]["host"] == "gpu-a1" and built["canary"]["verdict"] == "pass"
    assert "log_tail" not in built["canary_result"] and "invocation" not in built["canary_result"]


def test_kv_profile_build_needs_no_store_and_writes_nothing_in_check_mode(tmp_path):
    store = tmp_path / "store"
    args = {"state": "build", "store": str(store), "host_class": "c", "compat": COMPAT, "canary": canary()}
    for check_mode in (False, True):
        result = profile_action(args, check_mode=check_mode, diff=True).run(task_vars={})
        assert result["changed"] is False and result["reference_profile"]["geometry"] is None
        assert "diff" not in result
    assert not store.exists()


def test_kv_profile_present_records_the_built_profile(tmp_path):
    store = str(tmp_path / "store")
    result = profile_action({"store": store, "state": "present", "host_class": "c", "compat": COMPAT,
                             "canary": canary(model_config=TINY_CONFIG)}).run(task_vars={})
    assert not result.get("failed"), result
    assert result["changed"] is True and os.path.isfile(result["record"]["path"])
    assert result["record"]["profile"] == result["reference_profile"]
    found = action(KvProfile, {"store": store, "host_class": "c", "compat": COMPAT}).run(task_vars={})
    assert found["status"] == "found" and found["profile"]["profile"]["num_blocks"] == 15360


def test_kv_profile_present_canary_check_mode_writes_nothing(tmp_path):
    store = tmp_path / "store"
    result = profile_action({"store": str(store), "state": "present", "host_class": "c", "compat": COMPAT, "canary": canary()},
                            check_mode=True).run(task_vars={})
    assert result["changed"] is True and result["record"]["path"] is None
    assert result["reference_profile"]["ranks"][0]["kv_bytes"] == 32212254720
    assert not store.exists()


def test_kv_profile_canary_model_config_sources(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_CONFIG), encoding="utf-8")
    from_file = profile_action({"state": "build", "canary": canary(model_config=str(path))}).run(task_vars={})
    assert from_file["reference_profile"]["geometry"]["config"] == TINY_CONFIG
    slurped = {"content": base64.b64encode(json.dumps(TINY_CONFIG).encode()).decode(), "source": "/models/tiny/config.json"}
    from_host = profile_action({"state": "build", "canary": canary(model_config="", model_config_file=slurped)}).run(task_vars={})
    assert from_host["reference_profile"]["geometry"]["config"] == TINY_CONFIG
    # model_config wins over the host's file; a skipped slurp is no geometry
    given = profile_action({"state": "build", "canary": canary(model_config={"model_type": "x"}, model_config_file=slurped)}).run(task_vars={})
    assert given["reference_profile"]["geometry"]["config"] == {"model_type": "x"}
    skipped = profile_action({"state": "build", "canary": canary(model_config="", model_config_file={"skipped": True})}).run(task_vars={})
    assert skipped["reference_profile"]["geometry"] is None


@pytest.mark.parametrize(
    "over, match",
    [
        ({"model_config": "/nonexistent/config.json"}, r"^kv_profile \(canary\): canary\.model_config: cannot read /nonexistent/config.json"),
        ({"model_config_file": {"content": "!!!"}}, r"^kv_profile \(canary\): canary\.model_config_file\.content: not base64"),
        ({"model_config_file": {"content": base64.b64encode(b"[1]").decode()}},
         r"^kv_profile \(canary\): canary\.model_config_file \(config.json\): expected a JSON object"),
        ({"model_config": 5}, r"canary\.model_config: expected a mapping or a controller path, got int"),
        ({"gpus": [5]}, r"^kv_profile \(canary\): canary: canary rank 0: GPU 5 is not in the pre-boot probe$"),
        ({"result": {"verdict": "fail"}}, r"canary: canary result: ranks missing"),
        ({"preboot_gpus": [{"index": 3}]}, r"canary: pre-boot probe: GPU 3 has no free_bytes"),
    ],
)
def test_kv_profile_canary_errors_name_the_field(over, match):
    result = profile_action({"state": "build", "canary": canary(**over)}).run(task_vars={})
    assert result["failed"] is True
    assert re.search(match, result["msg"]), result["msg"]


def test_kv_profile_invalid_model_config_json_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json", encoding="utf-8")
    result = profile_action({"state": "build", "host_class": "c", "canary": canary(model_config=str(path))}).run(task_vars={})
    assert result["failed"] is True and result["msg"].startswith(f"kv_profile (c): canary.model_config ({path}): not JSON")


@pytest.mark.parametrize(
    "args, match",
    [
        ({"state": "build"}, "state is build but all of the following are missing: canary"),
        ({"state": "present", "store": "/x", "host_class": "c", "compat": COMPAT, "profile": PROFILE, "canary": canary()},
         "mutually exclusive: profile|canary"),
        ({"state": "present", "store": "/x", "host_class": "c", "compat": COMPAT}, "any of the following are missing: profile, canary"),
        ({"state": "present", "host_class": "c", "compat": COMPAT, "canary": canary()}, "missing: store"),
        ({"state": "query", "store": "/x", "compat": COMPAT}, "missing: host_class"),
        ({"state": "query", "store": "/x", "host_class": "c", "compat": COMPAT, "canary": canary()}, "canary: only used with state present or build"),
        ({"state": "build", "canary": {"result": CANARY_RUN, "gpus": [0]}}, "preboot_gpus"),
    ],
)
def test_kv_profile_canary_argument_rules(args, match):
    with pytest.raises(AnsibleActionFail, match=re.escape(match)):
        profile_action(args).run(task_vars={})

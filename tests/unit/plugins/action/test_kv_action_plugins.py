# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

import os
from unittest.mock import MagicMock

import pytest
from ansible.errors import AnsibleActionFail

from ansible_collections.gpufleet.vllm.plugins.action.kv_plan import ActionModule as KvPlan
from ansible_collections.gpufleet.vllm.plugins.action.kv_plan import members_from_group
from ansible_collections.gpufleet.vllm.plugins.action.kv_profile import ActionModule as KvProfile

GIB = 1024**3
REFERENCE = {
    "ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB"}, {"rank": 1, "free_bytes": "42GiB", "kv_bytes": "30GiB"}],
    "total_bytes": "141GiB",
    "bytes_per_block": 2097152,
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
    assert members["a/vllm"][1] == {"rank": 1, "boot_free_bytes": int(40.75 * GIB), "gpu_name": "NVIDIA H200", "total_bytes": 141 * GIB}


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
    assert result["kv_cache_memory_bytes"] == int(28.25 * GIB)
    assert result["weakest"] == {"host": "a/vllm", "rank": 1, "adjusted_bytes": int(28.25 * GIB)}
    assert result["msg"].startswith("deploy: deploy 28.25GiB")


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

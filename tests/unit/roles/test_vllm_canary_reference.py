# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vllm_canary role's reference profile: kv_profile builds it from the canary's inputs.

The role's task arguments are templated by Ansible's own templar with the role's variables and
given to the kv_profile action; the fact the role keeps is read back from that result.
"""

from __future__ import annotations

import base64
import json
import pathlib
import typing as t
from unittest.mock import MagicMock

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from ansible_collections.gpufleet.vllm.plugins.action.kv_profile import ActionModule as KvProfile
from ansible_collections.gpufleet.vllm.plugins.filter.kv import kv_reference

ROOT = pathlib.Path(__file__).resolve().parents[3]
TASKS = yaml.safe_load((ROOT / "roles" / "vllm_canary" / "tasks" / "main.yml").read_text(encoding="utf-8"))
CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "hidden_size": 128, "torch_dtype": "bfloat16"}
RUN = {"mode": "profiled", "verdict": "pass", "log_tail": "...",
       "ranks": [{"rank": 0, "initial_free_bytes": 9 * 1024**3, "suggested_kv_bytes_fit": 6 * 1024**3},
                 {"rank": 1, "initial_free_bytes": 9 * 1024**3, "suggested_kv_bytes_fit": 6 * 1024**3}],
       "block_size": 16, "num_blocks": 1000, "kv_cache_tokens": 16000, "max_concurrency": 3.9, "max_model_len": 4096}
PREBOOT = [{"index": 2, "free_bytes": 10 * 1024**3, "total_bytes": 24 * 1024**3, "name": "L4"},
           {"index": 5, "free_bytes": 11 * 1024**3, "total_bytes": 24 * 1024**3, "name": "L4"}]


def task(name: str) -> dict[str, t.Any]:
    return next(x for x in TASKS if x.get("name") == name)


def trusted(value: t.Any) -> t.Any:
    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {k: trusted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [trusted(v) for v in value]
    return value


def render(value: t.Any, variables: dict[str, t.Any]) -> t.Any:
    return Templar(loader=DataLoader(), variables=variables).template(trusted(value))


def role_vars(**over: t.Any) -> dict[str, t.Any]:
    return dict({
        "inventory_hostname": "gpu-a1", "vllm_canary_mode": "profiled", "vllm_canary_record": True,
        "vllm_canary_profile_store": "", "vllm_canary_host_class": "l4-tp2", "vllm_canary_compat_key": {"model": "tiny"},
        "vllm_canary_instance": {"name": "left", "gpus": ["5", 2], "port": 8000}, "vllm_canary_gpu_memory_utilization": "0.85",
        "vllm_canary_model_config": "", "vllm_canary_serve_args": {"tensor_parallel_size": 2},
        # the module's result carries the pre-boot probe (gpu_probe) and, when asked, the model's config (model_config_file)
        "__vllm_canary_outcome": dict(RUN, gpu_probe={"gpus": PREBOOT}, takeover={"instance_serving": False}),
        # an instance on this host alone (a canary gang: test_the_leader_of_a_canary_gang_records_every_members_ranks)
        "vllm_canary_gang_launch": {}, "vllm_canary_gang_members": [],
    }, **over)


def run_role_task(variables: dict[str, t.Any], check_mode: bool = False) -> tuple[dict[str, t.Any], t.Any]:
    """kv_profile's result with the role's arguments, and the reference profile fact the role keeps."""
    build = task("Build the reference profile and record it in the store")
    assert all(render("{{ " + condition + " }}", variables) is True for condition in build["when"])
    plugin_task = MagicMock()
    plugin_task.args = render(build["gpufleet.vllm.kv_profile"], variables)
    plugin_task.async_val = 0
    plugin_task.check_mode = check_mode
    plugin_task.diff = False
    plugin = KvProfile(plugin_task, MagicMock(), MagicMock(check_mode=check_mode), DataLoader(), MagicMock(), MagicMock())
    result = plugin.run(task_vars={})
    keep = task("Keep the reference profile")["ansible.builtin.set_fact"]["vllm_canary_reference_profile"]
    return result, render(keep, dict(variables, vllm_canary_recorded=result))


def test_not_recorded_the_profile_is_only_built(tmp_path):
    result, fact = run_role_task(role_vars(vllm_canary_record=False))
    assert not result.get("failed"), result
    assert result["changed"] is False and "record" not in result
    # the same profile the kv_reference filter built in the role before
    assert fact == kv_reference(RUN, PREBOOT, [5, 2], config=None, serve_args={"tensor_parallel_size": 2},
                                canary={"host": "gpu-a1", "instance": "left", "gpus": ["5", 2], "gpu_memory_utilization": 0.85})
    # rank 0 runs on GPU 5, rank 1 on GPU 2 (the instance's order)
    assert [r["free_bytes"] for r in fact["ranks"]] == [11 * 1024**3, 10 * 1024**3]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("check_mode", [False, True])
def test_recorded_the_fact_is_the_profile_recorded(tmp_path, check_mode):
    store = tmp_path / "store"
    result, fact = run_role_task(role_vars(vllm_canary_profile_store=str(store)), check_mode=check_mode)
    assert not result.get("failed"), result
    assert result["changed"] is True
    assert result["record"]["profile"] == fact and result["record"]["host_class"] == "l4-tp2"
    assert store.exists() is not check_mode


def test_the_host_config_json_gives_the_geometry():
    slurped = {"content": base64.b64encode(json.dumps(CONFIG).encode()).decode(), "source": "/models/tiny/config.json"}
    run = dict(RUN, gpu_probe={"gpus": PREBOOT}, model_config_file=slurped)
    _result, fact = run_role_task(role_vars(vllm_canary_record=False, __vllm_canary_outcome=run))
    assert fact["geometry"] == {"config": CONFIG, "serve_args": {"tensor_parallel_size": 2}}


def test_a_controller_config_file_gives_the_geometry(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG), encoding="utf-8")
    _result, fact = run_role_task(role_vars(vllm_canary_record=False, vllm_canary_model_config=str(path)))
    assert fact["geometry"]["config"] == CONFIG
    _result, fact = run_role_task(role_vars(vllm_canary_record=False, vllm_canary_model_config=CONFIG))
    assert fact["geometry"]["config"] == CONFIG


def test_manual_mode_keeps_no_reference_profile():
    keep = task("Keep the reference profile")["ansible.builtin.set_fact"]["vllm_canary_reference_profile"]
    assert render(keep, role_vars(vllm_canary_mode="manual", vllm_canary_recorded={"skipped": True})) == {}


def test_the_leader_of_a_canary_gang_records_every_members_ranks():
    """TP=2 x PP=2 over two hosts: the leader's kv_profile gets the follower's run (the fact each member keeps) and the
    reference holds the four ranks, each with its host; the follower records nothing itself."""
    follower_run = {"host": "gpu-a2", "gpus": [0, 1],
                    "result": {"ranks": [{"rank": 2, "auto_kv_bytes": 5 * 1024**3}, {"rank": 3, "auto_kv_bytes": 5 * 1024**3}]},
                    "preboot_gpus": [{"index": 0, "free_bytes": 12 * 1024**3}, {"index": 1, "free_bytes": 13 * 1024**3}]}
    gang = {"vllm_canary_gang_launch": {"leader": "gpu-a1", "serves_api": True, "args": ["--nnodes", "2"]},
            "vllm_canary_gang_members": ["gpu-a1", "gpu-a2"], "hostvars": {"gpu-a2": {"vllm_canary_gang_run": follower_run}}}
    result, fact = run_role_task(role_vars(vllm_canary_record=False, **gang))
    assert not result.get("failed"), result
    assert fact["members"] == ["gpu-a1", "gpu-a2"]
    assert [(r["rank"], r["host"], r["free_bytes"] >> 30) for r in fact["ranks"]] == [
        (0, "gpu-a1", 11), (1, "gpu-a1", 10), (2, "gpu-a2", 12), (3, "gpu-a2", 13)]
    build = task("Build the reference profile and record it in the store")
    follower = role_vars(inventory_hostname="gpu-a2", **gang)
    assert not all(render("{{ " + condition + " }}", follower) is True for condition in build["when"]), "a follower records nothing"

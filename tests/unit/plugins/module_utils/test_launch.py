# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The launch contract: the planner's record, its checks, the host's plan file, and every reader
of that file seeing the same figures."""
from __future__ import annotations

import json
from typing import Any

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._gate import _boot_gate
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan import _launch
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import LaunchError
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import keep_deployed, plan_class

GIB = 1 << 30
H200 = 150_110_961_664
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128, "torch_dtype": "bfloat16", "max_position_embeddings": 131072}


def spec(boot_free: int = 130 * GIB, **extra: Any) -> dict[str, Any]:
    return {
        "host_class": "h200",
        "reference": {"ranks": [{"rank": 0, "free_bytes": 130 * GIB, "kv_bytes": 100 * GIB}], "total_bytes": H200,
                      "vllm_free_bytes": {0: 129 * GIB},
                      "geometry": {"config": LLAMA_8B, "serve_args": {"max_num_batched_tokens": 2048}}},
        "hosts": {"a": [{"rank": 0, "boot_free_bytes": boot_free, "total_bytes": H200}]},
        "guard_bytes": GIB // 2,
        "max_model_len": 8192,
        "admission": {"concurrency": 4, "tokens_per_request": 8192},
        **extra,
    }


def host_file(launch: dict[str, Any]) -> dict[str, Any]:
    doc = _launch.plan_file(launch, {"name": "main", "gpus": [3], "port": 8001}, host_class="h200", key_hash="k1",
                            model="/srv/m", max_model_len=8192, planned_at="2026-12-02T10:00:00Z", gate_policy="shrink",
                            gate_state_dir="/var/lib/gpufleet-vllm")
    loaded: dict[str, Any] = json.loads(json.dumps(doc))  # the file on the host: JSON, rank keys as text
    return loaded


def test_the_planner_returns_the_launch_record_of_its_analysis():
    plan = plan_class(spec())
    launch = plan["launch"]
    assert plan["decision"] == launch["decision"] == "deploy", plan["reasons"]
    assert launch["schema"] == _launch.SCHEMA and launch["manual"] is True
    assert launch["kv_cache_memory_bytes"] == plan["kv_cache_memory_bytes"] > 0
    assert launch["gpu_memory_utilization"] == plan["gpu_memory_utilization"] and launch["utilization_source"] == "vllm"
    assert launch["free_floor_bytes"] == plan["free_floor_bytes"] and launch["vllm_floor_bytes"] == plan["vllm_floor_bytes"]
    assert launch["expect"] == {"reserved_bytes": plan["kv_cache_memory_bytes"], "num_blocks": plan["num_blocks"],
                                "kv_cache_tokens": plan["kv_cache_tokens"], "max_concurrency": plan["max_concurrency"]}
    assert launch["admission"] == {k: plan["admission"][k] for k in ("required_tokens", "required_blocks")}
    assert launch["capacity"] == plan["kv_capacity"] and launch["guard_bytes"] == GIB // 2
    assert set(launch) == set(_launch.FIELDS)
    # the record is its own fixed point: checking it again changes nothing
    assert _launch.check_launch(json.loads(json.dumps(launch))) == launch


def test_a_refused_class_has_a_record_that_starts_nothing():
    plan = plan_class(spec(boot_free=20 * GIB))
    assert plan["decision"] == "refuse"
    launch = plan["launch"]
    assert launch["kv_cache_memory_bytes"] is None and launch["expect"] is None and launch["free_floor_bytes"] == {}
    assert launch["reasons"] == plan["reasons"]
    with pytest.raises(LaunchError, match=r"^vllm_service_plan.decision: refuse is not deployable \(the planner refused the class: "):
        _launch.for_instance(plan, 0.9, "vllm_service_plan")


def test_an_auto_profile_record_takes_the_default_utilization_only_when_it_names_none():
    plan = {"decision": "auto_profile", "kv_cache_memory_bytes": 5 * GIB, "gpu_memory_utilization": None, "reasons": ["unstable"]}
    launch = _launch.for_instance(plan, 0.85)
    assert launch["manual"] is False and launch["kv_cache_memory_bytes"] is None and launch["expect"] is None
    assert (launch["gpu_memory_utilization"], launch["utilization_source"]) == (0.85, "default")
    own = _launch.for_instance(dict(plan, gpu_memory_utilization=0.61, utilization_source="lowest_free"), 0.85)
    assert (own["gpu_memory_utilization"], own["utilization_source"]) == (0.61, "lowest_free")
    with pytest.raises(LaunchError, match=r"takes the default utilization, which must be a number in \(0, 1\], got 1.5"):
        _launch.for_instance(plan, 1.5)


def test_a_hand_written_plan_and_the_planners_result_give_the_same_record():
    plan = plan_class(spec())
    flat = {k: v for k, v in plan.items() if k != "launch"}
    assert _launch.for_instance(flat, 0.9) == _launch.for_instance(plan, 0.9) == plan["launch"]


@pytest.mark.parametrize("change, needle", [
    ({"schema": 2}, r"^launch.schema: 2 is not the schema this collection reads \(1\)"),
    ({"decision": "maybe"}, r"^launch.decision: expected one of deploy, reprofile, split, auto_profile, refuse, got 'maybe'"),
    ({"manual": False}, r"^launch.manual: must be True for decision deploy"),
    ({"kv_cache_memory_bytes": "30GiB"}, r"^launch.kv_cache_memory_bytes: expected an integer, got '30GiB'"),
    ({"kv_cache_memory_bytes": 0}, r"^launch.kv_cache_memory_bytes: expected at least 1, got 0"),
    ({"kv_cache_memory_bytes": None}, r"^launch.kv_cache_memory_bytes: a deploy plan needs the byte budget"),
    ({"gpu_memory_utilization": 1.5}, r"^launch.gpu_memory_utilization: expected a number in \(0, 1\], got 1.5"),
    ({"gpu_memory_utilization": True}, r"^launch.gpu_memory_utilization: expected a number in \(0, 1\], got True"),
    ({"free_floor_bytes": {"x": 1}}, r"^launch.free_floor_bytes: rank 'x' is not an integer"),
    ({"free_floor_bytes": {"0": -1}}, r"^launch.free_floor_bytes\[0\]: expected bytes as a non-negative integer, got -1"),
    ({"utilization_source": "guess"}, r"^launch.utilization_source: expected one of vllm, nvml, lowest_free, default"),
    ({"budget": 1}, r"^launch: unknown field\(s\) budget"),
    ({"reasons": "one"}, r"^launch.reasons: expected a list of strings"),
])
def test_a_bad_record_names_the_field(change, needle):
    launch = dict(plan_class(spec())["launch"], **change)
    if "kv_cache_memory_bytes" in change:
        launch["expect"] = None
    with pytest.raises(LaunchError, match=needle):
        _launch.check_launch(launch)


def test_the_expected_reservation_is_the_budget():
    launch = plan_class(spec())["launch"]
    with pytest.raises(LaunchError, match=r"^launch.expect.reserved_bytes: 1 is not the budget"):
        _launch.check_launch(dict(launch, expect=dict(launch["expect"], reserved_bytes=1)))


def test_the_plan_file_holds_the_record_and_the_boot_gate_reads_the_same_figures():
    plan = plan_class(spec())
    doc = host_file(plan["launch"])
    assert doc["format"] == _launch.PLAN_FILE_FORMAT == _boot_gate.PLAN_FORMAT
    assert (doc["unit"], doc["gpus"], doc["port"]) == ("vllm-main.service", [3], 8001)
    assert doc["boot_gate"] == {"policy": "shrink", "state_file": "/var/lib/gpufleet-vllm/main.boot-gate.json"}
    gate = _boot_gate.parse_plan(doc)
    assert gate["kv_cache_memory_bytes"] == plan["kv_cache_memory_bytes"]
    assert (gate["num_blocks"], gate["kv_cache_tokens"]) == (plan["num_blocks"], plan["kv_cache_tokens"])
    assert gate["free_floor_bytes"] == plan["free_floor_bytes"] and gate["vllm_floor_bytes"] == plan["vllm_floor_bytes"]
    assert gate["gpu_memory_utilization"] == plan["gpu_memory_utilization"]
    assert gate["admission_blocks"] == plan["admission"]["required_blocks"]
    assert gate["policy"] == "shrink" and gate["gpus"] == [3]
    # the flat view the report and the kept-budget check read has the same figures
    flat = _launch.plan_file_figures(doc)
    assert (flat["kv_cache_memory_bytes"], flat["kv_cache_tokens"], flat["num_blocks"]) == (
        plan["kv_cache_memory_bytes"], plan["kv_cache_tokens"], plan["num_blocks"])


def test_the_boot_gate_refuses_a_bad_record_in_a_plan_file_naming_the_field():
    doc = host_file(plan_class(spec())["launch"])
    doc["launch"]["kv_cache_memory_bytes"] = -5
    with pytest.raises(_boot_gate.BootGateError, match=r"plan file: launch.kv_cache_memory_bytes: expected at least 1, got -5"):
        _boot_gate.parse_plan(doc)


def test_an_auto_profile_plan_file_has_no_gate():
    launch = _launch.for_instance({"decision": "auto_profile"}, 0.9)
    doc = host_file(launch)
    assert doc["boot_gate"] is None and doc["launch"]["manual"] is False
    assert _boot_gate.parse_plan(doc)["manual"] is False


def test_the_kept_budget_and_the_running_check_read_every_plan_file_format():
    plan = plan_class(spec())
    budget = plan["kv_cache_memory_bytes"]
    new = host_file(plan["launch"])
    old = {"format": 2, "decision": "deploy", "kv_cache_memory_bytes": budget,
           "gpu_memory_utilization": plan["gpu_memory_utilization"], "compat_key_hash": "k1"}
    for doc in (new, old):
        assert _launch.deployed(doc) == {"decision": "deploy", "kv_cache_memory_bytes": budget,
                                         "gpu_memory_utilization": plan["gpu_memory_utilization"], "compat_key_hash": "k1"}
        kept = keep_deployed(budget, budget, doc, "k1", 512 << 20, lambda b: b, None)
        assert kept == (budget, True, f"the deployed budget {kept[2].split('budget ')[1].split(' is')[0]} is the planned one")
        assert _launch.runs(doc, plan["launch"], "k1") is True
        assert _launch.runs(doc, plan["launch"], "k2") is False
    assert _launch.runs({}, plan["launch"], "k1") is False and _launch.deployed({}) == {}


def test_the_unit_and_the_canary_render_the_budget_with_one_function():
    from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import budget_args, build_argv

    launch = plan_class(spec())["launch"]
    words = budget_args(launch["kv_cache_memory_bytes"], launch["gpu_memory_utilization"])
    canary = build_argv("/opt/vllm/bin/vllm", "/srv/m", mode="manual", port=8000,
                        kv_cache_memory_bytes=launch["kv_cache_memory_bytes"],
                        gpu_memory_utilization=launch["gpu_memory_utilization"])
    assert canary[7:11] == words == ["--kv-cache-memory-bytes", str(launch["kv_cache_memory_bytes"]),
                                     "--gpu-memory-utilization", repr(launch["gpu_memory_utilization"])]


def test_the_plan_file_names_the_instances_cards_by_uuid_when_the_probe_read_them():
    launch = plan_class(spec())["launch"]
    probed = [{"index": i, "uuid": f"GPU-{i:08d}-0000-4000-8000-000000000000"} for i in range(4)]

    def doc(host_gpus: Any) -> dict[str, Any]:
        return _launch.plan_file(launch, {"name": "main", "gpus": [3, 1], "port": 8001}, host_class="h200", key_hash="k1",
                                 model="/srv/m", max_model_len=8192, planned_at="2026-12-02T10:00:00Z", gate_policy="shrink",
                                 gate_state_dir="/var/lib/gpufleet-vllm", host_gpus=host_gpus)

    named = doc(probed)
    assert named["gpu_uuids"] == ["GPU-00000003-0000-4000-8000-000000000000", "GPU-00000001-0000-4000-8000-000000000000"]
    assert _boot_gate.parse_plan(json.loads(json.dumps(named)))["gpu_uuids"] == named["gpu_uuids"]
    # not every card known, or no probe: no UUIDs (never some of them)
    assert "gpu_uuids" not in doc(probed[:2]) and "gpu_uuids" not in doc(None) and "gpu_uuids" not in doc([{"index": 3}])
    # the PCI bus ids beside them, where the probe read every one
    located = doc([dict(g, pci_bus_id=f"00000000:{0x18 + g['index']:02X}:00.0") for g in probed])
    assert located["gpu_pci_bus_ids"] == ["00000000:1B:00.0", "00000000:19:00.0"]
    assert _boot_gate.parse_plan(json.loads(json.dumps(located)))["gpu_pci_bus_ids"] == located["gpu_pci_bus_ids"]
    assert "gpu_pci_bus_ids" not in named

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings, strategies as st

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import GIB_ROUNDING_BYTES
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import (
    PlanError,
    floor_utilization,
    host_plan,
    plan_class,
    plan_deployable,
)

GIB = 1024**3
MIB = 1024**2

LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}
BPB = 16 * 131072  # Llama-3.1-8B bf16, block 16


def spec(**over):
    base = {
        "host_class": "h200",
        "reference": {
            "ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB"}],
            "total_bytes": "141GiB",
            "bytes_per_block": BPB,
            "kv_dtype_bytes": 2,
            "vllm_version": "0.32.0",
        },
        "hosts": {"a": [{"rank": 0, "boot_free_bytes": "40.75GiB"}]},
        "guard_bytes": "0.5GiB",
        "max_model_len": 8192,
    }
    base.update(over)
    return base


def four_rank_spec(frees):
    return spec(
        reference={
            "ranks": [{"rank": r, "free_bytes": "42GiB", "kv_bytes": "30GiB"} for r in range(4)],
            "total_bytes": "141GiB",
            "bytes_per_block": BPB,
        },
        hosts={"node-1": [{"rank": r, "boot_free_bytes": f} for r, f in enumerate(frees)]},
    )


# ---------------------------------------------------------------- formulas
def test_seed_example_28_25_gib():
    plan = plan_class(spec())
    assert plan["decision"] == "deploy"
    assert plan["kv_cache_memory_bytes"] == int(28.25 * GIB) == 30333206528
    assert plan["human"]["kv_cache_memory_bytes"] == "28.25GiB"
    row = plan["per_rank"][0]
    assert row["drift_bytes"] == int(1.25 * GIB)
    assert row["adjusted_bytes"] == int(28.25 * GIB)
    assert row["weakest"] is True
    # floor = F_ref - (B_ref - G - B_launch) = 42 - (30 - 0.5 - 28.25) = 40.75 GiB
    assert plan["free_floor_bytes"] == {0: int(40.75 * GIB)}
    assert row["margin_bytes"] == 0


def test_weakest_of_four_ranks_sets_the_value():
    frees = [round(x * GIB) for x in (41.8, 42.1, 40.6, 41.9)]
    plan = plan_class(four_rank_spec(frees))
    assert plan["weakest"]["rank"] == 2
    expected = 30 * GIB - (42 * GIB - frees[2]) - GIB // 2
    assert plan["kv_cache_memory_bytes"] == expected
    by_rank = {r["rank"]: r for r in plan["per_rank"]}
    assert by_rank[1]["adjusted_bytes"] == 30 * GIB - GIB // 2  # 42.1 > 42: capped at B_ref - G
    assert by_rank[1]["headroom_bytes"] == frees[1] - 42 * GIB
    assert [r["rank"] for r in plan["per_rank"] if r["weakest"]] == [2]
    # every rank has the same reference, so the same floor: 40.6 GiB
    assert set(plan["free_floor_bytes"].values()) == {42 * GIB - (30 * GIB - GIB // 2 - expected)}
    assert plan["free_floor_bytes"][0] == round(40.6 * GIB)


@pytest.mark.parametrize(
    "f_ref, b_ref, f_boot, guard, expected",
    [
        (42.0, 30.0, 40.75, 0.5, 28.25),
        (42.0, 30.0, 42.0, 0.5, 29.5),
        (42.0, 30.0, 50.0, 0.5, 29.5),  # more free memory never raises the budget
        (42.0, 30.0, 41.0, 0.0, 29.0),
        (80.0, 60.0, 70.0, 1.0, 49.0),
    ],
)
def test_drift_table(f_ref, b_ref, f_boot, guard, expected):
    plan = plan_class(
        spec(
            reference={"ranks": [{"rank": 0, "free_bytes": f"{f_ref}GiB", "kv_bytes": f"{b_ref}GiB"}], "total_bytes": "141GiB", "bytes_per_block": BPB},
            hosts={"h": [{"rank": 0, "boot_free_bytes": f"{f_boot}GiB"}]},
            guard_bytes=f"{guard}GiB",
        )
    )
    assert plan["max_safe_bytes"] == int(expected * GIB)


def test_per_rank_references_give_per_rank_floors():
    plan = plan_class(
        spec(
            reference={
                "ranks": [
                    {"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB"},
                    {"rank": 1, "free_bytes": "41GiB", "kv_bytes": "29GiB"},
                ],
                "total_bytes": "141GiB",
                "bytes_per_block": BPB,
            },
            hosts={"a": [{"rank": 0, "boot_free_bytes": "42GiB"}, {"rank": 1, "boot_free_bytes": "41GiB"}]},
        )
    )
    launch = plan["kv_cache_memory_bytes"]
    assert launch == 28.5 * GIB  # rank 1: 29 - 0 - 0.5
    assert plan["free_floor_bytes"] == {0: 42 * GIB - (30 * GIB - GIB // 2 - launch), 1: 41 * GIB}


def test_startup_utilization_from_vllm_figures():
    s = spec()
    s["reference"]["vllm_free_bytes"] = {"0": "41.5GiB"}
    plan = plan_class(s)
    assert plan["utilization_source"] == "vllm"
    vfloor = int(41.5 * GIB) - int(1.25 * GIB) - GIB_ROUNDING_BYTES
    assert plan["vllm_floor_bytes"] == {0: vfloor}
    util = plan["gpu_memory_utilization"]
    total = 141 * GIB
    assert util == math.floor(vfloor / total * 10000) / 10000
    assert math.ceil(total * util) <= vfloor  # vLLM's startup check passes at the floor
    assert math.ceil(total * (util + 0.0001)) > vfloor  # and it is the largest 4-decimal value that does


def test_startup_utilization_nvml_fallback_is_said():
    plan = plan_class(spec(cuda_context_bytes="1GiB"))
    assert plan["utilization_source"] == "nvml"
    floor = int(40.75 * GIB) - GIB
    assert plan["gpu_memory_utilization"] == floor_utilization(floor, 141 * GIB)
    assert any("CUDA-context allowance" in r for r in plan["reasons"])


def test_floor_utilization_edges():
    assert floor_utilization(0, 100) == 0.0
    assert floor_utilization(100, 100) == 1.0
    assert floor_utilization(99, 100) == 0.99
    total = 150754820096
    for free in (1, 12345678901, total - 1):
        u = floor_utilization(free, total)
        assert math.ceil(total * u) <= free


def test_blocks_tokens_concurrency_from_geometry():
    s = spec()
    s["reference"] = {
        "ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB"}],
        "total_bytes": "141GiB",
        "geometry": {"config": LLAMA_8B, "serve_args": {"max_model_len": 8192}},
        "vllm_version": "0.33.0",
    }
    del s["max_model_len"]
    plan = plan_class(s)
    assert plan["bytes_per_block"] == BPB
    assert plan["bytes_per_token"] == 131072
    assert plan["num_blocks"] == int(28.25 * GIB) // BPB == 14464
    assert plan["kv_cache_tokens"] == 14464 * 16
    assert plan["max_concurrency"] == (14464 - 1) // 512 == 28
    assert plan["max_concurrency_vllm"] == 28.25
    assert plan["one_request_bytes"] == 513 * BPB
    assert plan["what_if_fp8"]["num_blocks"] == int(28.25 * GIB) // (BPB // 2)
    assert plan["what_if_fp8"]["max_concurrency"] == (28928 - 1) // 512


def test_tiny_cpu_engine_figures():
    s = {
        "reference": {
            "ranks": [{"rank": 0, "free_bytes": 100_000_000 + 2 * MIB, "kv_bytes": 100_000_000 + MIB}],
            "total_bytes": 10297266176,
            "geometry": {
                "config": {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "torch_dtype": "bfloat16"},
                "serve_args": {"block_size": 128},
            },
        },
        "hosts": {"cpu": [{"rank": 0, "boot_free_bytes": 100_000_000 + 2 * MIB}]},
        "guard_bytes": MIB,
        "max_model_len": 256,
    }
    plan = plan_class(s)
    assert plan["kv_cache_memory_bytes"] == 100_000_000
    assert plan["num_blocks"] == 1525
    assert plan["kv_cache_tokens"] == 195_200
    assert plan["max_concurrency_vllm"] == 762.5  # what vLLM logs: "762.50x"


def test_sliding_window_model_is_planned_from_its_layout_not_scaled():
    s = spec()
    s["reference"] = {
        "ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB"}],
        "total_bytes": "141GiB",
        "geometry": {"config": dict(LLAMA_8B, sliding_window=4096), "serve_args": {"max_num_batched_tokens": 2048}},
        "vllm_version": "0.32.0",
    }
    plan = plan_class(s)
    assert plan["capacity_source"] == "layout"
    assert plan["kv_layout"]["family"] == "sliding_window"
    assert plan["num_blocks"] == int(28.25 * GIB) // BPB
    # one group of 32 sliding layers: cdiv(4095 + 2048, 16) + 1 = 385 blocks per request of 8192 tokens
    assert plan["blocks_per_request"] == 385
    assert plan["kv_cache_tokens"] == int(plan["num_blocks"] / 385 * 8192)
    assert plan["what_if_fp8"]["bytes_per_block"] == BPB // 2


def test_engine_figures_disagreeing_with_the_layout_are_used_and_said():
    s = spec()
    s["reference"] = {
        "ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB"}],
        "total_bytes": "141GiB",
        "geometry": {"config": dict(LLAMA_8B, sliding_window=4096), "serve_args": {}},
        "block_size": 16,
        "vllm_version": "0.32.0",
        "num_blocks": 10000,
        "kv_cache_tokens": 160000,
        "max_concurrency": 625.0,
        "max_model_len": 8192,
        "engine_kv_bytes": "30GiB",
    }
    plan = plan_class(s)
    assert plan["capacity_source"] == "engine"
    assert plan["num_blocks"] == 10000 * int(28.25 * GIB) // (30 * GIB)
    assert plan["blocks_per_request"] == 16
    assert plan["what_if_fp8"] is None
    assert any("layout predicts" in r for r in plan["reasons"])


def test_no_geometry_no_capacity_but_still_a_budget():
    s = spec()
    del s["reference"]["bytes_per_block"]
    plan = plan_class(s)
    assert plan["decision"] == "deploy"
    assert plan["num_blocks"] is None
    assert any("not computed" in r for r in plan["reasons"])


# ---------------------------------------------------------------- admission
def test_admission_ok_and_shortfall():
    ok = plan_class(spec(admission={"concurrency": 8, "tokens_per_request": 8192}))
    assert ok["admission"]["required_blocks"] == 8 * 512 + 1
    assert ok["admission"]["ok"] is True
    short = plan_class(spec(admission={"tokens": 300_000}))
    assert short["decision"] == "deploy"
    assert short["admission"]["ok"] is False
    assert short["admission"]["shortfall_blocks"] == math.ceil(300_000 / 16) + 1 - 14464
    assert short["admission"]["shortfall_tokens"] == short["admission"]["shortfall_blocks"] * 16
    assert any("admission shortfall" in r for r in short["reasons"])


def test_admission_needs_at_least_one_full_request():
    plan = plan_class(spec(admission={"tokens": 10}))
    assert plan["admission"]["required_blocks"] == 513


def test_refuse_when_not_even_one_request_fits():
    s = spec(max_model_len=131072 * 4)
    plan = plan_class(s)
    assert plan["decision"] == "refuse"
    assert "cannot hold one request of max_model_len 524288" in plan["reasons"][0]


def test_fit_admission_right_sizes():
    s = spec(budget_mode="fit_admission", admission={"concurrency": 4, "tokens_per_request": 8192}, fit_headroom=0.1)
    s["reference"]["vllm_free_bytes"] = {0: "41.5GiB"}
    plan = plan_class(s)
    need = 4 * 512 + 1
    blocks = need + math.ceil(need * 0.1)
    assert plan["fit"]["blocks"] == blocks
    assert plan["kv_cache_memory_bytes"] == blocks * BPB
    assert plan["fit"]["left_free_bytes_per_gpu"] == int(28.25 * GIB) - blocks * BPB
    assert plan["max_safe_bytes"] == int(28.25 * GIB)
    # the floor follows the smaller budget
    assert plan["free_floor_bytes"][0] == 42 * GIB - (30 * GIB - GIB // 2 - blocks * BPB)
    max_safe = copy.deepcopy(s)
    max_safe["budget_mode"] = "max_safe"
    # a smaller budget lowers the floor, so the startup check must accept less free memory
    assert plan["gpu_memory_utilization"] < plan_class(max_safe)["gpu_memory_utilization"]
    assert plan["decision"] == "deploy"


def test_fit_admission_never_above_max_safe():
    s = spec(budget_mode="fit_admission", admission={"tokens": 10**7})
    plan = plan_class(s)
    assert plan["kv_cache_memory_bytes"] == (int(28.25 * GIB) // BPB) * BPB
    assert plan["fit"]["capped_at_max_safe"] is True


def test_fit_admission_needs_admission():
    with pytest.raises(PlanError, match="fit_admission needs admission"):
        plan_class(spec(budget_mode="fit_admission"))


# ---------------------------------------------------------------- decisions
def test_refuse_without_reference():
    for ref in (None, {}, {"ranks": []}):
        plan = plan_class(spec(reference=ref))
        assert plan["decision"] == "refuse"
        assert "no reference profile" in plan["reasons"][0]
        assert plan["kv_cache_memory_bytes"] is None


def test_refuse_without_hosts():
    assert plan_class(spec(hosts={}))["decision"] == "refuse"


def test_refuse_missing_ranks_names_hosts():
    s = four_rank_spec(["42GiB"] * 4)
    s["hosts"]["node-2"] = [{"rank": 0, "boot_free_bytes": "42GiB"}, {"rank": 1, "boot_free_bytes": "42GiB"}]
    s["hosts"]["node-3"] = [{"rank": r, "boot_free_bytes": "42GiB"} for r in range(5)]
    plan = plan_class(s)
    assert plan["decision"] == "refuse"
    text = " ".join(plan["reasons"])
    assert "node-2 (reference ranks [2, 3] are missing)" in text
    assert "node-3 (ranks [4] have no reference rank)" in text
    assert "node-1" not in text.split("rank layout")[1].split(";")[0]


@pytest.mark.parametrize(
    "hosts, word",
    [
        (
            {
                "a": [{"rank": 0, "boot_free_bytes": "42GiB", "gpu_name": "NVIDIA H200"}],
                "b": [{"rank": 0, "boot_free_bytes": "42GiB", "gpu_name": "NVIDIA H100 80GB HBM3"}],
            },
            "mixed GPU name",
        ),
        (
            {
                "a": {"ranks": [{"rank": 0, "boot_free_bytes": "42GiB"}], "total_bytes": "141GiB"},
                "b": {"ranks": [{"rank": 0, "boot_free_bytes": "42GiB"}], "total_bytes": "80GiB"},
            },
            "GPU total memory differs from the reference",
        ),
        (
            {
                "a": {"ranks": [{"rank": 0, "boot_free_bytes": "42GiB"}], "compat_hash": "aaaa"},
                "b": {"ranks": [{"rank": 0, "boot_free_bytes": "42GiB"}], "compat_hash": "bbbb"},
            },
            "mixed compatibility key hash",
        ),
    ],
)
def test_refuse_mixed_classes_naming_hosts(hosts, word):
    plan = plan_class(spec(hosts=hosts))
    assert plan["decision"] == "refuse"
    text = " ".join(plan["reasons"])
    assert word in text
    assert ": b" in text or "b" in text.split(word)[1]


def test_refuse_host_mixing_gpus_in_one_engine():
    s = spec(
        reference={
            "ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB"}, {"rank": 1, "free_bytes": "42GiB", "kv_bytes": "30GiB"}],
            "bytes_per_block": BPB,
        },
        hosts={"a": [{"rank": 0, "boot_free_bytes": "42GiB", "total_bytes": 80 * GIB}, {"rank": 1, "boot_free_bytes": "42GiB", "total_bytes": 141 * GIB}]},
    )
    plan = plan_class(s)
    assert plan["decision"] == "refuse"
    assert any("host a mixes GPU memory sizes" in r for r in plan["reasons"])


def test_refuse_compat_hash_differs_from_reference():
    s = spec()
    s["reference"]["compat_hash"] = "1111222233334444"
    s["hosts"] = {"a": {"ranks": [{"rank": 0, "boot_free_bytes": "42GiB"}], "compat_hash": "9999"}}
    plan = plan_class(s)
    assert plan["decision"] == "refuse"
    assert any("compatibility key hash differs from the reference" in r for r in plan["reasons"])


@pytest.mark.parametrize(
    "rank, word",
    [
        ({"rank": 0, "free_bytes": "42GiB", "kv_bytes": -123456}, "not positive"),
        ({"rank": 0, "free_bytes": "42GiB", "kv_bytes": 0}, "not positive"),
        ({"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB", "kv_bytes_full": "29GiB"}, "exceeds the 'fully utilize'"),
        ({"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB", "kv_bytes_full": "-5GiB"}, "'fully utilize' suggestion"),
        ({"rank": 0, "free_bytes": "20GiB", "kv_bytes": "30GiB"}, "exceed the free memory"),
    ],
)
def test_refuse_bad_vllm_suggestions(rank, word):
    s = spec()
    s["reference"]["ranks"] = [rank]
    plan = plan_class(s)
    assert plan["decision"] == "refuse"
    text = " ".join(plan["reasons"])
    assert word in text
    if "positive" in word or "fully" in word:
        assert "57936" in text


def test_refuse_when_drift_eats_everything():
    plan = plan_class(spec(hosts={"a": [{"rank": 0, "boot_free_bytes": "10GiB"}]}))
    assert plan["decision"] == "refuse"
    assert "leaves no KV memory" in plan["reasons"][0]
    assert "host a rank 0" in plan["reasons"][0]


def test_auto_profile_for_unsteady_free_memory():
    hosts = {
        "a": [{"rank": 0, "boot_free_bytes": "42GiB", "free_min_bytes": "41GiB", "free_max_bytes": "42GiB"}],
        "b": [{"rank": 0, "boot_free_bytes": "42GiB", "free_min_bytes": "41.875GiB", "free_max_bytes": "42GiB"}],
    }
    plan = plan_class(spec(hosts=hosts, unstable_scope="class"))
    assert plan["decision"] == "auto_profile"
    assert [u["host"] for u in plan["unstable"]] == ["a"]
    assert "a rank 0 (moves 1GiB)" in plan["reasons"][0]
    assert plan["gpu_memory_utilization"] is not None
    assert plan["host_groups"] == []
    # a spread equal to the limit (0.5 x 0.5 GiB) is still steady
    hosts["a"][0]["free_min_bytes"] = 42 * GIB - GIB // 4
    assert plan_class(spec(hosts=hosts))["decision"] == "deploy"


def test_an_unsteady_host_alone_runs_vllms_profiling():
    """unstable_scope host (the default): the steady hosts keep a fixed budget planned without the unsteady one."""
    hosts = {
        "a": [{"rank": 0, "boot_free_bytes": "40GiB", "free_min_bytes": "39GiB", "free_max_bytes": "40GiB"}],
        "b": [{"rank": 0, "boot_free_bytes": "42GiB"}],
        "c": [{"rank": 0, "boot_free_bytes": "41.5GiB"}],
    }
    plan = plan_class(spec(hosts=hosts))
    assert plan["decision"] == "deploy"
    # planned from b and c: the weakest is c (drift 0.5 GiB), not the unsteady a (drift 2 GiB)
    assert plan["weakest"]["host"] == "c" and plan["kv_cache_memory_bytes"] == 29 * GIB
    assert plan["host_count"] == 3 and [u["host"] for u in plan["unstable"]] == ["a"]
    (group,) = plan["host_groups"]
    assert group["hosts"] == ["a"] and group["why"] == "unstable"
    assert group["plan"]["decision"] == "auto_profile" and group["plan"]["launch"]["manual"] is False
    assert "free memory is not steady on a rank 0 (moves 1GiB)" in plan["reasons"][1]
    assert "only a runs vLLM's own profiling (auto_profile); the class's 2 other hosts are planned without it" in plan["reasons"][1]
    assert host_plan(plan, "a") is group["plan"] and host_plan(plan, "b") is plan
    assert plan_deployable(plan)
    # every host unsteady: the class as a whole
    for name in hosts:
        hosts[name] = hosts["a"]
    whole = plan_class(spec(hosts=hosts))
    assert whole["decision"] == "auto_profile" and whole["host_groups"] == []


def test_auto_profile_for_flagged_host():
    plan = plan_class(spec(hosts={"a": {"ranks": [{"rank": 0, "boot_free_bytes": "42GiB"}], "unstable": True}}))
    assert plan["decision"] == "auto_profile"
    assert "flagged unstable" in plan["reasons"][0]


def test_split_names_outliers_and_budgets():
    hosts = {f"n{i}": [{"rank": 0, "boot_free_bytes": "42GiB"}] for i in range(10)}
    hosts["n3"] = [{"rank": 0, "boot_free_bytes": "38GiB"}]
    hosts["n7"] = [{"rank": 0, "boot_free_bytes": "39GiB"}]
    plan = plan_class(spec(hosts=hosts, max_capacity_loss=0.05))
    assert plan["decision"] == "split"
    assert plan["kv_cache_memory_bytes"] == int(25.5 * GIB)
    assert sorted(plan["capacity"]["outlier_hosts"]) == ["n3", "n7"]
    main, low = plan["split"]
    assert sorted(low["hosts"]) == ["n3", "n7"] and low["kv_cache_memory_bytes"] == int(25.5 * GIB)
    assert "n3" not in main["hosts"] and main["kv_cache_memory_bytes"] == int(29.5 * GIB)
    assert any("split outliers n3, n7" in r for r in plan["reasons"])
    # within the allowed loss: no split
    assert plan_class(spec(hosts=hosts, max_capacity_loss=0.2))["decision"] == "deploy"


def test_a_hosts_instances_share_its_plan():
    """Members are <host>/<instance>: one unsteady instance sends its whole host to vLLM's profiling."""
    hosts = {
        "a/x": [{"rank": 0, "boot_free_bytes": "42GiB"}],
        "a/y": {"ranks": [{"rank": 0, "boot_free_bytes": "42GiB"}], "unstable": True},
        "b/x": [{"rank": 0, "boot_free_bytes": "42GiB"}],
        "b/y": [{"rank": 0, "boot_free_bytes": "42GiB"}],
    }
    plan = plan_class(spec(hosts=hosts))
    assert plan["decision"] == "deploy" and [g["hosts"] for g in plan["host_groups"]] == [["a"]]
    assert host_plan(plan, "a")["decision"] == "auto_profile" and host_plan(plan, "a")["host_count"] == 2
    assert host_plan(plan, "b") is plan


def test_split_per_host_gives_the_other_hosts_their_own_plan():
    hosts = {f"n{i}": [{"rank": 0, "boot_free_bytes": "42GiB"}] for i in range(10)}
    hosts["n3"] = [{"rank": 0, "boot_free_bytes": "38GiB"}]
    plan = plan_class(spec(hosts=hosts, max_capacity_loss=0.05))
    assert plan["decision"] == "split" and plan["kv_cache_memory_bytes"] == int(25.5 * GIB)
    (group,) = plan["host_groups"]
    assert group["why"] == "split" and "n3" not in group["hosts"] and len(group["hosts"]) == 9
    main = group["plan"]
    assert main["decision"] == "deploy" and main["kv_cache_memory_bytes"] == int(29.5 * GIB)
    # the group's floors are its own budget's: a host of it is gated against them
    assert main["free_floor_bytes"][0] > plan["free_floor_bytes"][0]
    assert host_plan(plan, "n0")["kv_cache_memory_bytes"] == int(29.5 * GIB)
    assert host_plan(plan, "n3")["kv_cache_memory_bytes"] == int(25.5 * GIB)
    assert "split_policy per_host" in plan["reasons"][1]
    assert plan_deployable(plan, "per_host") and plan_deployable(plan, "warn") and not plan_deployable(plan, "fail")
    # warn: the weakest budget everywhere, no groups
    assert plan_class(spec(hosts=hosts, max_capacity_loss=0.05, split_policy="warn"))["host_groups"] == []
    with pytest.raises(PlanError, match="split_policy: expected one of per_host, warn, fail"):
        plan_class(spec(split_policy="hosts"))
    with pytest.raises(PlanError, match="unstable_scope"):
        plan_class(spec(unstable_scope="rack"))


def test_reprofile_only_for_large_headroom():
    small = plan_class(spec(hosts={"a": [{"rank": 0, "boot_free_bytes": "43GiB"}]}))
    assert small["decision"] == "deploy"
    assert small["kv_cache_memory_bytes"] == int(29.5 * GIB)
    assert small["headroom"]["min_bytes"] == GIB
    assert any("re-profile the class to use it" in r for r in small["reasons"])
    large = plan_class(spec(hosts={"a": [{"rank": 0, "boot_free_bytes": "46GiB"}]}))
    assert large["decision"] == "reprofile"
    assert large["headroom"]["reprofile_threshold_bytes"] == 3 * GIB
    custom = plan_class(spec(hosts={"a": [{"rank": 0, "boot_free_bytes": "43GiB"}]}, reprofile_headroom="1GiB"))
    assert custom["decision"] == "reprofile"
    # one rank without headroom keeps the class on deploy
    mixed = plan_class(spec(hosts={"a": [{"rank": 0, "boot_free_bytes": "46GiB"}], "b": [{"rank": 0, "boot_free_bytes": "42GiB"}]}))
    assert mixed["decision"] == "deploy"


def test_precedence_refuse_over_auto_profile():
    hosts = {"a": [{"rank": 0, "boot_free_bytes": "10GiB", "free_min_bytes": 0, "free_max_bytes": "10GiB"}]}
    assert plan_class(spec(hosts=hosts))["decision"] == "refuse"


def test_reference_record_is_unwrapped():
    record = {"format": 1, "host_class": "h200", "key_hash": "abcd", "compat": {"model": "x"}, "recorded_at": "t", "profile": spec()["reference"]}
    plan = plan_class(spec(reference=record))
    assert plan["kv_cache_memory_bytes"] == int(28.25 * GIB)
    bad_host = {"a": {"ranks": [{"rank": 0, "boot_free_bytes": "42GiB"}], "compat_hash": "ffff"}}
    assert plan_class(spec(reference=record, hosts=bad_host))["decision"] == "refuse"


# ---------------------------------------------------------------- input errors
@pytest.mark.parametrize(
    "over, match",
    [
        ({"guard_bytes": "-1GiB"}, "guard_bytes"),
        ({"guard_bytes": "half a gig"}, "guard_bytes"),
        ({"budget_mode": "yolo"}, "budget_mode"),
        ({"max_capacity_loss": 1.5}, "max_capacity_loss"),
        ({"unstable_share": 0}, "unstable_share"),
        ({"fit_headroom": "lots"}, "fit_headroom"),
        ({"hosts": {"a": [{"rank": 0}]}}, "boot_free_bytes is required"),
        ({"hosts": {"a": [{"rank": 0, "boot_free_bytes": "1.5B"}]}}, r"hosts.a\[0\].boot_free_bytes"),
        ({"hosts": {"a": [{"rank": -1, "boot_free_bytes": 1}]}}, "rank must be"),
        ({"hosts": {"a": [{"rank": 0, "boot_free_bytes": 1}, {"rank": 0, "boot_free_bytes": 1}]}}, "appears twice"),
        ({"hosts": ["a"]}, "hosts"),
        ({"reference": {"ranks": [{"rank": 0, "free_bytes": 1}]}}, r"reference.ranks\[0\].kv_bytes is required"),
        ({"reference": {"ranks": [{"rank": 0, "free_bytes": 1, "kv_bytes": 1}, {"rank": 0, "free_bytes": 1, "kv_bytes": 1}]}}, "appears twice"),
        ({"reference": {"ranks": [{"rank": 0, "free_bytes": 9, "kv_bytes": 1}], "bytes_per_block": 17}}, "multiple of block_size"),
        ({"admission": {"concurrency": 2}}, "admission"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"reference": "nope"}, "reference"),
    ],
)
def test_bad_input(over, match):
    with pytest.raises(PlanError, match=match):
        plan_class(spec(**over))


def test_geometry_disagreeing_with_bytes_per_block():
    s = spec()
    s["reference"]["geometry"] = {"config": LLAMA_8B, "serve_args": {"tensor_parallel_size": 2}}
    with pytest.raises(PlanError, match="disagrees"):
        plan_class(s)


def test_input_not_mutated():
    s = spec()
    before = copy.deepcopy(s)
    plan_class(s)
    assert s == before


# ---------------------------------------------------------------- properties
FREE = st.integers(min_value=20 * GIB, max_value=60 * GIB)


@st.composite
def fleets(draw):
    ranks = draw(st.integers(min_value=1, max_value=4))
    ref = [
        {
            "rank": r,
            "free_bytes": draw(st.integers(min_value=40 * GIB, max_value=50 * GIB)),
            "kv_bytes": draw(st.integers(min_value=25 * GIB, max_value=35 * GIB)),
        }
        for r in range(ranks)
    ]
    n_hosts = draw(st.integers(min_value=1, max_value=6))
    hosts = {f"h{i}": [{"rank": r, "boot_free_bytes": draw(FREE)} for r in range(ranks)] for i in range(n_hosts)}
    guard = draw(st.integers(min_value=0, max_value=2 * GIB))
    return {
        "reference": {"ranks": ref, "total_bytes": 141 * GIB, "bytes_per_block": BPB, "kv_dtype_bytes": 2, "vllm_version": "0.32.0"},
        "hosts": hosts,
        "guard_bytes": guard,
        "max_model_len": 8192,
    }


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_launch_never_exceeds_any_rank_nor_cap(s):
    plan = plan_class(s)
    launch = plan["max_safe_bytes"]
    for row in plan["per_rank"]:
        assert launch <= row["adjusted_bytes"]
    for ref in s["reference"]["ranks"]:
        assert launch <= ref["kv_bytes"] - s["guard_bytes"]
    assert launch == min(row["adjusted_bytes"] for row in plan["per_rank"])


@settings(max_examples=150, deadline=None)
@given(fleets(), st.data())
def test_monotone_in_each_boot_free(s, data):
    before = plan_class(s)["max_safe_bytes"]
    host = data.draw(st.sampled_from(sorted(s["hosts"])))
    rank = data.draw(st.integers(min_value=0, max_value=len(s["hosts"][host]) - 1))
    bump = data.draw(st.integers(min_value=0, max_value=10 * GIB))
    s2 = copy.deepcopy(s)
    s2["hosts"][host][rank]["boot_free_bytes"] += bump
    assert plan_class(s2)["max_safe_bytes"] >= before


@settings(max_examples=150, deadline=None)
@given(fleets(), st.lists(FREE, min_size=4, max_size=4))
def test_every_rank_at_or_above_its_floor_is_safe(s, new_frees):
    plan = plan_class(s)
    launch = plan["kv_cache_memory_bytes"]
    guard = s["guard_bytes"]
    refs = {r["rank"]: r for r in s["reference"]["ranks"]}
    for r, ref in refs.items():
        floor = plan["free_floor_bytes"][r]
        for f_boot in new_frees + [floor]:
            adjusted = ref["kv_bytes"] - max(0, ref["free_bytes"] - f_boot) - guard
            if f_boot >= floor:
                assert adjusted >= launch
            else:
                assert adjusted < launch


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_tokens_never_exceed_bytes_over_bytes_per_token(s):
    plan = plan_class(s)
    if plan["kv_cache_tokens"] is not None:
        assert plan["kv_cache_tokens"] <= plan["kv_cache_memory_bytes"] // (BPB // 16)
        assert plan["num_blocks"] * BPB <= plan["kv_cache_memory_bytes"]


@settings(max_examples=100, deadline=None)
@given(fleets(), st.integers(min_value=1, max_value=200_000), st.floats(min_value=0, max_value=1))
def test_fit_admission_never_above_launch(s, tokens, headroom):
    s = dict(s, budget_mode="fit_admission", admission={"tokens": tokens}, fit_headroom=headroom)
    plan = plan_class(s)
    assert plan["kv_cache_memory_bytes"] <= max(0, plan["max_safe_bytes"])
    assert plan["kv_cache_memory_bytes"] % BPB == 0


def test_reference_total_rounded_like_vllm_log_is_accepted():
    exact = 150754820096  # NVML
    logged = round(exact / GIB, 2) * GIB  # "140.40 GiB" in vLLM's log
    s = spec(hosts={"a": {"ranks": [{"rank": 0, "boot_free_bytes": "40.75GiB"}], "total_bytes": exact}})
    s["reference"]["total_bytes"] = int(logged)
    plan = plan_class(s)
    assert plan["decision"] == "deploy"
    nvml_floor = int(40.75 * GIB) - GIB
    assert plan["gpu_memory_utilization"] == floor_utilization(nvml_floor, exact)  # NVML's exact total is used
    s["hosts"]["a"]["total_bytes"] = exact + GIB
    assert plan_class(s)["decision"] == "refuse"

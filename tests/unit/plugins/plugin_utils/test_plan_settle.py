# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""No restart churn: the budget rounded down with a gate margin, a deployed budget kept within a step."""

from __future__ import annotations

import pytest

from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import PlanError, keep_deployed, plan_class, round_budget

GIB = 1024**3
MIB = 1024**2
BPB = 16 * 131072  # Llama-3.1-8B bf16, block 16
KEY = "k" * 16

SETTLE = {"gate_margin_bytes": "64MiB", "budget_granularity_bytes": "256MiB", "keep_step_bytes": "512MiB"}


def spec(boot_free: str | int = "40.75GiB", deployed=None, **over):
    base = {
        "host_class": "h200",
        "reference": {
            "ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB"}],
            "total_bytes": "141GiB",
            "bytes_per_block": BPB,
            "compat_hash": KEY,
            "vllm_version": "0.32.0",
        },
        "hosts": {"a": [{"rank": 0, "boot_free_bytes": boot_free}]},
        "guard_bytes": "0.5GiB",
        "max_model_len": 8192,
        **SETTLE,
    }
    if deployed is not None:
        base["deployed"] = deployed
    base.update(over)
    return base


def test_round_budget_margin_granularity_blocks():
    # 28.25 GiB - 64 MiB = 28.1875 GiB -> 28 GiB (granule 256 MiB), whole 2 MiB blocks
    assert round_budget(int(28.25 * GIB), BPB, 256 * MIB, 64 * MIB) == 28 * GIB
    # an odd block size: the granule's multiple is rounded down again to whole blocks
    assert round_budget(10 * GIB, 3 * MIB, 256 * MIB, 0) == (10 * GIB // (3 * MIB)) * 3 * MIB
    # below one granule only whole blocks count (small GPUs, the CPU build)
    assert round_budget(100 * MIB + 5, BPB, 256 * MIB, 0) == 100 * MIB
    assert round_budget(10 * MIB, BPB, 0, 64 * MIB) == 0
    assert round_budget(-5, BPB, 0, 0) == 0


def test_plan_rounds_and_the_weakest_rank_keeps_a_margin_above_its_floor():
    plan = plan_class(spec())
    assert plan["max_safe_bytes"] == int(28.25 * GIB)
    assert plan["kv_cache_memory_bytes"] == 28 * GIB
    assert plan["kv_cache_memory_bytes"] % BPB == 0
    row = plan["per_rank"][0]
    # floor = 42 - (30 - 0.5 - 28) = 40.5 GiB: 0.25 GiB below the free memory planned with
    assert plan["free_floor_bytes"] == {0: int(40.5 * GIB)}
    assert row["margin_bytes"] == 256 * MIB >= 64 * MIB
    choice = plan["budget_choice"]
    assert choice["rounded_bytes"] == 28 * GIB and choice["kept"] is False
    assert any("gate margin 64.00MiB" in r or "gate margin 64MiB" in r for r in plan["reasons"]), plan["reasons"]


def test_a_few_mib_of_drift_gives_the_same_rounded_budget_or_keeps_the_deployed_one():
    first = plan_class(spec())
    deployed = {"kv_cache_memory_bytes": first["kv_cache_memory_bytes"], "compat_key_hash": KEY, "decision": "deploy"}
    for moved in (-7, -3, 3, 7, 60):  # MiB of free memory between the two runs
        again = plan_class(spec(int(40.75 * GIB) + moved * MIB, deployed=deployed))
        assert again["kv_cache_memory_bytes"] == first["kv_cache_memory_bytes"], moved
        assert again["gpu_memory_utilization"] == first["gpu_memory_utilization"], moved
        assert again["free_floor_bytes"] == first["free_floor_bytes"], moved
        assert again["budget_choice"]["kept"] is True, moved


def test_the_deployed_budget_is_kept_across_a_granule_boundary():
    # 200 MiB more free memory: max safe 28.45 GiB less the 64 MiB margin rounds to 28.25 GiB, one
    # granule above the deployed 28 GiB, which is still safe and within the step: kept
    deployed = {"kv_cache_memory_bytes": 28 * GIB, "compat_key_hash": KEY}
    plan = plan_class(spec(int(40.75 * GIB) + 200 * MIB, deployed=deployed))
    assert plan["budget_choice"]["planned_bytes"] == int(28.25 * GIB)
    assert plan["kv_cache_memory_bytes"] == 28 * GIB
    assert plan["budget_choice"]["kept"] is True
    assert any("is kept (no canary, no restart)" in r for r in plan["reasons"])
    assert plan["per_rank"][0]["margin_bytes"] >= 64 * MIB


def test_a_deployed_budget_that_is_no_longer_safe_is_replaced():
    deployed = {"kv_cache_memory_bytes": 28 * GIB, "compat_key_hash": KEY}
    plan = plan_class(spec(int(40.75 * GIB) - 250 * MIB, deployed=deployed))
    assert plan["kv_cache_memory_bytes"] == int(27.75 * GIB)
    assert plan["budget_choice"]["kept"] is False
    assert "no longer safe" in plan["budget_choice"]["reason"]


def test_a_change_beyond_the_keep_step_is_deployed():
    deployed = {"kv_cache_memory_bytes": 27 * GIB, "compat_key_hash": KEY}
    plan = plan_class(spec(deployed=deployed))
    assert plan["kv_cache_memory_bytes"] == 28 * GIB
    assert "more than the keep step" in plan["budget_choice"]["reason"]
    # a larger step keeps it
    plan = plan_class(spec(deployed=deployed, keep_step_bytes="2GiB"))
    assert plan["kv_cache_memory_bytes"] == 27 * GIB and plan["budget_choice"]["kept"]
    # step 0: never kept
    plan = plan_class(spec(deployed=deployed, keep_step_bytes=0))
    assert plan["kv_cache_memory_bytes"] == 28 * GIB and not plan["budget_choice"]["kept"]


def test_another_key_or_no_manual_budget_is_not_kept():
    plan = plan_class(spec(deployed={"kv_cache_memory_bytes": int(27.9 * GIB), "compat_key_hash": "other"}))
    assert plan["kv_cache_memory_bytes"] == 28 * GIB and "another compatibility key" in plan["budget_choice"]["reason"]
    plan = plan_class(spec(deployed={"kv_cache_memory_bytes": None, "decision": "auto_profile", "compat_key_hash": KEY}))
    assert plan["kv_cache_memory_bytes"] == 28 * GIB and "no manual budget" in plan["budget_choice"]["reason"]


def test_a_deployed_budget_short_of_the_admission_plan_is_replaced():
    # 4 x 8192 tokens = 2048 blocks + the null block; 4 GiB holds 2048 blocks of 2 MiB: one short
    deployed = {"kv_cache_memory_bytes": 4 * GIB, "compat_key_hash": KEY}
    plan = plan_class(spec(deployed=deployed, keep_step_bytes="100GiB",
                           admission={"concurrency": 4, "tokens_per_request": 8192}))
    assert plan["kv_cache_memory_bytes"] == 28 * GIB
    assert "no longer holds the 2049 blocks" in plan["budget_choice"]["reason"]


def test_keep_deployed_directly():
    budget, kept, reason = keep_deployed(10, 20, None, KEY, 5, lambda b: b, None)
    assert (budget, kept) == (10, False) and "no budget deployed" in reason
    budget, kept, _reason = keep_deployed(10, 20, {"kv_cache_memory_bytes": 12, "compat_key_hash": KEY}, KEY, 5, lambda b: b, 11)
    assert (budget, kept) == (12, True)
    budget, kept, _reason = keep_deployed(10, 20, {"kv_cache_memory_bytes": 12, "compat_key_hash": KEY}, None, 5, lambda b: b, None)
    assert (budget, kept) == (10, False)


def test_bad_settle_inputs_name_the_field():
    with pytest.raises(PlanError, match="gate_margin_bytes"):
        plan_class(spec(gate_margin_bytes="lots"))
    with pytest.raises(PlanError, match="budget_granularity_bytes"):
        plan_class(spec(budget_granularity_bytes=-1))
    with pytest.raises(PlanError, match="deployed"):
        plan_class(spec(deployed=["28GiB"]))
    with pytest.raises(PlanError, match="deployed.kv_cache_memory_bytes"):
        plan_class(spec(deployed={"kv_cache_memory_bytes": "huge", "compat_key_hash": KEY}))


def test_settling_off_keeps_the_exact_formula():
    plan = plan_class(spec(gate_margin_bytes=0, budget_granularity_bytes=0, keep_step_bytes=0))
    assert plan["kv_cache_memory_bytes"] == int(28.25 * GIB)

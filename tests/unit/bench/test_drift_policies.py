# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The drift-policy simulation's accounting on a two-host fleet computed by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import drift_policies as dp  # noqa: E402  pylint: disable=wrong-import-position,import-error

GIB = dp.GIB
# 100 GiB GPUs, 1 GiB CUDA context, 10 GiB weights & co, 1 GiB per 16-token block
MODEL = dp.Model(total=100 * GIB, ctx=1 * GIB, non_kv=10 * GIB, bytes_per_block=GIB, block_size=16, max_model_len=16)


def ref(util: float) -> dp.Reference:
    return dp.Reference(free=[90 * GIB, 90 * GIB], kv=[70 * GIB, 70 * GIB], util=util)


def fleet(plan_b: list[float], boot_b: list[float]) -> dp.Fleet:
    return dp.Fleet(
        plan_free={"a": [90 * GIB, 90 * GIB], "b": [int(x * GIB) for x in plan_b]},
        boot_free={"a": [90 * GIB, 90 * GIB], "b": [int(x * GIB) for x in boot_b]},
    )


def test_copy_startup_refusal_and_accounting() -> None:
    out = dp.policy_copy(MODEL, ref(0.8), fleet([75, 90], [75, 90]))
    # host a: 89 GiB seen by vLLM >= 80 GiB requested; 1 + 10 + 70 <= 90: boots
    # host b: 74 GiB < 80 GiB: vLLM refuses to start
    assert (out.booted, out.startup_refused, out.oom) == (1, 1, 0)
    assert out.tokens_deployed == 70 * 16
    assert out.tokens_safe_max == (90 - 11) * 16 + (75 - 11) * 16
    assert out.free_left_bytes == 2 * (90 - 11 - 70) * GIB
    assert out.as_dict()["free_left_gib_per_booted_gpu"] == 9.0
    assert out.reprofiles == 0


def test_copy_oom_when_the_startup_check_passes() -> None:
    out = dp.policy_copy(MODEL, ref(0.5), fleet([75, 90], [75, 90]))
    # host b passes the check (74 >= 50) but 1 + 10 + 70 = 81 > 75: OOM
    assert (out.booted, out.startup_refused, out.oom, out.boot_failures) == (1, 0, 1, 1)


def test_average_uses_the_mean_drift_and_guard() -> None:
    out = dp.policy_average(MODEL, ref(0.5), fleet([75, 90], [75, 90]), guard=GIB // 4)
    # drifts 0, 0, 15, 0 GiB: mean 3.75; 70 - 3.75 - 0.25 = 66 GiB; host b: 11 + 66 = 77 > 75
    assert out.detail["budget_bytes"] == 66 * GIB
    assert (out.booted, out.oom) == (1, 1)


def test_vllm_per_host_reuses_only_with_free_at_least_the_reference() -> None:
    out = dp.policy_vllm_per_host(MODEL, ref(0.8), fleet([89.5, 90], [89.5, 90]))
    # host a reuses the bytes; host b re-profiles: 88.5 >= 80, KV = 80 - 10 - 150 MiB
    assert out.reprofiles == 1
    assert out.booted == 2
    profiled = MODEL.profiled_kv(0.8)
    assert profiled == 70 * GIB - 150 * dp.MIB
    assert out.tokens_deployed == 70 * 16 + profiled // GIB * 16


def test_fixed_util_profiles_every_boot() -> None:
    out = dp.policy_fixed_util(MODEL, ref(0.8), fleet([75, 90], [75, 90]), util=0.7)
    assert out.reprofiles == 2
    assert (out.booted, out.startup_refused) == (2, 0)
    out = dp.policy_fixed_util(MODEL, ref(0.8), fleet([60, 90], [60, 90]), util=0.7)
    assert (out.booted, out.startup_refused) == (1, 1)


def test_collection_weakest_rank_gate_and_boot() -> None:
    # plan: host b rank 0 has 5 GiB less than the reference: 70 - 5 - 0.5 = 64.5 GiB;
    # floor = 90 - (70 - 0.5 - 64.5) = 85 GiB; at boot b rank 0 fell to 84.9 GiB: gated
    out = dp.policy_collection(MODEL, ref(0.8), fleet([85, 90], [84.9, 90]), guard=GIB // 2,
                               budget_mode="max_safe", admission={"tokens": 16})
    assert out.detail["decision"] == "deploy"
    assert out.detail["budget_bytes"] == int(64.5 * GIB)
    assert (out.booted, out.gated, out.boot_failures) == (1, 1, 0)
    assert out.tokens_deployed == 64 * 16
    # the weakest rank sits exactly on the floor at planning time: no margin for any drop
    assert out.detail["min_plan_margin_bytes"] == 0
    # the same boot without the late drop passes the gate and boots
    out = dp.policy_collection(MODEL, ref(0.8), fleet([85, 90], [85, 90]), guard=GIB // 2,
                               budget_mode="max_safe", admission={"tokens": 16})
    assert (out.booted, out.gated, out.boot_failures) == (2, 0, 0)


def test_collection_fit_admission_deploys_the_plan_only() -> None:
    out = dp.policy_collection(MODEL, ref(0.8), fleet([85, 90], [85, 90]), guard=GIB // 2,
                               budget_mode="fit_admission", admission={"tokens": 160})
    # 160 tokens = 10 blocks + null block = 11, plus 10 % headroom (ceil 1.1) = 13 blocks
    assert out.detail["budget_bytes"] == 13 * GIB
    assert out.booted == 2
    assert out.tokens_deployed == 2 * 13 * 16


def test_make_fleet_is_seeded_and_movement_is_bounded() -> None:
    one = dp.make_fleet(dp.Model(), hosts=50, gpus=8, seed=7)
    two = dp.make_fleet(dp.Model(), hosts=50, gpus=8, seed=7)
    assert one.plan_free == two.plan_free and one.boot_free == two.boot_free
    low, high = dp.DISTRIBUTION["movement"]
    for name, plan in one.plan_free.items():
        moved = [b - p for b, p in zip(one.boot_free[name], plan)]
        if "late" not in one.notes.get(name, ""):
            assert all(low <= m <= high for m in moved), name


@pytest.mark.parametrize("key", ["copy", "max_safe", "fit_admission"])
def test_summary_means_over_seeds(key: str) -> None:
    model = dp.Model()
    reference = dp.make_reference(model, 8, 0.95)
    seeds = []
    for seed in (1, 2):
        outcomes = dp.run_policies(model, reference, dp.make_fleet(model, 40, 8, seed), GIB // 2, 0.9,
                                   {"concurrency": 4, "tokens_per_request": 8192})
        seeds.append([o.as_dict() for o in outcomes])
    rows = {r["key"]: r for r in dp.summarize(seeds)}
    row = rows[key]
    index = [o["key"] for o in seeds[0]].index(key)
    assert row["booted"] == (seeds[0][index]["booted"] + seeds[1][index]["booted"]) / 2
    assert row["seeds"] == 2

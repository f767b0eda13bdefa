#!/usr/bin/env python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Drift policies compared on a synthetic fleet (default 1,000 hosts x 8 GPUs, several seeds).

Every host runs one engine over all its GPUs (tensor parallel), so one budget
``D`` applies to every rank of a host. Per rank the model knows:

* ``F_plan`` NVML free memory when the fleet is probed for planning;
* ``F_boot = F_plan + movement`` NVML free memory when the engine starts;
* the engine's non-KV needs: ``ctx`` (CUDA context, not in vLLM's own free
  figure) and ``non_kv`` (weights + non-torch + peak activation + CUDA graphs).

Boot rules (the ones vLLM applies):

* profiled boot at utilization ``u``: vLLM's startup check
  ``F_boot - ctx >= ceil(total * u)`` or the engine refuses to start; the KV
  cache is ``floor(total * u) - non_kv - 150 MiB``; it never OOMs;
* manual boot with ``D`` and unit utilization ``u``: the same startup check,
  then an OOM when ``ctx + non_kv + D > F_boot`` on any rank.

The collection's policies also pass the rollout gate first: a host whose
``F_boot`` is below the plan's free floor on any rank is not touched ("gated":
it keeps its previous unit). The real rollout then stops every later batch; here
the other hosts are still booted so that the budgets can be compared.

The policies: copy the reference bytes unchanged; average-rank adjustment;
vLLM's per-host startup plan (reuse the bytes only when every rank has at least
the reference free memory, else re-profile); a fixed ``gpu_memory_utilization``
(profile at every boot); this collection's weakest rank with guard (``max_safe``,
one class as planned; the same after the planner's recommended split; guard 0 as
an ablation) and ``fit_admission``. The collection's figures come from the real
planner ``plan_class``.

Prints one JSON object with every seed's figures and their mean.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class
except ImportError:  # run from a checkout without the collection on the path
    sys.path.insert(0, os.path.join(HERE, "..", ".cache", "collections"))
    from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class

GIB = 1024**3
MIB = 1024**2
VLLM_MARGIN = 150 * MIB  # vLLM keeps this much out of its KV suggestion

# H200 as NVML reports it; Llama-3.1-70B bf16 at TP 8 (80 layers, 8 KV heads of 128)
H200_TOTAL = 150754820096
H200_RESERVED = 566231040
LLAMA70B_TP8_BYTES_PER_BLOCK = 80 * 16 * 1 * (128 + 128) * 2  # 655,360 bytes per 16-token block


@dataclass
class Model:
    """What one engine needs besides its KV cache, and the KV geometry."""

    total: int = H200_TOTAL
    ctx: int = 500 * MIB
    non_kv: int = int(19.0 * GIB)
    bytes_per_block: int = LLAMA70B_TP8_BYTES_PER_BLOCK
    block_size: int = 16
    max_model_len: int = 8192

    def tokens(self, kv_bytes: int) -> int:
        return max(0, kv_bytes) // self.bytes_per_block * self.block_size

    def profiled_kv(self, util: float) -> int:
        return math.floor(self.total * util) - self.non_kv - VLLM_MARGIN

    def startup_ok(self, free: int, util: float) -> bool:
        return free - self.ctx >= math.ceil(self.total * util)


@dataclass
class Reference:
    """The profiled canary: per rank NVML free ``F_ref`` and vLLM's suggestion ``B_ref``."""

    free: list[int]
    kv: list[int]
    util: float

    def vllm_free(self, model: Model) -> dict[int, int]:
        # vLLM logs its free memory with two decimals of GiB
        return {r: int(round((f - model.ctx) / GIB, 2) * GIB) for r, f in enumerate(self.free)}


@dataclass
class Fleet:
    """Per host: free memory per rank at planning and at boot."""

    plan_free: dict[str, list[int]]
    boot_free: dict[str, list[int]]
    notes: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    """What one policy did on one fleet."""

    policy: str
    hosts: int = 0
    booted: int = 0
    oom: int = 0
    startup_refused: int = 0
    gated: int = 0
    not_deployed: int = 0
    reprofiles: int = 0
    tokens_deployed: int = 0
    tokens_safe_max: int = 0
    free_left_bytes: int = 0
    gpus_booted: int = 0
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def boot_failures(self) -> int:
        return self.oom + self.startup_refused

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "hosts": self.hosts,
            "booted": self.booted,
            "boot_failures": self.boot_failures,
            "oom": self.oom,
            "startup_refused": self.startup_refused,
            "gated": self.gated,
            "not_deployed": self.not_deployed,
            "reprofiles": self.reprofiles,
            "tokens_deployed": self.tokens_deployed,
            "tokens_safe_max": self.tokens_safe_max,
            "tokens_share_of_safe_max": round(self.tokens_deployed / self.tokens_safe_max, 4) if self.tokens_safe_max else None,
            "free_left_gib_per_booted_gpu": round(self.free_left_bytes / self.gpus_booted / GIB, 3) if self.gpus_booted else None,
            "free_left_tib_fleet": round(self.free_left_bytes / 1024**4, 3),
            **self.detail,
        }


# ---------------------------------------------------------------- boots
def safe_max_bytes(model: Model, boot_free: list[int]) -> int:
    """The largest budget that does not OOM on this host (the weakest rank bounds the engine)."""
    return max(0, min(boot_free) - model.ctx - model.non_kv)


def _account(out: Outcome, model: Model, boot_free: list[int], kv: int) -> None:
    out.booted += 1
    out.gpus_booted += len(boot_free)
    out.tokens_deployed += model.tokens(kv)
    out.free_left_bytes += sum(f - model.ctx - model.non_kv - kv for f in boot_free)


def boot_manual(out: Outcome, model: Model, boot_free: list[int], budget: int, util: float) -> str:
    """One manual boot; returns ``ok``, ``startup_refused`` or ``oom`` and books it."""
    if not all(model.startup_ok(f, util) for f in boot_free):
        out.startup_refused += 1
        return "startup_refused"
    if any(model.ctx + model.non_kv + budget > f for f in boot_free):
        out.oom += 1
        return "oom"
    _account(out, model, boot_free, budget)
    return "ok"


def boot_profiled(out: Outcome, model: Model, boot_free: list[int], util: float) -> str:
    out.reprofiles += 1
    if not all(model.startup_ok(f, util) for f in boot_free):
        out.startup_refused += 1
        return "startup_refused"
    _account(out, model, boot_free, model.profiled_kv(util))
    return "ok"


def _new(policy: str, model: Model, fleet: Fleet) -> Outcome:
    out = Outcome(policy=policy, hosts=len(fleet.boot_free))
    out.tokens_safe_max = sum(model.tokens(safe_max_bytes(model, f)) for f in fleet.boot_free.values())
    return out


# ---------------------------------------------------------------- policies
def policy_copy(model: Model, ref: Reference, fleet: Fleet, guard: int = 0) -> Outcome:
    """Copy the reference suggestion (minus nothing) to every host, unit utilization unchanged."""
    out = _new("copy reference bytes", model, fleet)
    budget = min(ref.kv) - guard
    for free in fleet.boot_free.values():
        boot_manual(out, model, free, budget, ref.util)
    out.detail["budget_bytes"] = budget
    return out


def policy_average(model: Model, ref: Reference, fleet: Fleet, guard: int) -> Outcome:
    """Adjust by the average drift over every rank of every host, with the same guard."""
    out = _new("average-rank adjustment", model, fleet)
    drifts = [ref.free[r] - f for free in fleet.plan_free.values() for r, f in enumerate(free)]
    mean_drift = sum(drifts) / len(drifts)
    budget = int(min(ref.kv) - max(0.0, mean_drift) - guard)
    for free in fleet.boot_free.values():
        boot_manual(out, model, free, budget, ref.util)
    out.detail["budget_bytes"] = budget
    return out


def policy_vllm_per_host(model: Model, ref: Reference, fleet: Fleet) -> Outcome:
    """vLLM's advice: reuse the bytes where free memory is at least the reference's, else profile again."""
    out = _new("vLLM per-host startup plan", model, fleet)
    for free in fleet.boot_free.values():
        if all(f >= ref.free[r] for r, f in enumerate(free)):
            boot_manual(out, model, free, min(ref.kv), ref.util)
        else:
            boot_profiled(out, model, free, ref.util)
    return out


def policy_fixed_util(model: Model, ref: Reference, fleet: Fleet, util: float) -> Outcome:
    """No manual bytes: every boot profiles at a fixed utilization."""
    out = _new(f"fixed gpu_memory_utilization {util}", model, fleet)
    for free in fleet.boot_free.values():
        boot_profiled(out, model, free, util)
    out.detail["utilization"] = util
    return out


def plan_spec(model: Model, ref: Reference, plan_free: dict[str, list[int]], guard: int,
              budget_mode: str, admission: dict[str, int], host_class: str = "sim") -> dict[str, Any]:
    """The ``kv_plan`` input for these hosts (what the rollout builds from its probes)."""
    return {
        "host_class": host_class,
        "reference": {
            "ranks": [{"rank": r, "free_bytes": f, "kv_bytes": k} for r, (f, k) in enumerate(zip(ref.free, ref.kv))],
            "vllm_free_bytes": ref.vllm_free(model),
            "total_bytes": model.total,
            "gpu_name": "NVIDIA H200",
            "block_size": model.block_size,
            "bytes_per_block": model.bytes_per_block,
            "kv_dtype_bytes": 2,
        },
        "hosts": {
            name: [{"rank": r, "boot_free_bytes": f, "free_min_bytes": f, "free_max_bytes": f,
                    "gpu_name": "NVIDIA H200", "total_bytes": model.total} for r, f in enumerate(free)]
            for name, free in plan_free.items()
        },
        "guard_bytes": guard,
        "budget_mode": budget_mode,
        "admission": admission,
        "max_model_len": model.max_model_len,
    }


def _deploy_plan(out: Outcome, model: Model, fleet: Fleet, names: list[str], plan: dict[str, Any]) -> None:
    """Roll one plan out to ``names``: gate on the floor, then a manual boot with the plan's utilization."""
    budget = plan.get("kv_cache_memory_bytes")
    if plan["decision"] in ("refuse", "auto_profile") or not budget:
        out.not_deployed += len(names)
        return
    floors = {int(r): int(v) for r, v in plan["free_floor_bytes"].items()}
    util = plan["gpu_memory_utilization"]
    margin = min(f - floors[r] for name in names for r, f in enumerate(fleet.plan_free[name]))
    out.detail["min_plan_margin_bytes"] = min(margin, out.detail.get("min_plan_margin_bytes", margin))
    for name in names:
        free = fleet.boot_free[name]
        if any(f < floors[r] for r, f in enumerate(free)):
            out.gated += 1
            continue
        boot_manual(out, model, free, budget, util)


def policy_collection(model: Model, ref: Reference, fleet: Fleet, guard: int, budget_mode: str,
                      admission: dict[str, int], split: bool = False, label: str | None = None) -> Outcome:
    """This collection: the real planner's weakest rank with guard, gate, manual boot at its utilization."""
    name = label or f"gpufleet {budget_mode}" + (" + split" if split else "") + f" (guard {guard / GIB:g} GiB)"
    out = _new(name, model, fleet)
    spec = plan_spec(model, ref, fleet.plan_free, guard, budget_mode, admission)
    plan = plan_class(spec)
    out.detail["decision"] = plan["decision"]
    out.detail["budget_bytes"] = plan["kv_cache_memory_bytes"]
    out.detail["gpu_memory_utilization"] = plan["gpu_memory_utilization"]
    if split and plan["decision"] == "split" and plan["split"]:
        groups = []
        for group in plan["split"]:
            sub = {h: fleet.plan_free[h] for h in group["hosts"]}
            sub_plan = plan_class(plan_spec(model, ref, sub, guard, budget_mode, admission, host_class=group["name"]))
            groups.append({"hosts": len(sub), "decision": sub_plan["decision"], "budget_bytes": sub_plan["kv_cache_memory_bytes"]})
            _deploy_plan(out, model, fleet, list(sub), sub_plan)
        out.detail["split_groups"] = groups
    else:
        _deploy_plan(out, model, fleet, list(fleet.boot_free), plan)
    return out


# ---------------------------------------------------------------- the synthetic fleet
DISTRIBUTION = {
    "gpus_per_host": 8,
    "reference_base_used": 64 * MIB,
    "base_used": "per rank uniform 0-128 MiB (driver, ECC, monitoring differences)",
    "cotenants": [
        # share of hosts, GPUs touched (min, max), bytes per GPU (min, max), what
        (0.08, (1, 1), (256 * MIB, int(1.5 * GIB)), "monitoring agent"),
        (0.03, (1, 2), (2 * GIB, 8 * GIB), "side model (guardrail, embedder)"),
        (0.01, (1, 1), (12 * GIB, 24 * GIB), "large stale or foreign process"),
    ],
    "movement": (-384 * MIB, 128 * MIB),
    "late_cotenant": (0.002, (1 * GIB, 4 * GIB)),
}


def describe_distribution() -> list[str]:
    d = DISTRIBUTION
    lines = [
        f"{d['gpus_per_host']} GPUs per host (NVIDIA H200, total {H200_TOTAL} bytes, {H200_RESERVED} reserved), one TP={d['gpus_per_host']} engine per host",
        f"reference host: {d['reference_base_used'] // MIB} MiB used on every GPU before the profiled canary",
        f"fleet base use: {d['base_used']}",
    ]
    for share, gpus, size, what in d["cotenants"]:
        lines.append(f"co-tenant on {share:.0%} of hosts: {what}, {gpus[0]}-{gpus[1]} GPU(s), "
                     f"{size[0] / GIB:g}-{size[1] / GIB:g} GiB each (uniform)")
    low, high = d["movement"]
    lines.append(f"movement between planning and boot: per rank uniform {low // MIB} to +{high // MIB} MiB")
    share, (lo, hi) = d["late_cotenant"]
    lines.append(f"late co-tenant (starts after planning, before boot): {share:.1%} of hosts, one GPU, {lo / GIB:g}-{hi / GIB:g} GiB")
    return lines


def make_reference(model: Model, gpus: int, util: float) -> Reference:
    free = [model.total - H200_RESERVED - DISTRIBUTION["reference_base_used"]] * gpus
    return Reference(free=free, kv=[model.profiled_kv(util)] * gpus, util=util)


def make_fleet(model: Model, hosts: int, gpus: int, seed: int) -> Fleet:
    rng = random.Random(seed)
    d = DISTRIBUTION
    plan: dict[str, list[int]] = {}
    boot: dict[str, list[int]] = {}
    notes: dict[str, str] = {}
    for h in range(hosts):
        name = f"gpu-{h:05d}"
        used = [rng.randint(0, 128 * MIB) for _unused in range(gpus)]
        pick = rng.random()
        acc = 0.0
        for share, (gmin, gmax), (smin, smax), what in d["cotenants"]:
            acc += share
            if pick < acc:
                for gpu in rng.sample(range(gpus), rng.randint(gmin, gmax)):
                    used[gpu] += rng.randint(smin, smax)
                notes[name] = what
                break
        plan[name] = [model.total - H200_RESERVED - u for u in used]
        low, high = d["movement"]
        moved = [f + rng.randint(low, high) for f in plan[name]]
        share, (lmin, lmax) = d["late_cotenant"]
        if rng.random() < share:
            moved[rng.randrange(gpus)] -= rng.randint(lmin, lmax)
            notes[name] = notes.get(name, "") + " late co-tenant"
        boot[name] = moved
    return Fleet(plan_free=plan, boot_free=boot, notes=notes)


def run_policies(model: Model, ref: Reference, fleet: Fleet, guard: int, fixed_util: float,
                 admission: dict[str, int]) -> list[Outcome]:
    runs: list[tuple[str, Callable[[], Outcome]]] = [
        ("copy", lambda: policy_copy(model, ref, fleet)),
        ("average", lambda: policy_average(model, ref, fleet, guard)),
        ("vllm_per_host", lambda: policy_vllm_per_host(model, ref, fleet)),
        ("fixed_util", lambda: policy_fixed_util(model, ref, fleet, fixed_util)),
        ("max_safe", lambda: policy_collection(model, ref, fleet, guard, "max_safe", admission)),
        ("max_safe_split", lambda: policy_collection(model, ref, fleet, guard, "max_safe", admission, split=True)),
        ("max_safe_no_guard", lambda: policy_collection(model, ref, fleet, 0, "max_safe", admission)),
        ("fit_admission", lambda: policy_collection(model, ref, fleet, guard, "fit_admission", admission)),
    ]
    outcomes = []
    for key, run in runs:
        start = time.perf_counter()
        outcome = run()
        outcome.detail["key"] = key
        outcome.detail["seconds"] = round(time.perf_counter() - start, 3)
        outcomes.append(outcome)
    return outcomes


def summarize(per_seed: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Mean (and min/max of failures) per policy over seeds."""
    rows = []
    for i, first in enumerate(per_seed[0]):
        runs = [seed[i] for seed in per_seed]
        row: dict[str, Any] = {"key": first["key"], "policy": first["policy"], "seeds": len(runs)}
        for field_name in ("booted", "boot_failures", "oom", "startup_refused", "gated", "not_deployed", "reprofiles",
                           "tokens_deployed", "tokens_safe_max"):
            row[field_name] = statistics.mean(r[field_name] for r in runs)
        row["boot_failures_range"] = [min(r["boot_failures"] for r in runs), max(r["boot_failures"] for r in runs)]
        row["tokens_share_of_safe_max"] = round(statistics.mean(r["tokens_share_of_safe_max"] for r in runs), 4)
        free = [r["free_left_gib_per_booted_gpu"] for r in runs if r["free_left_gib_per_booted_gpu"] is not None]
        row["free_left_gib_per_booted_gpu"] = round(statistics.mean(free), 3) if free else None
        row["decisions"] = sorted({r["decision"] for r in runs if r.get("decision")})
        margins = [r["min_plan_margin_bytes"] for r in runs if r.get("min_plan_margin_bytes") is not None]
        row["min_plan_margin_bytes"] = min(margins) if margins else None
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=DISTRIBUTION["gpus_per_host"])
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--guard-gib", type=float, default=0.5)
    parser.add_argument("--reference-util", type=float, default=0.95, help="utilization of the profiled reference canary")
    parser.add_argument("--fixed-util", type=float, default=0.9, help="utilization of the fixed-utilization policy")
    parser.add_argument("--concurrency", type=int, default=64, help="fit_admission: requests of max_model_len to hold")
    args = parser.parse_args()
    model = Model()
    ref = make_reference(model, args.gpus, args.reference_util)
    guard = int(args.guard_gib * GIB)
    admission = {"concurrency": args.concurrency, "tokens_per_request": model.max_model_len}
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    per_seed = []
    start = time.perf_counter()
    for seed in seeds:
        fleet = make_fleet(model, args.hosts, args.gpus, seed)
        per_seed.append([o.as_dict() for o in run_policies(model, ref, fleet, guard, args.fixed_util, admission)])
    print(json.dumps({
        "benchmark": "drift_policies",
        "hosts": args.hosts,
        "gpus_per_host": args.gpus,
        "seeds": seeds,
        "guard_bytes": guard,
        "reference": {"utilization": args.reference_util, "free_bytes": ref.free[0], "kv_bytes": ref.kv[0],
                      "vllm_free_bytes": ref.vllm_free(model)[0]},
        "model": {"ctx_bytes": model.ctx, "non_kv_bytes": model.non_kv, "bytes_per_block": model.bytes_per_block,
                  "block_size": model.block_size, "max_model_len": model.max_model_len, "vllm_margin_bytes": VLLM_MARGIN},
        "admission": admission,
        "fixed_utilization": args.fixed_util,
        "distribution": describe_distribution(),
        "summary": summarize(per_seed),
        "per_seed": per_seed,
        "seconds": round(time.perf_counter() - start, 2),
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

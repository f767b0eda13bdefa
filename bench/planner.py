# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Time the class planner on synthetic fleets of 100, 1,000 and 10,000 hosts x 8 GPUs, and the
planning of instances that span hosts (gangs) of 16 hosts x 8 GPUs.

Prints one JSON object: per fleet size, the best wall time of ``--repeat``
runs (time.perf_counter), the best CPU time (time.process_time, less
sensitive to other load on the machine), the load average when measured, and
the peak Python memory of one run (tracemalloc, measured in a separate run
because tracing slows Python down).

``gang_runs``: per number of gangs (``--gang-sizes``, each of ``--gang-hosts`` hosts), the CPU time of
planning their class as a run does, against the same hosts as one-host instances in the same run:
the gangs' inventory and probe checks (``_gangs.inventory_problems``, ``probed_problems``,
``described``), the planner's input as ``kv_plan`` builds it from the probe facts (``members_from_group``:
one member per gang, whose ranks are every rank of every member host), the class plan over them against
a reference of the gang's ranks (``plan_class``) and the batches that keep each gang whole
(``class_batches`` with ``gangs``); the baseline plans the same hosts as one-host instances of their own
GPUs (``members_from_group`` and ``plan_class``) and their batches.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import sys
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class
except ImportError:  # run from a checkout without the collection on the path
    sys.path.insert(0, os.path.join(HERE, "..", ".cache", "collections"))
    from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class
from ansible_collections.gpufleet.vllm.plugins.action.kv_plan import members_from_group
from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _gangs
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._rollout import class_batches

GIB = 1024**3
# An H200 as NVML reports it (sim/fleet.yml): 150,754,820,096 bytes in all, 644,939,776 of them
# reserved by the driver, so at most 139.8 GiB free. Every synthetic figure stays below that:
# the planner refuses a reference whose free memory exceeds the GPU's total.
H200_TOTAL = 150754820096
H200_RESERVED = 644939776
IDLE_FREE = H200_TOTAL - H200_RESERVED - GIB // 4   # a quarter GiB used by the driver's context


def fleet(hosts: int, gpus: int, seed: int) -> dict:
    rng = random.Random(seed)
    ref = [{"rank": r, "free_bytes": IDLE_FREE - rng.randrange(GIB // 2), "kv_bytes": 120 * GIB + rng.randrange(GIB)}
           for r in range(gpus)]
    members = {}
    for h in range(hosts):
        ranks = []
        for r in range(gpus):
            free = IDLE_FREE - rng.randrange(2 * GIB)
            ranks.append(
                {
                    "rank": r,
                    "boot_free_bytes": free,
                    "free_min_bytes": free - rng.randrange(64 * 1024**2),
                    "free_max_bytes": free,
                    "gpu_name": "NVIDIA H200",
                    "total_bytes": H200_TOTAL,
                }
            )
        members[f"gpu-{h:05d}/vllm"] = ranks
    return {
        "host_class": f"bench-{hosts}",
        "reference": {
            "ranks": ref,
            "vllm_free_bytes": {r["rank"]: r["free_bytes"] - 600 * 1024**2 for r in ref},
            "total_bytes": H200_TOTAL,
            "gpu_name": "NVIDIA H200",
            "bytes_per_block": 2097152,
            "kv_dtype_bytes": 2,
        },
        "hosts": members,
        "guard_bytes": "0.5GiB",
        "max_model_len": 8192,
        "admission": {"concurrency": 64, "tokens_per_request": 8192},
    }


def gang_fleet(gangs: int, members: int, gpus: int, seed: int) -> tuple[dict, dict, dict, list[str]]:
    """A class of ``gangs`` instances of TP ``gpus`` x PP ``members``, each over ``members`` hosts: the class plan's
    settings and reference for the gangs (one reference rank per rank of a gang) and for the same hosts as one-host
    instances, the run's hostvars (inventory, probe facts and snapshots) and the hosts."""
    one_host = fleet(gangs * members, gpus, seed)
    hosts = [key.split("/", 1)[0] for key in one_host["hosts"]]
    serve_args = {"tensor_parallel_size": gpus, "pipeline_parallel_size": members, "max_model_len": 8192}
    hostvars: dict = {}
    for g in range(gangs):
        group = hosts[g * members:(g + 1) * members]
        gang = {"mode": "mp", "members": group, "interface": "ib0"}
        for i, host in enumerate(group):
            facts = [{"index": r["rank"], "name": "NVIDIA H200", "total_bytes": H200_TOTAL, "free_bytes": r["boot_free_bytes"],
                      "boot_free_bytes": r["boot_free_bytes"], "free_min_bytes": r["free_min_bytes"],
                      "free_max_bytes": r["free_max_bytes"]} for r in one_host["hosts"][f"{host}/vllm"]]
            hostvars[host] = {
                "ansible_host": f"10.{g // 250}.{g % 250}.{i + 1}", "gpufleet_host_class": one_host["host_class"],
                "gpufleet_model": "/srv/models/dsv3", "gpufleet_serve_args": dict(serve_args), "gpufleet_gpus": facts,
                "gpufleet_instances": [{"name": "dsv3", "port": 8000, "gpus": list(range(gpus)), "gang": dict(gang)}],
                "gpufleet_probe_result": {
                    "gpus": [{"index": r, "name": "NVIDIA H200", "total_bytes": H200_TOTAL} for r in range(gpus)],
                    # every follower resolved the leader's address (its ansible_host)
                    "resolved": [] if i == 0 else [{"name": f"10.{g // 250}.{g % 250}.1",
                                                    "addresses": [f"10.{g // 250}.{g % 250}.1"], "error": None}],
                    "infiniband": ["rdma_cm", "uverbs0"]}}
    # the reference of a gang holds every rank of its canary gang: the one-host reference's ranks, once per member
    ranks = [dict(r, rank=m * gpus + r["rank"]) for m in range(members) for r in one_host["reference"]["ranks"]]
    reference = dict(one_host["reference"], ranks=ranks, vllm_free_bytes={r["rank"]: r["free_bytes"] - 600 * 1024**2 for r in ranks})
    settings = {k: v for k, v in one_host.items() if k not in ("hosts", "reference")}
    return {**settings, "reference": reference}, {**settings, "reference": one_host["reference"]}, hostvars, hosts


def _task_vars(hostvars: dict, hosts: list[str], group: str) -> dict:
    return {"groups": {group: hosts}, "hostvars": hostvars}


def plan_gangs(settings: dict, hostvars: dict, hosts: list[str]) -> tuple[dict, list]:
    """The Python a run spends planning a class of gangs: checks, the planner's input, class plan, whole-gang batches."""
    problems = _gangs.inventory_problems(hostvars, hosts) + _gangs.probed_problems(hostvars, hosts)
    if problems:
        raise AssertionError(f"the synthetic gangs are wrong: {problems[:3]}")
    members = [g["members"] for g in _gangs.described(hostvars, hosts)]
    plan = plan_class({**settings, "hosts": members_from_group(settings["host_class"], _task_vars(hostvars, hosts, settings["host_class"]))})
    return plan, class_batches([{"class": settings["host_class"], "hosts": hosts, "gangs": members}], [1, "10%", "50%"])


def plan_one_host(settings: dict, hostvars: dict, hosts: list[str]) -> tuple[dict, list]:
    """The same hosts, each its own instance on its own GPUs: the planner's input and the class plan, the batches."""
    alone = {h: {k: v for k, v in hostvars[h].items() if k != "gpufleet_instances"} for h in hosts}
    plan = plan_class({**settings, "hosts": members_from_group(settings["host_class"], _task_vars(alone, hosts, settings["host_class"]))})
    return plan, class_batches([{"class": settings["host_class"], "hosts": hosts}], [1, "10%", "50%"])


def best_cpu(call, repeat: int) -> float:
    best = None
    for _run in range(repeat):
        start = time.process_time()
        call()
        took = time.process_time() - start
        best = took if best is None else min(best, took)
    return best or 0.0


def gang_runs(sizes: list[int], members: int, gpus: int, repeat: int) -> list[dict]:
    out = []
    for gangs in sizes:
        gang_settings, one_host_settings, hostvars, hosts = gang_fleet(gangs, members, gpus, seed=gangs)
        plan, batches = plan_gangs(gang_settings, hostvars, hosts)
        # a gang is never split: every batch holds whole gangs; the gang is planned over every rank of every member
        assert all(len(b["hosts"]) % members == 0 for b in batches), batches
        assert len(plan["per_rank"]) == len(hosts) * gpus and {r["member"] for r in plan["per_rank"]} == set(hosts), plan["reasons"]
        base_plan, _base_batches = plan_one_host(one_host_settings, hostvars, hosts)
        assert len(base_plan["per_rank"]) == len(hosts) * gpus, base_plan["reasons"]
        gang_cpu = best_cpu(functools.partial(plan_gangs, gang_settings, hostvars, hosts), repeat)
        base_cpu = best_cpu(functools.partial(plan_one_host, one_host_settings, hostvars, hosts), repeat)
        out.append({"gangs": gangs, "hosts": len(hosts), "ranks": len(hosts) * gpus, "batches": len(batches),
                    "gang_cpu_seconds": round(gang_cpu, 4), "one_host_cpu_seconds": round(base_cpu, 4),
                    "added_cpu_ms_per_host": round((gang_cpu - base_cpu) * 1000 / len(hosts), 3),
                    "decision": plan["decision"]})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--gang-sizes", default="1,10,100", help="numbers of gangs to plan ('' for none)")
    parser.add_argument("--gang-hosts", type=int, default=16, help="hosts per gang")
    args = parser.parse_args()
    out = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "gpus_per_host": args.gpus,
        "runs": [],
    }
    for size in (int(s) for s in args.sizes.split(",")):
        spec = fleet(size, args.gpus, seed=size)
        times = []
        cpu = []
        plan = None
        for _run in range(args.repeat):
            start, start_cpu = time.perf_counter(), time.process_time()
            plan = plan_class(spec)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        tracemalloc.start()
        plan_class(spec)
        _current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert plan is not None
        out["runs"].append(
            {
                "hosts": size,
                "ranks": size * args.gpus,
                "best_seconds": round(min(times), 4),
                "all_seconds": [round(t, 4) for t in times],
                "best_cpu_seconds": round(min(cpu), 4),
                "peak_traced_mib": round(peak / 1024**2, 2),
                "decision": plan["decision"],
                "kv_cache_memory_bytes": plan["kv_cache_memory_bytes"],
            }
        )
    out["gang_hosts"] = args.gang_hosts
    out["gang_runs"] = gang_runs([int(g) for g in args.gang_sizes.split(",") if g.strip()], args.gang_hosts, args.gpus, args.repeat)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

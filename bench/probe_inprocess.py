# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Benchmark: one in-process NVML probe of 8 GPUs with processes, on the fake library.

Builds a state file with 8 H200-sized GPUs, three processes each (one of them this
benchmark's own pid, so own-process accounting and /proc reads are exercised), then
times ``_nvml_probe.probe`` (samples=1) through the real pynvml binding loaded from the
fake ``libnvidia-ml.so.1``.  Prints JSON: median and p95 over --runs probes (goal < 50 ms).

The library must be found by the plain dlopen search, so the script re-executes itself
with LD_LIBRARY_PATH pointing at the built library when needed.

Usage: python bench/probe_inprocess.py [--runs 200] [--gpus 8] [--lib-dir .cache/fake-nvml]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fake_nvml"))
GOAL_MS = 50.0

import nvml_state  # noqa: E402  pylint: disable=wrong-import-position


def build_state(path: Path, gpus: int) -> None:
    state = nvml_state.new_state()
    state["gpus"] = [nvml_state.make_gpu(i, 150754820096, reserved=566231040, name="NVIDIA H200") for i in range(gpus)]
    for i in range(gpus):
        nvml_state.add_process(state, gpu=i, pid=os.getpid(), used=(100 + i) << 30, name="bench")
        nvml_state.add_process(state, gpu=i, pid=1, used=2 << 30, kind="compute", name="init")
        # a made-up pid: a process of another pid namespace (the fake NVML drops a dead local pid)
        nvml_state.add_process(state, gpu=i, pid=2 + i, used=256 << 20, kind="graphics", name="other", pidns="other")
    nvml_state.save(path, state)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--lib-dir", default=str(Path(os.environ.get("GPUFLEET_CACHE", ROOT / ".cache")) / "fake-nvml"))
    args = parser.parse_args()
    lib_dir = os.path.abspath(args.lib_dir)
    if not os.path.exists(os.path.join(lib_dir, "libnvidia-ml.so.1")):
        print(json.dumps({"error": f"fake NVML library not built in {lib_dir} (make fake-nvml)"}))
        return 2
    if os.environ.get("LD_LIBRARY_PATH", "").split(":")[0] != lib_dir:
        env = dict(os.environ, LD_LIBRARY_PATH=lib_dir + (":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else ""))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    import importlib  # pylint: disable=import-outside-toplevel
    import importlib.machinery  # pylint: disable=import-outside-toplevel
    import importlib.util  # pylint: disable=import-outside-toplevel

    import pynvml  # pylint: disable=import-outside-toplevel

    # the module_utils folder as a package: the probe imports its siblings
    package = importlib.machinery.ModuleSpec("gpufleet_module_utils", None, is_package=True)
    package.submodule_search_locations = [str(ROOT / "plugins" / "module_utils")]
    sys.modules.setdefault(package.name, importlib.util.module_from_spec(package))
    probe_mod = importlib.import_module(f"{package.name}._gpu._nvml_probe")

    with tempfile.TemporaryDirectory() as tmp:
        state_path = Path(tmp) / "state"
        build_state(state_path, args.gpus)
        os.environ["FAKE_NVML_STATE"] = str(state_path)
        result = probe_mod.probe(pynvml, samples=1, service_pids=[os.getpid()], host="bench")
        assert len(result["gpus"]) == args.gpus
        assert all(g["own_used_bytes"] > 0 and len(g["processes"]) == 3 for g in result["gpus"])
        durations = []
        for _run in range(args.runs):
            start = time.perf_counter()
            probe_mod.probe(pynvml, samples=1, service_pids=[os.getpid()], host="bench")
            durations.append((time.perf_counter() - start) * 1000)
    ordered = sorted(durations)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    median = statistics.median(durations)
    print(json.dumps({
        "benchmark": "probe_inprocess", "gpus": args.gpus, "processes_per_gpu": 3, "runs": args.runs,
        "median_ms": round(median, 3), "p95_ms": round(p95, 3), "min_ms": round(ordered[0], 3),
        "max_ms": round(ordered[-1], 3), "goal_ms": GOAL_MS, "within_goal": p95 < GOAL_MS,
        "library": "fake libnvidia-ml.so.1 through real pynvml",
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Watch a real co-tenant move NVML free memory, and measure the CUDA-context gap.

Needs a real NVIDIA GPU, pynvml and a PyTorch with CUDA in the same interpreter.
Loads the collection's ``_nvml_probe.py`` by file path.  Steps, all on GPU 0:

1. probe (NVML) before any CUDA context exists: ``free_before``;
2. start a child process that creates a CUDA context and reports
   ``torch.cuda.mem_get_info()`` right away (the free memory a CUDA program sees,
   which is what vLLM logs as its initial free memory), then allocates a fixed number
   of bytes and waits;
3. probe again twice: once with the child unknown (a co-tenant) and once with its pid
   passed as ``service_pids`` (our own engine): ``boot_free_bytes`` must come back to
   about ``free_before``;
4. stop the child and probe a last time: free memory must return.

Prints one JSON document and writes ``$OUT/nvml_cotenant.json`` when OUT is set.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROBE_PATH = HERE.parent.parent / "plugins" / "module_utils" / "_gpu" / "_nvml_probe.py"
ALLOC_BYTES = int(os.environ.get("COTENANT_BYTES", str(8 << 30)))
MIB = 1 << 20

CHILD = r"""
import sys, time, torch
torch.cuda.init()
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info(0)
print(f"context {free} {total}", flush=True)
block = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda:0")
block.fill_(1)
torch.cuda.synchronize()
free2, _ = torch.cuda.mem_get_info(0)
print(f"allocated {free2}", flush=True)
sys.stdin.read()
"""


def load_probe() -> Any:
    """``_nvml_probe`` from the collection's module_utils folder, as a package (it imports its siblings)."""
    package = importlib.machinery.ModuleSpec("gpufleet_module_utils", None, is_package=True)
    package.submodule_search_locations = [str(PROBE_PATH.parent)]
    sys.modules.setdefault(package.name, importlib.util.module_from_spec(package))
    return importlib.import_module(f"{package.name}.{PROBE_PATH.stem}")


def gpu0(result: dict[str, Any]) -> dict[str, Any]:
    gpu = dict(result["gpus"][0])
    gpu["processes"] = gpu.get("processes")
    return gpu


def main() -> int:
    import pynvml  # pylint: disable=import-outside-toplevel

    probe_mod = load_probe()
    host = platform.node()
    report: dict[str, Any] = {"host": host, "alloc_bytes": ALLOC_BYTES, "checks": []}

    def check(name: str, ok: bool, detail: Any) -> None:
        report["checks"].append({"check": name, "ok": bool(ok), "detail": detail})

    before = gpu0(probe_mod.probe(pynvml, devices=[0], host=host))
    report["before"] = before
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(ALLOC_BYTES)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        context_line = child.stdout.readline().split()
        alloc_line = child.stdout.readline().split()
        cuda_free_at_context = int(context_line[1])
        cuda_free_after_alloc = int(alloc_line[1])
        time.sleep(0.5)
        as_cotenant = gpu0(probe_mod.probe(pynvml, devices=[0], host=host))
        as_own = gpu0(probe_mod.probe(pynvml, devices=[0], host=host, service_pids=[child.pid]))
        report.update(child_pid=child.pid, cuda_free_at_context=cuda_free_at_context,
                      cuda_free_after_alloc=cuda_free_after_alloc, as_cotenant=as_cotenant, as_own=as_own)
    finally:
        if child.stdin:
            child.stdin.close()
        child.wait(timeout=60)
    time.sleep(0.5)
    after = gpu0(probe_mod.probe(pynvml, devices=[0], host=host))
    report["after"] = after

    free0 = before["free_bytes"]
    context_gap = free0 - cuda_free_at_context
    report["cuda_context_gap_bytes"] = context_gap
    report["cuda_context_gap_mib"] = round(context_gap / MIB, 1)
    drop = free0 - as_cotenant["free_bytes"]
    report["cotenant_drop_bytes"] = drop
    check("co-tenant lowers NVML free by at least its allocation", drop >= ALLOC_BYTES, drop)
    listed = [p for p in (as_cotenant["processes"] or []) if p["pid"] == child.pid]
    report["child_listed_by_nvml"] = bool(listed)
    if listed:
        check("NVML lists the co-tenant's memory >= its allocation",
              (listed[0].get("used_bytes") or 0) >= ALLOC_BYTES, listed[0])
        check("boot_free with the child as own ~ free before (within 256 MiB)",
              abs(as_own["boot_free_bytes"] - free0) <= 256 * MIB, as_own["boot_free_bytes"] - free0)
    check("free memory returns after the co-tenant exits (within 64 MiB)",
          abs(after["free_bytes"] - free0) <= 64 * MIB, after["free_bytes"] - free0)
    report["ok"] = all(c["ok"] for c in report["checks"])
    text = json.dumps(report, indent=2, sort_keys=True)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "nvml_cotenant.json").write_text(text + "\n", encoding="utf-8")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

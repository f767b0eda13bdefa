# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Check the NVML probe against a real NVIDIA driver and GPU.

Self-contained: needs only the standard library and pynvml (nvidia-ml-py); it loads
the collection's ``_nvml_probe.py`` by file path.  It

- probes every GPU with samples=5 (interval 0.2 s) and records the full result;
- times one in-process probe (samples=1), 20 runs, reporting median / p95 / min;
- reads ``nvidia-smi --query-gpu=index,uuid,memory.total,memory.free,memory.used
  --format=csv,noheader,nounits`` right after a probe and compares the figures
  (nvidia-smi rounds to MiB), timing it as well (5 runs);
- times NVML initialisation alone (part of every probe; slow without persistence mode);
- reads memory with both the v1 and v2 NVML calls and lists compute/graphics
  processes with the raw binding, checking they agree with the probe;
- reads every GPU's health queries with the raw binding (``nvmlDeviceGetEccMode``,
  ``nvmlDeviceGetTotalEccErrors`` uncorrected/volatile, ``nvmlDeviceGetRemappedRows``,
  ``nvmlDeviceGetRetiredPagesPendingStatus``), recording each answer or NVML return code, and checks
  that the probe's ``health`` agrees (a code 3 or 13 listed as not supported, any other code as an
  error); opens every GPU by UUID (``nvmlDeviceGetHandleByUUID``); registers for Xid events
  (``nvmlEventTypeXidCriticalError``) and waits ``NVML_CHECK_XID_WAIT_MS`` (default 200) with
  ``nvmlEventSetWait_v2``, recording what came back.

Prints one JSON document to stdout and writes it to ``$OUT/nvml_real.json`` when OUT
is set.  Exit status 0 when every check passed, 1 otherwise (the JSON says which).

Usage: python3 tests/device/nvml_real_check.py
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROBE_PATH = HERE.parent.parent / "plugins" / "module_utils" / "_gpu" / "_nvml_probe.py"
RUNS = int(os.environ.get("NVML_CHECK_RUNS", "20"))
SAMPLES = int(os.environ.get("NVML_CHECK_SAMPLES", "5"))
INTERVAL = float(os.environ.get("NVML_CHECK_INTERVAL", "0.2"))
MIB = 1 << 20
# nvidia-smi prints whole MiB, and free memory may move between the two reads.
SMI_TOLERANCE_MIB = int(os.environ.get("NVML_CHECK_SMI_TOLERANCE_MIB", "64"))


def load_probe() -> Any:
    """``_nvml_probe`` from the collection's module_utils folder, as a package (it imports its siblings)."""
    package = importlib.machinery.ModuleSpec("gpufleet_module_utils", None, is_package=True)
    package.submodule_search_locations = [str(PROBE_PATH.parent)]
    sys.modules.setdefault(package.name, importlib.util.module_from_spec(package))
    return importlib.import_module(f"{package.name}.{PROBE_PATH.stem}")


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    pos = min(len(ordered) - 1, max(0, int(round(share * (len(ordered) - 1)))))
    return ordered[pos]


def timing(values: list[float]) -> dict[str, Any]:
    return {"runs": len(values), "median_ms": round(statistics.median(values) * 1000, 3),
            "p95_ms": round(percentile(values, 0.95) * 1000, 3), "min_ms": round(min(values) * 1000, 3),
            "max_ms": round(max(values) * 1000, 3)}


def nvidia_smi() -> dict[str, Any]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"present": False}
    argv = [exe, "--query-gpu=index,uuid,memory.total,memory.free,memory.used", "--format=csv,noheader,nounits"]
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    elapsed = time.perf_counter() - start
    rows = []
    for line in done.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 5 and parts[0].isdigit():
            rows.append({"index": int(parts[0]), "uuid": parts[1], "total_mib": int(parts[2]),
                         "free_mib": int(parts[3]), "used_mib": int(parts[4])})
    return {"present": True, "path": exe, "argv": argv[1:], "rc": done.returncode, "seconds": elapsed, "gpus": rows,
            "stderr": done.stderr.strip()[-500:]}


def raw_reads(pynvml: Any) -> list[dict[str, Any]]:
    """v1 and v2 memory and the raw process lists, straight from the binding."""
    out = []
    pynvml.nvmlInit()
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            entry: dict[str, Any] = {"index": index}
            m1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
            entry["v1"] = {"total": int(m1.total), "free": int(m1.free), "used": int(m1.used)}
            try:
                m2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                entry["v2"] = {"total": int(m2.total), "reserved": int(m2.reserved), "free": int(m2.free),
                               "used": int(m2.used)}
            except pynvml.NVMLError as exc:
                entry["v2_error"] = [getattr(exc, "value", None), str(exc)]
            for kind, name in (("compute", "nvmlDeviceGetComputeRunningProcesses_v3"),
                               ("graphics", "nvmlDeviceGetGraphicsRunningProcesses_v3")):
                try:
                    entry[kind] = [{"pid": int(p.pid), "used": None if p.usedGpuMemory is None else int(p.usedGpuMemory),
                                    "gpu_instance": int(p.gpuInstanceId), "compute_instance": int(p.computeInstanceId)}
                                   for p in getattr(pynvml, name)(handle)]
                except pynvml.NVMLError as exc:
                    entry[kind + "_error"] = [getattr(exc, "value", None), str(exc)]
            out.append(entry)
    finally:
        pynvml.nvmlShutdown()
    return out


HEALTH_CALLS = (
    ("ecc_mode", "nvmlDeviceGetEccMode", ()),
    ("ecc_uncorrected_volatile", "nvmlDeviceGetTotalEccErrors", ("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC")),
    ("remapped_rows", "nvmlDeviceGetRemappedRows", ()),
    ("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus", ()),
)
NOT_SUPPORTED_CODES = (3, 13)  # NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND
XID_WAIT_MS = int(os.environ.get("NVML_CHECK_XID_WAIT_MS", "200"))


def raw_health(pynvml: Any) -> list[dict[str, Any]]:
    """Each GPU's health queries straight from the binding: the answer or the NVML code; the handle by UUID;
    one Xid registration and wait."""
    out = []
    pynvml.nvmlInit()
    try:
        handles = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            handles[index] = handle
            entry: dict[str, Any] = {"index": index, "queries": {}}
            for query, name, constants in HEALTH_CALLS:
                args = [getattr(pynvml, c) for c in constants]
                try:
                    value = getattr(pynvml, name)(handle, *args)
                    entry["queries"][query] = {"value": list(value) if isinstance(value, (list, tuple)) else value}
                except pynvml.NVMLError as exc:
                    entry["queries"][query] = {"code": getattr(exc, "value", None), "error": str(exc)}
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            try:
                by_uuid = pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid))
                entry["handle_by_uuid"] = {"uuid": uuid, "index": int(by_uuid)}
            except pynvml.NVMLError as exc:
                entry["handle_by_uuid"] = {"uuid": uuid, "code": getattr(exc, "value", None), "error": str(exc)}
            try:
                entry["supported_event_types"] = int(pynvml.nvmlDeviceGetSupportedEventTypes(handle))
            except pynvml.NVMLError as exc:
                entry["supported_event_types"] = {"code": getattr(exc, "value", None), "error": str(exc)}
            out.append(entry)
        xids: dict[str, Any] = {"wait_ms": XID_WAIT_MS, "registered": {}, "events": []}
        event_set = pynvml.nvmlEventSetCreate()
        try:
            for index, handle in handles.items():
                try:
                    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
                    xids["registered"][str(index)] = True
                except pynvml.NVMLError as exc:
                    xids["registered"][str(index)] = {"code": getattr(exc, "value", None), "error": str(exc)}
            start = time.perf_counter()
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, XID_WAIT_MS)
                xids["events"].append({"event_type": int(data.eventType), "xid": int(data.eventData)})
            except pynvml.NVMLError as exc:
                xids["wait_code"] = getattr(exc, "value", None)
            xids["waited_ms"] = round((time.perf_counter() - start) * 1000, 1)
        finally:
            pynvml.nvmlEventSetFree(event_set)
        out.append({"xid_events": xids})
    finally:
        pynvml.nvmlShutdown()
    return out


def check(checks: list[dict[str, Any]], name: str, ok: bool, detail: Any) -> None:
    checks.append({"check": name, "ok": bool(ok), "detail": detail})


def main() -> int:
    report: dict[str, Any] = {"host": platform.node(), "python": sys.version.split()[0],
                              "probe_module": str(PROBE_PATH), "checks": []}
    checks: list[dict[str, Any]] = report["checks"]
    try:
        import pynvml  # pylint: disable=import-outside-toplevel

        report["pynvml"] = getattr(pynvml, "__file__", None)
        try:
            from importlib.metadata import version  # pylint: disable=import-outside-toplevel
            report["nvidia_ml_py_version"] = version("nvidia-ml-py")
        except Exception:  # pylint: disable=broad-except
            report["nvidia_ml_py_version"] = None
        probe_mod = load_probe()

        # 1. a sampled probe, then nvidia-smi at (nearly) the same moment
        sampled = probe_mod.probe(pynvml, samples=SAMPLES, interval=INTERVAL, host=report["host"])
        at_probe = probe_mod.probe(pynvml, samples=1, host=report["host"])
        smi = nvidia_smi()
        report["probe_sampled"] = sampled
        report["probe_single"] = at_probe
        report["nvidia_smi"] = smi

        gpus = sampled["gpus"]
        check(checks, "gpus_found", len(gpus) > 0, len(gpus))
        for gpu in gpus:
            label = f"gpu{gpu['index']}"
            check(checks, f"{label}_memory_v2", gpu["memory_info_version"] == 2, gpu["memory_info_version"])
            check(checks, f"{label}_figures_sum", gpu["reserved_bytes"] is not None
                  and gpu["free_bytes"] + gpu["used_bytes"] + gpu["reserved_bytes"] <= gpu["total_bytes"],
                  {k: gpu[k] for k in ("total_bytes", "reserved_bytes", "used_bytes", "free_bytes")})
            check(checks, f"{label}_boot_free_bounds", gpu["free_bytes"] <= gpu["boot_free_bytes"] <= gpu["total_bytes"],
                  gpu["boot_free_bytes"])
            check(checks, f"{label}_samples", gpu["samples"] == SAMPLES
                  and gpu["free_min_bytes"] <= gpu["free_bytes"] <= gpu["free_max_bytes"],
                  [gpu["free_min_bytes"], gpu["free_max_bytes"]])
        if smi.get("present") and smi.get("rc") == 0:
            by_index = {row["index"]: row for row in smi["gpus"]}
            for gpu in at_probe["gpus"]:
                row = by_index.get(gpu["index"])
                if row is None:
                    check(checks, f"gpu{gpu['index']}_smi_row", False, "nvidia-smi did not list this GPU")
                    continue
                free_delta = gpu["free_bytes"] / MIB - row["free_mib"]
                total_delta = gpu["total_bytes"] / MIB - row["total_mib"]
                check(checks, f"gpu{gpu['index']}_smi_uuid", row["uuid"] == gpu["uuid"], row["uuid"])
                check(checks, f"gpu{gpu['index']}_smi_total", abs(total_delta) < 1.0, round(total_delta, 3))
                check(checks, f"gpu{gpu['index']}_smi_free", abs(free_delta) <= SMI_TOLERANCE_MIB, round(free_delta, 3))
        else:
            check(checks, "nvidia_smi_present", True, "absent: comparison skipped" if not smi.get("present")
                  else f"rc={smi.get('rc')}: comparison skipped")

        # 2. timing: in-process probe, one sample, RUNS times
        durations = []
        for _run in range(RUNS):
            start = time.perf_counter()
            probe_mod.probe(pynvml, samples=1, host=report["host"])
            durations.append(time.perf_counter() - start)
        report["probe_timing"] = timing(durations)
        # NVML initialisation alone (slow without persistence mode): part of every probe
        init_durations = []
        for _run in range(5):
            start = time.perf_counter()
            pynvml.nvmlInit()
            pynvml.nvmlShutdown()
            init_durations.append(time.perf_counter() - start)
        report["nvml_init_timing"] = timing(init_durations)
        if smi.get("present"):
            smi_durations = [smi["seconds"]] + [nvidia_smi()["seconds"] for _run in range(4)]
            report["nvidia_smi_timing"] = timing(smi_durations)
        else:
            report["nvidia_smi_timing"] = None

        # 3. raw v1/v2 memory and process lists from the binding
        raw = raw_reads(pynvml)
        report["raw"] = raw
        for entry in raw:
            label = f"gpu{entry['index']}"
            if "v2" in entry:
                v1, v2 = entry["v1"], entry["v2"]
                check(checks, f"{label}_v1_v2_total", v1["total"] == v2["total"], [v1["total"], v2["total"]])
                # v1 folds the driver reserve into used
                check(checks, f"{label}_v1_used_includes_reserved",
                      abs(v1["used"] - (v2["used"] + v2["reserved"])) <= SMI_TOLERANCE_MIB * MIB,
                      [v1["used"], v2["used"] + v2["reserved"]])
            else:
                check(checks, f"{label}_v2_available", False, entry.get("v2_error"))
            listed = {p["pid"] for p in entry.get("compute", []) + entry.get("graphics", [])}
            probed = next((g for g in at_probe["gpus"] if g["index"] == entry["index"]), None)
            if probed is not None:
                seen = {p["pid"] for p in probed["processes"]}
                check(checks, f"{label}_processes_match_binding", seen == listed,
                      {"probe": sorted(seen), "binding": sorted(listed)})
        # 4. health queries, the handle by UUID and Xid events, raw; the probe's health must agree
        health = raw_health(pynvml)
        report["raw_health"] = health
        for entry in health:
            if "xid_events" in entry:
                xids = entry["xid_events"]
                check(checks, "xid_registration_answers", all(v is True or (isinstance(v, dict) and v.get("code") in NOT_SUPPORTED_CODES)
                                                              for v in xids["registered"].values()), xids["registered"])
                check(checks, "xid_wait_answers", bool(xids["events"]) or xids.get("wait_code") == 10, xids)  # 10: NVML_ERROR_TIMEOUT
                continue
            label = f"gpu{entry['index']}"
            probed = next((g for g in at_probe["gpus"] if g["index"] == entry["index"]), None)
            check(checks, f"{label}_handle_by_uuid", entry["handle_by_uuid"].get("index") == entry["index"], entry["handle_by_uuid"])
            if probed is None:
                continue
            got = probed.get("health") or {}
            for query, answer in entry["queries"].items():
                if query == "ecc_uncorrected_volatile" and got.get("ecc_mode") == "disabled":
                    continue  # the probe does not read the counter with ECC off
                if "code" in answer and answer["code"] in NOT_SUPPORTED_CODES:
                    agrees = query in got.get("not_supported", [])
                elif "code" in answer:
                    agrees = query in got.get("errors", {})
                else:
                    agrees = got.get(query) is not None and query not in got.get("not_supported", [])
                check(checks, f"{label}_health_{query}", agrees, {"raw": answer, "probe": got.get(query)})
    except Exception as exc:  # pylint: disable=broad-except  # report, never crash without output
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
        check(checks, "ran_to_completion", False, report["error"])
    report["ok"] = all(c["ok"] for c in checks)
    text = json.dumps(report, indent=2, sort_keys=True, default=str)
    print(text)
    out_dir = os.environ.get("OUT")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "nvml_real.json"), "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

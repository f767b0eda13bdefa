# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The fake libnvidia-ml.so.1, driven through the REAL pynvml binding.

Each check runs in a fresh Python process whose LD_LIBRARY_PATH points at the built
library, so pynvml's plain ``CDLL("libnvidia-ml.so.1")`` finds it exactly as it would
find a driver's library.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.gpufleet.vllm.tests.fake_nvml import nvml_state

ROOT = Path(__file__).resolve().parents[3]
CACHE = Path(os.environ.get("GPUFLEET_CACHE") or ROOT / ".cache")
LIBDIR = CACHE / "fake-nvml"
LIB = LIBDIR / "libnvidia-ml.so.1"
GIB = 1 << 30

pytestmark = pytest.mark.skipif(not LIB.exists(), reason=f"fake NVML library not built ({LIB}); run `make fake-nvml`")

PRELUDE = """
import json, os, sys, ctypes
import pynvml as n
sys.path.insert(0, {fake_dir!r})
import nvml_state
STATE = os.environ["FAKE_NVML_STATE"]
out = {{}}
def err(fn, *a, **k):
    try:
        fn(*a, **k)
    except n.NVMLError as e:
        return [e.value, type(e).__name__]
    except Exception as e:
        return [None, type(e).__name__]
    return None
"""


def run_nvml(tmp_path: Path, code: str, state: dict[str, Any] | str | None) -> dict[str, Any]:
    """Run ``code`` (which fills ``out``) against ``state`` in a fresh interpreter."""
    path = tmp_path / "state"
    if isinstance(state, dict):
        nvml_state.save(path, state)
    elif isinstance(state, str):
        path.write_text(state)
    env = dict(os.environ, LD_LIBRARY_PATH=str(LIBDIR), FAKE_NVML_STATE=str(path))
    script = PRELUDE.format(fake_dir=str(ROOT / "tests" / "fake_nvml")) + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def fleet_state(n_gpus: int = 3) -> dict[str, Any]:
    state = nvml_state.new_state()
    state["system"].update(driver="560.35.03", cuda=12060, nvml="12.560.35.03")
    state["gpus"] = [
        nvml_state.make_gpu(i, 150754820096, reserved=566231040, name="NVIDIA H200 NVL", cc="9.0")
        for i in range(n_gpus)
    ]
    return state


def test_loaded_through_plain_dlopen(tmp_path):
    out = run_nvml(tmp_path, """
        n.nvmlInit()
        out["name"] = n.nvmlLib._name
        out["maps"] = [l.split()[-1] for l in open("/proc/self/maps") if "libnvidia-ml" in l][:1]
        n.nvmlShutdown()
    """, fleet_state())
    assert out["name"] == "libnvidia-ml.so.1"
    assert out["maps"] == [str(LIB)]


def test_system_and_device_identity(tmp_path):
    out = run_nvml(tmp_path, """
        n.nvmlInit()
        out["driver"] = n.nvmlSystemGetDriverVersion()
        out["cuda"] = n.nvmlSystemGetCudaDriverVersion()
        out["cuda_v2"] = n.nvmlSystemGetCudaDriverVersion_v2()
        out["nvml"] = n.nvmlSystemGetNVMLVersion()
        out["count"] = n.nvmlDeviceGetCount()
        out["gpus"] = []
        for i in range(out["count"]):
            h = n.nvmlDeviceGetHandleByIndex(i)
            pci = n.nvmlDeviceGetPciInfo(h)
            uuid = n.nvmlDeviceGetUUID(h)
            h2 = n.nvmlDeviceGetHandleByUUID(uuid)
            out["gpus"].append({
                "name": n.nvmlDeviceGetName(h), "uuid": uuid, "index": n.nvmlDeviceGetIndex(h2),
                "busId": str(pci.busId), "legacy": str(pci.busIdLegacy),
                "domain": pci.domain, "bus": pci.bus, "device": pci.device,
                "cc": list(n.nvmlDeviceGetCudaComputeCapability(h)),
            })
        out["by_uuid_missing"] = err(n.nvmlDeviceGetHandleByUUID, "GPU-nope")
        out["bad_index"] = err(n.nvmlDeviceGetHandleByIndex, 3)
        out["strings"] = [n.nvmlErrorString(c) for c in (0, 7, 13, 15, 16, 25, 12345)]
        n.nvmlShutdown()
    """, fleet_state(3))
    assert out["driver"] == "560.35.03" and out["nvml"] == "12.560.35.03"
    assert out["cuda"] == out["cuda_v2"] == 12060
    assert out["count"] == 3
    assert [g["index"] for g in out["gpus"]] == [0, 1, 2]
    gpu1 = out["gpus"][1]
    assert gpu1["name"] == "NVIDIA H200 NVL"  # percent-decoded space
    assert gpu1["uuid"] == "GPU-00000000-0000-4000-8000-000000000001"
    assert gpu1["busId"] == "00000000:19:00.0" and gpu1["legacy"] == "0000:19:00.0"
    assert (gpu1["domain"], gpu1["bus"], gpu1["device"]) == (0, 0x19, 0)
    assert gpu1["cc"] == [9, 0]
    assert out["by_uuid_missing"] == [6, "NVMLError_NotFound"]
    assert out["bad_index"] == [2, "NVMLError_InvalidArgument"]
    assert out["strings"] == ["Success", "Insufficient Size", "Function Not Found", "GPU is lost",
                              "GPU requires restart", "Argument version mismatch", "Unknown Error"]


def test_memory_v1_and_v2(tmp_path):
    state = fleet_state(2)
    state["gpus"][0]["base_used"] = 300 << 20
    nvml_state.add_process(state, gpu=0, pid=4242, used=4 * GIB, name="python3", pidns="other")
    out = run_nvml(tmp_path, """
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
        m1 = n.nvmlDeviceGetMemoryInfo(h)
        out["v2"] = [m2.total, m2.reserved, m2.free, m2.used]
        out["v1"] = [m1.total, m1.free, m1.used]
        out["bad_version"] = err(n.nvmlDeviceGetMemoryInfo, h, version=0x01000028)
        out["size"] = [ctypes.sizeof(n.c_nvmlMemory_v2_t), ctypes.sizeof(n.c_nvmlMemory_t)]
        h1 = n.nvmlDeviceGetHandleByIndex(1)
        m = n.nvmlDeviceGetMemoryInfo(h1, version=n.nvmlMemory_v2)
        out["idle"] = [m.free, m.used]
        n.nvmlShutdown()
    """, state)
    total, reserved, used = 150754820096, 566231040, (300 << 20) + 4 * GIB
    assert out["v2"] == [total, reserved, total - reserved - used, used]
    assert out["v1"] == [total, total - reserved - used, reserved + used]
    assert out["bad_version"] == [25, "NVMLError_ArgumentVersionMismatch"]
    assert out["size"] == [40, 24]
    assert out["idle"] == [total - reserved, 0]


def test_free_override_is_reported_verbatim(tmp_path):
    state = fleet_state(1)
    state["gpus"][0]["free_override"] = 200 * GIB
    out = run_nvml(tmp_path, """
        n.nvmlInit()
        out["free"] = n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(0), version=n.nvmlMemory_v2).free
        n.nvmlShutdown()
    """, state)
    assert out["free"] == 200 * GIB


def test_processes_two_call_protocol_and_struct(tmp_path):
    state = fleet_state(2)
    nvml_state.add_process(state, gpu=0, pid=101, used=GIB, kind="compute", pidns="other")
    nvml_state.add_process(state, gpu=0, pid=102, used=2 * GIB, kind="compute", pidns="other")
    nvml_state.add_process(state, gpu=0, pid=103, used=64 << 20, kind="graphics", name="Xorg", pidns="other")
    nvml_state.add_process(state, gpu=0, pid=104, used=128 << 20, kind="both", pidns="other")
    out = run_nvml(tmp_path, """
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        def rows(procs):
            return [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in procs]
        out["compute"] = rows(n.nvmlDeviceGetComputeRunningProcesses(h))
        out["graphics"] = rows(n.nvmlDeviceGetGraphicsRunningProcesses(h))
        out["compute_v2"] = rows(n.nvmlDeviceGetComputeRunningProcesses_v2(h))
        out["graphics_v2"] = rows(n.nvmlDeviceGetGraphicsRunningProcesses_v2(h))
        out["none"] = rows(n.nvmlDeviceGetComputeRunningProcesses(n.nvmlDeviceGetHandleByIndex(1)))
        fn = n._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
        count = ctypes.c_uint(0)
        out["query"] = [fn(h, ctypes.byref(count), None), count.value]
        arr = (n.c_nvmlProcessInfo_v3_t * 3)()
        count.value = 2
        out["short"] = [fn(h, ctypes.byref(count), arr), count.value]
        count.value = 3
        out["fill"] = [fn(h, ctypes.byref(count), arr), count.value, [arr[i].pid for i in range(3)]]
        out["struct"] = ctypes.sizeof(n.c_nvmlProcessInfo_v3_t)
        n.nvmlShutdown()
    """, state)
    na = 0xFFFFFFFF
    assert out["compute"] == [[101, GIB, na, na], [102, 2 * GIB, na, na], [104, 128 << 20, na, na]]
    assert out["graphics"] == [[103, 64 << 20, na, na], [104, 128 << 20, na, na]]
    assert out["compute_v2"] == out["compute"] and out["graphics_v2"] == out["graphics"]
    assert out["none"] == []
    assert out["query"] == [7, 3]
    assert out["short"] == [7, 3]
    assert out["fill"] == [0, 3, [101, 102, 104]]
    assert out["struct"] == 24


def test_state_is_read_again_on_every_call_and_noise_cycles(tmp_path):
    state = fleet_state(1)
    state["gpus"][0]["noise"] = [0, 100 << 20, 300 << 20]
    out = run_nvml(tmp_path, """
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        out["frees"] = [n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2).free for _ in range(4)]
        out["used"] = [n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2).used for _ in range(3)]
        with nvml_state.locked(STATE):
            s = nvml_state.load(STATE)
            s["gpus"][0]["noise"] = []
            nvml_state.add_process(s, gpu=0, pid=77, used=1 << 30, pidns="other")
            s["system"]["driver"] = "999.1"
            nvml_state.save(STATE, s)
        out["after"] = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2).used
        out["procs"] = [p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)]
        out["driver"] = n.nvmlSystemGetDriverVersion()
        n.nvmlShutdown()
    """, state)
    base = 150754820096 - 566231040
    assert out["frees"] == [base, base - (100 << 20), base - (300 << 20), base]
    assert out["used"] == [100 << 20, 300 << 20, 0]
    assert out["after"] == GIB
    assert out["procs"] == [77]
    assert out["driver"] == "999.1"


@pytest.mark.parametrize(("code", "name"), [
    (9, "NVMLError_DriverNotLoaded"),
    (4, "NVMLError_NoPermission"),
    (18, "NVMLError_LibRmVersionMismatch"),
])
def test_init_error(tmp_path, code, name):
    state = fleet_state(1)
    state["system"]["init_error"] = code
    out = run_nvml(tmp_path, """
        out["init"] = err(n.nvmlInit)
        out["init_v2"] = n.nvmlLib.nvmlInit_v2()
    """, state)
    assert out["init"] == [code, name]
    assert out["init_v2"] == code


def test_missing_state_file_means_driver_not_loaded(tmp_path):
    out = run_nvml(tmp_path, """
        out["init"] = err(n.nvmlInit)
    """, None)
    assert out["init"] == [9, "NVMLError_DriverNotLoaded"]


def test_malformed_state_is_an_unknown_error(tmp_path):
    out = run_nvml(tmp_path, """
        out["init"] = err(n.nvmlInit)
    """, "system driver=1\ngpu index=0 total=notanumber\n")
    assert out["init"] == [999, "NVMLError_Unknown"]


def test_calls_after_shutdown_are_uninitialized(tmp_path):
    out = run_nvml(tmp_path, """
        n.nvmlInit()
        n.nvmlInit()
        n.nvmlShutdown()
        out["still"] = n.nvmlDeviceGetCount()
        n.nvmlShutdown()
        out["after"] = err(n.nvmlDeviceGetCount)
        out["shutdown_again"] = err(n.nvmlShutdown)
    """, fleet_state(2))
    assert out["still"] == 2
    assert out["after"] == [1, "NVMLError_Uninitialized"]
    assert out["shutdown_again"] == [1, "NVMLError_Uninitialized"]


def test_per_gpu_errors(tmp_path):
    state = fleet_state(3)
    state["gpus"][1]["error"] = 15
    state["gpus"][2]["error"] = 16
    out = run_nvml(tmp_path, """
        n.nvmlInit()
        out["count"] = n.nvmlDeviceGetCount()
        out["gpu0"] = n.nvmlDeviceGetName(n.nvmlDeviceGetHandleByIndex(0))
        out["lost"] = err(n.nvmlDeviceGetHandleByIndex, 1)
        out["reset"] = err(n.nvmlDeviceGetHandleByIndex, 2)
        out["by_uuid"] = err(n.nvmlDeviceGetHandleByUUID, "GPU-00000000-0000-4000-8000-000000000001")
        h0 = n.nvmlDeviceGetHandleByIndex(0)
        with nvml_state.locked(STATE):
            s = nvml_state.load(STATE)
            s["gpus"][0]["error"] = 15
            nvml_state.save(STATE, s)
        out["later"] = [err(f, h0) for f in (n.nvmlDeviceGetName, n.nvmlDeviceGetUUID, n.nvmlDeviceGetPciInfo,
                                             n.nvmlDeviceGetMemoryInfo, n.nvmlDeviceGetCudaComputeCapability,
                                             n.nvmlDeviceGetComputeRunningProcesses)]
        out["mem_v2"] = err(n.nvmlDeviceGetMemoryInfo, h0, version=n.nvmlMemory_v2)
        n.nvmlShutdown()
    """, state)
    assert out["count"] == 3 and out["gpu0"] == "NVIDIA H200 NVL"
    assert out["lost"] == [15, "NVMLError_GpuIsLost"]
    assert out["reset"] == [16, "NVMLError_ResetRequired"]
    assert out["by_uuid"] == [15, "NVMLError_GpuIsLost"]
    assert out["later"] == [[15, "NVMLError_GpuIsLost"]] * 6
    assert out["mem_v2"] == [15, "NVMLError_GpuIsLost"]


def test_missing_functions_return_function_not_found(tmp_path):
    state = fleet_state(1)
    state["system"]["missing"] = ["nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetComputeRunningProcesses_v3",
                                  "nvmlSystemGetCudaDriverVersion_v2", "nvmlDeviceGetPciInfo_v3"]
    out = run_nvml(tmp_path, """
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        out["v2"] = err(n.nvmlDeviceGetMemoryInfo, h, version=n.nvmlMemory_v2)
        out["v1"] = n.nvmlDeviceGetMemoryInfo(h).total
        out["procs"] = err(n.nvmlDeviceGetComputeRunningProcesses, h)
        out["procs_v2"] = n.nvmlDeviceGetComputeRunningProcesses_v2(h)
        out["cuda_v2"] = err(n.nvmlSystemGetCudaDriverVersion_v2)
        out["cuda"] = n.nvmlSystemGetCudaDriverVersion()
        out["pci"] = err(n.nvmlDeviceGetPciInfo, h)
        n.nvmlShutdown()
    """, state)
    assert out["v2"] == [13, "NVMLError_FunctionNotFound"]
    assert out["v1"] == 150754820096
    # pynvml turns a missing unversioned-call target into its own mismatch error
    assert out["procs"] == [None, "NVMLLibraryMismatchError"]
    assert out["procs_v2"] == []
    assert out["cuda_v2"] == [13, "NVMLError_FunctionNotFound"]
    assert out["cuda"] == 12060
    assert out["pci"] == [13, "NVMLError_FunctionNotFound"]


def test_missing_init_function(tmp_path):
    state = fleet_state(1)
    state["system"]["missing"] = ["nvmlInitWithFlags"]
    out = run_nvml(tmp_path, """
        out["init"] = err(n.nvmlInit)
    """, state)
    assert out["init"] == [13, "NVMLError_FunctionNotFound"]


def test_zero_gpus(tmp_path):
    out = run_nvml(tmp_path, """
        n.nvmlInit()
        out["count"] = n.nvmlDeviceGetCount()
        out["handle"] = err(n.nvmlDeviceGetHandleByIndex, 0)
        n.nvmlShutdown()
    """, nvml_state.new_state())
    assert out["count"] == 0
    assert out["handle"] == [2, "NVMLError_InvalidArgument"]


def test_short_buffers_are_insufficient_size(tmp_path):
    out = run_nvml(tmp_path, """
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        buf = ctypes.create_string_buffer(10)
        out["name"] = n._nvmlGetFunctionPointer("nvmlDeviceGetName")(h, buf, ctypes.c_uint(8))
        out["driver"] = n._nvmlGetFunctionPointer("nvmlSystemGetDriverVersion")(buf, ctypes.c_uint(4))
        out["exact"] = n._nvmlGetFunctionPointer("nvmlSystemGetDriverVersion")(buf, ctypes.c_uint(10))
        out["value"] = buf.value.decode()
        n.nvmlShutdown()
    """, fleet_state(1))
    assert out["name"] == 7 and out["driver"] == 7
    assert out["exact"] == 0 and out["value"] == "560.35.03"


def test_probe_end_to_end_through_real_pynvml(tmp_path):
    """The collection's probe on top of real pynvml and the fake library."""
    state = fleet_state(2)
    state["gpus"][1]["noise"] = [0, 50 << 20]
    nvml_state.add_process(state, gpu=0, pid=4242, used=6 * GIB, name="embedder", pidns="other")
    out = run_nvml(tmp_path, """
        sys.path.insert(0, os.environ["PYTHONPATH"].split(os.pathsep)[0])
        from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._nvml_probe import probe
        with nvml_state.locked(STATE):
            s = nvml_state.load(STATE)
            nvml_state.add_process(s, gpu=1, pid=os.getpid(), used=10 << 30, name="me")
            nvml_state.save(STATE, s)
        r = probe(n, samples=3, interval=0.0, service_pids=[os.getpid()], host="t")
        out["gpus"] = [{k: g[k] for k in ("index", "free_bytes", "boot_free_bytes", "free_min_bytes",
                        "free_max_bytes", "reserved_bytes")} | {"own": [p["own"] for p in g["processes"]],
                        "names": [p["name"] for p in g["processes"]]} for g in r["gpus"]]
        out["cuda"] = r["cuda_driver_version"]
        out["me"] = open("/proc/self/comm").read().strip()
    """, state)
    total, reserved = 150754820096, 566231040
    gpu0, gpu1 = out["gpus"]
    assert out["cuda"] == "12.6"
    assert gpu0["free_bytes"] == gpu0["boot_free_bytes"] == total - reserved - 6 * GIB
    assert gpu0["own"] == [False]
    assert gpu1["own"] == [True] and gpu1["names"] == [out["me"]]
    assert gpu1["free_max_bytes"] - gpu1["free_min_bytes"] == 50 << 20
    assert gpu1["boot_free_bytes"] == gpu1["free_min_bytes"] + (10 << 30)
    assert gpu1["reserved_bytes"] == reserved


def test_real_gpu_check_script_runs_on_the_fake_library(tmp_path):
    """The prepared real-GPU check script, here on the fake library (no nvidia-smi), with GPUs that answer the health
    queries as an H200 on driver 580 does (retired pages NOT_SUPPORTED) and one Xid event pending."""
    state = fleet_state(2)
    for gpu in state["gpus"]:
        gpu["unsupported"] = ["nvmlDeviceGetRetiredPagesPendingStatus"]
    state["gpus"][1].update(remap_corrected=1, xid=[13])
    nvml_state.add_process(state, gpu=1, pid=4242, used=3 * GIB, kind="both", pidns="other")
    path = tmp_path / "state"
    nvml_state.save(path, state)
    out_dir = tmp_path / "out"
    env = dict(os.environ, LD_LIBRARY_PATH=str(LIBDIR), FAKE_NVML_STATE=str(path), OUT=str(out_dir),
               PATH="/nonexistent", NVML_CHECK_RUNS="5", NVML_CHECK_INTERVAL="0")
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "device" / "nvml_real_check.py")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    report = json.loads(done.stdout)
    assert done.returncode == 0, [c for c in report["checks"] if not c["ok"]]
    assert report["ok"] is True and "error" not in report
    assert json.loads((out_dir / "nvml_real.json").read_text()) == report
    assert report["nvidia_smi"] == {"present": False} and report["nvidia_smi_timing"] is None
    assert report["probe_timing"]["runs"] == 5
    assert [g["samples"] for g in report["probe_sampled"]["gpus"]] == [5, 5]
    assert report["raw"][1]["compute"][0]["pid"] == 4242
    names = {c["check"] for c in report["checks"]}
    assert {"gpu0_memory_v2", "gpu1_v1_used_includes_reserved", "gpu1_processes_match_binding"} <= names
    assert {"gpu0_health_retired_pages_pending", "gpu1_health_remapped_rows", "gpu1_handle_by_uuid", "xid_registration_answers",
            "xid_wait_answers"} <= names
    raw = report["raw_health"]
    assert raw[0]["queries"]["retired_pages_pending"]["code"] == 3
    assert raw[1]["queries"]["remapped_rows"] == {"value": [1, 0, 0, 0]}
    assert raw[2]["xid_events"]["events"] == [{"event_type": 8, "xid": 13}]
    assert report["probe_single"]["gpus"][0]["health"]["not_supported"] == ["retired_pages_pending"]


def test_real_gpu_check_script_reports_failures(tmp_path):
    """A driver without the v2 memory call makes the script fail, with the reason in the JSON."""
    state = fleet_state(1)
    state["system"]["missing"] = ["nvmlDeviceGetMemoryInfo_v2"]
    path = tmp_path / "state"
    nvml_state.save(path, state)
    env = dict(os.environ, LD_LIBRARY_PATH=str(LIBDIR), FAKE_NVML_STATE=str(path), PATH="/nonexistent",
               NVML_CHECK_RUNS="2", NVML_CHECK_INTERVAL="0")
    env.pop("OUT", None)
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "device" / "nvml_real_check.py")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    report = json.loads(done.stdout)
    assert done.returncode == 1 and report["ok"] is False
    failed = {c["check"] for c in report["checks"] if not c["ok"]}
    assert failed == {"gpu0_memory_v2", "gpu0_figures_sum", "gpu0_v2_available"}


def test_list_values_with_encoded_commas(tmp_path):
    out = run_nvml(tmp_path, """
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        out["frees"] = [n.nvmlDeviceGetMemoryInfo(h).free for _ in range(2)]
        out["v2"] = err(n.nvmlDeviceGetMemoryInfo, h, version=n.nvmlMemory_v2)
        out["name"] = err(n.nvmlDeviceGetName, h)
        n.nvmlShutdown()
    """, "system missing=nvmlDeviceGetMemoryInfo_v2%2CnvmlDeviceGetName\ngpu index=0 total=1000 noise=0%2C100\n")
    assert out["frees"] == [1000, 900]
    assert out["v2"] == [13, "NVMLError_FunctionNotFound"]
    assert out["name"] == [13, "NVMLError_FunctionNotFound"]


def test_real_gpu_check_script_compares_with_nvidia_smi(tmp_path):
    """With an nvidia-smi on PATH the script compares its figures with the probe's."""
    state = fleet_state(2)
    path = tmp_path / "state"
    nvml_state.save(path, state)
    total_mib = 150754820096 // (1 << 20)
    free_mib = (150754820096 - 566231040) // (1 << 20)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    rows = [f"0, GPU-00000000-0000-4000-8000-000000000000, {total_mib}, {free_mib}, 540",
            # GPU 1: nvidia-smi sees 1 GiB less free than NVML said: beyond the 64 MiB tolerance
            f"1, GPU-00000000-0000-4000-8000-000000000001, {total_mib}, {free_mib - 1024}, 1564"]
    smi.write_text("#!/bin/sh\n" + "".join(f"echo '{r}'\n" for r in rows))
    smi.chmod(0o755)
    env = dict(os.environ, LD_LIBRARY_PATH=str(LIBDIR), FAKE_NVML_STATE=str(path), PATH=f"{bindir}:/usr/bin:/bin",
               NVML_CHECK_RUNS="2", NVML_CHECK_INTERVAL="0")
    env.pop("OUT", None)
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "device" / "nvml_real_check.py")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    report = json.loads(done.stdout)
    checks = {c["check"]: c for c in report["checks"]}
    assert checks["gpu0_smi_free"]["ok"] and checks["gpu0_smi_total"]["ok"] and checks["gpu0_smi_uuid"]["ok"]
    assert checks["gpu1_smi_free"]["ok"] is False and checks["gpu1_smi_free"]["detail"] == 1024.0
    assert report["nvidia_smi_timing"]["runs"] == 5
    assert done.returncode == 1 and report["ok"] is False


def test_probe_without_any_nvml_library_says_so(tmp_path):
    """No libnvidia-ml.so.1 on the search path: the real pynvml reports it, the probe explains it."""
    script = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import pynvml
        from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._nvml_probe import NvmlProbeError, probe
        try:
            probe(pynvml, host="nodriver")
        except NvmlProbeError as exc:
            print(json.dumps({"msg": exc.message, "code": exc.code}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    system_nvml = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libnvidia-ml.so.1')"],
                                 env=env, capture_output=True, timeout=60, check=False)
    if system_nvml.returncode == 0:
        pytest.skip("this machine has a real libnvidia-ml.so.1 on the default search path")
    done = subprocess.run([sys.executable, "-c", script, ""], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.strip(), f"the probe did not report the missing library: {done.stderr[-2000:]}"
    out = json.loads(done.stdout)
    assert out == {"msg": "nodriver: NVML library libnvidia-ml.so.1 not found: is the NVIDIA driver installed?",
                   "code": 12}


def test_a_dead_process_frees_its_memory_as_the_driver_does(tmp_path):
    """A record of this pid namespace counts only while its process lives (the driver frees a dead
    process's memory); a record of another namespace (a container's pid) counts until it is removed."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state = fleet_state(1)
        nvml_state.add_process(state, gpu=0, pid=child.pid, used=2 * GIB, name="engine")
        nvml_state.add_process(state, gpu=0, pid=child.pid + 100000, used=GIB, name="dead")  # no such pid
        nvml_state.add_process(state, gpu=0, pid=4242, used=3 * GIB, name="container", pidns="other")
        code = """
            n.nvmlInit()
            h = n.nvmlDeviceGetHandleByIndex(0)
            out["used"] = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2).used
            out["pids"] = sorted(p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h))
            n.nvmlShutdown()
        """
        alive = run_nvml(tmp_path, code, state)
        assert alive["used"] == 5 * GIB and alive["pids"] == sorted([child.pid, 4242])
        assert [nvml_state.alive(p) for p in state["procs"]] == [True, False, True]
    finally:
        child.kill()
        child.wait()
    # the engine was killed and nobody removed its record: its memory is free again
    gone = run_nvml(tmp_path, code, state)
    assert gone["used"] == 3 * GIB and gone["pids"] == [4242]
    assert [nvml_state.alive(p) for p in state["procs"]] == [False, False, True]


def test_a_bad_pid_namespace_is_refused(tmp_path):
    state = fleet_state(1)
    with pytest.raises(nvml_state.StateError, match=r"procs\[0\]\.pidns: 'mine' is not one of local, other"):
        nvml_state.add_process(state, gpu=0, pid=1, used=1, pidns="mine")
    # the library refuses it too, naming the line
    text = nvml_state.dumps(fleet_state(1)) + "proc gpu=0 pid=1 used=1 kind=compute name= pidns=mine\n"
    out = run_nvml(tmp_path, """
        out["init"] = err(n.nvmlInit)
        out["count"] = err(n.nvmlDeviceGetCount)
    """, text)
    assert out["init"] == [999, "NVMLError_Unknown"] or out["count"] == [999, "NVMLError_Unknown"], out


def test_health_queries_unsupported_functions_and_xid_events(tmp_path):
    """The health symbols through the real pynvml: defaults, faults, NOT_SUPPORTED per GPU, ECC off, Xid events once per set."""
    state = fleet_state(3)
    state["gpus"][1].update(ecc_uncorrected_volatile=2, ecc_uncorrected_aggregate=1, remap_uncorrected=1, remap_pending=1,
                            retired_pending=1, xid=[48, 79], unsupported=["nvmlDeviceGetRetiredPagesPendingStatus"])
    state["gpus"][2].update(ecc_mode=0, unsupported=["nvmlDeviceRegisterEvents"])
    out = run_nvml(tmp_path, """
        import time
        n.nvmlInit()
        h = [n.nvmlDeviceGetHandleByIndex(i) for i in range(3)]
        U, V, A = n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC, n.NVML_AGGREGATE_ECC
        out["ecc_mode"] = [n.nvmlDeviceGetEccMode(x) for x in h]
        out["ecc0"] = n.nvmlDeviceGetTotalEccErrors(h[0], U, V)
        out["ecc1"] = [n.nvmlDeviceGetTotalEccErrors(h[1], U, V), n.nvmlDeviceGetTotalEccErrors(h[1], U, A),
                       n.nvmlDeviceGetTotalEccErrors(h[1], n.NVML_MEMORY_ERROR_TYPE_CORRECTED, V)]
        out["ecc2"] = err(n.nvmlDeviceGetTotalEccErrors, h[2], U, V)
        out["rows"] = [list(n.nvmlDeviceGetRemappedRows(x)) for x in h[:2]]
        out["retired0"] = n.nvmlDeviceGetRetiredPagesPendingStatus(h[0])
        out["retired1"] = err(n.nvmlDeviceGetRetiredPagesPendingStatus, h[1])
        out["types"] = [n.nvmlDeviceGetSupportedEventTypes(x) for x in h]
        s = n.nvmlEventSetCreate()
        for x in h[:2]:
            n.nvmlDeviceRegisterEvents(x, n.nvmlEventTypeXidCriticalError, s)
        out["register2"] = err(n.nvmlDeviceRegisterEvents, h[2], n.nvmlEventTypeXidCriticalError, s)
        events = []
        for _ in range(2):
            d = n.nvmlEventSetWait_v2(s, 1000)
            events.append([n.nvmlDeviceGetIndex(d.device), d.eventType, d.eventData])
        out["events"] = events
        t0 = time.monotonic()
        out["then"] = err(n.nvmlEventSetWait_v2, s, 150)
        out["waited"] = time.monotonic() - t0
        n.nvmlEventSetFree(s)
        s2 = n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(h[1], n.nvmlEventTypeXidCriticalError, s2)
        out["second_set"] = n.nvmlEventSetWait_v2(s2, 10).eventData
        n.nvmlShutdown()
    """, state)
    assert out["ecc_mode"] == [[1, 1], [1, 1], [0, 0]]
    assert out["ecc0"] == 0 and out["ecc1"] == [2, 2, 0], "the aggregate counter holds at least this boot's errors"
    assert out["ecc2"] == [3, "NVMLError_NotSupported"], "no ECC counters with ECC off"
    assert out["rows"] == [[0, 0, 0, 0], [0, 1, 1, 0]]
    assert out["retired0"] == 0 and out["retired1"] == [3, "NVMLError_NotSupported"]
    assert out["types"] == [8, 8, 0]
    assert out["register2"] == [3, "NVMLError_NotSupported"]
    assert out["events"] == [[1, 8, 48], [1, 8, 79]]
    assert out["then"] == [10, "NVMLError_Timeout"] and out["waited"] >= 0.14
    assert out["second_set"] == 48, "every event set (every listening process) receives the GPU's events"

# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Unit tests of the NVML probe core with an injected fake binding (no library, no GPU)."""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu import _nvml_probe as probe_mod
from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._nvml_probe import NvmlProbeError, probe

GIB = 1 << 30


class FakeNVMLError(Exception):
    """Same contract as pynvml.NVMLError: the NVML return code in ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"fake NVML error {self.value}"


class FakeNvml:
    """A pynvml-shaped object driven by a dict in the fake NVML state shape.

    ``state``: ``{"system": {...}, "gpus": [...], "procs": [...]}`` (see nvml_state.py);
    ``missing``: functions that raise NVML error 13; ``absent``: functions the binding lacks;
    ``errors``: ``{(function, index): code}`` raised by one function on one GPU.
    """

    NVMLError = FakeNVMLError
    nvmlMemory_v2 = 0x02000028

    def __init__(self, state: dict[str, Any], missing: tuple[str, ...] = (), absent: tuple[str, ...] = (),
                 errors: dict[tuple[str, int], int] | None = None) -> None:
        self.state = state
        self.missing = set(missing) | set(state.get("system", {}).get("missing", ()))
        self.absent = set(absent)
        self.errors = errors or {}
        self.calls: list[str] = []
        self.initialized = 0
        self.shutdowns = 0
        self.reads: dict[int, int] = {}

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml") and name in object.__getattribute__(self, "absent"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    # -- helpers
    def _enter(self, fn: str, index: int | None = None) -> None:
        self.calls.append(fn)
        if fn in self.missing:
            raise FakeNVMLError(13)
        if fn != "nvmlInit" and not self.initialized:
            raise FakeNVMLError(1)
        if index is not None:
            gpu = self._gpu(index)
            if gpu.get("error"):
                raise FakeNVMLError(gpu["error"])
            if (fn, index) in self.errors:
                raise FakeNVMLError(self.errors[(fn, index)])

    def _gpu(self, index: int) -> dict[str, Any]:
        return next(g for g in self.state["gpus"] if g["index"] == index)

    def _mem(self, index: int) -> tuple[int, int, int, int]:
        gpu = self._gpu(index)
        used = gpu.get("base_used", 0) + sum(p["used"] for p in self.state["procs"] if p["gpu"] == index)
        noise = gpu.get("noise") or []
        if noise:
            used += noise[self.reads.get(index, 0) % len(noise)]
            self.reads[index] = self.reads.get(index, 0) + 1
        total, reserved = gpu["total"], gpu.get("reserved", 0)
        free = max(0, total - reserved - used)
        if gpu.get("free_override") is not None:
            free = gpu["free_override"]
        return total, reserved, free, used

    # -- pynvml API
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        code = self.state.get("system", {}).get("init_error", 0)
        if code:
            raise FakeNVMLError(code)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")
        self.shutdowns += 1
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.state["system"].get("driver", "550.127.05")

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._enter("nvmlSystemGetNVMLVersion")
        return self.state["system"].get("nvml", "12.550.127.05")

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return self.state["system"].get("cuda", 12040)

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.state["system"].get("cuda", 12040)

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount_v2")
        return len(self.state["gpus"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._enter("nvmlDeviceGetHandleByIndex_v2")
        if index >= len(self.state["gpus"]):
            raise FakeNVMLError(2)
        self._enter("nvmlDeviceGetHandleByIndex_v2", index)
        return SimpleNamespace(index=index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Any:
        self._enter("nvmlDeviceGetHandleByUUID")
        for gpu in self.state["gpus"]:
            if gpu["uuid"] == uuid:
                self._enter("nvmlDeviceGetHandleByUUID", gpu["index"])
                return SimpleNamespace(index=gpu["index"])
        raise FakeNVMLError(6)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetIndex", handle.index)
        return handle.index

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetUUID", handle.index)
        return self._gpu(handle.index)["uuid"]

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetName", handle.index)
        return self._gpu(handle.index).get("name", "NVIDIA H200")

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        self._enter("nvmlDeviceGetPciInfo_v3", handle.index)
        return SimpleNamespace(busId=self._gpu(handle.index)["pci"].encode())

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        self._enter("nvmlDeviceGetCudaComputeCapability", handle.index)
        major, minor = self._gpu(handle.index).get("cc", "9.0").split(".")
        return int(major), int(minor)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        if version:
            self._enter("nvmlDeviceGetMemoryInfo_v2", handle.index)
            if version != self.nvmlMemory_v2:
                raise FakeNVMLError(25)
            total, reserved, free, used = self._mem(handle.index)
            return SimpleNamespace(version=version, total=total, reserved=reserved, free=free, used=used)
        self._enter("nvmlDeviceGetMemoryInfo", handle.index)
        total, _reserved, free, _used = self._mem(handle.index)
        return SimpleNamespace(total=total, free=free, used=total - free)

    def _procs(self, fn: str, handle: Any, kind: str) -> list[Any]:
        self._enter(fn, handle.index)
        return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p["used"], gpuInstanceId=0xFFFFFFFF,
                                computeInstanceId=0xFFFFFFFF)
                for p in self.state["procs"]
                if p["gpu"] == handle.index and p.get("kind", "compute") in (kind, "both")]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any) -> list[Any]:
        return self._procs("nvmlDeviceGetComputeRunningProcesses_v3", handle, "compute")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        return self._procs("nvmlDeviceGetComputeRunningProcesses_v2", handle, "compute")

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: Any) -> list[Any]:
        return self._procs("nvmlDeviceGetGraphicsRunningProcesses_v3", handle, "graphics")

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: Any) -> list[Any]:
        return self._procs("nvmlDeviceGetGraphicsRunningProcesses_v2", handle, "graphics")


def make_state(n_gpus: int = 2, total: int = 140 * GIB, reserved: int = 512 << 20) -> dict[str, Any]:
    return {
        "system": {"driver": "550.127.05", "cuda": 12040, "nvml": "12.550.127.05", "init_error": 0, "missing": []},
        "gpus": [{"index": i, "uuid": f"GPU-{i:08d}-aaaa", "name": "NVIDIA H200", "pci": f"00000000:{0x18 + i:02X}:00.0",
                  "total": total, "reserved": reserved, "base_used": 0, "cc": "9.0", "error": 0, "noise": [],
                  "free_override": None} for i in range(n_gpus)],
        "procs": [],
    }


@pytest.fixture()
def no_proc(tmp_path):
    """An empty /proc stand-in so process names and trees come only from the test."""
    root = tmp_path / "proc"
    root.mkdir()
    return str(root)


def add_proc_entry(proc_root: str, pid: int, ppid: int, comm: str) -> None:
    path = os.path.join(proc_root, str(pid))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "comm"), "w", encoding="utf-8") as handle:
        handle.write(comm + "\n")
    with open(os.path.join(path, "stat"), "w", encoding="utf-8") as handle:
        handle.write(f"{pid} ({comm} (x)) S {ppid} {pid} {pid} 0 -1 4194560 0 0 0 0\n")


# ---------------------------------------------------------------- results

def test_probe_reports_every_gpu_with_processes_and_versions(no_proc):
    state = make_state(2)
    state["procs"] = [
        {"gpu": 0, "pid": 100, "used": 3 * GIB, "kind": "compute"},
        {"gpu": 1, "pid": 200, "used": 64 << 20, "kind": "graphics"},
        {"gpu": 1, "pid": 201, "used": GIB, "kind": "both"},
    ]
    add_proc_entry(no_proc, 100, 1, "python3")
    nvml = FakeNvml(state)
    result = probe(nvml, host="h1", proc_root=no_proc)
    assert result["driver_version"] == "550.127.05"
    assert result["cuda_driver_version"] == "12.4"
    assert result["nvml_version"] == "12.550.127.05"
    assert result["warnings"] == []
    assert [g["index"] for g in result["gpus"]] == [0, 1]
    gpu0, gpu1 = result["gpus"]
    total, reserved = 140 * GIB, 512 << 20
    assert gpu0["uuid"] == "GPU-00000000-aaaa"
    assert gpu0["pci_bus_id"] == "00000000:18:00.0"
    assert gpu0["compute_capability"] == "9.0"
    assert gpu0["total_bytes"] == total
    assert gpu0["reserved_bytes"] == reserved
    assert gpu0["used_bytes"] == 3 * GIB
    assert gpu0["free_bytes"] == total - reserved - 3 * GIB
    assert gpu0["memory_info_version"] == 2
    assert gpu0["processes"] == [{"pid": 100, "name": "python3", "used_bytes": 3 * GIB, "kinds": ["compute"], "own": False}]
    assert gpu0["boot_free_bytes"] == gpu0["free_bytes"]
    # pid 201 is listed by both calls but reported once
    assert [(p["pid"], p["kinds"]) for p in gpu1["processes"]] == [(200, ["graphics"]), (201, ["compute", "graphics"])]
    assert gpu1["processes"][0]["name"] is None
    assert nvml.shutdowns == 1 and nvml.initialized == 0


def test_own_processes_raise_boot_free(no_proc):
    state = make_state(2)
    state["procs"] = [
        {"gpu": 0, "pid": 300, "used": 20 * GIB, "kind": "compute"},   # our engine's worker
        {"gpu": 0, "pid": 400, "used": 2 * GIB, "kind": "compute"},    # co-tenant
        {"gpu": 1, "pid": 301, "used": 30 * GIB, "kind": "compute"},   # our engine's second worker
    ]
    add_proc_entry(no_proc, 299, 1, "vllm")
    add_proc_entry(no_proc, 300, 299, "VLLM::Worker_TP0")
    add_proc_entry(no_proc, 301, 300, "VLLM::Worker_TP1")
    add_proc_entry(no_proc, 400, 1, "embedder")
    result = probe(FakeNvml(state), service_pids=[299], host="h1", proc_root=no_proc)
    gpu0, gpu1 = result["gpus"]
    assert result["own_pids"] == [299, 300, 301]
    assert {p["pid"]: p["own"] for p in gpu0["processes"]} == {300: True, 400: False}
    assert gpu0["own_used_bytes"] == 20 * GIB
    assert gpu0["boot_free_bytes"] == gpu0["free_bytes"] + 20 * GIB
    assert gpu1["boot_free_bytes"] == gpu1["free_bytes"] + 30 * GIB


def test_service_unit_cgroup_and_main_pid_descendants(no_proc, tmp_path):
    cg = tmp_path / "cgroup"
    unit_dir = cg / "system.slice" / "vllm-main.service"
    (unit_dir / "sub").mkdir(parents=True)
    (unit_dir / "cgroup.procs").write_text("500\n")
    (unit_dir / "sub" / "cgroup.procs").write_text("510\n511\n")
    add_proc_entry(no_proc, 500, 1, "vllm")
    add_proc_entry(no_proc, 520, 500, "child-outside-cgroup")
    add_proc_entry(no_proc, 600, 1, "other")
    commands: list[list[str]] = []

    def run(argv):
        commands.append(list(argv))
        return 0, "MainPID=500\nControlGroup=/system.slice/vllm-main.service\n", ""

    own = probe_mod.own_processes(["vllm-main.service"], [], run, no_proc, str(cg))
    assert own.roots == {500, 510, 511}
    assert 520 in own and 600 not in own and 1 not in own and 0 not in own and 999 not in own
    assert own.found() == [500, 510, 511, 520]
    assert commands == [["systemctl", "show", "-p", "ControlGroup,MainPID,LoadState", "--", "vllm-main.service"]]


def test_stopped_unit_has_no_processes(no_proc, tmp_path):
    own = probe_mod.own_processes(["vllm-main.service"], [], lambda argv: (0, "MainPID=0\nControlGroup=\n", ""),
                                  no_proc, str(tmp_path))
    assert own.roots == set() and own.found() == []


def test_unknown_unit_warns(no_proc):
    result = probe(FakeNvml(make_state(1)), service_units=["vllm-typo.service"], host="h1", proc_root=no_proc,
                   run_command=lambda argv: (0, "MainPID=0\nControlGroup=\nLoadState=not-found\n", ""))
    assert result["warnings"] == ["h1: systemd unit 'vllm-typo.service' not found: no process counts as own through it"]
    assert result["own_pids"] == []


def test_cgroup_v1_systemd_hierarchy(tmp_path):
    unit_dir = tmp_path / "systemd" / "system.slice" / "x.service"
    unit_dir.mkdir(parents=True)
    (unit_dir / "cgroup.procs").write_text("42\n")
    assert probe_mod.cgroup_pids("/system.slice/x.service", str(tmp_path)) == {42}


def test_systemctl_failure_names_the_unit(no_proc):
    with pytest.raises(NvmlProbeError, match="systemd unit 'vllm-x.service'.*Failed to connect"):
        probe(FakeNvml(make_state(1)), service_units=["vllm-x.service"], host="h1", proc_root=no_proc,
              run_command=lambda argv: (1, "", "Failed to connect to bus"))


def test_parent_pid_handles_comm_with_parentheses(no_proc):
    add_proc_entry(no_proc, 7, 3, "we (ird) name")
    assert probe_mod.parent_pid(7, no_proc) == 3
    assert probe_mod.parent_pid(8, no_proc) is None


def test_own_processes_walk_up_deep_chains_once(no_proc):
    for pid in range(10, 60):
        add_proc_entry(no_proc, pid, pid - 1, f"p{pid}")
    own = probe_mod.OwnProcesses([20], no_proc)
    assert 59 in own and 21 in own and 19 not in own and 10 not in own
    assert "20" not in own and -1 not in own
    assert own.found() == list(range(20, 60))


def test_devices_filter_keeps_the_given_order(no_proc):
    nvml = FakeNvml(make_state(4))
    result = probe(nvml, devices=["GPU-00000003-aaaa", "1", 0], host="h1", proc_root=no_proc)
    assert [g["index"] for g in result["gpus"]] == [3, 1, 0]
    assert [g["index"] for g in probe(nvml, devices=[], host="h1", proc_root=no_proc)["gpus"]] == [0, 1, 2, 3]


@pytest.mark.parametrize(("devices", "message"), [
    ([5], r"h1: GPU 5 does not exist \(4 GPUs, indices 0-3\)"),
    (["GPU-nope"], "h1: GPU GPU-nope not found on this host"),
    ([1, "1"], "GPU 1 is listed twice"),
    (["GPU-00000002-aaaa", 2], "GPU 2 is listed twice"),
    (["gpu0"], "neither a GPU index nor a GPU UUID"),
    ([-1], "negative"),
    ([True], "neither a GPU index nor a GPU UUID"),
])
def test_devices_errors(no_proc, devices, message):
    nvml = FakeNvml(make_state(4))
    with pytest.raises(NvmlProbeError, match=message):
        probe(nvml, devices=devices, host="h1", proc_root=no_proc)
    assert nvml.shutdowns == 1


def test_zero_gpus(no_proc):
    state = make_state(0)
    assert probe(FakeNvml(state), host="h1", proc_root=no_proc)["gpus"] == []
    with pytest.raises(NvmlProbeError, match=r"GPU 0 does not exist \(0 GPUs, indices none\)"):
        probe(FakeNvml(state), devices=[0], host="h1", proc_root=no_proc)


# ---------------------------------------------------------------- sampling

def test_samples_report_min_max_and_last(no_proc):
    state = make_state(1)
    state["gpus"][0]["noise"] = [0, 256 << 20, 64 << 20]
    slept: list[float] = []
    result = probe(FakeNvml(state), samples=4, interval=0.5, host="h1", proc_root=no_proc, sleep=slept.append)
    gpu = result["gpus"][0]
    base = 140 * GIB - (512 << 20)
    assert slept == [0.5, 0.5, 0.5]
    assert gpu["samples"] == 4
    assert gpu["free_max_bytes"] == base
    assert gpu["free_min_bytes"] == base - (256 << 20)
    assert gpu["free_bytes"] == base  # fourth read cycles back to noise 0
    assert gpu["boot_free_bytes"] == base - (256 << 20)  # the lowest sample bounds the boot


def test_single_sample_does_not_sleep(no_proc):
    slept: list[float] = []
    probe(FakeNvml(make_state(1)), samples=1, interval=3, host="h1", proc_root=no_proc, sleep=slept.append)
    assert slept == []


@pytest.mark.parametrize(("samples", "interval", "message"), [
    (0, 0.0, "samples must be an integer >= 1"),
    (True, 0.0, "samples must be an integer >= 1"),
    (1, -1.0, "interval must be >= 0"),
])
def test_bad_sampling_arguments(samples, interval, message):
    with pytest.raises(NvmlProbeError, match=message):
        probe(FakeNvml(make_state(1)), samples=samples, interval=interval)


# ---------------------------------------------------------------- degraded drivers

def test_memory_v2_missing_falls_back_to_v1_with_warning(no_proc):
    state = make_state(1)
    state["procs"] = [{"gpu": 0, "pid": 9, "used": GIB, "kind": "compute"}]
    nvml = FakeNvml(state, missing=("nvmlDeviceGetMemoryInfo_v2",))
    result = probe(nvml, samples=3, interval=0, host="h1", proc_root=no_proc)
    gpu = result["gpus"][0]
    assert gpu["memory_info_version"] == 1
    assert gpu["reserved_bytes"] is None
    assert gpu["used_bytes"] == 140 * GIB - gpu["free_bytes"]
    assert len(result["warnings"]) == 1
    assert "h1: GPU 0 (GPU-00000000-aaaa): nvmlDeviceGetMemoryInfo_v2 unavailable" in result["warnings"][0]
    # v2 is tried once, later samples go straight to v1
    assert nvml.calls.count("nvmlDeviceGetMemoryInfo_v2") == 1
    assert nvml.calls.count("nvmlDeviceGetMemoryInfo") == 3


def test_memory_v2_version_mismatch_falls_back(no_proc):
    nvml = FakeNvml(make_state(1))
    nvml.nvmlMemory_v2 = 0x01000028  # binding and driver disagree on the struct version
    original = FakeNvml.nvmlDeviceGetMemoryInfo

    def strict(self, handle, version=None):
        if version is not None and version != 0x02000028:
            self.calls.append("nvmlDeviceGetMemoryInfo_v2")
            raise FakeNVMLError(25)
        return original(self, handle, version)

    nvml.nvmlDeviceGetMemoryInfo = strict.__get__(nvml)
    result = probe(nvml, host="h1", proc_root=no_proc)
    assert result["gpus"][0]["memory_info_version"] == 1
    assert "version mismatch" in result["warnings"][0]


def test_optional_fields_are_omitted_with_warnings(no_proc):
    nvml = FakeNvml(make_state(1), missing=(
        "nvmlDeviceGetName", "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetCudaComputeCapability",
        "nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion",
    ))
    result = probe(nvml, host="h1", proc_root=no_proc)
    gpu = result["gpus"][0]
    for key in ("name", "pci_bus_id", "compute_capability"):
        assert key not in gpu
    assert result["driver_version"] is None and result["nvml_version"] is None
    assert len(result["warnings"]) == 5
    assert any("h1: GPU 0 (GPU-00000000-aaaa): name not reported" in w for w in result["warnings"])


def test_cuda_version_falls_back_to_v1_call(no_proc):
    nvml = FakeNvml(make_state(1), missing=("nvmlSystemGetCudaDriverVersion_v2",))
    result = probe(nvml, host="h1", proc_root=no_proc)
    assert result["cuda_driver_version"] == "12.4" and result["warnings"] == []
    nvml = FakeNvml(make_state(1), absent=("nvmlSystemGetCudaDriverVersion_v2",),
                    missing=("nvmlSystemGetCudaDriverVersion",))
    result = probe(nvml, host="h1", proc_root=no_proc)
    assert result["cuda_driver_version"] is None
    assert result["warnings"] == ["h1: cuda_driver_version not reported (nvmlSystemGetCudaDriverVersion: "
                                  "function not found in this driver)"]


def test_process_calls_fall_back_to_v2_then_degrade(no_proc):
    state = make_state(1)
    state["procs"] = [{"gpu": 0, "pid": 9, "used": GIB, "kind": "compute"}]
    nvml = FakeNvml(state, missing=("nvmlDeviceGetComputeRunningProcesses_v3",),
                    absent=("nvmlDeviceGetGraphicsRunningProcesses_v3",))
    result = probe(nvml, host="h1", proc_root=no_proc)
    assert [p["pid"] for p in result["gpus"][0]["processes"]] == [9]
    assert result["warnings"] == []
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in nvml.calls
    nvml = FakeNvml(state, missing=tuple(n for _k, names in probe_mod._PROCESS_CALLS for n in names))
    result = probe(nvml, host="h1", proc_root=no_proc)
    gpu = result["gpus"][0]
    assert gpu["processes"] == [] and gpu["processes_reported"] is False
    assert len(result["warnings"]) == 2


def test_process_memory_not_available(no_proc):
    state = make_state(1)
    state["procs"] = [{"gpu": 0, "pid": 9, "used": 0xFFFFFFFFFFFFFFFF, "kind": "compute"}]
    nvml = FakeNvml(state)
    nvml._mem = lambda index: (140 * GIB, 0, 100 * GIB, 40 * GIB)
    result = probe(nvml, service_pids=[9], host="h1", proc_root=no_proc)
    gpu = result["gpus"][0]
    assert gpu["processes"][0]["used_bytes"] is None
    assert gpu["own_used_bytes"] == 0 and gpu["boot_free_bytes"] == 100 * GIB


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize(("code", "message"), [
    (9, "h1: NVIDIA driver not loaded"),
    (4, "h1: no permission to query NVML"),
    (12, "h1: NVML library libnvidia-ml.so.1 not found"),
    (18, "versions differ"),
    (999, "h1: NVML error 999: fake NVML error 999"),
])
def test_init_errors(code, message):
    state = make_state(1)
    state["system"]["init_error"] = code
    nvml = FakeNvml(state)
    with pytest.raises(NvmlProbeError, match=message) as info:
        probe(nvml, host="h1")
    assert info.value.code == code
    assert nvml.shutdowns == 0


def test_library_load_oserror():
    nvml = FakeNvml(make_state(1))

    def boom() -> None:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    nvml.nvmlInit = boom
    with pytest.raises(NvmlProbeError, match="h1: NVML library libnvidia-ml.so.1 not found.*cannot open"):
        probe(nvml, host="h1")


@pytest.mark.parametrize(("code", "message"), [
    (15, r"h1: GPU 1: opening the GPU: GPU is lost"),
    (16, r"h1: GPU 1: opening the GPU: GPU requires a reset"),
])
def test_gpu_errors_name_the_gpu(no_proc, code, message):
    state = make_state(2)
    state["gpus"][1]["error"] = code
    nvml = FakeNvml(state)
    with pytest.raises(NvmlProbeError, match=message) as info:
        probe(nvml, host="h1", proc_root=no_proc)
    assert info.value.gpu == "1" and info.value.code == code
    assert nvml.shutdowns == 1


def test_gpu_lost_during_memory_read_names_index_and_uuid(no_proc):
    nvml = FakeNvml(make_state(2), errors={("nvmlDeviceGetMemoryInfo_v2", 1): 15})
    with pytest.raises(NvmlProbeError, match=r"h1: GPU 1 \(GPU-00000001-aaaa\): reading memory \(v2\): GPU is lost"):
        probe(nvml, host="h1", proc_root=no_proc)


def test_process_listing_error_is_fatal(no_proc):
    nvml = FakeNvml(make_state(1), errors={("nvmlDeviceGetComputeRunningProcesses_v3", 0): 4})
    with pytest.raises(NvmlProbeError, match="listing compute processes: no permission"):
        probe(nvml, host="h1", proc_root=no_proc)


@pytest.mark.parametrize(("override", "message"), [
    ({"free_override": 141 * GIB}, r"impossible memory figures \(free 151397597184 > total 150323855360\)"),
    ({"base_used": 150 * GIB}, r"impossible memory figures \(used 161061273600 > total"),
    ({"total": 0}, r"impossible memory figures \(total 0, reserved 536870912 > total 0\)"),
])
def test_impossible_figures(no_proc, override, message):
    state = make_state(1)
    state["gpus"][0].update(override)
    with pytest.raises(NvmlProbeError, match="h1: GPU 0 \\(GPU-00000000-aaaa\\): NVML reports " + message):
        probe(FakeNvml(state), host="h1", proc_root=no_proc)


def test_binding_without_a_required_function(no_proc):
    nvml = FakeNvml(make_state(1), absent=("nvmlDeviceGetCount",))
    with pytest.raises(NvmlProbeError, match="the NVML binding has no nvmlDeviceGetCount"):
        probe(nvml, host="h1", proc_root=no_proc)


def test_describe_error_survives_a_failing_str():
    class Weird(Exception):
        value = 77

        def __str__(self) -> str:
            raise RuntimeError("no library")

    assert probe_mod.describe_error(Weird()) == "NVML error 77: Weird"


# ---------------------------------------------------------------- properties

@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(min_value=1 << 30, max_value=192 << 30),
    reserved_frac=st.floats(min_value=0, max_value=0.05),
    procs=st.lists(st.tuples(st.integers(min_value=0, max_value=40 << 30), st.booleans()), max_size=6),
    base_used=st.integers(min_value=0, max_value=8 << 30),
)
def test_boot_free_between_free_and_total(total, reserved_frac, procs, base_used):
    state = make_state(1, total=total, reserved=int(total * reserved_frac))
    state["gpus"][0]["base_used"] = base_used
    own = []
    for pid, (used, is_own) in enumerate(procs, start=1000):
        state["procs"].append({"gpu": 0, "pid": pid, "used": used, "kind": "compute"})
        if is_own:
            own.append(pid)
    try:
        result = probe(FakeNvml(state), service_pids=own, host="h1", proc_root="/nonexistent")
    except NvmlProbeError as exc:
        # the only refusal allowed is an over-committed GPU reported as impossible figures
        assert "impossible memory figures" in str(exc)
        return
    gpu = result["gpus"][0]
    assert gpu["free_bytes"] <= gpu["boot_free_bytes"] <= gpu["total_bytes"]
    assert gpu["free_min_bytes"] <= gpu["free_bytes"] <= gpu["free_max_bytes"]

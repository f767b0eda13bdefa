# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The gpu_memory_info module shell: arguments, result (no facts), failures."""
from __future__ import annotations

import json
import platform
from typing import Any

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpufleet.vllm.plugins.modules import gpu_memory_info
from ansible_collections.gpufleet.vllm.tests.unit.plugins.module_utils.test_nvml_probe import (
    GIB,
    FakeNvml,
    make_state,
)


def run(monkeypatch, capsys, args: dict[str, Any], binding: Any, node: str = "gpu-a1") -> tuple[int, dict[str, Any]]:
    monkeypatch.setattr(gpu_memory_info, "pynvml", binding)
    monkeypatch.setattr(platform, "node", lambda: node)
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        gpu_memory_info.main()
    return exc.value.code or 0, json.loads(capsys.readouterr().out)


def test_reports_gpus_without_facts(monkeypatch, capsys):
    state = make_state(2)
    state["procs"] = [{"gpu": 1, "pid": 4242, "used": 2 * GIB, "kind": "compute"}]
    rc, out = run(monkeypatch, capsys, {"samples": 2, "interval": 0}, FakeNvml(state))
    assert rc == 0
    assert out["changed"] is False
    assert [g["index"] for g in out["gpus"]] == [0, 1]
    assert out["driver_version"] == "550.127.05" and out["cuda_driver_version"] == "12.4"
    assert "ansible_facts" not in out, "an info module sets no facts (gpu_memory_facts does)"
    assert out["gpus"][1]["processes"][0]["pid"] == 4242
    assert out["gpus"][0]["samples"] == 2
    assert "warnings" not in out


def test_check_mode_reads_normally(monkeypatch, capsys):
    rc, out = run(monkeypatch, capsys, {"_ansible_check_mode": True, "devices": ["1"]}, FakeNvml(make_state(2)))
    assert rc == 0 and out["changed"] is False
    assert [g["index"] for g in out["gpus"]] == [1]


def test_degraded_driver_warns(monkeypatch, capsys):
    # where warnings end up (result or controller display) depends on what else is loaded:
    # capture what the module hands to warn()
    warned: list[str] = []
    monkeypatch.setattr(gpu_memory_info.AnsibleModule, "warn", lambda self, msg: warned.append(msg))
    rc, out = run(monkeypatch, capsys, {}, FakeNvml(make_state(1), missing=("nvmlDeviceGetMemoryInfo_v2",)))
    assert rc == 0 and out["gpus"][0]["memory_info_version"] == 1
    assert len(warned) == 1 and "GPU 0 (GPU-00000000-aaaa): nvmlDeviceGetMemoryInfo_v2 unavailable" in warned[0]


def test_gpu_error_names_host_and_gpu(monkeypatch, capsys):
    state = make_state(2)
    state["gpus"][1]["error"] = 15
    rc, out = run(monkeypatch, capsys, {}, FakeNvml(state))
    assert rc == 1 and out["failed"] is True
    assert out["msg"] == "gpu-a1: GPU 1: opening the GPU: GPU is lost (NVML_ERROR_GPU_IS_LOST): it fell off the bus; the host needs attention"
    assert out["gpu"] == "1" and out["nvml_error"] == 15
    assert "exception" not in out or "Traceback" not in out.get("msg", "")


def test_unknown_device(monkeypatch, capsys):
    rc, out = run(monkeypatch, capsys, {"devices": ["GPU-nope"]}, FakeNvml(make_state(2)))
    assert rc == 1 and out["msg"] == "gpu-a1: GPU GPU-nope not found on this host"


def test_driver_not_loaded(monkeypatch, capsys):
    state = make_state(1)
    state["system"]["init_error"] = 9
    rc, out = run(monkeypatch, capsys, {}, FakeNvml(state))
    assert rc == 1 and out["msg"].startswith("gpu-a1: NVIDIA driver not loaded")


def test_service_unit_failure_is_prefixed_with_host(monkeypatch, capsys):
    monkeypatch.setattr(gpu_memory_info.AnsibleModule, "run_command",
                        lambda self, argv, **kw: (1, "", "Failed to connect to bus"))
    rc, out = run(monkeypatch, capsys, {"service_units": ["vllm-a.service"]}, FakeNvml(make_state(1)))
    assert rc == 1
    assert out["msg"] == "gpu-a1: cannot read systemd unit 'vllm-a.service' (systemctl show rc=1): Failed to connect to bus"


def test_service_unit_processes_count_as_own(monkeypatch, capsys):
    state = make_state(1)
    state["procs"] = [{"gpu": 0, "pid": 1, "used": 4 * GIB, "kind": "compute"}]
    seen: list[list[str]] = []

    def fake_run(self, argv, **kw):
        seen.append(list(argv))
        return 0, "MainPID=1\nControlGroup=\n", ""

    monkeypatch.setattr(gpu_memory_info.AnsibleModule, "run_command", fake_run)
    rc, out = run(monkeypatch, capsys, {"service_units": ["vllm-a.service"]}, FakeNvml(state))
    assert rc == 0 and seen[0][:2] == ["systemctl", "show"]
    gpu = out["gpus"][0]
    assert 1 in out["own_pids"] and gpu["processes"][0]["own"] is True
    assert gpu["boot_free_bytes"] == gpu["free_bytes"] + 4 * GIB


@pytest.mark.parametrize(("args", "message"), [
    ({"samples": 0}, "samples: must be an integer in 1..1000, got 0"),
    ({"interval": -2.5}, "interval: must be >= 0 and <= 3600, got -2.5"),
    ({"interval": "nan"}, "interval: must be a finite number, got nan"),
    ({"interval": float("inf")}, "interval: must be a finite number, got inf"),
    ({"service_units": ["vllm-a.service\nx"]}, "service_units[0]: must not contain control characters"),
    ({"service_pids": ["abc"]}, "service_pids"),
    ({"bogus": 1}, "Unsupported parameters"),
])
def test_argument_errors(monkeypatch, capsys, args, message):
    rc, out = run(monkeypatch, capsys, args, FakeNvml(make_state(1)))
    assert rc == 1 and message in out["msg"]


def test_missing_binding(monkeypatch, capsys):
    monkeypatch.setattr(gpu_memory_info, "PYNVML_IMPORT_ERROR", "Traceback: No module named 'pynvml'")
    rc, out = run(monkeypatch, capsys, {}, None)
    assert rc == 1
    assert "nvidia-ml-py" in out["msg"] and "Failed to import the required Python library" in out["msg"]

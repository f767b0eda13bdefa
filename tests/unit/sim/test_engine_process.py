# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The simulated engine as a process, on a private fake NVML state file (no test host)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import parse_engine_log
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_metrics import parse_metrics

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "sim" / "engine" / "vllm"
sys.path.insert(0, str(ROOT / "tests" / "fake_nvml"))
import nvml_state  # noqa: E402  pylint: disable=wrong-import-position,import-error

GiB = 1 << 30
MiB = 1 << 20
H200 = 150754820096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def host(tmp_path: Path):
    return make_host(tmp_path)


def make_host(tmp_path: Path) -> tuple[Path, dict]:
    """A fake host: state with 2 H200 (a co-tenant on GPU 1), sim.json, the 8B model."""
    state = nvml_state.new_state()
    for i in range(2):
        state["gpus"].append(nvml_state.make_gpu(i, H200, reserved=566231040))
    nvml_state.add_process(state, gpu=1, pid=61002, used=int(1.5 * GiB), name="dcgm-exporter", pidns="other")
    nvml_state.save(tmp_path / "state", state)
    (tmp_path / "sim.json").write_text(json.dumps({"boot_delay_s": 0.2, "token_delay_s": 0.002}))
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(ROOT / "sim" / "models" / "llama-3.1-8b-instruct" / "config.json", model / "config.json")
    env = dict(os.environ, FAKE_NVML_STATE=str(tmp_path / "state"), CUDA_VISIBLE_DEVICES="0,1")
    return tmp_path, env


def start(tmp_path: Path, env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ENGINE), "serve", str(tmp_path / "model"), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_health(port: int, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("engine did not become healthy")


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read().decode()


def post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_manual_boot_registers_ranks_serves_and_cleans_up(host) -> None:
    tmp_path, env = host
    port = free_port()
    budget = 20 * GiB
    proc = start(tmp_path, env, "--port", str(port), "--host", "127.0.0.1", "-tp", "2", "--max-model-len", "8192",
                 "--kv-cache-memory-bytes", str(budget), "--served-model-name", "llama")
    try:
        wait_health(port, proc)
        state = nvml_state.load(tmp_path / "state")
        mine = [p for p in state["procs"] if p["name"].startswith("VLLM::")]
        assert sorted(p["gpu"] for p in mine) == [0, 1]
        assert len({p["pid"] for p in mine}) == 2               # one process per rank
        for p in mine:
            assert os.path.exists(f"/proc/{p['pid']}")
            assert p["used"] > budget                          # KV + weights + context + ...
        models = json.loads(get(port, "/v1/models"))
        assert models["data"][0]["id"] == "llama" and models["data"][0]["max_model_len"] == 8192
        out = post(port, {"model": "llama", "prompt": "one two three four", "max_tokens": 7})
        assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
        assert out["choices"][0]["finish_reason"] == "length"
        m = parse_metrics(get(port, "/metrics"))
        assert m.kv_cache_memory_bytes == budget
        assert m.request_success["length"] == 1
        assert m.generation_tokens_total == 7
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=10)[0]
    assert proc.returncode == 0
    state = nvml_state.load(tmp_path / "state")
    assert [p["pid"] for p in state["procs"]] == [61002]     # only the co-tenant is left
    log = parse_engine_log(output, tp_size=2)
    assert log.errors == []
    assert log.ranks[0].manual and log.ranks[1].manual
    # vLLM's logged free is NVML's free minus the CUDA context; the co-tenant shows on rank 1
    gpu0 = H200 - 566231040 - 650969088                   # the engine's default CUDA context cost
    assert log.ranks[0].initial_free_bytes == pytest.approx(gpu0, abs=0.006 * GiB)
    assert log.ranks[1].initial_free_bytes == pytest.approx(gpu0 - 1.5 * GiB, abs=0.006 * GiB)
    assert log.capacity.tokens == m.kv_cache_size_tokens
    assert log.server_started


def test_profiled_boot_suggestions_reflect_the_co_tenant(host) -> None:
    tmp_path, env = host
    port = free_port()
    proc = start(tmp_path, env, "--port", str(port), "--host", "127.0.0.1", "-tp", "2", "--max-model-len", "8192")
    try:
        wait_health(port, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=10)[0]
    log = parse_engine_log(output, tp_size=2)
    r0, r1 = log.ranks[0], log.ranks[1]
    assert r0.profiled and r1.profiled
    assert r0.suggested_kv_bytes_fit == r1.suggested_kv_bytes_fit          # same requested share
    assert r0.suggested_kv_bytes_full - r1.suggested_kv_bytes_full == int(1.5 * GiB)


@pytest.mark.parametrize(("args", "kind"), [
    (["--kv-cache-memory-bytes", str(20 * GiB), "--gpu-memory-utilization", "0.995"], "startup_memory_check"),
    (["--kv-cache-memory-bytes", str(64 * MiB), "--max-model-len", "131072"], "request_does_not_fit"),
    (["--kv-cache-memory-bytes", str(135 * GiB), "--gpu-memory-utilization", "0.5"], "cuda_oom"),
])
def test_boot_failures_exit_1_and_leave_no_process(host, args, kind) -> None:
    tmp_path, env = host
    proc = start(tmp_path, env, "--port", str(free_port()), "-tp", "2", *args)
    output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 1
    assert kind in parse_engine_log(output, tp_size=2).error_kinds()
    assert [p["pid"] for p in nvml_state.load(tmp_path / "state")["procs"]] == [61002]


def test_fail_next_boot_is_consumed_once(host) -> None:
    tmp_path, env = host
    cfg = json.loads((tmp_path / "sim.json").read_text())
    cfg["fail_next_boot"] = {"kind": "oom"}
    (tmp_path / "sim.json").write_text(json.dumps(cfg))
    port = free_port()
    argv = ["--port", str(port), "--host", "127.0.0.1", "-tp", "2", "--kv-cache-memory-bytes", str(20 * GiB)]
    first = start(tmp_path, env, *argv)
    assert first.communicate(timeout=30)[0] and first.returncode == 1
    assert json.loads((tmp_path / "sim.json").read_text())["fail_next_boot"] is None
    second = start(tmp_path, env, *argv)
    try:
        wait_health(port, second)
    finally:
        second.send_signal(signal.SIGTERM)
        second.communicate(timeout=10)


def test_slow_next_boot_grows_memory_while_loading_and_is_consumed_once(host) -> None:
    """slow_next_boot: the next boot takes its boot_delay_s and its ranks' memory grows in load_steps
    increments while the weights load (what a re-probe right after a restart sees); then boots are quick again."""
    tmp_path, env = host
    cfg = json.loads((tmp_path / "sim.json").read_text())
    cfg["slow_next_boot"] = {"boot_delay_s": 4.0, "load_steps": 8}
    (tmp_path / "sim.json").write_text(json.dumps(cfg))
    port = free_port()
    argv = ["--port", str(port), "--host", "127.0.0.1", "-tp", "2", "--kv-cache-memory-bytes", str(20 * GiB)]
    started = time.monotonic()
    proc = start(tmp_path, env, *argv)
    seen: list[int] = []
    try:
        while time.monotonic() - started < 20:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            used = sum(p["used"] for p in nvml_state.load(tmp_path / "state")["procs"] if p["gpu"] == 0 and p["name"].startswith("VLLM::"))
            if used and (not seen or used != seen[-1]):
                seen.append(used)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.02)
        boot_seconds = time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    assert boot_seconds >= 4.0 * 0.9, boot_seconds
    # the context, then the weights in several increments, then activations, KV and graphs: growing, never shrinking
    # below what the weights took
    assert len(seen) >= 6, seen
    weights_stage = seen[1:-3]
    assert weights_stage == sorted(weights_stage) and len(set(weights_stage)) >= 4, seen
    assert json.loads((tmp_path / "sim.json").read_text())["slow_next_boot"] is None
    quick = start(tmp_path, env, *argv)
    try:
        started = time.monotonic()
        wait_health(port, quick)
        assert time.monotonic() - started < 3.5
    finally:
        quick.send_signal(signal.SIGTERM)
        quick.communicate(timeout=10)


SIGTERM_UNDER_THE_LOCK = """
import os, signal, sys, time
sys.path.insert(0, {conftest_dir!r})
from conftest import load_engine
engine = load_engine()
serve = engine.Serve(None)
signal.signal(signal.SIGTERM, serve._on_signal)
serve.registry.set(0, 0, os.getpid(), "VLLM::EngineCore", 500 * 1024 * 1024)
with engine.locked(serve.registry.path):
    # systemd's stop lands while a registry update holds the state lock
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)
    print("released", flush=True)
time.sleep(30)
print("not stopped", flush=True)
"""


def test_a_sigterm_while_the_state_lock_is_held_still_stops_the_engine_and_frees_its_memory(host) -> None:
    """The handler takes the state lock to drop the engine's entries: run inside a registry
    update, it waited for ever on this process's own flock, systemd killed the engine at
    TimeoutStopSec and its memory stayed in the fake NVML state for the next boot's gate."""
    tmp_path, env = host
    script = SIGTERM_UNDER_THE_LOCK.format(conftest_dir=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=20,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # the shutdown ran after the lock was released, not inside it, and not 30 s later
    lines = done.stdout.splitlines()
    assert lines[0] == "released" and "not stopped" not in lines, done.stdout + done.stderr
    assert "Shutting down FastAPI HTTP server." in lines[1], done.stdout + done.stderr
    assert not [p for p in nvml_state.load(tmp_path / "state")["procs"] if p["name"].startswith("VLLM::")]

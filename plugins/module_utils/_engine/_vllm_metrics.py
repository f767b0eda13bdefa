# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Parser for vLLM's Prometheus ``/metrics`` text.

Plain Python, no Ansible import. Uses ``prometheus_client``'s text parser
when it is importable (every vLLM environment has it) and otherwise a small
built-in parser for the exposition format; both produce the same flat list
of samples, so the figures derived from them are identical.

Every figure is aggregated over the label sets vLLM adds per engine
(``model_name``, ``engine``): counters, gauges and histograms are summed,
except ``kv_cache_usage`` (a fraction per engine), which is the maximum.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Tuple

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

try:  # pragma: no cover - exercised through both code paths in the tests
    from prometheus_client.parser import text_string_to_metric_families as _prom_text_parser

    # declared here, Optional: None below when prometheus_client is not importable
    _prom_parse: Callable[[str], Iterable[Metric]] | None = _prom_text_parser
    HAS_PROMETHEUS_CLIENT = True
except ImportError:  # pragma: no cover
    _prom_parse = None
    HAS_PROMETHEUS_CLIENT = False

__all__ = [
    "EngineMetrics",
    "Histogram",
    "MetricsParseError",
    "Sample",
    "histogram_quantile",
    "metrics_from_samples",
    "parse_metrics",
    "parse_samples",
]

# typing aliases: evaluated at run time, target hosts may run Python < 3.9
Sample = Tuple[str, Dict[str, str], float]
Samples = List[Sample]

CACHE_CONFIG = "vllm:cache_config_info"
PREEMPTIONS = "vllm:num_preemptions"
REQUEST_SUCCESS = "vllm:request_success"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
TTFT = "vllm:time_to_first_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
# time per output token: its name since vLLM 0.10, and the older one
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format."""


@dataclass
class Histogram:
    """A cumulative histogram: ``buckets`` is ``[(le, cumulative_count), ...]``
    sorted by ``le`` and ending with ``+Inf``."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    count: float = 0.0
    sum: float = 0.0


@dataclass
class EngineMetrics:
    """Figures from one ``/metrics`` scrape (``None`` when not exposed)."""

    cache_config: dict[str, str] = field(default_factory=dict)
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_size_tokens: int | None = None
    kv_cache_max_concurrency: float | None = None
    gpu_memory_utilization: float | None = None
    cache_dtype: str | None = None
    preemptions_total: float | None = None
    request_success: dict[str, float] = field(default_factory=dict)
    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    ttft: Histogram | None = None
    e2e: Histogram | None = None
    itl: Histogram | None = None
    engines: int = 0
    # each engine's KV cache tokens, when several engines report (data parallel): a plan's figure is per engine
    engine_kv_cache_tokens: list[int] = field(default_factory=list)
    recognised: bool = False
    parser: str = ""

    @property
    def requests_succeeded(self) -> float:
        return float(sum(self.request_success.values()))


# --------------------------------------------------------------------------- samples

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LINE = re.compile(rf"^\s*({_NAME})\s*(?:\{{(.*)\}})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], value)


def _builtin_samples(text: str) -> list[Sample]:
    out: list[Sample] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise MetricsParseError(f"line {lineno}: not a Prometheus sample: {raw[:120]!r}")
        name, labels_text, value_text = m.groups()
        labels: dict[str, str] = {}
        if labels_text:
            pos = 0
            while pos < len(labels_text):
                lm = _LABEL.match(labels_text, pos)
                if not lm:
                    raise MetricsParseError(f"line {lineno}: bad labels: {labels_text[:120]!r}")
                labels[lm.group(1)] = _unescape(lm.group(2))
                pos = lm.end()
        try:
            value = float(value_text)
        except ValueError:
            raise MetricsParseError(f"line {lineno}: bad value {value_text!r}") from None
        out.append((name, labels, value))
    return out


def _prometheus_samples(text: str) -> list[Sample]:
    if _prom_parse is None:
        raise MetricsParseError("prometheus_client is not importable")
    out: list[Sample] = []
    try:
        for family in _prom_parse(text):
            for s in family.samples:
                out.append((s.name, dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"not Prometheus text: {exc}") from None
    return out


def parse_samples(text: str, use_prometheus_client: bool | None = None) -> tuple[list[Sample], str]:
    """Return ``(samples, parser_name)``. ``use_prometheus_client=None`` picks
    ``prometheus_client`` when importable."""
    if use_prometheus_client is None:
        use_prometheus_client = HAS_PROMETHEUS_CLIENT
    if use_prometheus_client:
        if not HAS_PROMETHEUS_CLIENT:
            raise MetricsParseError("prometheus_client is not importable")
        return _prometheus_samples(text), "prometheus_client"
    return _builtin_samples(text), "builtin"


# --------------------------------------------------------------------------- figures


def _opt_int(value: str | None) -> int | None:
    if value is None or value in ("", "None", "none", "null"):
        return None
    try:
        return int(value)
    except ValueError:
        try:
            f = float(value)
        except ValueError:
            return None
        return int(f) if f.is_integer() else None


def _opt_float(value: str | None) -> float | None:
    if value is None or value in ("", "None", "none", "null"):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _counter(samples: list[Sample], base: str) -> list[Sample]:
    """Counter samples whether exposed as ``base_total`` or ``base``."""
    total = [s for s in samples if s[0] == base + "_total"]
    return total or [s for s in samples if s[0] == base]


def _sum(samples: list[Sample]) -> float | None:
    return float(sum(s[2] for s in samples)) if samples else None


def _histogram(samples: list[Sample], base: str) -> Histogram | None:
    buckets: dict[float, float] = {}
    count = [s for s in samples if s[0] == base + "_count"]
    total = [s for s in samples if s[0] == base + "_sum"]
    for name, labels, value in samples:
        if name == base + "_bucket" and "le" in labels:
            le = float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + value
    if not buckets and not count:
        return None
    return Histogram(
        buckets=sorted(buckets.items()),
        count=float(sum(s[2] for s in count)),
        sum=float(sum(s[2] for s in total)),
    )


def parse_metrics(text: str, use_prometheus_client: bool | None = None) -> EngineMetrics:
    """Parse a ``/metrics`` scrape into :class:`EngineMetrics`.

    Raises :class:`MetricsParseError` when the text is not Prometheus text.
    """
    samples, parser = parse_samples(text, use_prometheus_client)
    return metrics_from_samples(samples, parser)


def metrics_from_samples(samples: list[Sample], parser: str = "") -> EngineMetrics:
    """The figures of one engine's samples, however they were read: a ``/metrics`` scrape
    (:func:`parse_metrics`) or a Prometheus server's instant query of the same series."""
    m = EngineMetrics(parser=parser)
    vllm = [s for s in samples if s[0].startswith("vllm:")]
    m.recognised = bool(vllm)

    cache = [s for s in samples if s[0] == CACHE_CONFIG]
    if cache:
        labels = dict(cache[0][1])
        m.cache_config = labels
        m.engines = len({(s[1].get("engine"), s[1].get("model_name")) for s in cache})
        m.num_gpu_blocks = _opt_int(labels.get("num_gpu_blocks"))
        m.block_size = _opt_int(labels.get("block_size"))
        m.kv_cache_memory_bytes = _opt_int(labels.get("kv_cache_memory_bytes"))
        m.kv_cache_size_tokens = _opt_int(labels.get("kv_cache_size_tokens"))
        m.kv_cache_max_concurrency = _opt_float(labels.get("kv_cache_max_concurrency"))
        m.gpu_memory_utilization = _opt_float(labels.get("gpu_memory_utilization"))
        dtype = labels.get("cache_dtype")
        m.cache_dtype = None if dtype in (None, "", "None") else dtype
        if len(cache) > 1:
            # Several engines (data parallel): capacity adds up.
            blocks = [_opt_int(s[1].get("num_gpu_blocks")) for s in cache]
            tokens = [_opt_int(s[1].get("kv_cache_size_tokens")) for s in cache]
            if all(b is not None for b in blocks):
                m.num_gpu_blocks = sum(b for b in blocks if b is not None)
            if all(t is not None for t in tokens):
                m.kv_cache_size_tokens = sum(t for t in tokens if t is not None)
                m.engine_kv_cache_tokens = [t for t in tokens if t is not None]

    m.preemptions_total = _sum(_counter(samples, PREEMPTIONS))
    for _name, labels, value in _counter(samples, REQUEST_SUCCESS):
        reason = labels.get("finished_reason", "")
        m.request_success[reason] = m.request_success.get(reason, 0.0) + value
    m.running = _sum([s for s in samples if s[0] == RUNNING])
    m.waiting = _sum([s for s in samples if s[0] == WAITING])
    for usage_name in KV_USAGE:
        usage = [s[2] for s in samples if s[0] == usage_name]
        if usage:
            m.kv_cache_usage = float(max(usage))
            break
    m.prompt_tokens_total = _sum(_counter(samples, PROMPT_TOKENS))
    m.generation_tokens_total = _sum(_counter(samples, GENERATION_TOKENS))
    m.ttft = _histogram(samples, TTFT)
    m.e2e = _histogram(samples, E2E)
    for itl_name in ITL:
        m.itl = _histogram(samples, itl_name)
        if m.itl is not None:
            break
    return m


def histogram_quantile(h: Histogram | None, q: float) -> float | None:
    """Prometheus-style quantile estimate (linear inside the bucket).

    Returns ``None`` for an empty histogram; when the quantile falls into the
    ``+Inf`` bucket, returns the highest finite bucket bound.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    if h is None or not h.buckets:
        return None
    total = h.buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in h.buckets:
        if count >= rank and count > prev_count:
            if math.isinf(le):
                return prev_le
            lower = prev_le if prev_le < le else 0.0
            return lower + (le - lower) * (rank - prev_count) / (count - prev_count)
        if not math.isinf(le):
            prev_le = le
        prev_count = count
    return prev_le

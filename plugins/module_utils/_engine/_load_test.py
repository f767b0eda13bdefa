# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Short load test against a vLLM OpenAI-compatible server (stdlib only).

Streams ``/v1/completions`` so the time to first token is measured on the
client, sends prompts whose token count is controlled through the engine's
own ``/tokenize`` endpoint, and reads ``usage`` from the final stream chunk.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import typing as t
from dataclasses import dataclass, field

PROMPT_WORD = "hello"


@dataclass
class LoadSpec:
    requests: int = 16
    concurrency: int = 4
    prompt_tokens: int = 32
    max_tokens: int = 16
    warmup: int = 2
    request_timeout: float = 120.0

    def validate(self) -> None:
        for name in ("requests", "concurrency", "prompt_tokens", "max_tokens", "warmup"):
            value = getattr(self, name)
            minimum = 0 if name in ("requests", "warmup") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"load.{name} must be an integer >= {minimum}, got {value!r}")
        if not math.isfinite(self.request_timeout) or self.request_timeout <= 0:
            raise ValueError(f"load.request_timeout must be a positive number of seconds, got {self.request_timeout!r}")

    def shape(self) -> dict[str, int]:
        return {
            "warmup": self.warmup,
            "requests": self.requests,
            "concurrency": self.concurrency,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
        }


@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str = ""


@dataclass
class LoadResult:
    spec: dict[str, int]
    completed: int = 0
    failed: int = 0
    seconds: float = 0.0
    warmup_seconds: float = 0.0
    warmup_ok: bool = True
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    e2e_p50: float | None = None
    e2e_p95: float | None = None
    throughput_rps: float | None = None
    output_tokens_per_second: float | None = None
    prompt_tokens_sent: int | None = None
    prompt_tokens_seen: int | None = None
    completion_tokens: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, t.Any]:
        return {
            "requests": self.spec.get("requests"),
            "concurrency": self.spec.get("concurrency"),
            "prompt_tokens": self.spec.get("prompt_tokens"),
            "max_tokens": self.spec.get("max_tokens"),
            "completed": self.completed,
            "failed": self.failed,
            "seconds": round(self.seconds, 3),
            "warmup": self.spec.get("warmup"),
            "warmup_ok": self.warmup_ok,
            "warmup_seconds": round(self.warmup_seconds, 3),
            "ttft_p50": _r(self.ttft_p50),
            "ttft_p95": _r(self.ttft_p95),
            "e2e_p50": _r(self.e2e_p50),
            "e2e_p95": _r(self.e2e_p95),
            "throughput_rps": _r(self.throughput_rps),
            "output_tokens_per_second": _r(self.output_tokens_per_second),
            "prompt_tokens_seen": self.prompt_tokens_seen,
            "completion_tokens": self.completion_tokens,
            "errors": self.errors[:10],
        }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def percentile(values: t.Sequence[float], pct: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * pct / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def _post_json(
    host: str, port: int, path: str, payload: dict[str, t.Any], timeout: float,
    headers: dict[str, str] | None = None,
) -> tuple[int, t.Any]:
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        body = json.dumps(payload).encode()
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        raw = response.read().decode("utf-8", "replace")
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw
    finally:
        conn.close()


def tokenize_count(
    host: str, port: int, model: str, prompt: str, timeout: float = 30.0,
    headers: dict[str, str] | None = None,
) -> int | None:
    """Token count of ``prompt`` by the engine's ``/tokenize``; ``None`` if unavailable."""
    try:
        status, data = _post_json(host, port, "/tokenize", {"model": model, "prompt": prompt}, timeout, headers)
    except (OSError, http.client.HTTPException):
        return None
    if status != 200 or not isinstance(data, dict):
        return None
    if isinstance(data.get("count"), int):
        return int(data["count"])
    if isinstance(data.get("tokens"), list):
        return len(data["tokens"])
    return None


def build_prompt(
    target_tokens: int,
    count: t.Callable[[str], int | None],
    word: str = PROMPT_WORD,
) -> tuple[str, int | None]:
    """A prompt of ``target_tokens`` tokens made of a repeated word.

    ``count`` measures a prompt (``/tokenize``). The per-word cost and the fixed
    cost (BOS...) are measured from 1 and 2 words, then the repeat count is
    solved and checked. Without a counter, one word per token is assumed and
    the measured count is ``None``.
    """
    one = count(word)
    two = count(f"{word} {word}")
    if one is None or two is None or two - one <= 0:
        return " ".join([word] * max(1, target_tokens)), None
    per_word = two - one
    fixed = one - per_word
    repeats = max(1, (target_tokens - fixed) // per_word)
    prompt = " ".join([word] * repeats)
    measured = count(prompt)
    # Adjust by single words if the tokenizer merged or split differently.
    for _attempt in range(4):
        if measured is None or measured == target_tokens:
            break
        repeats = max(1, repeats + (1 if measured < target_tokens else -1))
        prompt = " ".join([word] * repeats)
        measured = count(prompt)
    return prompt, measured


def stream_completion(
    host: str,
    port: int,
    model: str,
    prompt: str,
    max_tokens: int,
    timeout: float,
    clock: t.Callable[[], float] = time.monotonic,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """One streamed ``/v1/completions`` request; TTFT = first chunk carrying text."""
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = clock()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    ttft: float | None = None
    usage: dict[str, t.Any] | None = None
    text_chunks = 0
    try:
        conn.request(
            "POST", "/v1/completions", body=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream", **(headers or {})},
        )
        response = conn.getresponse()
        if response.status != 200:
            detail = response.read(2000).decode("utf-8", "replace").strip()
            return RequestResult(False, error=f"HTTP {response.status}: {detail[:300]}")
        done = False
        while True:
            line = response.readline()
            if not line:
                break
            text = line.decode("utf-8", "replace").strip()
            if not text.startswith("data:"):
                continue
            data = text[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                return RequestResult(False, error=f"malformed stream chunk: {data[:200]}")
            if isinstance(chunk, dict) and chunk.get("error"):
                err = chunk["error"]
                msg = err.get("message") if isinstance(err, dict) else err
                return RequestResult(False, error=f"stream error: {str(msg)[:300]}")
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    text_chunks += 1
                    if ttft is None:
                        ttft = clock() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
        if not done:
            return RequestResult(False, ttft=ttft, error="stream ended without [DONE] (connection closed)")
    except (OSError, http.client.HTTPException) as exc:
        return RequestResult(False, ttft=ttft, error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()
    e2e = clock() - start
    if ttft is None:
        return RequestResult(False, e2e=e2e, error="no token was streamed")
    return RequestResult(
        True, ttft=ttft, e2e=e2e,
        prompt_tokens=(usage or {}).get("prompt_tokens"),
        completion_tokens=(usage or {}).get("completion_tokens", text_chunks),
    )


def run_load_test(
    host: str,
    port: int,
    model: str,
    spec: LoadSpec,
    *,
    on_start: t.Callable[[], None] | None = None,
    request: t.Callable[[str, int, float], RequestResult] | None = None,
    headers: dict[str, str] | None = None,
) -> LoadResult:
    """Warm up, then send ``spec.requests`` streamed requests from ``spec.concurrency`` threads."""
    spec.validate()
    result = LoadResult(spec=spec.shape())
    if spec.requests == 0:
        return result

    def counter(text: str) -> int | None:
        return tokenize_count(host, port, model, text, timeout=spec.request_timeout, headers=headers)

    def default_request(prompt: str, max_tokens: int, timeout: float) -> RequestResult:
        return stream_completion(host, port, model, prompt, max_tokens, timeout, headers=headers)

    send = request or default_request
    prompt, measured = build_prompt(spec.prompt_tokens, counter)
    result.prompt_tokens_sent = measured

    warm_start = time.monotonic()
    for _warm in range(spec.warmup):
        warm = send(prompt, spec.max_tokens, spec.request_timeout)
        if not warm.ok:
            result.warmup_ok = False
            result.errors.append(f"warm-up: {warm.error}")
            break
    result.warmup_seconds = time.monotonic() - warm_start

    results: list[RequestResult] = []
    lock = threading.Lock()
    next_index = [0]

    def worker() -> None:
        while True:
            with lock:
                if next_index[0] >= spec.requests:
                    return
                next_index[0] += 1
            outcome = send(prompt, spec.max_tokens, spec.request_timeout)
            with lock:
                results.append(outcome)

    if on_start is not None:
        on_start()
    start = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _slot in range(min(spec.concurrency, spec.requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.seconds = time.monotonic() - start

    good = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    result.completed = len(good)
    result.failed = len(bad)
    for r in bad:
        if r.error not in result.errors:
            result.errors.append(r.error)
    ttfts = [r.ttft for r in good if r.ttft is not None]
    e2es = [r.e2e for r in good if r.e2e is not None]
    result.ttft_p50 = percentile(ttfts, 50)
    result.ttft_p95 = percentile(ttfts, 95)
    result.e2e_p50 = percentile(e2es, 50)
    result.e2e_p95 = percentile(e2es, 95)
    result.completion_tokens = sum(int(r.completion_tokens or 0) for r in good)
    seen = [r.prompt_tokens for r in good if isinstance(r.prompt_tokens, int)]
    result.prompt_tokens_seen = max(seen) if seen else None
    if result.seconds > 0:
        result.throughput_rps = len(good) / result.seconds
        result.output_tokens_per_second = result.completion_tokens / result.seconds
    return result

# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""KV-cache capacity arithmetic shared by the planner and the boot gate.

The planner (``_plan.py``, on the controller) and the boot gate (``_boot_gate.py``,
installed on every GPU host by ``vllm_service``) must turn bytes into blocks, blocks
into tokens and free memory into a startup utilization in exactly the same way: a
gate that shrinks a budget and then counts its tokens differently from the planner
would start an engine whose capacity nobody planned. This module is that one home.

It imports nothing but the standard library (no Ansible, no pynvml, no other
module_utils), so the gate can carry it to the host and the controller can import it.

Capacity sources (the planner's ``capacity_source``):

* ``geometry``: one full-attention (or MLA) group, ``tokens = blocks * block_size``;
* ``layout``: KV-cache groups as vLLM groups layers (sliding window, chunked local,
  hybrids), ``tokens = int(blocks / request_blocks * max_model_len)``, vLLM's own
  definition (its max concurrency times ``max_model_len``);
* ``engine``: a layout known only from the profiled canary's figures: tokens as for
  ``layout``, blocks from the engine's blocks per byte (a lower bound).
"""

from __future__ import annotations

import math
import typing as t

# bytes of one value of each dtype name vLLM accepts for the model, the KV cache and state caches
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "int8": 1,
}

SOURCES = ("geometry", "layout", "engine")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)


def floor_utilization(free_bytes: int, total_bytes: int) -> float:
    """Largest 4-decimal ``u`` with ``ceil(total * u) <= free`` (vLLM's startup check passes)."""
    if total_bytes <= 0 or free_bytes <= 0:
        return 0.0
    k = min(10000, (free_bytes * 10000) // total_bytes)
    while k > 0 and math.ceil(total_bytes * (k / 10000)) > free_bytes:
        k -= 1
    return k / 10000


def profiled_utilization_cap(budget_bytes: int, vllm_free_ref: int, kv_full_ref: int, total_bytes: int) -> float:
    """Highest ``--gpu-memory-utilization`` at which vLLM's own profiling sizes a KV cache of at
    most ``budget_bytes`` on a rank.

    A profiled boot gets ``ceil(total * u) - non_kv`` bytes of KV cache, where ``non_kv`` is
    what the engine holds besides the cache (weights, activation peak, non-torch memory, vLLM's
    redundancy buffer). The profiled reference canary shows ``non_kv`` per rank: its "fully
    utilize" suggestion is ``vllm_free - non_kv``. So ``u <= floor4((budget + vllm_free_ref -
    kv_full_ref) / total)`` keeps a profiled start at or below the planned budget.
    """
    return floor_utilization(budget_bytes + vllm_free_ref - kv_full_ref, total_bytes)


def blocks_for_bytes(kv_bytes: int, bytes_per_block: int | None = None,
                     engine: tuple[int, int] | None = None) -> int:
    """Whole KV blocks ``kv_bytes`` holds per rank.

    ``bytes_per_block``: the page of every KV-cache group (vLLM's rounding: whole pages).
    ``engine``: ``(blocks, kv_bytes)`` the profiled engine made, when the page size is not
    known; one block costs at most ``kv_bytes / blocks``, so this is a lower bound.
    """
    if kv_bytes <= 0:
        return 0
    if bytes_per_block:
        return kv_bytes // bytes_per_block
    if engine is None or engine[0] <= 0 or engine[1] <= 0:
        raise ValueError("blocks_for_bytes needs bytes_per_block or the engine's (blocks, kv_bytes)")
    return kv_bytes * engine[0] // engine[1]


def full_attention_request_blocks(tokens: int, block_size: int) -> int:
    """Blocks one request of ``tokens`` holds in one full-attention group."""
    return cdiv(tokens, block_size)


def one_request_blocks(request_blocks: int) -> int:
    """Blocks vLLM needs to admit one request: its own blocks plus the null block."""
    return request_blocks + 1


def tokens_for_blocks(num_blocks: int, source: str, block_size: int, request_blocks: int | None = None,
                      max_model_len: int | None = None) -> int | None:
    """KV-cache tokens of ``num_blocks`` as vLLM reports them (None when a multi-group layout
    has no ``max_model_len`` or per-request blocks to count them with)."""
    if source == "geometry":
        return max(0, num_blocks) * block_size
    if not max_model_len or not request_blocks:
        return None
    return int(max(0, num_blocks) / request_blocks * max_model_len)


def capacity_record(source: str | None, block_size: int | None, bytes_per_block: int | None,
                    request_blocks: int | None, max_model_len: int | None,
                    engine: tuple[int, int] | None = None) -> dict[str, t.Any] | None:
    """What a plan file carries so that a host computes the planner's blocks and tokens.

    The keys are those of the plan file's ``capacity`` object; None when the plan has no
    capacity model."""
    if source not in SOURCES or not block_size:
        return None
    return {
        "source": source,
        "block_size": block_size,
        "bytes_per_block": bytes_per_block,
        "blocks_per_request": request_blocks,
        "max_model_len": max_model_len,
        "engine_num_blocks": engine[0] if engine else None,
        "engine_kv_bytes": engine[1] if engine else None,
    }

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The reference profile ``kv_plan`` reads, built from a profiled canary's result.

Plain Python, no Ansible import. Per rank: NVML free memory just before the
boot (``free_bytes``), vLLM's "fit into requested memory" suggestion
(``kv_bytes``, GPU builds) and the KV memory the engine actually allocated
(``kv_bytes_in_use``: the log's "Current kv cache memory in use", or the CPU
build's "Auto set ... GiB for KV cache", which prints no suggestion). Engine
figures kept for capacity: blocks, block size, tokens, max concurrency (the
``/metrics`` figure, unrounded), ``max_model_len`` and, when ``/metrics`` gives
it, the exact KV bytes (``engine_kv_bytes``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["ReferenceError", "reference_from_canary"]

_DROPPED = ("log_tail", "invocation", "changed", "failed", "msg")


class ReferenceError(ValueError):
    """The canary result or the pre-boot probe cannot make a reference (message names the field)."""


def _rank_gpu(preboot: Sequence[Mapping[str, Any]], gpus: Sequence[Any], rank: int) -> Mapping[str, Any]:
    if rank >= len(gpus):
        raise ReferenceError(f"canary rank {rank} has no GPU in the instance's gpus {list(gpus)}")
    index = int(gpus[rank])
    for gpu in preboot:
        if int(gpu.get("index", -1)) == index:
            return gpu
    raise ReferenceError(f"canary rank {rank}: GPU {index} is not in the pre-boot probe")


def reference_from_canary(
    run: Mapping[str, Any],
    preboot: Sequence[Mapping[str, Any]],
    gpus: Sequence[Any],
    *,
    config: Mapping[str, Any] | None = None,
    serve_args: Mapping[str, Any] | None = None,
    canary: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The reference profile of one profiled canary run (``vllm_canary``'s result)."""
    if not isinstance(run, Mapping) or not isinstance(run.get("ranks"), list) or not run["ranks"]:
        raise ReferenceError("canary result: ranks missing (was the canary run in profiled mode and did it boot?)")
    if not preboot:
        raise ReferenceError("pre-boot probe: no GPUs (gpu_memory_info's gpus)")
    serve_args = dict(serve_args or {})
    ranks: list[dict[str, Any]] = []
    vllm_free: dict[int, int] = {}
    for pos, entry in enumerate(run["ranks"]):
        rank = int(entry.get("rank", pos))
        gpu = _rank_gpu(preboot, gpus, rank)
        in_use = entry.get("current_kv_bytes")
        if in_use is None:
            in_use = entry.get("auto_kv_bytes")
        item: dict[str, Any] = {
            "rank": rank,
            "free_bytes": int(gpu["free_bytes"]),
            "kv_bytes": entry.get("suggested_kv_bytes_fit"),
            "kv_bytes_full": entry.get("suggested_kv_bytes_full"),
        }
        if in_use is not None:
            item["kv_bytes_in_use"] = int(in_use)
        ranks.append(item)
        if entry.get("initial_free_bytes") is not None:
            vllm_free[rank] = int(entry["initial_free_bytes"])
    max_model_len = run.get("max_model_len") or serve_args.get("max_model_len")
    info = dict(canary or {})
    info.update(
        startup_seconds=run.get("startup_seconds"),
        max_concurrency=run.get("max_concurrency"),
        load=run.get("load"),
        preemptions=run.get("preemptions"),
        verdict=run.get("verdict"),
    )
    return {
        "ranks": ranks,
        "vllm_free_bytes": vllm_free,
        "total_bytes": preboot[0].get("total_bytes"),
        "gpu_name": preboot[0].get("name"),
        "block_size": run.get("block_size"),
        "num_blocks": run.get("num_blocks"),
        "kv_cache_tokens": run.get("kv_cache_tokens"),
        "max_concurrency": run.get("max_concurrency"),
        "max_model_len": int(max_model_len) if max_model_len is not None else None,
        "engine_kv_bytes": run.get("kv_cache_memory_bytes"),
        "geometry": {"config": dict(config), "serve_args": serve_args} if config is not None else None,
        "canary": info,
        "canary_result": {k: v for k, v in run.items() if k not in _DROPPED},
    }

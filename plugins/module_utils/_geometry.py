# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""KV-cache geometry: bytes per token and per block, blocks, tokens.

Plain Python, no Ansible import. Follows vLLM's arithmetic for a model
whose attention layers all form one full-attention KV-cache group:

* per-layer page = ``block_size * kv_heads_per_rank * (head_size + head_size_v) * dtype_bytes``;
* ``bytes_per_block = layers_on_rank * page``; ``num_blocks = kv_bytes // bytes_per_block``;
* tokens = ``num_blocks * block_size``; one block is the null block, so one
  request of ``L`` tokens needs ``(cdiv(L, block_size) + 1) * bytes_per_block``.

``kv_heads_per_rank = max(1, kv_heads // tensor_parallel_size)`` (heads are
replicated when TP exceeds the KV head count). MLA models (``kv_lora_rank``)
store one latent head of ``kv_lora_rank + qk_rope_head_dim`` values per layer,
K only, not divided by TP. Layers are split over pipeline stages like vLLM's
``get_pp_indices``; the stage with the most layers bounds the engine, so its
count is used.

Sliding-window, hybrid (Mamba/linear attention) and multi-group models do not
follow this formula: :class:`UnpredictableGeometry` is raised with the reason,
and capacity must come from the engine's own figures.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = [
    "GeometryError",
    "UnpredictableGeometry",
    "KVGeometry",
    "geometry_from_config",
    "load_config",
    "cdiv",
    "DTYPE_BYTES",
]


class GeometryError(ValueError):
    """The model config or serve arguments are missing or invalid."""


class UnpredictableGeometry(GeometryError):
    """The model's KV capacity cannot be predicted from its config (reason in the message)."""


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

_KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")

# config keys that mark a hybrid / state-space / multi-group model
_HYBRID_KEYS = (
    "layers_block_type",
    "hybrid_override_pattern",
    "attn_type_list",
    "layer_block_types",
    "mamba_d_state",
    "mamba_expand",
    "ssm_cfg",
    "linear_attn_config",
    "full_attn_layers",
    "cross_attention_layers",
)
_HYBRID_MODEL_TYPES = ("mamba", "jamba", "zamba", "falcon_h1", "nemotron_h", "qwen3_next", "granitemoehybrid", "bamba", "minimax", "plamo2", "lfm2")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)


@dataclass(frozen=True)
class KVGeometry:
    """KV geometry of one rank of an engine (the largest pipeline stage)."""

    bytes_per_token: int
    bytes_per_block: int
    block_size: int
    num_layers_on_rank: int
    kv_heads_per_rank: int
    head_size: int = 0
    head_size_v: int = 0
    dtype_bytes: int = 2
    kv_cache_dtype: str = "auto"
    mla: bool = False

    def num_blocks(self, kv_bytes: int) -> int:
        """Blocks vLLM makes from ``kv_bytes`` per rank (floor division, never negative)."""
        if kv_bytes <= 0:
            return 0
        return kv_bytes // self.bytes_per_block

    def tokens(self, num_blocks: int) -> int:
        """Tokens vLLM reports for ``num_blocks`` (one full-attention group)."""
        return max(0, num_blocks) * self.block_size

    def blocks_for_tokens(self, tokens: int) -> int:
        """Whole blocks holding ``tokens`` (no null block)."""
        return cdiv(max(0, tokens), self.block_size)

    def bytes_for_tokens(self, tokens: int) -> int:
        """Bytes of the whole blocks holding ``tokens`` (no null block)."""
        return self.blocks_for_tokens(tokens) * self.bytes_per_block

    def bytes_for_one_request(self, max_model_len: int) -> int:
        """Least KV bytes with which vLLM accepts ``max_model_len``: its blocks plus the null block."""
        return (cdiv(max_model_len, self.block_size) + 1) * self.bytes_per_block

    def max_concurrency(self, num_blocks: int, tokens_per_request: int) -> int:
        """Whole requests of ``tokens_per_request`` tokens that fit at once (null block excluded)."""
        per_request = cdiv(tokens_per_request, self.block_size)
        if per_request <= 0:
            return 0
        return max(0, num_blocks - 1) // per_request

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_block": self.bytes_per_block,
            "block_size": self.block_size,
            "num_layers_on_rank": self.num_layers_on_rank,
            "kv_heads_per_rank": self.kv_heads_per_rank,
            "head_size": self.head_size,
            "head_size_v": self.head_size_v,
            "dtype_bytes": self.dtype_bytes,
            "kv_cache_dtype": self.kv_cache_dtype,
            "mla": self.mla,
        }


def load_config(config: Mapping[str, Any] | str) -> dict[str, Any]:
    """Return a HF config as a dict; ``config`` may be a dict, a ``config.json`` path or its directory."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, str) or not config:
        raise GeometryError(f"model config: expected a dict or a path to config.json, got {config!r}")
    path = os.path.join(config, "config.json") if os.path.isdir(config) else config
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        raise GeometryError(f"model config {path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise GeometryError(f"model config {path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GeometryError(f"model config {path}: expected a JSON object")
    return data


def _positive_int(cfg: Mapping[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GeometryError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _serve_int(serve_args: Mapping[str, Any], key: str, default: int) -> int:
    value = serve_args.get(key, default)
    if value is None:
        return default
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GeometryError(f"serve_args.{key} must be a positive integer, got {value!r}")
    return value


def _check_predictable(cfg: Mapping[str, Any], top: Mapping[str, Any]) -> None:
    model_type = str(cfg.get("model_type") or top.get("model_type") or "").lower()
    for marker in _HYBRID_MODEL_TYPES:
        if marker in model_type:
            raise UnpredictableGeometry(f"model_type {model_type!r} is a hybrid/state-space model: KV capacity comes from the engine's own figures")
    for key in _HYBRID_KEYS:
        if cfg.get(key) not in (None, [], {}, ""):
            raise UnpredictableGeometry(f"config has {key}: a hybrid or multi-group model, KV capacity comes from the engine's own figures")
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and any(str(t) != "full_attention" for t in layer_types):
        kinds = sorted({str(t) for t in layer_types})
        raise UnpredictableGeometry(f"layer_types {kinds}: not every layer is full attention, KV capacity comes from the engine's own figures")
    if cfg.get("use_sliding_window") is False:
        return
    for key in ("sliding_window", "interleaved_sliding_window", "sliding_window_pattern"):
        value = cfg.get(key)
        if value not in (None, False, 0, [], ""):
            raise UnpredictableGeometry(f"{key}={value!r}: sliding-window attention, KV capacity comes from the engine's own figures")


def _pp_max_layers(num_layers: int, pp: int) -> int:
    if pp > num_layers:
        raise GeometryError(f"pipeline_parallel_size {pp} exceeds num_hidden_layers {num_layers}")
    per = num_layers // pp
    # vLLM's get_pp_indices gives the remainder to the stages before the last one
    return per + (1 if num_layers % pp else 0)


def _dtype_bytes(name: str, field: str) -> int:
    key = name.lower().replace("torch.", "")
    if key not in DTYPE_BYTES:
        raise GeometryError(f"{field}: unknown dtype {name!r} (known: {', '.join(sorted(DTYPE_BYTES))})")
    return DTYPE_BYTES[key]


def geometry_from_config(config: Mapping[str, Any] | str, serve_args: Mapping[str, Any] | None = None) -> KVGeometry:
    """KV geometry of one rank from a HF ``config.json`` and ``vllm serve`` arguments.

    ``serve_args`` keys used: ``dtype`` (default: the config's ``torch_dtype``/``dtype``;
    ``float32`` models run in ``bfloat16`` as vLLM's ``auto``), ``kv_cache_dtype``
    (``auto`` = model dtype, ``fp8*`` = 1 byte), ``tensor_parallel_size``,
    ``pipeline_parallel_size``, ``block_size`` (default 16, or 128 with ``device: cpu`` as
    vLLM's CPU engine).
    """
    serve_args = dict(serve_args or {})
    top = load_config(config)
    text = top.get("text_config")
    cfg: dict[str, Any] = dict(text) if isinstance(text, Mapping) else dict(top)
    where = "model config" + (" text_config" if isinstance(text, Mapping) else "")
    _check_predictable(cfg, top)

    tp = _serve_int(serve_args, "tensor_parallel_size", 1)
    pp = _serve_int(serve_args, "pipeline_parallel_size", 1)
    default_block = 128 if str(serve_args.get("device") or "").lower() == "cpu" else 16
    block_size = _serve_int(serve_args, "block_size", default_block)
    num_layers = _positive_int(cfg, "num_hidden_layers", where)
    layers_on_rank = _pp_max_layers(num_layers, pp)

    # dtype of the model, then of the cache
    dtype = serve_args.get("dtype") or "auto"
    if str(dtype).lower() == "auto":
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or top.get("torch_dtype") or top.get("dtype")
        if not dtype:
            raise GeometryError(f"{where} names no torch_dtype/dtype: set serve_args.dtype")
        if str(dtype).lower().replace("torch.", "") in ("float32", "float", "fp32"):
            dtype = "bfloat16"
    model_bytes = _dtype_bytes(str(dtype), "dtype")
    kv_dtype = str(serve_args.get("kv_cache_dtype") or "auto")
    dtype_bytes = model_bytes if kv_dtype.lower() == "auto" else _dtype_bytes(kv_dtype, "kv_cache_dtype")

    kv_lora_rank = cfg.get("kv_lora_rank")
    if kv_lora_rank:
        rope = cfg.get("qk_rope_head_dim") or 0
        if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) or not isinstance(rope, int) or rope < 0:
            raise GeometryError(f"{where}: kv_lora_rank/qk_rope_head_dim must be integers, got {kv_lora_rank!r}/{rope!r}")
        head_size, head_size_v, heads = kv_lora_rank + rope, 0, 1
        mla = True
    else:
        heads_total = None
        for key in _KV_HEAD_KEYS:
            if cfg.get(key) is not None:
                heads_total = _positive_int(cfg, key, where)
                break
        if heads_total is None:
            heads_total = _positive_int(cfg, "num_attention_heads", where)
        if cfg.get("head_dim") is not None:
            head_size = _positive_int(cfg, "head_dim", where)
        else:
            hidden = _positive_int(cfg, "hidden_size", where)
            attn_heads = _positive_int(cfg, "num_attention_heads", where)
            head_size = hidden // attn_heads
        head_size_v = head_size
        heads = max(1, heads_total // tp)
        mla = False

    bytes_per_token = layers_on_rank * heads * (head_size + head_size_v) * dtype_bytes
    if bytes_per_token <= 0:
        raise GeometryError(f"{where}: computed a non-positive KV size per token")
    return KVGeometry(
        bytes_per_token=bytes_per_token,
        bytes_per_block=bytes_per_token * block_size,
        block_size=block_size,
        num_layers_on_rank=layers_on_rank,
        kv_heads_per_rank=heads,
        head_size=head_size,
        head_size_v=head_size_v,
        dtype_bytes=dtype_bytes,
        kv_cache_dtype=kv_dtype,
        mla=mla,
    )

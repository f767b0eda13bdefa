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

DeepSeek-V3.2 adds its indexer's key cache (``index_head_dim`` uint8 values
plus a float32 scale per 128) to every MLA layer's page; ``kv_cache_dtype:
fp8_ds_mla`` stores DeepSeek's packed 656-byte row per token and layer.

Sliding-window, chunked-local and hybrid (Mamba/linear attention) models do
not follow this formula: :func:`geometry_from_config` raises
:class:`UnpredictableGeometry` for them, and :func:`capacity_model` returns
their :class:`~._kv_layout.KVLayout` (grouped as vLLM groups KV-cache layers)
or raises when the layout is not known.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping

from ._kv_block_size import (
    BlockSize,
    EngineTarget,
    UnknownBlockSize,
    attention_block_size,
    engine_target,
    gdn_flashinfer_prefill,
    hybrid_block_size,
    is_gdn,
    state_page_bytes,
)
from ._kv_capacity import DTYPE_BYTES, cdiv
from ._kv_layout import FAMILIES, KVLayout, LayoutError, UnknownLayout, layer_kinds, layout_from_config, prefix_caching

__all__ = [
    "DTYPE_BYTES",
    "EngineTarget",
    "GeometryError",
    "KVGeometry",
    "UnpredictableBlockSize",
    "UnpredictableGeometry",
    "capacity_model",
    "cdiv",
    "engine_target",
    "geometry_from_config",
    "load_config",
]


class GeometryError(ValueError):
    """The model config or serve arguments are missing or invalid."""


class UnpredictableGeometry(GeometryError):
    """The model's KV capacity cannot be predicted from its config (reason in the message)."""


class UnpredictableBlockSize(UnpredictableGeometry):
    """The block size vLLM picks for this engine and layout is not modelled: the engine's own figure can size it."""


_KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")


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
    # where the block size comes from (serve_args, or the engine's own choice and why), for the plan's reasons
    block_size_source: str = ""
    release_notes: tuple[str, ...] = ()

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
            "block_size_source": self.block_size_source,
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
    """Raise :class:`UnpredictableGeometry` unless every layer is full attention (or MLA)."""
    model_type = _model_type(cfg, top)
    try:
        family, _kinds = layer_kinds(cfg, model_type)
    except UnknownLayout as exc:
        raise UnpredictableGeometry(f"{exc}; KV capacity comes from the engine's own figures") from None
    except LayoutError as exc:
        raise GeometryError(str(exc)) from None
    if family != "full_attention":
        raise UnpredictableGeometry(
            f"{family.replace('_', ' ')} model ({FAMILIES[family][0]}): not one full-attention KV-cache group, "
            "capacity comes from its KV layout (capacity_model) or the engine's own figures"
        )


def _model_type(cfg: Mapping[str, Any], top: Mapping[str, Any]) -> str:
    return str(cfg.get("model_type") or top.get("model_type") or "").lower()


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


def _half_kind(name: str) -> str:
    return "bf16" if name in ("bfloat16", "bf16") else "fp16"


# per-token bytes of one MLA layer for the packed DeepSeek kv_cache_dtype layouts
# (fp8_ds_mla: 512 fp8 latent values, 4 float32 scales, 64 bf16 RoPE values)
_DS_MLA_TOKEN_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}
# DeepSeek-V3.2 indexer key cache: uint8 values plus one float32 scale per 128 values
_INDEXER_QUANT_BLOCK = 128


@dataclass(frozen=True)
class _Attention:
    where: str
    layers_on_rank: int
    heads: int
    head_size: int
    head_size_v: int
    dtype_bytes: int
    kv_dtype: str
    mla: bool
    block_size: int
    block_size_source: str
    token_bytes_per_layer: int
    model_type: str
    model_bytes: int


def _attention(top: Mapping[str, Any], cfg: Mapping[str, Any], where: str, serve_args: Mapping[str, Any], target: EngineTarget,
               engine_block_size: int | None = None) -> _Attention:
    """One attention layer's KV bytes per token on one rank, and the block size vLLM uses for it."""
    tp = _serve_int(serve_args, "tensor_parallel_size", 1)
    pp = _serve_int(serve_args, "pipeline_parallel_size", 1)
    given = _serve_int(serve_args, "block_size", 0) if serve_args.get("block_size") is not None else None
    mla = bool(cfg.get("kv_lora_rank"))
    if engine_block_size:
        choice = BlockSize(engine_block_size, ENGINE_BLOCK_SOURCE)
    else:
        choice = attention_block_size(target, given=given, mla=mla, model_type=_model_type(cfg, top))
    if choice.size is None:
        raise UnpredictableBlockSize(f"block size: {choice.source}")
    block_size, block_source = choice.size, choice.source
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
    kv_key = kv_dtype.lower()
    if target.rules.refuses_half_kv_dtype_mismatch and kv_key in ("float16", "half", "fp16", "bfloat16", "bf16"):
        model_name = str(dtype).lower().replace("torch.", "")
        if DTYPE_BYTES.get(model_name) != 2 or _half_kind(kv_key) != _half_kind(model_name):
            raise GeometryError(f"serve_args.kv_cache_dtype {kv_dtype}: vLLM {target.rules.release} refuses a float16/bfloat16 KV cache "
                                f"that differs from the model's dtype ({dtype}); use auto")

    kv_lora_rank = cfg.get("kv_lora_rank")
    if kv_lora_rank:
        rope = cfg.get("qk_rope_head_dim") or 0
        if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) or not isinstance(rope, int) or rope < 0:
            raise GeometryError(f"{where}: kv_lora_rank/qk_rope_head_dim must be integers, got {kv_lora_rank!r}/{rope!r}")
        head_size, head_size_v, heads = kv_lora_rank + rope, 0, 1
        if kv_key in _DS_MLA_TOKEN_BYTES:
            dtype_bytes = 1
            per_layer = _DS_MLA_TOKEN_BYTES[kv_key]
        else:
            dtype_bytes = model_bytes if kv_key == "auto" else _dtype_bytes(kv_dtype, "kv_cache_dtype")
            per_layer = head_size * dtype_bytes
        index_dim = cfg.get("index_head_dim")
        if index_dim:
            if isinstance(index_dim, bool) or not isinstance(index_dim, int) or index_dim <= 0:
                raise GeometryError(f"{where}: index_head_dim must be a positive integer, got {index_dim!r}")
            # the indexer's key cache sits in the same KV-cache group as MLA (one uniform-type group)
            per_layer += index_dim + index_dim // _INDEXER_QUANT_BLOCK * 4
        return _Attention(where, layers_on_rank, heads, head_size, head_size_v, dtype_bytes, kv_dtype, True, block_size, block_source,
                          per_layer, _model_type(cfg, top), model_bytes)
    if kv_key in _DS_MLA_TOKEN_BYTES:
        raise GeometryError(f"kv_cache_dtype {kv_dtype}: DeepSeek's packed MLA cache needs an MLA model (kv_lora_rank in the config)")
    dtype_bytes = model_bytes if kv_key == "auto" else _dtype_bytes(kv_dtype, "kv_cache_dtype")
    heads_total = None
    for key in _KV_HEAD_KEYS:
        if cfg.get(key) is not None:
            heads_total = _positive_int(cfg, key, where)
            break
    if heads_total is None:
        heads_total = _positive_int(cfg, "num_attention_heads", where)
    # A config without head_dim (or null) derives it; a given one must be a positive integer.
    if cfg.get("head_dim") is not None:
        head_size = _positive_int(cfg, "head_dim", where)
    else:
        hidden = _positive_int(cfg, "hidden_size", where)
        attn_heads = _positive_int(cfg, "num_attention_heads", where)
        head_size = hidden // attn_heads
    heads = max(1, heads_total // tp)
    per_layer = heads * 2 * head_size * dtype_bytes
    return _Attention(where, layers_on_rank, heads, head_size, head_size, dtype_bytes, kv_dtype, False, block_size, block_source,
                      per_layer, _model_type(cfg, top), model_bytes)


def _text_config(config: Mapping[str, Any] | str) -> tuple[dict[str, Any], dict[str, Any], str]:
    top = load_config(config)
    text = top.get("text_config")
    cfg: dict[str, Any] = dict(text) if isinstance(text, Mapping) else dict(top)
    where = "model config" + (" text_config" if isinstance(text, Mapping) else "")
    return top, cfg, where


# the block size a profiled engine reported: final, never aligned again
ENGINE_BLOCK_SOURCE = "the profiled canary's block size (reference.block_size)"


def _target(serve_args: Mapping[str, Any], target: EngineTarget | None) -> EngineTarget:
    if target is not None:
        return target
    try:
        return engine_target(None, device=serve_args.get("device"))
    except ValueError as exc:
        raise GeometryError(f"serve_args.device: {exc}") from None


def geometry_from_config(
    config: Mapping[str, Any] | str, serve_args: Mapping[str, Any] | None = None, target: EngineTarget | None = None,
    engine_block_size: int | None = None,
) -> KVGeometry:
    """KV geometry of one rank from a HF ``config.json`` and ``vllm serve`` arguments.

    ``serve_args`` keys used: ``dtype`` (default: the config's ``torch_dtype``/``dtype``;
    ``float32`` models run in ``bfloat16`` as vLLM's ``auto``), ``kv_cache_dtype``
    (``auto`` = model dtype, ``fp8*`` = 1 byte, ``fp8_ds_mla`` = DeepSeek's 656-byte
    packed MLA row), ``tensor_parallel_size``, ``pipeline_parallel_size``,
    ``block_size`` (default: the one vLLM of ``target``'s release picks on its device,
    :mod:`._kv_block_size`), ``device`` (``cpu`` for the CPU build when no ``target`` is given).
    ``target`` is the engine the plan is for (:func:`engine_target`); without one, the
    newest known release's rules apply and the result's ``release_notes`` say so.
    ``engine_block_size`` is the block size a profiled engine reported: it is used as is.
    Raises :class:`UnpredictableGeometry` for models that are not one
    full-attention (or MLA) group, or whose block size vLLM picks in a way not modelled.
    """
    serve_args = dict(serve_args or {})
    tgt = _target(serve_args, target)
    top, cfg, where = _text_config(config)
    _check_predictable(cfg, top)
    att = _attention(top, cfg, where, serve_args, tgt, engine_block_size)
    bytes_per_token = att.layers_on_rank * att.token_bytes_per_layer
    if bytes_per_token <= 0:
        raise GeometryError(f"{where}: computed a non-positive KV size per token")
    return KVGeometry(
        bytes_per_token=bytes_per_token,
        bytes_per_block=bytes_per_token * att.block_size,
        block_size=att.block_size,
        num_layers_on_rank=att.layers_on_rank,
        kv_heads_per_rank=att.heads,
        head_size=att.head_size,
        head_size_v=att.head_size_v,
        dtype_bytes=att.dtype_bytes,
        kv_cache_dtype=att.kv_dtype,
        mla=att.mla,
        block_size_source=att.block_size_source,
        release_notes=tgt.rules.notes,
    )


def _hybrid_block(cfg: Mapping[str, Any], att: _Attention, serve_args: Mapping[str, Any], tgt: EngineTarget, gdn_prefill: bool) -> tuple[int, str]:
    """The block vLLM aligns a state-space hybrid's attention page to (see :mod:`._kv_block_size`)."""
    if att.mla:
        raise UnknownBlockSize("a state-space hybrid with MLA layers: the block alignment vLLM applies is not modelled")
    tp = _serve_int(serve_args, "tensor_parallel_size", 1)
    explicit_half_gdn = is_gdn(att.model_type) and str(
        serve_args.get("mamba_ssm_cache_dtype") or "").lower() in ("float16", "bfloat16")
    if tgt.device == "cpu" and not explicit_half_gdn:
        # the CPU build keeps SSM state in float32 on hosts with AVX-512 BF16
        float32_choices = {True, False} if tgt.cpu_bf16 is None else {tgt.cpu_bf16}
    else:
        float32_choices = {False}
    given = serve_args.get("block_size") is not None
    try:
        pages = {state_page_bytes(cfg, att.model_type, tp=tp, model_dtype_bytes=att.model_bytes, serve_args=serve_args, target=tgt,
                                  ssm_float32=f32) for f32 in float32_choices}
    except UnknownLayout as exc:
        if not given:
            raise UnknownBlockSize(str(exc)) from None
        return att.block_size, (f"serve_args.block_size, taken as is: {exc} (vLLM raises a block too small to hold the state; "
                                "the profiled canary's figures check it)")
    choice = hybrid_block_size(tgt, start=att.block_size, attention_page_per_token=att.token_bytes_per_layer, state_pages=pages,
                               gdn_prefill=gdn_prefill, given=given)
    if choice.size is None:
        raise UnknownBlockSize(choice.source)
    return choice.size, choice.source


def capacity_model(
    config: Mapping[str, Any] | str, serve_args: Mapping[str, Any] | None = None, target: EngineTarget | None = None,
    engine_block_size: int | None = None,
) -> KVGeometry | KVLayout:
    """The capacity model of any family: :class:`KVGeometry` for one full-attention/MLA group, else a :class:`KVLayout`.

    ``target`` as for :func:`geometry_from_config`. A state-space hybrid's block size
    is the one vLLM aligns to its state page (given or not). Raises
    :class:`UnpredictableGeometry` (reason in the message) when the layout or the
    block size is not known.
    """
    serve_args = dict(serve_args or {})
    tgt = _target(serve_args, target)
    top, cfg, where = _text_config(config)
    try:
        family, _kinds = layer_kinds(cfg, _model_type(cfg, top))
    except UnknownLayout as exc:
        raise UnpredictableGeometry(f"{exc}; KV capacity comes from the engine's own figures") from None
    except LayoutError as exc:
        raise GeometryError(str(exc)) from None
    if family == "full_attention":
        return geometry_from_config(config, serve_args, tgt, engine_block_size)
    att = _attention(top, cfg, where, serve_args, tgt, engine_block_size)
    block_size, block_source = att.block_size, att.block_size_source
    notes: list[str] = []
    gdn_prefill = False
    try:
        if family == "hybrid_state_space":
            try:
                gdn_prefill = is_gdn(att.model_type) and gdn_flashinfer_prefill(tgt, prefix_caching(serve_args), cfg.get("linear_key_head_dim"))
            except UnknownBlockSize as exc:
                if not engine_block_size:
                    raise
                # the engine's block is known; its blocks per request settle the checkpoint block (class_capacity)
                notes.append(f"{exc}: no GDN checkpoint block assumed; the profiled canary's blocks per request decide")
            if not engine_block_size:
                block_size, block_source = _hybrid_block(cfg, att, serve_args, tgt, gdn_prefill)
            if not tgt.rules.mamba_cache_mode_flag and serve_args.get("mamba_cache_mode") is not None:
                notes.append(f"serve_args.mamba_cache_mode is ignored by vLLM {tgt.rules.release} (the mode follows prefix caching)")
                serve_args.pop("mamba_cache_mode")
        layout = layout_from_config(
            cfg, att.model_type, page_bytes=att.token_bytes_per_layer * block_size, block_size=block_size, serve_args=serve_args,
            checkpoint_blocks=1 if gdn_prefill else 0,
        )
    except UnknownBlockSize as exc:
        raise UnpredictableBlockSize(f"block size: {exc}") from None
    except UnknownLayout as exc:
        raise UnpredictableGeometry(f"{exc}; KV capacity comes from the engine's own figures") from None
    except LayoutError as exc:
        raise GeometryError(str(exc)) from None
    if layout is None:  # pragma: no cover - family checked above
        return geometry_from_config(config, serve_args, tgt, engine_block_size)
    return replace(layout, block_size_source=block_source, notes=tuple(notes) + layout.notes)

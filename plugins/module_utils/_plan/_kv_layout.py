# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""KV-cache layouts of every attention family, grouped the way vLLM groups them.

Plain Python, no Ansible import, no vLLM import. Mirrors vLLM 0.3x's
``vllm/v1/core/kv_cache_utils.py`` (hybrid KV-cache manager):

* each attention layer has a spec: full attention, sliding window ``w``,
  chunked local attention ``c``, or a state (Mamba / linear attention);
* layers with the same spec form buckets; every group holds ``group_size``
  layers, ``group_size`` = the smallest bucket (or the largest one when it is
  below 1.5 x the smallest); a bucket of ``n`` layers makes ``cdiv(n, group_size)``
  groups;
* all groups draw from one block pool; one block costs the widest group's
  pages: ``bytes_per_block = group_size * page``; ``num_blocks = kv_bytes // bytes_per_block``;
* a request of ``L`` tokens needs blocks in every group: full ``cdiv(L, bs)``,
  sliding ``cdiv(min(w - 1 + in_flight, L), bs) + 1``, chunked
  ``cdiv(min(c + in_flight, L), bs)``, state 1 (2 with ``mamba_cache_mode: align``);
  ``in_flight = max_concurrent_batches * max_num_batched_tokens``;
* ``max_concurrency = num_blocks / blocks_per_request`` and the logged
  "KV cache size: N tokens" is ``int(max_concurrency * L)``;
* vLLM refuses to start unless ``kv_bytes - bytes_per_block >= blocks_per_request * bytes_per_block``.

With the hybrid manager off (``disable_hybrid_kv_cache_manager``, and chunked
local attention with ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=0``),
sliding and chunked layers next to full ones are allocated as full attention:
one group.

State-space layers (Mamba, GDN, linear attention) pad their page to the
attention page, whose block size the engine raises until it holds the state
(:mod:`._kv_block_size` derives it per vLLM release and device); such layouts
are checked against the profiled canary's max concurrency. A config this module does not know raises
:class:`UnknownLayout`: the caller uses the engine's figures or refuses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .._validate import int_field

__all__ = [
    "FAMILIES",
    "KVLayout",
    "LayerGroup",
    "LayoutError",
    "UnknownLayout",
    "layer_kinds",
    "layout_from_config",
    "prefix_caching",
]


class LayoutError(ValueError):
    """The model config or serve arguments are invalid for a KV layout (message names the field)."""


class UnknownLayout(LayoutError):
    """The config describes a layout this module cannot size exactly (reason in the message)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# family -> (config markers, how capacity is derived); docs/model-families.md renders the same table
FAMILIES: dict[str, tuple[str, str]] = {
    "full_attention": ("no marker below (Llama, Qwen, Mistral without sliding_window, MHA/GQA/MQA)", "geometry"),
    "mla": ("kv_lora_rank (DeepSeek-V2/V3, Kimi-K2)", "geometry"),
    "mla_indexer": ("kv_lora_rank + index_head_dim (DeepSeek-V3.2)", "geometry"),
    "sliding_window": ("sliding_window without layer_types (Mistral-7B-v0.1, Phi-3)", "layout"),
    "interleaved_sliding_window": (
        "layer_types with sliding_attention (Gemma 2/3, gpt-oss, Cohere2), model_type gemma2, sliding_window_pattern",
        "layout",
    ),
    "chunked_local": ("attention_chunk_size (+ no_rope_layers) (Llama 4)", "layout"),
    "hybrid_state_space": (
        "layer_types with linear_attention/mamba, layers_block_type, hybrid_override_pattern, attn_layer_period, "
        "attn_type_list, model_type falcon_h1 (Qwen3-Next, Jamba, Nemotron-H, Granite-4.0-H, Falcon-H1, MiniMax)",
        "layout with the engine's block size",
    ),
}

_STATE = "state"
_FULL = "full"
_SLIDING = "sliding"
_CHUNKED = "chunked"


@dataclass(frozen=True)
class LayerGroup:
    """One KV-cache group: ``layers`` real layers of one kind (``window`` for sliding/chunked)."""

    kind: str
    layers: int
    window: int | None = None

    def blocks_per_request(self, tokens: int, block_size: int, in_flight: int | None, state_blocks: int) -> int:
        if self.kind == _FULL:
            return _cdiv(tokens, block_size)
        if self.kind == _STATE:
            return state_blocks
        if in_flight is None:
            raise UnknownLayout(
                f"{self.kind} window {self.window}: max_num_batched_tokens is needed (serve_args.max_num_batched_tokens) "
                "to size the window's in-flight blocks"
            )
        window = int(self.window or 0)
        if self.kind == _SLIDING:
            return _cdiv(min(window - 1 + in_flight, tokens), block_size) + 1
        return _cdiv(min(window + in_flight, tokens), block_size)


@dataclass(frozen=True)
class KVLayout:
    """KV-cache groups of one rank, with what a block costs and what a request needs."""

    family: str
    groups: tuple[LayerGroup, ...]
    group_size: int
    page_bytes: int
    block_size: int
    in_flight_tokens: int | None
    state_blocks: int = 1
    hybrid_manager: bool = True
    notes: tuple[str, ...] = field(default=())
    # where the block size comes from (serve_args, or the engine's own choice and why), for the plan's reasons
    block_size_source: str = ""

    @property
    def bytes_per_block(self) -> int:
        return self.group_size * self.page_bytes

    def num_blocks(self, kv_bytes: int) -> int:
        return max(0, kv_bytes) // self.bytes_per_block

    def blocks_per_request(self, tokens: int) -> int:
        """Blocks one request of ``tokens`` tokens holds, summed over the groups."""
        return sum(g.blocks_per_request(tokens, self.block_size, self.in_flight_tokens, self.state_blocks) for g in self.groups)

    def max_concurrency(self, num_blocks: int, max_model_len: int) -> float:
        """vLLM's figure: ``num_blocks / blocks_per_request(max_model_len)`` (null block included, as vLLM does)."""
        return num_blocks / self.blocks_per_request(max_model_len)

    def tokens(self, num_blocks: int, max_model_len: int) -> int:
        """The logged "KV cache size: N tokens": ``int(max_concurrency * max_model_len)``."""
        return int(self.max_concurrency(num_blocks, max_model_len) * max_model_len)

    def bytes_for_one_request(self, max_model_len: int) -> int:
        """Least KV bytes vLLM boots with: one request's blocks plus the null block."""
        return (self.blocks_per_request(max_model_len) + 1) * self.bytes_per_block

    def as_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "groups": [{"kind": g.kind, "layers": g.layers, "window": g.window} for g in self.groups],
            "group_size": self.group_size,
            "page_bytes": self.page_bytes,
            "bytes_per_block": self.bytes_per_block,
            "block_size": self.block_size,
            "in_flight_tokens": self.in_flight_tokens,
            "state_blocks": self.state_blocks,
            "hybrid_manager": self.hybrid_manager,
            "notes": list(self.notes),
            "block_size_source": self.block_size_source,
        }


# ----------------------------------------------------------------- layer kinds
def _int(cfg: Mapping[str, Any], key: str) -> int | None:
    """An integer of the model's config; anything else reads as absent."""
    return int_field(cfg.get(key), key, floats="refuse", quiet=True)


def _hybrid_kinds(cfg: Mapping[str, Any], model_type: str, n: int) -> list[str] | None:
    """Per-layer ``full``/``state`` list for state-space hybrids; None when the config is not one."""
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and any(str(t) in ("linear_attention", "mamba", "mamba2") for t in layer_types):
        return [_STATE if str(t) in ("linear_attention", "mamba", "mamba2") else _FULL for t in layer_types]
    if isinstance(cfg.get("layers_block_type"), list):
        return [_STATE if str(t) == "mamba" else _FULL for t in cfg["layers_block_type"]]
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        # Nemotron-H: M = Mamba, * = attention, - = MLP and E = MoE (no cache)
        return [_STATE if c == "M" else _FULL for c in pattern if c in "M*"]
    if isinstance(cfg.get("attn_type_list"), list):
        # MiniMax: 0 = linear attention (a state), 1 = softmax attention
        return [_FULL if int(t) == 1 else _STATE for t in cfg["attn_type_list"]]
    period, offset = _int(cfg, "attn_layer_period"), _int(cfg, "attn_layer_offset")
    if period and offset is not None:
        # Jamba: attention where i % period == offset, Mamba elsewhere
        return [_FULL if i % period == offset else _STATE for i in range(n)]
    if isinstance(cfg.get("attn_layer_indices"), list):
        # Bamba-style
        attn = {int(i) for i in cfg["attn_layer_indices"]}
        return [_FULL if i in attn else _STATE for i in range(n)]
    interval = _int(cfg, "full_attention_interval")
    if interval and "qwen3_next" in model_type:
        return [_FULL if (i + 1) % interval == 0 else _STATE for i in range(n)]
    if "falcon_h1" in model_type:
        # every layer runs attention and Mamba side by side
        return [_FULL] * n + [_STATE] * n
    return None


def layer_kinds(cfg: Mapping[str, Any], model_type: str) -> tuple[str, list[tuple[str, int | None]]]:
    """(family, per-layer ``(kind, window)``) of a text config; raises :class:`UnknownLayout`."""
    n = cfg.get("num_hidden_layers")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise LayoutError(f"model config: num_hidden_layers must be a positive integer, got {n!r}")
    hybrid = _hybrid_kinds(cfg, model_type, n)
    if hybrid is not None:
        return "hybrid_state_space", [(k, None) for k in hybrid]
    for key in ("ssm_cfg", "mamba_d_state", "mamba_expand", "linear_attn_config", "cross_attention_layers"):
        if cfg.get(key) not in (None, [], {}, ""):
            raise UnknownLayout(f"config has {key} but no layer pattern this planner knows: KV capacity comes from the engine's own figures")
    for marker in ("mamba", "zamba", "plamo2", "lfm2", "minimax", "bamba", "nemotron_h", "granitemoehybrid", "jamba", "qwen3_next", "falcon_h1"):
        if marker in model_type:
            raise UnknownLayout(f"model_type {model_type!r} is a state-space hybrid whose layer pattern is not in its config")

    chunk = _int(cfg, "attention_chunk_size")
    if chunk:
        no_rope = cfg.get("no_rope_layers")
        if not isinstance(no_rope, list) or len(no_rope) != n:
            interval = _int(cfg, "no_rope_layer_interval") or 4
            no_rope = [int((i + 1) % interval != 0) for i in range(n)]
        # Llama 4: RoPE layers (1) attend in chunks, NoPE layers (0) globally
        return "chunked_local", [(_CHUNKED, chunk) if int(flag) else (_FULL, None) for flag in no_rope]

    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False or window in (None, False, 0, ""):
        window = None
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        if len(layer_types) != n:
            raise UnknownLayout(f"layer_types has {len(layer_types)} entries for {n} layers: the layer pattern is not known")
        unknown = sorted({str(t) for t in layer_types} - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnknownLayout(f"layer_types {unknown}: not a layer type this planner knows")
        if "sliding_attention" not in layer_types:
            return "full_attention", [(_FULL, None)] * n
        if not isinstance(window, int) or window <= 0:
            raise LayoutError("model config: layer_types has sliding_attention but sliding_window is not a positive integer")
        return "interleaved_sliding_window", [(_SLIDING, window) if t == "sliding_attention" else (_FULL, None) for t in layer_types]
    if window is not None and not isinstance(window, int):
        raise UnknownLayout(f"sliding_window={window!r}: per-layer window lists are not sized by this planner")
    pattern = _int(cfg, "sliding_window_pattern") or _int(cfg, "_sliding_window_pattern")
    if "gemma2" in model_type and window:
        # Gemma 2: even layers slide, odd layers are global
        return "interleaved_sliding_window", [(_SLIDING, window) if i % 2 == 0 else (_FULL, None) for i in range(n)]
    if window and pattern:
        # Gemma 3 and Cohere2 before layer_types: every pattern-th layer is global
        return "interleaved_sliding_window", [(_FULL, None) if (i + 1) % pattern == 0 else (_SLIDING, window) for i in range(n)]
    if window and "gpt_oss" in model_type:
        return "interleaved_sliding_window", [(_SLIDING, window) if i % 2 == 0 else (_FULL, None) for i in range(n)]
    if window:
        # Mistral-7B-v0.1, Phi-3: vLLM applies the model's window to every layer
        return "sliding_window", [(_SLIDING, window)] * n
    return "full_attention", [(_FULL, None)] * n


# ------------------------------------------------------------------- grouping
def _group(kinds: list[tuple[str, int | None]], hybrid_manager: bool) -> tuple[list[LayerGroup], int, list[str]]:
    notes: list[str] = []
    specs = list(kinds)
    has_full = any(k == _FULL for k, _w in specs)
    if not hybrid_manager and has_full and any(k in (_SLIDING, _CHUNKED) for k, _w in specs):
        # unify_hybrid_kv_cache_specs: local layers are allocated as full attention
        specs = [(_FULL, None) if k in (_SLIDING, _CHUNKED) else (k, w) for k, w in specs]
        notes.append("hybrid KV-cache manager off: sliding/chunked layers are allocated as full attention")
    if not hybrid_manager and any(k == _STATE for k, _w in specs):
        raise LayoutError("state-space hybrids need vLLM's hybrid KV-cache manager (disable_hybrid_kv_cache_manager must be false)")
    buckets: dict[tuple[str, int | None], int] = {}
    for spec in specs:
        buckets[spec] = buckets.get(spec, 0) + 1
    if len(buckets) == 1:
        (kind, window), count = next(iter(buckets.items()))
        return [LayerGroup(kind, count, window)], count, notes
    smallest, largest = min(buckets.values()), max(buckets.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    groups: list[LayerGroup] = []
    for (kind, window), count in buckets.items():
        num = _cdiv(count, group_size)
        # layers[i::num] per group: the first groups get the remainder
        for i in range(num):
            groups.append(LayerGroup(kind, len(range(i, count, num)), window))
        if count % group_size:
            notes.append(f"{group_size - count % group_size} padding layer(s) in the {kind} groups")
    return groups, group_size, notes


def prefix_caching(serve_args: Mapping[str, Any]) -> bool:
    """Whether the engine caches prefixes (vLLM's default: on), from ``serve_args.enable_prefix_caching``."""
    caching = serve_args.get("enable_prefix_caching", True)
    return caching if isinstance(caching, bool) else str(caching).lower() in ("true", "1", "yes")


# state-space layers built on vLLM's Mamba2 mixer keep one prefill checkpoint block in "align" mode
_MAMBA2_MODEL_TYPES = ("granitemoehybrid", "nemotron_h", "bamba", "falcon_h1", "zamba2", "mamba2", "plamo2")


def _state_blocks(model_type: str, serve_args: Mapping[str, Any], checkpoint_blocks: int = 0) -> int:
    """Blocks one request holds per state group (vLLM's ``MambaSpec.max_memory_usage_bytes``).

    ``mamba_cache_mode`` is ``align`` by default when prefix caching is on (vLLM's
    default), ``none`` without it: ``none`` holds 1 block, ``align`` 2 plus a
    prefill checkpoint block for Mamba2 mixers (and ``checkpoint_blocks`` more: GDN
    layers under the FlashInfer GDN prefill kernel, vLLM 0.33+); speculative
    decoding adds ``num_speculative_tokens`` blocks.
    """
    mode = serve_args.get("mamba_cache_mode")
    if mode is None:
        mode = "align" if prefix_caching(serve_args) else "none"
    spec = serve_args.get("num_speculative_tokens") or 0
    if str(mode).lower() == "align":
        return 2 + int(spec) + (1 if any(t in model_type for t in _MAMBA2_MODEL_TYPES) else 0) + checkpoint_blocks
    return 1 + int(spec)


def layout_from_config(
    cfg: Mapping[str, Any],
    model_type: str,
    *,
    page_bytes: int,
    block_size: int,
    serve_args: Mapping[str, Any],
    checkpoint_blocks: int = 0,
) -> KVLayout | None:
    """KV layout of a non-full-attention model; None for a plain full-attention (or MLA) model.

    ``page_bytes`` is one attention layer's page (``block_size`` tokens) on one
    rank. ``serve_args`` keys used: ``max_num_batched_tokens`` and
    ``max_concurrent_batches`` (in-flight tokens of sliding/chunked layers;
    default 1 batch, 2 with ``async_scheduling``), ``disable_hybrid_kv_cache_manager``,
    ``mamba_cache_mode``, ``enable_prefix_caching``, ``num_speculative_tokens``, ``pipeline_parallel_size``.
    """
    family, kinds = layer_kinds(cfg, model_type)
    if family == "full_attention":
        return None
    pp = int(serve_args.get("pipeline_parallel_size") or 1)
    if pp > 1:
        raise UnknownLayout(f"{family} with pipeline_parallel_size {pp}: per-stage groups are not sized by this planner")
    disable = serve_args.get("disable_hybrid_kv_cache_manager")
    hybrid_manager = not (disable is True or str(disable).lower() in ("true", "1", "yes"))
    if family == "chunked_local" and str(serve_args.get("allow_chunked_local_attn_with_hybrid_kv_cache", "1")).lower() in ("0", "false", "no"):
        hybrid_manager = False
    groups, group_size, notes = _group(kinds, hybrid_manager)
    in_flight: int | None = None
    batched = serve_args.get("max_num_batched_tokens")
    if batched is not None:
        if isinstance(batched, bool) or not str(batched).strip().isdigit() or int(batched) <= 0:
            raise LayoutError(f"serve_args.max_num_batched_tokens must be a positive integer, got {batched!r}")
        batches = serve_args.get("max_concurrent_batches")
        if batches is None:
            batches = 2 if str(serve_args.get("async_scheduling", "")).lower() in ("true", "1", "yes") else 1
        in_flight = int(batches) * int(batched)
    state_blocks = _state_blocks(model_type, serve_args, checkpoint_blocks) if family == "hybrid_state_space" else 1
    if family == "hybrid_state_space":
        notes.append(f"state pages are padded to the attention page of {block_size} tokens")
    return KVLayout(
        family=family,
        groups=tuple(groups),
        group_size=group_size,
        page_bytes=page_bytes,
        block_size=block_size,
        in_flight_tokens=in_flight,
        state_blocks=state_blocks,
        hybrid_manager=hybrid_manager,
        notes=tuple(notes),
    )

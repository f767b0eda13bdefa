# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The KV capacity model of a planned class: geometry, blocks, tokens and concurrency.

Plain Python, no Ansible import. :func:`reference_geometry` reads the model's KV geometry
(or layout) from the reference profile, :func:`class_capacity` checks it against the
profiled canary's own figures and returns the :class:`Capacity` the planner counts blocks,
tokens and per-request blocks with; :func:`what_if_fp8` is the same plan with a 1-byte KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._geometry import (
    EngineTarget,
    GeometryError,
    KVGeometry,
    UnpredictableBlockSize,
    UnpredictableGeometry,
    capacity_model,
    engine_target,
    load_config,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._kv_block_size import attention_block_size
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._kv_capacity import (
    blocks_for_bytes,
    capacity_record,
    full_attention_request_blocks,
    one_request_blocks,
    tokens_for_blocks,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._kv_layout import KVLayout
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan_inputs import PlanError, Reference

__all__ = ["Capacity", "class_capacity", "geometry_family", "reference_geometry", "what_if_fp8"]


def _reference_target(ref: Reference, serve_args: Mapping[str, Any]) -> EngineTarget:
    runtime = ref.get("runtime") or {}
    try:
        return engine_target(runtime.get("vllm_version"), device=serve_args.get("device"), torch_version=runtime.get("torch_version"),
                             compute_capability=runtime.get("compute_capability"), cuda_version=runtime.get("cuda_version"))
    except ValueError as exc:
        raise PlanError(f"reference.geometry.serve_args.device: {exc}") from None


def _model(config: Any, serve_args: dict[str, Any], ref: Reference, target: EngineTarget,
           notes: list[str]) -> tuple[KVGeometry | KVLayout | None, str | None]:
    """The capacity model with vLLM's own block size, or the profiled canary's where they differ or vLLM's is not modelled."""
    engine_block = ref.get("block_size")
    try:
        try:
            geo = capacity_model(config, serve_args, target)
        except UnpredictableBlockSize as exc:
            if "block_size" in serve_args or not engine_block:
                raise
            notes.append(f"{exc}: the profiled canary's block size {engine_block} is used")
            return capacity_model(config, serve_args, target, engine_block_size=engine_block), None
        if "block_size" not in serve_args and engine_block and engine_block != geo.block_size:
            notes.append(
                f"the profiled canary used block size {engine_block} where {target.describe()} is modelled to pick {geo.block_size} "
                f"({geo.block_size_source}): the canary's figure is used"
            )
            return capacity_model(config, serve_args, target, engine_block_size=engine_block), None
        return geo, None
    except UnpredictableGeometry as exc:
        return None, str(exc)


def reference_geometry(ref: Reference, notes: list[str] | None = None) -> tuple[KVGeometry | KVLayout | None, str | None]:
    """Capacity model from the reference (geometry: or bytes_per_block); (None, why) when unknown.

    One full-attention (or MLA) group gives a :class:`KVGeometry`; sliding-window,
    chunked-local and state-space hybrids give a :class:`KVLayout` grouped as vLLM
    groups them. The block size is the serve arguments', else the one vLLM of the
    reference's release picks on its device for that layout (:mod:`._kv_block_size`);
    the profiled canary's own block size wins where it differs or where vLLM's choice
    is not modelled. ``notes`` receives what the plan's reasons should say about it.
    """
    notes = [] if notes is None else notes
    geo_spec = ref.get("geometry")
    geo: KVGeometry | KVLayout | None = None
    why: str | None = None
    if geo_spec:
        if not isinstance(geo_spec, Mapping) or "config" not in geo_spec:
            raise PlanError("reference.geometry: expected {config: <config.json path or dict>, serve_args: {...}}")
        serve_args = dict(geo_spec.get("serve_args") or {})
        target = _reference_target(ref, serve_args)
        try:
            geo, why = _model(geo_spec["config"], serve_args, ref, target, notes)
        except GeometryError as exc:
            raise PlanError(f"reference.geometry: {exc}") from None
        if geo is not None:
            if geo.block_size_source != "serve_args.block_size":
                notes.append(f"block size {geo.block_size}: {geo.block_size_source}")
            notes.extend(n for n in target.rules.notes if n not in notes)
            if isinstance(geo, KVLayout):
                notes.extend(n for n in geo.notes if "is ignored by" in n)
    bpb = ref.get("bytes_per_block")
    if bpb is not None:
        bs = ref["block_size"]
        if bs is None:
            # bytes per block without the block size: a full-attention engine's, at the block vLLM picks for attention layers
            target = _reference_target(ref, {})
            bs = attention_block_size(target, given=None, mla=False, model_type="").size or 16
            notes.append(f"block size {bs} with reference.bytes_per_block: {target.describe()} picks it for attention layers "
                         "(give reference.block_size for an MLA or state-space model)")
        if bpb <= 0 or bpb % bs:
            raise PlanError(f"reference.bytes_per_block {bpb} is not a positive multiple of block_size {bs}")
        if geo is not None and (geo.bytes_per_block != bpb or geo.block_size != bs):
            raise PlanError(
                f"reference.bytes_per_block {bpb} (block {bs}) disagrees with the model geometry "
                f"({geo.bytes_per_block} per block of {geo.block_size}); drop one of them"
            )
        if geo is None and why is not None:
            return None, why
        if geo is None:
            dtype_bytes = ref.get("kv_dtype_bytes")
            dtype_bytes = int(dtype_bytes) if isinstance(dtype_bytes, int) and not isinstance(dtype_bytes, bool) else 0
            geo = KVGeometry(
                bytes_per_token=bpb // bs,
                bytes_per_block=bpb,
                block_size=bs,
                num_layers_on_rank=0,
                kv_heads_per_rank=0,
                dtype_bytes=dtype_bytes,
                block_size_source="reference.block_size",
            )
    if geo is None:
        return None, why or "the reference gives no KV geometry (bytes_per_block or geometry)"
    return geo, None


class Capacity:
    """Blocks, per-request blocks, tokens and concurrency of one capacity model.

    ``source`` is ``geometry`` (one full-attention/MLA group: tokens are
    ``blocks * block_size``), ``layout`` (KV-cache groups as vLLM groups them:
    tokens are ``int(blocks / request_blocks * max_model_len)``, vLLM's own
    definition) or ``engine`` (an unknown layout: the profiled canary's blocks
    per byte and per request, a lower bound on blocks).
    """

    def __init__(
        self,
        source: str,
        block_size: int,
        bytes_per_block: int | None,
        geometry: KVGeometry | None = None,
        layout: KVLayout | None = None,
        engine: tuple[int, int, int, int] | None = None,
    ) -> None:
        self.source = source
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.geometry = geometry
        self.layout = layout
        # (engine blocks, engine KV bytes, blocks per request, at max_model_len)
        self.engine = engine
        self.fixed_request_blocks: dict[int, int] = {}

    def num_blocks(self, kv_bytes: int) -> int:
        if not self.bytes_per_block and self.engine is None:
            raise PlanError("internal: engine capacity without engine figures")
        return blocks_for_bytes(kv_bytes, self.bytes_per_block, self.engine[:2] if self.engine else None)

    def request_blocks(self, tokens: int) -> int:
        """Blocks one request of ``tokens`` holds, summed over every KV-cache group."""
        if tokens in self.fixed_request_blocks:
            return self.fixed_request_blocks[tokens]
        if self.layout is not None:
            if self.layout.in_flight_tokens is None:
                # in-flight tokens unknown: a window holds at most the whole request (conservative)
                return replace(self.layout, in_flight_tokens=tokens).blocks_per_request(tokens)
            return self.layout.blocks_per_request(tokens)
        if self.engine is not None:
            per_request, length = self.engine[2], self.engine[3]
            return max(1, math.ceil(per_request * tokens / length))
        return full_attention_request_blocks(tokens, self.block_size)

    def request_blocks_bounds(self, tokens: int) -> tuple[int, int]:
        if self.layout is not None and self.layout.in_flight_tokens is None:
            return (
                replace(self.layout, in_flight_tokens=1).blocks_per_request(tokens),
                replace(self.layout, in_flight_tokens=tokens).blocks_per_request(tokens),
            )
        value = self.request_blocks(tokens)
        return value, value

    def tokens(self, num_blocks: int, max_model_len: int | None) -> int | None:
        request_blocks = self.request_blocks(max_model_len) if self.source != "geometry" and max_model_len else None
        return tokens_for_blocks(num_blocks, self.source, self.block_size, request_blocks, max_model_len)

    def record(self, max_model_len: int | None) -> dict[str, Any] | None:
        """The plan file's ``capacity``: what the boot gate needs to count blocks and tokens as this model does."""
        request_blocks = self.request_blocks(max_model_len) if max_model_len else None
        return capacity_record(self.source, self.block_size, self.bytes_per_block, request_blocks, max_model_len,
                               self.engine[:2] if self.engine else None)

    def admission_blocks(self, adm: tuple[str, int, int], max_model_len: int | None) -> tuple[int, int] | None:
        """(required tokens, required blocks incl. the null block) of an admission plan."""
        kind, a, b = adm
        if kind == "tokens":
            if self.source == "geometry":
                return a, one_request_blocks(full_attention_request_blocks(a, self.block_size))
            if not max_model_len:
                return None
            # vLLM counts tokens as max-length requests: tokens / max_model_len requests
            return a, one_request_blocks(math.ceil(a * self.request_blocks(max_model_len) / max_model_len))
        return a * b, one_request_blocks(a * self.request_blocks(b))


def _engine_request_blocks(ref: Reference, max_model_len: int | None) -> int | None:
    """Blocks per request of the profiled canary: its blocks over its max concurrency (vLLM's figure)."""
    blocks, conc = ref.get("num_blocks"), ref.get("max_concurrency")
    ref_len = ref.get("max_model_len") or max_model_len
    if not blocks or not conc or (max_model_len and ref_len != max_model_len):
        return None
    return max(1, round(blocks / conc))


def class_capacity(
    ref: Reference, geo: KVGeometry | KVLayout | None, geo_why: str | None, max_model_len: int | None, reasons: list[str]
) -> tuple[Capacity | None, str | None]:
    """The capacity model of the class, checked against the profiled canary's own figures."""
    engine_blocks = _engine_request_blocks(ref, max_model_len)
    if isinstance(geo, KVGeometry):
        cap = Capacity("geometry", geo.block_size, geo.bytes_per_block, geometry=geo)
        return cap, None
    if isinstance(geo, KVLayout):
        cap = Capacity("layout", geo.block_size, geo.bytes_per_block, layout=geo)
        exact = ref.get("engine_kv_bytes")
        if exact and ref.get("num_blocks") and exact // geo.bytes_per_block != ref["num_blocks"]:
            reasons.append(
                f"the {geo.family} layout predicts {exact // geo.bytes_per_block} blocks from the engine's {exact} bytes, the engine "
                f"made {ref['num_blocks']}: capacity from the engine's own figures instead"
            )
            geo_why = f"{geo.family} layout disagrees with the engine"
            geo = None
        elif max_model_len:
            low, high = cap.request_blocks_bounds(max_model_len)
            if engine_blocks is not None and not low <= engine_blocks <= high and geo.family == "hybrid_state_space":
                # the state blocks per request depend on the vLLM release's mamba cache mode: the engine knows
                cap.fixed_request_blocks[max_model_len] = engine_blocks
                reasons.append(
                    f"{geo.family}: the layout gives {low} blocks per request of {max_model_len} tokens, the profiled canary "
                    f"{engine_blocks}; the engine's figure is used (state blocks per request differ between vLLM releases)"
                )
            elif engine_blocks is not None and not low <= engine_blocks <= high:
                reasons.append(
                    f"the {geo.family} layout needs {low}..{high} blocks per request of {max_model_len} tokens, the engine "
                    f"{engine_blocks} ({ref['num_blocks']} blocks / {ref['max_concurrency']}x): capacity from the engine's own figures instead"
                )
                geo_why = f"{geo.family} layout disagrees with the engine"
                geo = None
            elif low != high:
                if engine_blocks is not None:
                    cap.fixed_request_blocks[max_model_len] = engine_blocks
                    reasons.append(
                        f"{geo.family}: blocks per request of {max_model_len} tokens taken from the profiled canary ({engine_blocks}); "
                        "set serve_args.max_num_batched_tokens to size them from the config"
                    )
                else:
                    reasons.append(
                        f"{geo.family}: max_num_batched_tokens not given and no engine concurrency in the reference: "
                        f"{high} blocks per request assumed (the most a window can hold)"
                    )
        if geo is not None:
            return cap, None
    # unknown layout: the engine's own figures, if exact enough
    exact = ref.get("engine_kv_bytes")
    ref_blocks = ref.get("num_blocks")
    engine_block = ref.get("block_size")
    if ref_blocks and exact and engine_blocks is not None and max_model_len and engine_block:
        reasons.append(
            f"KV layout not known ({geo_why}); capacity derived from the profiled canary's own figures: {ref_blocks} blocks "
            f"from {exact} bytes, {engine_blocks} blocks per request of {max_model_len} tokens (blocks are a lower bound): "
            "verify with the manual canary"
        )
        return Capacity("engine", engine_block, None, engine=(ref_blocks, exact, engine_blocks, max_model_len)), None
    why = geo_why or "no KV geometry"
    return None, (
        f"{why}; the reference lacks the engine figures to derive capacity from (num_blocks, block_size, max_concurrency, max_model_len and the "
        "exact KV bytes the engine allocated: a manual canary's kv_cache_memory_bytes)"
    )


def geometry_family(ref: Reference, geo: KVGeometry | KVLayout | None) -> str | None:
    """The family the result's ``kv_layout`` names: a layout's own, ``full_attention``, ``mla`` or ``mla_indexer``."""
    if isinstance(geo, KVLayout):
        return geo.family
    if not isinstance(geo, KVGeometry):
        return None
    if not geo.mla:
        return "full_attention"
    spec = ref.get("geometry") or {}
    config = spec.get("config")
    try:
        cfg = load_config(config) if config else {}
    except GeometryError:
        cfg = {}
    text_cfg = cfg.get("text_config")
    text = text_cfg if isinstance(text_cfg, Mapping) else cfg
    return "mla_indexer" if text.get("index_head_dim") else "mla"


def what_if_fp8(
    ref: Reference,
    geo: KVGeometry | KVLayout | None,
    cap: Capacity | None,
    launch: int,
    adm: tuple[str, int, int] | None,
    max_model_len: int | None,
    reasons: list[str],
) -> dict[str, Any] | None:
    """The same plan with a 1-byte (fp8) KV cache; for a cache already 1 byte wide, the plan itself."""
    if cap is None or cap.source == "engine" or not cap.bytes_per_block:
        return None
    spec = ref.get("geometry") or {}
    fp8: Capacity | None = None
    already = False
    if spec.get("config"):
        if isinstance(geo, KVLayout) and geo.family == "hybrid_state_space":
            reasons.append("what_if_fp8 not computed: a state-space hybrid's block size follows its state pages, which fp8 does not shrink")
            return None
        serve_args = dict(spec.get("serve_args") or {})
        serve_args.setdefault("block_size", cap.block_size)
        current = str(serve_args.get("kv_cache_dtype") or "auto").lower()
        serve_args["kv_cache_dtype"] = current if current.startswith(("fp8", "int8")) else "fp8"
        try:
            model = capacity_model(spec["config"], serve_args)
        except GeometryError:
            return None
        if isinstance(model, KVGeometry):
            fp8 = Capacity("geometry", model.block_size, model.bytes_per_block, geometry=model)
        else:
            fp8 = Capacity("layout", model.block_size, model.bytes_per_block, layout=model)
            fp8.fixed_request_blocks = dict(cap.fixed_request_blocks)
        already = model.bytes_per_block == cap.bytes_per_block
        dtype = serve_args["kv_cache_dtype"]
    elif isinstance(geo, KVGeometry) and geo.dtype_bytes in (1, 2, 4):
        bpb8 = geo.bytes_per_block // geo.dtype_bytes
        fp8 = Capacity("geometry", geo.block_size, bpb8, geometry=replace(geo, bytes_per_block=bpb8, bytes_per_token=geo.bytes_per_token // geo.dtype_bytes))
        already = geo.dtype_bytes == 1
        dtype = geo.kv_cache_dtype if already else "fp8"
    else:
        return None
    blocks8 = fp8.num_blocks(max(0, launch))
    out: dict[str, Any] = {
        "kv_cache_dtype": dtype,
        "already_one_byte": already,
        "bytes_per_block": fp8.bytes_per_block,
        "bytes_per_token": fp8.geometry.bytes_per_token if fp8.geometry else None,
        "num_blocks": blocks8,
        "kv_cache_tokens": fp8.tokens(blocks8, max_model_len),
        "max_concurrency": (max(0, blocks8 - 1) // fp8.request_blocks(max_model_len)) if max_model_len else None,
    }
    if adm is not None:
        need8 = fp8.admission_blocks(adm, max_model_len)
        if need8 is not None:
            out["admission_bytes"] = need8[1] * (fp8.bytes_per_block or 0)
    return out

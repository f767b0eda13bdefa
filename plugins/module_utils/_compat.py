# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Compatibility key of a reference profile.

Plain Python, no Ansible import.

A reference profile (vLLM's suggested KV bytes and the free memory it was
measured against) is only valid for the exact engine, model and GPU it came
from. The key collects those fields, canonicalises them (so ``"8192"`` and
``8192``, ``"True"`` and ``true`` or a reordered dict give the same key) and
hashes them: ``hash`` is the first 16 hex digits of the SHA-256 of the
canonical JSON (sorted keys, no spaces); ``full_hash`` is all 64.

Fields left out or set to ``null`` are absent from the key. Field names not in
:data:`KNOWN_FIELDS` are kept (a deployment may add its own), canonicalised
generically.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["CompatKey", "CompatError", "compat_key", "diff_keys", "KNOWN_FIELDS", "INT_FIELDS", "BOOL_FIELDS"]


class CompatError(ValueError):
    """A compatibility key field has a value that cannot be canonicalised."""


# design step 2 plus the fields of vLLM's own startup-plan key
KNOWN_FIELDS: tuple[str, ...] = (
    "model",
    "model_revision",
    "vllm_version",
    "vllm_commit",
    "torch_version",
    "cuda_version",
    "gpu_name",
    "total_bytes",
    "compute_capability",
    "driver_version",
    "world_size",
    "rank_count",
    "kv_cache_dtype",
    "dtype",
    "quantization",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "enforce_eager",
    "compilation_config",
    "cuda_graph_sizes",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "block_size",
    "enable_sleep_mode",
    "pytorch_cuda_alloc_conf",
    "kv_offloading_backend",
    "kv_offloading_size",
    "kv_transfer_config",
    "cpu_offload_gb",
    "limit_mm_per_prompt",
)

INT_FIELDS = frozenset(
    {
        "total_bytes",
        "world_size",
        "rank_count",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "block_size",
    }
)
BOOL_FIELDS = frozenset({"enforce_eager", "enable_sleep_mode"})
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _generic(value: Any, where: str) -> Any:
    # exact built-in types out, whatever subclasses came in (Ansible tags its values)
    if value is None:
        return None
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value.strip())
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CompatError(f"compat.{where}: not a finite number: {value!r}")
        return int(value) if value.is_integer() else float(value)
    if isinstance(value, Mapping):
        return {str(k): _generic(v, f"{where}.{k}") for k, v in sorted(value.items(), key=lambda kv: str(kv[0])) if v is not None}
    if isinstance(value, (list, tuple)):
        return [_generic(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise CompatError(f"compat.{where}: unsupported value {value!r} ({type(value).__name__})")


def _canonical_value(name: str, value: Any) -> Any:
    if name in INT_FIELDS:
        if isinstance(value, bool):
            raise CompatError(f"compat.{name}: expected an integer, got {value!r}")
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value.strip())
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise CompatError(f"compat.{name}: expected an integer, got {value!r}")
        return int(value)
    if name in BOOL_FIELDS:
        if isinstance(value, bool):
            return bool(value)
        text = str(value).strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise CompatError(f"compat.{name}: expected a boolean, got {value!r}")
    if name == "compute_capability" and isinstance(value, (list, tuple)) and len(value) == 2:
        return f"{int(value[0])}.{int(value[1])}"
    if name == "cuda_graph_sizes" and isinstance(value, (list, tuple)):
        return sorted(_generic(v, name) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and name in ("compute_capability", "cpu_offload_gb"):
        return str(value) if name == "compute_capability" else _generic(value, name)
    return _generic(value, name)


@dataclass(frozen=True)
class CompatKey:
    """Canonical compatibility fields and their hash."""

    fields: dict[str, Any] = field(default_factory=dict)
    hash: str = ""
    full_hash: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"fields": dict(self.fields), "hash": self.hash, "full_hash": self.full_hash}


def canonical_json(fields: Mapping[str, Any]) -> str:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def compat_key(fields: Mapping[str, Any] | CompatKey) -> CompatKey:
    """Canonicalise ``fields`` and hash them. ``None`` values are dropped."""
    if isinstance(fields, CompatKey):
        return fields
    if not isinstance(fields, Mapping):
        raise CompatError(f"compat: expected a dict of key fields, got {type(fields).__name__}")
    canon: dict[str, Any] = {}
    for raw_name, value in fields.items():
        name = str.__str__(str(raw_name).strip())
        if not name:
            raise CompatError("compat: empty field name")
        if value is None:
            continue
        canon[name] = _canonical_value(name, value)
    full = hashlib.sha256(canonical_json(canon).encode("ascii")).hexdigest()
    return CompatKey(fields=dict(sorted(canon.items())), hash=full[:16], full_hash=full)


def diff_keys(a: Mapping[str, Any] | CompatKey, b: Mapping[str, Any] | CompatKey) -> list[dict[str, Any]]:
    """Fields whose canonical values differ: ``[{field, reference, current}]`` (``a`` is the reference).

    A field present on one side only shows ``None`` on the other. Sorted by field name.
    """
    ka, kb = compat_key(a), compat_key(b)
    out = []
    for name in sorted(set(ka.fields) | set(kb.fields)):
        ref, cur = ka.fields.get(name), kb.fields.get(name)
        if ref != cur or type(ref) is not type(cur):
            out.append({"field": name, "reference": ref, "current": cur})
    return out

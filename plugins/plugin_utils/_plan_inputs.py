# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the class planner reads: its input types and their parsing.

Plain Python, no Ansible import. :func:`parse_reference` and :func:`parse_hosts` turn the
``reference`` and ``hosts`` of a ``kv_plan`` input into :class:`Reference` and :class:`Host`
records (bytes as integers), :func:`admission_need` the ``admission`` plan; :func:`size` is
the byte/count field they all use. Every malformed field raises :class:`PlanError` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional, Tuple, TypedDict

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._boot_check import boot_timeout as _boot_timeout
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import MAX_BYTES, SizeError, parse_size
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError, boolean

__all__ = ["Host", "HostRank", "PlanError", "RefRank", "Reference", "admission_need", "boot_timeout_for", "parse_hosts", "parse_reference",
           "reference_boot_seconds", "size"]


class PlanError(ValueError):
    """The plan input is malformed (message names the field)."""


class _RefRankFigures(TypedDict):
    rank: int
    free_bytes: int  # F_ref
    kv_bytes: int  # B_ref
    kv_source: str  # "suggestion" (vLLM's fit suggestion) or "in_use" (the KV bytes the engine allocated)


class RefRank(_RefRankFigures, total=False):
    """One rank of the parsed reference profile."""

    kv_bytes_full: int  # vLLM's "fully utilize" suggestion, when it logged one


class Reference(TypedDict):
    """The reference profile as :func:`parse_reference` returns it (bytes as integers)."""

    ranks: list[RefRank]
    vllm_free: dict[int, int]
    total_bytes: int | None
    block_size: int | None  # the profiled engine's (or a given) block size; None: vLLM's own choice is derived
    block_size_given: bool
    runtime: dict[str, Any]  # the engine the reference was profiled on: vllm_version, torch_version, compute_capability, cuda_version
    bytes_per_block: int | None
    geometry: Any  # {config, serve_args} as given; reference_geometry checks it
    kv_dtype_bytes: Any
    num_blocks: int | None
    kv_cache_tokens: int | None
    engine_kv_bytes: int | None
    max_concurrency: float | None
    max_model_len: int | None
    gpu_name: Any
    key_hash: Any  # the compatibility key's hash (input reference.compat_hash, or a kv_profile record's key_hash)
    boot_seconds: float | None  # the profiled canary's boot (start to /health), when the record has it


# One rank of a host as parse_hosts returns it: (rank, boot_free_bytes, free_min_bytes, free_max_bytes,
# GPU name, total bytes, flagged unstable, history_spread_bytes, history_min_bytes). A typing alias,
# evaluated at run time: target hosts may run Python < 3.9.
HostRank = Tuple[int, int, Optional[int], Optional[int], Any, Any, bool, Optional[int], Optional[int]]


class Host(TypedDict):
    """One host of the class as :func:`parse_hosts` returns it."""

    ranks: list[HostRank]
    unstable: bool
    gpu_name: Any
    total_bytes: Any
    key_hash: Any  # input hosts.<host>.compat_hash


def size(value: Any, field: str) -> int:
    """A non-negative byte size or count (an integer or ``"42GiB"``); :class:`PlanError` naming ``field`` otherwise."""
    if isinstance(value, int) and 0 <= value <= MAX_BYTES and not isinstance(value, bool):  # fast path for large fleets
        return value
    try:
        return parse_size(value, field)
    except SizeError as exc:
        raise PlanError(str(exc)) from None


def _signed_size(value: Any, field: str) -> int:
    """Like :func:`size` but keeps a negative integer (vLLM suggestions can be negative)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_BYTES:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return -size(-value, field)
    if isinstance(value, str) and value.strip().startswith("-"):
        return -size(value.strip()[1:], field)
    return size(value, field)


def _rank_no(value: Any, field: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanError(f"{field}: rank must be a non-negative integer, got {value!r}")
    return value


# the runtime facts of a reference that decide which vLLM release's rules plan it (the compatibility key's fields)
_RUNTIME_KEYS = ("vllm_version", "torch_version", "compute_capability", "cuda_version")


def parse_reference(raw: Any) -> Reference | None:
    """The input's ``reference`` (a recorded profile or a whole ``kv_profile`` record); None when absent or without ranks."""
    if raw is None or raw == {} or raw == "":
        return None
    if not isinstance(raw, Mapping):
        raise PlanError(f"reference: expected a mapping (a recorded profile), got {type(raw).__name__}")
    ref = dict(raw)
    key_hash = ref.get("compat_hash")
    runtime = {k: ref.get(k) for k in _RUNTIME_KEYS if ref.get(k) is not None}
    if "ranks" not in ref and isinstance(ref.get("profile"), Mapping):
        # a whole kv_profile record: unwrap it; its compatibility key names the runtime it was profiled on
        key_hash = key_hash or ref.get("key_hash")
        compat_raw = ref.get("compat")
        compat: Mapping[str, Any] = compat_raw if isinstance(compat_raw, Mapping) else {}
        runtime = {k: compat.get(k) for k in _RUNTIME_KEYS if compat.get(k) is not None}
        ref = dict(ref["profile"])
        key_hash = ref.get("compat_hash") or key_hash
        runtime.update((k, ref[k]) for k in _RUNTIME_KEYS if ref.get(k) is not None)
    ranks_raw = ref.get("ranks")
    if not ranks_raw:
        return None
    if not isinstance(ranks_raw, list):
        raise PlanError("reference.ranks: expected a list of {rank, free_bytes, kv_bytes}")
    ranks: list[RefRank] = []
    seen: set[int] = set()
    for i, entry in enumerate(ranks_raw):
        where = f"reference.ranks[{i}]"
        if not isinstance(entry, Mapping):
            raise PlanError(f"{where}: expected a mapping with rank, free_bytes, kv_bytes")
        rank = _rank_no(entry.get("rank", i), f"{where}.rank")
        if rank in seen:
            raise PlanError(f"{where}: rank {rank} appears twice in the reference")
        seen.add(rank)
        if entry.get("free_bytes") is None:
            raise PlanError(f"{where}.free_bytes is required")
        kv_source = "suggestion"
        kv_raw = entry.get("kv_bytes")
        if kv_raw is None:
            # builds without a "fit" suggestion (the CPU build): the KV memory the engine actually allocated
            for key, source in (("kv_bytes_in_use", "in_use"), ("current_kv_bytes", "in_use"), ("auto_kv_bytes", "in_use")):
                if entry.get(key) is not None:
                    kv_raw, kv_source = entry[key], source
                    break
            else:
                if ref.get("engine_kv_bytes") is not None:
                    kv_raw, kv_source = ref["engine_kv_bytes"], "in_use"
        if kv_raw is None:
            raise PlanError(
                f"{where}.kv_bytes is required (vLLM's fit suggestion), or the KV bytes the engine allocated "
                f"({where}.kv_bytes_in_use, or reference.engine_kv_bytes)"
            )
        item: RefRank = {
            "rank": rank,
            "free_bytes": size(entry["free_bytes"], f"{where}.free_bytes"),
            "kv_bytes": _signed_size(kv_raw, f"{where}.kv_bytes"),
            "kv_source": kv_source,
        }
        if entry.get("kv_bytes_full") is not None:
            item["kv_bytes_full"] = _signed_size(entry["kv_bytes_full"], f"{where}.kv_bytes_full")
        ranks.append(item)
    ranks.sort(key=lambda r: r["rank"])
    vllm_free: dict[int, int] = {}
    raw_vf = ref.get("vllm_free_bytes") or {}
    if not isinstance(raw_vf, Mapping):
        raise PlanError("reference.vllm_free_bytes: expected a mapping rank -> bytes")
    for key, value in raw_vf.items():
        if value is None:
            continue
        vllm_free[_rank_no(key, "reference.vllm_free_bytes")] = size(value, f"reference.vllm_free_bytes[{key}]")
    out: Reference = {
        "ranks": ranks,
        "vllm_free": vllm_free,
        "total_bytes": size(ref["total_bytes"], "reference.total_bytes") if ref.get("total_bytes") is not None else None,
        "block_size": None if ref.get("block_size") is None else size(ref["block_size"], "reference.block_size"),
        "block_size_given": ref.get("block_size") is not None,
        "runtime": runtime,
        "bytes_per_block": size(ref["bytes_per_block"], "reference.bytes_per_block") if ref.get("bytes_per_block") is not None else None,
        "geometry": ref.get("geometry"),
        "kv_dtype_bytes": ref.get("kv_dtype_bytes"),
        "num_blocks": size(ref["num_blocks"], "reference.num_blocks") if ref.get("num_blocks") is not None else None,
        "kv_cache_tokens": size(ref["kv_cache_tokens"], "reference.kv_cache_tokens") if ref.get("kv_cache_tokens") is not None else None,
        "engine_kv_bytes": size(ref["engine_kv_bytes"], "reference.engine_kv_bytes") if ref.get("engine_kv_bytes") is not None else None,
        "max_concurrency": _concurrency(ref.get("max_concurrency")),
        "max_model_len": size(ref["max_model_len"], "reference.max_model_len") if ref.get("max_model_len") is not None else None,
        "gpu_name": ref.get("gpu_name"),
        "key_hash": key_hash,
        "boot_seconds": _boot_seconds(ref.get("canary")),
    }
    for key, value in runtime.items():
        if not isinstance(value, (str, int, float)) or isinstance(value, bool) or any(ord(c) < 32 for c in str(value)):
            raise PlanError(f"reference.{key}: expected a version string, got {value!r}")
    if out["block_size"] is not None and out["block_size"] <= 0:
        raise PlanError(f"reference.block_size must be positive, got {ref.get('block_size')!r}")
    total = out["total_bytes"]
    if total is not None:
        for item in ranks:
            if item["free_bytes"] > total:
                raise PlanError(f"reference.ranks[rank {item['rank']}].free_bytes {item['free_bytes']} is above "
                                f"reference.total_bytes {total}: free memory cannot exceed the GPU's total")
        for rank_no, free in vllm_free.items():
            if free > total:
                raise PlanError(f"reference.vllm_free_bytes[{rank_no}] {free} is above reference.total_bytes {total}")
    return out


def reference_boot_seconds(doc: Mapping[str, Any]) -> float | None:
    """The measured boot of a class: a plan's ``boot_seconds``, else the canary's of a reference
    profile or of a whole profile-store record (``profile.canary.startup_seconds``)."""
    if doc.get("boot_seconds") is not None:
        return _seconds(doc["boot_seconds"], "boot_seconds")
    profile = doc.get("profile")
    return _boot_seconds((profile if isinstance(profile, Mapping) else doc).get("canary"))


def boot_timeout_for(configured: Any, measured: Any = None, serve_args: Mapping[str, Any] | None = None,
                     field: str = "boot_timeout") -> int:
    """Seconds a start may take: ``configured`` (0 derives it) from ``measured`` - seconds, or a
    plan, reference profile or profile-store record (:func:`reference_boot_seconds`) - and the
    serve args (``enforce_eager``). The one reading of the measured boot behind the ``boot_timeout``
    filter and the class plan's outline; raises :class:`PlanError` or ``EngineSpecError``."""
    seconds = reference_boot_seconds(measured) if isinstance(measured, Mapping) else measured
    return _boot_timeout(configured, seconds, (serve_args or {}).get("enforce_eager", False), field)[0]


def _boot_seconds(canary: Any) -> float | None:
    """The profiled canary's boot time (``canary.startup_seconds``), or None when the record has none."""
    if not isinstance(canary, Mapping) or canary.get("startup_seconds") is None:
        return None
    return _seconds(canary["startup_seconds"], "reference.canary.startup_seconds")


def _seconds(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise PlanError(f"{field}: expected a number of seconds, got {value!r}")
    return float(value)


def _concurrency(value: Any) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PlanError(f"reference.max_concurrency: expected a number (vLLM's maximum concurrency), got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise PlanError(f"reference.max_concurrency must be positive, got {value!r}")
    return number


def _flag(value: Any, field: str) -> bool:
    """A boolean as Ansible reads it; any other word (``"maybe"``) is an error, never a quiet false."""
    try:
        return boolean(value, field)
    except ValidationError as exc:
        raise PlanError(str(exc)) from None


def parse_hosts(raw: Any) -> dict[str, Host]:
    """The input's ``hosts``: host -> list of ranks, or host -> mapping with ``ranks`` and host-wide attributes."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise PlanError(f"hosts: expected a mapping host -> list of ranks, got {type(raw).__name__}")
    hosts: dict[str, Host] = {}
    for name, value in raw.items():
        host = str(name)
        attrs: Mapping[str, Any] = {}
        if isinstance(value, Mapping):
            attrs = value
            value = value.get("ranks")
        if not isinstance(value, list):
            raise PlanError(f"hosts.{host}: expected a list of ranks (or a mapping with ranks)")
        ranks: list[HostRank] = []
        append = ranks.append
        for i, entry in enumerate(value):
            if not isinstance(entry, Mapping):
                raise PlanError(f"hosts.{host}[{i}]: expected a mapping with rank and boot_free_bytes")
            get = entry.get
            rank = get("rank", i)
            if not isinstance(rank, int) or rank < 0 or isinstance(rank, bool) or rank > MAX_BYTES:
                rank = _rank_no(rank, f"hosts.{host}[{i}].rank")
            free = get("boot_free_bytes")
            if free is None:
                free = get("free_bytes")
                if free is None:
                    raise PlanError(f"hosts.{host}[{i}] (rank {rank}): boot_free_bytes is required")
                if not isinstance(free, int) or free < 0 or isinstance(free, bool) or free > MAX_BYTES:
                    free = size(free, f"hosts.{host}[{i}].free_bytes")
            elif not isinstance(free, int) or free < 0 or isinstance(free, bool) or free > MAX_BYTES:
                free = size(free, f"hosts.{host}[{i}].boot_free_bytes")
            fmin = get("free_min_bytes")
            if fmin is not None and (not isinstance(fmin, int) or fmin < 0 or isinstance(fmin, bool) or fmin > MAX_BYTES):
                fmin = size(fmin, f"hosts.{host}[{i}].free_min_bytes")
            fmax = get("free_max_bytes")
            if fmax is not None and (not isinstance(fmax, int) or fmax < 0 or isinstance(fmax, bool) or fmax > MAX_BYTES):
                fmax = size(fmax, f"hosts.{host}[{i}].free_max_bytes")
            flagged = get("unstable", False)
            flagged = flagged if isinstance(flagged, bool) else _flag(flagged, f"hosts.{host}[{i}].unstable")
            if fmin is not None and fmax is not None and fmin > fmax:
                raise PlanError(f"hosts.{host}[{i}] (rank {rank}): free_min_bytes {fmin} is above free_max_bytes {fmax}")
            # how far boot-free memory moved across this rank's recent probes (the probe history)
            moved = get("history_spread_bytes")
            if moved is not None and (not isinstance(moved, int) or moved < 0 or isinstance(moved, bool)):
                moved = size(moved, f"hosts.{host}[{i}].history_spread_bytes")
            lowest = get("history_min_bytes")
            if lowest is not None and (not isinstance(lowest, int) or lowest < 0 or isinstance(lowest, bool)):
                lowest = size(lowest, f"hosts.{host}[{i}].history_min_bytes")
            append((rank, free, fmin, fmax, get("gpu_name") or get("name"), get("total_bytes"), flagged, moved, lowest))
        hosts[host] = {
            "ranks": ranks,
            "unstable": _flag(attrs.get("unstable", False), f"hosts.{host}.unstable"),
            "gpu_name": attrs.get("gpu_name"),
            "total_bytes": attrs.get("total_bytes"),
            "key_hash": attrs.get("compat_hash"),
        }
    return hosts


def admission_need(adm: Any) -> tuple[str, int, int] | None:
    """The admission plan as ``("tokens", N, 0)`` or ``("concurrency", C, L)``."""
    if not adm:
        return None
    if not isinstance(adm, Mapping):
        raise PlanError("admission: expected {tokens: N} or {concurrency: C, tokens_per_request: L}")
    if adm.get("tokens") is not None:
        return "tokens", size(adm["tokens"], "admission.tokens"), 0
    if adm.get("concurrency") is not None and adm.get("tokens_per_request") is not None:
        conc = size(adm["concurrency"], "admission.concurrency")
        per = size(adm["tokens_per_request"], "admission.tokens_per_request")
        return "concurrency", conc, per
    raise PlanError("admission: expected {tokens: N} or {concurrency: C, tokens_per_request: L}")

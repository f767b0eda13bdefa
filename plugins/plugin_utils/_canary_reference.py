# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The reference profile ``kv_plan`` reads, built from a profiled canary's result.

Plain Python, no Ansible import. Per rank: NVML free memory just before the
boot (``free_bytes``), vLLM's "fit into requested memory" suggestion
(``kv_bytes``, GPU builds) and the KV memory the engine actually allocated
(``kv_bytes_in_use``: the log's "Current kv cache memory in use", or the CPU
build's "Auto set ... GiB for KV cache", which prints no suggestion). Engine
figures kept for capacity: blocks, block size, tokens, max concurrency (the
``/metrics`` figure, unrounded), ``max_model_len`` and, when ``/metrics`` gives
it, the exact KV bytes (``engine_kv_bytes``).

``reference_from_canary`` is the one builder: the ``kv_reference`` filter and
``kv_profile``'s ``canary`` option both call it. ``model_config_from`` picks the
model's ``config.json`` for the geometry from what the ``vllm_canary`` role has.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Callable, Mapping, Sequence

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import member_rank_offset
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import is_secret_option

__all__ = ["ReferenceError", "model_config_from", "reference_from_canary"]

# what the run result carries beside the canary's own figures: the pre-boot probe and the model's config
# (the reference keeps them as its ranks' free memory and its geometry) and what the takeover stopped
_DROPPED = ("log_tail", "invocation", "changed", "failed", "msg", "takeover", "gpu_probe", "model_config_file", "warnings")


class ReferenceError(ValueError):
    """The canary result or the pre-boot probe cannot make a reference (message names the field)."""


def _rank_gpu(preboot: Sequence[Mapping[str, Any]], gpus: Sequence[Any], place: int, rank: int) -> Mapping[str, Any]:
    """The pre-boot figures of the GPU of ``rank``, the ``place``-th of ``gpus``."""
    if place >= len(gpus):
        raise ReferenceError(f"canary rank {rank} has no GPU in the instance's gpus {list(gpus)}")
    index = int(gpus[place])
    for gpu in preboot:
        if int(gpu.get("index", -1)) == index:
            if gpu.get("free_bytes") is None:
                raise ReferenceError(f"pre-boot probe: GPU {index} has no free_bytes")
            return gpu
    raise ReferenceError(f"canary rank {rank}: GPU {index} is not in the pre-boot probe")


def _config_mapping(text: str | bytes, field: str) -> dict[str, Any]:
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ReferenceError(f"{field}: not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ReferenceError(f"{field}: expected a JSON object (the model's config.json), got {type(config).__name__}")
    return config


def model_config_from(
    model_config: Any,
    host_file: Mapping[str, Any] | None,
    read_controller_file: Callable[[str], str],
    field: str = "model_config",
) -> dict[str, Any] | None:
    """The model's ``config.json`` for the reference's geometry, or ``None`` when there is none.

    ``model_config`` wins: a mapping is the config itself, a non-empty string the path
    of a ``config.json`` on the controller (read with ``read_controller_file``). Else
    ``host_file``, the registered result of ``ansible.builtin.slurp`` reading the
    config on the canary host; a skipped slurp (no ``content``) means no geometry.
    ``field`` names ``model_config`` in the errors.
    """
    if isinstance(model_config, Mapping):
        return dict(model_config)
    if model_config not in (None, ""):
        if not isinstance(model_config, str):
            raise ReferenceError(f"{field}: expected a mapping or a controller path, got {type(model_config).__name__}")
        return _config_mapping(read_controller_file(model_config), f"{field} ({model_config})")
    if host_file is None or host_file.get("content") is None:
        return None
    content = host_file["content"]
    if not isinstance(content, str):
        raise ReferenceError("model_config_file.content: expected the base64 text ansible.builtin.slurp returns")
    try:
        raw = base64.b64decode(content, validate=True)
    except (binascii.Error, ValueError):
        raise ReferenceError("model_config_file.content: not base64 (expected the result of ansible.builtin.slurp)") from None
    return _config_mapping(raw, f"model_config_file ({host_file.get('source') or 'config.json'})")


def _ranks(
    run: Mapping[str, Any], preboot: Sequence[Mapping[str, Any]], gpus: Sequence[Any], host: str | None, where: str | None = None,
) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """One host's ranks of a canary run and vLLM's initial free memory per rank. A rank's GPU is the
    host's ``gpus`` at the rank's place among the host's ranks: the instance's ranks on one host, a
    member's global ranks of a gang (``host`` set, and kept on each rank). ``where`` names a member in errors."""
    prefix = f"{where}: " if where else ""
    if not isinstance(run, Mapping) or not isinstance(run.get("ranks"), list) or not run["ranks"]:
        raise ReferenceError(f"{prefix}canary result: ranks missing (was the canary run in profiled mode and did it boot?)")
    if not preboot:
        raise ReferenceError(f"{prefix}pre-boot probe: no GPUs (gpu_memory_info's gpus)")
    ranks: list[dict[str, Any]] = []
    vllm_free: dict[int, int] = {}
    for pos, entry in enumerate(run["ranks"]):
        rank = int(entry.get("rank", pos))
        try:
            gpu = _rank_gpu(preboot, gpus, pos if host is not None else rank, rank)
        except ReferenceError as exc:
            raise ReferenceError(f"{prefix}{exc}") from None
        in_use = entry.get("current_kv_bytes")
        if in_use is None:
            in_use = entry.get("auto_kv_bytes")
        item: dict[str, Any] = {
            "rank": rank,
            "free_bytes": int(gpu["free_bytes"]),
            "kv_bytes": entry.get("suggested_kv_bytes_fit"),
            "kv_bytes_full": entry.get("suggested_kv_bytes_full"),
        }
        if host is not None:
            item["host"] = host
        if in_use is not None:
            item["kv_bytes_in_use"] = int(in_use)
        ranks.append(item)
        if entry.get("initial_free_bytes") is not None:
            vllm_free[rank] = int(entry["initial_free_bytes"])
    return ranks, vllm_free


def reference_from_canary(
    run: Mapping[str, Any],
    preboot: Sequence[Mapping[str, Any]],
    gpus: Sequence[Any],
    *,
    config: Mapping[str, Any] | None = None,
    serve_args: Mapping[str, Any] | None = None,
    canary: Mapping[str, Any] | None = None,
    members: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The reference profile of one profiled canary run (``vllm_canary``'s result).

    ``members``: the other members of a canary gang (an instance over several hosts), each ``host``,
    ``result``, ``preboot_gpus`` and ``gpus`` as the run's own: their ranks join the reference's, every
    rank then naming its host (the run's own is ``canary['host']``), and ``members`` lists the gang's
    hosts, the run's (its leader) first. The engine's figures are the leader's: its canary measured the
    gang's engine."""
    serve_args = dict(serve_args or {})
    leader = str((canary or {}).get("host") or "") or None if members else None
    if members and leader is None:
        raise ReferenceError("canary.facts.host: a canary gang's reference names the host of each rank; the leader's is missing")
    ranks, vllm_free = _ranks(run, preboot, gpus, leader)
    hosts = [leader] if leader else []
    for i, member in enumerate(members or ()):
        host = str(member.get("host") or "")
        if not host or host in hosts:
            raise ReferenceError(f"members[{i}].host: expected a host of the gang other than {', '.join(hosts)}, got {host!r}")
        more, free = _ranks(member.get("result") or {}, member.get("preboot_gpus") or [], member.get("gpus") or [], host,
                            f"members[{i}] ({host})")
        # the members come in node-rank order, each giving the ranks after the ones before it; a log that numbers a
        # member's ranks within the member (the CPU build's data-parallel worker) is numbered in the instance here
        offset = member_rank_offset([r["rank"] for r in more], len(ranks), len(member.get("gpus") or []))
        if offset:
            more = [dict(r, rank=r["rank"] + offset) for r in more]
            free = {rank + offset: value for rank, value in free.items()}
        clash = sorted({r["rank"] for r in more} & {r["rank"] for r in ranks})
        if clash:
            raise ReferenceError(f"members[{i}] ({host}): rank(s) {', '.join(map(str, clash))} also reported by another member")
        ranks.extend(more)
        vllm_free.update(free)
        hosts.append(host)
    ranks.sort(key=lambda r: r["rank"])
    max_model_len = run.get("max_model_len") or serve_args.get("max_model_len")
    info = dict(canary or {})
    info.update(
        startup_seconds=run.get("startup_seconds"),
        max_concurrency=run.get("max_concurrency"),
        load=run.get("load"),
        preemptions=run.get("preemptions"),
        verdict=run.get("verdict"),
    )
    reference: dict[str, Any] = {
        "ranks": ranks,
        "vllm_free_bytes": vllm_free,
        "total_bytes": preboot[0].get("total_bytes"),
        "gpu_name": preboot[0].get("name"),
        "block_size": run.get("block_size"),
        "num_blocks": run.get("num_blocks"),
        "kv_cache_tokens": run.get("kv_cache_tokens"),
        "max_concurrency": run.get("max_concurrency"),
        "max_model_len": int(max_model_len) if max_model_len is not None else None,
        "engine_kv_bytes": run.get("kv_cache_memory_bytes"),
        # the geometry needs no secret option, and the store's records are not the place for one
        "geometry": {"config": dict(config), "serve_args": {k: v for k, v in serve_args.items() if not is_secret_option(str(k))}}
        if config is not None else None,
        "canary": info,
        "canary_result": {k: v for k, v in run.items() if k not in _DROPPED},
    }
    if members:
        reference["members"] = hosts
    return reference

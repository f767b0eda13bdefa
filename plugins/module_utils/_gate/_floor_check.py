# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The free-memory floor check: which ranks of an instance are below their floor, and by how much.

Plain Python, no Ansible import. The one rule both gates apply to an NVML reading:

* the rollout's free-memory gate (``_free_memory_gate``: on the controller on the status
  call's reading, and in ``vllm_unit``'s write call on the reading after the stop);
* the boot gate (``_boot_gate``: on the host at every start of a unit; ``vllm_service``
  installs this module with it).

A rank ``r`` of an instance runs on GPU ``gpus[r]``; its floor is the NVML boot-free memory
its start needs (a launch record's per-rank ``free_floor_bytes``, or what a gate derives
for automatic profiling); its margin is ``free - floor``, negative below the floor.
"""

from __future__ import annotations

import typing as t

__all__ = ["below_floor", "floor_rows", "rank_floor", "shortfall"]


def rank_floor(floors: t.Mapping[t.Any, t.Any], rank: int) -> int | None:
    """The floor of ``rank`` in a per-rank ``free_floor_bytes`` map (keys int or str); None when it has none."""
    for key in (rank, str(rank)):
        if key in floors:
            return int(floors[key])
    return None


def floor_rows(gpu_indices: t.Iterable[t.Any], gpus: t.Iterable[t.Mapping[str, t.Any]],
               floors: t.Mapping[t.Any, t.Any]) -> list[dict[str, t.Any]]:
    """One row per rank of an instance whose rank ``r`` runs on GPU ``gpu_indices[r]``.

    ``gpus``: NVML figures per GPU (``index``, ``boot_free_bytes`` - free plus what this host's
    own units hold - or ``free_bytes``, ``total_bytes``, optional ``uuid``, ``pci_bus_id``,
    ``health``); ``floors``: ``{rank: bytes}`` (keys int or str, :func:`rank_floor`).

    Each row: ``rank``, ``gpu``, ``floor_bytes`` (None: no floor for the rank), ``free_bytes``
    and ``total_bytes`` (None: the reading lacks the GPU), ``margin_bytes`` (``free - floor``,
    None when either is missing); for a GPU the reading has, its ``uuid`` and ``pci_bus_id``,
    and its ``health`` when the reading has one.
    """
    by_index = {int(g["index"]): g for g in gpus}
    rows = []
    for rank, raw_index in enumerate(gpu_indices):
        index = int(raw_index)
        gpu = by_index.get(index)
        floor = rank_floor(floors, rank)
        row: dict[str, t.Any] = {"rank": rank, "gpu": index, "floor_bytes": floor, "free_bytes": None,
                                 "total_bytes": None, "margin_bytes": None}
        if gpu is not None:
            free = int(gpu.get("boot_free_bytes", gpu.get("free_bytes", 0)))
            row.update(free_bytes=free, total_bytes=int(gpu.get("total_bytes") or 0), uuid=gpu.get("uuid"),
                       pci_bus_id=gpu.get("pci_bus_id"))
            if gpu.get("health") is not None:
                row["health"] = gpu["health"]
            if floor is not None:
                row["margin_bytes"] = free - floor
        rows.append(row)
    return rows


def below_floor(rows: t.Iterable[t.Mapping[str, t.Any]]) -> list[t.Mapping[str, t.Any]]:
    """The rows of :func:`floor_rows` whose free memory is below their floor (margin < 0), in rank order."""
    return [r for r in rows if r["margin_bytes"] is not None and r["margin_bytes"] < 0]


def shortfall(rows: t.Iterable[t.Mapping[str, t.Any]]) -> int:
    """By how much the instance is below its floors: the largest ``floor - free`` over its ranks, 0 when none is below."""
    return max([0, *(-int(r["margin_bytes"]) for r in rows if r["margin_bytes"] is not None)])

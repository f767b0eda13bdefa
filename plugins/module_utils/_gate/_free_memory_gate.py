# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The rollout's free-memory gate: an NVML reading of a host's GPUs against the launch record.

Plain Python. The controller runs it on the reading the status call takes (the gate before
the stop, filter ``gpufleet.vllm.gate_violations``); the vllm_unit call that stops the
instances and writes the new units runs it on the host, on the reading it takes once they
stopped (the gate after the stop), before it writes anything.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._plan._launch import LaunchError, check_launch
from .._sizes import human_bytes
from ._floor_check import below_floor, floor_rows, rank_floor

__all__ = ["gate_violations", "rank_floor"]


def gate_violations(gpus: Sequence[Mapping[str, Any]] | Mapping[str, Any], instances: Sequence[Mapping[str, Any]],
                    launch: Mapping[str, Any]) -> list[str]:
    """Every rank of ``instances`` whose NVML boot-free memory is below what its start needs.

    ``gpus``: gpu_memory_info's ``gpus`` (``index``, ``total_bytes``, ``boot_free_bytes`` -
    free plus what this host's own units hold - and ``processes`` with ``own``), or a whole
    reading with them under ``gpus`` (vllm_unit's ``gpu_probe``); a reading whose probe
    failed (``error``) fails the gate with its error;
    ``instances``: ``{name, gpus}``, rank ``r`` on ``gpus[r]``; ``launch``: the class's launch
    record (``_launch``, utilization resolved). A manual budget needs the record's floor for
    the rank (``free_floor_bytes``); automatic profiling needs ``ceil(total * utilization)``,
    vLLM's own startup check. One sentence per rank that fails.
    """
    record = check_launch(launch)
    if isinstance(gpus, Mapping):
        if gpus.get("error"):
            return [f"the NVML probe failed: {gpus['error']}"]
        read: Sequence[Mapping[str, Any]] = gpus["gpus"]
    else:
        read = gpus
    floors = record["free_floor_bytes"]
    auto = not record["manual"]
    if auto and record["gpu_memory_utilization"] is None:
        raise LaunchError("launch.gpu_memory_utilization: an auto_profile record needs the utilization (launch_contract sets it)")
    utilization = float(record["gpu_memory_utilization"] or 0)
    by_index = {int(g["index"]): g for g in read}
    totals = {index: int(g["total_bytes"]) for index, g in by_index.items()} if auto else {}
    out = []
    for inst in instances:
        indices = [int(g) for g in inst["gpus"]]
        # automatic profiling: vLLM's own startup check, ceil(total * utilization), is the floor
        needs = {rank: math.ceil(totals[index] * utilization) for rank, index in enumerate(indices) if index in totals} if auto else floors
        rows = floor_rows(indices, read, needs)
        below = below_floor(rows)
        for row in rows:
            where = f"{inst['name']} rank {row['rank']} (GPU {row['gpu']})"
            if row["free_bytes"] is None:
                out.append(f"{where}: not found by NVML")
            elif row["floor_bytes"] is None:
                out.append(f"{where}: the plan has no floor for this rank")
            elif row in below:
                free, need = row["free_bytes"], row["floor_bytes"]
                others = [str(p["pid"]) for p in by_index[row["gpu"]].get("processes") or [] if not p.get("own")]
                out.append(f"{where}: boot-free {free} B ({human_bytes(free)}) < floor {need} B ({human_bytes(need)})"
                           + (f", other processes: {','.join(others)}" if others else ""))
    return out

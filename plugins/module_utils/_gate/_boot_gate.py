# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The boot gate: re-check an instance's free-memory floor with NVML at every unit start.

Plain Python with no Ansible import. ``vllm_service`` installs it on the host with a
small launcher (``gpufleet-vllm-boot-gate``) that systemd runs as the unit's
``ExecStart``; the launcher probes the instance's GPUs, decides, records the decision
in the instance's gate state file and then *replaces itself* (``execv``) with
``vllm serve``, its budget arguments lowered when the decision says so. Being the
unit's main process is what makes a refusal final: systemd honours
``RestartPreventExitStatus`` only for the main process, not for ``ExecStartPre``
commands (checked on systemd 252), so a refused start does not loop.

Policies (``vllm_service_boot_gate``):

* ``refuse``: any rank below its floor -> no start, one journal line naming the rank,
  its free memory and its floor, exit :data:`EXIT_REFUSED`.
* ``shrink``: the drift rule once more against the floor,
  ``B = B_plan - max over ranks of max(0, floor - F_boot)``; start with ``B`` only if
  it still holds one ``max_model_len`` request (its blocks + the null block) and the
  admission plan when the plan has one, else refuse. The startup utilization drops by
  the same bytes (vLLM's own free figure moves with NVML's).
* ``profile``: start without a byte budget, vLLM profiling at
  ``floor4((min F_boot - guard - allowance) / total)``, never above the plan's
  utilization (``allowance``: NVML floor minus vLLM floor, vLLM's CUDA context) nor above
  the plan's ``profile_max_utilization``, at which vLLM's profiling sizes the planned budget.

It never raises a budget: a rank above its floor starts the plan as written.

Under every policy, a start is refused when a rank's GPU is another card than the plan's
(``gpu_uuids``) or, with the plan file's ``boot_gate.gpu_health`` ``refuse`` (the default),
when it fails an NVML health check (``_gpu_health``: uncorrectable ECC errors since the driver
loaded, a row remapping pending or failed, pages pending retirement, a critical Xid event while
the gate listens, ``boot_gate.xid_wait_ms``); ``warn`` starts and names the GPU in the line.

The plan file (``<state_dir>/<instance>.plan.json``) is read in format 3 (the instance,
its GPUs and the gate's policy and state file, and the class's launch record, ``_launch``
and ``docs/launch-contract.md``), and in the formats earlier releases wrote: 1 (budget,
floors, utilization, tokens) and 2 (also guard, max_model_len, admission, capacity figures,
GPU ranks and the gate's policy and state file, beside each other).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import typing as t

from .._gpu._gpu_health import BLOCKING_CHECKS, HEALTH_POLICIES, listen_for_xids, unhealthy
from .._plan._kv_capacity import (
    SOURCES as CAPACITY_SOURCES,
    blocks_for_bytes,
    floor_utilization,
    full_attention_request_blocks,
    one_request_blocks,
    tokens_for_blocks,
)
from .._plan._launch import PLAN_CHECKSUM_VARIABLE, PLAN_FILE_FORMAT, LaunchError, check_launch, plan_checksum, rank_bytes
from .._units._instance import unit_name
from .._validate import int_field
from ._floor_check import below_floor, floor_rows, shortfall

PLAN_FORMATS = (1, 2, PLAN_FILE_FORMAT)
PLAN_FORMAT = PLAN_FILE_FORMAT
STATE_FORMAT = 1
POLICIES = ("refuse", "shrink", "profile")
# EX_CONFIG: systemd shows "status=78/CONFIG"; the unit lists it in RestartPreventExitStatus
EXIT_REFUSED = 78
# probe failures (no driver, GPU lost) keep the unit's normal restart policy
EXIT_PROBE_FAILED = 1
DEFAULT_CUDA_CONTEXT_BYTES = 1 << 30
# the longest the gate listens for Xid events before a start
MAX_XID_WAIT_MS = 10000
GIB = 1 << 30


class BootGateError(Exception):
    """The plan file or the gate's inputs are unusable; the message names the field."""


def _hb(value: int) -> str:
    """Bytes as GiB with two decimals (the journal line; exact bytes stand beside it)."""
    return f"{value / GIB:.2f} GiB"


def _int(doc: t.Mapping[str, t.Any], key: str, where: str, required: bool = True) -> int | None:
    return int_field(doc.get(key), f"{where}: {key}", required=required, error=BootGateError,
                     message="{field} must be an integer, got {value!r}")


# ---------------------------------------------------------------- plan file

def parse_plan(doc: t.Any, where: str = "plan file") -> dict[str, t.Any]:
    """Normalise a plan record of format 1, 2 or 3 into what the gate needs."""
    if not isinstance(doc, t.Mapping):
        raise BootGateError(f"{where}: expected a JSON object")
    fmt = doc.get("format")
    if fmt not in PLAN_FORMATS:
        raise BootGateError(f"{where}: format {fmt!r} is not one this gate reads ({', '.join(map(str, PLAN_FORMATS))})")
    checksum = plan_checksum(doc)  # of the file as written, before its launch fields are flattened
    if fmt == PLAN_FILE_FORMAT:
        doc = _with_launch_fields(doc, where)
    decision = doc.get("decision")
    manual = decision != "auto_profile"
    gpus = doc.get("gpus")
    if not isinstance(gpus, list) or not gpus or not all(isinstance(g, int) and not isinstance(g, bool) for g in gpus):
        raise BootGateError(f"{where}: gpus must be a non-empty list of NVML indices, got {gpus!r}")
    plan: dict[str, t.Any] = {
        "format": fmt,
        "instance": str(doc.get("instance") or ""),
        "unit": str(doc.get("unit") or ""),
        "host_class": doc.get("host_class"),
        "decision": decision,
        "manual": manual,
        "gpus": list(gpus),
        "gpu_uuids": _gpu_uuids(doc.get("gpu_uuids"), len(gpus), where),
        "gpu_pci_bus_ids": _gpu_pci_bus_ids(doc.get("gpu_pci_bus_ids"), len(gpus), where),
        "kv_cache_memory_bytes": _int(doc, "kv_cache_memory_bytes", where, required=manual),
        "num_blocks": _int(doc, "num_blocks", where, required=False),
        "kv_cache_tokens": _int(doc, "kv_cache_tokens", where, required=False),
        "free_floor_bytes": rank_bytes(doc.get("free_floor_bytes"), f"{where}: free_floor_bytes", signed=True, error=BootGateError),
        "vllm_floor_bytes": rank_bytes(doc.get("vllm_floor_bytes"), f"{where}: vllm_floor_bytes", signed=True, error=BootGateError),
        "guard_bytes": _int(doc, "guard_bytes", where, required=False),
        "max_model_len": _int(doc, "max_model_len", where, required=False),
        "planned_at": doc.get("planned_at"),
        "compat_key_hash": doc.get("compat_key_hash"),
        "checksum": checksum,
    }
    util = doc.get("gpu_memory_utilization")
    if util is not None and (isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < float(util) <= 1):
        raise BootGateError(f"{where}: gpu_memory_utilization must be a number in (0, 1], got {util!r}")
    plan["gpu_memory_utilization"] = float(util) if util is not None else None
    cap = doc.get("profile_max_utilization")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 <= float(cap) <= 1):
        raise BootGateError(f"{where}: profile_max_utilization must be a number in [0, 1], got {cap!r}")
    plan["profile_max_utilization"] = float(cap) if cap is not None else None
    if manual and plan["kv_cache_memory_bytes"] is not None and plan["kv_cache_memory_bytes"] <= 0:
        raise BootGateError(f"{where}: kv_cache_memory_bytes must be > 0 for a manual budget")
    admission = doc.get("admission")
    plan["admission_blocks"] = None
    plan["admission_tokens"] = None
    if isinstance(admission, t.Mapping):
        plan["admission_blocks"] = _int(admission, "required_blocks", f"{where}: admission", required=False)
        plan["admission_tokens"] = _int(admission, "required_tokens", f"{where}: admission", required=False)
    plan["capacity"] = _capacity_figures(doc, plan, where)
    gate_doc = doc.get("boot_gate")
    gate: t.Mapping[str, t.Any] = gate_doc if isinstance(gate_doc, t.Mapping) else {}
    plan["policy"] = gate.get("policy")
    plan["state_file"] = gate.get("state_file")
    health = gate.get("gpu_health", "refuse")  # plan files written before 2.0.0 name none: the default
    if health not in HEALTH_POLICIES:
        raise BootGateError(f"{where}: boot_gate.gpu_health must be one of {', '.join(HEALTH_POLICIES)}, got {health!r}")
    plan["gpu_health"] = health
    wait = _int(gate, "xid_wait_ms", f"{where}: boot_gate", required=False) or 0
    if not 0 <= wait <= MAX_XID_WAIT_MS:
        raise BootGateError(f"{where}: boot_gate.xid_wait_ms must be within 0..{MAX_XID_WAIT_MS}, got {wait}")
    plan["xid_wait_ms"] = wait
    return plan


def _with_launch_fields(doc: t.Mapping[str, t.Any], where: str) -> dict[str, t.Any]:
    """A format 3 plan file's launch record (``_launch``), checked, with its figures where
    formats 1 and 2 keep them (beside the instance's own fields)."""
    try:
        launch = check_launch(doc.get("launch"), f"{where}: launch")
    except LaunchError as exc:
        raise BootGateError(str(exc)) from None
    expect = launch["expect"] or {}
    flat = {key: launch[key] for key in ("decision", "kv_cache_memory_bytes", "gpu_memory_utilization", "profile_max_utilization",
                                         "free_floor_bytes", "vllm_floor_bytes", "guard_bytes", "admission", "capacity")}
    return {**doc, **flat, "num_blocks": expect.get("num_blocks"), "kv_cache_tokens": expect.get("kv_cache_tokens")}


def _capacity_figures(doc: t.Mapping[str, t.Any], plan: t.Mapping[str, t.Any], where: str) -> dict[str, t.Any] | None:
    """What turns a budget into blocks and tokens, as the planner counts them.

    The plan file's ``capacity`` (``_kv_capacity.capacity_record``): the capacity source,
    the page (or the profiled engine's blocks per byte) and, for multi-group layouts, the
    blocks one ``max_model_len`` request holds summed over every KV-cache group. Format 1
    files (and format 2 files written before the per-request blocks were recorded, for a
    multi-group layout) carry only the plan's blocks and tokens at its budget: scaled.
    """
    cap = doc.get("capacity")
    if isinstance(cap, t.Mapping) and cap.get("block_size") and (cap.get("bytes_per_block") or cap.get("engine_num_blocks")):
        here = f"{where}: capacity"
        source = cap.get("source") or "geometry"
        if source not in CAPACITY_SOURCES:
            raise BootGateError(f"{here}: source {source!r} is not one of {', '.join(CAPACITY_SOURCES)}")
        block = _int(cap, "block_size", here)
        bpb = _int(cap, "bytes_per_block", here, required=False)
        request_blocks = _int(cap, "blocks_per_request", here, required=False)
        engine_blocks = _int(cap, "engine_num_blocks", here, required=False)
        engine_bytes = _int(cap, "engine_kv_bytes", here, required=False)
        for name, value in (("block_size", block), ("bytes_per_block", bpb), ("blocks_per_request", request_blocks),
                            ("engine_num_blocks", engine_blocks), ("engine_kv_bytes", engine_bytes)):
            if value is not None and value <= 0:
                raise BootGateError(f"{here}: {name} must be > 0, got {value}")
        engine = (engine_blocks, engine_bytes) if engine_blocks and engine_bytes else None
        if not bpb and engine is None:
            raise BootGateError(f"{here}: without bytes_per_block the engine's engine_num_blocks and engine_kv_bytes are needed")
        if source == "geometry" or request_blocks:
            return {"source": source, "bytes_per_block": bpb, "block_size": block, "engine": engine,
                    "blocks_per_request": request_blocks,
                    "max_model_len": _int(cap, "max_model_len", here, required=False) or plan["max_model_len"]}
    blocks, tokens, budget = plan["num_blocks"], plan["kv_cache_tokens"], plan["kv_cache_memory_bytes"]
    if blocks and tokens and budget:
        return {"source": "scaled", "num_blocks": blocks, "kv_cache_tokens": tokens, "kv_cache_memory_bytes": budget,
                "block_size": max(1, tokens // blocks)}
    return None


def read_plan(path: str) -> dict[str, t.Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except FileNotFoundError:
        raise BootGateError(f"plan file {path} does not exist: deploy the instance with gpufleet.vllm.vllm_service") from None
    except (OSError, ValueError) as exc:
        raise BootGateError(f"plan file {path}: cannot read it: {exc}") from None
    return parse_plan(doc, f"plan file {path}")


def capacity(figures: t.Mapping[str, t.Any], kv_bytes: int) -> tuple[int, int]:
    """(blocks, tokens) vLLM makes from ``kv_bytes`` per rank, from the plan's capacity figures.

    ``geometry``, ``layout``, ``engine``: the planner's own arithmetic
    (``_kv_capacity``): whole pages, tokens as vLLM counts them for the layout.
    ``scaled``: the plan's own blocks and tokens at its budget, in proportion (rounded down).
    """
    if kv_bytes <= 0:
        return 0, 0
    if figures["source"] == "scaled":
        base = figures["kv_cache_memory_bytes"]
        return figures["num_blocks"] * kv_bytes // base, figures["kv_cache_tokens"] * kv_bytes // base
    blocks = blocks_for_bytes(kv_bytes, figures["bytes_per_block"], figures["engine"])
    tokens = tokens_for_blocks(blocks, figures["source"], figures["block_size"], figures["blocks_per_request"],
                               figures["max_model_len"])
    return blocks, tokens or 0


def request_blocks_needed(figures: t.Mapping[str, t.Any], max_model_len: int) -> int:
    """Blocks vLLM needs to admit one request of ``max_model_len`` (the null block included):
    the plan's per-request blocks of every KV-cache group, else one full-attention group."""
    per_request = figures.get("blocks_per_request")
    if not per_request or figures.get("max_model_len") not in (None, max_model_len):
        per_request = full_attention_request_blocks(max_model_len, figures["block_size"])
    return one_request_blocks(per_request)


# ---------------------------------------------------------------- decision

_GPU_UUID = re.compile(r"GPU-[0-9A-Fa-f-]{8,64}")


def _gpu_uuids(value: t.Any, count: int, where: str) -> list[str] | None:
    """The UUIDs of the instance's GPUs in rank order (a plan file names them when the probe read them); None: not named."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != count or not all(isinstance(u, str) and _GPU_UUID.fullmatch(u) for u in value):
        raise BootGateError(f"{where}: gpu_uuids must list one NVML UUID (GPU-...) per GPU of gpus ({count}), got {value!r}")
    return list(value)


def _gpu_pci_bus_ids(value: t.Any, count: int, where: str) -> list[str] | None:
    """The PCI bus ids of the instance's GPUs in rank order (informative: the UUIDs identify the cards); None: not named."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != count or not all(isinstance(b, str) and b and b.isprintable() for b in value):
        raise BootGateError(f"{where}: gpu_pci_bus_ids must list one PCI bus id per GPU of gpus ({count}), got {value!r}")
    return list(value)


def moved_gpus(plan: t.Mapping[str, t.Any], gpus: t.Sequence[t.Mapping[str, t.Any]]) -> list[str]:
    """The ranks whose GPU index now names another card than the one the plan was made for (by UUID).

    After a reboot in which a GPU fell off the bus, or a card was replaced, index ``i`` can be
    another GPU: its memory is not the one the floor was planned for, and an engine started on
    it runs on a card nobody planned. A GPU NVML did not give a UUID for is not judged.
    """
    planned = plan.get("gpu_uuids")
    if not planned:
        return []
    found = {int(g["index"]): g.get("uuid") for g in gpus}
    bus = {int(g["index"]): g.get("pci_bus_id") for g in gpus}
    planned_bus = plan.get("gpu_pci_bus_ids") or [None] * len(planned)
    where_now = {uuid: index for index, uuid in found.items() if uuid}
    out = []
    for rank, (index, uuid, slot) in enumerate(zip(plan["gpus"], planned, planned_bus)):
        now = found.get(index)
        if now and now != uuid:
            now_at = f" at PCI {bus[index]}" if bus.get(index) else ""
            was_at = f" at PCI {slot}" if slot else ""
            moved = f" ({uuid} is GPU {where_now[uuid]} now)" if uuid in where_now else ""
            out.append(f"rank {rank}: GPU {index} is {now}{now_at}, the plan was made for {uuid}{was_at}{moved}")
    return out


def rank_rows(plan: t.Mapping[str, t.Any], gpus: t.Sequence[t.Mapping[str, t.Any]]) -> list[dict[str, t.Any]]:
    """Per rank of the instance: GPU, NVML free memory now, floor, margin (free - floor) (``_floor_check.floor_rows``)."""
    return floor_rows(plan["gpus"], gpus, plan["free_floor_bytes"])


def health_findings(rows: t.Sequence[t.Mapping[str, t.Any]]) -> tuple[list[str], list[str]]:
    """(what stops a start, what is only reported): one line per rank whose GPU fails a health check,
    naming the rank, the GPU's index and UUID and why."""
    blocking, other = [], []
    for row in rows:
        found = unhealthy(row.get("health"))
        if not found:
            continue
        where = f"rank {row['rank']} (GPU {row['gpu']}{', ' + row['uuid'] if row.get('uuid') else ''})"
        stop = [why for check, why in found if check in BLOCKING_CHECKS]
        rest = [why for check, why in found if check not in BLOCKING_CHECKS]
        if stop:
            blocking.append(f"{where}: {'; '.join(stop)}")
        if rest:
            other.append(f"{where}: {'; '.join(rest)}")
    return blocking, other


def decide(plan: t.Mapping[str, t.Any], gpus: t.Sequence[t.Mapping[str, t.Any]], policy: str,
           cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES) -> dict[str, t.Any]:
    """The gate's verdict for one start (see :func:`_decide`), with the health findings a start goes
    on with (policy ``gpu_health: warn``, or checks that stop nothing) in its message and reasons."""
    out = _decide(plan, gpus, policy, cuda_context_bytes)
    noted = out.pop("_health_notes", [])
    if noted and out["action"] != "refuse":
        out["message"] += "; GPU health: " + "; ".join(noted)
    return out


def _decide(plan: t.Mapping[str, t.Any], gpus: t.Sequence[t.Mapping[str, t.Any]], policy: str,
            cuda_context_bytes: int = DEFAULT_CUDA_CONTEXT_BYTES) -> dict[str, t.Any]:
    """The gate's verdict for one start. ``gpus``: NVML figures (``index``, ``boot_free_bytes``
    or ``free_bytes``, ``total_bytes``). Returns ``action`` (``start``, ``shrink``,
    ``profile``, ``refuse``), the budget and tokens planned and started, ``degraded``,
    the per-rank rows and one ``message`` for the journal."""
    if policy not in POLICIES:
        raise BootGateError(f"policy {policy!r}: expected one of {', '.join(POLICIES)}")
    unit = plan.get("unit") or unit_name(str(plan.get("instance")))
    rows = rank_rows(plan, gpus)
    planned = {"kv_cache_memory_bytes": plan["kv_cache_memory_bytes"], "gpu_memory_utilization": plan["gpu_memory_utilization"],
               "num_blocks": plan["num_blocks"], "kv_cache_tokens": plan["kv_cache_tokens"]}
    out: dict[str, t.Any] = {"unit": unit, "policy": policy, "ranks": rows, "planned": planned, "started": dict(planned),
                             "degraded": None, "reasons": []}

    def refuse(why: str) -> dict[str, t.Any]:
        out.update(action="refuse", started=None, message=f"{unit}: boot gate ({policy}) refuses the start: {why}")
        out["reasons"].append(why)
        return out

    if not plan["manual"]:
        out.update(action="start", message=f"{unit}: boot gate: automatic profiling, nothing to check")
        return out
    if not plan["free_floor_bytes"]:
        # A plan without NVML ranks (the CPU build, or a plan made without a probe) promises no
        # free-memory floor: there is nothing to compare, and refusing would only stop the engine.
        out.update(action="start", message=(f"{unit}: boot gate: the plan names no free-memory floor (no NVML ranks); "
                                            f"nothing to check, starting the planned {plan['kv_cache_memory_bytes']} bytes"))
        return out
    missing = [r for r in rows if r["free_bytes"] is None]
    if missing:
        return refuse("; ".join(f"rank {r['rank']} (GPU {r['gpu']}) not found by NVML" for r in missing))
    moved = moved_gpus(plan, gpus)
    if moved:
        return refuse("; ".join(moved) + ": the card was replaced or the GPUs were enumerated anew; not starting on a card the plan "
                      "was not made for: deploy the host again to plan it on the GPUs it has now")
    blocking, other = health_findings(rows)
    if blocking and plan.get("gpu_health", "refuse") == "refuse":
        return refuse("; ".join(blocking) + ": not starting on an unhealthy GPU (gpu_health: refuse); reset or service the GPU, "
                      "or deploy with vllm_service_boot_gate_gpu_health: warn to start anyway")
    notes = [*(f"{line} (gpu_health: warn, starting anyway)" for line in blocking), *other]
    out["reasons"].extend(notes)
    out["_health_notes"] = notes
    unfloored = [r for r in rows if r["floor_bytes"] is None]
    if unfloored:
        return refuse("; ".join(f"rank {r['rank']} (GPU {r['gpu']}): the plan file has no floor for it" for r in unfloored))
    below = below_floor(rows)
    if not below:
        low = min(rows, key=lambda r: r["margin_bytes"])
        out.update(action="start", message=(
            f"{unit}: boot gate: every rank at or above its floor (lowest margin rank {low['rank']} GPU {low['gpu']}: "
            f"{_hb(low['margin_bytes'])}); starting the planned {plan['kv_cache_memory_bytes']} bytes"))
        return out
    shown = "; ".join(f"rank {r['rank']} (GPU {r['gpu']}) free {r['free_bytes']} B ({_hb(r['free_bytes'])}) "
                      f"< floor {r['floor_bytes']} B ({_hb(r['floor_bytes'])})" for r in below)
    if policy == "refuse":
        return refuse(shown + "; not starting (no restart: exit 78)")
    if policy == "profile":
        return _profile(out, plan, rows, shown, cuda_context_bytes, refuse)
    return _shrink(out, plan, rows, shown, refuse)


def _shrink(out: dict[str, t.Any], plan: t.Mapping[str, t.Any], rows: list[dict[str, t.Any]], shown: str,
            refuse: t.Callable[[str], dict[str, t.Any]]) -> dict[str, t.Any]:
    before = plan["kv_cache_memory_bytes"]
    short = shortfall(rows)
    after = before - short
    figures = plan["capacity"]
    if figures is None:
        return refuse(shown + "; shrink needs the plan's capacity figures (bytes per block), which this plan file lacks: "
                              "redeploy it to write a format 2 plan file")
    blocks_before, tokens_before = capacity(figures, before)
    if plan["num_blocks"] is not None and plan["kv_cache_tokens"] is not None:
        blocks_before, tokens_before = plan["num_blocks"], plan["kv_cache_tokens"]
    blocks_after, tokens_after = capacity(figures, after)
    degraded = {"kv_cache_memory_bytes_before": before, "kv_cache_memory_bytes_after": max(0, after),
                "kv_cache_tokens_before": tokens_before, "kv_cache_tokens_after": tokens_after,
                "num_blocks_before": blocks_before, "num_blocks_after": blocks_after, "shortfall_bytes": short}
    out["degraded"] = degraded
    if plan["max_model_len"]:
        need = request_blocks_needed(figures, plan["max_model_len"])
        if blocks_after < need:
            return refuse(f"{shown}; the shrunk budget {max(0, after)} B ({blocks_after} blocks) cannot hold one request of "
                          f"max_model_len {plan['max_model_len']} ({need} blocks with the null block)")
    else:
        out["reasons"].append("the plan file gives no max_model_len: the one-request check was skipped")
    if plan["admission_blocks"] is not None and blocks_after < plan["admission_blocks"]:
        return refuse(f"{shown}; the shrunk budget {max(0, after)} B gives {blocks_after} blocks ({tokens_after} tokens), "
                      f"below the admission plan's {plan['admission_blocks']} blocks ({plan['admission_tokens']} tokens)")
    util = plan["gpu_memory_utilization"]
    total = min(r["total_bytes"] for r in rows if r["total_bytes"])
    new_util = floor_utilization(math.ceil(total * util) - short, total) if util and total else util
    if not new_util or new_util <= 0:
        return refuse(f"{shown}; no --gpu-memory-utilization is left for vLLM's startup check after the shrink")
    out["started"] = {"kv_cache_memory_bytes": after, "gpu_memory_utilization": min(util or new_util, new_util),
                      "num_blocks": blocks_after, "kv_cache_tokens": tokens_after}
    out.update(action="shrink", message=(
        f"{out['unit']}: boot gate (shrink) starts degraded: {shown}; budget {before} -> {after} B "
        f"({_hb(before)} -> {_hb(after)}), tokens {tokens_before} -> {tokens_after}, "
        f"utilization {util} -> {out['started']['gpu_memory_utilization']}"))
    return out


def _profile(out: dict[str, t.Any], plan: t.Mapping[str, t.Any], rows: list[dict[str, t.Any]], shown: str,
             cuda_context_bytes: int, refuse: t.Callable[[str], dict[str, t.Any]]) -> dict[str, t.Any]:
    guard = plan["guard_bytes"] if plan["guard_bytes"] is not None else 0
    utils = []
    for r in rows:
        vllm_floor = plan["vllm_floor_bytes"].get(r["rank"])
        allowance = r["floor_bytes"] - vllm_floor if vllm_floor is not None else cuda_context_bytes
        utils.append(floor_utilization(r["free_bytes"] - guard - max(0, allowance), r["total_bytes"]))
    util = min(utils)
    capped = ""
    if plan["gpu_memory_utilization"]:
        util = min(util, plan["gpu_memory_utilization"])
    if plan["profile_max_utilization"] is not None and plan["profile_max_utilization"] < util:
        # vLLM's profiling would size more KV cache than the plan at the free-memory figure: never raise a budget
        util = plan["profile_max_utilization"]
        capped = f", capped at {util} so that vLLM's own profiling sizes at most the planned {plan['kv_cache_memory_bytes']} B"
    elif plan["profile_max_utilization"] is None:
        out["reasons"].append("the plan file gives no profile_max_utilization (the reference lacks vLLM's figures): the profiled "
                              "cache is bounded by the plan's startup utilization only")
    if util <= 0:
        return refuse(f"{shown}; no utilization is left for vLLM's own profiling after the guard {guard} B")
    out["started"] = {"kv_cache_memory_bytes": None, "gpu_memory_utilization": util, "num_blocks": None,
                      "kv_cache_tokens": None}
    out["degraded"] = {"kv_cache_memory_bytes_before": plan["kv_cache_memory_bytes"], "kv_cache_memory_bytes_after": None,
                       "kv_cache_tokens_before": plan["kv_cache_tokens"], "kv_cache_tokens_after": None,
                       "gpu_memory_utilization_after": util}
    out.update(action="profile", message=(
        f"{out['unit']}: boot gate (profile) starts with vLLM's own profiling: {shown}; "
        f"--gpu-memory-utilization {util} (lowest free minus guard {guard} B and the CUDA-context allowance{capped}) "
        f"instead of the manual budget {plan['kv_cache_memory_bytes']} B"))
    return out


# ---------------------------------------------------------------- argv and state

def _option_index(argv: list[str], name: str) -> int | None:
    for pos, word in enumerate(argv):
        if word == name or word.startswith(name + "="):
            return pos
    return None


def option_value(argv: t.Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` / ``--name=VALUE`` in an argv (None when absent)."""
    pos = _option_index(list(argv), name)
    if pos is None:
        return None
    word = argv[pos]
    if "=" in word:
        return word.split("=", 1)[1]
    return argv[pos + 1] if pos + 1 < len(argv) else None


def trust_problem(plan: t.Mapping[str, t.Any], engine: t.Sequence[str], recorded_checksum: str | None, path: str) -> str | None:
    """Why the gate must not start from this plan file, or None.

    The deploy records the plan file's checksum beside the unit (a drop-in, root's file, that
    systemd hands to the gate as ``GPUFLEET_PLAN_SHA256``): a plan file that differs was edited
    since (a doubled budget would have the gate start what nobody planned).
    The budget the plan names must also be the one the unit starts, so that the journal line
    never names a budget the engine does not get.
    """
    if recorded_checksum and plan.get("checksum") != recorded_checksum:
        return (f"plan file {path} was changed since the deploy wrote it (the unit's drop-in records checksum {recorded_checksum[:16]}, "
                f"the file has {str(plan.get('checksum'))[:16]}): deploy the instance again with gpufleet.vllm.vllm_service "
                "or put the file back")
    argv_budget = option_value(engine, "--kv-cache-memory-bytes")
    if plan.get("manual") and argv_budget is not None and str(plan.get("kv_cache_memory_bytes")) != argv_budget:
        return (f"plan file {path} names the budget {plan.get('kv_cache_memory_bytes')} B but the unit starts "
                f"{argv_budget} B: deploy the instance again with gpufleet.vllm.vllm_service")
    return None


def _set_option(argv: list[str], name: str, value: str | None) -> list[str]:
    """Set (or with None drop) ``--name VALUE`` / ``--name=VALUE`` in an argv."""
    out = list(argv)
    pos = _option_index(out, name)
    if pos is None:
        if value is not None:
            out += [name, value]
        return out
    width = 1 if "=" in out[pos] else 2
    if value is None:
        del out[pos:pos + width]
    elif width == 1:
        out[pos] = f"{name}={value}"
    else:
        out[pos + 1] = value
    return out


def engine_argv(argv: t.Sequence[str], verdict: t.Mapping[str, t.Any]) -> list[str]:
    """The engine's command line for the verdict: budget and utilization lowered (never raised)."""
    out = list(argv)
    action = verdict["action"]
    if action == "shrink":
        out = _set_option(out, "--kv-cache-memory-bytes", str(verdict["started"]["kv_cache_memory_bytes"]))
        out = _set_option(out, "--gpu-memory-utilization", str(verdict["started"]["gpu_memory_utilization"]))
    elif action == "profile":
        out = _set_option(out, "--kv-cache-memory-bytes", None)
        out = _set_option(out, "--gpu-memory-utilization", str(verdict["started"]["gpu_memory_utilization"]))
    return out


def write_json_atomic(path: str, doc: t.Mapping[str, t.Any], mode: int = 0o644) -> None:
    """Temporary file in the target directory, fsync, rename: readers see old or new, never a part."""
    import tempfile  # pylint: disable=import-outside-toplevel  # not at import: every unit start pays for it

    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(doc, handle, indent=2, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def state_record(plan: t.Mapping[str, t.Any], verdict: t.Mapping[str, t.Any], plan_path: str,
                 now: float, invocation_id: str | None, seconds: float) -> dict[str, t.Any]:
    return {
        "format": STATE_FORMAT,
        "plan_file": plan_path,
        "plan_format": plan["format"],
        "instance": plan["instance"],
        "unit": verdict["unit"],
        "checked_at": now,
        "invocation_id": invocation_id,
        "policy": verdict["policy"],
        "action": verdict["action"],
        "ranks": verdict["ranks"],
        "planned": verdict["planned"],
        "started": verdict["started"],
        "degraded": verdict["degraded"] if verdict["action"] in ("shrink", "profile") else None,
        "attempted": verdict["degraded"] if verdict["action"] == "refuse" else None,
        "reasons": verdict["reasons"],
        "message": verdict["message"],
        "gate_seconds": round(seconds, 4),
    }


def _parse_args(argv: t.Sequence[str]) -> tuple[dict[str, str], list[str]]:
    opts: dict[str, str] = {}
    words = list(argv)
    if "--" not in words:
        raise BootGateError("usage: gpufleet-vllm-boot-gate --plan FILE [--plan-sha256 HEX] [--policy P] [--state FILE] -- ENGINE ARGS...")
    cut = words.index("--")
    head, engine = words[:cut], words[cut + 1:]
    pos = 0
    while pos < len(head):
        key = head[pos]
        if key not in ("--plan", "--plan-sha256", "--policy", "--state", "--check-only") or (key != "--check-only" and pos + 1 >= len(head)):
            raise BootGateError(f"unknown or incomplete option {key!r}")
        if key == "--check-only":
            opts["check_only"] = "1"
            pos += 1
            continue
        opts[key[2:]] = head[pos + 1]
        pos += 2
    if "plan" not in opts:
        raise BootGateError("--plan FILE is required")
    if not engine and "check_only" not in opts:
        raise BootGateError("no engine command after --")
    return opts, engine


def _journal(line: str) -> None:
    """One line on stderr, which systemd writes to the unit's journal."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def load_pynvml() -> t.Any:
    """NVIDIA's ``pynvml`` binding: the installed ``nvidia-ml-py``, else the copy vLLM ships as
    ``vllm/third_party/pynvml.py`` (a vLLM venv often has only that one). The copy is loaded from
    its file alone: importing the ``vllm`` package would pull in torch at every unit start."""
    import importlib.util  # pylint: disable=import-outside-toplevel

    try:
        import pynvml  # pylint: disable=import-outside-toplevel
        return pynvml
    except ImportError as exc:
        missing = exc
    spec = importlib.util.find_spec("vllm")
    for where in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(where, "third_party", "pynvml.py")
        if os.path.isfile(path):
            vendored = importlib.util.spec_from_file_location("pynvml", path)
            if vendored is not None and vendored.loader is not None:
                module = importlib.util.module_from_spec(vendored)
                sys.modules["pynvml"] = module  # the binding looks itself up there while it loads
                try:
                    vendored.loader.exec_module(module)
                except Exception:
                    del sys.modules["pynvml"]
                    raise
                return module
    raise ImportError(f"{missing}; and no vllm/third_party/pynvml.py beside this interpreter's vLLM")


def run(argv: t.Sequence[str], nvml: t.Any = None, execv: t.Callable[[str, list[str]], t.Any] | None = None,
        log: t.Callable[[str], None] | None = None, clock: t.Callable[[], float] = time.time) -> int:
    """The launcher: returns the exit status when it does not hand over to the engine."""
    from .._gpu._nvml_probe import NvmlProbeError, probe  # pylint: disable=import-outside-toplevel

    emit = log or _journal
    started = time.monotonic()
    try:
        opts, engine = _parse_args(argv)
        plan = read_plan(opts["plan"])
        policy = opts.get("policy") or plan["policy"] or "shrink"
        if policy not in POLICIES:
            raise BootGateError(f"policy {policy!r}: expected one of {', '.join(POLICIES)}")
        # the deploy's drop-in beside the unit gives the checksum (root's file); --plan-sha256 by hand
        recorded = opts.get("plan-sha256") or os.environ.get(PLAN_CHECKSUM_VARIABLE) or None
        problem = trust_problem(plan, engine, recorded, opts["plan"])
        if problem:
            raise BootGateError(f"{plan['unit'] or 'the unit'}: {problem}")
    except BootGateError as exc:
        emit(f"gpufleet boot gate: {exc}; not starting (exit {EXIT_REFUSED})")
        return EXIT_REFUSED
    state_path = opts.get("state") or plan["state_file"]
    if plan["manual"] and plan["free_floor_bytes"]:
        if nvml is None:
            try:
                nvml = load_pynvml()
            except ImportError as exc:
                emit(f"gpufleet boot gate: {plan['unit']}: cannot import pynvml ({exc}); not starting")
                return EXIT_PROBE_FAILED
        try:
            found = probe(nvml, devices=plan["gpus"], samples=1, host=os.uname().nodename)
        except NvmlProbeError as exc:
            emit(f"gpufleet boot gate: {plan['unit']}: NVML probe failed: {exc}; not starting")
            return EXIT_PROBE_FAILED
        gpus = found["gpus"]
        if plan["xid_wait_ms"]:
            # only Xids raised while the gate listens reach it (NVML delivers no earlier event)
            xids = listen_for_xids(nvml, [int(g["index"]) for g in gpus], plan["xid_wait_ms"])
            for gpu in gpus:
                if int(gpu["index"]) in xids and isinstance(gpu.get("health"), dict):
                    gpu["health"]["xid"] = xids[int(gpu["index"])]
    else:
        gpus = []
    verdict = decide(plan, gpus, policy)
    seconds = time.monotonic() - started
    # a check (--check-only: "what would a start do now", asked by hand) is not a start:
    # the record of the last start, which the boot check and the metrics read, stays that start's
    if state_path and "check_only" not in opts:
        try:
            write_json_atomic(state_path, state_record(plan, verdict, opts["plan"], clock(),
                                                       os.environ.get("INVOCATION_ID"), seconds))
        except OSError as exc:
            emit(f"gpufleet boot gate: {plan['unit']}: cannot write the gate state {state_path}: {exc}")
    emit(verdict["message"])
    if verdict["action"] == "refuse":
        return EXIT_REFUSED
    if "check_only" in opts:
        return 0
    command = engine_argv(engine, verdict)
    (execv or os.execv)(command[0], command)
    return 0  # only reached with an injected execv


# ---------------------------------------------------------------- the boot check's side

def read_state(path: str) -> dict[str, t.Any] | None:
    """The gate's last record (None when there is none or it is unreadable)."""
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == STATE_FORMAT else None


def wait_state(path: str, invocation_id: t.Callable[[], str | None], timeout: float = 30.0,
               sleep: t.Callable[[float], None] = time.sleep, clock: t.Callable[[], float] = time.monotonic) -> dict[str, t.Any] | None:
    """The gate's record of the unit's current start: it names the unit's InvocationID.

    The start job of a ``Type=exec`` unit completes when the gate program was executed,
    before it decided, so a caller right after ``systemctl restart`` may have to wait a
    moment. None when no record of this start appears within ``timeout``.
    """
    deadline = clock() + timeout
    while True:
        current = invocation_id()
        state = read_state(path)
        if state is not None and current and state.get("invocation_id") == current:
            return state
        if clock() >= deadline:
            return None
        sleep(0.2)


def boot_expectations(state: t.Mapping[str, t.Any] | None, expected_bytes: int | None,
                      min_tokens: int | None) -> tuple[int | None, int | None, dict[str, t.Any] | None]:
    """What a boot check compares with after the gate: (expected bytes, min tokens, degraded).

    A shrink lowers both to what the gate started (never above the plan); a profiled start
    has no byte budget to compare. Without a record of this start, the plan stands.
    """
    if not state or state.get("action") not in ("shrink", "profile"):
        return expected_bytes, min_tokens, None
    started = state.get("started") or {}
    degraded = dict(state.get("degraded") or {}, policy=state.get("policy"), action=state.get("action"),
                    message=state.get("message"))
    if state["action"] == "profile":
        return None, None, degraded
    got = started.get("kv_cache_memory_bytes")
    if expected_bytes is not None and isinstance(got, int) and got <= expected_bytes:
        expected_bytes = got
    tokens = started.get("kv_cache_tokens")
    if min_tokens is not None and isinstance(tokens, int):
        min_tokens = min(min_tokens, tokens)
    return expected_bytes, min_tokens, degraded

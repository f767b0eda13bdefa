# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The launch contract: what one host class starts vLLM with, and what every start must show.

Plain Python with no Ansible import: the planner (``kv_plan``) builds the record on the
controller, and the boot gate reads it on the host from the instance's plan file.

``kv_plan`` returns, besides its analysis, one ``launch`` record per class (schema
:data:`SCHEMA`). Everything that starts or checks an engine reads that record and nothing
else: the unit (``vllm_service``'s template), the rollout's free-memory gate, the boot gate
on the host, ``vllm_boot_check``, the manual canary, the host's plan file and the report.
``docs/launch-contract.md`` is the schema's documentation; a change to a field there and
here goes with a new :data:`SCHEMA`.

Record (every byte figure an integer, ranks as keys of the instance's GPU list):

``schema``
    :data:`SCHEMA`.
``decision``, ``reasons``
    The planner's decision (``deploy``, ``reprofile``, ``split``, ``auto_profile``,
    ``refuse``) and why.
``manual``
    ``True`` when the engine takes the byte budget (every decision but ``auto_profile``).
``kv_cache_memory_bytes``
    ``--kv-cache-memory-bytes`` per GPU; ``None`` when vLLM profiles (``auto_profile``).
``gpu_memory_utilization``, ``utilization_source``
    ``--gpu-memory-utilization`` and where it comes from: ``vllm`` or ``nvml`` (the
    startup check at the floor, from vLLM's or NVML's free figures), ``lowest_free``
    (``auto_profile``: the lowest free memory seen), ``default`` (the deploying role's
    ``vllm_service_auto_gpu_memory_utilization``: an ``auto_profile`` plan without one), or
    ``None`` on a refused class.
``profile_max_utilization``
    The boot gate's ``profile`` policy: the utilization at which vLLM's own profiling
    sizes the planned budget (never more).
``guard_bytes``
    The guard the floors keep.
``free_floor_bytes``, ``vllm_floor_bytes``
    Per rank: the least NVML free memory a start needs (the rollout's gate and the boot
    gate) and the least free memory vLLM may log at startup (the boot check).
``expect``
    What the engine must report once up (manual budgets; ``None`` otherwise):
    ``reserved_bytes`` (the KV memory each rank reserves), ``num_blocks``,
    ``kv_cache_tokens``, ``max_concurrency``.
``admission``
    ``{required_tokens, required_blocks}`` of the admission plan, or ``None``.
``capacity``
    What turns bytes into blocks and tokens (``_kv_capacity.capacity_record``), or ``None``.
"""

from __future__ import annotations

import hashlib
import json
import typing as t

from .._units._instance import unit_name
from .._validate import int_field

SCHEMA = 1
# The host's plan file (<state_dir>/<instance>.plan.json) with the launch record inside.
PLAN_FILE_FORMAT = 3
DECISIONS = ("deploy", "reprofile", "split", "auto_profile", "refuse")
UTILIZATION_SOURCES = ("vllm", "nvml", "lowest_free", "default")
EXPECT_FIELDS = ("reserved_bytes", "num_blocks", "kv_cache_tokens", "max_concurrency")
FIELDS = ("schema", "decision", "reasons", "manual", "kv_cache_memory_bytes", "gpu_memory_utilization",
          "utilization_source", "profile_max_utilization", "guard_bytes", "free_floor_bytes", "vllm_floor_bytes",
          "expect", "admission", "capacity")

__all__ = ["DECISIONS", "EXPECT_FIELDS", "FIELDS", "PLAN_FILE_FORMAT", "SCHEMA", "LaunchError", "check_launch",
           "deployed", "figures", "for_host", "for_instance", "for_member", "from_plan", "plan_file", "plan_file_figures", "rank_bytes", "runs"]


class LaunchError(ValueError):
    """A launch record (or the plan it is built from) that cannot be used; the message names the field."""


def _int(doc: t.Mapping[str, t.Any], key: str, where: str, low: int = 0) -> int | None:
    return int_field(doc.get(key), f"{where}.{key}", low=low, strings=True, error=LaunchError)


def _fraction(doc: t.Mapping[str, t.Any], key: str, where: str, low_open: bool) -> float | None:
    value = doc.get(key)
    if value is None:
        return None
    try:
        number = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or not (0 < number <= 1 if low_open else 0 <= number <= 1):
        raise LaunchError(f"{where}.{key}: expected a number in {'(0, 1]' if low_open else '[0, 1]'}, got {value!r}")
    return number


def rank_bytes(raw: t.Any, where: str, *, signed: bool = False,
               error: type[Exception] = LaunchError) -> dict[int, int]:
    """A per-rank bytes map (``{rank: bytes}``, ranks as integers); ``where`` names the field in errors.

    ``signed``: negative ranks and figures pass, as the boot gate has always read plan files
    of formats 1 and 2. ``error``: the exception class the caller's errors are.
    """
    if raw is None:
        return {}
    if not isinstance(raw, t.Mapping):
        raise error(f"{where}: expected a mapping rank -> bytes, got {type(raw).__name__}")
    out: dict[int, int] = {}
    for key, value in raw.items():
        try:
            rank = int(key)
        except (TypeError, ValueError):
            raise error(f"{where}: rank {key!r} is not an integer") from None
        if rank < 0 and not signed:
            raise error(f"{where}: rank {rank} is negative")
        if isinstance(value, bool) or not isinstance(value, int) or (value < 0 and not signed):
            kind = "an integer" if signed else "a non-negative integer"
            raise error(f"{where}[{rank}]: expected bytes as {kind}, got {value!r}")
        out[rank] = value
    return out


def from_plan(plan: t.Mapping[str, t.Any], where: str = "plan") -> dict[str, t.Any]:
    """The launch record of a class from ``kv_plan``'s analysis (its flat fields).

    The planner calls this once per class; a plan written by hand with the same fields
    (``decision``, ``kv_cache_memory_bytes``, ``free_floor_bytes``, ...) goes through it too,
    so both give the same record.
    """
    if not isinstance(plan, t.Mapping):
        raise LaunchError(f"{where}: expected a mapping, got {type(plan).__name__}")
    decision = plan.get("decision")
    # a refused class starts nothing: its record carries the decision and the reasons only
    if decision == "refuse":
        return check_launch({"schema": SCHEMA, "decision": decision, "reasons": list(plan.get("reasons") or []),
                             "manual": True}, where)
    manual = decision != "auto_profile"
    admission = plan.get("admission")
    capacity = plan.get("kv_capacity") or None
    if manual and capacity is None and plan.get("block_size") and plan.get("bytes_per_block"):
        capacity = {"source": plan.get("capacity_source"), "bytes_per_block": plan["bytes_per_block"],
                    "block_size": plan["block_size"]}
    budget = plan.get("kv_cache_memory_bytes") if manual else None
    record = {
        "schema": SCHEMA,
        "decision": decision,
        "reasons": list(plan.get("reasons") or []),
        "manual": manual,
        "kv_cache_memory_bytes": budget,
        "gpu_memory_utilization": plan.get("gpu_memory_utilization"),
        "utilization_source": plan.get("utilization_source"),
        "profile_max_utilization": plan.get("profile_max_utilization") if manual else None,
        "guard_bytes": plan.get("guard_bytes"),
        "free_floor_bytes": dict(plan.get("free_floor_bytes") or {}) if manual else {},
        "vllm_floor_bytes": dict(plan.get("vllm_floor_bytes") or {}) if manual else {},
        "expect": {
            "reserved_bytes": budget,
            "num_blocks": plan.get("num_blocks"),
            "kv_cache_tokens": plan.get("kv_cache_tokens"),
            "max_concurrency": plan.get("max_concurrency"),
        } if manual and budget is not None else None,
        "admission": {"required_tokens": admission.get("required_tokens"), "required_blocks": admission.get("required_blocks")}
        if manual and isinstance(admission, t.Mapping) else None,
        "capacity": dict(capacity) if manual and isinstance(capacity, t.Mapping) else None,
    }
    return check_launch(record, where)


def check_launch(doc: t.Any, where: str = "launch") -> dict[str, t.Any]:
    """A launch record checked and normalised (ranks as integers, figures as numbers).

    Raises :class:`LaunchError` naming the field for anything a start could not use.
    """
    if not isinstance(doc, t.Mapping):
        raise LaunchError(f"{where}: expected a mapping (the launch record), got {type(doc).__name__}")
    unknown = sorted(set(map(str, doc)) - set(FIELDS))
    if unknown:
        raise LaunchError(f"{where}: unknown field(s) {', '.join(unknown)} (schema {SCHEMA} has {', '.join(FIELDS)})")
    if doc.get("schema") != SCHEMA:
        raise LaunchError(f"{where}.schema: {doc.get('schema')!r} is not the schema this collection reads ({SCHEMA})")
    decision = doc.get("decision")
    if decision not in DECISIONS:
        raise LaunchError(f"{where}.decision: expected one of {', '.join(DECISIONS)}, got {decision!r}")
    manual = decision != "auto_profile"
    if doc.get("manual") is not manual:
        raise LaunchError(f"{where}.manual: must be {manual} for decision {decision}")
    reasons = doc.get("reasons") or []
    if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
        raise LaunchError(f"{where}.reasons: expected a list of strings")
    budget = _int(doc, "kv_cache_memory_bytes", where, low=1)
    if manual and budget is None and decision != "refuse":
        raise LaunchError(f"{where}.kv_cache_memory_bytes: a {decision} plan needs the byte budget")
    if not manual and budget is not None:
        raise LaunchError(f"{where}.kv_cache_memory_bytes: an auto_profile plan has no byte budget (vLLM profiles)")
    source = doc.get("utilization_source")
    if source is not None and source not in UTILIZATION_SOURCES:
        raise LaunchError(f"{where}.utilization_source: expected one of {', '.join(UTILIZATION_SOURCES)}, got {source!r}")
    expect = doc.get("expect")
    if expect is not None:
        if not isinstance(expect, t.Mapping) or set(map(str, expect)) - set(EXPECT_FIELDS):
            raise LaunchError(f"{where}.expect: expected a mapping of {', '.join(EXPECT_FIELDS)}")
        expect = {key: _int(expect, key, f"{where}.expect") for key in EXPECT_FIELDS}
        if expect["reserved_bytes"] != budget:
            raise LaunchError(f"{where}.expect.reserved_bytes: {expect['reserved_bytes']} is not the budget {budget}")
    admission = doc.get("admission")
    if admission is not None:
        if not isinstance(admission, t.Mapping):
            raise LaunchError(f"{where}.admission: expected {{required_tokens, required_blocks}}")
        admission = {key: _int(admission, key, f"{where}.admission") for key in ("required_tokens", "required_blocks")}
    capacity = doc.get("capacity")
    if capacity is not None and not isinstance(capacity, t.Mapping):
        raise LaunchError(f"{where}.capacity: expected a mapping")
    return {
        "schema": SCHEMA,
        "decision": decision,
        "reasons": list(reasons),
        "manual": manual,
        "kv_cache_memory_bytes": budget,
        "gpu_memory_utilization": _fraction(doc, "gpu_memory_utilization", where, low_open=True),
        "utilization_source": source,
        "profile_max_utilization": _fraction(doc, "profile_max_utilization", where, low_open=False),
        "guard_bytes": _int(doc, "guard_bytes", where),
        "free_floor_bytes": rank_bytes(doc.get("free_floor_bytes"), f"{where}.free_floor_bytes"),
        "vllm_floor_bytes": rank_bytes(doc.get("vllm_floor_bytes"), f"{where}.vllm_floor_bytes"),
        "expect": expect,
        "admission": admission,
        "capacity": dict(capacity) if capacity is not None else None,
    }


def for_instance(plan: t.Mapping[str, t.Any], default_utilization: float, where: str = "plan") -> dict[str, t.Any]:
    """The launch record a deploy starts an instance with.

    ``plan``: ``kv_plan``'s result (its ``launch`` record is used) or a plan written by hand
    with the analysis's flat fields. An ``auto_profile`` plan that names no utilization takes
    ``default_utilization`` (``utilization_source: default``); a refused plan is not
    deployable.
    """
    if not isinstance(plan, t.Mapping):
        raise LaunchError(f"{where}: expected a mapping (kv_plan's result), got {type(plan).__name__}")
    record = check_launch(plan["launch"], f"{where}.launch") if "launch" in plan else from_plan(plan, where)
    if record["decision"] == "refuse":
        raise LaunchError(f"{where}.decision: refuse is not deployable (the planner refused the class: "
                          + ("; ".join(record["reasons"]) or "no reason given") + ")")
    if record["gpu_memory_utilization"] is None:
        if record["manual"]:
            raise LaunchError(f"{where}.gpu_memory_utilization: a manual budget needs the startup utilization")
        try:
            record["gpu_memory_utilization"] = _fraction({"v": default_utilization}, "v", "", low_open=True)
        except LaunchError:
            raise LaunchError(f"{where}: an auto_profile plan without gpu_memory_utilization takes the default utilization, "
                              f"which must be a number in (0, 1], got {default_utilization!r}") from None
        record["utilization_source"] = "default"
    return record


def for_member(record: t.Mapping[str, t.Any], first_rank: int, ranks: int, where: str = "launch") -> dict[str, t.Any]:
    """The launch record of one member of an instance that spans hosts (a gang): the gang's record, whose
    per-rank floors are keyed by the rank in the whole instance, with the member's ``ranks`` ranks from
    ``first_rank`` renumbered by their place among the member's GPUs (0, 1, ...), as its plan file, its gates
    and its boot check key them. The budget and the engine's figures are the gang's own: one engine.

    A manual record without a floor for one of the member's ranks was not planned for this member (a plan of
    another layout, or a member's plan given to another): refused, naming the rank."""
    if isinstance(first_rank, bool) or not isinstance(first_rank, int) or first_rank < 0:
        raise LaunchError(f"{where}: the member's first rank must be a non-negative integer, got {first_rank!r}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise LaunchError(f"{where}: the member's rank count must be a positive integer, got {ranks!r}")
    member = dict(record)
    for key in ("free_floor_bytes", "vllm_floor_bytes"):
        floors = record.get(key) or {}
        if not floors:
            continue  # vLLM profiles (auto_profile), or a record without vLLM's floors: nothing per rank to pick
        wanted = range(first_rank, first_rank + ranks)
        missing = [r for r in wanted if r not in floors]
        if missing:
            raise LaunchError(f"{where}.{key}: no floor for rank(s) {', '.join(map(str, missing))} of this member (its ranks "
                              f"{first_rank}-{first_rank + ranks - 1} of the instance; the plan has rank(s) "
                              f"{', '.join(map(str, sorted(floors)))}): plan the gang across all of its members")
        member[key] = {r - first_rank: floors[r] for r in wanted}
    return member


def for_host(plan: t.Any, default_utilization: float, where: str = "plan", gang: t.Any = None,
             gang_field: str = "gang") -> dict[str, t.Any]:
    """The launch record the instances of a host start with: :func:`for_instance`, and on a member of a gang
    (``gang``: its launches, instance name -> ``gang_member_launch``'s launch) :func:`for_member` at the place
    its ``first_rank`` and ``ranks`` give. A host is a member of one gang at most."""
    record = for_instance(plan, default_utilization, where)
    if not gang:
        return record
    if not isinstance(gang, t.Mapping):
        raise LaunchError(f"{gang_field}: expected a mapping instance -> the member's launch")
    places = set()
    for name, launch in gang.items():
        if not isinstance(launch, t.Mapping):
            raise LaunchError(f"{gang_field}.{name}: expected the member's launch (gang_member_launch's)")
        for key in ("first_rank", "ranks"):
            if isinstance(launch.get(key), bool) or not isinstance(launch.get(key), int):
                raise LaunchError(f"{gang_field}.{name}.{key}: expected an integer (gang_member_launch gives where the member's "
                                  f"ranks lie in the gang), got {launch.get(key)!r}")
        places.add((launch["first_rank"], launch["ranks"]))
    if len(places) > 1:
        raise LaunchError(f"{gang_field}: the host is a member of several gangs ({', '.join(sorted(map(str, gang)))}), whose ranks "
                          "differ; one class plan cannot give each its floors")
    first_rank, ranks = places.pop()
    return for_member(record, first_rank, ranks, f"{where}.launch" if isinstance(plan, t.Mapping) and "launch" in plan else where)


def _instance_gpu_field(gpus: t.Sequence[t.Any], host_gpus: t.Any, key: str, prefix: str = "") -> list[str] | None:
    """One probed field (``key``) of each of an instance's GPUs (indices), in rank order; None unless every GPU has it."""
    if not isinstance(host_gpus, (list, tuple)):
        return None
    by_index = {g.get("index"): g.get(key) for g in host_gpus if isinstance(g, t.Mapping)}
    found = [by_index.get(int(g)) for g in gpus]
    return [str(v) for v in found] if all(isinstance(v, str) and v and v.startswith(prefix) for v in found) else None


def instance_gpu_uuids(gpus: t.Sequence[t.Any], host_gpus: t.Any) -> list[str] | None:
    """The NVML UUIDs of an instance's GPUs (indices) from the host's probed GPUs (``index``, ``uuid``); None unless all are known."""
    return _instance_gpu_field(gpus, host_gpus, "uuid", "GPU-")


def instance_gpu_pci_bus_ids(gpus: t.Sequence[t.Any], host_gpus: t.Any) -> list[str] | None:
    """The PCI bus ids (``pci_bus_id``, as NVML prints them) of an instance's GPUs; None unless all are known."""
    return _instance_gpu_field(gpus, host_gpus, "pci_bus_id")


def cuda_visible_devices(gpus: t.Sequence[t.Any], host_gpus: t.Any) -> str:
    """The engine's ``CUDA_VISIBLE_DEVICES``: the instance's cards by NVML UUID in rank order, else by index.

    A UUID names one card wherever it is enumerated: after a reboot in which a GPU falls off the bus,
    index 3 may be another card, while ``GPU-…`` is still the planned one or no card at all (CUDA and
    vLLM's ``CudaPlatform.device_control_id_to_physical_device_id`` resolve it with
    ``nvmlDeviceGetHandleByUUID``). Indices are the fallback only when the probe did not read every
    card's UUID (``host_gpus`` absent: a unit rendered without a probe, e.g. by hand).
    """
    uuids = instance_gpu_uuids(gpus, host_gpus)
    return ",".join(uuids if uuids else [str(int(g)) for g in gpus])


def plan_file(launch: t.Mapping[str, t.Any], instance: t.Mapping[str, t.Any], *, host_class: str | None,
              key_hash: str | None, model: str, max_model_len: int | None, planned_at: str,
              gate_policy: str | None, gate_state_dir: str | None, host_gpus: t.Any = None,
              gate_gpu_health: str | None = None, gate_xid_wait_ms: int | None = None) -> dict[str, t.Any]:
    """The host's plan file of one instance (format :data:`PLAN_FILE_FORMAT`): where it runs and its launch record.

    The boot gate reads it at every start; an application embedding vLLM reads the same
    record (``docs/launch-contract.md``). ``max_model_len`` 0 or ``None``: not set.
    ``key_hash``: the compatibility key's hash (``_compat.key_hash``), the file's ``compat_key_hash``.
    ``host_gpus``: the host's probed GPUs; with every GPU's UUID known, ``gpu_uuids`` names
    the cards in rank order and the gate refuses a start on another card at one of the indices.
    ``gate_gpu_health`` (``refuse`` or ``warn``) and ``gate_xid_wait_ms``: what the gate does with an
    unhealthy GPU and how long it listens for Xid events (left out: ``refuse`` and 0).
    """
    record = check_launch(launch)
    name = str(instance["name"])
    uuids = instance_gpu_uuids(instance["gpus"], host_gpus)
    # where each card sits, for people: a moved card's message names the slot it was planned in
    bus_ids = instance_gpu_pci_bus_ids(instance["gpus"], host_gpus) if uuids else None
    return {
        "format": PLAN_FILE_FORMAT,
        "instance": name,
        "unit": unit_name(name),
        "host_class": host_class,
        "compat_key_hash": key_hash,
        "model": model,
        "gpus": [int(g) for g in instance["gpus"]],
        **({"gpu_uuids": uuids} if uuids else {}),
        **({"gpu_pci_bus_ids": bus_ids} if bus_ids else {}),
        "port": int(instance["port"]),
        "max_model_len": int(max_model_len) if max_model_len else None,
        "planned_at": planned_at,
        "boot_gate": {"policy": gate_policy, "state_file": f"{gate_state_dir}/{name}.boot-gate.json",
                      **({"gpu_health": gate_gpu_health} if gate_gpu_health else {}),
                      **({"xid_wait_ms": int(gate_xid_wait_ms)} if gate_xid_wait_ms else {})}
        if record["manual"] and gate_state_dir else None,
        "launch": record,
    }


# The drop-in beside an instance's unit that records its plan file's checksum (root's file):
# systemd hands it to the boot gate as this variable; the audit reads the file.
PLAN_CHECKSUM_VARIABLE = "GPUFLEET_PLAN_SHA256"
PLAN_CHECKSUM_DROPIN = "gpufleet-plan.conf"
# The field of a plan file the boot check adds after the start (the checksum of the unit that
# passed): the plan file's checksum is taken without it.
PLAN_CHECKSUM_EXCLUDES = ("unit_checksum",)


def plan_file_bytes(plan: t.Mapping[str, t.Any]) -> bytes:
    """A plan file as the boot gate and applications read it: indented JSON, sorted keys."""
    return (json.dumps(dict(plan), indent=4, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def plan_checksum(plan: t.Mapping[str, t.Any]) -> str:
    """SHA-256 of a plan file as written, without the fields of :data:`PLAN_CHECKSUM_EXCLUDES`.

    The deploy records it beside the unit (a drop-in, root's file, :data:`PLAN_CHECKSUM_DROPIN`);
    the boot gate refuses a plan file whose checksum differs, and the audit reports it as edited.
    """
    kept = {k: v for k, v in plan.items() if k not in PLAN_CHECKSUM_EXCLUDES}
    return hashlib.sha256(plan_file_bytes(kept)).hexdigest()


def plan_file_figures(doc: t.Any) -> dict[str, t.Any]:
    """A host's plan file as one flat mapping, whatever format wrote it: the instance's fields,
    and beside them the launch figures (format 3 keeps them in ``launch``, its expectations
    ``num_blocks``, ``kv_cache_tokens`` and ``max_concurrency`` in ``launch.expect``; formats 1
    and 2 kept them flat). ``{}`` for no file. Not checked: the boot gate checks what it starts."""
    if not isinstance(doc, t.Mapping) or not doc:
        return {}
    launch = doc.get("launch")
    if doc.get("format") != PLAN_FILE_FORMAT or not isinstance(launch, t.Mapping):
        return dict(doc)
    flat = {k: v for k, v in doc.items() if k != "launch"}
    flat.update(figures(launch))
    return flat


def figures(launch: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """A launch record's fields with its expectations beside them (``num_blocks``,
    ``kv_cache_tokens``, ``max_concurrency``), as the report and the tests read them."""
    raw = launch.get("expect")
    expect: t.Mapping[str, t.Any] = raw if isinstance(raw, t.Mapping) else {}
    flat = {k: v for k, v in launch.items() if k != "expect"}
    flat.update((k, v) for k, v in expect.items() if k != "reserved_bytes")
    return flat


def deployed(doc: t.Any) -> dict[str, t.Any]:
    """What a host's plan file says the instance runs: ``{decision, kv_cache_memory_bytes,
    gpu_memory_utilization, compat_key_hash}`` (any format); empty for no file or one without a decision."""
    flat = plan_file_figures(doc)
    if flat.get("decision") is None and flat.get("kv_cache_memory_bytes") is None:
        return {}
    return {key: flat.get(key) for key in ("decision", "kv_cache_memory_bytes", "gpu_memory_utilization", "compat_key_hash")}


def runs(doc: t.Any, launch: t.Mapping[str, t.Any], key_hash: str | None) -> bool:
    """Whether a host's plan file records this launch record's budget and utilization for this
    compatibility key (a boot that passed its check with exactly this record)."""
    now = deployed(doc)
    if not now or not key_hash:
        return False
    return bool(now["kv_cache_memory_bytes"] == launch.get("kv_cache_memory_bytes")
                and now["gpu_memory_utilization"] == launch.get("gpu_memory_utilization")
                and now["compat_key_hash"] == key_hash)

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Run reports behind ``gpufleet.vllm.rollout_report``: the model.

Plain Python, no Ansible import.

* :func:`build_report` turns what a playbook collected (per class state with
  the plan and the canaries, per host outcome facts, the batch records; for a
  probe run, per host its GPUs and instances) into a report of schema version
  :data:`SCHEMA_VERSION`;
* :func:`load_report` reads a stored ``report.json`` of any known schema
  version (version 0 is the flat summary older playbooks wrote, version 1 has
  no ``probe`` nor ``check_mode``) and upgrades it;
* :func:`class_artifacts` gives each class's plan and canaries as stored.

Rendering and writing a run directory: ``_report_render``.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import figures as launch_figures, plan_checksum, plan_file_figures
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import SizeError, human_bytes, parse_size
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._instance import unit_name
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import int_field

__all__ = [
    "AUDIT_VERDICTS",
    "KINDS",
    "OUTCOMES",
    "SCHEMA_VERSION",
    "ReportError",
    "build_report",
    "bytes_text",
    "cell_text",
    "class_artifacts",
    "failed_items",
    "failure_message",
    "instance_state",
    "load_report",
    "signed_bytes_text",
    "utc_now",
]

# 2: ``probe`` (what a probe run read per host, GPU and instance) and ``check_mode``.
SCHEMA_VERSION = 2
KINDS = ("rollout", "plan", "probe", "audit")
# Per host outcome of a run, worst first (the summary counts them).
OUTCOMES = ("rolled_back", "failed", "not_reached", "skipped", "deployed", "unchanged", "planned", "probed", "audited")
# Verdicts of an audit run per instance, worst first (vllm_audit, _audit.VERDICTS reversed).
AUDIT_VERDICTS = ("plan_edited", "would_refuse", "would_shrink", "reprofile_due", "ok")

_CANARY_FIELDS = (
    "verdict",
    "kv_cache_tokens",
    "num_blocks",
    "max_concurrency",
    "preemptions",
    "startup_seconds",
    "completed",
    "failed",
    "ttft_p50",
    "ttft_p95",
    "e2e_p50",
    "e2e_p95",
)
_LOAD_FIELDS = ("completed", "failed", "ttft_p50", "ttft_p95", "e2e_p50", "e2e_p95")
_PLAN_FIELDS = (
    "budget_mode",
    "kv_cache_memory_bytes",
    "max_safe_bytes",
    "gpu_memory_utilization",
    "utilization_source",
    "num_blocks",
    "kv_cache_tokens",
    "max_concurrency",
    "block_size",
    "bytes_per_block",
    "guard_bytes",
)


class ReportError(ValueError):
    """Report input or a stored report that cannot be used (message names the field)."""


# ---------------------------------------------------------------- small helpers
def _int(value: Any, field: str) -> int | None:
    """An integer byte figure from an int or a size string; None stays None."""
    if value is None or value == "" or isinstance(value, (bool, int, float)):
        return int_field(None if value == "" else value, field, floats="truncate", what="a byte count", error=ReportError)
    try:
        return parse_size(value, field)
    except SizeError as exc:
        if isinstance(value, str) and value.lstrip("-").isdigit():
            return int(value)
        raise ReportError(str(exc)) from None


def _num(value: Any) -> float | int | None:
    if value is None or value == "" or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return int(out) if out.is_integer() and "." not in str(value) else out


def _rank_map(value: Any, field: str) -> dict[str, int]:
    """``{rank: bytes}`` with string keys (JSON keys are strings)."""
    if not value:
        return {}
    if not isinstance(value, Mapping):
        raise ReportError(f"{field}: expected a mapping of rank to bytes, got {type(value).__name__}")
    out: dict[str, int] = {}
    for rank, nbytes in value.items():
        converted = _int(nbytes, f"{field}[{rank}]")
        if converted is not None:
            out[str(rank)] = converted
    return dict(sorted(out.items(), key=lambda kv: (len(kv[0]), kv[0])))


def bytes_text(value: Any) -> str:
    if value is None:
        return "-"
    try:
        return human_bytes(int(value))
    except (TypeError, ValueError):
        return str(value)


def signed_bytes_text(value: Any) -> str:
    if value is None:
        return "-"
    value = int(value)
    return ("-" if value < 0 else "+") + human_bytes(abs(value))


def cell_text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _str_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value if v is not None and str(v) != ""]
    return [str(value)]


def _parse_time(value: Any) -> _dt.datetime | None:
    if not value:
        return None
    try:
        stamp = _dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=_dt.timezone.utc)


def _iso(value: Any) -> str | None:
    """An ISO 8601 time with its offset (a time without one is UTC, as the playbooks take it)."""
    stamp = _parse_time(value)
    return stamp.isoformat() if stamp is not None else (str(value) if value else None)


def _seconds_between(start: Any, end: Any) -> float | None:
    begin, finish = _parse_time(start), _parse_time(end)
    if begin is None or finish is None:
        return None
    return round((finish - begin).total_seconds(), 1)


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


# ---------------------------------------------------------------- building a report
def _canary(raw: Any) -> dict[str, Any] | None:
    """The figures of one canary result (vllm_canary's return or a stored canary record)."""
    if not isinstance(raw, Mapping) or not raw:
        return None
    out: dict[str, Any] = {}
    load_raw = raw.get("load")
    load: Mapping[str, Any] = load_raw if isinstance(load_raw, Mapping) else {}
    for field in _CANARY_FIELDS:
        if field in _LOAD_FIELDS:
            # the load test's figures; a top-level "failed" is the task's flag, not a request count
            value = load.get(field, None if field == "failed" else raw.get(field))
        else:
            value = raw.get(field)
        out[field] = value if field == "verdict" else _num(value)
    out["reasons"] = _str_list(raw.get("reasons"))[:10]
    out["engine_errors"] = [
        str(e.get("message", e)) if isinstance(e, Mapping) else str(e) for e in (raw.get("engine_errors") or [])
    ][:5]
    return out


def _per_rank(rows: Any) -> list[dict[str, Any]]:
    out = []
    for pos, row in enumerate(rows or []):
        if not isinstance(row, Mapping):
            raise ReportError(f"plan.per_rank[{pos}]: expected a mapping")
        free = _int(row.get("boot_free_bytes"), f"per_rank[{pos}].boot_free_bytes")
        floor = _int(row.get("floor_bytes"), f"per_rank[{pos}].floor_bytes")
        margin = _int(row.get("margin_bytes"), f"per_rank[{pos}].margin_bytes")
        if margin is None and free is not None and floor is not None:
            margin = free - floor
        out.append(
            {
                "host": str(row.get("host", "?")),
                "rank": row.get("rank"),
                "boot_free_bytes": free,
                "floor_bytes": floor,
                "drift_bytes": _int(row.get("drift_bytes"), f"per_rank[{pos}].drift_bytes"),
                "adjusted_bytes": _int(row.get("adjusted_bytes"), f"per_rank[{pos}].adjusted_bytes"),
                "margin_bytes": margin,
                "weakest": bool(row.get("weakest")),
                "unstable": bool(row.get("unstable")),
                # a rank of an instance over several hosts: the member host it runs on
                **({"member": str(row["member"])} if row.get("member") is not None else {}),
            }
        )
    return out


def _fit(plan: Mapping[str, Any]) -> dict[str, Any] | None:
    fit = plan.get("fit")
    if not isinstance(fit, Mapping):
        return None
    return {
        "blocks": _num(fit.get("blocks")),
        "required_blocks": _num(fit.get("required_blocks")),
        "budget_bytes": _int(fit.get("budget_bytes"), "fit.budget_bytes"),
        "max_safe_bytes": _int(fit.get("max_safe_bytes"), "fit.max_safe_bytes"),
        "left_free_bytes_per_gpu": _int(fit.get("left_free_bytes_per_gpu"), "fit.left_free_bytes_per_gpu"),
        "capped_at_max_safe": bool(fit.get("capped_at_max_safe")),
    }


def _budget_choice(plan: Mapping[str, Any]) -> dict[str, Any] | None:
    """How the planner settled the budget: rounding, gate margin, a deployed budget kept or replaced."""
    choice = plan.get("budget_choice")
    if not isinstance(choice, Mapping):
        return None
    out: dict[str, Any] = {
        field: _int(choice.get(field), f"budget_choice.{field}")
        for field in ("max_safe_bytes", "gate_margin_bytes", "granularity_bytes", "rounded_bytes", "planned_bytes",
                      "deployed_bytes", "keep_step_bytes")
    }
    out["kept"] = bool(choice.get("kept"))
    out["reason"] = cell_text(choice.get("reason"))
    return out


def _first_run(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the rollout does to the class (``_first_run.outline``): canary host, stops and outages, units."""
    outline = state.get("first_run")
    if not isinstance(outline, Mapping):
        return None
    stops = [
        {"host": cell_text(s.get("host")), "unit": cell_text(s.get("unit")), "when": cell_text(s.get("when")), "boots": _num(s.get("boots")),
         "load_tests": _num(s.get("load_tests")), "estimate": cell_text(s.get("estimate")), "seconds": _num(s.get("seconds")),
         "drained": bool(s.get("drained"))}
        for s in outline.get("stops") or [] if isinstance(s, Mapping)
    ]
    units = [
        {"host": cell_text(u.get("host")), "unit": cell_text(u.get("unit")), "action": cell_text(u.get("action")), "batch": _num(u.get("batch"))}
        for u in outline.get("units") or [] if isinstance(u, Mapping)
    ]
    return {
        "canary_host": cell_text(outline.get("canary_host")),
        "canary_rule": cell_text(outline.get("canary_rule")),
        "canary_instance": cell_text(outline.get("canary_instance")),
        "profiled_canary": bool(outline.get("profiled_canary")),
        "boot_seconds": _num(outline.get("boot_seconds")),
        "boot_source": cell_text(outline.get("boot_source")),
        "stops": stops,
        "units": units,
        "lines": _str_list(outline.get("lines")),
    }


def _what_if_fp8(plan: Mapping[str, Any]) -> dict[str, Any] | None:
    fp8 = plan.get("what_if_fp8")
    if not isinstance(fp8, Mapping):
        return None
    return {
        "kv_cache_tokens": _num(fp8.get("kv_cache_tokens")),
        "num_blocks": _num(fp8.get("num_blocks")),
        "max_concurrency": _num(fp8.get("max_concurrency")),
        "bytes_per_block": _int(fp8.get("bytes_per_block"), "what_if_fp8.bytes_per_block"),
    }


def _class_entry(name: str, state: Mapping[str, Any], hosts: list[str]) -> dict[str, Any]:
    plan = state.get("plan") if isinstance(state.get("plan"), Mapping) else {}
    plan = plan or {}
    # what the class starts with comes from its launch record; the analysis (weakest rank,
    # split, per-rank table, budget mode) from the rest of the plan
    launch = plan.get("launch")
    started = {**plan, **launch_figures(launch)} if isinstance(launch, Mapping) else plan
    failed = bool(state.get("failed"))
    ok = bool(state.get("ok")) and not failed
    weakest = plan.get("weakest") if isinstance(plan.get("weakest"), Mapping) else None
    canaries_doc = state.get("canaries")
    canaries_raw: Mapping[str, Any] = canaries_doc if isinstance(canaries_doc, Mapping) else {}
    entry: dict[str, Any] = {
        "name": name,
        "status": "failed" if failed else ("deployable" if ok else "skipped"),
        "decision": started.get("decision") or state.get("decision"),
        "reasons": _str_list(state.get("reasons") or plan.get("reasons")),
        "key_hash": str(state.get("key_hash") or ""),
        "plan": {field: started.get(field) for field in _PLAN_FIELDS},
        "free_floor_bytes": _rank_map(started.get("free_floor_bytes"), f"class {name}: free_floor_bytes"),
        "vllm_floor_bytes": _rank_map(started.get("vllm_floor_bytes"), f"class {name}: vllm_floor_bytes"),
        "weakest": (
            {"host": str(weakest.get("host")), "rank": weakest.get("rank"), "adjusted_bytes": _int(weakest.get("adjusted_bytes"), "weakest"),
             **({"member": str(weakest["member"])} if weakest.get("member") is not None else {})}
            if weakest
            else None
        ),
        "what_if_fp8": _what_if_fp8(plan),
        "fit": _fit(plan),
        "budget_choice": _budget_choice(plan),
        "first_run": _first_run(state),
        "admission": plan.get("admission") if isinstance(plan.get("admission"), Mapping) else None,
        "split": [
            {"name": str(g.get("name")), "hosts": _str_list(g.get("hosts")), "kv_cache_memory_bytes": _int(g.get("kv_cache_memory_bytes"), "split")}
            for g in plan.get("split") or []
            if isinstance(g, Mapping)
        ],
        "per_rank": _per_rank(plan.get("per_rank")),
        "manual_canary": str(state.get("manual_canary") or "not run"),
        "canaries": {
            "profiled": _canary(canaries_raw.get("profiled")),
            "manual": _canary(canaries_raw.get("manual")),
        },
        "hosts": sorted(hosts),
    }
    for field in ("kv_cache_memory_bytes", "max_safe_bytes", "guard_bytes", "bytes_per_block"):
        entry["plan"][field] = _int(entry["plan"][field], f"class {name}: {field}")
    for field in ("num_blocks", "kv_cache_tokens", "max_concurrency", "block_size", "gpu_memory_utilization"):
        entry["plan"][field] = _num(entry["plan"][field])
    return entry


_GPU_BYTES = (
    "total_bytes",
    "free_bytes",
    "boot_free_bytes",
    "free_min_bytes",
    "free_max_bytes",
    "used_bytes",
    "reserved_bytes",
    "own_used_bytes",
)
_INSTANCE_PLAN_FIELDS = (
    "decision",
    "kv_cache_memory_bytes",
    "gpu_memory_utilization",
    "num_blocks",
    "kv_cache_tokens",
    "max_concurrency",
    "compat_key_hash",
    "host_class",
    "model",
)


def _mapping(value: Any, field: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ReportError(f"{field}: expected a mapping, got {type(value).__name__}")
    return value


def _sequence(value: Any, field: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ReportError(f"{field}: expected a list, got {type(value).__name__}")
    return list(value)


def _probe_gpu(raw: Any, where: str) -> dict[str, Any]:
    gpu = _mapping(raw, where)
    out: dict[str, Any] = {
        "index": _num(gpu.get("index")),
        "uuid": str(gpu.get("uuid") or "") or None,
        "name": str(gpu.get("name") or "") or None,
    }
    for field in _GPU_BYTES:
        out[field] = _int(gpu.get(field), f"{where}.{field}")
    processes = []
    for pos, proc_raw in enumerate(_sequence(gpu.get("processes"), f"{where}.processes")):
        proc = _mapping(proc_raw, f"{where}.processes[{pos}]")
        processes.append(
            {
                "pid": _num(proc.get("pid")),
                "name": str(proc.get("name") or "") or None,
                "used_bytes": _int(proc.get("used_bytes"), f"{where}.processes[{pos}].used_bytes"),
                "own": bool(proc.get("own")),
            }
        )
    out["processes"] = processes
    out["processes_reported"] = bool(gpu.get("processes_reported", True))
    return out


def _probe_instance(raw: Any, where: str) -> dict[str, Any]:
    inst = _mapping(raw, where)
    name = str(inst.get("name") or "")
    if not name:
        raise ReportError(f"{where}: an instance needs a name")
    plan_raw = inst.get("plan")
    plan = None
    if plan_raw:
        plan_map = plan_file_figures(_mapping(plan_raw, f"{where}.plan"))
        plan = {field: plan_map.get(field) for field in _INSTANCE_PLAN_FIELDS}
        plan["kv_cache_memory_bytes"] = _int(plan["kv_cache_memory_bytes"], f"{where}.plan.kv_cache_memory_bytes")
        for field in ("gpu_memory_utilization", "num_blocks", "kv_cache_tokens", "max_concurrency"):
            plan[field] = _num(plan[field])
        plan["free_floor_bytes"] = _rank_map(plan_map.get("free_floor_bytes"), f"{where}.plan.free_floor_bytes")
    gpus = [_num(g) for g in _sequence(inst.get("gpus"), f"{where}.gpus")]
    return {
        "name": name,
        "unit": str(inst.get("unit") or unit_name(name)),
        "gpus": [g for g in gpus if g is not None],
        "port": _num(inst.get("port")),
        "load_state": str(inst.get("load_state") or "") or None,
        "active_state": str(inst.get("active_state") or "") or None,
        "sub_state": str(inst.get("sub_state") or "") or None,
        "plan": plan,
    }


def _probe_runtime(raw: Any, where: str) -> dict[str, Any] | None:
    """The engine runtime's install record as the host snapshot read it (``{record, error}``: the release
    the venv links to and its stamp) -> ``{release, package, version, error}``; None without one."""
    if raw is None:
        return None
    data = _mapping(raw, where)
    record = _mapping(data.get("record") or {}, f"{where}.record")
    error = data.get("error")
    if not record and error is None:
        return None
    stamp = _mapping(record.get("stamp") or {}, f"{where}.record.stamp")
    return {"release": str(record.get("release") or "") or None, "package": str(stamp.get("package") or "") or None,
            "version": str(stamp.get("version") or "") or None, "error": str(error) if error is not None else None}


def _probe_section(raw: Any) -> dict[str, Any]:
    """``data.probe``: ``{hosts: {host: {class, error, driver_version, ..., gpus: [...], instances: [...]}}}``."""
    probe = _mapping(raw, "data.probe")
    hosts_raw = _mapping(probe.get("hosts"), "data.probe.hosts")
    hosts = []
    for host, facts_raw in sorted(hosts_raw.items()):
        where = f"data.probe.hosts.{host}"
        facts = _mapping(facts_raw, where)
        error = facts.get("error")
        hosts.append(
            {
                "host": str(host),
                "class": str(facts.get("class") or ""),
                "ok": error is None,
                "error": str(error) if error is not None else None,
                "driver_version": str(facts.get("driver_version") or "") or None,
                "cuda_driver_version": str(facts.get("cuda_driver_version") or "") or None,
                "nvml_version": str(facts.get("nvml_version") or "") or None,
                "runtime": _probe_runtime(facts.get("runtime"), f"{where}.runtime"),
                "gpus": [_probe_gpu(g, f"{where}.gpus[{pos}]") for pos, g in enumerate(_sequence(facts.get("gpus"), f"{where}.gpus"))],
                "instances": [
                    _probe_instance(i, f"{where}.instances[{pos}]") for pos, i in enumerate(_sequence(facts.get("instances"), f"{where}.instances"))
                ],
            }
        )
    return {"hosts": hosts}


def _audit_section(raw: Any) -> dict[str, Any]:
    """``data.audit``: ``{hosts: {host: {class, error, instances: [vllm_audit instance entries]}}}``."""
    audit = _mapping(raw, "data.audit")
    hosts = []
    for host, facts_raw in sorted(_mapping(audit.get("hosts"), "data.audit.hosts").items()):
        where = f"data.audit.hosts.{host}"
        facts = _mapping(facts_raw, where)
        error = facts.get("error")
        instances = []
        for pos, inst_raw in enumerate(_sequence(facts.get("instances"), f"{where}.instances")):
            inst = _mapping(inst_raw, f"{where}.instances[{pos}]")
            verdict = str(inst.get("verdict") or "")
            if verdict not in AUDIT_VERDICTS:
                raise ReportError(f"{where}.instances[{pos}].verdict: expected one of {', '.join(AUDIT_VERDICTS)}, got {verdict!r}")
            ranks = []
            for rpos, row_raw in enumerate(_sequence(inst.get("ranks"), f"{where}.instances[{pos}].ranks")):
                row = _mapping(row_raw, f"{where}.instances[{pos}].ranks[{rpos}]")
                rwhere = f"{where}.instances[{pos}].ranks[{rpos}]"
                ranks.append({"rank": _num(row.get("rank")), "gpu": _num(row.get("gpu")),
                              "free_bytes": _int(row.get("free_bytes"), f"{rwhere}.free_bytes"),
                              "floor_bytes": _int(row.get("floor_bytes"), f"{rwhere}.floor_bytes"),
                              "margin_bytes": _signed_int(row.get("margin_bytes"), f"{rwhere}.margin_bytes")})
            last_raw = inst.get("last_start")
            last: Mapping[str, Any] = last_raw if isinstance(last_raw, Mapping) else {}
            instances.append({
                "instance": str(inst.get("instance") or ""),
                "unit": str(inst.get("unit") or ""),
                "policy": str(inst.get("policy") or ""),
                "verdict": verdict,
                "next_start": str(inst.get("next_start") or ""),
                "ranks": ranks,
                "min_margin_bytes": _signed_int(inst.get("min_margin_bytes"), f"{where}.instances[{pos}].min_margin_bytes"),
                "kv_cache_memory_bytes": _int(inst.get("kv_cache_memory_bytes"), f"{where}.instances[{pos}].kv_cache_memory_bytes"),
                "planned_at": cell_text(inst.get("planned_at")) if inst.get("planned_at") else None,
                "plan_age_days": _num(inst.get("plan_age_days")),
                "compat_key_hash": inst.get("compat_key_hash"),
                "reference_key_hash": inst.get("reference_key_hash"),
                "key_matches": inst.get("key_matches"),
                "last_start_action": last.get("action"),
                "degraded": bool(last.get("degraded")),
                "reasons": _str_list(inst.get("reasons")),
            })
        hosts.append({"host": str(host), "class": str(facts.get("class") or ""), "ok": error is None,
                      "error": str(error) if error is not None else None, "instances": instances,
                      "clock_skew_seconds": _num(facts.get("clock_skew_seconds"))})
    return {"hosts": hosts}


def _signed_int(value: Any, field: str) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return value
    return _int(value, field)


def _audit_summary(audit: Mapping[str, Any], gangs: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    instances = [(h["host"], i) for h in audit["hosts"] for i in h["instances"]]
    counts = {v: 0 for v in AUDIT_VERDICTS}
    for _host, inst in instances:
        counts[inst["verdict"]] += 1
    return {
        "hosts": len(audit["hosts"]),
        "audited": sum(1 for h in audit["hosts"] if h["ok"]),
        "instances": len(instances),
        "verdicts": {k: v for k, v in counts.items() if v},
        "would_refuse": [f"{h}/{i['instance']}" for h, i in instances if i["verdict"] == "would_refuse"],
        "would_shrink": [f"{h}/{i['instance']}" for h, i in instances if i["verdict"] == "would_shrink"],
        "plan_edited": [f"{h}/{i['instance']}" for h, i in instances if i["verdict"] == "plan_edited"],
        # a gang's verdict is its worst member's: name@leader, as the gang steps name a gang
        "gangs": {f"{g['name']}@{g['leader']}": g["verdict"] for g in gangs if "verdict" in g},
    }


def instance_state(inst: Mapping[str, Any]) -> str:
    if inst.get("load_state") == "not-found":
        return "not installed"
    state = inst.get("active_state") or "unknown"
    return f"{state} ({inst['sub_state']})" if inst.get("sub_state") else state


def _probe_summary(probe: Mapping[str, Any]) -> dict[str, Any]:
    gpus = [(h["host"], g) for h in probe["hosts"] for g in h["gpus"]]
    instances = [i for h in probe["hosts"] for i in h["instances"]]
    lowest = None
    for host, gpu in gpus:
        if gpu["boot_free_bytes"] is not None and (lowest is None or gpu["boot_free_bytes"] < lowest["bytes"]):
            lowest = {"host": host, "index": gpu["index"], "bytes": gpu["boot_free_bytes"]}
    return {
        "hosts": len(probe["hosts"]),
        "probed": sum(1 for h in probe["hosts"] if h["ok"]),
        "gpus": len(gpus),
        "instances": len(instances),
        "active_instances": sum(1 for i in instances if i["active_state"] == "active"),
        "lowest_boot_free": lowest,
    }


def _host_outcome(kind: str, host: Mapping[str, Any], class_entry: dict[str, Any] | None) -> str:
    if class_entry is not None and class_entry["status"] == "failed":
        return "failed"
    if host.get("error") is not None:  # failed in a batch, or in the check of every host's inputs before them
        if host.get("rollback_failed"):  # its class rollback stopped on it
            return "failed"
        return "rolled_back" if host.get("touched") and host.get("batch") is not None else "failed"
    if class_entry is None or class_entry["status"] != "deployable":
        return "skipped"
    if kind != "rollout":
        return "planned"
    if host.get("batch") is None:
        return "not_reached"
    return "deployed" if host.get("pending") else "unchanged"


_MANUAL_VERDICTS = ("pass", "fail", "inconclusive")


def _class_group(host_class: str) -> str:
    """The inventory group of a class's hosts (playbooks/plays/validate.yml adds them)."""
    return "gpufleet_class_" + "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in host_class)


# the message of ansible.builtin.command and shell when the command exits non-zero: its own words are in stderr
_NONZERO = "non-zero return code"
# the most of a command's stderr a message carries (its end: where a program says why it stopped)
_STDERR_CHARS = 400


def _one_message(result: Mapping[str, Any], default: str) -> str:
    msg = str(result.get("msg") or default)
    stderr = result.get("stderr")
    if msg == _NONZERO and isinstance(stderr, str) and stderr.strip():
        tail = " ".join(stderr.strip().split())
        tail = tail if len(tail) <= _STDERR_CHARS else "..." + tail[-_STDERR_CHARS:]
        rc = result.get("rc")
        return f"{msg}{'' if rc is None else f' {rc}'}: {tail}"
    return msg


def failed_items(result: Any) -> list[str]:
    """The message of each failed item of a looped task's result (``results``), in order (a command's
    stderr with it where its message only says it exited non-zero)."""
    items = result.get("results") if isinstance(result, Mapping) else None
    if not isinstance(items, list):
        return []
    return [_one_message(r, "no message") for r in items if isinstance(r, Mapping) and r.get("failed")]


def failure_message(result: Any, default: str = "no message") -> str:
    """What a failed task said (``ansible_failed_result``): each failed item's message, since a looped task
    fails with "One or more items failed", else its own ``msg``, else ``default``. A command that exited
    non-zero says only that: the end of its stderr follows, where a program says why."""
    if not isinstance(result, Mapping):
        return default
    return "; ".join(failed_items(result)) or _one_message(result, default)


def run_data(hostvars: Mapping[str, Any], groups: Mapping[str, Any], hosts_from: str = "gpufleet_rollout",
             controller: str = "localhost", raw_vars: Callable[[str], Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """What :func:`build_report` takes, read from a rollout's hostvars.

    Per class, from its canary host (``gpufleet_canary_of_class``, else its first host by name):
    ``gpufleet_class_state``, with the canaries it ran (``gpufleet_reference``'s profiled canary,
    and ``vllm_canary_result`` when the manual canary gave a verdict). Per host of ``hosts_from``: its class, batch
    (the batch record that lists it), pending instances (``vllm_service_pending``), whether it was
    touched, and - for a host that failed in a serial batch or in the input check before them -
    the failure's message (each failed item's too) and task. ``controller``'s vars give the
    run's start (``gpufleet_run.started``) and the batches (``gpufleet_batches``, each with its
    ``index`` and ``hosts``: the batch of a host) and what a class rollback did
    (``gpufleet_class_rolled_back``: host -> ``{class, after, summary}``; ``gpufleet_class_rollback_error``:
    ``"<host>: <why>"`` where it stopped).

    ``raw_vars(host)`` gives a host's vars untemplated (Ansible's ``hostvars.raw_get``): the
    failed task is read from there, since templating it whole would template its arguments
    (``{{ item }}`` of a loop) outside the task.
    """
    run = dict((hostvars.get(controller) or {}).get("gpufleet_run") or {})
    batches = list((hostvars.get(controller) or {}).get("gpufleet_batches") or [])
    batch_of = {h: b.get("index") for b in batches if isinstance(b, Mapping) for h in b.get("hosts") or []}
    # a class rollback (gpufleet_on_failure: rollback_class): the hosts it restored, and why it stopped
    class_rolled = (hostvars.get(controller) or {}).get("gpufleet_class_rolled_back") or {}
    rollback_error = (hostvars.get(controller) or {}).get("gpufleet_class_rollback_error")
    classes: dict[str, Any] = {}
    hosts: dict[str, Any] = {}
    host_takeovers: list[str] = []
    for host in groups.get(hosts_from) or []:
        hv = hostvars.get(host) or {}
        host_lease = hv.get("gpufleet_host_lease")
        if isinstance(host_lease, Mapping):
            host_takeovers.extend(f"{host}: {t.get('msg')}" for t in host_lease.get("taken_over") or [] if isinstance(t, Mapping))
        cls = str(hv.get("gpufleet_host_class") or "")
        if cls not in classes:
            # the canary results live on the class's canary host (plan_classes.yml keeps its name on every host)
            canary = hv.get("gpufleet_canary_of_class") or sorted(groups.get(_class_group(cls)) or [host])[0]
            ch = hostvars.get(canary) or {}
            state = dict(ch.get("gpufleet_class_state") or hv.get("gpufleet_class_state") or {})
            manual = ch.get("vllm_canary_result") if state.get("manual_canary") in _MANUAL_VERDICTS else None
            reference = ch.get("gpufleet_reference") or {}
            profiled = ((reference.get("profile") or {}) if isinstance(reference, Mapping) else {}).get("canary_result")
            state["canaries"] = {"profiled": profiled, "manual": manual}
            classes[cls] = state
        in_batch = host in batch_of or bool(hv.get("gpufleet_inputs_failed"))
        failure = hv.get("ansible_failed_result") if in_batch else None
        error = task = None
        if isinstance(failure, Mapping):
            # a looped task (one item per instance) fails with "One or more items failed": add each item's message
            items = failed_items(failure)
            error = str(failure.get("msg") or "failed without a message")
            if items:
                error += ": " + "; ".join(items)
            failed_task = (raw_vars(host) if raw_vars else hv).get("ansible_failed_task")
            task = failed_task.get("name") if isinstance(failed_task, Mapping) else None
        elif in_batch and hv.get("gpufleet_host_error"):
            # a check that ran once for the run (run_once) failed on one host; the play names each host it concerns
            error = str(hv["gpufleet_host_error"])
        # the host's own failure, kept before a class rollback ran tasks in its name (playbooks/tasks/host_failed.yml)
        own = hv.get("gpufleet_own_failure")
        if in_batch and isinstance(own, Mapping) and own.get("msg"):
            error, task = str(own["msg"]), str(own.get("task") or "") or None
        # a failed bake whose rollback failed in turn (playbooks/tasks/batch_bake.yml): failed, not rolled back
        rollback_failed = bool(hv.get("gpufleet_rollback_failed")) and in_batch
        if rollback_failed and hv.get("gpufleet_host_error"):
            error = str(hv["gpufleet_host_error"])
        rolled_back_with = None
        if error is None and host in class_rolled:
            # rolled back with its class after a host or a bake of a later batch failed (gpufleet_on_failure)
            entry = class_rolled[host] if isinstance(class_rolled[host], Mapping) else {}
            error = f"rolled back with its class after {entry.get('after')} failed: {entry.get('summary')}"
            task = "Roll back the class's other hosts this run changed"
            rolled_back_with = str(entry.get("after") or "") or None
        elif error is None and isinstance(rollback_error, str) and rollback_error.startswith(f"{host}: "):
            error, task, rollback_failed = f"its class rollback stopped here: {rollback_error}", None, True
        pending = [i.get("name") for i in hv.get("vllm_service_pending") or [] if isinstance(i, Mapping)]
        hosts[host] = {
            "class": cls,
            "batch": batch_of.get(host),
            "pending": pending,
            "touched": bool(hv.get("vllm_service_touched")),
            "error": error,
            "failed_task": task,
            "rollback_failed": rollback_failed,
            "rolled_back_with": rolled_back_with,
            # what the deploy wrote: each plan file's checksum (its drop-in on the host records the same) and key
            "plans": plan_records(hv.get("vllm_service_rendered"), pending) if host in batch_of else [],
        }
    started = str(run.get("started") or "")
    if started and "+" not in started:
        started += "+00:00"
    lease = (hostvars.get(controller) or {}).get("gpufleet_lease")
    return {"started": started or None, "classes": classes, "hosts": hosts, "batches": batches,
            "lease": lease_entry(lease, host_takeovers) if isinstance(lease, Mapping) else None}


def plan_records(rendered: Any, names: Sequence[Any]) -> list[dict[str, Any]]:
    """Per instance of ``names``, the checksum of the plan file the deploy rendered for it and the key that produced it."""
    out = []
    for item in rendered if isinstance(rendered, Sequence) and not isinstance(rendered, str) else []:
        if isinstance(item, Mapping) and item.get("name") in names and isinstance(item.get("plan"), Mapping):
            out.append({"instance": str(item["name"]), "checksum": plan_checksum(item["plan"]),
                        "compat_key_hash": item["plan"].get("compat_key_hash")})
    return out


def lease_entry(result: Mapping[str, Any], host_takeovers: Sequence[str] = ()) -> dict[str, Any]:
    """The run's leases (``gpufleet.vllm.rollout_lease``'s result): who held them, and expired ones taken over.

    ``host_takeovers``: the host leases the run took over, a sentence each that names the host.
    """
    leases = [lease for lease in result.get("leases") or [] if isinstance(lease, Mapping)]
    return {
        "run_id": leases[0].get("run_id") if leases else None,
        "owner": leases[0].get("owner") if leases else None,
        "classes": sorted(str(lease.get("scope")) for lease in leases),
        "taken_over": [str(t.get("msg")) for t in result.get("taken_over") or [] if isinstance(t, Mapping)] + list(host_takeovers),
    }


def build_report(data: Mapping[str, Any], kind: str = "rollout", generated: _dt.datetime | None = None) -> dict[str, Any]:
    """Turn what a playbook collected into a report of schema version :data:`SCHEMA_VERSION`.

    ``data`` keys (all optional but ``classes``):

    * ``started``/``finished``: ISO 8601 times of the run;
    * ``classes``: ``{name: state}`` where ``state`` is the class state the
      rollout keeps (``ok``, ``failed``, ``plan`` as ``kv_plan`` returns it,
      ``key_hash``, ``manual_canary``, ``reasons``) plus optional ``canaries``
      (``{profiled: <vllm_canary result>, manual: <vllm_canary result>}``);
    * ``hosts``: ``{host: {class, batch, pending, touched, error, failed_task, rollback_failed}}``
      (``rollback_failed``: a class rollback stopped on this host - its outcome is ``failed``);
      ``batch`` is the batch number the host ran in, ``pending`` the instances
      that changed, ``error`` the message of the failure that stopped it;
    * ``batches``: ``[{index, total, hosts, started, finished, analysis}]`` (``analysis``: the bake's
      verdict on the batch, as ``gpufleet.vllm.rollout_bake`` returns it, when the class bakes);
    * ``check_mode``: whether the run was a dry run (``--check``);
    * ``probe`` (required for ``kind="probe"``): ``{hosts: {host: {class,
      error, driver_version, cuda_driver_version, nvml_version, gpus,
      instances}}}`` where ``gpus`` are ``gpu_memory_info`` entries and each
      instance is ``{name, unit, gpus, port, load_state, active_state,
      sub_state, plan}`` (``plan``: the instance's plan file, or null).
      A probe report's hosts come from this section (outcome ``probed``, or
      ``failed`` with the ``error``).
    """
    if kind not in KINDS:
        raise ReportError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    sources = _read_sources(data, kind)
    classes = _class_entries(sources.classes, sources.hosts)
    hosts = _host_entries(kind, sources.hosts, {c["name"]: c for c in classes})
    finished = data.get("finished") or (generated or utc_now()).isoformat()
    batches = _batch_entries(data.get("batches") or [], hosts, finished)
    gangs = _gang_entries(data.get("gangs"), hosts, sources.audit)
    rolled_back = [
        {"host": h["host"], "class": h["class"], "batch": h["batch"], "failed_task": h["failed_task"], "error": h["error"],
         "with_class_after": h["rolled_back_with"]}
        for h in hosts
        if h["outcome"] == "rolled_back"
    ]
    if kind == "rollout":
        policies = {str(b.get("class")): b.get("on_failure") for b in data.get("batches") or [] if isinstance(b, Mapping)}
        for cls in classes:
            cls["on_failure"] = str(policies[cls["name"]]) if policies.get(cls["name"]) else None
            cls["final"] = _class_final([h for h in hosts if h["class"] == cls["name"]], bool(data.get("check_mode")))
    stamp = generated or utc_now()
    report = {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "generated": stamp.isoformat(),
        "started": _iso(data.get("started")),
        "finished": finished,
        "classes": classes,
        "hosts": hosts,
        "batches": batches,
        "rolled_back": rolled_back,
        "gangs": gangs,
        # the hosts that failed themselves (a host rolled back with its class did not)
        "failed_hosts": [h["host"] for h in hosts if h["outcome"] in ("rolled_back", "failed") and not h["rolled_back_with"]],
        "check_mode": bool(data.get("check_mode")),
        "probe": sources.probe,
        "audit": sources.audit,
        "upgraded_from": None,
        "lease": dict(data["lease"]) if isinstance(data.get("lease"), Mapping) else None,
    }
    report["summary"] = _summary(report)
    return report


def _class_final(hosts: list[dict[str, Any]], check_mode: bool = False) -> dict[str, Any]:
    """Where a class's hosts ended: ``{state, new_plan, previous, failed}`` (host names; ``state``: ``new_plan``,
    ``previous_plan``, ``mixed`` or ``failed``). On the new plan: deployed or already on it; on the previous one: rolled
    back, or not reached; failed: a host whose rollback failed, or that failed before anything on it changed. In check
    mode nothing changed: a host the run would deploy is still on its previous plan."""
    deployed = ("unchanged",) if check_mode else ("deployed", "unchanged")
    new = sorted(h["host"] for h in hosts if h["outcome"] in deployed)
    previous = sorted(h["host"] for h in hosts if h["outcome"] in ("rolled_back", "not_reached", "skipped")
                      or (check_mode and h["outcome"] == "deployed"))
    failed = sorted(h["host"] for h in hosts if h["outcome"] == "failed")
    state = "failed" if failed else "mixed" if new and previous else "new_plan" if new else "previous_plan"
    return {"state": state, "new_plan": new, "previous": previous, "failed": failed}


@dataclass
class _Sources:
    """The checked sections of :func:`build_report`'s data. ``hosts`` are the audited or probed
    hosts in an audit or probe report, the data's own hosts otherwise."""

    classes: Mapping[str, Any]
    hosts: Mapping[str, Any]
    audit: dict[str, Any] | None
    probe: dict[str, Any] | None


def _read_sources(data: Any, kind: str) -> _Sources:
    if not isinstance(data, Mapping):
        raise ReportError("data: expected a mapping")
    classes_raw = data.get("classes") or {}
    if not isinstance(classes_raw, Mapping):
        raise ReportError("data.classes: expected a mapping of class name to class state")
    hosts_raw = data.get("hosts") or {}
    if not isinstance(hosts_raw, Mapping):
        raise ReportError("data.hosts: expected a mapping of host name to its facts")
    audit: dict[str, Any] | None = None
    if kind == "audit":
        if not isinstance(data.get("audit"), Mapping):
            raise ReportError("data.audit: an audit report needs the audit results, {hosts: {host: {instances, ...}}}")
        audit = _audit_section(data["audit"])
        hosts_raw = {h["host"]: {"class": h["class"], "error": h["error"]} for h in audit["hosts"]}
    probe: dict[str, Any] | None = None
    if kind == "probe" or data.get("probe") is not None:
        if not isinstance(data.get("probe"), Mapping):
            raise ReportError("data.probe: a probe report needs the probe results, {hosts: {host: {gpus, instances, ...}}}")
        probe = _probe_section(data["probe"])
        if kind == "probe":
            # a probe report's hosts are the probed ones
            hosts_raw = {h["host"]: {"class": h["class"], "error": h["error"]} for h in probe["hosts"]}
    return _Sources(classes_raw, hosts_raw, audit, probe)


def _class_entries(classes_raw: Mapping[str, Any], hosts_raw: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One entry per class, sorted by name, each with its hosts (checked to be mappings first)."""
    members: dict[str, list[str]] = {}
    for host, facts in hosts_raw.items():
        if not isinstance(facts, Mapping):
            raise ReportError(f"data.hosts.{host}: expected a mapping")
        members.setdefault(str(facts.get("class") or ""), []).append(str(host))
    classes = []
    for name, state in sorted(classes_raw.items()):
        if not isinstance(state, Mapping):
            raise ReportError(f"data.classes.{name}: expected a mapping")
        classes.append(_class_entry(str(name), state, members.get(str(name), [])))
    return classes


def _host_entries(kind: str, hosts_raw: Mapping[str, Any], by_name: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per host, sorted by name, with its outcome."""
    hosts = []
    for host, facts in sorted(hosts_raw.items()):
        cls = by_name.get(str(facts.get("class") or ""))
        pending = _str_list(facts.get("pending"))
        batch = facts.get("batch")
        error = facts.get("error")
        if kind in ("probe", "audit"):
            outcome = ("probed" if kind == "probe" else "audited") if error is None else "failed"
        else:
            outcome = _host_outcome(kind, {**facts, "pending": pending, "batch": batch if batch != "" else None}, cls)
        hosts.append(
            {
                "host": str(host),
                "class": str(facts.get("class") or ""),
                "batch": int(batch) if batch not in (None, "") else None,
                "pending": pending,
                "outcome": outcome,
                "failed_task": str(facts["failed_task"]) if facts.get("failed_task") else None,
                "error": str(error) if error is not None else None,
                # the host whose failure rolled this one back with its class (gpufleet_on_failure: rollback_class);
                # it did not fail itself
                "rolled_back_with": (str(facts["rolled_back_with"]) if facts.get("rolled_back_with") and outcome == "rolled_back"
                                     else None),
                "plans": [{"instance": str(p.get("instance")), "checksum": str(p.get("checksum")),
                           "compat_key_hash": p.get("compat_key_hash")}
                          for p in facts.get("plans") or [] if isinstance(p, Mapping)],
            }
        )
    return hosts


# a gang's outcome is its worst member's, in this order (the first is the worst)
GANG_OUTCOME_ORDER = ("failed", "rolled_back", "not_reached", "skipped", "deployed", "unchanged", "planned", "probed", "audited")


def _gang_entries(gangs_raw: Any, hosts: list[dict[str, Any]], audit: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """One entry per instance that spans hosts (a gang, ``{name, leader, members, host_class}`` as
    ``_gangs.described`` gives it): its members' outcomes, and the gang's, its worst member's (a member not in the
    report counts as ``not_reached``). In an audit, its members' verdicts on the gang's instance too, and the
    gang's, its worst member's: one member that would be refused at its next start stops the whole gang's start
    (a member whose instance was not audited counts as ``would_refuse``: nothing says it would start)."""
    outcomes = {h["host"]: h["outcome"] for h in hosts}
    entries = []
    for i, gang in enumerate(_sequence(gangs_raw or [], "data.gangs")):
        where = f"data.gangs[{i}]"
        gang = _mapping(gang, where)
        members = _str_list(gang.get("members"))
        if len(members) < 2 or not isinstance(gang.get("name"), str) or not gang["name"]:
            raise ReportError(f"{where}: expected a gang with its name and two or more members, got {dict(gang)!r}")
        of_members = {m: outcomes.get(m, "not_reached") for m in members}
        worst = min(of_members.values(), key=lambda o: GANG_OUTCOME_ORDER.index(o) if o in GANG_OUTCOME_ORDER else 0)
        entry = {"name": gang["name"], "leader": str(gang.get("leader") or members[0]), "members": members,
                 "class": str(gang.get("host_class") or ""), "members_outcomes": of_members, "outcome": worst}
        if audit is not None:
            verdicts = _gang_audit_verdicts(audit, gang["name"], members)
            entry["members_verdicts"] = verdicts
            entry["verdict"] = min(verdicts.values(), key=AUDIT_VERDICTS.index)
        entries.append(entry)
    return entries


def _gang_audit_verdicts(audit: Mapping[str, Any], name: str, members: list[str]) -> dict[str, str]:
    by_host = {h["host"]: h for h in audit["hosts"]}
    verdicts = {}
    for member in members:
        found = [i["verdict"] for i in (by_host.get(member) or {}).get("instances", []) if i["instance"] == name]
        verdicts[member] = found[0] if found else "would_refuse"
    return verdicts


def _batch_entries(batches_raw: Any, hosts: list[dict[str, Any]], finished: Any) -> list[dict[str, Any]]:
    """One entry per batch with its hosts' outcomes; a batch still running counts up to ``finished``."""
    batches = []
    for pos, raw in enumerate(batches_raw):
        if not isinstance(raw, Mapping):
            raise ReportError(f"data.batches[{pos}]: expected a mapping")
        index = int(raw.get("index", pos + 1))
        names = _str_list(raw.get("hosts"))
        outcomes = {h["host"]: h["outcome"] for h in hosts if h["batch"] == index}
        with_class = {h["host"] for h in hosts if h["batch"] == index and h.get("rolled_back_with")}
        # a host rolled back with its class passed its batch: the batch is rolled back, not failed
        bad = [n for n in names if outcomes.get(n) in ("rolled_back", "failed") and n not in with_class]
        batches.append(
            {
                "index": index,
                "total": _num(raw.get("total")),
                # per-class ramps: batch class_index of class_total of this class
                "class": str(raw["class"]) if raw.get("class") else None,
                "class_index": _num(raw.get("class_index")),
                "class_total": _num(raw.get("class_total")),
                "hosts": [{"host": n, "outcome": outcomes.get(n, "unknown")} for n in names],
                "started": raw.get("started"),
                "finished": raw.get("finished"),
                "seconds": _seconds_between(raw.get("started"), raw.get("finished") or finished),
                "outcome": ("failed" if bad else "rolled_back" if with_class & set(names)
                            else "ok" if raw.get("finished") else "stopped"),
                # the bake's verdict on the batch (rollout_bake), None for a batch that was not baked
                "analysis": _analysis_entry(raw.get("analysis"), f"data.batches[{pos}].analysis"),
            }
        )
    return batches


def _analysis_entry(raw: Any, where: str) -> dict[str, Any] | None:
    """A batch's analysis as the report keeps it: the verdict, what it counted as, the bake's span and every check."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or not isinstance(raw.get("checks"), list):
        raise ReportError(f"{where}: expected the analysis of gpufleet.vllm.rollout_bake (verdict, effective, checks)")
    checks = []
    for pos, check in enumerate(raw["checks"]):
        if not isinstance(check, Mapping):
            raise ReportError(f"{where}.checks[{pos}]: expected a mapping")
        checks.append({key: check.get(key) for key in ("name", "verdict", "why", "canary", "baseline", "threshold", "limit", "samples")})
    return {
        "verdict": str(raw.get("verdict")),
        "effective": str(raw.get("effective") or raw.get("verdict")),
        "seconds": _num(raw.get("seconds")),
        "started": raw.get("started"),
        "finished": raw.get("finished"),
        "canary_hosts": _num(raw.get("canary_hosts")),
        "baseline_hosts": _num(raw.get("baseline_hosts")),
        # each engine's /metrics, or the Prometheus server asked (None: a bake that did not read)
        "source": str(raw["source"]) if raw.get("source") else None,
        "checks": checks,
        "unread": [str(u) for u in raw.get("unread") or []],
        # the bake itself failed (an error, not a verdict)
        "error": str(raw["error"]) if raw.get("error") else None,
        "baseline_unread": {str(h): [str(w) for w in why] for h, why in (raw.get("baseline_unread") or {}).items()},
    }


def _summary(report: Mapping[str, Any]) -> dict[str, Any]:
    counts = {o: 0 for o in OUTCOMES}
    for host in report["hosts"]:
        counts[host["outcome"]] = counts.get(host["outcome"], 0) + 1
    out: dict[str, Any] = {
        "classes": len(report["classes"]),
        "deployable_classes": sum(1 for c in report["classes"] if c["status"] == "deployable"),
        "failed_classes": [c["name"] for c in report["classes"] if c["status"] == "failed"],
        "hosts": len(report["hosts"]),
        "outcomes": {k: v for k, v in counts.items() if v},
        "ok": not report["failed_hosts"] and not any(c["status"] == "failed" for c in report["classes"]),
    }
    if report.get("probe") is not None:
        out["probe"] = _probe_summary(report["probe"])
    if report.get("audit") is not None:
        out["audit"] = _audit_summary(report["audit"], report.get("gangs") or [])
        out["ok"] = out["ok"] and not out["audit"]["would_refuse"] and not out["audit"]["plan_edited"]
    return out


def class_artifacts(report: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per class, the compact plan and verdicts published as job artifacts (``set_stats``)."""
    out = {}
    for cls in report["classes"]:
        plan = cls["plan"]
        out[cls["name"]] = {
            "status": cls["status"],
            "decision": cls["decision"],
            "kv_cache_memory_bytes": plan.get("kv_cache_memory_bytes"),
            "kv_cache_tokens": plan.get("kv_cache_tokens"),
            "gpu_memory_utilization": plan.get("gpu_memory_utilization"),
            "free_floor_bytes": cls["free_floor_bytes"],
            "weakest": cls["weakest"],
            "manual_canary": cls["manual_canary"],
            "canary_verdicts": {name: (c or {}).get("verdict") for name, c in cls["canaries"].items() if c},
            "hosts": {h["host"]: h["outcome"] for h in report["hosts"] if h["class"] == cls["name"]},
        }
    return out


# ---------------------------------------------------------------- reading stored reports
def _upgrade_v0(old: Mapping[str, Any]) -> dict[str, Any]:
    """Version 0: ``{started, classes: {name: flat summary with hosts: [{host, pending_before}]}}``."""
    classes: dict[str, Any] = {}
    hosts: dict[str, Any] = {}
    classes_raw = old.get("classes") or {}
    if not isinstance(classes_raw, Mapping):
        raise ReportError("report.json (schema 0): classes must be a mapping")
    for name, flat in classes_raw.items():
        if not isinstance(flat, Mapping):
            raise ReportError(f"report.json (schema 0): classes.{name} must be a mapping")
        plan = {k: flat.get(k) for k in ("decision", "kv_cache_memory_bytes", "gpu_memory_utilization", "free_floor_bytes", "kv_cache_tokens", "weakest")}
        classes[name] = {
            "ok": flat.get("ok"),
            "failed": flat.get("failed"),
            "plan": plan,
            "key_hash": flat.get("key_hash"),
            "manual_canary": flat.get("manual_canary"),
            "reasons": flat.get("reasons"),
        }
        for host in flat.get("hosts") or []:
            if isinstance(host, Mapping) and host.get("host"):
                hosts[str(host["host"])] = {"class": name, "pending": host.get("pending_before") or []}
    return {"started": old.get("started"), "classes": classes, "hosts": hosts}


_REQUIRED_KEYS = ("kind", "classes", "hosts", "batches", "summary")


def load_report(obj: Any) -> dict[str, Any]:
    """A stored report (parsed JSON) of any known schema version, as a current one."""
    if not isinstance(obj, Mapping):
        raise ReportError("report.json: expected a JSON object")
    version = obj.get("schema_version", 0)
    if version in (1, SCHEMA_VERSION):
        missing = [k for k in _REQUIRED_KEYS + (("probe",) if version == SCHEMA_VERSION and obj.get("kind") == "probe" else ()) if k not in obj]
        if missing:
            raise ReportError(f"report.json (schema {version}): missing {', '.join(missing)}")
        report = dict(obj)
        if version == 1:
            # Version 1 had no probe section nor check-mode flag; everything else is unchanged.
            report.update(schema_version=SCHEMA_VERSION, probe=None, check_mode=False, upgraded_from=1)
        report.setdefault("probe", None)
        report.setdefault("audit", None)
        report.setdefault("check_mode", False)
        # written before class rollbacks were told apart and classes said where their hosts ended: derived
        hosts = [dict(h, rolled_back_with=h.get("rolled_back_with")) for h in report["hosts"] if isinstance(h, Mapping)]
        report["hosts"] = hosts
        if report.get("kind") == "rollout":
            dry = bool(report["check_mode"])
            report["classes"] = [dict(c, on_failure=c.get("on_failure"),
                                      final=c.get("final") or _class_final([h for h in hosts if h.get("class") == c.get("name")], dry))
                                 for c in report["classes"] if isinstance(c, Mapping)]
        return report
    if version == 0:
        kind = obj.get("kind") or "rollout"
        stamp = _parse_time(obj.get("started")) or utc_now()
        report = build_report(_upgrade_v0(obj), kind if kind in KINDS else "rollout", generated=stamp)
        # A v0 summary holds no batch record: say "unknown", never "not reached".
        for host in report["hosts"]:
            if host["outcome"] == "not_reached":
                host["outcome"] = "unknown"
        report["summary"] = _summary(report)
        report["finished"] = None
        report["upgraded_from"] = 0
        return report
    raise ReportError(f"report.json: unknown schema_version {version!r} (this collection reads 0 to {SCHEMA_VERSION})")

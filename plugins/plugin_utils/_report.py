# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Run reports behind ``gpufleet.vllm.rollout_report``.

Plain Python, no Ansible import.

* :func:`build_report` turns what a playbook collected (per class state with
  the plan and the canaries, per host outcome facts, the batch records; for a
  probe run, per host its GPUs and instances) into a report of schema version
  :data:`SCHEMA_VERSION`;
* :func:`load_report` reads a stored ``report.json`` of any known schema
  version (version 0 is the flat summary older playbooks wrote, version 1 has
  no ``probe`` nor ``check_mode``) and upgrades it;
* :func:`render_markdown` and :func:`render_html` render a report (the HTML is
  self-contained: inline CSS and SVG, no external asset, no script);
* :func:`write_run_dir` writes ``<dir>/<kind>-<UTC timestamp>/`` with
  ``report.json``, ``report.md`` and ``report.html`` atomically (a temporary
  directory renamed into place) and never replaces an existing run directory.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import SizeError, human_bytes, parse_size

__all__ = [
    "KINDS",
    "OUTCOMES",
    "SCHEMA_VERSION",
    "ReportError",
    "build_report",
    "class_artifacts",
    "load_report",
    "render_html",
    "render_markdown",
    "render_svg",
    "summary_line",
    "write_run_dir",
]

# 2: ``probe`` (what a probe run read per host, GPU and instance) and ``check_mode``.
SCHEMA_VERSION = 2
KINDS = ("rollout", "plan", "probe", "audit")
# Per host outcome of a run, worst first (the summary counts them).
OUTCOMES = ("rolled_back", "failed", "not_reached", "skipped", "deployed", "unchanged", "planned", "probed", "audited")
# Verdicts of an audit run per instance, worst first (vllm_audit, _audit.VERDICTS reversed).
AUDIT_VERDICTS = ("would_refuse", "would_shrink", "reprofile_due", "ok")

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
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ReportError(f"{field}: expected a byte count, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise ReportError(f"{field}: expected a byte count, got {value!r}")
        return int(value)
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


def _hb(value: Any) -> str:
    if value is None:
        return "-"
    try:
        return human_bytes(int(value))
    except (TypeError, ValueError):
        return str(value)


def _signed_hb(value: Any) -> str:
    if value is None:
        return "-"
    value = int(value)
    return ("-" if value < 0 else "+") + human_bytes(abs(value))


def _text(value: Any) -> str:
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


def _utc_now() -> _dt.datetime:
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
    out["reason"] = _text(choice.get("reason"))
    return out


def _first_run(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the rollout does to the class (``_first_run.outline``): canary host, stops and outages, units."""
    outline = state.get("first_run")
    if not isinstance(outline, Mapping):
        return None
    stops = [
        {"host": _text(s.get("host")), "unit": _text(s.get("unit")), "when": _text(s.get("when")), "boots": _num(s.get("boots")),
         "load_tests": _num(s.get("load_tests")), "estimate": _text(s.get("estimate")), "seconds": _num(s.get("seconds")),
         "drained": bool(s.get("drained"))}
        for s in outline.get("stops") or [] if isinstance(s, Mapping)
    ]
    units = [
        {"host": _text(u.get("host")), "unit": _text(u.get("unit")), "action": _text(u.get("action")), "batch": _num(u.get("batch"))}
        for u in outline.get("units") or [] if isinstance(u, Mapping)
    ]
    return {
        "canary_host": _text(outline.get("canary_host")),
        "canary_rule": _text(outline.get("canary_rule")),
        "canary_instance": _text(outline.get("canary_instance")),
        "profiled_canary": bool(outline.get("profiled_canary")),
        "boot_seconds": _num(outline.get("boot_seconds")),
        "boot_source": _text(outline.get("boot_source")),
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
    failed = bool(state.get("failed"))
    ok = bool(state.get("ok")) and not failed
    weakest = plan.get("weakest") if isinstance(plan.get("weakest"), Mapping) else None
    canaries_doc = state.get("canaries")
    canaries_raw: Mapping[str, Any] = canaries_doc if isinstance(canaries_doc, Mapping) else {}
    entry: dict[str, Any] = {
        "name": name,
        "status": "failed" if failed else ("deployable" if ok else "skipped"),
        "decision": plan.get("decision") or state.get("decision"),
        "reasons": _str_list(state.get("reasons") or plan.get("reasons")),
        "key_hash": str(state.get("key_hash") or ""),
        "plan": {field: plan.get(field) for field in _PLAN_FIELDS},
        "free_floor_bytes": _rank_map(plan.get("free_floor_bytes"), f"class {name}: free_floor_bytes"),
        "vllm_floor_bytes": _rank_map(plan.get("vllm_floor_bytes"), f"class {name}: vllm_floor_bytes"),
        "weakest": (
            {"host": str(weakest.get("host")), "rank": weakest.get("rank"), "adjusted_bytes": _int(weakest.get("adjusted_bytes"), "weakest")}
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
        plan_map = _mapping(plan_raw, f"{where}.plan")
        plan = {field: plan_map.get(field) for field in _INSTANCE_PLAN_FIELDS}
        plan["kv_cache_memory_bytes"] = _int(plan["kv_cache_memory_bytes"], f"{where}.plan.kv_cache_memory_bytes")
        for field in ("gpu_memory_utilization", "num_blocks", "kv_cache_tokens", "max_concurrency"):
            plan[field] = _num(plan[field])
        plan["free_floor_bytes"] = _rank_map(plan_map.get("free_floor_bytes"), f"{where}.plan.free_floor_bytes")
    gpus = [_num(g) for g in _sequence(inst.get("gpus"), f"{where}.gpus")]
    return {
        "name": name,
        "unit": str(inst.get("unit") or f"vllm-{name}.service"),
        "gpus": [g for g in gpus if g is not None],
        "port": _num(inst.get("port")),
        "load_state": str(inst.get("load_state") or "") or None,
        "active_state": str(inst.get("active_state") or "") or None,
        "sub_state": str(inst.get("sub_state") or "") or None,
        "plan": plan,
    }


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
                "planned_at": _text(inst.get("planned_at")) if inst.get("planned_at") else None,
                "plan_age_days": _num(inst.get("plan_age_days")),
                "compat_key_hash": inst.get("compat_key_hash"),
                "reference_key_hash": inst.get("reference_key_hash"),
                "key_matches": inst.get("key_matches"),
                "last_start_action": last.get("action"),
                "degraded": bool(last.get("degraded")),
                "reasons": _str_list(inst.get("reasons")),
            })
        hosts.append({"host": str(host), "class": str(facts.get("class") or ""), "ok": error is None,
                      "error": str(error) if error is not None else None, "instances": instances})
    return {"hosts": hosts}


def _signed_int(value: Any, field: str) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        return value
    return _int(value, field)


def _audit_summary(audit: Mapping[str, Any]) -> dict[str, Any]:
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
    }


def _instance_state(inst: Mapping[str, Any]) -> str:
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
        return "rolled_back" if host.get("touched") and host.get("batch") is not None else "failed"
    if class_entry is None or class_entry["status"] != "deployable":
        return "skipped"
    if kind != "rollout":
        return "planned"
    if host.get("batch") is None:
        return "not_reached"
    return "deployed" if host.get("pending") else "unchanged"


def build_report(data: Mapping[str, Any], kind: str = "rollout", generated: _dt.datetime | None = None) -> dict[str, Any]:
    """Turn what a playbook collected into a report of schema version :data:`SCHEMA_VERSION`.

    ``data`` keys (all optional but ``classes``):

    * ``started``/``finished``: ISO 8601 times of the run;
    * ``classes``: ``{name: state}`` where ``state`` is the class state the
      rollout keeps (``ok``, ``failed``, ``plan`` as ``kv_plan`` returns it,
      ``key_hash``, ``manual_canary``, ``reasons``) plus optional ``canaries``
      (``{profiled: <vllm_canary result>, manual: <vllm_canary result>}``);
    * ``hosts``: ``{host: {class, batch, pending, touched, error, failed_task}}``;
      ``batch`` is the batch number the host ran in, ``pending`` the instances
      that changed, ``error`` the message of the failure that stopped it;
    * ``batches``: ``[{index, total, hosts, started, finished}]``;
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
    by_name = {c["name"]: c for c in classes}

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
            }
        )
    finished = data.get("finished") or (generated or _utc_now()).isoformat()
    batches = []
    for pos, raw in enumerate(data.get("batches") or []):
        if not isinstance(raw, Mapping):
            raise ReportError(f"data.batches[{pos}]: expected a mapping")
        index = int(raw.get("index", pos + 1))
        names = _str_list(raw.get("hosts"))
        outcomes = {h["host"]: h["outcome"] for h in hosts if h["batch"] == index}
        bad = [n for n in names if outcomes.get(n) in ("rolled_back", "failed")]
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
                "outcome": "failed" if bad else ("ok" if raw.get("finished") else "stopped"),
            }
        )
    rolled_back = [
        {"host": h["host"], "class": h["class"], "batch": h["batch"], "failed_task": h["failed_task"], "error": h["error"]}
        for h in hosts
        if h["outcome"] == "rolled_back"
    ]
    stamp = generated or _utc_now()
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
        "failed_hosts": [h["host"] for h in hosts if h["outcome"] in ("rolled_back", "failed")],
        "check_mode": bool(data.get("check_mode")),
        "probe": probe,
        "audit": audit,
        "upgraded_from": None,
    }
    report["summary"] = _summary(report)
    return report


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
        out["audit"] = _audit_summary(report["audit"])
        out["ok"] = out["ok"] and not out["audit"]["would_refuse"]
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
        return report
    if version == 0:
        kind = obj.get("kind") or "rollout"
        stamp = _parse_time(obj.get("started")) or _utc_now()
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


# ---------------------------------------------------------------- renderers
def summary_line(report: Mapping[str, Any]) -> str:
    """One line: classes, host outcomes, failed hosts (a probe: hosts, GPUs, instances, lowest boot free)."""
    summ = report["summary"]
    if report["kind"] == "audit" and summ.get("audit"):
        audit = summ["audit"]
        parts = [f"audit: {audit['audited']} of {audit['hosts']} host(s) audited, {audit['instances']} instance(s)"]
        if audit["verdicts"]:
            parts.append(", ".join(f"{audit['verdicts'][v]} {v.replace('_', ' ')}" for v in AUDIT_VERDICTS if v in audit["verdicts"]))
        if audit["would_refuse"]:
            parts.append("refused at next start: " + ", ".join(audit["would_refuse"]))
        if report["failed_hosts"]:
            parts.append("failed hosts " + ", ".join(report["failed_hosts"]))
        return "; ".join(parts)
    if report["kind"] == "probe" and summ.get("probe"):
        probe = summ["probe"]
        parts = [
            f"probe: {probe['probed']} of {probe['hosts']} host(s) probed, {probe['gpus']} GPU(s), "
            f"{probe['active_instances']} of {probe['instances']} instance(s) active"
        ]
        low = probe.get("lowest_boot_free")
        if low:
            parts.append(f"lowest boot free {_hb(low['bytes'])} ({low['host']} GPU {_text(low['index'])})")
        if report["failed_hosts"]:
            parts.append("failed hosts " + ", ".join(report["failed_hosts"]))
        return "; ".join(parts)
    parts = [f"{report['kind']}: {summ['classes']} class(es), {summ['deployable_classes']} deployable"]
    if summ["failed_classes"]:
        parts.append("failed classes " + ", ".join(summ["failed_classes"]))
    if summ["outcomes"]:
        # worst first, also for a stored report (report.json is written with sorted keys)
        order = [o for o in OUTCOMES if o in summ["outcomes"]] + sorted(set(summ["outcomes"]) - set(OUTCOMES))
        parts.append(", ".join(f"{summ['outcomes'][k]} {k.replace('_', ' ')}" for k in order))
    if report["failed_hosts"]:
        parts.append("failed hosts " + ", ".join(report["failed_hosts"]))
    if report.get("check_mode"):
        parts.append("check mode: nothing was changed on the hosts")
    return "; ".join(parts)


def _class_budget_line(cls: Mapping[str, Any]) -> list[tuple[str, str]]:
    plan = cls["plan"]
    rows = [
        ("decision", _text(cls["decision"])),
        ("status", cls["status"]),
        ("KV cache bytes (launch)", f"{_hb(plan['kv_cache_memory_bytes'])} ({_text(plan['kv_cache_memory_bytes'])} bytes)"),
        ("max safe bytes", _hb(plan.get("max_safe_bytes"))),
        ("blocks / tokens", f"{_text(plan['num_blocks'])} / {_text(plan['kv_cache_tokens'])}"),
        ("max concurrency", _text(plan.get("max_concurrency"))),
        ("startup --gpu-memory-utilization", _text(plan["gpu_memory_utilization"])),
        ("free floor (NVML) per rank", ", ".join(f"rank {r}: {_hb(v)}" for r, v in cls["free_floor_bytes"].items()) or "-"),
        ("weakest", f"{cls['weakest']['host']} rank {cls['weakest']['rank']}" if cls["weakest"] else "-"),
        ("compatibility key", cls["key_hash"] or "-"),
    ]
    fp8 = cls.get("what_if_fp8")
    if fp8:
        rows.append(("what if fp8 KV", f"{_text(fp8['kv_cache_tokens'])} tokens, max concurrency {_text(fp8['max_concurrency'])}"))
    choice = cls.get("budget_choice")
    # a plan made with settling off (the exact formula, nothing deployed) has nothing to say here
    if choice and (choice["gate_margin_bytes"] or choice["granularity_bytes"] or choice["deployed_bytes"] is not None):
        rows.append(
            (
                "budget kept" if choice["kept"] else "budget settled",
                f"{_hb(choice['rounded_bytes'])} = max safe {_hb(choice['max_safe_bytes'])} less the gate margin "
                f"{_hb(choice['gate_margin_bytes'])}, rounded down to {_hb(choice['granularity_bytes'])} and whole blocks; "
                f"{choice['reason']}",
            )
        )
    fit = cls.get("fit")
    if fit:
        rows.append(
            (
                "right-size (fit_admission)",
                f"{_hb(fit['budget_bytes'])} instead of {_hb(fit['max_safe_bytes'])}: "
                f"{_hb(fit['left_free_bytes_per_gpu'])} per GPU left free for other work",
            )
        )
    adm = cls.get("admission")
    if adm:
        rows.append(
            (
                "admission plan",
                f"needs {_text(adm.get('required_blocks'))} blocks, has {_text(adm.get('available_blocks'))}"
                + (f"; {_text(adm.get('shortfall_tokens'))} tokens short" if adm.get("shortfall_blocks") else ": ok"),
            )
        )
    for group in cls.get("split") or []:
        rows.append((f"split {group['name']}", f"{', '.join(group['hosts'])}: {_hb(group['kv_cache_memory_bytes'])}"))
    return rows


_CANARY_COLUMNS = (
    ("verdict", "verdict"),
    ("kv_cache_tokens", "tokens"),
    ("preemptions", "preemptions"),
    ("failed", "failed requests"),
    ("ttft_p50", "TTFT p50 s"),
    ("ttft_p95", "TTFT p95 s"),
    ("e2e_p50", "e2e p50 s"),
    ("e2e_p95", "e2e p95 s"),
)


def _canaries_in_order(cls: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """The class's canaries that ran, profiled first (also for a stored report, whose keys are sorted)."""
    found = cls.get("canaries") or {}
    names = [n for n in ("profiled", "manual") if n in found] + sorted(set(found) - {"profiled", "manual"})
    return [(n, found[n]) for n in names if found[n]]


def _md_cell(value: Any) -> str:
    return _text(value).replace("|", "\\|").replace("\n", " ")


def _batch_label(batch: Mapping[str, Any]) -> str:
    """``3 of 4`` for the run; ``1 of 3 of class l40s (3 of 4)`` when the batch names its class."""
    run = f"{batch['index']}" + (f" of {batch['total']}" if batch.get("total") else "")
    if batch.get("class") and batch.get("class_index"):
        return f"{batch['class_index']} of {batch.get('class_total') or '?'} of class {batch['class']} ({run})"
    return run


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown."""
    out = [f"# gpufleet.vllm {report['kind']} report", ""]
    out.append(f"- started: {_text(report.get('started'))}")
    out.append(f"- finished: {_text(report.get('finished'))}")
    out.append(f"- summary: {summary_line(report)}")
    if report.get("check_mode"):
        out.append("- dry run (check mode): nothing was changed on the hosts")
    if report.get("upgraded_from") == 0:
        out.append("- read from a schema 0 report: per-rank figures, canaries and batches were not recorded")
    out.append("")
    if report.get("probe"):
        out += _probe_markdown(report["probe"])
    if report.get("audit"):
        out += _audit_markdown(report["audit"])
    for cls in report["classes"]:
        out += [f"## Class {cls['name']}", "", "| | |", "|---|---|"]
        out += [f"| {_md_cell(k)} | {_md_cell(v)} |" for k, v in _class_budget_line(cls)]
        out.append("")
        if cls["reasons"]:
            out += ["Reasons:", ""] + [f"- {r}" for r in cls["reasons"]] + [""]
        if cls.get("first_run") and cls["first_run"]["lines"]:
            out += ["What the rollout does (estimates):", ""] + [f"- {_md_cell(line)}" for line in cls["first_run"]["lines"]] + [""]
        if cls["per_rank"]:
            out += [
                "| host | rank | boot free | floor | drift (F_ref - F_boot) | adjusted | margin |",
                "|---|---|---|---|---|---|---|",
            ]
            for row in cls["per_rank"]:
                out.append(
                    f"| {_md_cell(row['host'])}{' (weakest)' if row['weakest'] else ''} | {row['rank']} | {_hb(row['boot_free_bytes'])} | "
                    f"{_hb(row['floor_bytes'])} | {_signed_hb(row['drift_bytes'])} | "
                    f"{_hb(row['adjusted_bytes'])} | {_signed_hb(row['margin_bytes'])} |"
                )
            out.append("")
        canaries = _canaries_in_order(cls)
        out.append(f"Manual canary: {cls['manual_canary']}")
        out.append("")
        if canaries:
            out += ["| canary | " + " | ".join(h for _k, h in _CANARY_COLUMNS) + " |", "|---" * (len(_CANARY_COLUMNS) + 1) + "|"]
            for name, can in canaries:
                out.append(f"| {name} | " + " | ".join(_md_cell(can.get(k)) for k, _h in _CANARY_COLUMNS) + " |")
            out.append("")
    if report["batches"]:
        out += ["## Batches", "", "| batch | hosts | seconds | outcome |", "|---|---|---|---|"]
        for b in report["batches"]:
            hosts = ", ".join(f"{h['host']} ({h['outcome'].replace('_', ' ')})" for h in b["hosts"])
            out.append(f"| {_md_cell(_batch_label(b))} | {_md_cell(hosts)} | {_text(b['seconds'])} | {b['outcome']} |")
        out.append("")
    if report["hosts"] and not report.get("probe"):
        out += ["## Hosts", "", "| host | class | batch | outcome | changed instances |", "|---|---|---|---|---|"]
        for h in report["hosts"]:
            out.append(
                f"| {_md_cell(h['host'])} | {_md_cell(h['class'])} | {_text(h['batch'])} | {h['outcome'].replace('_', ' ')} | "
                f"{_md_cell(', '.join(h['pending']) or '-')} |"
            )
        out.append("")
    if report["rolled_back"]:
        out += ["## Rolled back", ""]
        for rb in report["rolled_back"]:
            out.append(f"- **{rb['host']}** (class {rb['class']}, batch {_text(rb['batch'])}): {rb['error']}")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


_GPU_COLUMNS = ("GPU", "name", "total", "free", "boot free", "free min / max", "own engine", "other processes")
_INSTANCE_COLUMNS = ("instance", "unit", "state", "GPUs", "port", "KV budget", "tokens", "utilization", "decision", "compatibility key")


def _gpu_row(gpu: Mapping[str, Any]) -> list[str]:
    others = [p for p in gpu["processes"] if not p["own"]]
    other_bytes = sum(p["used_bytes"] or 0 for p in others)
    return [
        _text(gpu["index"]),
        _text(gpu["name"]),
        _hb(gpu["total_bytes"]),
        _hb(gpu["free_bytes"]),
        _hb(gpu["boot_free_bytes"]),
        f"{_hb(gpu['free_min_bytes'])} / {_hb(gpu['free_max_bytes'])}",
        _hb(gpu["own_used_bytes"]),
        (f"{len(others)} ({_hb(other_bytes)})" if others else "none") if gpu["processes_reported"] else "not reported",
    ]


def _instance_row(inst: Mapping[str, Any]) -> list[str]:
    plan = inst.get("plan") or {}
    return [
        inst["name"],
        inst["unit"],
        _instance_state(inst),
        ", ".join(str(g) for g in inst["gpus"]) or "-",
        _text(inst["port"]),
        _hb(plan.get("kv_cache_memory_bytes")) if plan else "no plan file",
        _text(plan.get("kv_cache_tokens")),
        _text(plan.get("gpu_memory_utilization")),
        _text(plan.get("decision")),
        _text(plan.get("compat_key_hash")),
    ]


def _host_line(host: Mapping[str, Any]) -> str:
    bits = [f"class {host['class']}" if host["class"] else "no class"]
    if host["driver_version"]:
        bits.append(f"driver {host['driver_version']}")
    if host["cuda_driver_version"]:
        bits.append(f"CUDA {host['cuda_driver_version']}")
    if host["nvml_version"]:
        bits.append(f"NVML {host['nvml_version']}")
    return ", ".join(bits)


_AUDIT_COLUMNS = ("instance", "verdict", "next start", "rank", "GPU", "boot free", "floor", "margin", "plan age", "key")


def _audit_rows(inst: Mapping[str, Any]) -> list[list[str]]:
    key = {True: "matches", False: "changed", None: "-"}[inst["key_matches"]]
    age = f"{inst['plan_age_days']:.1f} d" if isinstance(inst["plan_age_days"], (int, float)) else "-"
    rows = []
    for row in inst["ranks"] or [{"rank": None, "gpu": None, "free_bytes": None, "floor_bytes": None, "margin_bytes": None}]:
        rows.append([inst["instance"], inst["verdict"].replace("_", " "), inst["next_start"], _text(row["rank"]), _text(row["gpu"]),
                     _hb(row["free_bytes"]), _hb(row["floor_bytes"]), _signed_hb(row["margin_bytes"]), age, key])
    return rows


def _audit_markdown(audit: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for host in audit["hosts"]:
        out += [f"## Host {host['host']}", "", f"- class: {_md_cell(host['class'] or '-')}"]
        if host["error"]:
            out.append(f"- audit failed: {_md_cell(host['error'])}")
        out.append("")
        if host["instances"]:
            out += ["| " + " | ".join(_AUDIT_COLUMNS) + " |", "|---" * len(_AUDIT_COLUMNS) + "|"]
            for inst in host["instances"]:
                out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in _audit_rows(inst)]
            out.append("")
            for inst in host["instances"]:
                out += [f"- {_md_cell(inst['instance'])}: {_md_cell(r)}" for r in inst["reasons"]]
            out.append("")
    return out


def _audit_html(audit: Mapping[str, Any]) -> list[str]:
    esc = html.escape
    out: list[str] = []
    for host in audit["hosts"]:
        out.append(f'<h2 id="host-{esc(host["host"])}">Host {esc(host["host"])}</h2>')
        out.append(f"<p>class {esc(host['class'] or '-')}</p>")
        if host["error"]:
            out.append(f'<p class="bad">audit failed: <code>{esc(host["error"])}</code></p>')
        rows = []
        for inst in host["instances"]:
            for row in _audit_rows(inst):
                cells = [esc(c) for c in row]
                bad = inst["verdict"] in ("would_refuse", "would_shrink")
                cells[1] = f'<span class="{"bad" if bad else "ok"}">{cells[1]}</span>'
                rows.append(cells)
        if rows:
            out.append(_html_table(list(_AUDIT_COLUMNS), rows, raw=True))
        reasons = [(i["instance"], r) for i in host["instances"] for r in i["reasons"]]
        if reasons:
            out.append("<ul>" + "".join(f"<li>{esc(n)}: {esc(r)}</li>" for n, r in reasons) + "</ul>")
    return out


def _probe_markdown(probe: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for host in probe["hosts"]:
        out += [f"## Host {host['host']}", "", f"- {_md_cell(_host_line(host))}"]
        if host["error"]:
            out.append(f"- probe failed: {_md_cell(host['error'])}")
        out.append("")
        if host["gpus"]:
            out += ["| " + " | ".join(_GPU_COLUMNS) + " |", "|---" * len(_GPU_COLUMNS) + "|"]
            out += ["| " + " | ".join(_md_cell(c) for c in _gpu_row(g)) + " |" for g in host["gpus"]]
            out.append("")
            procs = [(g["index"], p) for g in host["gpus"] for p in g["processes"]]
            if procs:
                out += ["| GPU | pid | process | used | own engine |", "|---|---|---|---|---|"]
                for index, proc in procs:
                    out.append(
                        f"| {_text(index)} | {_text(proc['pid'])} | {_md_cell(proc['name'])} | {_hb(proc['used_bytes'])} | "
                        f"{'yes' if proc['own'] else 'no'} |"
                    )
                out.append("")
        if host["instances"]:
            out += ["| " + " | ".join(_INSTANCE_COLUMNS) + " |", "|---" * len(_INSTANCE_COLUMNS) + "|"]
            out += ["| " + " | ".join(_md_cell(c) for c in _instance_row(i)) + " |" for i in host["instances"]]
            out.append("")
    return out


# SVG chart of a probed host: one stacked bar per GPU (reserved, other processes, own engine, free).
_GPU_SEGMENTS = (
    ("reserved", "#9e9e9e", "driver reserve"),
    ("other", "#ef6c00", "other processes"),
    ("own", "#1565c0", "own engine"),
    ("free", "#2e7d32", "free"),
)


def render_gpu_svg(host: Mapping[str, Any]) -> str:
    """Inline SVG: per GPU of a probed host, its memory split into reserve, other processes, own engine and free."""
    gpus = [g for g in host.get("gpus") or [] if g.get("total_bytes")]
    if not gpus:
        return ""
    width = _LABEL_W + _BAR_W + _NOTE_W
    height = _ROW_H * len(gpus) + 30
    esc = html.escape
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        f"<title>{esc(host['host'])}: memory of each GPU</title>",
    ]
    for i, gpu in enumerate(gpus):
        y = 10 + i * _ROW_H
        total = gpu["total_bytes"]
        free = gpu["free_bytes"] or 0
        reserved = gpu["reserved_bytes"] or 0
        own = gpu["own_used_bytes"] or 0
        sizes = {"reserved": reserved, "own": own, "free": free, "other": max(0, total - reserved - own - free)}
        label = f"GPU {_text(gpu['index'])} {gpu['name'] or ''}".strip()
        parts.append(f'<text x="{_LABEL_W - 8}" y="{y + 16}" text-anchor="end" font-size="12">{esc(label)}</text>')
        x = float(_LABEL_W)
        for key, color, _legend in _GPU_SEGMENTS:
            seg = round(_BAR_W * sizes[key] / total, 1)
            if seg > 0:
                parts.append(
                    f'<rect class="gpu-{key}" x="{round(x, 1)}" y="{y + 3}" width="{seg}" height="{_ROW_H - 8}" fill="{color}" fill-opacity="0.8"/>'
                )
            x += seg
        note = f"free {_hb(free)} of {_hb(total)}, boot free {_hb(gpu['boot_free_bytes'])}"
        parts.append(f'<text x="{_LABEL_W + _BAR_W + 8}" y="{y + 16}" font-size="11">{esc(note)}</text>')
    legend = "bar, left to right: " + ", ".join(f"{text} ({color})" for _key, color, text in _GPU_SEGMENTS)
    parts.append(f'<text x="{_LABEL_W}" y="{height - 4}" font-size="11">{esc(legend)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


# SVG chart: one row per host/rank; bar = boot free memory, tick = floor, label = drift.
_ROW_H = 26
_LABEL_W = 230
_BAR_W = 560
_NOTE_W = 290


def render_svg(cls: Mapping[str, Any]) -> str:
    """Inline SVG: per host/rank, boot free memory (bar) against the free floor (black tick), with the drift."""
    rows = [r for r in cls.get("per_rank") or [] if r.get("boot_free_bytes") is not None]
    if not rows:
        return ""
    # The axis is zoomed on the figures (free and floor are close, often within a GiB of
    # each other): from half a span below the lowest to a tenth above the highest.
    values: list[int] = [r["boot_free_bytes"] for r in rows] + [r["floor_bytes"] for r in rows if r["floor_bytes"] is not None]
    low, high = min(values), max(values)
    span = max(high - low, high // 50, 1)
    axis_low = max(0, low - span // 2)
    axis_high = high + span // 10 + 1

    def xpos(nbytes: int) -> float:
        return round(_LABEL_W + _BAR_W * (nbytes - axis_low) / (axis_high - axis_low), 1)

    width = _LABEL_W + _BAR_W + _NOTE_W
    height = _ROW_H * len(rows) + 30
    esc = html.escape
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        f"<title>{esc(cls['name'])}: boot free memory vs floor per host and rank</title>",
    ]
    for i, row in enumerate(rows):
        y = 10 + i * _ROW_H
        free_w = round(xpos(row["boot_free_bytes"]) - _LABEL_W, 1)
        ok = row["margin_bytes"] is None or row["margin_bytes"] >= 0
        color = "#2e7d32" if ok else "#c62828"
        label = f"{row['host']} rank {row['rank']}{' *' if row['weakest'] else ''}"
        parts.append(f'<text x="{_LABEL_W - 8}" y="{y + 16}" text-anchor="end" font-size="12">{esc(label)}</text>')
        parts.append(f'<rect x="{_LABEL_W}" y="{y + 3}" width="{free_w}" height="{_ROW_H - 8}" fill="{color}" fill-opacity="0.75"/>')
        if row["floor_bytes"] is not None:
            fx = xpos(row["floor_bytes"])
            parts.append(f'<line x1="{fx}" x2="{fx}" y1="{y}" y2="{y + _ROW_H - 2}" stroke="#000" stroke-width="3"/>')
        note = f"free {_hb(row['boot_free_bytes'])}, floor {_hb(row['floor_bytes'])}, drift {_signed_hb(row['drift_bytes'])}"
        parts.append(f'<text x="{_LABEL_W + _BAR_W + 8}" y="{y + 16}" font-size="11">{esc(note)}</text>')
    parts.append(
        f'<text x="{_LABEL_W}" y="{height - 4}" font-size="11">bar: NVML free memory at boot (red: below the floor);'
        f" black tick: free floor; * weakest rank; axis {esc(_hb(axis_low))} to {esc(_hb(axis_high))}</text>"
    )
    parts.append("</svg>")
    return "\n".join(parts)


_CSS = """
body{font-family:sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:24px}h2{font-size:20px;border-bottom:2px solid #ccc;margin-top:28px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #bbb;padding:4px 8px;font-size:13px;text-align:left}
th{background:#eef}.ok{color:#2e7d32;font-weight:bold}.bad{color:#c62828;font-weight:bold}
.summary{padding:8px 12px;border-left:6px solid #2e7d32;background:#f1f8e9}.summary.fail{border-color:#c62828;background:#ffebee}
code{background:#f4f4f4;padding:1px 3px}
"""


def _html_table(header: list[str], rows: list[list[str]], raw: bool = False) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c if raw else esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _outcome_html(outcome: str) -> str:
    cls = "bad" if outcome in ("rolled_back", "failed", "fail") else ("ok" if outcome in ("deployed", "unchanged", "pass", "ok") else "")
    return f'<span class="{cls}">{html.escape(outcome.replace("_", " "))}</span>'


def _probe_html(probe: Mapping[str, Any]) -> list[str]:
    esc = html.escape
    out: list[str] = []
    for host in probe["hosts"]:
        out.append(f'<h2 id="host-{esc(host["host"])}">Host {esc(host["host"])}</h2>')
        out.append(f"<p>{esc(_host_line(host))}</p>")
        if host["error"]:
            out.append(f'<p class="bad">probe failed: <code>{esc(host["error"])}</code></p>')
        if host["gpus"]:
            out.append(render_gpu_svg(host))
            out.append(_html_table(list(_GPU_COLUMNS), [_gpu_row(g) for g in host["gpus"]]))
            procs = [(g["index"], p) for g in host["gpus"] for p in g["processes"]]
            if procs:
                rows = [
                    [_text(index), _text(proc["pid"]), _text(proc["name"]), _hb(proc["used_bytes"]), "yes" if proc["own"] else "no"]
                    for index, proc in procs
                ]
                out.append(_html_table(["GPU", "pid", "process", "used", "own engine"], rows))
        if host["instances"]:
            rows = []
            for inst in host["instances"]:
                cells = [esc(c) for c in _instance_row(inst)]
                cells[2] = f'<span class="{"ok" if inst["active_state"] == "active" else "bad"}">{cells[2]}</span>'
                rows.append(cells)
            out.append(_html_table(list(_INSTANCE_COLUMNS), rows, raw=True))
    return out


def render_html(report: Mapping[str, Any]) -> str:
    """The report as one self-contained HTML page (inline CSS and SVG, no script, no external asset)."""
    esc = html.escape
    ok = report["summary"]["ok"]
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>gpufleet.vllm {esc(report['kind'])} report</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>gpufleet.vllm {esc(report['kind'])} report</h1>",
        f"<p>started {esc(_text(report.get('started')))}, finished {esc(_text(report.get('finished')))}</p>",
        f'<p class="summary{"" if ok else " fail"}" id="summary">{esc(summary_line(report))}</p>',
    ]
    if report.get("check_mode"):
        out.append('<p id="check-mode">Dry run (check mode): nothing was changed on the hosts.</p>')
    if report.get("upgraded_from") == 0:
        out.append("<p>Read from a schema 0 report: per-rank figures, canaries and batches were not recorded.</p>")
    if report.get("probe"):
        out += _probe_html(report["probe"])
    if report.get("audit"):
        out += _audit_html(report["audit"])
    for cls in report["classes"]:
        out.append(f'<h2 id="class-{esc(cls["name"])}">Class {esc(cls["name"])}</h2>')
        out.append(_html_table(["", ""], [[k, v] for k, v in _class_budget_line(cls)]))
        if cls["reasons"]:
            out.append("<ul>" + "".join(f"<li>{esc(r)}</li>" for r in cls["reasons"]) + "</ul>")
        if cls.get("first_run") and cls["first_run"]["lines"]:
            out.append('<p>What the rollout does (estimates):</p><ul class="first-run">'
                       + "".join(f"<li>{esc(line)}</li>" for line in cls["first_run"]["lines"]) + "</ul>")
        if cls["per_rank"]:
            out.append(render_svg(cls))
            rows = [
                [
                    esc(r["host"]) + (" <b>(weakest)</b>" if r["weakest"] else ""),
                    esc(_text(r["rank"])),
                    esc(_hb(r["boot_free_bytes"])),
                    esc(_hb(r["floor_bytes"])),
                    esc(_signed_hb(r["drift_bytes"])),
                    esc(_hb(r["adjusted_bytes"])),
                    _outcome_html("ok") if (r["margin_bytes"] or 0) >= 0 else _outcome_html("fail"),
                ]
                for r in cls["per_rank"]
            ]
            out.append(_html_table(["host", "rank", "boot free", "floor", "drift (F_ref - F_boot)", "adjusted", "vs floor"], rows, raw=True))
        out.append(f"<p>Manual canary: {esc(cls['manual_canary'])}</p>")
        canaries = _canaries_in_order(cls)
        if canaries:
            rows = [[esc(n)] + [_outcome_html(str(c.get(k))) if k == "verdict" else esc(_text(c.get(k))) for k, _h in _CANARY_COLUMNS] for n, c in canaries]
            out.append(_html_table(["canary"] + [h for _k, h in _CANARY_COLUMNS], rows, raw=True))
    if report["batches"]:
        out.append("<h2>Batches</h2>")
        rows = [
            [
                esc(_batch_label(b)),
                ", ".join(f"{esc(h['host'])} ({_outcome_html(h['outcome'])})" for h in b["hosts"]),
                esc(_text(b["seconds"])),
                _outcome_html(b["outcome"]),
            ]
            for b in report["batches"]
        ]
        out.append(_html_table(["batch", "hosts", "seconds", "outcome"], rows, raw=True))
    if report["hosts"] and not report.get("probe"):
        out.append("<h2>Hosts</h2>")
        rows = [
            [esc(h["host"]), esc(h["class"]), esc(_text(h["batch"])), _outcome_html(h["outcome"]), esc(", ".join(h["pending"]) or "-")]
            for h in report["hosts"]
        ]
        out.append(_html_table(["host", "class", "batch", "outcome", "changed instances"], rows, raw=True))
    if report["rolled_back"]:
        out.append("<h2>Rolled back</h2><ul>")
        out += [
            f"<li><b>{esc(rb['host'])}</b> (class {esc(rb['class'])}, batch {esc(_text(rb['batch']))}): <code>{esc(_text(rb['error']))}</code></li>"
            for rb in report["rolled_back"]
        ]
        out.append("</ul>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- writing
def _stamp(moment: _dt.datetime) -> str:
    return moment.astimezone(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def write_run_dir(report_dir: str, report: Mapping[str, Any], moment: _dt.datetime | None = None) -> str:
    """Write ``<report_dir>/<kind>-<UTC timestamp>/{report.json,report.md,report.html}``; returns its path.

    Files are written into a temporary directory next to the target, then the
    directory is renamed into place. An existing run directory is never
    replaced: a later name (``-2``, ``-3``...) is taken instead.
    """
    if not report_dir:
        raise ReportError("report_dir: empty path")
    if not os.path.isdir(report_dir):
        raise ReportError(f"report_dir {report_dir}: not a directory")
    base = f"{report['kind']}-{_stamp(moment or _utc_now())}"
    tmp = tempfile.mkdtemp(prefix=f".{base}.", dir=report_dir)
    try:
        files = {
            "report.json": json.dumps(report, indent=2, sort_keys=True) + "\n",
            "report.md": render_markdown(report),
            "report.html": render_html(report),
        }
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
        os.chmod(tmp, 0o755)
        for attempt in range(1, 1000):
            target = os.path.join(report_dir, base if attempt == 1 else f"{base}-{attempt}")
            if os.path.lexists(target):
                continue
            try:
                os.rename(tmp, target)
            except OSError:
                if os.path.lexists(target):
                    continue  # another run took this name in between
                raise
            return target
        raise ReportError(f"report_dir {report_dir}: no free name for {base}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

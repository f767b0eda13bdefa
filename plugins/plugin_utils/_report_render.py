# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Run reports behind ``gpufleet.vllm.rollout_report``: rendering and the run directory.

Plain Python, no Ansible import.

* :func:`render_markdown` and :func:`render_html` render a report built or loaded by
  ``_report`` (the HTML is self-contained: inline CSS and SVG, no external asset, no script);
* :func:`write_run_dir` writes ``<dir>/<kind>-<UTC timestamp>/`` with
  ``report.json``, ``report.md`` and ``report.html`` atomically (a temporary
  directory renamed into place) and never replaces an existing run directory.
"""

from __future__ import annotations

import datetime as _dt
import functools
import html
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from ansible_collections.gpufleet.vllm.plugins.plugin_utils._report import (
    AUDIT_VERDICTS,
    OUTCOMES,
    ReportError,
    bytes_text,
    cell_text,
    instance_state,
    signed_bytes_text,
    utc_now,
)

__all__ = [
    "render_analysis_svg",
    "render_gpu_svg",
    "render_html",
    "render_markdown",
    "render_svg",
    "summary_line",
    "write_run_dir",
]


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
        if audit.get("plan_edited"):
            parts.append("plan file edited on the host: " + ", ".join(audit["plan_edited"]))
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
            parts.append(f"lowest boot free {bytes_text(low['bytes'])} ({low['host']} GPU {cell_text(low['index'])})")
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
    parts += [line for line in (_final_summary(report, cls) for cls in report["classes"]) if line]
    if report.get("check_mode"):
        parts.append("check mode: nothing was changed on the hosts")
    return "; ".join(parts)


def _final_summary(report: Mapping[str, Any], cls: Mapping[str, Any]) -> str:
    """Where a class that did not simply end on its new plan ended ('' otherwise)."""
    final = cls.get("final") or {}
    if final.get("state") == "mixed":
        return (f"class {cls['name']} split: {len(final['new_plan'])} host(s) on the new plan, "
                f"{len(final['previous'])} on the previous")
    rolled = any(h["outcome"] == "rolled_back" and h["class"] == cls["name"] for h in report["hosts"])
    if final.get("state") == "previous_plan" and rolled:
        return f"class {cls['name']} is back on its previous plan"
    return ""


_FINAL_STATES = {"new_plan": "on the new plan", "previous_plan": "on its previous plan", "mixed": "split between the plans",
                 "failed": "a host failed"}


def _final_text(cls: Mapping[str, Any]) -> str:
    final = cls.get("final")
    if not final:
        return "-"
    labels = (("new_plan", "new plan"), ("previous", "previous plan"), ("failed", "failed"))
    sides = [f"{label}: {', '.join(final[key])}" for key, label in labels if final.get(key)]
    return f"{_FINAL_STATES.get(final['state'], final['state'])} ({'; '.join(sides) or 'no host'})"


def _class_budget_line(cls: Mapping[str, Any]) -> list[tuple[str, str]]:
    plan = cls["plan"]
    rows = [
        ("decision", cell_text(cls["decision"])),
        ("status", cls["status"]),
        ("where its hosts ended", _final_text(cls)),
        ("on a failed host or bake", cell_text(cls.get("on_failure"))),
        ("KV cache bytes (launch)", f"{bytes_text(plan['kv_cache_memory_bytes'])} ({cell_text(plan['kv_cache_memory_bytes'])} bytes)"),
        ("max safe bytes", bytes_text(plan.get("max_safe_bytes"))),
        ("blocks / tokens", f"{cell_text(plan['num_blocks'])} / {cell_text(plan['kv_cache_tokens'])}"),
        ("max concurrency", cell_text(plan.get("max_concurrency"))),
        ("startup --gpu-memory-utilization", cell_text(plan["gpu_memory_utilization"])),
        ("free floor (NVML) per rank", ", ".join(f"rank {r}: {bytes_text(v)}" for r, v in cls["free_floor_bytes"].items()) or "-"),
        ("weakest", f"{rank_where(cls['weakest'])} rank {cls['weakest']['rank']}" if cls["weakest"] else "-"),
        ("compatibility key", cls["key_hash"] or "-"),
    ]
    fp8 = cls.get("what_if_fp8")
    if fp8:
        rows.append(("what if fp8 KV", f"{cell_text(fp8['kv_cache_tokens'])} tokens, max concurrency {cell_text(fp8['max_concurrency'])}"))
    choice = cls.get("budget_choice")
    # a plan made with settling off (the exact formula, nothing deployed) has nothing to say here
    if choice and (choice["gate_margin_bytes"] or choice["granularity_bytes"] or choice["deployed_bytes"] is not None):
        rows.append(
            (
                "budget kept" if choice["kept"] else "budget settled",
                f"{bytes_text(choice['rounded_bytes'])} = max safe {bytes_text(choice['max_safe_bytes'])} less the gate margin "
                f"{bytes_text(choice['gate_margin_bytes'])}, rounded down to {bytes_text(choice['granularity_bytes'])} and whole blocks; "
                f"{choice['reason']}",
            )
        )
    fit = cls.get("fit")
    if fit:
        rows.append(
            (
                "right-size (fit_admission)",
                f"{bytes_text(fit['budget_bytes'])} instead of {bytes_text(fit['max_safe_bytes'])}: "
                f"{bytes_text(fit['left_free_bytes_per_gpu'])} per GPU left free for other work",
            )
        )
    adm = cls.get("admission")
    if adm:
        rows.append(
            (
                "admission plan",
                f"needs {cell_text(adm.get('required_blocks'))} blocks, has {cell_text(adm.get('available_blocks'))}"
                + (f"; {cell_text(adm.get('shortfall_tokens'))} tokens short" if adm.get("shortfall_blocks") else ": ok"),
            )
        )
    for group in cls.get("split") or []:
        rows.append((f"split {group['name']}", f"{', '.join(group['hosts'])}: {bytes_text(group['kv_cache_memory_bytes'])}"))
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


def rank_where(row: Mapping[str, Any]) -> str:
    """Where a rank of the plan runs: its planned member, and the host for a rank of a gang on a follower."""
    host, member = str(row.get("host", "?")), row.get("member")
    return f"{host} (on {member})" if member and not host.startswith(f"{member}/") else host


def _md_cell(value: Any) -> str:
    return cell_text(value).replace("|", "\\|").replace("\n", " ")


def _batch_label(batch: Mapping[str, Any]) -> str:
    """``3 of 4`` for the run; ``1 of 3 of class l40s (3 of 4)`` when the batch names its class."""
    run = f"{batch['index']}" + (f" of {batch['total']}" if batch.get("total") else "")
    if batch.get("class") and batch.get("class_index"):
        return f"{batch['class_index']} of {batch.get('class_total') or '?'} of class {batch['class']} ({run})"
    return run


def _lease_lines(report: Mapping[str, Any]) -> list[str]:
    lease = report.get("lease")
    if not isinstance(lease, Mapping) or not lease.get("classes"):
        return []
    return ([f"run {lease.get('run_id')} of {lease.get('owner')} held the lease of {', '.join(lease['classes'])}"]
            + [str(m) for m in lease.get("taken_over") or []])


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown."""
    out = [f"# gpufleet.vllm {report['kind']} report", ""]
    out.append(f"- started: {cell_text(report.get('started'))}")
    out.append(f"- finished: {cell_text(report.get('finished'))}")
    out.append(f"- summary: {summary_line(report)}")
    if report.get("check_mode"):
        out.append("- dry run (check mode): nothing was changed on the hosts")
    for line in _lease_lines(report):
        out.append(f"- {line}")
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
                    f"| {_md_cell(rank_where(row))}{' (weakest)' if row['weakest'] else ''} | {row['rank']} | {bytes_text(row['boot_free_bytes'])} | "
                    f"{bytes_text(row['floor_bytes'])} | {signed_bytes_text(row['drift_bytes'])} | "
                    f"{bytes_text(row['adjusted_bytes'])} | {signed_bytes_text(row['margin_bytes'])} |"
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
            out.append(f"| {_md_cell(_batch_label(b))} | {_md_cell(hosts)} | {cell_text(b['seconds'])} | {b['outcome']} |")
        out.append("")
        for b in report["batches"]:
            if b.get("analysis"):
                out += _analysis_md(b)
    if report["hosts"] and not report.get("probe"):
        out += ["## Hosts", "", "| host | class | batch | outcome | changed instances |", "|---|---|---|---|---|"]
        for h in report["hosts"]:
            out.append(
                f"| {_md_cell(h['host'])} | {_md_cell(h['class'])} | {cell_text(h['batch'])} | {h['outcome'].replace('_', ' ')} | "
                f"{_md_cell(', '.join(h['pending']) or '-')} |"
            )
        out.append("")
    if report.get("gangs"):
        out += ["## Gangs", "", f"| instance | class | members | {_gang_column(report)} |", "|---|---|---|---|"]
        for g in report["gangs"]:
            of_members, whole = _gang_cells(g)
            members = ", ".join(f"{m} ({o.replace('_', ' ')})" for m, o in of_members.items())
            out.append(f"| {_md_cell(g['name'] + ' (leader ' + g['leader'] + ')')} | {_md_cell(g['class'])} | {_md_cell(members)} | "
                       f"{whole.replace('_', ' ')} |")
        out.append("")
    if report["rolled_back"]:
        out += ["## Rolled back", ""]
        for rb in report["rolled_back"]:
            out.append(f"- **{rb['host']}** (class {rb['class']}, batch {cell_text(rb['batch'])}): {rb['error']}")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


_GPU_COLUMNS = ("GPU", "name", "total", "free", "boot free", "free min / max", "own engine", "other processes")
_INSTANCE_COLUMNS = ("instance", "unit", "state", "GPUs", "port", "KV budget", "tokens", "utilization", "decision", "compatibility key")


def _gpu_row(gpu: Mapping[str, Any]) -> list[str]:
    others = [p for p in gpu["processes"] if not p["own"]]
    other_bytes = sum(p["used_bytes"] or 0 for p in others)
    return [
        cell_text(gpu["index"]),
        cell_text(gpu["name"]),
        bytes_text(gpu["total_bytes"]),
        bytes_text(gpu["free_bytes"]),
        bytes_text(gpu["boot_free_bytes"]),
        f"{bytes_text(gpu['free_min_bytes'])} / {bytes_text(gpu['free_max_bytes'])}",
        bytes_text(gpu["own_used_bytes"]),
        (f"{len(others)} ({bytes_text(other_bytes)})" if others else "none") if gpu["processes_reported"] else "not reported",
    ]


def _instance_row(inst: Mapping[str, Any]) -> list[str]:
    plan = inst.get("plan") or {}
    return [
        inst["name"],
        inst["unit"],
        instance_state(inst),
        ", ".join(str(g) for g in inst["gpus"]) or "-",
        cell_text(inst["port"]),
        bytes_text(plan.get("kv_cache_memory_bytes")) if plan else "no plan file",
        cell_text(plan.get("kv_cache_tokens")),
        cell_text(plan.get("gpu_memory_utilization")),
        cell_text(plan.get("decision")),
        cell_text(plan.get("compat_key_hash")),
    ]


def _host_line(host: Mapping[str, Any]) -> str:
    bits = [f"class {host['class']}" if host["class"] else "no class"]
    if host["driver_version"]:
        bits.append(f"driver {host['driver_version']}")
    if host["cuda_driver_version"]:
        bits.append(f"CUDA {host['cuda_driver_version']}")
    if host["nvml_version"]:
        bits.append(f"NVML {host['nvml_version']}")
    # reports written before the probe kept the install record have no runtime
    runtime = host.get("runtime")
    if runtime:
        installed = " ".join(str(runtime[k]) for k in ("package", "version") if runtime.get(k))
        bits.append(f"runtime {installed or 'unknown'}" + (f" ({runtime['release']})" if runtime.get("release") else "")
                    + (f": {runtime['error']}" if runtime.get("error") else ""))
    return ", ".join(bits)


_AUDIT_COLUMNS = ("instance", "verdict", "next start", "rank", "GPU", "boot free", "floor", "margin", "plan age", "key")


def _audit_rows(inst: Mapping[str, Any]) -> list[list[str]]:
    key = {True: "matches", False: "changed", None: "-"}[inst["key_matches"]]
    age = f"{inst['plan_age_days']:.1f} d" if isinstance(inst["plan_age_days"], (int, float)) else "-"
    rows = []
    for row in inst["ranks"] or [{"rank": None, "gpu": None, "free_bytes": None, "floor_bytes": None, "margin_bytes": None}]:
        rows.append([inst["instance"], inst["verdict"].replace("_", " "), inst["next_start"], cell_text(row["rank"]), cell_text(row["gpu"]),
                     bytes_text(row["free_bytes"]), bytes_text(row["floor_bytes"]), signed_bytes_text(row["margin_bytes"]), age, key])
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
                bad = inst["verdict"] in ("plan_edited", "would_refuse", "would_shrink")
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
                        f"| {cell_text(index)} | {cell_text(proc['pid'])} | {_md_cell(proc['name'])} | {bytes_text(proc['used_bytes'])} | "
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
        label = f"GPU {cell_text(gpu['index'])} {gpu['name'] or ''}".strip()
        parts.append(f'<text x="{_LABEL_W - 8}" y="{y + 16}" text-anchor="end" font-size="12">{esc(label)}</text>')
        x = float(_LABEL_W)
        for key, color, _legend in _GPU_SEGMENTS:
            seg = round(_BAR_W * sizes[key] / total, 1)
            if seg > 0:
                parts.append(
                    f'<rect class="gpu-{key}" x="{round(x, 1)}" y="{y + 3}" width="{seg}" height="{_ROW_H - 8}" fill="{color}" fill-opacity="0.8"/>'
                )
            x += seg
        note = f"free {bytes_text(free)} of {bytes_text(total)}, boot free {bytes_text(gpu['boot_free_bytes'])}"
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
        note = f"free {bytes_text(row['boot_free_bytes'])}, floor {bytes_text(row['floor_bytes'])}, drift {signed_bytes_text(row['drift_bytes'])}"
        parts.append(f'<text x="{_LABEL_W + _BAR_W + 8}" y="{y + 16}" font-size="11">{esc(note)}</text>')
    parts.append(
        f'<text x="{_LABEL_W}" y="{height - 4}" font-size="11">bar: NVML free memory at boot (red: below the floor);'
        f" black tick: free floor; * weakest rank; axis {esc(bytes_text(axis_low))} to {esc(bytes_text(axis_high))}</text>"
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


_ANALYSIS_COLUMNS = ["check", "verdict", "canary", "baseline", "limit", "threshold", "requests (canary / baseline)", "why"]


def _analysis_title(batch: Mapping[str, Any]) -> str:
    a = batch["analysis"]
    counted = f" (counted as {a['effective']})" if a["effective"] != a["verdict"] else ""
    source = f", read from {a['source']}" if a.get("source") else ""
    return (f"Bake of batch {_batch_label(batch)}: {a['verdict']}{counted}, {cell_text(a['seconds'])} s, "
            f"{cell_text(a['canary_hosts'])} changed host(s) against {cell_text(a['baseline_hosts'])} baseline host(s){source}")


def _figure(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _analysis_row(check: Mapping[str, Any]) -> list[str]:
    threshold = ", ".join(f"{k} {v:g}" for k, v in (check.get("threshold") or {}).items() if isinstance(v, (int, float)))
    samples = check.get("samples") or {}
    return [str(check.get("name")), str(check.get("verdict")), _figure(check.get("canary")), _figure(check.get("baseline")),
            _figure(check.get("limit")), threshold or "-", f"{_figure(samples.get('canary'))} / {_figure(samples.get('baseline'))}",
            str(check.get("why") or "")]


def _analysis_notes(analysis: Mapping[str, Any]) -> list[str]:
    notes = [f"the bake itself failed: {analysis['error']}"] if analysis.get("error") else []
    notes += [f"could not read {u}" for u in analysis.get("unread") or []]
    notes += [f"baseline host {h} left out: {'; '.join(why)}" for h, why in (analysis.get("baseline_unread") or {}).items()]
    return notes


def _analysis_md(batch: Mapping[str, Any]) -> list[str]:
    out = [f"**{_analysis_title(batch)}**", "", "| " + " | ".join(_ANALYSIS_COLUMNS) + " |", "|---" * len(_ANALYSIS_COLUMNS) + "|"]
    out += ["| " + " | ".join(_md_cell(c) for c in _analysis_row(check)) + " |" for check in batch["analysis"]["checks"]]
    out += ["", *(f"- {_md_cell(n)}" for n in _analysis_notes(batch["analysis"])), ""]
    return out


def _bar_length(value: float, top: float) -> float:
    return round(_BAR_W * max(0.0, float(value)) / top, 1)


def render_analysis_svg(batch: Mapping[str, Any]) -> str:
    """Inline SVG: per check of a batch's bake with figures, the canary's (coloured by the check's verdict) and
    the baseline's (grey) as bars, and the limit past which the check fails as a black tick; each row has its
    own scale (the checks' units differ)."""
    checks = [c for c in (batch.get("analysis") or {}).get("checks") or [] if isinstance(c.get("canary"), (int, float))]
    if not checks:
        return ""
    row_h = 2 * _ROW_H
    width = _LABEL_W + _BAR_W + _NOTE_W
    height = row_h * len(checks) + 30
    esc = html.escape
    colors = {"pass": "#2e7d32", "fail": "#c62828"}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        f"<title>{esc(_analysis_title(batch))}</title>",
    ]
    for i, check in enumerate(checks):
        y = 10 + i * row_h
        figures = {"canary": check.get("canary"), "baseline": check.get("baseline"), "limit": check.get("limit")}
        top = max([abs(float(v)) for v in figures.values() if isinstance(v, (int, float))] + [1e-12]) * 1.1
        length = functools.partial(_bar_length, top=top)

        parts.append(f'<text x="{_LABEL_W - 8}" y="{y + 20}" text-anchor="end" font-size="12">{esc(str(check.get("name")))}</text>')
        color = colors.get(str(check.get("verdict")), "#f9a825")
        parts.append(f'<rect class="bake-canary" x="{_LABEL_W}" y="{y + 3}" width="{length(figures["canary"])}" height="{_ROW_H - 10}" '
                     f'fill="{color}" fill-opacity="0.8"/>')
        if isinstance(figures["baseline"], (int, float)):
            parts.append(f'<rect class="bake-baseline" x="{_LABEL_W}" y="{y + _ROW_H - 3}" width="{length(figures["baseline"])}" '
                         f'height="{_ROW_H - 10}" fill="#9e9e9e" fill-opacity="0.8"/>')
        if isinstance(figures["limit"], (int, float)):
            lx = _LABEL_W + length(figures["limit"])
            parts.append(f'<line class="bake-limit" x1="{lx}" x2="{lx}" y1="{y}" y2="{y + row_h - 6}" stroke="#000" stroke-width="3"/>')
        note = ", ".join(f"{k} {_figure(v)}" for k, v in figures.items() if isinstance(v, (int, float)))
        verdict = esc(str(check.get("verdict")))
        parts.append(f'<text x="{_LABEL_W + _BAR_W + 8}" y="{y + 20}" font-size="11">{esc(note)} ({verdict})</text>')
    parts.append(f'<text x="{_LABEL_W}" y="{height - 4}" font-size="11">upper bar: the canary (green pass, red fail, amber '
                 "otherwise); lower bar: the baseline; black tick: the limit (success rate and memory margin fail below it, "
                 "the others above it)</text>")
    parts.append("</svg>")
    return "\n".join(parts)


def _analysis_html(batch: Mapping[str, Any]) -> list[str]:
    esc = html.escape
    rows = []
    for check in batch["analysis"]["checks"]:
        cells = [esc(c) for c in _analysis_row(check)]
        cells[1] = _outcome_html(str(check.get("verdict")))
        rows.append(cells)
    out = [f"<h3>{esc(_analysis_title(batch))}</h3>", render_analysis_svg(batch), _html_table(_ANALYSIS_COLUMNS, rows, raw=True)]
    notes = _analysis_notes(batch["analysis"])
    if notes:
        out.append("<ul>" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>")
    return out


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
                    [cell_text(index), cell_text(proc["pid"]), cell_text(proc["name"]), bytes_text(proc["used_bytes"]), "yes" if proc["own"] else "no"]
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
        f"<p>started {esc(cell_text(report.get('started')))}, finished {esc(cell_text(report.get('finished')))}</p>",
        f'<p class="summary{"" if ok else " fail"}" id="summary">{esc(summary_line(report))}</p>',
    ]
    if report.get("check_mode"):
        out.append('<p id="check-mode">Dry run (check mode): nothing was changed on the hosts.</p>')
    for line in _lease_lines(report):
        out.append(f'<p class="lease">{esc(line)}</p>')
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
                    esc(rank_where(r)) + (" <b>(weakest)</b>" if r["weakest"] else ""),
                    esc(cell_text(r["rank"])),
                    esc(bytes_text(r["boot_free_bytes"])),
                    esc(bytes_text(r["floor_bytes"])),
                    esc(signed_bytes_text(r["drift_bytes"])),
                    esc(bytes_text(r["adjusted_bytes"])),
                    _outcome_html("ok") if (r["margin_bytes"] or 0) >= 0 else _outcome_html("fail"),
                ]
                for r in cls["per_rank"]
            ]
            out.append(_html_table(["host", "rank", "boot free", "floor", "drift (F_ref - F_boot)", "adjusted", "vs floor"], rows, raw=True))
        out.append(f"<p>Manual canary: {esc(cls['manual_canary'])}</p>")
        canaries = _canaries_in_order(cls)
        if canaries:
            rows = [[esc(n)] + [_outcome_html(str(c.get(k))) if k == "verdict" else esc(cell_text(c.get(k))) for k, _h in _CANARY_COLUMNS] for n, c in canaries]
            out.append(_html_table(["canary"] + [h for _k, h in _CANARY_COLUMNS], rows, raw=True))
    if report["batches"]:
        out.append("<h2>Batches</h2>")
        rows = [
            [
                esc(_batch_label(b)),
                ", ".join(f"{esc(h['host'])} ({_outcome_html(h['outcome'])})" for h in b["hosts"]),
                esc(cell_text(b["seconds"])),
                _outcome_html(b["outcome"]),
            ]
            for b in report["batches"]
        ]
        out.append(_html_table(["batch", "hosts", "seconds", "outcome"], rows, raw=True))
        for b in report["batches"]:
            if b.get("analysis"):
                out += _analysis_html(b)
    if report["hosts"] and not report.get("probe"):
        out.append("<h2>Hosts</h2>")
        rows = [
            [esc(h["host"]), esc(h["class"]), esc(cell_text(h["batch"])), _outcome_html(h["outcome"]), esc(", ".join(h["pending"]) or "-")]
            for h in report["hosts"]
        ]
        out.append(_html_table(["host", "class", "batch", "outcome", "changed instances"], rows, raw=True))
    if report.get("gangs"):
        out.append("<h2>Gangs</h2>")
        rows = [
            [esc(f"{g['name']} (leader {g['leader']})"), esc(g["class"]),
             esc(", ".join(f"{m} ({o.replace('_', ' ')})" for m, o in _gang_cells(g)[0].items())),
             _outcome_html(g["outcome"]) if "verdict" not in g else esc(g["verdict"].replace("_", " "))]
            for g in report["gangs"]
        ]
        out.append(_html_table(["instance", "class", "members", _gang_column(report)], rows, raw=True))
    if report["rolled_back"]:
        out.append("<h2>Rolled back</h2><ul>")
        out += [
            f"<li><b>{esc(rb['host'])}</b> (class {esc(rb['class'])}, batch {esc(cell_text(rb['batch']))}): <code>{esc(cell_text(rb['error']))}</code></li>"
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
    base = f"{report['kind']}-{_stamp(moment or utc_now())}"
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


def _gang_column(report: Mapping[str, Any]) -> str:
    """An audit judges a gang by its members' verdicts (its worst member's); a run by their outcomes."""
    return "verdict" if report.get("kind") == "audit" else "outcome"


def _gang_cells(gang: Mapping[str, Any]) -> tuple[Mapping[str, str], str]:
    if "verdict" in gang:
        return gang["members_verdicts"], gang["verdict"]
    return gang["members_outcomes"], gang["outcome"]

# -*- coding: utf-8 -*-
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Between rollouts: each instance's margin to its floor now, and what its next start would do.

Plain Python with no Ansible import, used on the host by the ``vllm_audit`` module
(``playbooks/audit.yml``) and by the metrics exporter (``gpufleet-vllm-metrics``, run by a
systemd timer, writing node_exporter textfile metrics). Both read the plan files
(``<state_dir>/*.plan.json``) with the boot gate's own reader (:func:`_boot_gate.read_plan`),
probe NVML once for every GPU they name with the probe every other reader of a host uses
(:func:`_nvml_probe.probe`, behind ``gpu_memory_info`` and ``vllm_host_snapshot``; the module
hands in the same command runner as the snapshot) and judge every instance with the boot
gate's own rule (:func:`_boot_gate.decide` under the unit's policy), so the audit says exactly
what the gate would do at the next start. Nothing here reads a plan file, the gate's record or
NVML a way of its own; only the plan checksum the deploy records beside the unit is read here.

Verdicts, worst first: ``plan_edited`` (the plan file is not the one the deploy wrote: its
checksum differs from the one recorded beside the unit, so the gate refuses the next start),
``would_refuse`` (the next start is refused), ``would_shrink`` (it starts degraded: a smaller
budget, or vLLM's own profiling under ``profile``), ``reprofile_due`` (the plan is older than
the allowed age, dated in the future of the clock that judges it, or the class's stored
reference has another compatibility key), ``ok``.

Ages are measured on one clock: the controller's when the audit is given its time (the
controller wrote ``planned_at``), and the difference between the host's clock and it is
reported as ``clock_skew_seconds``; the exporter on the host has only the host's clock.
"""

from __future__ import annotations

import calendar
import glob
import os
import re
import shlex
import sys
import time
import typing as t

from ._gate._boot_gate import POLICIES, BootGateError, decide, read_plan, read_state, trust_problem
from ._gpu._gpu_health import health_checks
from ._plan._launch import PLAN_CHECKSUM_DROPIN, PLAN_CHECKSUM_VARIABLE
from ._units._gang import member_of_args
from ._units._instance import unit_name

RunCommand = t.Callable[[t.Sequence[str]], t.Tuple[int, str, str]]
VERDICTS = ("ok", "reprofile_due", "would_shrink", "would_refuse", "plan_edited")
# a plan dated this far in the future of the judging clock names a wrong clock (or an edited date)
FUTURE_TOLERANCE_S = 300.0
DEFAULT_MAX_CLOCK_SKEW_S = 300.0
_RECORDED_CHECKSUM = re.compile(rf"^Environment={PLAN_CHECKSUM_VARIABLE}=([0-9a-f]{{64}})\s*$", re.MULTILINE)
DEFAULT_REPROFILE_AFTER_DAYS = 30.0
METRIC_PREFIX = "gpufleet_vllm_"


def plan_timestamp(value: t.Any) -> float | None:
    """``planned_at`` (``YYYY-MM-DDTHH:MM:SSZ``) as seconds since the epoch."""
    if not isinstance(value, str):
        return None
    try:
        return float(calendar.timegm(time.strptime(value, "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


def plan_files(state_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(state_dir), "*.plan.json")))


def unit_gang(unit_dir: str, unit: str) -> dict[str, t.Any] | None:
    """The gang (an instance over several hosts) the unit's ``ExecStart`` runs a member of, as
    :func:`_gang.member_of_args` reads its rank arguments; None for an instance on one host or a unit
    that cannot be read. The exporter labels the member with it, so that Prometheus can judge a gang
    by its worst member."""
    try:
        with open(os.path.join(unit_dir, unit), encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError):
        return None
    for line in text.replace("\\\n", " ").splitlines():
        if line.startswith("ExecStart="):
            try:
                return member_of_args(shlex.split(line[len("ExecStart="):]))
            except ValueError:  # quoting shlex does not read as systemd does: not a unit this collection wrote
                return None
    return None


def recorded_checksum(unit_dir: str, unit: str) -> str | None:
    """The plan file checksum the deploy recorded beside the unit (its drop-in), None for a unit without one."""
    try:
        with open(os.path.join(unit_dir, f"{unit}.d", PLAN_CHECKSUM_DROPIN), encoding="utf-8") as handle:
            found = _RECORDED_CHECKSUM.search(handle.read())
    except OSError:
        return None
    return found.group(1) if found else None


def judge(plan: t.Mapping[str, t.Any], gpus: t.Sequence[t.Mapping[str, t.Any]], now: float,
          reprofile_after_days: float, reference_key_hash: str | None = None,
          state: t.Mapping[str, t.Any] | None = None, checksum: str | None = None, plan_path: str = "plan file",
          clock: str = "host") -> dict[str, t.Any]:
    """One instance: per-rank margin, the gate's action at a start now, plan age, key, verdict.

    ``now``: the judging clock (``clock``: whose it is); ``checksum``: the one the unit records.
    """
    policy = plan["policy"] if plan["policy"] in POLICIES else "shrink"
    verdict = decide(plan, gpus, policy)
    planned_ts = plan_timestamp(plan.get("planned_at"))
    age_days = (now - planned_ts) / 86400.0 if planned_ts is not None else None
    reasons: list[str] = []
    key_matches = None
    if reference_key_hash:
        key_matches = reference_key_hash == plan.get("compat_key_hash")
    # the gate's own rule: an edited plan file is refused at the next start, whatever its figures say
    edited = trust_problem(plan, [], checksum, plan_path)
    if edited:
        result = "plan_edited"
        reasons.append(edited)
    elif verdict["action"] == "refuse":
        result = "would_refuse"
        reasons.append(verdict["message"])
    elif verdict["action"] in ("shrink", "profile"):
        result = "would_shrink"
        reasons.append(verdict["message"])
    else:
        result = "ok"
    if age_days is not None and age_days * 86400.0 < -FUTURE_TOLERANCE_S:
        reasons.append(f"the plan is dated {plan.get('planned_at')}, {-age_days * 24:.1f} h in the future of the {clock}'s clock: "
                       "a clock is wrong (or the date was edited); its age cannot be judged: profile the class again")
    elif age_days is not None and age_days > reprofile_after_days:
        reasons.append(f"the plan is {age_days:.1f} days old (allowed {reprofile_after_days:g}): profile the class again")
    if key_matches is False:
        reasons.append(f"the class's stored reference has compatibility key {reference_key_hash}, the plan "
                       f"{plan.get('compat_key_hash')}: profile the class again")
    if result == "ok" and reasons:
        result = "reprofile_due"
    margins = [r["margin_bytes"] for r in verdict["ranks"] if r["margin_bytes"] is not None]
    last = dict(state) if state else None
    return {
        "instance": plan["instance"],
        "unit": verdict["unit"],
        "host_class": plan.get("host_class") or "",
        "policy": policy,
        "decision": plan["decision"],
        "verdict": result,
        "next_start": verdict["action"],
        "ranks": verdict["ranks"],
        "min_margin_bytes": min(margins) if margins else None,
        "kv_cache_memory_bytes": plan["kv_cache_memory_bytes"],
        "kv_cache_tokens": plan["kv_cache_tokens"],
        "would_start": verdict["started"],
        "planned_at": plan.get("planned_at"),
        "plan_timestamp": planned_ts,
        "plan_age_days": round(age_days, 3) if age_days is not None else None,
        "compat_key_hash": plan.get("compat_key_hash"),
        "reference_key_hash": reference_key_hash,
        "key_matches": key_matches,
        "last_start": _last_start(last),
        "plan_checksum": plan.get("checksum"),
        "recorded_checksum": checksum,
        "reasons": reasons,
    }


def _last_start(state: t.Mapping[str, t.Any] | None) -> dict[str, t.Any] | None:
    """What the gate did at the unit's last start (its record), for the degraded figures."""
    if not state:
        return None
    started = state.get("started") or {}
    return {"checked_at": state.get("checked_at"), "action": state.get("action"),
            "degraded": state.get("degraded"), "kv_cache_memory_bytes": started.get("kv_cache_memory_bytes"),
            "kv_cache_tokens": started.get("kv_cache_tokens")}


def audit(state_dir: str, nvml: t.Any, now: float | None = None,
          reprofile_after_days: float = DEFAULT_REPROFILE_AFTER_DAYS,
          reference_key_hashes: t.Mapping[str, str] | None = None, host: str = "localhost",
          unit_dir: str = "/etc/systemd/system", controller_time: float | None = None,
          max_clock_skew: float = DEFAULT_MAX_CLOCK_SKEW_S, run_command: RunCommand | None = None) -> dict[str, t.Any]:
    """Every manual-budget instance of this host, judged now (one NVML probe for all).

    ``now``: the host's clock. With ``controller_time`` (the controller's clock when it sent the
    audit) ages are judged on the controller's clock, which wrote ``planned_at``, and the skew
    between the two is reported; beyond ``max_clock_skew`` seconds every instance says so.
    ``run_command``: how the probe runs ``systemctl`` to find the units' processes (the module's
    runner, as the snapshot's; the probe's own without one, as in the exporter).
    """
    from ._gpu._nvml_probe import NvmlProbeError, probe  # pylint: disable=import-outside-toplevel

    now = time.time() if now is None else now
    skew = None if controller_time is None else now - controller_time
    judging, clock = (now, "host") if controller_time is None else (controller_time, "controller")
    plans: list[tuple[str, dict[str, t.Any]]] = []
    errors: list[str] = []
    for path in plan_files(state_dir):
        try:
            plan = read_plan(path)  # the gate's reader: what the next start would read
        except BootGateError as exc:
            errors.append(str(exc))  # it names the file
            continue
        except ValueError as exc:  # a figure the gate's checks did not expect: still only this file
            errors.append(f"plan file {path}: {exc}")
            continue
        if plan["manual"]:
            plans.append((path, plan))
    devices = sorted({g for _path, plan in plans for g in plan["gpus"]})
    # the running engines' memory is what their next start gets back: free + own, as the
    # rollout's gates count it (the boot gate itself runs before its engine exists)
    units = [plan["unit"] or unit_name(plan["instance"]) for _path, plan in plans]
    probe_errors: dict[str, str] = {}
    try:
        gpus = probe(nvml, devices=devices, samples=1, service_units=units, host=host, run_command=run_command)["gpus"] if devices else []
    except NvmlProbeError:
        if len(plans) < 2:
            raise
        # one GPU that NVML cannot read must not blind the other instances: each on its own
        gpus, probe_errors = _probe_each(nvml, plans, host, probe, NvmlProbeError, run_command)
    instances = []
    for path, plan in plans:
        state = read_state(plan["state_file"]) if plan["state_file"] else None
        key = (reference_key_hashes or {}).get(plan.get("host_class") or "")
        unit = plan["unit"] or unit_name(plan["instance"])
        entry = judge(plan, gpus, judging, reprofile_after_days, key, state, recorded_checksum(unit_dir, unit), path, clock)
        if path in probe_errors:
            # no figures of its GPUs: the gate does not start it (it exits before the engine)
            why = probe_errors[path]
            entry.update(nvml_error=why, ranks=[], min_margin_bytes=None, would_start=None, next_start="refuse",
                         verdict="plan_edited" if entry["verdict"] == "plan_edited" else "would_refuse")
            entry["reasons"].insert(0, f"NVML cannot read its GPUs {plan['gpus']}: {why}; the boot gate does not start it")
        if skew is not None and abs(skew) > max_clock_skew:
            entry["reasons"].append(f"the host's clock is {abs(skew):.0f} s {'ahead of' if skew > 0 else 'behind'} the controller's: "
                                    "ages are judged on the controller's; fix the host's time (NTP)")
            if entry["verdict"] == "ok":
                entry["verdict"] = "reprofile_due"
        entry["plan_file"] = path
        entry["gang"] = unit_gang(unit_dir, unit)
        instances.append(entry)
    return {"checked_at": now, "instances": instances, "errors": errors,
            "clock_skew_seconds": round(skew, 3) if skew is not None else None}


def _probe_each(nvml: t.Any, plans: list[tuple[str, dict[str, t.Any]]], host: str, probe: t.Callable[..., t.Any],
                error: type[Exception], run_command: RunCommand | None = None) -> tuple[list[dict[str, t.Any]], dict[str, str]]:
    """The GPUs of each instance probed on their own: those that answer, and per plan file the error of the others."""
    gpus: dict[int, dict[str, t.Any]] = {}
    errors: dict[str, str] = {}
    for path, plan in plans:
        unit = plan["unit"] or unit_name(plan["instance"])
        try:
            found = probe(nvml, devices=plan["gpus"], samples=1, service_units=[unit], host=host,
                          run_command=run_command)["gpus"] if plan["gpus"] else []
        except error as exc:
            errors[path] = str(exc)
            continue
        for gpu in found:
            gpus.setdefault(gpu["index"], gpu)
    return list(gpus.values()), errors


# ---------------------------------------------------------------- node_exporter textfile

def registry(report: t.Mapping[str, t.Any], prometheus: t.Any) -> t.Any:
    """The report as a prometheus_client registry (``prometheus``: the prometheus_client module)."""
    reg = prometheus.CollectorRegistry()
    # not "instance": Prometheus gives every scraped series its target's instance label,
    # which would rename ours to exported_instance
    rank_labels = ["vllm_instance", "rank", "gpu", "class"]
    inst_labels = ["vllm_instance", "class"]

    def gauge(name: str, doc: str, labels: list[str]) -> t.Any:
        return prometheus.Gauge(METRIC_PREFIX + name, doc, labels, registry=reg)

    floor = gauge("floor_bytes", "NVML free memory the instance's rank needs at boot (the plan's floor)", rank_labels)
    free = gauge("boot_free_bytes", "NVML free memory of the rank now (what a start would see)", rank_labels)
    margin = gauge("margin_bytes", "boot-free minus floor; below zero the next start is shrunk or refused", rank_labels)
    budget = gauge("budget_bytes", "the plan's KV-cache budget per rank", inst_labels)
    started_budget = gauge("started_budget_bytes", "KV-cache budget the gate started at the last start (0: profiled)", inst_labels)
    tokens = gauge("tokens", "KV-cache tokens of the plan", inst_labels)
    started_tokens = gauge("started_tokens", "KV-cache tokens the gate started at the last start", inst_labels)
    degraded = gauge("degraded", "1 when the last start was shrunk or profiled by the boot gate", inst_labels)
    refuse = gauge("would_refuse", "1 when a start now would be refused", inst_labels)
    shrink = gauge("would_shrink", "1 when a start now would be shrunk or profiled", inst_labels)
    edited = gauge("plan_edited", "1 when the plan file is not the one the deploy wrote (the gate refuses the next start)",
                   inst_labels)
    planned = gauge("plan_timestamp_seconds", "when the plan file was written", inst_labels)
    refused = gauge("last_start_refused", "1 when the boot gate refused the unit's last start (it stays down until a start "
                    "is tried again)", inst_labels)
    last_action = gauge("last_start_action", "1 for what the boot gate did at the unit's last start", [*inst_labels, "action"])
    last_when = gauge("last_start_timestamp_seconds", "when the boot gate checked the unit's last start", inst_labels)
    nvml_error = gauge("nvml_error", "1 when NVML cannot read the instance's GPUs (its figures are missing)", inst_labels)
    audited = gauge("last_audit_timestamp_seconds", "when these figures were measured", inst_labels)
    health = gauge("gpu_health", "1 when the rank's GPU passes the NVML health check, 0 when it fails it (no series: the GPU "
                   "does not support the query, or NVML could not read the GPU)", [*rank_labels, "uuid", "check"])
    info = gauge("gpu_info", "1 per rank: the card NVML finds at the rank's GPU index now (UUID, PCI bus id), to join with "
                 "the rank's other series", [*rank_labels, "uuid", "pci_bus_id"])
    gang = gauge("gang_member", "1 when the instance runs as a member of a gang (an instance over several hosts): gang is the "
                 "address and port its members meet at, the same on each; a gang starts only when every member does",
                 [*inst_labels, "gang", "leader"])
    errors = prometheus.Gauge(METRIC_PREFIX + "plan_file_errors", "plan files that cannot be read", registry=reg)
    errors.set(len(report.get("errors") or ()))
    for inst in report["instances"]:
        labels = {"vllm_instance": inst["instance"], "class": inst["host_class"]}
        for row in inst["ranks"]:
            rlabels = dict(labels, rank=str(row["rank"]), gpu=str(row["gpu"]))
            if row["floor_bytes"] is not None:
                floor.labels(**rlabels).set(row["floor_bytes"])
            if row["free_bytes"] is not None:
                free.labels(**rlabels).set(row["free_bytes"])
            if row["margin_bytes"] is not None:
                margin.labels(**rlabels).set(row["margin_bytes"])
            if row.get("uuid") or row.get("pci_bus_id"):
                info.labels(uuid=str(row.get("uuid") or ""), pci_bus_id=str(row.get("pci_bus_id") or ""), **rlabels).set(1)
            for check, healthy in health_checks(row.get("health")).items():
                health.labels(uuid=str(row.get("uuid") or ""), check=check, **rlabels).set(1 if healthy else 0)
        if inst["kv_cache_memory_bytes"] is not None:
            budget.labels(**labels).set(inst["kv_cache_memory_bytes"])
        if inst["kv_cache_tokens"] is not None:
            tokens.labels(**labels).set(inst["kv_cache_tokens"])
        last = inst["last_start"] or {}
        if last.get("action") in ("start", "shrink", "profile"):
            started_budget.labels(**labels).set(last.get("kv_cache_memory_bytes") or 0)
            if last.get("kv_cache_tokens") is not None:
                started_tokens.labels(**labels).set(last["kv_cache_tokens"])
        degraded.labels(**labels).set(1 if last.get("degraded") else 0)
        if last.get("action"):
            refused.labels(**labels).set(1 if last["action"] == "refuse" else 0)
            last_action.labels(action=str(last["action"]), **labels).set(1)
            if isinstance(last.get("checked_at"), (int, float)):
                last_when.labels(**labels).set(last["checked_at"])
        nvml_error.labels(**labels).set(1 if inst.get("nvml_error") else 0)
        refuse.labels(**labels).set(1 if inst["verdict"] == "would_refuse" else 0)
        shrink.labels(**labels).set(1 if inst["verdict"] == "would_shrink" else 0)
        edited.labels(**labels).set(1 if inst["verdict"] == "plan_edited" else 0)
        if inst["plan_timestamp"] is not None:
            planned.labels(**labels).set(inst["plan_timestamp"])
        audited.labels(**labels).set(report["checked_at"])
        if inst.get("gang"):
            gang.labels(gang=inst["gang"]["gang"], leader="true" if inst["gang"]["leader"] else "false", **labels).set(1)
    return reg


def _say(stream: t.TextIO, line: str) -> None:
    """One line for the journal (the exporter's stdout and stderr go there)."""
    stream.write(line + "\n")
    stream.flush()


def exporter_main(argv: t.Sequence[str], nvml: t.Any = None, prometheus: t.Any = None) -> int:
    """``gpufleet-vllm-metrics --state-dir DIR --out FILE.prom``: one audit, written atomically."""
    args = list(argv)
    opts = {"state-dir": "/etc/gpufleet", "out": "/var/lib/prometheus/node-exporter/gpufleet_vllm.prom",
            "unit-dir": "/etc/systemd/system"}
    while args:
        key = args.pop(0)
        if not key.startswith("--") or key[2:] not in opts or not args:
            _say(sys.stderr, f"gpufleet-vllm-metrics: unknown or incomplete option {key!r}")
            return 2
        opts[key[2:]] = args.pop(0)
    if not opts["out"].endswith(".prom"):
        _say(sys.stderr, f"gpufleet-vllm-metrics: --out {opts['out']}: node_exporter reads only *.prom files")
        return 2
    if nvml is None:
        # as the boot gate finds it: nvidia-ml-py, else the copy vLLM ships (a vLLM venv often has only that one,
        # and the exporter runs with the gate's interpreter)
        from ._gate._boot_gate import load_pynvml  # pylint: disable=import-outside-toplevel

        try:
            nvml = load_pynvml()
        except ImportError as exc:
            _say(sys.stderr, f"gpufleet-vllm-metrics: no NVML binding: {exc}")
            return 1
    if prometheus is None:
        import prometheus_client  # pylint: disable=import-outside-toplevel

        prometheus = prometheus_client
    from ._gpu._nvml_probe import NvmlProbeError  # pylint: disable=import-outside-toplevel
    try:
        report = audit(opts["state-dir"], nvml, host=os.uname().nodename, unit_dir=opts["unit-dir"])
    except NvmlProbeError as exc:
        # the previous file stays: its audit timestamp ages, which the stale-audit alert sees
        _say(sys.stderr, f"gpufleet-vllm-metrics: NVML probe failed: {exc}")
        return 1
    prometheus.write_to_textfile(opts["out"], registry(report, prometheus))
    for inst in report["instances"]:
        if inst.get("nvml_error"):
            _say(sys.stderr, f"gpufleet-vllm-metrics: {inst['instance']}: NVML probe failed: {inst['nvml_error']}")
    worst = max((VERDICTS.index(i["verdict"]) for i in report["instances"]), default=0)
    _say(sys.stdout, f"gpufleet-vllm-metrics: {len(report['instances'])} instance(s), worst verdict {VERDICTS[worst]}, "
                     f"written to {opts['out']}")
    return 0

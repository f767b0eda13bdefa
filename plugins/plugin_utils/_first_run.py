# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What a rollout of one class will do, before it runs: the canary host, the instances that stop
and for about how long, the units that will be written.

Plain Python, no Ansible import; behind the ``first_run_outline`` filter (plan.yml, rollout.yml)
and read by the run report.

On the canary host the production instance the canaries use is stopped for each canary and
started again with its old unit after each (drained around them when a ``drain`` hook is set);
its class's first batch then restarts it with the new unit. Every other host's instances stop
once, in their batch. The outage figures are estimates: the number of engine boots times the
boot time the collection knows (the reference profile's canary, else the class's newest profile,
else the boot timeout as an upper bound) plus the canary load tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ansible_collections.gpufleet.vllm.plugins.module_utils._units._instance import unit_name

__all__ = ["CANARY_RULE", "FirstRunError", "outline", "outline_lines"]

CANARY_RULE = "the first healthy host of the class by name"
# a canary's load test, warm-up included, when no earlier canary measured one
_LOAD_SECONDS_DEFAULT = 30.0


class FirstRunError(ValueError):
    """Malformed outline input (names the field)."""


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise FirstRunError(f"{field}: expected a non-empty string, got {value!r}")
    return value


def _seconds(value: Any, field: str) -> float | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise FirstRunError(f"{field}: expected seconds (a number), got {value!r}")
    try:
        out = float(value)
    except ValueError:
        raise FirstRunError(f"{field}: expected seconds (a number), got {value!r}") from None
    if out < 0 or out != out:  # pylint: disable=comparison-with-itself
        raise FirstRunError(f"{field}: expected seconds >= 0, got {value!r}")
    return out


def _active(state: Any) -> bool:
    return str(state or "") in ("active", "activating", "reloading")


def outline(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The outline of one class's rollout.

    ``spec``: ``host_class``, ``canary_host``, ``canary_chosen`` (true when ``gpufleet_canary_host``
    named it), ``canary_instance`` (the instance name the canaries use), ``profiled_canary`` (a
    profiled canary runs: no reference profile for the key, or a fresh one was asked for),
    ``manual_canary`` (true, false or ``None``: decided after planning), ``hosts`` (host -> list of
    ``{name, active_state, unit_exists}``), ``batches`` (lists of hosts, in order),
    ``boot_seconds`` and ``boot_source`` (the boot time the collection knows and where from),
    ``boot_timeout`` (upper bound when none is known), ``load_seconds`` (one canary load test),
    ``drain`` (a drain hook is set).
    """
    if not isinstance(spec, Mapping):
        raise FirstRunError("first run outline: expected a mapping")
    host_class = _text(spec.get("host_class"), "host_class")
    canary = _text(spec.get("canary_host"), "canary_host")
    canary_instance = _text(spec.get("canary_instance"), "canary_instance")
    hosts = spec.get("hosts")
    if not isinstance(hosts, Mapping) or canary not in hosts:
        raise FirstRunError(f"hosts: expected host -> instances with the canary host {canary} among them")
    batches = spec.get("batches") or [[h] for h in hosts]
    if not isinstance(batches, Sequence) or isinstance(batches, str):
        raise FirstRunError("batches: expected a list of host lists")
    boot = _seconds(spec.get("boot_seconds"), "boot_seconds")
    timeout = _seconds(spec.get("boot_timeout"), "boot_timeout") or 900.0
    load = _seconds(spec.get("load_seconds"), "load_seconds")
    source = str(spec.get("boot_source") or "")
    if boot is None:
        boot_used, estimate = timeout, "at most"
        source = f"no boot measured yet for this class: the boot timeout {int(timeout)} s is the upper bound"
    else:
        boot_used, estimate = boot, "about"
    load_used = _LOAD_SECONDS_DEFAULT if load is None else load
    profiled = bool(spec.get("profiled_canary"))
    manual = spec.get("manual_canary")
    canaries = (1 if profiled else 0) + (0 if manual is False else 1)
    batch_of: dict[str, int] = {}
    for number, group in enumerate(batches, start=1):
        if not isinstance(group, Sequence) or isinstance(group, str):
            raise FirstRunError(f"batches[{number - 1}]: expected a list of hosts")
        for host in group:
            batch_of.setdefault(str(host), number)

    stops: list[dict[str, Any]] = []
    units: list[dict[str, Any]] = []
    for host in sorted(hosts, key=lambda h: (batch_of.get(h, 10**6), h != canary, h)):
        instances = hosts[host]
        if not isinstance(instances, Sequence) or isinstance(instances, str):
            raise FirstRunError(f"hosts.{host}: expected a list of instances")
        for pos, inst in enumerate(instances):
            if not isinstance(inst, Mapping):
                raise FirstRunError(f"hosts.{host}[{pos}]: expected {{name, active_state, unit_exists}}")
            name = _text(inst.get("name"), f"hosts.{host}[{pos}].name")
            running = _active(inst.get("active_state"))
            unit = unit_name(name)
            units.append({"host": host, "unit": unit, "action": "replace" if inst.get("unit_exists") else "create",
                          "batch": batch_of.get(host)})
            if not running:
                continue
            boots = 1
            loads = 0
            when = f"batch {batch_of.get(host, '?')}"
            if host == canary and name == canary_instance and canaries:
                # each canary boots once and runs its load test; the old unit boots again after each;
                # the first batch boots the new unit
                boots = 2 * canaries + 1
                loads = canaries
                when = (f"{canaries} canar{'y' if canaries == 1 else 'ies'} (each followed by a restart with the old unit), "
                        f"then batch {batch_of.get(host, '?')}")
            stops.append({
                "host": host,
                "instance": name,
                "unit": unit,
                "when": when,
                "boots": boots,
                "load_tests": loads,
                "estimate": estimate,
                "seconds": round(boots * boot_used + loads * load_used),
                "drained": bool(spec.get("drain")),
            })
    return {
        "host_class": host_class,
        "canary_host": canary,
        "canary_rule": "gpufleet_canary_host" if spec.get("canary_chosen") else CANARY_RULE,
        "canary_instance": canary_instance,
        "profiled_canary": profiled,
        "manual_canary": manual,
        "boot_seconds": boot,
        "boot_source": source,
        "load_seconds": load,
        "stops": stops,
        "units": units,
    }


def outline_lines(out: Mapping[str, Any]) -> list[str]:
    """The outline as lines a person reads (the plan's output and the report)."""
    lines = [
        f"class {out['host_class']}: canary host {out['canary_host']} ({out['canary_rule']}), instance {out['canary_instance']}; "
        + ("a profiled canary, then " if out["profiled_canary"] else "")
        + ("a manual canary with the planned budget" if out["manual_canary"] is not False else "no manual canary (the canary host runs the plan)")
    ]
    boot = out.get("boot_seconds")
    lines.append(f"engine boot: {'about ' + str(round(boot)) + ' s (' + out['boot_source'] + ')' if boot is not None else out['boot_source']}")
    if not out["stops"]:
        lines.append("no running instance stops (no vLLM unit runs yet on these hosts)")
    for stop in out["stops"]:
        loads = f" and {stop['load_tests']} canary load test(s)" if stop["load_tests"] else ""
        lines.append(
            f"{stop['host']}: {stop['unit']} is out of service for {stop['boots']} engine boot(s){loads} ({stop['when']}): "
            f"{stop['estimate']} {stop['seconds']} s in all{' (drained first)' if stop['drained'] else ''}"
        )
    created = [u for u in out["units"] if u["action"] == "create"]
    replaced = [u for u in out["units"] if u["action"] == "replace"]
    if created:
        lines.append("units written new: " + ", ".join(f"{u['host']}:{u['unit']}" for u in created))
    if replaced:
        lines.append("units replaced (the previous one is kept for rollback): " + ", ".join(f"{u['host']}:{u['unit']}" for u in replaced))
    return lines

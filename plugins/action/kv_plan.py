# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin for gpufleet.vllm.kv_plan: plan one host class on the controller."""

from __future__ import annotations

import time
from typing import Any, Mapping

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import default
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._gang import GangError
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._instance import clashes
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError, boolean, instance_name, integer
from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _probe_history
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._gangs import rank_places
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import SPLIT_POLICIES, UNSTABLE_SCOPES, PlanError, plan_class, plan_deployable

ARGUMENT_SPEC: dict[str, Any] = {
    "host_class": {"type": "str"},
    "reference": {"type": "dict"},
    "hosts": {"type": "dict"},
    "hosts_from": {"type": "str"},
    "guard_bytes": {"type": "raw", "default": default("guard_bytes")},
    "admission": {"type": "dict"},
    "max_model_len": {"type": "int"},
    "budget_mode": {"type": "str", "default": default("budget_mode"), "choices": ["max_safe", "fit_admission"]},
    "fit_headroom": {"type": "float", "default": default("fit_headroom")},
    "max_capacity_loss": {"type": "float", "default": default("max_capacity_loss")},
    "reprofile_headroom": {"type": "raw"},
    "unstable_share": {"type": "float", "default": default("unstable_share")},
    "cuda_context_bytes": {"type": "raw", "default": default("cuda_context_bytes")},
    "gate_margin_bytes": {"type": "raw", "default": default("gate_margin_bytes")},
    "budget_granularity_bytes": {"type": "raw", "default": default("budget_granularity_bytes")},
    "keep_step_bytes": {"type": "raw", "default": default("keep_step_bytes")},
    "deployed": {"type": "dict"},
    "split_policy": {"type": "str", "default": default("split_policy"), "choices": list(SPLIT_POLICIES)},
    "unstable_scope": {"type": "str", "default": default("unstable_scope"), "choices": list(UNSTABLE_SCOPES)},
    "require_admission": {"type": "bool", "default": default("require_admission")},
    "probe_history": {
        "type": "dict",
        "options": {
            "store": {"type": "path", "required": True},
            "keep": {"type": "int", "default": _probe_history.DEFAULT_KEEP},
            "window": {"type": "int", "default": _probe_history.DEFAULT_WINDOW},
        },
    },
}

DEFAULT_INSTANCE = "vllm"


def _facts_gpus(hostvars: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    gpus = hostvars.get("gpufleet_gpus")
    if gpus is None:
        facts = hostvars.get("ansible_facts") or {}
        gpus = facts.get("gpufleet_gpus") if isinstance(facts, Mapping) else None
    return gpus if isinstance(gpus, list) else None


def members_from_group(group: str, task_vars: Mapping[str, Any],
                       history: Mapping[str, list[dict[str, Any]]] | None = None,
                       window: int = _probe_history.DEFAULT_WINDOW) -> dict[str, list[dict[str, Any]] | dict[str, Any]]:
    """``{"<host>/<instance>": [rank entries]}`` from the ``gpufleet_gpus`` facts of a group.

    Each instance of ``gpufleet_instances`` (default: one instance ``vllm`` on
    every GPU) is one member; its ranks are its GPUs in the order listed. A host
    whose inventory sets ``gpufleet_unstable`` gives ``{ranks, unstable: true}``
    members; with ``history`` (host -> probes) each rank carries how far its GPU's
    boot-free memory moved across the last ``window`` probes.

    An instance that spans hosts (a gang) is one member ``<leader>/<instance>``: one engine, whose ranks are
    every member's, numbered in the whole instance and each naming its ``member`` host; it is unstable when
    any member is flagged. Every member must be a host of the group with its facts.
    """
    groups = task_vars.get("groups") or {}
    if group not in groups:
        raise AnsibleActionFail(f"hosts_from: inventory group {group!r} does not exist")
    hostvars = task_vars.get("hostvars") or {}
    members: dict[str, list[dict[str, Any]] | dict[str, Any]] = {}
    no_facts: list[str] = []
    try:
        places = rank_places(hostvars, [str(h) for h in groups[group]])
    except GangError as exc:
        raise AnsibleActionFail(f"hosts_from {group}: {exc}") from None
    # a gang's planning member -> its hosts, its ranks so far, whether a member is flagged unstable, the members seen
    gangs: dict[str, tuple[tuple[str, ...], list[dict[str, Any]], list[bool], set[str]]] = {}
    for host in groups[group]:
        hv = hostvars.get(host) or {}
        gpus = _facts_gpus(hv)
        if not gpus:
            no_facts.append(host)
            continue
        by_index = {}
        for pos, gpu in enumerate(gpus):
            try:
                index = integer(gpu.get("index", pos) if isinstance(gpu, Mapping) else None, f"host {host} gpufleet_gpus[{pos}].index", low=0)
            except ValidationError as exc:
                raise AnsibleActionFail(str(exc)) from None
            if index in by_index:
                raise AnsibleActionFail(f"host {host}: GPU index {index} appears twice in its gpufleet_gpus facts")
            by_index[index] = gpu
        instances = hv.get("gpufleet_instances") or [{"name": DEFAULT_INSTANCE, "gpus": sorted(by_index)}]
        if not isinstance(instances, list):
            raise AnsibleActionFail(f"host {host}: gpufleet_instances must be a list of {{name, gpus, port}}")
        # the instance rules of a host (_instance.clashes), each refused where the loop below reaches it
        found = clashes([{"name": i.get("name"), "gpus": sorted(by_index) if i.get("gpus") is None else i.get("gpus")}
                         if isinstance(i, Mapping) else None for i in instances])
        twice_named = {c.position for c in found if c.rule == "name"}
        gpu_clash = {(c.position, c.rank): c for c in found if c.rule in ("gpu_twice", "gpu_shared")}
        for pos, inst in enumerate(instances):
            if not isinstance(inst, Mapping) or not inst.get("name"):
                raise AnsibleActionFail(f"host {host}: every gpufleet_instances entry needs a name")
            try:
                instance_name(inst["name"], f"host {host} gpufleet_instances name")
            except ValidationError as exc:
                raise AnsibleActionFail(str(exc)) from None
            if pos in twice_named:
                raise AnsibleActionFail(f"host {host}: instance {inst['name']} appears twice in gpufleet_instances")
            indices = inst.get("gpus")
            if indices is None:
                indices = sorted(by_index)
            if not isinstance(indices, list):
                raise AnsibleActionFail(f"host {host} instance {inst['name']}: gpus must be a list of GPU indices")
            ranks = []
            for rank, index in enumerate(indices):
                try:
                    gpu = by_index[int(index)]
                except (KeyError, TypeError, ValueError):
                    raise AnsibleActionFail(
                        f"host {host} instance {inst['name']}: GPU {index!r} is not in its gpufleet_gpus facts (indices {sorted(by_index)})"
                    ) from None
                entry = {
                    "rank": rank,
                    "boot_free_bytes": gpu.get("boot_free_bytes", gpu.get("free_bytes")),
                    "free_min_bytes": gpu.get("free_min_bytes"),
                    "free_max_bytes": gpu.get("free_max_bytes"),
                    "gpu_name": gpu.get("name"),
                    "total_bytes": gpu.get("total_bytes"),
                    # the card, for the plan's per-rank table (the planner does not judge by it)
                    "gpu": int(index),
                    "uuid": gpu.get("uuid"),
                    "pci_bus_id": gpu.get("pci_bus_id"),
                }
                moved = _probe_history.movement(history[host], int(index), window) if history and host in history else None
                if moved is not None:
                    entry["history_spread_bytes"], entry["history_min_bytes"] = moved
                ranks.append({k: v for k, v in entry.items() if v is not None})
                clash = gpu_clash.get((pos, rank))
                if clash is not None and clash.rule == "gpu_twice":
                    raise AnsibleActionFail(f"host {host} instance {inst['name']}: GPU {index} is listed twice")
                if clash is not None:
                    raise AnsibleActionFail(f"host {host}: GPU {index} is used by instances {instances[clash.other]['name']} and {inst['name']}; "
                                            "instances sharing a GPU would each be planned the whole budget")
            try:
                flagged = boolean(hv.get("gpufleet_unstable", False), f"host {host} gpufleet_unstable")
            except ValidationError as exc:
                raise AnsibleActionFail(str(exc)) from None
            place = places.get((str(host), str(inst["name"])))
            if place is None:
                members[f"{host}/{inst['name']}"] = {"ranks": ranks, "unstable": True} if flagged else ranks
                continue
            _hosts, gang_ranks, gang_flagged, seen = gangs.setdefault(place.member, (place.members, [], [], set()))
            gang_ranks.extend(dict(r, rank=place.first_rank + r["rank"], member=str(host)) for r in ranks)
            gang_flagged.append(flagged)
            seen.add(str(host))
    if no_facts:
        shown = ", ".join(no_facts[:10]) + (f" and {len(no_facts) - 10} more" if len(no_facts) > 10 else "")
        raise AnsibleActionFail(f"hosts_from {group}: no gpufleet_gpus facts for {shown}; run gpufleet.vllm.gpu_memory_facts on them first")
    for member, (hosts_of_gang, gang_ranks, gang_flagged, seen) in gangs.items():
        missing = [h for h in hosts_of_gang if h not in seen]
        if missing:
            raise AnsibleActionFail(f"hosts_from {group}: instance {member.split('/', 1)[1]} spans hosts {', '.join(hosts_of_gang)}: "
                                    f"{', '.join(missing)} not in the group; a gang is planned on every rank of every member")
        gang_ranks.sort(key=lambda r: r["rank"])
        members[member] = {"ranks": gang_ranks, "unstable": True} if any(gang_flagged) else gang_ranks
    return members


class ActionModule(ActionBase):  # type: ignore[misc]  # ActionBase is Any: ansible-core ships no type information
    """Plan a host class: launch bytes, floor, utilization, capacity, decision."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)
    _requires_connection = False

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result: dict[str, Any] = super().run(tmp, task_vars)
        del tmp
        _validation, args = self.validate_argument_spec(
            argument_spec=ARGUMENT_SPEC,
            required_one_of=[["hosts", "hosts_from"]],
        )
        hosts: dict[str, Any] = dict(args.get("hosts") or {})
        if args.get("hosts_from"):
            history = None
            if args.get("probe_history"):
                try:
                    history = self._record_history(args["hosts_from"], task_vars, args["probe_history"])
                except _probe_history.ProbeHistoryError as exc:
                    raise AnsibleActionFail(f"kv_plan ({args.get('host_class') or 'class'}): {exc}") from None
            window = args["probe_history"]["window"] if args.get("probe_history") else _probe_history.DEFAULT_WINDOW
            for name, ranks in members_from_group(args["hosts_from"], task_vars, history, window).items():
                if name in hosts:
                    raise AnsibleActionFail(f"host {name} is given both in hosts and by hosts_from")
                hosts[name] = ranks
        # require_admission judges the plan (deployable) and does not change it; split_policy per_host and
        # unstable_scope host give hosts of the class plans of their own (host_groups)
        spec = {k: v for k, v in args.items() if k not in ("hosts_from", "probe_history", "require_admission")}
        spec["hosts"] = hosts
        try:
            plan = plan_class(spec)
            deployable = plan_deployable(plan, args["split_policy"], args["require_admission"])
        except PlanError as exc:
            result.update(failed=True, msg=f"kv_plan ({args.get('host_class') or 'class'}): {exc}")
            return result
        result.update(plan)
        result["deployable"] = deployable
        result["changed"] = False
        result["msg"] = f"{plan['decision']}: {plan['reasons'][0]}" if plan["reasons"] else plan["decision"]
        return result

    def _record_history(self, group: str, task_vars: Mapping[str, Any],
                        options: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
        """Append each host's probe to its history (not in check mode); host -> probes."""
        if options["window"] < 2 or options["keep"] < options["window"]:
            raise _probe_history.ProbeHistoryError(
                f"probe_history: window must be >= 2 and keep >= window, got window {options['window']}, keep {options['keep']}")
        hostvars = task_vars.get("hostvars") or {}
        now = time.time()
        out = {}
        for host in (task_vars.get("groups") or {}).get(group, []):
            gpus = _facts_gpus(hostvars.get(host) or {})
            if gpus:
                out[host] = _probe_history.record(options["store"], host, gpus, now, options["keep"], bool(self._task.check_mode))
        return out

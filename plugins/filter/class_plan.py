# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters: class_canary, class_canary_hosts, class_deploy_order, class_state, class_states (documentation in the YAML files beside this one).

One call into ``plugin_utils/_class_plan``, where the class's planning decisions live."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.module_utils._units._gang import GangError
from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _gangs
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._analysis import BAKE_FIELDS, AnalysisError, bake_settings
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._class_plan import (
    ClassPlanError,
    canary_need,
    class_state as _class_state,
    class_states as _class_states,
    deploy_order,
)
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._rollout import NEW_PLAN_ON_FAILURE, RolloutError, class_on_failure, host_capacity


def class_canary(query: Any, host_class: Any, force_profile: Any = False, run_canaries: Any = True) -> dict[str, Any]:
    """A class's reference lookup and the run's settings -> whether it needs a profiled canary, and why."""
    if not isinstance(host_class, str) or not host_class:
        raise AnsibleFilterError("class_canary: host_class must be the class name")
    try:
        return canary_need(query, host_class, force_profile=bool(force_profile), run_canaries=bool(run_canaries)).as_dict()
    except ClassPlanError as exc:
        raise AnsibleFilterError(f"class_canary: {exc}") from None


def class_canary_hosts(hostvars: Any, class_hosts: Any) -> list[str]:
    """hostvars, a class's healthy hosts -> the hosts that run its canaries, the canary host first (with the members
    of its gang when its first instance spans hosts)."""
    if not isinstance(hostvars, Mapping):
        raise AnsibleFilterError(f"class_canary_hosts: expected hostvars as the input, got {type(hostvars).__name__}")
    if isinstance(class_hosts, (str, Mapping)) or not isinstance(class_hosts, Sequence):
        raise AnsibleFilterError("class_canary_hosts: class_hosts must be the list of the class's hosts")
    try:
        return _gangs.canary_hosts(hostvars, [str(h) for h in class_hosts])
    except GangError as exc:
        raise AnsibleFilterError(f"class_canary_hosts: {exc}") from None


def class_state(outcome: Any, host_class: Any, **fields: Any) -> dict[str, Any]:
    """A class's outcome and what planning found -> its state record (``gpufleet_class_state``), built in one place."""
    if not isinstance(host_class, str) or not host_class:
        raise AnsibleFilterError("class_state: host_class must be the class name")
    try:
        return _class_state(str(outcome), host_class, **fields).as_dict()
    except TypeError as exc:  # an unknown keyword
        raise AnsibleFilterError(f"class_state: {exc}") from None
    except ClassPlanError as exc:
        raise AnsibleFilterError(f"class_state: {exc}") from None


def class_deploy_order(hostvars: Any, hosts: Any, classes: Any, approved_plan: Any = None) -> list[dict[str, Any]]:
    """hostvars, the play's hosts and the class order -> ``{class, hosts, max_unavailable, capacity, bake, on_failure}`` per
    deployable class, its canary host first (``approved_plan``: the plan artifact the run applies, whose classes'
    recorded failure policy applies where the inventory sets none)."""
    if not isinstance(hosts, (list, tuple)) or not isinstance(classes, (list, tuple)):
        raise AnsibleFilterError("class_deploy_order: hosts and classes must be lists")
    states = {}
    for host in hosts:
        host_vars = hostvars[host]
        state = host_vars.get("gpufleet_class_state") or {}
        snapshot = host_vars.get("gpufleet_probe_result")
        states[str(host)] = {"host_class": host_vars.get("gpufleet_host_class"), "ok": state.get("ok") is True,
                             "canary": host_vars.get("gpufleet_canary_of_class"),
                             "max_unavailable": host_vars.get("gpufleet_max_unavailable"),
                             "capacity": host_capacity(snapshot) if isinstance(snapshot, Mapping) else None,
                             "bake": _bake(host_vars), "on_failure": _on_failure(host_vars, approved_plan)}
    try:
        # the instances over several hosts: each is rolled out whole (rollout_batches)
        gangs = [(g["host_class"], g["members"]) for g in _gangs.described(hostvars, [str(h) for h in hosts])]
        return deploy_order(states, [str(c) for c in classes], gangs)
    except (ClassPlanError, GangError) as exc:
        raise AnsibleFilterError(f"class_deploy_order: {exc}") from None


def _on_failure(host_vars: Mapping[str, Any], approved_plan: Any) -> str:
    """The class's failure policy as this host gives it (validate.yml checked the value and that the class's hosts agree)."""
    try:
        return class_on_failure(host_vars.get("gpufleet_on_failure"), str(host_vars.get("gpufleet_host_class")), approved_plan)
    except RolloutError as exc:
        raise AnsibleFilterError(f"class_deploy_order: {exc}") from None


def _bake(host_vars: Mapping[str, Any]) -> dict[str, Any] | None:
    """The class's bake as this host gives it (validate.yml checked it, and that the class's hosts agree)."""
    try:
        return bake_settings(*(host_vars.get(name) for name in BAKE_FIELDS))
    except AnalysisError as exc:
        raise AnsibleFilterError(f"class_deploy_order: {exc}") from None


def class_states(hostvars: Any, hosts: Any) -> dict[str, dict[str, Any]]:
    """hostvars and the planned hosts -> every class's state with its reference id (the plan artifact's classes)."""
    if not isinstance(hosts, (list, tuple)):
        raise AnsibleFilterError("class_states: hosts must be a list")
    rows = []
    policies: dict[str, str] = {}
    for host in hosts:
        host_vars = hostvars[host]
        rows.append((str(host), host_vars.get("gpufleet_host_class"), host_vars.get("gpufleet_class_state")))
        policies.setdefault(str(host_vars.get("gpufleet_host_class")), _on_failure(host_vars, None))
    states = _class_states(rows)
    # the failure policy the plan is made with, recorded for the run that applies it
    return {name: dict(state, on_failure=policies.get(name, NEW_PLAN_ON_FAILURE)) for name, state in states.items()}


class FilterModule:
    """gpufleet.vllm class planning filters."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"class_canary": class_canary, "class_canary_hosts": class_canary_hosts, "class_deploy_order": class_deploy_order, "class_state": class_state,
                "class_states": class_states}

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters: class_rollback_hosts, class_settings_problems, compat_fields, gate_violations, metrics_targets, release_history, rollback_summary,
rollout_batches, rollout_plan, rollout_plan_drift, run_settings, runtime_problems.

The documentation of each is in the YAML file of its name beside this one.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ansible.errors import AnsibleFilterError, AnsibleUndefinedVariable
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from jinja2 import Undefined
from jinja2.exceptions import UndefinedError

from ansible_collections.gpufleet.vllm.plugins.module_utils import _lease, _validate
from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import default
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan import _compat
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import LaunchError
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._unit_files import rollback_summary as _rollback_summary
from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _analysis, _gangs, _releases, _report, _rollout


def failure_message(result: Any, default: str = "no message") -> str:
    """A failed task's result (ansible_failed_result) -> what it said: each failed item's message, else its msg."""
    if not isinstance(default, str):
        raise AnsibleFilterError("failure_message: default must be a text")
    return _report.failure_message(result, default)


def rollback_summary(entries: Any) -> str:
    """What a restore (vllm_unit state=restored) did, instance by instance."""
    if not isinstance(entries, Sequence) or isinstance(entries, str) or not all(isinstance(e, Mapping) for e in entries):
        raise AnsibleFilterError("rollback_summary: expected the instances list of gpufleet.vllm.vllm_unit state=restored")
    return _rollback_summary(entries)


def rollout_batches(classes: Any, serial: Any = None) -> list[dict[str, Any]]:
    """Per-class batches, classes in the given order."""
    try:
        return _rollout.class_batches(classes, [1, "10%", "50%"] if serial is None else serial)
    except _rollout.RolloutError as exc:
        raise AnsibleFilterError(f"rollout_batches: {exc}") from None


def class_rollback_hosts(batches: Any, hostvars: Any, active: Any = None, gangs: Any = False) -> list[str]:
    """The run's batch records and hostvars -> the hosts of the running batch's class that this run changed, but the
    running batch's failing ones (and, given ``active``, its hosts no longer in the batch), in the order a class
    rollback restores them (the latest batch first); with ``gangs``, only the members of gangs among them."""
    if isinstance(batches, (str, Mapping)) or not isinstance(batches, Sequence) or not all(isinstance(b, Mapping) for b in batches):
        raise AnsibleFilterError("class_rollback_hosts: expected the run's batch records (gpufleet_batches)")
    if not isinstance(hostvars, Mapping):
        raise AnsibleFilterError("class_rollback_hosts: expected hostvars")
    if not isinstance(gangs, bool):
        raise AnsibleFilterError(f"class_rollback_hosts: gangs must be true or false, got {gangs!r}")
    hosts = sorted({h for b in batches for h in b.get("hosts") or []})
    changed = {h: bool((hostvars.get(h) or {}).get("vllm_service_pending")) for h in hosts}
    # the hosts of the running batch on their own failure path (playbooks/tasks/host_failed.yml): each rolls itself back
    failing = {h for h in hosts if (hostvars.get(h) or {}).get("gpufleet_failing_in_batch")}
    if active is not None and (isinstance(active, (str, Mapping)) or not isinstance(active, Sequence)):
        raise AnsibleFilterError("class_rollback_hosts: active must be the batch's hosts still in the play (ansible_play_batch)")
    members: set[str] = set()
    if gangs:
        try:
            members = {m for gang in _gangs.described(hostvars, hosts) for m in gang["members"]}
        except ValueError as exc:  # GangError: the inventory's gang checks ran before any batch
            raise AnsibleFilterError(f"class_rollback_hosts: {exc}") from None
    return _rollout.class_rollback_hosts(batches, changed, failing, None if active is None else set(active), members, gangs)


def class_settings_problems(hostvars: Any, hosts: Any, classes: Any = None) -> list[str]:
    """hostvars, the run's hosts -> what is wrong with each class's own settings (its capacity budget, failure policy,
    bake, model config, serve args and service user); ``classes``, the run's, limits the model config's check."""
    if not isinstance(hostvars, Mapping) or isinstance(hosts, str) or not isinstance(hosts, Sequence):
        raise AnsibleFilterError("class_settings_problems: expected hostvars | gpufleet.vllm.class_settings_problems(list of hosts)")
    if classes is not None and (isinstance(classes, str) or not isinstance(classes, Sequence)):
        raise AnsibleFilterError("class_settings_problems: classes must be a list of host classes")
    wanted = ("gpufleet_host_class", *_rollout.CLASS_SETTINGS, _rollout.MODEL_CONFIG_FIELD, _rollout.SERVE_ARGS_FIELD,
              _rollout.SERVICE_USER_FIELD)
    views = {}
    for host in hosts:
        found = hostvars.get(host) or {}
        views[str(host)] = {name: found.get(name) for name in wanted}
    return _rollout.class_settings_problems(views, [str(c) for c in classes or ()])


def metrics_targets(instances: Any, host: Any, listen_host: Any = "0.0.0.0", reach: Any = None, address: Any = None,
                    gang_launch: Any = None) -> list[dict[str, str]]:
    """A host's instances -> where the controller reads each engine's /metrics during a bake."""
    if not isinstance(host, str) or not host:
        raise AnsibleFilterError("metrics_targets: host must be the inventory host's name")
    try:
        return _analysis.metrics_targets(host, instances, listen_host, reach, address, gang_launch)
    except _analysis.AnalysisError as exc:
        raise AnsibleFilterError(f"metrics_targets: {exc}") from None


def rollout_plan(classes: Mapping[str, Any], hosts: Mapping[str, Any], created: str, serial: Any = None) -> dict[str, Any]:
    """The plan artifact plan.yml writes."""
    if not isinstance(classes, Mapping) or not isinstance(hosts, Mapping):
        raise AnsibleFilterError("rollout_plan: classes and hosts must be mappings")
    return _rollout.plan_artifact(classes, hosts, str(created), serial)


def rollout_plan_drift(plan: Any, host_class: str | None = None, current: Mapping[str, Any] | None = None,
                       host: str | None = None, units: Sequence[Mapping[str, Any]] | None = None) -> list[str]:
    """What moved since the approved plan: for a class (``host_class``, ``current``) and/or a host's units."""
    try:
        moved: list[str] = []
        if host_class is not None:
            moved += _rollout.plan_drift(plan, host_class, current or {})
        if host is not None:
            moved += _rollout.unit_drift(plan, host, units or [])
        if host_class is None and host is None:
            _rollout.check_artifact(plan)
        return moved
    except _rollout.RolloutError as exc:
        raise AnsibleFilterError(f"rollout_plan_drift: {exc}") from None


def run_settings(names: Any, given: Any, inventory: Any) -> dict[str, Any]:
    """The run's settings: the play's variables first, else the first target host's; survey text lists read.
    Given the argument spec, the settings are validated against it (as ``validate_argument_spec`` would, but
    without reading the play's variables again: a setting whose template is undefined there is not given)."""
    if not isinstance(given, Mapping) or not isinstance(inventory, Mapping):
        raise AnsibleFilterError("run_settings: the play's variables (vars) and the first host's variables must be mappings")
    if isinstance(names, str) or not isinstance(names, (Mapping, Sequence)):
        raise AnsibleFilterError("run_settings: expected the names of the run settings (a list, or the argument spec)")
    wanted = [str(name) for name in names]
    settings = _rollout.run_settings(wanted, _defined(given, wanted), _defined(inventory, wanted))
    if isinstance(names, Mapping):
        errors = ArgumentSpecValidator(dict(names)).validate(dict(settings)).error_messages
        if errors:
            raise AnsibleFilterError("run_settings: Validation of arguments failed:\n" + "\n".join(errors))
    if "gpufleet_rollout_serial" in settings:
        try:
            _rollout.check_serial(settings["gpufleet_rollout_serial"])
        except _rollout.RolloutError as exc:
            raise AnsibleFilterError(f"run_settings: {exc}") from None
    try:
        # the controller's own directories: never the system's, unless asked for
        allow = _validate.boolean(settings.get("gpufleet_allow_system_paths", False), "gpufleet_allow_system_paths")
        for key in ("gpufleet_profile_store", "gpufleet_report_dir", "gpufleet_plan_file"):
            if settings.get(key):
                _validate.outside_system_dirs(settings[key], key, allow=allow)
        if "gpufleet_remote_timeout" in settings:
            _validate.integer(settings["gpufleet_remote_timeout"], "gpufleet_remote_timeout", low=30, high=86400)
        if "gpufleet_lease_ttl" in settings or "gpufleet_lease_wait" in settings:
            _lease.check_inputs(settings.get("gpufleet_lease_ttl", default("lease_ttl")), settings.get("gpufleet_lease_wait", default("lease_wait")))
    except (_validate.ValidationError, _lease.LeaseError) as exc:
        raise AnsibleFilterError(f"run_settings: {exc}") from None
    return settings


def _defined(variables: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """The values of ``names`` that resolve: a value whose template is undefined where it is read (a group
    variable built from a host's own variable, read on localhost) is not given, as ``is defined`` says."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            if name not in variables:
                continue
            value = variables[name]
        except (UndefinedError, AnsibleUndefinedVariable):
            continue
        if not isinstance(value, Undefined):
            out[name] = value
    return out


def compat_fields(host: Any) -> dict[str, Any]:
    """An instance's engine, model, serve args and GPU as the fields of its compatibility key."""
    if not isinstance(host, Mapping):
        raise AnsibleFilterError(f"compat_fields: expected a mapping of the instance's facts, got {type(host).__name__}")
    unknown = sorted(set(host) - _COMPAT_INPUTS)
    if unknown or "model" not in host:
        raise AnsibleFilterError(f"compat_fields: model is required; unknown input(s) {', '.join(unknown) or 'none'} "
                                 f"(it takes {', '.join(sorted(_COMPAT_INPUTS))})")
    try:
        return _compat.host_fields(
            str(host["model"]), host.get("serve_args"), host.get("env"), version_output=host.get("version_output"),
            gpu=host.get("gpu"), driver_version=host.get("driver_version"), rank_count=int(host.get("rank_count") or 0),
            runtime=host.get("runtime"), gang=_gang_fields(host.get("gang"), host.get("nccl_version")))
    except (TypeError, ValueError, AttributeError) as exc:
        raise AnsibleFilterError(f"compat_fields: {exc}") from None


_COMPAT_INPUTS = frozenset({"model", "serve_args", "env", "version_output", "gpu", "driver_version", "rank_count", "runtime", "gang",
                            "nccl_version"})


def _gang_fields(gang: Any, nccl_version: Any) -> dict[str, Any] | None:
    """A gang's key fields with the runtime's NCCL version; None for a one-host instance (its key has neither)."""
    if not gang:
        return None
    if not isinstance(gang, Mapping):
        raise AnsibleFilterError(f"compat_fields: gang must be a mapping (gang_key_fields), got {type(gang).__name__}")
    return {**gang, "nccl_version": nccl_version or None}


def runtime_problems(reference: Any, host: Any, reference_host: str = "the class reference") -> list[str]:
    """A host's driver, vLLM, torch and CUDA build against the class reference, and its driver against the CUDA build."""
    try:
        return _compat.runtime_problems(reference, host, str(reference_host))
    except _compat.CompatError as exc:
        raise AnsibleFilterError(str(exc)) from None


def gate_violations(gpus: Any, instances: Any, launch: Any) -> list[str]:
    """The free-memory gate of the serial batches: every rank below what its start needs."""
    if not isinstance(launch, Mapping):
        raise AnsibleFilterError("gate_violations: launch must be a mapping (the class's launch record, from launch_contract)")
    try:
        return _rollout.gate_violations(gpus, instances, launch)
    except LaunchError as exc:
        raise AnsibleFilterError(f"gate_violations: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise AnsibleFilterError(f"gate_violations: a GPU or instance lacks a field, or a figure is not a number: {exc!r}") from None


def release_history(history: Any, previous: Any, current: Any, keep_previous: Any = 2) -> dict[str, list[str]]:
    """The engine releases a host keeps after switching to ``current`` (and those it removes)."""
    try:
        return _releases.release_history(history, previous, current, keep_previous)
    except _releases.ReleaseError as exc:
        raise AnsibleFilterError(f"release_history: {exc}") from None


class FilterModule:
    """gpufleet.vllm rollout filters."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {
            "class_rollback_hosts": class_rollback_hosts,
            "failure_message": failure_message,
            "class_settings_problems": class_settings_problems,
            "compat_fields": compat_fields,
            "gate_violations": gate_violations,
            "metrics_targets": metrics_targets,
            "release_history": release_history,
            "rollback_summary": rollback_summary,
            "rollout_batches": rollout_batches,
            "rollout_plan": rollout_plan,
            "rollout_plan_drift": rollout_plan_drift,
            "run_settings": run_settings,
            "runtime_problems": runtime_problems,
        }

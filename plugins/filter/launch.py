# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters: cuda_visible_devices, launch_contract, launch_plan_file, launch_runs, launch_serve_args (documentation in the YAML files beside this one).

Each is one call into ``module_utils/_plan/_launch`` or ``_serve_argv``: the launch contract's
rules live there, not here."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import EngineSpecError, budget_args
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import (
    LaunchError,
    check_launch,
    cuda_visible_devices as _cuda_visible_devices,
    for_host,
    plan_file,
    runs,
)


def cuda_visible_devices(gpus: Any, host_gpus: Any = None, field: Any = "gpus") -> str:
    """An instance's GPU indices and the host's probed GPUs -> the engine's CUDA_VISIBLE_DEVICES (UUIDs when all are known)."""
    name = field if isinstance(field, str) and field else "gpus"
    if not isinstance(gpus, (list, tuple)) or not gpus:
        raise AnsibleFilterError(f"cuda_visible_devices: {name}: expected the instance's GPU indices (a non-empty list)")
    try:
        return _cuda_visible_devices(gpus, host_gpus)
    except (TypeError, ValueError):
        raise AnsibleFilterError(f"cuda_visible_devices: {name}: GPU indices must be integers, got {list(gpus)!r}") from None


def launch_contract(plan: Any, default_utilization: Any = 0.9, field: Any = "vllm_service_plan", gang: Any = None,
                    gang_field: Any = "vllm_service_gang_launch") -> dict[str, Any]:
    """kv_plan's result (or a plan written by hand) -> the checked launch record an instance starts with; on a
    member of a gang (``gang``: its launches), with the floors of its own ranks."""
    try:
        return for_host(plan, default_utilization, field if isinstance(field, str) and field else "plan", gang,
                        gang_field if isinstance(gang_field, str) and gang_field else "gang")
    except LaunchError as exc:
        raise AnsibleFilterError(f"launch_contract: {exc}") from None


def launch_plan_file(launch: Any, instance: Any, host: Any) -> dict[str, Any]:
    """A launch record, an instance (name, gpus, port) and the host's facts -> the instance's plan file."""
    if not isinstance(instance, Mapping) or not isinstance(host, Mapping):
        raise AnsibleFilterError("launch_plan_file: expected an instance {name, gpus, port} and a mapping of host facts")
    try:
        return plan_file(launch, instance, host_class=host.get("host_class") or None, key_hash=host.get("compat_key_hash") or None,
                         model=str(host["model"]), max_model_len=int(host.get("max_model_len") or 0), planned_at=str(host["planned_at"]),
                         gate_policy=host.get("gate_policy"), gate_state_dir=host.get("gate_state_dir"), host_gpus=host.get("gpus"),
                         gate_gpu_health=host.get("gate_gpu_health") or None, gate_xid_wait_ms=int(host.get("gate_xid_wait_ms") or 0))
    except KeyError as exc:
        raise AnsibleFilterError(f"launch_plan_file: {exc.args[0]} is missing") from None
    except (LaunchError, TypeError, ValueError) as exc:
        raise AnsibleFilterError(f"launch_plan_file: {exc}") from None


def launch_runs(plan_file_doc: Any, launch: Any, key_hash: Any) -> bool:
    """A host's plan file (any format, ``{}`` for none), a launch record and a key hash -> whether the host runs that record."""
    if not isinstance(launch, Mapping):
        raise AnsibleFilterError("launch_runs: launch must be a mapping (a launch record)")
    return runs(plan_file_doc, launch, str(key_hash) if key_hash else None)


def launch_serve_args(launch: Any) -> list[str]:
    """A launch record -> its ``vllm serve`` budget options (the byte budget, the startup utilization)."""
    try:
        record = check_launch(launch)
        return budget_args(record["kv_cache_memory_bytes"], record["gpu_memory_utilization"])
    except (LaunchError, EngineSpecError) as exc:
        raise AnsibleFilterError(f"launch_serve_args: {exc}") from None


class FilterModule:
    """gpufleet.vllm launch contract filters."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {
            "cuda_visible_devices": cuda_visible_devices,
            "launch_contract": launch_contract,
            "launch_plan_file": launch_plan_file,
            "launch_runs": launch_runs,
            "launch_serve_args": launch_serve_args,
        }

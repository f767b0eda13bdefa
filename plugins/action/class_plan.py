# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin for gpufleet.vllm.class_plan: what a class's planning decides before any host is touched."""

from __future__ import annotations

from typing import Any

from ansible.plugins.action import ActionBase

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import EngineSpecError
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._compat import CompatError
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._class_plan import ClassPlanError, prepare_class
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan_inputs import PlanError
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._profile_store import ProfileStore, ProfileStoreError
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._rollout import RolloutError

# The options of gpufleet.vllm.class_plan (plugins/modules/class_plan.py documents them).
ARGUMENT_SPEC: dict[str, Any] = {
    "host_class": {"type": "str", "required": True},
    "store": {"type": "path", "required": True},
    "compat": {"type": "dict", "required": True},
    "hosts": {"type": "list", "elements": "str", "required": True},
    "snapshots": {"type": "dict", "required": True},
    "canary_host": {"type": "str", "required": True},
    "canary_instance": {"type": "str", "required": True},
    "canary_chosen": {"type": "bool", "default": False},
    "approved_plan": {"type": "dict"},
    "force_profile": {"type": "bool", "default": False},
    "run_canaries": {"type": "bool", "default": True},
    "serial": {"type": "raw"},
    "max_unavailable": {"type": "raw"},
    "boot_timeout": {"type": "raw", "default": 0},
    "enforce_eager": {"type": "raw", "default": False},
    "drain": {"type": "bool", "default": False},
    "gangs": {"type": "list", "elements": "list", "default": []},
}

_ERRORS = (ClassPlanError, CompatError, EngineSpecError, PlanError, ProfileStoreError, RolloutError)


class ActionModule(ActionBase):  # type: ignore[misc]  # ActionBase is Any: ansible-core ships no type information
    """One call per class: the reference lookup, the canary decision, an approved plan's drift, the outline's inputs."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)
    _requires_connection = False

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result: dict[str, Any] = super().run(tmp, task_vars)
        del tmp
        _validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        host_class = args["host_class"]
        try:
            prepared = prepare_class(
                ProfileStore(args["store"]), host_class, args["compat"], hosts=args["hosts"], snapshots=args["snapshots"],
                canary_host=args["canary_host"], canary_instance=args["canary_instance"], canary_chosen=args["canary_chosen"],
                approved_plan=args["approved_plan"], force_profile=args["force_profile"], run_canaries=args["run_canaries"],
                serial=args["serial"], max_unavailable=args["max_unavailable"], boot_timeout=args["boot_timeout"],
                enforce_eager=args["enforce_eager"], drain=args["drain"], gangs=args["gangs"])
        except _ERRORS as exc:
            result.update(failed=True, msg=f"class_plan ({host_class}): {exc}")
            return result
        result.update(prepared.as_dict())
        result["changed"] = False
        corrupt = prepared.reference.get("corrupt") or []
        if corrupt:
            result["warnings"] = [f"unreadable profile skipped: {c['error']}" for c in corrupt]
        need = prepared.canary
        result["msg"] = (f"class {host_class}: key {prepared.key_hash}, reference {prepared.reference['status']}; "
                         + ("refused: " + "; ".join(prepared.refusal) if prepared.refusal
                            else f"a profiled canary runs first: {need.why}" if need.profiled and need.plan_now
                            else need.dry_run_stop or "no profiled canary needed")
                         + (f"; the approved plan no longer holds: {'; '.join(prepared.plan_moved)}" if prepared.plan_moved else ""))
        return result

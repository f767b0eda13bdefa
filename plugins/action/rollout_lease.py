# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin for gpufleet.vllm.rollout_lease: one run at a time per host class, and per host."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

from ansible_collections.gpufleet.vllm.plugins.module_utils import _lease


class ActionModule(ActionBase):  # type: ignore[misc]  # ActionBase is Any: ansible-core ships no type information
    """Class leases in the profile store, here on the controller; a host's lease on that host, by the module."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(_lease.ARGUMENT_SPEC)

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = super().run(tmp, task_vars or {})
        del tmp
        _validation, args = self.validate_argument_spec(argument_spec=_lease.ARGUMENT_SPEC, **_lease.ARGUMENT_RULES)
        try:
            if args["host_dir"]:
                got = self._on_host(args, task_vars or {})
            else:
                got = _lease.apply(args["store"], args["classes"], args, check_mode=bool(self._task.check_mode))
        except _lease.LeaseError as exc:
            raise AnsibleActionFail(f"rollout_lease: {exc}") from None
        for entry in list(got.get("taken_over") or []) + list(got.get("held_by") or []):
            self._display.warning(entry["msg"])
        result.update(got)
        return result

    def _on_host(self, args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        """The host's lease, taken by the module on the host; it names this controller and this run's store.

        A host held by a run of this store that no longer holds its class lease (it ended without
        reaching the host, or was taken over) is taken over: a second call names that run superseded.
        """
        store = args["store"]
        own = _lease.store_id(store) if store else None
        module_args = {k: v for k, v in self._task.args.items() if k != "store"}
        module_args.update(controller=args["controller"] or _lease.controller_process(), owner=args["owner"] or _lease.default_owner(),
                           details=dict(args["details"], **({"store_id": own} if own else {})))
        got: dict[str, Any] = self._execute_module(module_name="gpufleet.vllm.rollout_lease", module_args=module_args, task_vars=task_vars)
        holder = got.get("holder")
        if (got.get("failed") and own and store and args["state"] == "present" and isinstance(holder, dict)
                and _lease.run_ended(store, holder, own)):
            module_args["superseded"] = [*args["superseded"], str(holder.get("run_id"))]
            got = self._execute_module(module_name="gpufleet.vllm.rollout_lease", module_args=module_args, task_vars=task_vars)
        if got.get("failed"):
            got["msg"] = f"rollout_lease: {got.get('msg', 'the host lease failed')}"
        return got

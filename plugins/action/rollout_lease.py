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
        if args["host_dir"]:
            # the module takes the host's lease on the host; the lease names this controller, as a class lease does
            module_args = dict(self._task.args, controller=args["controller"] or _lease.controller_process(),
                               owner=args["owner"] or _lease.default_owner())
            got = self._execute_module(module_name="gpufleet.vllm.rollout_lease", module_args=module_args,
                                       task_vars=task_vars or {})
        else:
            try:
                got = _lease.apply(args["store"], args["classes"], args, check_mode=bool(self._task.check_mode))
            except _lease.LeaseError as exc:
                raise AnsibleActionFail(f"rollout_lease: {exc}") from None
        for entry in list(got.get("taken_over") or []) + list(got.get("held_by") or []):
            self._display.warning(entry["msg"])
        result.update(got)
        return result

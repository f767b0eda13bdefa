# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin for gpufleet.vllm.rollout_lease: one controller at a time per host class."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _lease

ARGUMENT_SPEC: dict[str, Any] = {
    "state": {"type": "str", "default": "present", "choices": ["present", "renewed", "absent"]},
    "store": {"type": "path", "required": True},
    "classes": {"type": "list", "elements": "str", "required": True},
    "run_id": {"type": "str", "required": True},
    "ttl": {"type": "int", "default": 7200},
    "wait": {"type": "int", "default": 0},
    "purpose": {"type": "str", "default": "rollout"},
    "details": {"type": "dict", "default": {}},
}


class ActionModule(ActionBase):  # type: ignore[misc]  # ActionBase is Any: ansible-core ships no type information
    """Take, renew or release the leases of host classes in the profile store."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)
    _requires_connection = False

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = super().run(tmp, task_vars or {})
        del tmp
        _validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        try:
            ttl, wait = _lease.check_inputs(args["ttl"], args["wait"])
            classes = sorted(set(args["classes"]))  # name order: overlapping runs never hold one each
            for scope in classes:
                _lease.lease_path(args["store"], scope)
            if not args["run_id"].strip() or any(not c.isprintable() for c in args["run_id"]):
                raise _lease.LeaseError("run_id: expected printable text")
            details = {str(k): v for k, v in args["details"].items() if isinstance(v, (str, int, float, bool)) and v != ""}
            if self._task.check_mode:
                return self._check_mode(result, args, classes)
            if args["state"] == "absent":
                released = [c for c in classes if _lease.release(args["store"], c, args["run_id"])["released"]]
                result.update(changed=bool(released), released=released, leases=[], taken_over=[])
                return result
            if args["state"] == "renewed":
                leases = [_lease.renew(args["store"], c, args["run_id"], ttl)["lease"] for c in classes]
                result.update(changed=True, leases=leases, taken_over=[], released=[])
                return result
            return self._acquire(result, args, classes, ttl, wait, details)
        except _lease.LeaseError as exc:
            raise AnsibleActionFail(f"rollout_lease: {exc}") from None

    def _acquire(self, result: dict[str, Any], args: dict[str, Any], classes: list[str], ttl: int, wait: int,
                 details: dict[str, Any]) -> dict[str, Any]:
        taken: list[dict[str, Any]] = []
        leases: list[dict[str, Any]] = []
        try:
            for scope in classes:
                got = _lease.acquire(args["store"], scope, args["run_id"], ttl, wait=wait, purpose=args["purpose"], details=details)
                leases.append(got["lease"])
                if got["taken_over"] is not None:
                    taken.append({"scope": scope, "holder": got["taken_over"],
                                  "msg": f"host class {scope}: took over the lease of {_lease.describe(got['taken_over'])} "
                                         + ("(its controller no longer runs on this machine)" if _lease.holder_gone(got["taken_over"])
                                            else "(expired: its controller stopped without releasing it)")})
        except _lease.LeaseError:
            for lease in leases:  # all or none
                _lease.release(args["store"], lease["scope"], args["run_id"])
            raise
        for entry in taken:
            self._display.warning(entry["msg"])
        result.update(changed=True, leases=leases, taken_over=taken, released=[])
        return result

    def _check_mode(self, result: dict[str, Any], args: dict[str, Any], classes: list[str]) -> dict[str, Any]:
        for scope in classes:
            held = _lease.read(_lease.lease_path(args["store"], scope))
            if held is not None and held.get("run_id") != args["run_id"]:
                self._display.warning(f"host class {scope} is being changed by {_lease.describe(held)}")
        result.update(changed=args["state"] != "absent", leases=[], taken_over=[], released=[],
                      msg="check mode: no lease taken, renewed or released")
        return result

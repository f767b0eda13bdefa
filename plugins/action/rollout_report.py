# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin for gpufleet.vllm.rollout_report: write a run report directory on the controller."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _gangs
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._report import KINDS, ReportError, build_report, class_artifacts, run_data
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._report_render import summary_line, write_run_dir

ARGUMENT_SPEC: dict[str, Any] = {
    "report_dir": {"type": "path"},
    "kind": {"type": "str", "default": "rollout", "choices": list(KINDS)},
    "data": {"type": "dict"},
    "hosts_from": {"type": "str", "default": "gpufleet_rollout"},
}


def _gangs_of(hostvars: Any, inventory: list[str], hosts: list[str]) -> list[dict[str, Any]]:
    """The instances over several of ``hosts`` (gangs), for the report's gang entries. A run stopped by a gang the
    inventory gets wrong named it already (plays/validate.yml): its report lists no gang rather than failing too.
    The inventory's hosts are read as a plain mapping: outside a template, Ansible's hostvars cannot answer for a
    host it does not know (a gang that names one)."""
    known = {str(h): hostvars[h] for h in inventory if h in hostvars}
    try:
        return _gangs.described(known, hosts)
    except ValueError:  # GangError
        return []


class ActionModule(ActionBase):  # type: ignore[misc]  # ActionBase is Any: ansible-core ships no type information
    """Build the run report, write report.json/.md/.html into a new run directory."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)
    _requires_connection = False

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result: dict[str, Any] = super().run(tmp, task_vars)
        del tmp
        _validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        if args["data"] is not None:
            data = dict(args["data"])
            audited = data.get("audit", {}).get("hosts") if isinstance(data.get("audit"), Mapping) else None
            if "gangs" not in data and isinstance(audited, Mapping):
                # an audit judges each member's ranks; the report judges its gangs from them
                data["gangs"] = _gangs_of(task_vars.get("hostvars") or {}, list((task_vars.get("groups") or {}).get("all") or []),
                                          [str(h) for h in audited])
        else:
            # a run that failed before it grouped its hosts has no group yet: a report of no host
            hostvars = task_vars.get("hostvars") or {}
            raw = getattr(hostvars, "raw_get", None)
            data = run_data(hostvars, task_vars.get("groups") or {}, args["hosts_from"], raw_vars=raw)
            data["gangs"] = _gangs_of(hostvars, list((task_vars.get("groups") or {}).get("all") or []), list(data["hosts"]))
        # A dry run is recorded as one: ansible_check_mode stays true under a task's check_mode: false.
        data.setdefault("check_mode", bool(task_vars.get("ansible_check_mode", False)))
        try:
            report = build_report(data, args["kind"])
        except ReportError as exc:
            raise AnsibleActionFail(f"rollout_report ({args['kind']}): {exc}") from None
        result.update(
            report=report,
            summary=summary_line(report),
            failed_hosts=report["failed_hosts"],
            classes=class_artifacts(report),
            path=None,
            changed=False,
        )
        if not args.get("report_dir"):
            result["msg"] = f"{result['summary']} (no report_dir: nothing written)"
            return result
        if self._task.check_mode:
            result["msg"] = f"{result['summary']} (check mode: nothing written to {args['report_dir']})"
            return result
        try:
            path = write_run_dir(args["report_dir"], report)
        except (ReportError, OSError) as exc:
            raise AnsibleActionFail(f"rollout_report: cannot write the report under {args['report_dir']}: {exc}") from None
        result.update(path=path, changed=True, msg=f"{result['summary']}; report: {path}/report.html")
        return result

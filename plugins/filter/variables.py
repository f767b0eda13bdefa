# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters: unknown_variables, host_pattern (documentation in the YAML files beside this one)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ansible.errors import AnsibleFilterError
from ansible.utils.display import Display

from ansible_collections.gpufleet.vllm.plugins.module_utils import _validate
from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _variables

_display = Display()


def unknown_variables(hostvars: Any, hosts: Any) -> list[dict[str, Any]]:
    """The variables of ``hosts`` with a gpufleet.vllm prefix that the collection does not read.

    One warning per set of such variables names them, the nearest known name of each and the
    hosts that have them; a host whose ``gpufleet_strict_variables`` is true makes it an error.
    """
    if not isinstance(hostvars, Mapping) or isinstance(hosts, str) or not isinstance(hosts, Sequence):
        raise AnsibleFilterError("unknown_variables: expected hostvars | gpufleet.vllm.unknown_variables(list of hosts)")
    known = _variables.known_names()
    per_host: dict[str, list[dict[str, Any]]] = {}
    strict: dict[str, bool] = {}
    for host in hosts:
        hv = hostvars.get(host) or {}
        per_host[str(host)] = _variables.unknown(list(hv.keys()), known)
        try:
            strict[str(host)] = _validate.boolean(hv.get("gpufleet_strict_variables", False), "gpufleet_strict_variables")
        except _validate.ValidationError as exc:
            raise AnsibleFilterError(f"unknown_variables: {host}: {exc}") from None
    warnings, errors = _variables.report(per_host, strict)
    for sentence in warnings:
        _display.warning(sentence)
    if errors:
        raise AnsibleFilterError("; ".join(errors))
    return [dict(entry, host=host) for host, entries in per_host.items() for entry in entries]


def host_pattern(value: Any, field: Any = "gpufleet_target") -> str:
    """A playbook's host pattern (``gpufleet_target``, ``gpufleet_rollback_hosts``), checked: a non-empty text
    without control characters. The first play of every playbook names itself with it: see the YAML file."""
    if not isinstance(field, str) or not field:
        raise AnsibleFilterError("host_pattern: field must name the variable")
    try:
        return _validate.text(value, field)
    except _validate.ValidationError as exc:
        raise AnsibleFilterError(f"host_pattern: {exc}") from None


class FilterModule:
    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"host_pattern": host_pattern, "unknown_variables": unknown_variables}

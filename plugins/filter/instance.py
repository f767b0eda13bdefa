# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters: unit_name (documentation in the YAML file beside this one).

One call into ``module_utils/_units/_instance``, the one home of an instance's names."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.module_utils._units._instance import unit_name as _unit_name
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError, instance_name


def unit_name(instance: Any, field: Any = "instance name") -> str:
    """An instance name, or an instance mapping with ``name`` -> its systemd unit ``vllm-NAME.service``."""
    where = field if isinstance(field, str) and field else "instance name"
    name = instance.get("name") if isinstance(instance, Mapping) else instance
    if isinstance(instance, Mapping):
        where = f"{where}.name"
    try:
        return _unit_name(instance_name(name, where))
    except ValidationError as exc:
        raise AnsibleFilterError(f"unit_name: {exc}") from None


class FilterModule:
    """gpufleet.vllm instance filters."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"unit_name": unit_name}

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filters: class_canary (documentation in the YAML file beside this one).

One call into ``plugin_utils/_class_plan``, where the class's planning decisions live."""

from __future__ import annotations

from typing import Any, Callable

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.plugin_utils._class_plan import ClassPlanError, canary_need


def class_canary(query: Any, host_class: Any, force_profile: Any = False, run_canaries: Any = True) -> dict[str, Any]:
    """A class's reference lookup and the run's settings -> whether it needs a profiled canary, and why."""
    if not isinstance(host_class, str) or not host_class:
        raise AnsibleFilterError("class_canary: host_class must be the class name")
    try:
        return canary_need(query, host_class, force_profile=bool(force_profile), run_canaries=bool(run_canaries)).as_dict()
    except ClassPlanError as exc:
        raise AnsibleFilterError(f"class_canary: {exc}") from None


class FilterModule:
    """gpufleet.vllm class planning filters."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"class_canary": class_canary}

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Filter: first_run_outline (documentation in the YAML file beside this one)."""

from __future__ import annotations

from typing import Any, Callable

from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _first_run


def first_run_outline(spec: Any) -> dict[str, Any]:
    """What a rollout of one class will do: canary host, instances that stop and for how long, units written."""
    try:
        out = _first_run.outline(spec)
    except _first_run.FirstRunError as exc:
        raise AnsibleFilterError(f"first_run_outline: {exc}") from None
    out["lines"] = _first_run.outline_lines(out)
    return out


class FilterModule:
    """gpufleet.vllm first-run outline filter."""

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {"first_run_outline": first_run_outline}

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The kv_plan role's kv_plan_deployable is the planner's rule (kv_plan's deployable), with the role's policies.

The role's task arguments are templated by Ansible's own templar with the role's defaults and
given to the kv_plan action; the fact the role keeps is read back from that result.
"""

from __future__ import annotations

import pathlib
import typing as t
from unittest.mock import MagicMock

import pytest
import yaml
from ansible.errors import AnsibleValueOmittedError
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from ansible_collections.gpufleet.vllm.plugins.action.kv_plan import ActionModule as KvPlan

ROOT = pathlib.Path(__file__).resolve().parents[3]
ROLE = ROOT / "roles" / "kv_plan"
TASKS = yaml.safe_load((ROLE / "tasks" / "main.yml").read_text(encoding="utf-8"))
DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text(encoding="utf-8"))
GIB = 1024**3
REFERENCE = {"ranks": [{"rank": 0, "free_bytes": 42 * GIB, "kv_bytes": 30 * GIB}], "total_bytes": 141 * GIB, "bytes_per_block": 2097152,
             "vllm_version": "0.32.0"}
OMITTED = object()


def task(prefix: str) -> dict[str, t.Any]:
    return next(x for x in TASKS if str(x.get("name", "")).startswith(prefix))


def render(value: str, variables: dict[str, t.Any]) -> t.Any:
    try:
        return Templar(loader=DataLoader(), variables=variables).template(trust_as_template(value))
    except AnsibleValueOmittedError:
        return OMITTED


def role_plan(**over: t.Any) -> tuple[dict[str, t.Any], t.Any]:
    variables = dict(DEFAULTS, kv_plan_host_class="h200", kv_plan_reference=REFERENCE, kv_plan_hosts_from="h200",
                     groups={"h200": ["a", "b"]},
                     hostvars={"a": {"gpufleet_gpus": [{"index": 0, "free_bytes": 42 * GIB}]},
                               "b": {"gpufleet_gpus": [{"index": 0, "free_bytes": 42 * GIB}]}},
                     **over)
    args = {k: render(v, variables) if isinstance(v, str) else v for k, v in task("Plan class")["gpufleet.vllm.kv_plan"].items()}
    plugin_task = MagicMock()
    plugin_task.args = {k: v for k, v in args.items() if v is not OMITTED}
    plugin_task.async_val = 0
    plugin_task.check_mode = False
    plugin = KvPlan(plugin_task, MagicMock(), MagicMock(check_mode=False), MagicMock(), MagicMock(), MagicMock())
    result = plugin.run(task_vars=variables)
    assert not result.get("failed"), result
    keep = task("Keep the plan of class")["ansible.builtin.set_fact"]["kv_plan_deployable"]
    return result, render(keep, dict(variables, __kv_plan_run=result))


@pytest.mark.parametrize(
    "over, deployable",
    [
        ({}, True),
        # the role requires the admission plan by default: a shortfall is not deployable
        ({"kv_plan_admission": {"tokens": 300_000}}, False),
        ({"kv_plan_admission": {"tokens": 300_000}, "kv_plan_require_admission": "false"}, True),
    ],
)
def test_role_fact_is_the_planners_deployable(over, deployable):
    result, fact = role_plan(**over)
    assert result["deployable"] is deployable
    assert fact is deployable

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What an instance is called on a host: its systemd unit and the files named after it.

The one home of the names every part of the collection uses for an instance ``NAME``:
the unit ``vllm-NAME.service`` (modules, the boot gate, the audit, the report and, through
the ``gpufleet.vllm.unit_name`` filter, the playbooks and roles), its secret environment
file ``vllm-NAME.env`` and its plan record ``NAME.plan.json``. Plain Python, no Ansible import.
"""
from __future__ import annotations

import typing as t

__all__ = ["UNIT_PREFIX", "UNIT_SUFFIX", "env_file_name", "instance_of_unit", "plan_file_name", "unit_name", "unit_names"]

UNIT_PREFIX = "vllm-"
UNIT_SUFFIX = ".service"


def unit_name(name: str) -> str:
    """``vllm-NAME.service``, the systemd unit of instance ``name``."""
    return f"{UNIT_PREFIX}{name}{UNIT_SUFFIX}"


def unit_names(names: t.Iterable[str]) -> list[str]:
    """The units of several instances, in their order."""
    return [unit_name(n) for n in names]


def instance_of_unit(unit: str) -> str | None:
    """The instance a ``vllm-NAME.service`` unit runs, or None for any other unit."""
    if unit.startswith(UNIT_PREFIX) and unit.endswith(UNIT_SUFFIX) and len(unit) > len(UNIT_PREFIX) + len(UNIT_SUFFIX):
        return unit[len(UNIT_PREFIX):-len(UNIT_SUFFIX)]
    return None


def env_file_name(name: str) -> str:
    """``vllm-NAME.env``, the instance's secret environment file in the state directory."""
    return f"{UNIT_PREFIX}{name}.env"


def plan_file_name(name: str) -> str:
    """``NAME.plan.json``, the plan record of the instance in the state directory."""
    return f"{name}.plan.json"

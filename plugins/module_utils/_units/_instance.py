# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What an instance is called on a host: its systemd unit and the files named after it.

The one home of the names every part of the collection uses for an instance ``NAME``:
the unit ``vllm-NAME.service`` (modules, the boot gate, the audit, the report and, through
the ``gpufleet.vllm.unit_name`` filter, the playbooks and roles), its secret environment
file ``vllm-NAME.env`` and its plan record ``NAME.plan.json``. Plain Python, no Ansible import.

Also the rules the instances of one host keep between them (:func:`clashes`): names unique,
ports unique, no GPU listed twice by an instance nor used by two instances.
"""
from __future__ import annotations

import typing as t

__all__ = ["UNIT_PREFIX", "UNIT_SUFFIX", "Clash", "clashes", "env_file_name", "instance_of_unit", "plan_file_name", "unit_name", "unit_names"]

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


class Clash(t.NamedTuple):
    """One break of the rules the instances of a host keep between them (:func:`clashes`).

    ``rule``: ``name`` or ``port`` (an earlier instance has the same one), ``gpu_twice`` (the
    instance lists the GPU again), ``gpu_shared`` (an earlier instance uses the GPU);
    ``position``: the instance's position in the list; ``value``: the name, port or GPU index;
    ``other``: the position of the instance it clashes with (its own for ``gpu_twice``);
    ``rank``: for a GPU, its position in the instance's ``gpus``.
    """

    rule: str
    position: int
    value: t.Any
    other: int
    rank: int | None = None


def _gpu_index(value: t.Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def clashes(instances: t.Sequence[t.Any]) -> list[Clash]:
    """Where the instances of one host break their rules, in list order (per instance: name,
    port, then its GPUs in order): instance names are unique on a host, so are ports, and a GPU
    belongs to one instance (sharing one, each would get the whole plan's budget), listed once.

    ``instances``: ``{name, port, gpus}`` as given (a part left out or unusable, a name that is
    not text, a port that is not an integer, a GPU that is not a number, is not compared; the
    callers refuse those on their own). Each caller words its errors from these, naming its field.
    """
    out: list[Clash] = []
    names: dict[str, int] = {}
    ports: dict[int, int] = {}
    owner: dict[int, int] = {}
    for pos, inst in enumerate(instances):
        if not isinstance(inst, t.Mapping):
            continue
        name, port, gpus = inst.get("name"), inst.get("port"), inst.get("gpus")
        if isinstance(name, str):
            if name in names:
                out.append(Clash("name", pos, name, names[name]))
            names.setdefault(name, pos)
        if isinstance(port, int) and not isinstance(port, bool):
            if port in ports:
                out.append(Clash("port", pos, port, ports[port]))
            ports.setdefault(port, pos)
        seen: set[int] = set()
        for rank, raw in enumerate(gpus if isinstance(gpus, (list, tuple)) else ()):
            index = _gpu_index(raw)
            if index is None:
                continue
            if index in seen:
                out.append(Clash("gpu_twice", pos, index, pos, rank))
                continue
            seen.add(index)
            if owner.setdefault(index, pos) != pos:
                out.append(Clash("gpu_shared", pos, index, owner[index], rank))
    return out

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Find a task of a playbook or role by what it does, not by its display name.

A test that looks a task up by its name breaks when the task is renamed, and a name says
nothing the test relies on. These find the one task that runs a module, sets a fact or
includes a file, through blocks, rescues and always sections; none or several is an error
naming what was looked for.
"""

from __future__ import annotations

import typing as t

Task = t.Dict[str, t.Any]
INCLUDES = ("ansible.builtin.include_tasks", "ansible.builtin.import_tasks")


def tasks_in(tasks: t.Iterable[Task]) -> list[Task]:
    """Every task, those inside blocks, rescues and always sections too, in file order."""
    out: list[Task] = []
    for task in tasks:
        out.append(task)
        for key in ("block", "rescue", "always"):
            out.extend(tasks_in(task.get(key) or []))
    return out


def plays_tasks(plays: t.Iterable[t.Mapping[str, t.Any]]) -> list[Task]:
    """The tasks of every play of a playbook file, in order."""
    return [task for play in plays for task in play.get("tasks", [])]


def only(tasks: t.Iterable[Task], what: str, matches: t.Callable[[Task], bool]) -> Task:
    """The one task that ``matches``; ``what`` names it in the error."""
    found = [task for task in tasks_in(tasks) if matches(task)]
    if len(found) != 1:
        raise LookupError(f"expected one task that {what}, found {len(found)}: {[task.get('name') for task in found]}")
    return found[0]


def running(tasks: t.Iterable[Task], action: str) -> Task:
    """The one task that runs ``action`` (a module's or action's full name)."""
    return only(tasks, f"runs {action}", lambda task: action in task)


def setting(tasks: t.Iterable[Task], fact: str) -> Task:
    """The one ``set_fact`` task that sets ``fact``."""
    return only(tasks, f"sets {fact}", lambda task: fact in (task.get("ansible.builtin.set_fact") or {}))


def including(tasks: t.Iterable[Task], path: str) -> Task:
    """The one task that includes or imports the task file ``path``, as written in the task."""
    return only(tasks, f"includes {path}", lambda task: any(task.get(key) == path for key in INCLUDES))

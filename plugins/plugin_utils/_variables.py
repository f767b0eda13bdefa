# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The collection's variable names, and the inventory's names that none of them is (controller-only).

Ansible ignores a variable nobody reads: ``gpufleet_rollout_serail`` in an inventory changes
nothing and says nothing. The names the collection reads are every name with one of its
prefixes that its playbooks and roles mention (argument specs, defaults, tasks, templates),
read from the installed collection itself, so a new variable is known the day it is used.
A name of an inventory or of the extra vars with one of those prefixes that is not among them
is reported with the known name nearest to it.
"""

from __future__ import annotations

import difflib
import os
import re
import typing as t
from functools import lru_cache

# the prefixes of the collection's variables (the roles' and the playbooks'); internal names start with "__"
PREFIXES = ("gpufleet_", "vllm_service_", "vllm_canary_", "vllm_runtime_", "gpu_probe_", "kv_plan_")
_NAME = re.compile(r"(?<![A-Za-z0-9_])((?:" + "|".join(PREFIXES) + r")[A-Za-z0-9_]*)")
# what reads variables: the playbooks and the roles (any mention), the plugins (a name as a string literal,
# as the report reads hostvars: never a name in a docstring or an example)
_SOURCES = ("playbooks", "roles")
_SUFFIXES = (".yml", ".yaml", ".j2")
_LITERAL = re.compile(r"""(?<=["'])((?:""" + "|".join(PREFIXES) + r""")[A-Za-z0-9_]*)(?=["'])""")


def collection_root() -> str:
    """The installed collection's directory (this file is ``plugins/plugin_utils/_variables.py`` in it)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@lru_cache(maxsize=4)
def known_names(root: str | None = None) -> frozenset[str]:
    """Every name with one of :data:`PREFIXES` that the collection's playbooks and roles mention, or its plugins read."""
    base = root or collection_root()
    found: set[str] = set()
    for source in _SOURCES:
        for folder, _dirs, files in os.walk(os.path.join(base, source)):
            for name in files:
                if name.endswith(_SUFFIXES):
                    with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as fh:
                        found.update(_NAME.findall(fh.read()))
    for folder, _dirs, files in os.walk(os.path.join(base, "plugins")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as fh:
                    found.update(_LITERAL.findall(fh.read()))
    return frozenset(n.rstrip("_") for n in found if not n.endswith("_") or n.rstrip("_") in found)


def unknown(names: t.Iterable[str], known: t.Collection[str]) -> list[dict[str, str | None]]:
    """The names with a collection prefix that are not known, each with the nearest known name (or None)."""
    out = []
    ordered = sorted(known)
    for name in sorted(set(names)):
        if not isinstance(name, str) or not name.startswith(PREFIXES) or name in known:
            continue
        near = difflib.get_close_matches(name, ordered, n=1, cutoff=0.8)
        out.append({"name": name, "nearest": near[0] if near else None})
    return out


def describe(found: t.Sequence[t.Mapping[str, t.Any]], hosts: t.Sequence[str], strict: bool = False) -> str:
    """One sentence for the hosts that have the same unknown variables (a warning, or the error when strict)."""
    words = [f"{f['name']} (did you mean {f['nearest']}?)" if f.get("nearest") else str(f["name"]) for f in found]
    shown = ", ".join(hosts[:5]) + (f" and {len(hosts) - 5} more host(s)" if len(hosts) > 5 else "")
    return (f"{shown}: {len(words)} variable(s) that gpufleet.vllm does not read, so they change nothing: "
            + ", ".join(words) + (" (gpufleet_strict_variables is true)" if strict
                                  else " (gpufleet_strict_variables: true makes this an error)"))


def report(per_host: t.Mapping[str, t.Sequence[t.Mapping[str, t.Any]]], strict: t.Mapping[str, bool]) -> tuple[list[str], list[str]]:
    """(warnings, errors): one sentence per set of unknown variables, for all the hosts that have that set."""
    groups: dict[tuple[tuple[str, bool], ...], list[str]] = {}
    for host, entries in per_host.items():
        if entries:
            key = tuple((str(e["name"]), bool(strict.get(host))) for e in entries)
            groups.setdefault(key, []).append(host)
    warnings: list[str] = []
    errors: list[str] = []
    for key, hosts in groups.items():
        entries = per_host[hosts[0]]
        is_strict = key[0][1]
        (errors if is_strict else warnings).append(describe(entries, sorted(hosts), is_strict))
    return warnings, errors

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Every task file a caller includes with ``tasks_from`` has an argument spec of its own.

ansible-core validates ``include_role: tasks_from: X`` against ``argument_specs.X`` only: without
that entry nothing is checked. An entry point's options are the role variables its task files
read, each as the main spec declares it (same type and default as defaults/main.yml), plus the
variables only that entry point takes (required, no default).
"""

from __future__ import annotations

import pathlib
import re
import typing as t

import pytest
import yaml
from _role_cases import run_role_cases  # pylint: disable=import-error  # beside this file

ROOT = pathlib.Path(__file__).resolve().parents[3]
CALLER_DIRS = ("roles", "playbooks", "molecule", "tests")
INCLUDE_ROLE = {"include_role", "ansible.builtin.include_role", "import_role", "ansible.builtin.import_role"}
# Python tests that build playbooks as dicts: {"name": "gpufleet.vllm.<role>", "tasks_from": "<entry>"}
PY_INCLUDE = re.compile(r'"name":\s*"gpufleet\.vllm\.(\w+)",\s*"tasks_from":\s*"(\w+)"')
TEMPLATE = re.compile(r"lookup\('ansible\.builtin\.template',\s*'([\w./-]+)'")
INCLUDE_TASKS = re.compile(r"(?:include|import)_tasks:\s*([\w./-]+\.yml)\s*$", re.M)


def load(path: pathlib.Path) -> t.Any:
    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def _includes(node: t.Any) -> t.Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in INCLUDE_ROLE and isinstance(value, dict) and "tasks_from" in value:
                name, entry = str(value.get("name", "")), str(value["tasks_from"])
                if name.startswith("gpufleet.vllm.") and "{{" not in entry:
                    yield name.removeprefix("gpufleet.vllm."), entry.removesuffix(".yml")
            yield from _includes(value)
    elif isinstance(node, list):
        for item in node:
            yield from _includes(item)


def tasks_from_callers() -> dict[tuple[str, str], list[str]]:
    """(role, entry point) -> the files that include it with tasks_from."""
    found: dict[tuple[str, str], list[str]] = {}
    for top in CALLER_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            rel = str(path.relative_to(ROOT))
            if path.suffix in (".yml", ".yaml"):
                pairs = [pair for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) for pair in _includes(doc)]
            elif path.suffix == ".py":
                pairs = PY_INCLUDE.findall(path.read_text(encoding="utf-8"))
            else:
                continue
            for pair in pairs:
                found.setdefault(pair, []).append(rel)
    return found


CALLERS = tasks_from_callers()
SPECS = {p.parent.parent.name: load(p)["argument_specs"] for p in sorted((ROOT / "roles").glob("*/meta/argument_specs.yml"))}
ENTRY_POINTS = [(role, entry) for role, specs in SPECS.items() for entry in specs if entry != "main"]


def test_callers_are_found():
    assert ("gpu_probe", "interpreter") in CALLERS and ("vllm_runtime", "switch") in CALLERS


@pytest.mark.parametrize(("role", "entry"), sorted(CALLERS))
def test_every_tasks_from_entry_point_has_a_spec(role, entry):
    assert (ROOT / "roles" / role / "tasks" / f"{entry}.yml").is_file(), f"{role}/{entry}: no such task file"
    assert entry in SPECS.get(role, {}), (
        f"{role}: tasks_from {entry} (from {', '.join(CALLERS[role, entry])}) has no argument_specs.{entry}"
    )


@pytest.mark.parametrize(("role", "entry"), ENTRY_POINTS)
def test_entry_point_is_described(role, entry):
    spec = SPECS[role][entry]
    assert spec.get("short_description") and spec.get("description"), f"{role}/{entry}: no short_description or description"
    assert (ROOT / "roles" / role / "tasks" / f"{entry}.yml").is_file(), f"{role}: argument_specs.{entry} has no task file"


@pytest.mark.parametrize(("role", "entry"), ENTRY_POINTS)
def test_entry_point_options_match_main_and_defaults(role, entry):
    main = SPECS[role]["main"]["options"]
    defaults = load(ROOT / "roles" / role / "defaults" / "main.yml")
    for name, option in SPECS[role][entry]["options"].items():
        assert name.startswith(role + "_") and option.get("description"), f"{role}/{entry}: {name}: prefix or description"
        if name in defaults:
            assert option.get("default") == defaults[name], f"{role}/{entry}: {name}: default {option.get('default')!r} != {defaults[name]!r}"
            assert option == main[name], f"{role}/{entry}: {name} is declared otherwise than in argument_specs.main"
        else:
            assert option.get("required") and "default" not in option, (
                f"{role}/{entry}: {name} is not in defaults/main.yml, so it must be required (and have no default)"
            )


def _read_text(role: str, entry: str) -> str:
    """The entry point's task file, the role's task files it includes or imports, the role's
    templates they render, and the role variables (vars/main.yml) any of these read."""
    role_dir = ROOT / "roles" / role
    role_vars = load(role_dir / "vars" / "main.yml") if (role_dir / "vars" / "main.yml").is_file() else {}
    seen: list[str] = []
    texts: list[str] = []
    todo = [f"tasks/{entry}.yml"]
    while todo:
        name = todo.pop()
        if name in seen or not (role_dir / name).is_file():
            continue
        seen.append(name)
        texts.append((role_dir / name).read_text(encoding="utf-8"))
        todo += [f"tasks/{n}" for n in INCLUDE_TASKS.findall(texts[-1])] + [f"templates/{n}" for n in TEMPLATE.findall(texts[-1])]
        for var, value in role_vars.items():
            if f"vars/{var}" not in seen and re.search(rf"(?<!\w){var}(?!\w)", texts[-1]):
                seen.append(f"vars/{var}")
                texts.append(str(value))
                todo += [f"templates/{n}" for n in TEMPLATE.findall(texts[-1])]
    return "\n".join(texts)


@pytest.mark.parametrize(("role", "entry"), ENTRY_POINTS)
def test_entry_point_options_are_the_variables_it_reads(role, entry):
    defaults = load(ROOT / "roles" / role / "defaults" / "main.yml")
    text = _read_text(role, entry)

    def read(name: str) -> bool:
        return re.search(rf"(?<!\w){name}(?!\w)", text) is not None

    options = SPECS[role][entry]["options"]
    assert sorted(name for name in defaults if read(name)) == sorted(name for name in options if name in defaults), (
        f"{role}/{entry}: the options must be the role variables its task files read"
    )
    unread = [name for name in options if not read(name)]
    assert not unread, f"{role}/{entry}: options its task files never read: {unread}"


# Per entry point: variables that pass validation (the files then stop or finish without
# changing the host) and wrong ones, each with the variable the failure must name.
VALIDATION = {
    ("gpu_probe", "interpreter"): (
        {"gpu_probe_python": "/nonexistent/python3"},
        {"gpu_probe_install_binding": ({"gpu_probe_install_binding": "maybe"}, "is not a valid boolean")},
    ),
    ("vllm_canary", "compat"): (
        {"vllm_canary_compat": {"model": "/srv/models/m"}},
        {"vllm_canary_instance": ({"vllm_canary_instance": [0, 1]}, "unable to convert to dict")},
    ),
    ("vllm_runtime", "switch"): (
        {"vllm_runtime_switch_to": "/nonexistent/release"},
        {"vllm_runtime_switch_to": ({}, "missing required arguments"),
         "vllm_runtime_keep_previous": ({"vllm_runtime_switch_to": "/nonexistent/release", "vllm_runtime_keep_previous": "two"},
                                        "unable to convert to int")},
    ),
}


def test_validation_cases_cover_every_entry_point_of_their_roles():
    roles = {role for role, _entry in VALIDATION}
    assert sorted(VALIDATION) == sorted(pair for pair in ENTRY_POINTS if pair[0] in roles)


@pytest.mark.parametrize(("role", "entry"), sorted(VALIDATION))
def test_wrong_variables_fail_argument_spec_validation(tmp_path, role, entry):
    good, bad = VALIDATION[role, entry]
    cases = {"good": good, **{f"bad_{i}": role_vars for i, (role_vars, _reason) in enumerate(bad.values())}}
    outcome, stdout = run_role_cases(tmp_path, role, entry, cases)
    assert f"Validating arguments against arg spec '{entry}'" in stdout
    assert "Validation of arguments failed" not in outcome["good"], outcome["good"]
    for i, (name, (_role_vars, reason)) in enumerate(bad.items()):
        msg = outcome[f"bad_{i}"]
        assert "Validation of arguments failed" in msg and name in msg and reason in msg, msg

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Every role's meta/argument_specs.yml and defaults/main.yml agree."""

from __future__ import annotations

import pathlib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "meta" / "argument_specs.yml").is_file())
OWN_ROLES = {"vllm_runtime", "vllm_service", "vllm_canary", "kv_plan"}
PY_TYPES = {"str": str, "path": str, "int": int, "float": (int, float), "bool": bool, "list": list, "dict": dict}


def load(role: str, *parts: str):
    with open(ROOT / "roles" / role / pathlib.Path(*parts), encoding="utf-8") as handle:
        return yaml.safe_load(handle) or {}


def test_own_roles_have_specs():
    assert OWN_ROLES <= set(ROLES)


@pytest.mark.parametrize("role", ROLES)
def test_spec_and_defaults_list_the_same_variables(role):
    options = load(role, "meta", "argument_specs.yml")["argument_specs"]["main"]["options"]
    defaults = load(role, "defaults", "main.yml")
    assert sorted(options) == sorted(defaults), (
        f"{role}: only in argument_specs: {sorted(set(options) - set(defaults))}, "
        f"only in defaults: {sorted(set(defaults) - set(options))}"
    )


@pytest.mark.parametrize("role", ROLES)
def test_spec_defaults_equal_role_defaults(role):
    options = load(role, "meta", "argument_specs.yml")["argument_specs"]["main"]["options"]
    defaults = load(role, "defaults", "main.yml")
    for name, spec in options.items():
        assert "default" in spec, f"{role}: {name} has no default in argument_specs"
        assert spec["default"] == defaults[name], f"{role}: {name}: spec {spec['default']!r} != defaults {defaults[name]!r}"


@pytest.mark.parametrize("role", ROLES)
def test_variables_carry_the_role_prefix_and_a_description(role):
    options = load(role, "meta", "argument_specs.yml")["argument_specs"]["main"]["options"]
    for name, spec in options.items():
        assert name.startswith(role + "_"), f"{role}: {name} lacks the role prefix"
        assert spec.get("description"), f"{role}: {name} has no description"


@pytest.mark.parametrize("role", ROLES)
def test_default_values_match_declared_types(role):
    options = load(role, "meta", "argument_specs.yml")["argument_specs"]["main"]["options"]
    for name, spec in options.items():
        value, kind = spec["default"], spec.get("type", "str")
        if kind == "raw" or (isinstance(value, str) and "{{" in value):
            continue
        assert isinstance(value, PY_TYPES[kind]), f"{role}: {name} default {value!r} is not a {kind}"
        if kind == "int":
            assert not isinstance(value, bool)
        if "choices" in spec:
            assert value in spec["choices"], f"{role}: {name} default {value!r} not in {spec['choices']}"

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_service: awkward values are quoted so that systemd accepts the unit, and a control
character anywhere that reaches the unit or the environment file is refused, naming the
variable, by the role's validate tasks and by the template itself.

The units are rendered by the real ansible-playbook (tests/tools/unit_render.py); systemd
reads them back with ``systemd-analyze verify`` here and runs them in a test host in
tests/integration/test_unit_quoting.py.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))

import unit_render  # noqa: E402  pylint: disable=wrong-import-position,import-error

from ansible_collections.gpufleet.vllm.plugins.module_utils._units._unit_files import service_input_problems  # noqa: E402


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("quoting")
    exe = out / "bin" / "vllm"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    base = unit_render.hostile_case(str(exe))
    refused = {name: dict(base, **change) for name, change, _field in unit_render.injections()}
    return unit_render.render({"hostile": base}, out), out, refused, unit_render.template_errors(refused, out / "refused")


def test_hostile_values_render_and_validate(rendered):
    hostile = rendered[0]["hostile"]
    assert "validate_error" not in hostile, hostile.get("validate_error")
    assert "render_error" not in hostile


def test_hostile_unit_has_exactly_the_directives_of_a_plain_one(rendered):
    text = rendered[0]["hostile"]["unit"]
    keys = [line.split("=", 1)[0] for line in text.replace("\\\n", " ").splitlines()
            if line and not line.startswith(("#", "[", " "))]
    assert keys.count("ExecStart") == 1
    assert not [k for k in keys if k.startswith("ExecStartPre") or k.startswith("ExecStartPost")]
    assert keys.count("User") == 1 and keys.count("Group") == 1
    # one Environment= per fixed variable and per vllm_service_env entry
    assert keys.count("Environment") == 5 + len(unit_render.HOSTILE_ENV)


def test_hostile_environment_file_has_one_line_per_variable(rendered):
    env = rendered[0]["hostile"]["env"]
    lines = [line for line in env.splitlines() if line and not line.startswith("#")]
    assert [line.split("=", 1)[0] for line in lines] == sorted(unit_render.HOSTILE_SECRET_ENV)
    assert all(line.endswith('"') for line in lines)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_hostile_unit(rendered):
    units, out = rendered[0], rendered[1]
    unit = out / "vllm-q.service"
    unit.write_text(units["hostile"]["unit"])
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False)
    problems = [line for line in proc.stderr.splitlines() if unit.name in line or "Unknown" in line or "Invalid" in line]
    assert proc.returncode == 0 and not problems, proc.stderr


def test_the_hostile_case_passes_the_input_check(rendered):
    assert service_input_problems(unit_render.role_vars(unit_render.hostile_case("/opt/vllm/venv/bin/vllm"))) == []


@pytest.mark.parametrize(("case", "field"), [(c, f) for c, _change, f in unit_render.injections()])
def test_control_characters_are_refused_naming_the_field(rendered, case, field):
    _units, _out, refused, template_errors = rendered
    # the role's validate tasks (this check) stop it, naming the variable ...
    problems = service_input_problems(unit_render.role_vars(refused[case]))
    assert problems and any(field in p for p in problems), problems
    # ... and the templates refuse it even without them, naming it too
    assert template_errors[case] is not None, f"{case}: rendered without an error"
    named = field.split(":")[0]
    assert named in template_errors[case] or named.split(".")[-1] in template_errors[case], template_errors[case]


def test_units_are_ordered_after_the_configured_units(rendered):
    """vllm_service_after_units: one After= and one Wants= per unit, after the network's."""
    lines = rendered[0]["hostile"]["unit"].splitlines()
    after = [line.split("=", 1)[1] for line in lines if line.startswith("After=")]
    wants = [line.split("=", 1)[1] for line in lines if line.startswith("Wants=")]
    assert after == wants == ["network-online.target", *unit_render.HOSTILE_AFTER_UNITS], (after, wants)


@pytest.mark.parametrize("bad", ["nvidia-persistenced", "nvidia persistenced.service", "a;b.service", "x.serv1ce",
                                 "-x.service/../y", "", 5, "n" * 250 + ".service"])
def test_a_bad_ordering_unit_is_refused_naming_the_field(bad):
    case = dict(unit_render.hostile_case("/opt/vllm/venv/bin/vllm"), vllm_service_after_units=["nvidia-persistenced.service", bad])
    problems = service_input_problems(unit_render.role_vars(case))
    assert len(problems) == 1 and problems[0].startswith("vllm_service_after_units[1]: "), problems


def test_ordering_units_must_be_a_list():
    case = dict(unit_render.hostile_case("/opt/vllm/venv/bin/vllm"), vllm_service_after_units="nvidia-persistenced.service")
    assert service_input_problems(unit_render.role_vars(case)) == ["vllm_service_after_units: expected a list"]

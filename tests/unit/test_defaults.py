# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""One default per setting: every entry point agrees with plugins/module_utils/_defaults.py.

Modules and action plugins read the table; what cannot import Python (role defaults, role and
playbook argument specs, module documentation, the playbooks' ``default(...)`` filters) is read
here and compared with it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ansible_collections.gpufleet.vllm.plugins.action import kv_plan as kv_plan_action
from ansible_collections.gpufleet.vllm.plugins.module_utils import _lease
from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import DEFAULTS, MEASURED_CUDA_CONTEXT_BYTES, default
from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu import _gpu_memory
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import parse_size
from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _plan, _probe_history

REPO = Path(__file__).resolve().parents[2]
PLAYBOOK_SPEC = REPO / "playbooks" / "vars" / "rollout_argument_spec.yml"
SIZES = {"guard_bytes", "gate_margin_bytes", "budget_granularity_bytes", "keep_step_bytes", "cuda_context_bytes"}

# setting -> where it is an input: ("role", variable) the role default and every argument spec entry that lists it;
# ("action", option) the kv_plan action; ("doc", module, option path) a module's documented default;
# ("spec", variable) playbooks/vars/rollout_argument_spec.yml; ("jinja", variable) every `variable | default(...)`
# in the playbooks and roles (at least one).
PLACES: dict[str, list[tuple[str, ...]]] = {
    "guard_bytes": [("role", "kv_plan_guard"), ("action", "guard_bytes"), ("doc", "kv_plan", "guard_bytes"),
                    ("spec", "gpufleet_guard"), ("jinja", "gpufleet_guard")],
    "gate_margin_bytes": [("role", "kv_plan_gate_margin"), ("action", "gate_margin_bytes"), ("doc", "kv_plan", "gate_margin_bytes"),
                          ("spec", "gpufleet_gate_margin"), ("jinja", "gpufleet_gate_margin")],
    "budget_granularity_bytes": [("role", "kv_plan_budget_granularity"), ("action", "budget_granularity_bytes"),
                                 ("doc", "kv_plan", "budget_granularity_bytes"), ("spec", "gpufleet_budget_granularity"),
                                 ("jinja", "gpufleet_budget_granularity")],
    "keep_step_bytes": [("role", "kv_plan_keep_step"), ("action", "keep_step_bytes"), ("doc", "kv_plan", "keep_step_bytes"),
                        ("spec", "gpufleet_budget_keep_step"), ("jinja", "gpufleet_budget_keep_step")],
    "require_admission": [("role", "kv_plan_require_admission"), ("action", "require_admission"), ("doc", "kv_plan", "require_admission")],
    "split_policy": [("role", "kv_plan_split_policy"), ("action", "split_policy"), ("doc", "kv_plan", "split_policy"),
                     ("spec", "gpufleet_split_policy"), ("jinja", "gpufleet_split_policy")],
    "budget_mode": [("role", "kv_plan_budget_mode"), ("action", "budget_mode"), ("doc", "kv_plan", "budget_mode"),
                    ("spec", "gpufleet_budget_mode"), ("jinja", "gpufleet_budget_mode")],
    "fit_headroom": [("role", "kv_plan_fit_headroom"), ("action", "fit_headroom"), ("doc", "kv_plan", "fit_headroom")],
    "max_capacity_loss": [("role", "kv_plan_max_capacity_loss"), ("action", "max_capacity_loss"), ("doc", "kv_plan", "max_capacity_loss")],
    "unstable_share": [("action", "unstable_share"), ("doc", "kv_plan", "unstable_share")],
    "cuda_context_bytes": [("action", "cuda_context_bytes"), ("doc", "kv_plan", "cuda_context_bytes")],
    "probe_history_window": [("role", "kv_plan_probe_history_window"), ("doc", "kv_plan", "probe_history.window")],
    "probe_history_keep": [("role", "kv_plan_probe_history_keep"), ("doc", "kv_plan", "probe_history.keep")],
    "settle_timeout": [("spec", "gpufleet_settle_timeout"), ("jinja", "gpufleet_settle_timeout")],
    "boot_timeout": [("role", "vllm_service_boot_timeout"), ("jinja", "vllm_service_boot_timeout")],
    "canary_startup_timeout": [("role", "vllm_canary_startup_timeout")],
    "unstable_scope": [("role", "kv_plan_unstable_scope"), ("action", "unstable_scope"), ("doc", "kv_plan", "unstable_scope"),
                       ("spec", "gpufleet_unstable_scope"), ("jinja", "gpufleet_unstable_scope")],
    "probe_samples": [("role", "gpu_probe_samples"), ("doc", "gpu_memory_info", "samples"), ("doc", "gpu_memory_facts", "samples")],
    "probe_interval": [("role", "gpu_probe_interval"), ("doc", "gpu_memory_info", "interval"), ("doc", "gpu_memory_facts", "interval")],
    "executable": [("role", "vllm_canary_executable"), ("role", "vllm_service_executable"), ("doc", "vllm_runtime_info", "executable"),
                   ("jinja", "gpufleet_vllm_executable")],
    "state_dir": [("role", "vllm_canary_state_dir"), ("role", "vllm_service_state_dir"), ("doc", "vllm_audit", "state_dir"),
                  ("doc", "vllm_unit", "state_dir"), ("doc", "vllm_boot_check", "record.state_dir"), ("jinja", "vllm_service_state_dir")],
    "unit_dir": [("role", "vllm_service_unit_dir"), ("doc", "vllm_audit", "unit_dir"), ("doc", "vllm_unit", "unit_dir"),
                 ("doc", "vllm_boot_check", "record.unit_dir")],
    "service_user": [("role", "vllm_service_user"), ("doc", "vllm_host_snapshot", "model_user"), ("jinja", "vllm_service_user")],
    "nvml_binding_venv": [("role", "gpu_probe_binding_venv"), ("doc", "nvml_interpreter", "binding_venv")],
    "reprofile_after_days": [("doc", "vllm_audit", "reprofile_after_days"), ("spec", "gpufleet_reprofile_after_days"),
                             ("jinja", "gpufleet_reprofile_after_days")],
    "lease_ttl": [("doc", "rollout_lease", "ttl"), ("spec", "gpufleet_lease_ttl"), ("jinja", "gpufleet_lease_ttl")],
    "lease_wait": [("doc", "rollout_lease", "wait"), ("spec", "gpufleet_lease_wait"), ("jinja", "gpufleet_lease_wait")],
    "remote_timeout": [("spec", "gpufleet_remote_timeout"), ("jinja", "gpufleet_remote_timeout")],
}


def _same(setting: str, got: Any) -> bool:
    want = DEFAULTS[setting].value
    if setting in SIZES:
        return parse_size(got, setting) == want
    if isinstance(want, bool) or isinstance(got, bool):
        return got is want
    return bool(got == want)


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _role_values(variable: str) -> list[tuple[str, Any]]:
    role = next(r.name for r in (REPO / "roles").iterdir() if variable.startswith(r.name + "_"))
    out = [(f"roles/{role}/defaults/main.yml", _yaml(REPO / "roles" / role / "defaults" / "main.yml")[variable])]
    for entry, spec in (_yaml(REPO / "roles" / role / "meta" / "argument_specs.yml")["argument_specs"]).items():
        option = (spec.get("options") or {}).get(variable)
        if option is not None:
            assert "default" in option, f"roles/{role}/meta/argument_specs.yml {entry}: {variable} has no default"
            out.append((f"roles/{role}/meta/argument_specs.yml ({entry})", option["default"]))
    return out


def _doc_default(module: str, path: str) -> Any:
    source = (REPO / "plugins" / "modules" / f"{module}.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    doc = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "DOCUMENTATION" for t in node.targets))
    options = yaml.safe_load(doc).get("options") or {}
    parts = path.split(".")
    for fragment in yaml.safe_load(doc).get("extends_documentation_fragment") or []:
        if fragment == "gpufleet.vllm.gpu_memory" and parts[0] not in options:
            frag = ast.parse((REPO / "plugins" / "doc_fragments" / "gpu_memory.py").read_text(encoding="utf-8"))
            text = next(node.value.value for cls in frag.body if isinstance(cls, ast.ClassDef) for node in cls.body
                        if isinstance(node, ast.Assign) and node.targets[0].id == "DOCUMENTATION")  # type: ignore[attr-defined]
            options = dict(yaml.safe_load(text)["options"], **options)
    node = options[parts[0]]
    for part in parts[1:]:
        node = node["suboptions"][part]
    assert "default" in node, f"plugins/modules/{module}.py: option {path} documents no default"
    return node["default"]


def _spec_option(variable: str) -> dict[str, Any]:
    spec = _yaml(PLAYBOOK_SPEC)["gpufleet_argument_spec"]
    for section in spec.values():
        if variable in section:
            return dict(section[variable])
    raise AssertionError(f"{variable} is in no section of {PLAYBOOK_SPEC.relative_to(REPO)}")


_JINJA_DEFAULT = r"(?<![A-Za-z0-9_]){name}\s*\|\s*default\(\s*((?:'[^']*'|\"[^\"]*\"|[-0-9.]+|true|false))\s*(?:,\s*true\s*)?\)"


def _jinja_defaults(variable: str) -> list[tuple[str, Any]]:
    pattern = re.compile(_JINJA_DEFAULT.format(name=re.escape(variable)))
    out = []
    for folder in ("playbooks", "roles"):
        for path in sorted((REPO / folder).rglob("*.yml")):
            for match in pattern.finditer(path.read_text(encoding="utf-8")):
                literal = {"true": "True", "false": "False"}.get(match.group(1), match.group(1))
                out.append((str(path.relative_to(REPO)), ast.literal_eval(literal)))
    return out


def _values(setting: str, place: tuple[str, ...]) -> list[tuple[str, Any]]:
    kind = place[0]
    if kind == "role":
        return _role_values(place[1])
    if kind == "action":
        return [(f"kv_plan action {place[1]}", kv_plan_action.ARGUMENT_SPEC[place[1]]["default"])]
    if kind == "doc":
        return [(f"plugins/modules/{place[1]}.py {place[2]}", _doc_default(place[1], place[2]))]
    if kind == "spec":
        option = _spec_option(place[1])
        assert "default" in option, f"{PLAYBOOK_SPEC.relative_to(REPO)}: {place[1]} has no default"
        return [(f"{PLAYBOOK_SPEC.relative_to(REPO)} {place[1]}", option["default"])]
    found = _jinja_defaults(place[1])
    assert found, f"no `{place[1]} | default(...)` in the playbooks or roles"
    return found


@pytest.mark.parametrize("setting", sorted(PLACES))
def test_every_entry_point_has_the_tables_default(setting):
    wrong = [f"{where}: {got!r}" for place in PLACES[setting] for where, got in _values(setting, place) if not _same(setting, got)]
    assert not wrong, f"{setting}: the table says {DEFAULTS[setting].value!r}; these differ: " + "; ".join(wrong)


def test_every_setting_of_the_table_has_a_reason_and_a_place():
    assert sorted(DEFAULTS) == sorted(PLACES), "a setting of the table is checked nowhere, or a checked one is not in the table"
    assert all(d.reason and not d.reason.endswith(".") for d in DEFAULTS.values())


def test_the_python_defaults_read_the_table():
    assert {k: _plan.DEFAULTS[k] for k in ("guard_bytes", "budget_mode", "fit_headroom", "max_capacity_loss", "unstable_share",
                                           "cuda_context_bytes")} == {k: default(k) for k in ("guard_bytes", "budget_mode",
                                                                                              "fit_headroom", "max_capacity_loss",
                                                                                              "unstable_share", "cuda_context_bytes")}
    assert (default("probe_history_window"), default("probe_history_keep")) == (_probe_history.DEFAULT_WINDOW, _probe_history.DEFAULT_KEEP)
    options = kv_plan_action.ARGUMENT_SPEC["probe_history"]["options"]
    assert (options["window"]["default"], options["keep"]["default"]) == (default("probe_history_window"), default("probe_history_keep"))
    assert (_lease.ARGUMENT_SPEC["ttl"]["default"], _lease.ARGUMENT_SPEC["wait"]["default"]) == (default("lease_ttl"), default("lease_wait"))
    assert (_gpu_memory.ARGUMENT_SPEC["samples"]["default"], _gpu_memory.ARGUMENT_SPEC["interval"]["default"]) == (
        default("probe_samples"), default("probe_interval"))


def test_the_plan_function_alone_gives_the_exact_formula():
    # plan_class settles no budget unless asked: the protocol's own figures (the action and the role ask)
    assert (_plan.DEFAULTS["gate_margin_bytes"], _plan.DEFAULTS["budget_granularity_bytes"], _plan.DEFAULTS["keep_step_bytes"]) == (0, 0, 0)


def test_the_gate_margin_covers_a_monitoring_agents_cuda_context():
    # the margin, not the guard: the guard cancels out of the weakest rank's floor (F_ref - (B_ref - G - B_launch))
    f_ref, b_ref, f_boot = 42 * 1024**3, 30 * 1024**3, int(40.75 * 1024**3)
    for guard in (default("guard_bytes"), 2 * default("guard_bytes")):
        launch = b_ref - (f_ref - f_boot) - guard
        assert f_ref - (b_ref - guard - launch) == f_boot
    assert default("gate_margin_bytes") > MEASURED_CUDA_CONTEXT_BYTES


def test_the_defaults_are_copies():
    first = default("executable")
    assert first == DEFAULTS["executable"].value
    with pytest.raises(TypeError):
        DEFAULTS["executable"] = DEFAULTS["state_dir"]  # type: ignore[index]

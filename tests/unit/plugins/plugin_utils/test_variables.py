# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""_variables: the names the collection reads, and the mistyped ones of an inventory."""

from __future__ import annotations

from pathlib import Path

import yaml

from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _variables

REPO = Path(__file__).resolve().parents[4]


def test_every_documented_input_is_known():
    known = _variables.known_names(str(REPO))
    spec = yaml.safe_load((REPO / "playbooks" / "vars" / "rollout_argument_spec.yml").read_text(encoding="utf-8"))
    names = set(spec["gpufleet_argument_spec"]["run"]) | set(spec["gpufleet_argument_spec"]["host"])
    for path in (REPO / "roles").glob("*/meta/argument_specs.yml"):
        for entry in yaml.safe_load(path.read_text(encoding="utf-8"))["argument_specs"].values():
            names |= set(entry.get("options") or {})
    assert names and not sorted(names - known), sorted(names - known)
    # read by the plugins only (the planner reads a host's gpufleet_unstable)
    assert "gpufleet_unstable" in known


def test_the_shipped_inventories_name_only_variables_the_collection_reads():
    known = _variables.known_names(str(REPO))
    problems = []
    for path in sorted((REPO / "inventories").rglob("*.yml")):
        def walk(node, where):
            if isinstance(node, dict):
                for key, value in node.items():
                    if isinstance(key, str) and key.startswith(_variables.PREFIXES) and key not in known:
                        problems.append(f"{path.relative_to(REPO)}: {where}{key}")
                    if key in ("hosts", "children", "vars", "all") or not isinstance(key, str) or not key.startswith(_variables.PREFIXES):
                        walk(value, f"{where}{key}.")
        walk(yaml.safe_load(path.read_text(encoding="utf-8")), "")
    assert not problems, problems


def test_a_typo_is_named_with_the_nearest_known_name_and_hosts_that_share_it_get_one_sentence():
    known = {"gpufleet_rollout_serial", "vllm_service_boot_timeout", "gpufleet_guard"}
    per_host = {h: _variables.unknown(["gpufleet_rollout_serail", "gpufleet_guard", "ansible_host", "gpufleet_zzz"], known)
                for h in [f"gpu-{i}" for i in range(7)]}
    per_host["gpu-x"] = []
    assert per_host["gpu-0"] == [{"name": "gpufleet_rollout_serail", "nearest": "gpufleet_rollout_serial"},
                                 {"name": "gpufleet_zzz", "nearest": None}]
    warnings, errors = _variables.report(per_host, {"gpu-6": True})
    assert errors == ["gpu-6: 2 variable(s) that gpufleet.vllm does not read, so they change nothing: gpufleet_rollout_serail "
                      "(did you mean gpufleet_rollout_serial?), gpufleet_zzz (gpufleet_strict_variables is true)"]
    (warning,) = warnings
    assert warning.startswith("gpu-0, gpu-1, gpu-2, gpu-3, gpu-4 and 1 more host(s): 2 variable(s)"), warning
    assert warning.endswith("(gpufleet_strict_variables: true makes this an error)")

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The shipped inventories name controller paths that are the same in every play.

``playbook_dir`` is the directory of the playbook file that holds the play: ``playbooks`` in
``rollout.yml``'s own plays, ``playbooks/plays`` in the plays it imports (the canaries and the
planning). ``inventory_dir`` is a host's own variable: the implicit localhost has none, and
ansible-runner (AWX) copies the inventory away from the project. A path built from either
named a file in one play and another (or none) in the next: ``make demo`` stopped at both
canaries because the simulated inventory built its model configs from ``playbook_dir``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INVENTORIES = sorted(p for p in (REPO / "inventories").iterdir() if p.is_dir())
PATH_SETTINGS = ("gpufleet_profile_store", "gpufleet_report_dir", "gpufleet_model_config")
SIM_ROOT = "{{ sim_checkout }}/"


def _yaml_files(inventory: Path) -> list[Path]:
    return sorted(p for p in inventory.rglob("*") if p.suffix in (".yml", ".yaml"))


def _settings(inventory: Path) -> list[tuple[str, str, Any]]:
    """(file, setting, value) of every controller path an inventory's YAML sets."""
    found = []
    for path in _yaml_files(inventory):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for key in PATH_SETTINGS:
            if key in data:
                found.append((path.name, key, data[key]))
        for event, hook in (data.get("gpufleet_hooks") or {}).items():
            found.append((path.name, f"gpufleet_hooks.{event}", hook))
    return found


def test_there_are_inventories_to_check() -> None:
    assert {p.name for p in INVENTORIES} >= {"example", "sim"}


@pytest.mark.parametrize("inventory", INVENTORIES, ids=lambda p: p.name)
def test_no_shipped_inventory_builds_a_path_from_playbook_dir_or_inventory_dir(inventory: Path) -> None:
    offenders = []
    for path in _yaml_files(inventory):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\b(playbook_dir|inventory_dir)\b", code):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []


@pytest.mark.parametrize("inventory", INVENTORIES, ids=lambda p: p.name)
def test_every_controller_path_is_absolute_or_from_the_checkout_variable(inventory: Path) -> None:
    settings = _settings(inventory)
    assert {key for _file, key, _value in settings} >= set(PATH_SETTINGS), settings
    for name, key, value in settings:
        assert isinstance(value, str) and (value.startswith("/") or value.startswith(SIM_ROOT)), (name, key, value)
        assert "{{" not in value.replace(SIM_ROOT, "", 1), (name, key, value)
        assert inventory.name == "sim" or not value.startswith(SIM_ROOT), (name, key, value)


def test_the_sim_inventory_script_gives_every_host_the_checkout(tmp_path: Path) -> None:
    """``sim_checkout`` is a group ``all`` variable (the implicit localhost gets it too), the checkout's
    absolute path, also when no simulated host is up (the script then adds no host)."""
    script = REPO / "inventories" / "sim" / "connection.py"
    done = subprocess.run([sys.executable, str(script), "--list"], capture_output=True, text=True, timeout=60,
                          check=True, env={"PATH": "/usr/bin:/bin", "GPUFLEET_CACHE": str(tmp_path / "no-cache")})
    data = json.loads(done.stdout)
    assert data["all"]["vars"] == {"sim_checkout": str(REPO)}
    assert data["all"]["hosts"] == [] and data["_meta"]["hostvars"] == {}


def test_the_example_pins_a_vllm_release_the_collection_models() -> None:
    # a copied example that pins a release outside the modelled ones is planned with another release's rules
    from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_release import RELEASES, release_rules

    data = yaml.safe_load((REPO / "inventories" / "example" / "group_vars" / "gpufleet.yml").read_text(encoding="utf-8"))
    rules = release_rules(data["vllm_runtime_version"])
    assert rules.notes == () and rules.release in RELEASES, (data["vllm_runtime_version"], rules.notes)

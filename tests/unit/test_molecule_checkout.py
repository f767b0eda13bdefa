# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Molecule tests the checkout: never another installed copy of gpufleet.vllm.

The base molecule config pins Ansible's collections path to the checkout's link tree,
every scenario boots its hosts with ``molecule/_shared/create.yml``, and that playbook
starts by checking where Ansible resolves the collection from. The check itself is run
here against a decoy copy placed first on the collections path (every scenario's create
runs it against the checkout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
MOLECULE = REPO_ROOT / "molecule"
CHECK_TASKS = ("Ask Ansible where it loads gpufleet.vllm from", "Check that it is this checkout")


def _scenarios() -> list[Path]:
    return sorted(p.parent for p in MOLECULE.glob("*/molecule.yml"))


def test_base_config_pins_the_collections_path_to_the_checkout() -> None:
    base = yaml.safe_load((REPO_ROOT / ".config" / "molecule" / "config.yml").read_text())
    assert base["prerun"] is False
    env = base["ansible"]["env"]
    assert env["ANSIBLE_COLLECTIONS_PATH"] == "${MOLECULE_PROJECT_DIRECTORY}/.cache/collections"
    assert env["ANSIBLE_COLLECTIONS_SCAN_SYS_PATH"] == "false"


@pytest.mark.parametrize("scenario", _scenarios(), ids=lambda p: p.name)
def test_every_scenario_checks_the_checkout_and_keeps_the_base_env(scenario: Path) -> None:
    config = yaml.safe_load((scenario / "molecule.yml").read_text())
    playbooks = config["provisioner"]["playbooks"]
    assert playbooks["create"] == "../_shared/create.yml"
    # molecule replaces (does not merge) the base's ansible.env with a scenario's env.
    assert "env" not in config["provisioner"]
    assert "env" not in config.get("ansible", {})


def _check_play(repo: Path) -> list[dict[str, Any]]:
    plays = yaml.safe_load((MOLECULE / "_shared" / "create.yml").read_text())
    tasks = [t for t in plays[0]["tasks"] if t["name"] in CHECK_TASKS]
    assert [t["name"] for t in tasks] == list(CHECK_TASKS)
    play = dict(plays[0], tasks=tasks)
    play["vars"] = dict(play["vars"], gpufleet_repo=str(repo))
    return [play]


def _collections_tree(root: Path, target: Path) -> Path:
    namespace = root / "ansible_collections" / "gpufleet"
    namespace.mkdir(parents=True)
    os.symlink(target, namespace / "vllm")
    return root


def _decoy(root: Path) -> Path:
    copy = root / "copy"
    (copy / "plugins").mkdir(parents=True)
    (copy / "meta").mkdir()
    shutil.copy(REPO_ROOT / "galaxy.yml", copy)
    shutil.copy(REPO_ROOT / "meta" / "runtime.yml", copy / "meta")
    for part in ("modules", "module_utils", "doc_fragments"):
        shutil.copytree(REPO_ROOT / "plugins" / part, copy / "plugins" / part)
    return _collections_tree(root / "tree", copy)


def _run_check(tmp_path: Path, collections_path: str) -> subprocess.CompletedProcess[str]:
    playbook = tmp_path / "check.yml"
    playbook.write_text(yaml.safe_dump(_check_play(REPO_ROOT)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PYTHONPATH"))}
    env.update(ANSIBLE_COLLECTIONS_PATH=collections_path, ANSIBLE_COLLECTIONS_SCAN_SYS_PATH="false",
               ANSIBLE_LOCAL_TEMP=str(tmp_path / "ansible-tmp"), ANSIBLE_NOCOLOR="1")
    return subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", str(playbook)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )


def test_create_refuses_another_copy_first_on_the_path(tmp_path: Path) -> None:
    checkout = _collections_tree(tmp_path / "checkout", REPO_ROOT)
    decoy = _decoy(tmp_path / "decoy")
    run = _run_check(tmp_path, f"{decoy}:{checkout}")
    assert run.returncode != 0
    assert f"Ansible loads gpufleet.vllm from {(decoy / 'ansible_collections/gpufleet/vllm').resolve()}" in run.stdout
    assert f"not from the checkout {REPO_ROOT}" in run.stdout

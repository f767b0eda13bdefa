# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_service snapshot.yml and restore.yml (the file half of a rollback), run by
ansible-playbook against a unit and state directory in a temporary tree.

A rollback restores exactly what was on disk before the instances were stopped: the
unit (even when it did not change, e.g. the service had failed), the plan file and the
secret environment file; it removes only the files that did not exist then, and leaves
alone files a snapshot knows nothing about.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
BIN = pathlib.Path(sys.executable).parent

UNIT_A = "[Service]\nExecStart=/opt/vllm/venv/bin/vllm serve m --kv-cache-memory-bytes 1000\n"
PLAN_A = '{"instance": "a", "kv_cache_memory_bytes": 1000}\n'
ENV_A = 'HF_TOKEN="hf_old"\n'


@pytest.fixture()
def tree(tmp_path):
    collections = tmp_path / "collections"
    (collections / "ansible_collections" / "gpufleet").mkdir(parents=True)
    os.symlink(ROOT, collections / "ansible_collections" / "gpufleet" / "vllm")
    units, state = tmp_path / "systemd", tmp_path / "gpufleet"
    units.mkdir()
    state.mkdir()
    return {"root": tmp_path, "collections": collections, "units": units, "state": state}


def run_tasks(tree, tasks_from: str, names: list[str], **extra) -> None:
    """Run one task file of the role for the instances `names`."""
    role_vars = {
        "vllm_service_instances": [{"name": n, "gpus": [i], "port": 8000 + i} for i, n in enumerate(names)],
        "vllm_service_unit_dir": str(tree["units"]),
        "vllm_service_state_dir": str(tree["state"]),
        "vllm_service_group": "root",
    }
    role_vars.update(extra)
    play = [{
        "hosts": "localhost",
        "connection": "local",
        "gather_facts": False,
        "tasks": [{
            "name": f"Run {tasks_from}",
            "ansible.builtin.include_role": {"name": "gpufleet.vllm.vllm_service", "tasks_from": tasks_from},
            "vars": role_vars,
        }],
    }]
    playbook = tree["root"] / f"{tasks_from}.yml"
    playbook.write_text(json.dumps(play))
    binary = BIN / "ansible-playbook"
    if not binary.exists():
        binary = pathlib.Path(shutil.which("ansible-playbook") or "ansible-playbook")
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(tree["collections"]), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0")
    argv = [str(binary), "-i", "localhost,", "-e", f"ansible_python_interpreter={sys.executable}", str(playbook)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "hf_old" not in proc.stdout and "hf_new" not in proc.stdout, "a secret reached the output"


def write(path: pathlib.Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    path.chmod(mode)


def test_failed_service_with_an_unchanged_unit_keeps_its_unit_and_gets_its_env_back(tree):
    units, state = tree["units"], tree["state"]
    write(units / "vllm-a.service", UNIT_A)
    write(state / "a.plan.json", PLAN_A, 0o640)
    write(state / "vllm-a.env", ENV_A, 0o600)
    # A stale copy from an older change must not come back.
    (state / "units").mkdir(mode=0o700)
    write(state / "units" / "vllm-a.service.previous", "[Service]\nExecStart=/old\n", 0o600)

    run_tasks(tree, "snapshot", ["a"])
    kept = state / "units"
    assert (kept / "vllm-a.service.previous").read_text() == UNIT_A
    assert (kept / "a.plan.json.previous").read_text() == PLAN_A
    assert (kept / "vllm-a.env.previous").read_text() == ENV_A
    assert stat.S_IMODE((kept / "vllm-a.env.previous").stat().st_mode) == 0o600
    assert not list(kept.glob("*.absent"))

    # The run changes the environment file, rewrites the same unit, then the boot fails.
    write(state / "vllm-a.env", 'HF_TOKEN="hf_new"\n', 0o600)
    write(units / "vllm-a.service", UNIT_A)
    run_tasks(tree, "restore", ["a"], vllm_service_rollback_instances=[{"name": "a", "gpus": [0], "port": 8000}])

    assert (units / "vllm-a.service").read_text() == UNIT_A, "the live unit is kept, not removed or replaced"
    assert (state / "vllm-a.env").read_text() == ENV_A, "the environment file is restored"
    assert stat.S_IMODE((state / "vllm-a.env").stat().st_mode) == 0o600
    assert (state / "a.plan.json").read_text() == PLAN_A
    assert stat.S_IMODE((units / "vllm-a.service").stat().st_mode) == 0o644


def test_new_instance_is_removed_and_an_unknown_one_left_alone(tree):
    units, state = tree["units"], tree["state"]
    # b is new in this run; c has a unit but no snapshot (it was not part of the change).
    write(units / "vllm-c.service", UNIT_A)
    run_tasks(tree, "snapshot", ["b"])
    kept = state / "units"
    assert sorted(p.name for p in kept.iterdir()) == [
        "b.plan.json.absent", "vllm-b.env.absent", "vllm-b.service.absent"]

    write(units / "vllm-b.service", UNIT_A)
    write(state / "vllm-b.env", 'HF_TOKEN="hf_new"\n', 0o600)
    write(state / "b.plan.json", PLAN_A, 0o640)
    run_tasks(tree, "restore", ["b", "c"])

    assert not (units / "vllm-b.service").exists()
    assert not (state / "vllm-b.env").exists()
    assert not (state / "b.plan.json").exists()
    assert (units / "vllm-c.service").read_text() == UNIT_A, "no snapshot of c: its unit stays"


def test_a_later_snapshot_replaces_an_absent_marker(tree):
    units, state = tree["units"], tree["state"]
    run_tasks(tree, "snapshot", ["a"])
    assert (state / "units" / "vllm-a.service.absent").exists()
    # The first deploy succeeded; the next change snapshots the unit that now exists.
    write(units / "vllm-a.service", UNIT_A)
    write(state / "vllm-a.env", ENV_A, 0o600)
    run_tasks(tree, "snapshot", ["a"])
    assert not (state / "units" / "vllm-a.service.absent").exists()
    assert not (state / "units" / "vllm-a.env.absent").exists()
    assert (state / "units" / "a.plan.json.absent").exists(), "still no plan file"

    write(units / "vllm-a.service", "[Service]\nExecStart=/new\n")
    run_tasks(tree, "restore", ["a"])
    assert (units / "vllm-a.service").read_text() == UNIT_A
    assert (state / "vllm-a.env").read_text() == ENV_A

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A canary gang's inputs, run by ansible-playbook itself: what playbooks/vars/canary.yml gives each member from the
inventory (its launch, the gang's members leader first), and the role's refusal to start a canary gang while one of
its members is not in the play (the others would wait for it until their startup timeout).

The canary gang itself runs on the real engine in the real-engine lane (tests/integration/test_real_engine.py, step 9:
profile.yml in mode mp, the role in manual mode in mode dp)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
GANG = {"mode": "mp", "members": ["a1", "a2"], "address": "10.0.0.1", "port": 29500}


@pytest.fixture(scope="module")
def ansible(tmp_path_factory):
    out = tmp_path_factory.mktemp("gang")
    member = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, "gpufleet_host_class": "h100",
              "gpufleet_model": "/srv/models/m", "gpufleet_serve_args": {"tensor_parallel_size": 2},
              "gpufleet_instances": [{"name": "m", "gpus": [0], "port": 8000, "gang": GANG}]}
    inventory = {"all": {"children": {"gpufleet_rollout": {"hosts": {
        "a1": member, "a2": member, "solo": dict(member, gpufleet_instances=[{"name": "m", "gpus": [0, 1], "port": 8000}])}}}}}
    (out / "inventory.yml").write_text(json.dumps(inventory))
    collections = out / "collections"
    (collections / "ansible_collections" / "gpufleet").mkdir(parents=True)
    os.symlink(ROOT, collections / "ansible_collections" / "gpufleet" / "vllm")
    playbook = pathlib.Path(sys.executable).parent / "ansible-playbook"
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_NOCOLOR="1", ANSIBLE_LOCALHOST_WARNING="0")

    def run(plays: list, *args: str) -> subprocess.CompletedProcess[str]:
        (out / "play.yml").write_text(json.dumps(plays))
        argv = [str(playbook if playbook.exists() else shutil.which("ansible-playbook")), "-i", str(out / "inventory.yml"),
                str(out / "play.yml"), *args]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180, check=False)
    return out, run


def test_the_canary_inputs_give_each_member_its_rank_and_the_gang(ansible):
    out, run = ansible
    tasks = [{"name": "Keep the gang inputs", "delegate_to": "localhost", "ansible.builtin.copy": {
        "content": "{{ {'launch': vllm_canary_gang_launch, 'members': vllm_canary_gang_members} | to_json }}",
        "dest": str(out) + "/{{ inventory_hostname }}.json", "mode": "0644"}}]
    vars_files = [str(ROOT / "playbooks" / "vars" / name) for name in ("common.yml", "canary.yml")]
    proc = run([{"hosts": "gpufleet_rollout", "gather_facts": False, "vars_files": vars_files, "tasks": tasks}])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    got = {h: json.loads((out / f"{h}.json").read_text()) for h in ("a1", "a2", "solo")}
    assert got["a1"]["members"] == got["a2"]["members"] == ["a1", "a2"]
    assert (got["a1"]["launch"]["serves_api"], got["a2"]["launch"]["serves_api"]) == (True, False)
    assert got["a2"]["launch"]["leader"] == "a1" and "--headless" in got["a2"]["launch"]["args"]
    assert got["solo"] == {"launch": {}, "members": []}, "a one-host instance runs no canary gang"


def test_a_canary_gang_with_a_member_missing_from_the_play_starts_nothing(ansible):
    _out, run = ansible
    tasks = [{"name": "Run the canary", "ansible.builtin.include_role": {"name": "gpufleet.vllm.vllm_canary"},
              "vars": {"vllm_canary_model": "/srv/models/m", "vllm_canary_record": False, "vllm_canary_instance": "{{ gpufleet_instances | first }}",
                       "vllm_canary_gang_launch": "{{ (hostvars | gpufleet.vllm.gang_member_launch(inventory_hostname)).m }}",
                       "vllm_canary_gang_members": ["a1", "a2"]}}]
    proc = run([{"hosts": "gpufleet_rollout", "gather_facts": False, "tasks": tasks}], "--limit", "a1")
    assert proc.returncode != 0
    assert ("the canary gang of instance m needs every member (a1, a2, the leader a1 first) in this play; missing: a2"
            in " ".join(proc.stdout.split())), proc.stdout[-4000:]
    assert "Build the compatibility key" not in proc.stdout and "Boot the canary engine" not in proc.stdout, proc.stdout[-4000:]

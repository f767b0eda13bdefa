# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The compatibility key the vllm_canary role builds (tasks_from: compat), run by ansible-playbook itself.

The engine is a real venv whose interpreter the role's vllm_runtime_info reads; its NCCL is a
distribution installed as pip installs it (metadata only). A gang's leader keys its reference by
the gang's layout, its InfiniBand devices and that NCCL (gang_key_fields over the inventory's
hostvars); a one-host instance on the same engine keys exactly what it keyed before gangs.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import venv

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._compat import GANG_FIELDS, compat_key

ROOT = pathlib.Path(__file__).resolve().parents[3]
GANG = {"mode": "mp", "members": ["a1", "a2"]}
SNAPSHOT = {"driver_version": "570.86.15", "infiniband": ["rdma_cm", "uverbs0"],
            "gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3", "total_bytes": 85520809984, "compute_capability": "9.0"}
                     for i in range(2)]}


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    out = tmp_path_factory.mktemp("compat")
    env_dir = out / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    purelib = subprocess.run([str(env_dir / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    info = pathlib.Path(purelib) / "nvidia_nccl_cu12-2.27.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-nccl-cu12\nVersion: 2.27.3\n")
    engine = env_dir / "bin" / "vllm"
    engine.write_text("#!/bin/sh\necho 0.33.0\n")
    engine.chmod(0o755)
    serve_args = {"tensor_parallel_size": 2, "max_model_len": 4096}
    member = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, "gpufleet_host_class": "h100",
              "gpufleet_model": "/srv/models/m", "gpufleet_serve_args": serve_args, "gpufleet_probe_result": SNAPSHOT,
              "gpufleet_instances": [{"name": "m", "gpus": [0], "port": 8000, "gang": GANG}]}
    inventory = {"all": {"hosts": {
        "a1": member, "a2": dict(member, gpufleet_probe_result=dict(SNAPSHOT, infiniband=[])),
        "solo": dict(member, gpufleet_instances=[{"name": "m", "gpus": [0, 1], "port": 8000}])}}}
    tasks = [
        {"name": "Build the key as the rollout's canary does",
         "ansible.builtin.include_role": {"name": "gpufleet.vllm.vllm_canary", "tasks_from": "compat"},
         "vars": {"vllm_canary_executable": str(engine), "vllm_canary_model": "{{ gpufleet_model }}",
                  "vllm_canary_serve_args": "{{ gpufleet_serve_args }}", "vllm_canary_env": {},
                  "vllm_canary_instance": "{{ gpufleet_instances | first }}",
                  "vllm_canary_host_snapshot": "{{ gpufleet_probe_result }}",
                  # as playbooks/vars/canary.yml gives it
                  "vllm_canary_gang": "{{ hostvars | gpufleet.vllm.gang_key_fields(inventory_hostname, 'm') }}"}},
        {"name": "Keep the key", "ansible.builtin.copy": {"content": "{{ vllm_canary_compat_key | to_json }}",
                                                          "dest": str(out) + "/{{ inventory_hostname }}.json", "mode": "0644"}},
    ]
    (out / "play.yml").write_text(json.dumps([{"hosts": "a1,solo", "gather_facts": False, "tasks": tasks}]))
    (out / "inventory.yml").write_text(json.dumps(inventory))
    collections = out / "collections"
    (collections / "ansible_collections" / "gpufleet").mkdir(parents=True)
    os.symlink(ROOT, collections / "ansible_collections" / "gpufleet" / "vllm")
    playbook = pathlib.Path(sys.executable).parent / "ansible-playbook"
    argv = [str(playbook if playbook.exists() else shutil.which("ansible-playbook")), "-i", str(out / "inventory.yml"), str(out / "play.yml")]
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_NOCOLOR="1", ANSIBLE_LOCALHOST_WARNING="0")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return {host: json.loads((out / f"{host}.json").read_text()) for host in ("a1", "solo")}


def test_the_gang_leader_keys_its_layout_infiniband_and_nccl(keys):
    leader = keys["a1"]
    assert {name: leader.get(name) for name in GANG_FIELDS} == {
        "gang_mode": "mp", "nnodes": 2, "gang_layout": [1, 1], "nccl_version": "2.27.3", "infiniband": ["rdma_cm", "uverbs0"]}
    assert leader["vllm_version"] == "0.33.0" and leader["gpu_name"] == "NVIDIA H100 80GB HBM3" and leader["rank_count"] == 1


def test_a_one_host_instance_on_the_same_engine_keys_none_of_it(keys):
    solo = keys["solo"]
    assert not set(solo) & set(GANG_FIELDS), "the NCCL of the runtime joins a gang's key only"
    assert solo["rank_count"] == 2 and solo["driver_version"] == "570.86.15"
    # without the gang's fields, the leader's key is the one-host key of its own GPU count
    stripped = {k: v for k, v in keys["a1"].items() if k not in GANG_FIELDS}
    assert compat_key(dict(stripped, rank_count=2)).hash == compat_key(solo).hash

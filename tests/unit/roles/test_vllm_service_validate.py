# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_service validate.yml: which plans and serve_args it accepts, run by ansible-playbook
(every case in one run, each in a block whose rescue keeps the failure message)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]
BIN = pathlib.Path(sys.executable).parent

MANUAL = {"kv_cache_memory_bytes": 30333206528, "gpu_memory_utilization": 0.2854, "reasons": ["r"]}
CASES = {
    "deploy": ({"decision": "deploy", **MANUAL}, {"max_model_len": 8192}),
    "reprofile": ({"decision": "reprofile", **MANUAL, "reasons": ["headroom 12 GiB over the reference"]}, {}),
    "split": ({"decision": "split", **MANUAL}, {}),
    "auto_profile": ({"decision": "auto_profile", "kv_cache_memory_bytes": None, "gpu_memory_utilization": None}, {}),
    "refuse": ({"decision": "refuse", "reasons": ["too small"]}, {}),
    "api_key": ({"decision": "deploy", **MANUAL}, {"api_key": "sk-not-a-real-key", "max_model_len": 8192}),
    "hf_token": ({"decision": "deploy", **MANUAL}, {"--hf-token": "hf_not_a_real_token"}),
    "counting_options": ({"decision": "deploy", **MANUAL},
                         {"max_num_batched_tokens": 8192, "tokenizer": "/srv/tok", "ssl_keyfile": "/etc/k.pem"}),
    "port": ({"decision": "deploy", **MANUAL}, {"port": 9000}),
}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validate")
    collections = tmp / "collections"
    (collections / "ansible_collections" / "gpufleet").mkdir(parents=True)
    os.symlink(ROOT, collections / "ansible_collections" / "gpufleet" / "vllm")
    tasks = []
    for case, (plan, serve_args) in CASES.items():
        tasks.append({
            "name": f"Case {case}",
            "block": [
                {"name": f"Validate {case}",
                 "ansible.builtin.include_role": {"name": "gpufleet.vllm.vllm_service", "tasks_from": "validate"},
                 "vars": {"vllm_service_plan": plan, "vllm_service_serve_args": serve_args,
                          "vllm_service_model": "/srv/models/m",
                          "vllm_service_instances": [{"name": "main", "gpus": [0], "port": 8000}]}},
                {"name": f"Keep {case}", "ansible.builtin.set_fact": {f"case_{case}": "ok"}},
            ],
            "rescue": [{"name": f"Keep the failure of {case}",
                        "ansible.builtin.set_fact": {f"case_{case}": "{{ ansible_failed_result.msg }}"}}],
        })
    tasks.append({"name": "Write the outcome", "ansible.builtin.copy": {
        "dest": str(tmp / "outcome.json"), "mode": "0644",
        "content": "{{ {" + ", ".join(f"'{c}': case_{c}" for c in CASES) + "} | to_json }}"}})
    playbook = tmp / "validate.yml"
    playbook.write_text(json.dumps([{"hosts": "localhost", "connection": "local", "gather_facts": False, "tasks": tasks}]))
    binary = BIN / "ansible-playbook"
    if not binary.exists():
        binary = pathlib.Path(shutil.which("ansible-playbook") or "ansible-playbook")
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0")
    argv = [str(binary), "-i", "localhost,", "-e", f"ansible_python_interpreter={sys.executable}", str(playbook)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return json.loads((tmp / "outcome.json").read_text()), proc.stdout


@pytest.mark.parametrize("case", ["deploy", "reprofile", "split", "auto_profile", "counting_options"])
def test_accepted(outcome, case):
    assert outcome[0][case] == "ok", outcome[0][case]


def test_reprofile_reason_is_reported(outcome):
    assert "plan decision reprofile" in outcome[1]
    assert "headroom 12 GiB over the reference" in outcome[1]


def test_refused_decision(outcome):
    msg = outcome[0]["refuse"]
    assert "vllm_service_plan.decision: must be one of deploy, reprofile, split, auto_profile, got 'refuse'" in msg, msg


@pytest.mark.parametrize(("case", "key", "env"), [("api_key", "api_key", "VLLM_API_KEY"), ("hf_token", "--hf-token", "HF_TOKEN")])
def test_secret_serve_args_are_refused(outcome, case, key, env):
    msg = outcome[0][case]
    assert f"serve_args {key} would put a secret" in msg, msg
    assert "vllm_service_secret_env" in msg and env in msg
    # the message names the option, never its value
    assert "not_a_real" not in msg and "not-a-real" not in msg


def test_reserved_option_is_refused(outcome):
    assert "serve_args must not set" in outcome[0]["port"]

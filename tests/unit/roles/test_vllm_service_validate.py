# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_service validate.yml: which plans and serve_args it accepts, run by ansible-playbook
(every case in one run, each in a block whose rescue keeps the failure message)."""

from __future__ import annotations

import pytest
from _role_cases import run_role_cases  # pylint: disable=import-error  # beside this file

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
    cases = {case: {"vllm_service_plan": plan, "vllm_service_serve_args": serve_args, "vllm_service_model": "/srv/models/m",
                    "vllm_service_instances": [{"name": "main", "gpus": [0], "port": 8000}]}
             for case, (plan, serve_args) in CASES.items()}
    return run_role_cases(tmp_path_factory.mktemp("validate"), "vllm_service", "validate", cases)


@pytest.mark.parametrize("case", ["deploy", "reprofile", "split", "auto_profile", "counting_options"])
def test_accepted(outcome, case):
    assert outcome[0][case] == "ok", outcome[0][case]


def test_reprofile_reason_is_reported(outcome):
    assert "plan decision reprofile" in outcome[1]
    assert "headroom 12 GiB over the reference" in outcome[1]


def test_refused_decision(outcome):
    msg = outcome[0]["refuse"]
    assert "vllm_service_plan.decision: refuse is not deployable (the planner refused the class: too small)" in msg, msg


@pytest.mark.parametrize(("case", "key", "env"), [("api_key", "api_key", "VLLM_API_KEY"), ("hf_token", "--hf-token", "HF_TOKEN")])
def test_secret_serve_args_are_refused(outcome, case, key, env):
    msg = outcome[0][case]
    assert f"serve_args {key} would put a secret" in msg, msg
    assert "vllm_service_secret_env" in msg and env in msg
    # the message names the option, never its value
    assert "not_a_real" not in msg and "not-a-real" not in msg


def test_reserved_option_is_refused(outcome):
    assert "serve_args must not set" in outcome[0]["port"]

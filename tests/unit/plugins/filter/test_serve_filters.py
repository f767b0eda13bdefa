# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
from __future__ import annotations

import json

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.filter.serve import FilterModule
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import render_serve_args

F = FilterModule().filters()


def test_filter_names():
    assert set(F) == {"vllm_serve_argv", "vllm_secret_options", "systemd_exec_start", "systemd_environment",
                      "systemd_environment_file", "systemd_value", "vllm_service_problems", "vllm_instances_problems",
                      "health_url", "boot_timeout"}


def test_serve_argv_renders_every_kind_of_value():
    args = {
        "tensor_parallel_size": 2,
        "--max-model-len": 8192,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "swap_space": None,
        "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]},
        "served_model_name": ["llama", "llama 8b"],
    }
    argv = F["vllm_serve_argv"](args)
    assert argv == [
        "--compilation-config", json.dumps({"cudagraph_capture_sizes": [1, 2, 4]}, separators=(",", ":")),
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--max-model-len", "8192",
        "--served-model-name", "llama", "llama 8b",
        "--tensor-parallel-size", "2",
    ]
    # one rendering for the unit and the canary
    assert argv == render_serve_args(args)


def test_serve_argv_of_nothing():
    assert F["vllm_serve_argv"]({}) == []
    assert F["vllm_serve_argv"](None) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"port": 9000}, "option 'port' is set by the module itself"),
        ({"gpu_memory_utilization": 0.5}, "gpu_memory_utilization"),
        ({"max_model_len": 1, "max-model-len": 2}, "are the same option"),
        ({"served_model_name": []}, "is an empty list"),
    ],
)
def test_serve_argv_errors_are_filter_errors(args, message):
    with pytest.raises(AnsibleFilterError, match="vllm_serve_argv: .*" + message):
        F["vllm_serve_argv"](args)


def test_serve_argv_needs_a_mapping():
    with pytest.raises(AnsibleFilterError, match="expected a mapping of vllm serve options, got list"):
        F["vllm_serve_argv"](["--port", "1"])


def test_secret_options():
    args = {
        "api_key": "sk-1",
        "--hf-token": "hf_x",
        "ssl_keyfile_password": "pw",
        "db_credentials": "c",
        "ssl_keyfile": "/etc/ssl/k.pem",
        "max_model_len": 8192,
        "tokenizer": "t",
        "max_num_batched_tokens": 8192,
        "long_prefill_token_threshold": 64,
    }
    assert F["vllm_secret_options"](args) == ["--hf-token", "api_key", "db_credentials", "ssl_keyfile_password"]
    assert F["vllm_secret_options"]({"max_model_len": 1, "dtype": "auto"}) == []
    assert F["vllm_secret_options"](None) == []

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What an instance is called on a host, and the rules the instances of a host keep between them."""

from __future__ import annotations

from ansible_collections.gpufleet.vllm.plugins.module_utils._units import _instance
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._instance import Clash


def test_the_names_of_an_instance():
    assert _instance.unit_name("main") == "vllm-main.service"
    assert _instance.instance_of_unit("vllm-main.service") == "main"
    assert _instance.instance_of_unit("vllm-.service") is None
    assert _instance.env_file_name("main") == "vllm-main.env" and _instance.plan_file_name("main") == "main.plan.json"


def test_instances_that_keep_the_rules_do_not_clash():
    assert _instance.clashes([{"name": "a", "port": 8000, "gpus": [0, 1]}, {"name": "b", "port": 8001, "gpus": [2]}]) == []
    assert _instance.clashes([]) == []


def test_each_clash_names_the_instance_the_value_and_the_instance_it_clashes_with():
    found = _instance.clashes([
        {"name": "a", "port": 8000, "gpus": [0, 1, 0]},
        {"name": "b", "port": 8000, "gpus": [1]},
        {"name": "a", "port": 8002, "gpus": [3]},
    ])
    assert found == [
        Clash("gpu_twice", 0, 0, 0, 2),
        Clash("port", 1, 8000, 0),
        Clash("gpu_shared", 1, 1, 0, 0),
        Clash("name", 2, "a", 0),
    ]


def test_a_gpu_shared_and_listed_again_is_one_clash_of_each_and_the_first_owner_keeps_it():
    found = _instance.clashes([{"name": "a", "gpus": [5]}, {"name": "b", "gpus": [5, 5]}, {"name": "c", "gpus": ["5"]}])
    assert found == [Clash("gpu_shared", 1, 5, 0, 0), Clash("gpu_twice", 1, 5, 1, 1), Clash("gpu_shared", 2, 5, 0, 0)]


def test_parts_left_out_or_unusable_are_not_compared():
    """The callers refuse those themselves, naming their field; the rules compare what is left."""
    found = _instance.clashes([None, {"name": None, "port": True, "gpus": None}, {"name": ["x"], "port": True, "gpus": "0"},
                               {"name": "a", "gpus": [None, "x", 2]}, {"name": "b", "gpus": [2]}])
    assert found == [Clash("gpu_shared", 4, 2, 3, 0)]

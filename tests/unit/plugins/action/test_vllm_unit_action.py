# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vllm_unit action plugin: the module runs with gpu_probe.python when it probes, else as usual."""
from __future__ import annotations

from typing import Any
from unittest.mock import MagicMock

from ansible_collections.gpufleet.vllm.plugins.action.vllm_unit import ActionModule, module_task_vars

HOST_VARS = {"ansible_python_interpreter": "/usr/bin/python3", "inventory_hostname": "gpu-a1"}


def test_a_probing_call_runs_with_the_probe_interpreter():
    args = {"state": "snapshot", "names": ["main"], "gpu_probe": {"python": "/opt/vllm/venv/bin/python", "samples": 3}}
    assert module_task_vars(args, HOST_VARS) == dict(HOST_VARS, ansible_python_interpreter="/opt/vllm/venv/bin/python")
    assert HOST_VARS["ansible_python_interpreter"] == "/usr/bin/python3", "the caller's variables are not changed"


def test_a_delegated_probing_call_runs_with_the_probe_interpreter_on_the_delegated_host():
    delegated = {"ansible_delegated_vars": {"gpu-b2": {"ansible_python_interpreter": "/usr/bin/python3", "ansible_host": "10.0.0.2"}}}
    out = module_task_vars({"state": "status", "gpu_probe": {"python": "/opt/vllm/venv/bin/python"}}, dict(HOST_VARS, **delegated), "gpu-b2")
    assert out["ansible_delegated_vars"]["gpu-b2"] == {"ansible_python_interpreter": "/opt/vllm/venv/bin/python", "ansible_host": "10.0.0.2"}
    assert delegated["ansible_delegated_vars"]["gpu-b2"]["ansible_python_interpreter"] == "/usr/bin/python3"


def test_the_plugin_keeps_the_modules_check_mode_and_async():
    assert ActionModule._supports_check_mode is True and ActionModule._supports_async is True


def test_other_calls_keep_the_hosts_interpreter():
    assert module_task_vars({"state": "present", "instances": []}, HOST_VARS) == HOST_VARS
    # bad gpu_probe values are the module's to refuse, by name
    assert module_task_vars({"state": "status", "gpu_probe": "yes"}, HOST_VARS) == HOST_VARS
    assert module_task_vars({"state": "status", "gpu_probe": {"python": ""}}, {}) == {}


def test_run_hands_the_module_those_variables():
    task = MagicMock(args={"state": "status", "instances": [], "gpu_probe": {"python": "/opt/vllm/venv/bin/python"}}, async_val=0,
                     delegate_to=None)
    connection = MagicMock()
    connection._shell.tmpdir = "/nonexistent"
    plugin = ActionModule(task, connection, MagicMock(check_mode=False), MagicMock(), MagicMock(), MagicMock())
    seen: dict[str, Any] = {}

    def execute(**kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        return {"changed": False, "pending": []}

    plugin._execute_module = execute
    plugin._remove_tmp_path = MagicMock()
    result = plugin.run(task_vars=dict(HOST_VARS))
    assert result["pending"] == [] and result["changed"] is False
    assert seen["module_name"] == "gpufleet.vllm.vllm_unit" and seen["module_args"] is task.args
    assert seen["task_vars"]["ansible_python_interpreter"] == "/opt/vllm/venv/bin/python"

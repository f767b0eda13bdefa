# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin for gpufleet.vllm.vllm_unit: run the module with the interpreter its NVML probe needs.

With ``gpu_probe``, the module reads the GPUs in the same round trip as the units (the
free-memory gates of a rollout), which needs ``pynvml``: the host's interpreter for
modules may not have it, the vLLM virtual environment's does. A task cannot set
``ansible_python_interpreter`` only when it probes, so this plugin does: the module runs
with ``gpu_probe.python`` when that is given, else with the host's usual interpreter.
The module itself checks every option.
"""

from __future__ import annotations

from typing import Any, Mapping

from ansible.plugins.action import ActionBase
from ansible.utils.vars import merge_hash


def module_task_vars(args: Mapping[str, Any], task_vars: Mapping[str, Any], delegate_to: str | None = None) -> dict[str, Any]:
    """``task_vars`` with ``ansible_python_interpreter`` set to ``gpu_probe.python`` when the module probes.

    A delegated task takes its interpreter from the delegated host's variables
    (``ansible_delegated_vars``), so the interpreter is set there too.
    """
    probe = args.get("gpu_probe")
    python = probe.get("python") if isinstance(probe, Mapping) else None
    if not (isinstance(python, str) and python):
        return dict(task_vars)
    out = dict(task_vars, ansible_python_interpreter=python)
    delegated = task_vars.get("ansible_delegated_vars")
    if delegate_to and isinstance(delegated, Mapping) and isinstance(delegated.get(delegate_to), Mapping):
        out["ansible_delegated_vars"] = dict(delegated, **{delegate_to: dict(delegated[delegate_to], ansible_python_interpreter=python)})
    return out


class ActionModule(ActionBase):  # type: ignore[misc]  # ActionBase is Any: ansible-core ships no type information
    """Run vllm_unit on the host, with gpu_probe.python as its interpreter when it probes."""

    _supports_check_mode = True
    _supports_async = True

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = super().run(tmp, task_vars)
        del tmp
        wrap_async = bool(self._task.async_val) and not self._connection.has_native_async
        result = merge_hash(result, self._execute_module(
            module_name="gpufleet.vllm.vllm_unit", module_args=self._task.args,
            task_vars=module_task_vars(self._task.args, task_vars or {}, self._task.delegate_to), wrap_async=wrap_async))
        if not wrap_async:
            self._remove_tmp_path(self._connection._shell.tmpdir)
        return result

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin for gpufleet.vllm.nvml_interpreter: the first interpreter on the host that imports pynvml."""

from __future__ import annotations

from typing import Any

from ansible.plugins.action import ActionBase

from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import default
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._nvml_interpreter import candidates, host_python, outcome, search_command

# The options of gpufleet.vllm.nvml_interpreter (plugins/modules/nvml_interpreter.py documents them).
ARGUMENT_SPEC: dict[str, Any] = {
    "python": {"type": "str", "default": ""},
    "vllm_python": {"type": "str", "default": ""},
    "binding_venv": {"type": "path", "default": default("nvml_binding_venv")},
    "binding_venv_only": {"type": "bool", "default": False},
}


class ActionModule(ActionBase):  # type: ignore[misc]  # ActionBase is Any: ansible-core ships no type information
    """One shell round trip: try each candidate's ``import pynvml``, keep the first that works."""

    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        task_vars = task_vars or {}
        result: dict[str, Any] = super().run(tmp, task_vars)
        del tmp
        _validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        for field in ("python", "vllm_python"):
            if any(ord(ch) < 32 or ord(ch) == 127 for ch in args[field]):
                result.update(failed=True, msg=f"nvml_interpreter: {field} holds a control character: {args[field]!r}")
                return result
        gathered = ((task_vars.get("ansible_facts") or {}).get("python") or {}).get("executable")
        configured = task_vars.get("ansible_python_interpreter")
        configured = self._templar.template(configured) if isinstance(configured, str) else None
        tried = candidates(python=args["python"], vllm_python=args["vllm_python"], binding_venv=args["binding_venv"],
                           binding_venv_only=args["binding_venv_only"], host=host_python(gathered, configured))
        # read-only: it runs in check mode as it does otherwise
        run = self._low_level_execute_command(search_command(tried), sudoable=True)
        found, passed_over = outcome(run.get("rc", 1), run.get("stdout", ""))
        result.update(changed=False, interpreter=found, candidates=tried, passed_over=passed_over)
        if found:
            result["msg"] = f"{found} imports pynvml"
        else:
            result["msg"] = "no interpreter here imports pynvml: " + "; ".join(passed_over or tried)
        return result

#!/usr/bin/python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
# This file only documents the action plugin of the same name.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: nvml_interpreter
short_description: Find the Python interpreter on a host that runs the NVML probe (one that imports pynvml)
version_added: 3.0.0
description:
  - Tries the candidate interpreters in order, in one shell command on the host (no module is copied), and
    returns the first whose C(import pynvml) works, with the reason each earlier one was passed over. Every line
    of the command goes to its standard output, tagged, so that the reasons survive a terminal (C(ssh -tt)).
  - The candidates, in order - with O(binding_venv_only), only O(binding_venv)C(/bin/python); else with O(python),
    only that one; else O(vllm_python) (the vLLM venv ships C(nvidia-ml-py)), the interpreter Ansible runs modules
    with on the host (gathered, or C(ansible_python_interpreter) when it is an absolute path, else C(python3) on
    the C(PATH)), and O(binding_venv)C(/bin/python).
  - The P(gpufleet.vllm.gpu_probe#role) role's C(interpreter) entry point calls it, and installs the binding when
    none is found; the probe play calls it first and includes that role only for the hosts where none is found.
  - Sets no fact; the caller keeps RV(interpreter) as C(gpu_probe_interpreter) (the variable every NVML read of the
    collection runs with), as the role and the playbooks do with M(ansible.builtin.set_fact).
  - Never changes anything; always returns C(changed=false).
author:
  - gpufleet maintainers (@gpufleet)
extends_documentation_fragment:
  - gpufleet.vllm.attributes
  - gpufleet.vllm.attributes.INFO_MODULE
  - gpufleet.vllm.attributes.PLATFORM_LINUX
  - gpufleet.vllm.attributes.ACTIONGROUP_VLLM
attributes:
  action:
    description: Indicates this has a corresponding action plugin so some parts of the options can be executed on the controller.
    support: full
    details:
      - Runs one shell command on the host; no module is transferred.
  async:
    description: Supports being used with the C(async) keyword.
    support: none
options:
  python:
    description: The one interpreter to try (C(gpu_probe_python)); empty tries the others.
    type: str
    default: ""
  vllm_python:
    description: The vLLM venv's interpreter (C(gpu_probe_vllm_python)), tried first; empty leaves it out.
    type: str
    default: ""
  binding_venv:
    description: The small venv the P(gpufleet.vllm.gpu_probe#role) role installs the binding into (C(gpu_probe_binding_venv)), tried last.
    type: path
    default: /opt/gpufleet/nvml-venv
  binding_venv_only:
    description: Try only O(binding_venv)'s interpreter (C(gpu_probe_install_binding)).
    type: bool
    default: false
seealso:
  - module: gpufleet.vllm.vllm_host_snapshot
  - module: gpufleet.vllm.gpu_memory_facts
"""

EXAMPLES = r"""
- name: Find the interpreter that runs the NVML probe
  gpufleet.vllm.nvml_interpreter:
    vllm_python: /opt/vllm/venv/bin/python3
  register: nvml_interpreter

- name: Read the GPUs with it
  gpufleet.vllm.gpu_memory_info:
  vars:
    ansible_python_interpreter: "{{ nvml_interpreter.interpreter }}"
  when: nvml_interpreter.interpreter | length > 0
"""

RETURN = r"""
interpreter:
  description: The first candidate that imports C(pynvml) (a bare name resolved on the C(PATH)); empty when none does.
  returned: always
  type: str
  sample: /opt/vllm/venv/bin/python3
candidates:
  description: The interpreters tried, in order.
  returned: always
  type: list
  elements: str
  sample: [/opt/vllm/venv/bin/python3, /usr/bin/python3, /opt/gpufleet/nvml-venv/bin/python]
passed_over:
  description: Why each candidate before the one found (every candidate, when none is found) was passed over, one line each.
  returned: always
  type: list
  elements: str
  sample: ["/opt/vllm/venv/bin/python3: not found", "/usr/bin/python3: ModuleNotFoundError: No module named 'pynvml'"]
"""

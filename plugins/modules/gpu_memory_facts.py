#!/usr/bin/python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_memory_facts
short_description: Per-GPU memory, processes and driver figures from NVML, kept as host facts
version_added: 2.0.0
description:
  - Runs the probe of M(gpufleet.vllm.gpu_memory_info) (same options, same result) and also sets its
    result as host facts, for the plays and plugins that read them from C(hostvars), such as
    O(gpufleet.vllm.kv_plan#module:hosts_from) - C(gpufleet_gpus), the GPU list, and C(gpufleet_nvml),
    the driver, CUDA driver and NVML versions, this host's own engine pids and the host name.
  - Counts the GPU memory held by this host's own engine processes (the systemd units in
    O(service_units), their descendants, and O(service_pids)) and reports
    C(boot_free_bytes), the free memory that engine would see if it booted now (from the lowest sample).
  - A later probe replaces the facts, a probe of a subset of the GPUs (O(devices)) included; probe with
    M(gpufleet.vllm.gpu_memory_info) to read without touching them.
  - Never changes anything on the host; always returns C(changed=false).
author:
  - gpufleet maintainers (@gpufleet)
extends_documentation_fragment:
  - gpufleet.vllm.attributes
  - gpufleet.vllm.attributes.FACTS
  - gpufleet.vllm.attributes.FACTS_MODULE
  - gpufleet.vllm.attributes.PLATFORM_LINUX
  - gpufleet.vllm.attributes.ACTIONGROUP_VLLM
  - gpufleet.vllm.gpu_memory
attributes:
  facts:
    support: full
    details:
      - Sets C(ansible_facts.gpufleet_gpus) (the GPU list) and C(ansible_facts.gpufleet_nvml) (versions, own pids, host).
seealso:
  - module: gpufleet.vllm.gpu_memory_info
    description: The same probe without facts.
  - module: gpufleet.vllm.kv_plan
    description: Plans a class from the C(gpufleet_gpus) facts of its hosts.
  - name: NVML API reference
    description: Device queries used by this module.
    link: https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html
"""

EXAMPLES = r"""
- name: Keep every GPU's figures as host facts
  gpufleet.vllm.gpu_memory_facts:

- name: Show the boot-time free memory per GPU
  ansible.builtin.debug:
    msg: "{{ ansible_facts.gpufleet_gpus | map(attribute='boot_free_bytes') | list }}"

- name: Probe again, three samples, counting vLLM's memory as our own, and keep the result too
  gpufleet.vllm.gpu_memory_facts:
    samples: 3
    interval: 0.5
    service_units:
      - vllm-main.service
  vars:
    ansible_python_interpreter: /opt/vllm/venv/bin/python
  register: probed

- name: Show the driver the facts were read with
  ansible.builtin.debug:
    msg: "{{ ansible_facts.gpufleet_nvml.host }}: driver {{ ansible_facts.gpufleet_nvml.driver_version }}, {{ probed.gpus | length }} GPU(s)"
"""

RETURN = r"""
gpus:
  description: One entry per GPU read, as M(gpufleet.vllm.gpu_memory_info) returns it (its RETURN documents every field).
  returned: success
  type: list
  elements: dict
driver_version: {description: NVIDIA driver version., type: str, returned: success, sample: "550.127.05"}
cuda_driver_version: {description: Highest CUDA version the driver supports., type: str, returned: success, sample: "12.4"}
nvml_version: {description: NVML library version., type: str, returned: success, sample: "12.550.127.05"}
own_pids: {description: Process ids counted as this host's own engine., type: list, elements: int, returned: success, sample: [4242]}
ansible_facts:
  description: Facts set on the host (what C(hostvars[host]) holds afterwards).
  returned: success
  type: dict
  contains:
    gpufleet_gpus:
      description: The same list as RV(gpus), one entry per GPU read (what the planner reads per host).
      type: list
      elements: dict
      returned: success
      sample: [{index: 0, uuid: GPU-6f0c0d1e-0000-4000-8000-000000000000, total_bytes: 150754820096, boot_free_bytes: 149114847232}]
    gpufleet_nvml:
      description: The host-level part of the result, with the host name NVML was read on.
      type: dict
      returned: success
      sample: {host: gpu-a1, driver_version: "550.127.05", cuda_driver_version: "12.4", nvml_version: "12.550.127.05", own_pids: []}
"""

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._gpu_memory import ARGUMENT_SPEC, PYNVML_IMPORT_ERROR, pynvml, run


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run(module, pynvml, set_facts=True, missing_binding=missing_required_lib("nvidia-ml-py"), import_error=PYNVML_IMPORT_ERROR)


if __name__ == "__main__":
    main()

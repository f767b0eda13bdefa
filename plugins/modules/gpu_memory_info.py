#!/usr/bin/python
# Copyright (c) gpufleet.vllm contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_memory_info
short_description: Per-GPU memory, processes and driver figures from NVML
version_added: 1.0.0
description:
  - Reads every GPU (or the GPUs listed in O(devices)) through NVML with the C(nvidia-ml-py) binding
    and reports total, free, used and driver-reserved bytes, compute capability, PCI bus id,
    the processes holding GPU memory, and the driver, CUDA driver and NVML versions.
  - Counts the GPU memory held by this host's own engine processes (the systemd units in
    O(service_units), their descendants, and O(service_pids)) and reports
    C(boot_free_bytes), the free memory that engine would see if it booted now (from the lowest sample).
  - With O(samples) greater than one, reads memory repeatedly O(interval) seconds apart and
    reports the lowest and highest free figure, to spot GPUs whose free memory moves.
  - Never changes anything; always returns C(changed=false).
  - Returns the figures only and sets no facts; use M(gpufleet.vllm.gpu_memory_facts) to set facts
    (C(gpufleet_gpus), C(gpufleet_nvml)).
author:
  - gpufleet maintainers (@gpufleet)
extends_documentation_fragment:
  - gpufleet.vllm.attributes
  - gpufleet.vllm.attributes.INFO_MODULE
  - gpufleet.vllm.attributes.PLATFORM_LINUX
  - gpufleet.vllm.attributes.ACTIONGROUP_VLLM
  - gpufleet.vllm.gpu_memory
seealso:
  - module: gpufleet.vllm.gpu_memory_facts
    description: The same probe, its result kept as host facts.
  - name: NVML API reference
    description: Device queries used by this module.
    link: https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html
"""

EXAMPLES = r"""
- name: Read every GPU
  gpufleet.vllm.gpu_memory_info:
  register: gpu

- name: Read GPUs 2 and 3, five samples one second apart, counting vLLM's memory as our own
  gpufleet.vllm.gpu_memory_info:
    devices: [2, 3]
    samples: 5
    interval: 1
    service_units:
      - vllm-main.service
  vars:
    ansible_python_interpreter: /opt/vllm/venv/bin/python
  register: gpu_pair

- name: Show the boot-time free memory per GPU
  ansible.builtin.debug:
    msg: "{{ gpu_pair.gpus | map(attribute='boot_free_bytes') | list }}"
"""

RETURN = r"""
gpus:
  description: One entry per GPU read, in the order of O(devices) (else index order).
  returned: success
  type: list
  elements: dict
  contains:
    index: {description: NVML index., type: int, returned: always, sample: 0}
    uuid: {description: GPU UUID., type: str, returned: always, sample: GPU-6f0c0d1e-0000-4000-8000-000000000000}
    name: {description: Product name (absent when the driver cannot report it)., type: str, returned: when supported, sample: NVIDIA H200}
    pci_bus_id: {description: PCI bus id., type: str, returned: when supported, sample: "00000000:18:00.0"}
    compute_capability: {description: CUDA compute capability., type: str, returned: when supported, sample: "9.0"}
    total_bytes: {description: Total memory (last sample)., type: int, returned: always, sample: 150754820096}
    free_bytes: {description: Free memory (last sample)., type: int, returned: always, sample: 149114847232}
    used_bytes: {description: Used memory (last sample; with v1 it includes the driver's reserve)., type: int, returned: always, sample: 1073741824}
    reserved_bytes:
      description: Memory the driver reserves (null when only the v1 memory call is available).
      type: int
      returned: always
      sample: 566231040
    memory_info_version: {description: NVML memory call used (2 or 1)., type: int, returned: always, sample: 2}
    free_min_bytes: {description: Lowest free figure over the samples., type: int, returned: always, sample: 149114847232}
    free_max_bytes: {description: Highest free figure over the samples., type: int, returned: always, sample: 149114847232}
    samples: {description: Number of readings taken., type: int, returned: always, sample: 1}
    own_used_bytes: {description: GPU memory held by this host's own engine processes., type: int, returned: always, sample: 0}
    boot_free_bytes:
      description:
        - C(free_min_bytes) plus C(own_used_bytes), the free memory the engine would see if it booted now (capped at total).
        - The lowest sample counts, because a dip seen while sampling is what a boot may meet.
      type: int
      returned: always
      sample: 149114847232
    processes:
      description: Processes holding memory on this GPU (compute and graphics, one entry per pid).
      type: list
      elements: dict
      returned: always
      sample: [{pid: 4242, name: python3, used_bytes: 1073741824, kinds: [compute], own: false}]
    processes_reported: {description: False when the driver cannot list processes (then V(processes) is empty)., type: bool, returned: always, sample: true}
    health:
      description:
        - The GPU's NVML health queries. C(ecc_mode) (V(enabled) or V(disabled)), C(ecc_uncorrected_volatile)
          (uncorrectable ECC errors since the driver loaded), C(remapped_rows) (C(corrected), C(uncorrected), C(pending),
          C(failure)) and C(retired_pages_pending); null when not read.
        - C(not_supported) lists the queries the GPU or driver does not support (retired pages on Ampere and later, ECC on
          GeForce cards), which is no error; C(errors) maps each other query that failed to its NVML error.
      type: dict
      returned: always
      version_added: 2.0.0
      sample:
        ecc_mode: enabled
        ecc_uncorrected_volatile: 0
        remapped_rows: {corrected: 0, uncorrected: 0, pending: false, failure: false}
        retired_pages_pending: null
        not_supported: [retired_pages_pending]
        errors: {}
driver_version: {description: NVIDIA driver version., type: str, returned: success, sample: "550.127.05"}
cuda_driver_version: {description: Highest CUDA version the driver supports., type: str, returned: success, sample: "12.4"}
nvml_version: {description: NVML library version., type: str, returned: success, sample: "12.550.127.05"}
own_pids: {description: Process ids counted as this host's own engine., type: list, elements: int, returned: success, sample: [4242]}
"""

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._gpu_memory import ARGUMENT_SPEC, PYNVML_IMPORT_ERROR, pynvml, run


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    run(module, pynvml, set_facts=False, missing_binding=missing_required_lib("nvidia-ml-py"), import_error=PYNVML_IMPORT_ERROR)


if __name__ == "__main__":
    main()

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
author:
  - gpufleet maintainers (@gpufleet)
requirements:
  - C(nvidia-ml-py) (the C(pynvml) module) importable by the Python interpreter that runs
    the module on the target, and the NVIDIA driver's C(libnvidia-ml.so.1). The vLLM virtual
    environment already ships C(nvidia-ml-py); point C(ansible_python_interpreter) at it.
extends_documentation_fragment:
  - gpufleet.vllm.attributes
  - gpufleet.vllm.attributes.FACTS
  - gpufleet.vllm.attributes.INFO_MODULE
  - gpufleet.vllm.attributes.PLATFORM_LINUX
  - gpufleet.vllm.attributes.ACTIONGROUP_VLLM
attributes:
  facts:
    support: full
    details:
      - Sets C(ansible_facts.gpufleet_gpus) (the GPU list) and C(ansible_facts.gpufleet_nvml) (versions, own pids, host).
options:
  devices:
    description:
      - GPUs to read, by index (V(0)) or UUID (V(GPU-...)), in the order given
        (like C(CUDA_VISIBLE_DEVICES)). Omit (or give an empty list) to read every GPU in index order.
      - An unknown or repeated GPU is an error.
    type: list
    elements: str
  samples:
    description: Number of memory readings per GPU.
    type: int
    default: 1
  interval:
    description: Seconds between two readings when O(samples) is greater than one.
    type: float
    default: 1.0
  service_units:
    description:
      - systemd units (for example V(vllm-main.service)) whose processes are this host's own engine.
        Their control group members, main process and its descendants count as own.
    type: list
    elements: str
    default: []
  service_pids:
    description: Extra process ids (and their descendants) that count as this host's own engine.
    type: list
    elements: int
    default: []
notes:
  - NVML free memory is read before any CUDA context of the engine exists; the engine's own logged
    initial free memory is typically a few hundred MiB lower. Compare NVML with NVML.
seealso:
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

- name: Show the boot-time free memory per GPU
  ansible.builtin.debug:
    msg: "{{ ansible_facts.gpufleet_gpus | map(attribute='boot_free_bytes') | list }}"
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
driver_version: {description: NVIDIA driver version., type: str, returned: success, sample: "550.127.05"}
cuda_driver_version: {description: Highest CUDA version the driver supports., type: str, returned: success, sample: "12.4"}
nvml_version: {description: NVML library version., type: str, returned: success, sample: "12.550.127.05"}
own_pids: {description: Process ids counted as this host's own engine., type: list, elements: int, returned: success, sample: [4242]}
ansible_facts:
  description: Facts set by the module.
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

import platform
import traceback
from typing import Any, Sequence, cast

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.gpufleet.vllm.plugins.module_utils._nvml_probe import NvmlProbeError, probe
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError, integer, number, text

try:
    import pynvml
except ImportError:
    pynvml = None
    PYNVML_IMPORT_ERROR: str | None = traceback.format_exc()
else:
    PYNVML_IMPORT_ERROR = None


def run_module(module: AnsibleModule, binding: Any) -> dict[str, Any]:
    """Probe through ``binding`` with the module's parameters; returns the module result."""
    params = module.params
    host = platform.node()

    def run_command(argv: Sequence[str]) -> tuple[int, str, str]:
        # AnsibleModule.run_command returns (rc, stdout, stderr); ansible-core ships no types
        return cast("tuple[int, str, str]", module.run_command(argv, environ_update={"LC_ALL": "C", "SYSTEMD_PAGER": ""}))

    result = probe(
        binding,
        devices=params["devices"],
        samples=params["samples"],
        interval=params["interval"],
        service_units=params["service_units"],
        service_pids=params["service_pids"],
        host=host,
        run_command=run_command,
    )
    warnings = result.pop("warnings")
    nvml_facts = {key: result[key] for key in ("driver_version", "cuda_driver_version", "nvml_version", "own_pids")}
    nvml_facts["host"] = host
    facts = {"gpufleet_gpus": result["gpus"], "gpufleet_nvml": nvml_facts}
    return {"changed": False, "ansible_facts": facts, "warnings": warnings, **result}


MAX_SAMPLES = 1000
MAX_INTERVAL = 3600.0


def check_params(params: dict[str, Any]) -> None:
    """The edge checks: finite, bounded sample count and interval; unit names and devices as plain text."""
    integer(params["samples"], "samples", low=1, high=MAX_SAMPLES)
    number(params["interval"], "interval", low=0, high=MAX_INTERVAL)
    for i, device in enumerate(params["devices"] or []):
        text(device, f"devices[{i}]")
    for i, unit in enumerate(params["service_units"] or []):
        text(unit, f"service_units[{i}]")
    for i, pid in enumerate(params["service_pids"] or []):
        integer(pid, f"service_pids[{i}]", low=1)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "devices": {"type": "list", "elements": "str"},
            "samples": {"type": "int", "default": 1},
            "interval": {"type": "float", "default": 1.0},
            "service_units": {"type": "list", "elements": "str", "default": []},
            "service_pids": {"type": "list", "elements": "int", "default": []},
        },
        supports_check_mode=True,
    )
    try:
        check_params(module.params)
    except ValidationError as exc:
        module.fail_json(msg=str(exc))
    if pynvml is None:
        module.fail_json(msg=missing_required_lib("nvidia-ml-py"), exception=PYNVML_IMPORT_ERROR)
    try:
        result = run_module(module, pynvml)
    except NvmlProbeError as exc:
        host = platform.node()
        msg = exc.message if exc.message.startswith(host) else f"{host}: {exc.message}"
        module.fail_json(msg=msg, gpu=exc.gpu, nvml_error=exc.code)
    warnings = result.pop("warnings")
    for warning in warnings:
        module.warn(warning)
    module.exit_json(**result)


if __name__ == "__main__":
    main()

# -*- coding: utf-8 -*-

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The options, requirements and notes of gpu_memory_info and gpu_memory_facts (one argument spec, module_utils/_gpu/_gpu_memory.py)."""

from __future__ import annotations


class ModuleDocFragment:
    """``gpufleet.vllm.gpu_memory``: the NVML probe's options."""

    DOCUMENTATION = r"""
requirements:
  - C(nvidia-ml-py) (the C(pynvml) module) importable by the Python interpreter that runs
    the module on the target, and the NVIDIA driver's C(libnvidia-ml.so.1). The vLLM virtual
    environment already ships C(nvidia-ml-py); point C(ansible_python_interpreter) at it.
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
"""

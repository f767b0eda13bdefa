#!/usr/bin/python
# -*- coding: utf-8 -*-

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_audit
short_description: Judge every vLLM instance of a host against its free-memory floor now
version_added: 1.0.0
description:
  - Reads the plan files of the host's instances (C(<state_dir>/*.plan.json), written by the P(gpufleet.vllm.vllm_service#role)
    role) with the boot gate's own reader, probes NVML once for every GPU they name (the probe of
    M(gpufleet.vllm.vllm_host_snapshot) and M(gpufleet.vllm.gpu_memory_info), one sample, the instances' units' processes
    counted as this host's own) and judges each manual-budget instance with the boot gate's own rule under the unit's
    policy, so the verdict says what the next start would do.
  - Per instance and rank, the NVML free memory now, the plan's floor and the margin between them; the plan's age;
    its compatibility key against O(reference_key_hashes); the gate's record of the last start (degraded or not).
  - "Verdicts, worst first: V(plan_edited) (the plan file is not the one the deploy wrote - its checksum is not the one
    recorded beside the unit - so the boot gate refuses the next start), V(would_refuse) (the next start is refused),
    V(would_shrink) (it starts degraded), V(reprofile_due) (the plan is older than O(reprofile_after_days), dated in
    the future of the judging clock, the host's clock is off the controller's by more than O(max_clock_skew), or the
    class's stored reference has another compatibility key), V(ok)."
  - Ages are judged on one clock - the controller's with O(controller_time) (it wrote the plan's C(planned_at)), else the
    host's - and the host's skew from the controller is returned (RV(clock_skew_seconds)).
  - Never changes anything.
author:
  - gpufleet maintainers (@gpufleet)
extends_documentation_fragment:
  - gpufleet.vllm.attributes
  - gpufleet.vllm.attributes.INFO_MODULE
  - gpufleet.vllm.attributes.PLATFORM_LINUX
  - gpufleet.vllm.attributes.ACTIONGROUP_VLLM
options:
  state_dir:
    description: Directory of the plan files (the role's C(vllm_service_state_dir)).
    type: path
    default: /etc/gpufleet
  reprofile_after_days:
    description: Age in days after which a plan is V(reprofile_due).
    type: float
    default: 30
  reference_key_hashes:
    description: Host class -> compatibility-key hash of the class's newest stored reference profile.
    type: dict
    default: {}
  unit_dir:
    description:
      - Directory of the instances' units; beside each, a drop-in (C(vllm-NAME.service.d/gpufleet-plan.conf)) records its
        plan file's checksum.
    type: path
    default: /etc/systemd/system
  controller_time:
    description:
      - The controller's clock (seconds since the epoch) when it sent the task, for example C(now().timestamp()).
        Ages are then judged on it and the host's skew from it is returned.
    type: float
  max_clock_skew:
    description: Seconds the host's clock may be off the controller's before every instance says so.
    type: float
    default: 300
requirements:
  - C(nvidia-ml-py) (the C(pynvml) module) importable by the Python interpreter that runs the module.
seealso:
  - module: gpufleet.vllm.gpu_memory_info
  - module: gpufleet.vllm.vllm_boot_check
"""

EXAMPLES = r"""
- name: Judge the instances of this host (what their next start would do)
  gpufleet.vllm.vllm_audit:
    state_dir: /etc/gpufleet
    reprofile_after_days: 30
  register: audit

- name: Show each instance's verdict and lowest margin
  ansible.builtin.debug:
    msg: "{{ item.instance }}: {{ item.verdict }} (margin {{ item.min_margin_bytes | gpufleet.vllm.human_bytes }})"
  loop: "{{ audit.instances }}"
  loop_control:
    label: "{{ item.instance }}"
"""

RETURN = r"""
checked_at:
  description: Seconds since the epoch when NVML was read.
  returned: success
  type: float
instances:
  description:
    - One entry per manual-budget instance, with C(instance), C(unit), C(host_class), C(policy), C(verdict),
      C(next_start) (the gate's action at a start now), C(ranks) (C(rank), C(gpu), C(uuid), C(pci_bus_id), C(free_bytes),
      C(floor_bytes), C(margin_bytes), C(health) as M(gpufleet.vllm.gpu_memory_info) returns it), C(min_margin_bytes),
      C(kv_cache_memory_bytes), C(kv_cache_tokens), C(would_start),
      C(planned_at), C(plan_age_days), C(compat_key_hash), C(reference_key_hash), C(key_matches),
      C(last_start) (the gate's last record), C(plan_checksum) and C(recorded_checksum) (the unit's), C(reasons),
      C(plan_file) and C(gang) (for a member of an instance over several hosts, C(gang), the C(ADDRESS:PORT) its members
      meet at, and C(leader); else null).
  returned: success
  type: list
  elements: dict
clock_skew_seconds:
  description: The host's clock minus O(controller_time) (positive - the host is ahead); null without O(controller_time).
  returned: success
  type: float
errors:
  description: Plan files that could not be read, each with the reason.
  returned: success
  type: list
  elements: str
worst:
  description: The worst verdict of the host (V(ok) without instances).
  returned: success
  type: str
"""

import platform
import time

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.gpufleet.vllm.plugins.module_utils._audit import VERDICTS, audit
from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import default
from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._gpu_memory import PYNVML_IMPORT_ERROR, host_message, module_runner, pynvml
from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._nvml_probe import NvmlProbeError


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "state_dir": {"type": "path", "default": default("state_dir")},
            "reprofile_after_days": {"type": "float", "default": default("reprofile_after_days")},
            "reference_key_hashes": {"type": "dict", "default": {}, "no_log": False},
            "unit_dir": {"type": "path", "default": default("unit_dir")},
            "controller_time": {"type": "float"},
            "max_clock_skew": {"type": "float", "default": 300.0},
        },
        supports_check_mode=True,
    )
    if module.params["reprofile_after_days"] <= 0:
        module.fail_json(msg=f"reprofile_after_days must be > 0, got {module.params['reprofile_after_days']}")
    if module.params["max_clock_skew"] < 0:
        module.fail_json(msg=f"max_clock_skew must be >= 0, got {module.params['max_clock_skew']}")
    if pynvml is None:
        module.fail_json(msg=missing_required_lib("nvidia-ml-py"), exception=PYNVML_IMPORT_ERROR)
    host = platform.node()
    try:
        # the probe runs systemctl through the snapshot's runner (vllm_host_snapshot)
        result = audit(module.params["state_dir"], pynvml, now=time.time(),
                       reprofile_after_days=module.params["reprofile_after_days"],
                       reference_key_hashes={str(k): str(v) for k, v in module.params["reference_key_hashes"].items()},
                       host=host, unit_dir=module.params["unit_dir"],
                       controller_time=module.params["controller_time"], max_clock_skew=module.params["max_clock_skew"],
                       run_command=module_runner(module))
    except NvmlProbeError as exc:
        module.fail_json(msg=host_message(exc, host), gpu=exc.gpu, nvml_error=exc.code)
    worst = max((VERDICTS.index(i["verdict"]) for i in result["instances"]), default=0)
    module.exit_json(changed=False, worst=VERDICTS[worst], **result)


if __name__ == "__main__":
    main()

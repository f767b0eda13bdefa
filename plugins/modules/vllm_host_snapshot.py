#!/usr/bin/python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
from __future__ import annotations

DOCUMENTATION = r"""
---
module: vllm_host_snapshot
short_description: What planning needs from one host, in one call - GPUs, instance units, plan records, install record, probe interpreter
version_added: 3.0.0
description:
  - Reads in one module run what the planning plays (C(probe.yml), C(plan.yml), C(rollout.yml)) need from a host, so
    that no later task reads it again.
  - The NVML probe of M(gpufleet.vllm.gpu_memory_facts), with the same options and result. The processes of the
    instances' units (C(vllm-NAME.service) for every name in O(instances)) and of O(adopt_units) count as this
    host's own engine.
  - For every instance in O(instances) its unit's state (C(LoadState), C(ActiveState), C(SubState), read with one
    C(systemctl show)), and the plan record its running unit passed its boot check with
    (O(state_dir)C(/NAME.plan.json); an empty mapping when there is none or it cannot be parsed).
  - With O(engine_executable), the runtime fields of the compatibility key, read by the engine's own interpreter.
  - With O(runtime_venv), the install record of the engine runtime - the release the P(gpufleet.vllm.vllm_runtime#role)
    role switched the venv to, and that release's C(.gpufleet-complete) stamp (package, version, base interpreter).
  - With O(model), whether the service user can read all of the model (RV(model_access)).
  - The Python interpreter the module ran with (one that imports C(pynvml)).
  - Sets the host facts C(gpufleet_gpus) and C(gpufleet_nvml) as M(gpufleet.vllm.gpu_memory_facts) does, and
    C(gpufleet_host_snapshot) (the instances, the engine's runtime, the install record and the interpreter).
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
      - Sets C(ansible_facts.gpufleet_gpus), C(ansible_facts.gpufleet_nvml) and C(ansible_facts.gpufleet_host_snapshot).
options:
  instances:
    description:
      - Names of the host's vLLM instances (unit C(vllm-NAME.service), plan record C(NAME.plan.json)).
      - Each name is 1-64 ASCII letters, digits, C(_), C(.) or C(-), starting with a letter or digit; names are unique.
    type: list
    elements: str
    default: [vllm]
  adopt_units:
    description: Hand-written systemd units the instances take over; their processes count as this host's own engine.
    type: list
    elements: str
    default: []
  state_dir:
    description:
      - Directory of the plan records (C(vllm_service_state_dir)).
      - An absolute, normalised path (no C(..), C(//) or C(/./)) without whitespace, as M(gpufleet.vllm.vllm_unit) takes it.
    type: path
    default: /etc/gpufleet
  engine_executable:
    description:
      - The C(vllm) CLI of the instances. When given, the snapshot reads the runtime fields of the compatibility key
        (vLLM, its commit, torch and its CUDA build) from distribution metadata with the interpreter beside it, as
        M(gpufleet.vllm.vllm_runtime_info) does, without importing either. Omit to read no runtime.
      - An absolute, normalised path (no C(..), C(//) or C(/./)).
    type: path
  runtime_venv:
    description:
      - The engine's venv as the P(gpufleet.vllm.vllm_runtime#role) role manages it (C(vllm_runtime_venv), a symbolic
        link to the current release). When given, the snapshot returns its install record (RV(install_record)), read
        without starting any program. Omit to read none.
      - An absolute, normalised path (no C(..), C(//) or C(/./)).
    type: path
  model:
    description:
      - A local model (an absolute path, as C(vllm serve) takes it) that O(model_user) must be able to read, all of it.
        The snapshot checks it as M(gpufleet.vllm.vllm_account) O(gpufleet.vllm.vllm_account#module:state=checked) does
        (C(find -L) as the user) and returns the outcome in RV(model_access); an unreadable file is no failure here.
      - Where O(model_user) does not exist yet, nothing is checked (the deploy that creates the user checks then).
      - Omit (or a model id) to check nothing.
    type: str
  model_user:
    description: The service user that runs the engine (C(vllm_service_user)), whose access to O(model) is checked.
    type: str
    default: vllm
  resolve:
    description:
      - Host names or addresses to resolve on this host with the system resolver, returned in RV(resolved). The
        playbooks give a follower of an instance that spans hosts the gang's address (C(docs/multi-host.md)).
      - A name that does not resolve is no failure here; RV(resolved) says why.
    type: list
    elements: str
    default: []
seealso:
  - module: gpufleet.vllm.gpu_memory_facts
  - module: gpufleet.vllm.vllm_unit
  - module: gpufleet.vllm.kv_plan
"""

EXAMPLES = r"""
- name: Read the host once for planning (nine samples, half a second apart)
  gpufleet.vllm.vllm_host_snapshot:
    instances: [main, side]
    engine_executable: /opt/vllm/venv/bin/vllm
    runtime_venv: /opt/vllm/venv
    samples: 9
    interval: 0.5
  vars:
    ansible_python_interpreter: /opt/vllm/venv/bin/python
  register: snap

- name: Show which instances run, and the interpreter that read the GPUs
  ansible.builtin.debug:
    msg: "{{ snap.instances | items2dict(key_name='name', value_name='active_state') }} (read with {{ snap.interpreter }})"

- name: Show the engine release the venv runs (the runtime role's install record)
  ansible.builtin.debug:
    msg: "{{ snap.install_record.release | default('not installed by the runtime role') }} {{ snap.install_record.stamp | default({}) }}"
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
instances:
  description: One entry per name in O(instances), in that order.
  returned: success
  type: list
  elements: dict
  contains:
    name: {description: The instance name., type: str, returned: success, sample: main}
    unit: {description: Its systemd unit., type: str, returned: success, sample: vllm-main.service}
    load_state: {description: systemd's C(LoadState) (V(not-found) when there is no unit)., type: str, returned: success, sample: loaded}
    active_state: {description: systemd's C(ActiveState)., type: str, returned: success, sample: active}
    sub_state: {description: systemd's C(SubState)., type: str, returned: success, sample: running}
    unit_exists: {description: Whether systemd knows the unit., type: bool, returned: success, sample: true}
    plan:
      description: The plan record of the unit's last boot check, as parsed JSON; empty when there is none or it cannot be parsed or read.
      type: dict
      returned: success
      sample: {instance: main, kv_cache_memory_bytes: 34359738368, gpu_memory_utilization: 0.95}
    plan_error:
      description: Why the plan record could not be read (V(null) when it was read or there is none).
      type: str
      returned: success
engine:
  description: The engine's runtime, with O(engine_executable).
  returned: when O(engine_executable) is given
  type: dict
  contains:
    executable: {description: O(engine_executable)., type: str, returned: always, sample: /opt/vllm/venv/bin/vllm}
    python:
      description: The interpreter beside it that was read; V(null) when there is none (nothing to read).
      type: str
      returned: always
      sample: /opt/vllm/venv/bin/python
    compat:
      description: The runtime fields of the compatibility key (those M(gpufleet.vllm.vllm_runtime_info) returns in its C(compat), less the model's).
      type: dict
      returned: always
      sample: {vllm_version: 0.33.0, torch_version: 2.9.0+cu128, cuda_version: "12.8"}
    nccl_version:
      description:
        - The NCCL wheel torch loads (M(gpufleet.vllm.vllm_runtime_info)'s C(nccl_version)), a key field of an instance that
          spans hosts; V(null) without one.
      type: str
      returned: always
      sample: 2.27.3
    error:
      description: Why an interpreter beside the CLI (even a broken link) could not be read (the reader fails the host with it); V(null) when read.
      type: str
      returned: always
install_record:
  description:
    - The install record of the engine runtime at O(runtime_venv) - what the P(gpufleet.vllm.vllm_runtime#role) role
      left there; read-only.
    - An empty mapping without O(runtime_venv), or when the venv is not a symbolic link (a plain directory or missing - no
      release of the role).
  returned: success
  type: dict
  contains:
    venv: {description: O(runtime_venv)., type: str, returned: when the venv is a link, sample: /opt/vllm/venv}
    release:
      description: The release directory the venv points to (resolved).
      type: str
      returned: when the venv is a link
      sample: /opt/vllm/releases/vllm-0.33.0-3f2a9c1d0e
    stamp:
      description:
        - The release's C(.gpufleet-complete) stamp as parsed JSON - C(package), C(version) and C(python) (the base
          interpreter) for a release the role installed, C(package=unmanaged) and C(kept_from) for a venv it kept as a
          release; empty when it cannot be read (see RV(install_record_error)).
      type: dict
      returned: when the venv is a link
      sample: {package: vllm, version: 0.33.0, python: /usr/bin/python3.12}
install_record_error:
  description: Why the release's stamp could not be read (missing, unreadable, not a JSON object); V(null) when it was read or there is no record.
  type: str
  returned: success
model_access:
  description: With O(model), whether O(model_user) can read all of it.
  returned: when O(model) is given
  type: dict
  contains:
    model: {description: O(model)., type: str, returned: always, sample: /srv/models/llama-3.1-8b-instruct}
    user: {description: O(model_user)., type: str, returned: always, sample: vllm}
    checked:
      description: Whether the model was checked and found readable; V(false) where the user does not exist yet or it is not readable.
      type: bool
      returned: always
    error:
      description: What the user cannot read (the first paths, or C(find)'s own errors); V(null) when readable or not checked.
      type: str
      returned: always
resolved:
  description: One entry per O(resolve) name, in its order.
  returned: success
  type: list
  elements: dict
  contains:
    name: {description: The name as given., type: str, returned: always, sample: gpu-a1.example.net}
    addresses: {description: The addresses it resolves to (empty when it does not)., type: list, elements: str, returned: always,
                sample: [10.20.0.11]}
    error: {description: Why it does not resolve; V(null) when it does., type: str, returned: always}
infiniband:
  description:
    - The InfiniBand/RoCE device nodes under C(/dev/infiniband) (C(uverbs0), C(rdma_cm)), sorted; empty on a host without any.
    - The unit of a member of an instance that spans hosts allows NCCL these devices only where they are (C(docs/multi-host.md)).
  returned: success
  type: list
  elements: str
  sample: [rdma_cm, uverbs0, uverbs1]
interpreter:
  description: The Python interpreter the module ran with (it imports C(pynvml)).
  returned: success
  type: str
  sample: /opt/vllm/venv/bin/python
ansible_facts:
  description: Facts set on the host (what C(hostvars[host]) holds afterwards).
  returned: success
  type: dict
  contains:
    gpufleet_gpus:
      description: The same list as RV(gpus) (what the planner reads per host).
      type: list
      elements: dict
      returned: success
    gpufleet_nvml:
      description: The host-level part of the probe, with the host name NVML was read on.
      type: dict
      returned: success
    gpufleet_host_snapshot:
      description:
        - The host name, RV(interpreter), RV(instances), RV(engine) (V(null) without O(engine_executable)),
          RV(install_record) and RV(install_record_error); with O(model) also RV(model_access).
      type: dict
      returned: success
      sample: {host: gpu-a1, interpreter: /opt/vllm/venv/bin/python, instances: [], engine: null, install_record: {},
               install_record_error: null}
"""

import platform
import sys

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._gpu_memory import PYNVML_IMPORT_ERROR, host_message, module_runner, pynvml
from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._nvml_probe import NvmlProbeError
from ansible_collections.gpufleet.vllm.plugins.module_utils._host_snapshot import (
    ARGUMENT_SPEC,
    HostSnapshotError,
    check_params,
    snapshot,
    snapshot_facts,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    try:
        check_params(module.params)
    except ValidationError as exc:
        module.fail_json(msg=str(exc))
    if pynvml is None:
        module.fail_json(msg=missing_required_lib("nvidia-ml-py"), exception=PYNVML_IMPORT_ERROR)
    host = platform.node()

    try:
        result = snapshot(module.params, pynvml, host, module_runner(module), sys.executable)
    except NvmlProbeError as exc:
        module.fail_json(msg=host_message(exc, host), gpu=exc.gpu, nvml_error=exc.code)
    except HostSnapshotError as exc:
        module.fail_json(msg=str(exc))
    for warning in result.pop("warnings"):
        module.warn(warning)
    module.exit_json(changed=False, ansible_facts=snapshot_facts(result, host), **result)


if __name__ == "__main__":
    main()

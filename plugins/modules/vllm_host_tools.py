#!/usr/bin/python
# -*- coding: utf-8 -*-

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_host_tools
short_description: Install the boot gate, its library and the metrics exporter of the vLLM units in one call
version_added: 1.2.0
description:
  - Installs, in one round trip, the files the P(gpufleet.vllm.vllm_service#role) role puts on a host besides the
    units - the boot gate program and its library, the metrics exporter and its systemd service and timer - given
    with their contents, owned by root.
  - Each file and directory is compared with the one on disk (content, owner C(root:root), mode) and written
    atomically (a temporary file in its directory, renamed) only when it differs, so a file edited or removed on the
    host is installed again and a host that has them all changes nothing. Missing parent directories are created
    (root, 0755).
  - O(compile) directories are byte-compiled with O(python) (the interpreter that runs them, whose user may not write
    C(__pycache__) there) when one of their files changed or a compiled file is missing.
  - When O(python) resolves to the interpreter that runs the module, the module compiles them itself instead of
    starting that interpreter again.
  - O(units) are enabled and started; after a change to any file (for example the unit files themselves) systemd is
    reloaded and each unit is restarted, so the new files take effect.
author:
  - gpufleet maintainers (@gpufleet)
extends_documentation_fragment:
  - gpufleet.vllm.attributes
  - gpufleet.vllm.attributes.PLATFORM_LINUX
  - gpufleet.vllm.attributes.ACTIONGROUP_VLLM
attributes:
  check_mode:
    support: full
    details:
      - Reports which files would change and writes, compiles and starts nothing.
  diff_mode:
    support: none
  idempotent:
    support: full
options:
  files:
    description: The files, with their contents.
    type: list
    elements: dict
    required: true
    suboptions:
      path:
        description: Absolute path of the file.
        type: path
        required: true
      content:
        description: The file's text.
        type: str
        required: true
      mode:
        description: Octal mode, quoted (V('0755') for programs).
        type: str
        default: '0644'
  directories:
    description: Directories to create (or fix) first.
    type: list
    elements: dict
    default: []
    suboptions:
      path:
        description: Absolute path of the directory.
        type: path
        required: true
      mode:
        description: Octal mode, quoted.
        type: str
        default: '0755'
  compile:
    description: Directories of Python files to byte-compile with O(python).
    type: list
    elements: path
    default: []
  python:
    description: The interpreter that compiles O(compile) (the one that runs those files). Required with O(compile).
    type: path
  units:
    description: systemd units to enable and start (restarted after any file changed), for example a C(.timer).
    type: list
    elements: str
    default: []
seealso:
  - name: The boot gate
    description: What the installed files do (docs/boot-gate.md in the collection).
    link: https://github.com/gpufleet/gpufleet.vllm/blob/main/docs/boot-gate.md
"""

EXAMPLES = r"""
- name: Install a program, its library (compiled) and a timer that runs it
  gpufleet.vllm.vllm_host_tools:
    directories:
      - path: /opt/example/lib/example_pkg
    files:
      - path: /opt/example/lib/example_pkg/__init__.py
        content: ""
      - path: /usr/local/bin/example-tool
        content: "#!/usr/bin/python3\nimport sys\nsys.exit(0)\n"
        mode: "0755"
      - path: /etc/systemd/system/example-tool.service
        content: "[Service]\nType=oneshot\nExecStart=/usr/local/bin/example-tool\n"
      - path: /etc/systemd/system/example-tool.timer
        content: "[Timer]\nOnBootSec=1min\nOnUnitActiveSec=1min\n\n[Install]\nWantedBy=timers.target\n"
    compile:
      - /opt/example/lib/example_pkg
    python: /usr/bin/python3
    units:
      - example-tool.timer
  register: tools

- name: Say what changed
  ansible.builtin.debug:
    msg: "{{ tools.written | length }} file(s) written, units started again: {{ tools.started }}"
"""

RETURN = r"""
written:
  description: The directories and files that were created or changed (would be, in check mode), in the order given.
  returned: always
  type: list
  elements: str
  sample: [/usr/local/bin/example-tool]
compiled:
  description: The O(compile) directories that were byte-compiled.
  returned: always
  type: list
  elements: str
  sample: [/opt/example/lib/example_pkg]
started:
  description: The O(units) that were enabled, started or restarted.
  returned: always
  type: list
  elements: str
  sample: [example-tool.timer]
"""

import traceback
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.text.converters import to_native

from ansible_collections.gpufleet.vllm.plugins.module_utils._units._host_tools import ARGUMENT_SPEC, HostToolsError, apply


def run_module(module: AnsibleModule) -> dict[str, Any]:
    def runner(argv: list[str]) -> tuple[int, str, str]:
        rc, out, err = module.run_command(argv)
        return rc, out, err

    systemctl = module.get_bin_path("systemctl", required=True) if module.params["units"] else "systemctl"
    return apply(module.params, runner, systemctl, module.check_mode)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    try:
        result = run_module(module)
    except HostToolsError as exc:
        module.fail_json(msg=f"vllm_host_tools: {to_native(exc)}")
    except Exception as exc:  # pylint: disable=broad-exception-caught
        module.fail_json(msg=f"vllm_host_tools failed unexpectedly: {to_native(exc)}", exception=traceback.format_exc())
    module.exit_json(**result)


if __name__ == "__main__":
    main()

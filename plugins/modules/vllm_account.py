#!/usr/bin/python
# -*- coding: utf-8 -*-

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_account
short_description: Create the unprivileged account vLLM runs as, and check that it can read the model, in one call
version_added: 2.0.0
description:
  - With O(state=present), makes the service account what the units of the P(gpufleet.vllm.vllm_service#role) role
    expect, in one round trip - a system group, a system user in it (shell C(/usr/sbin/nologin), home O(home), no
    skeleton files) and the home directory owned by them with mode 0750 (missing parent directories are created,
    root, 0755) - and then, with O(model), checks that this user can read every file of the model.
  - A user that exists with another primary group, home or shell is changed to these (C(usermod)); with
    O(create=false) the group and the user must exist already (an account managed elsewhere) and only the home is
    made theirs.
  - With O(state=checked), changes nothing and only reports RV(ready) and checks the model; where the user does not
    exist yet the check fails, or with O(user_optional) is left to a later call (RV(model_checked) is false).
  - The model check runs C(find -L) as the user (C(runuser)); a file or directory the user cannot read fails the
    task naming the first five, as the engine itself would fail only in a worker, with a misleading
    C(FileNotFoundError).
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
      - Reports what would be created or changed, and creates nothing. The model is checked where the user exists.
  diff_mode:
    support: none
  idempotent:
    support: full
options:
  state:
    description:
      - V(present) creates or fixes the account, then checks the model; V(checked) changes nothing.
    type: str
    choices: [present, checked]
    default: present
  user:
    description: The service user.
    type: str
    required: true
  group:
    description: The service user's primary group.
    type: str
    required: true
  home:
    description: The user's home directory (where vLLM keeps its caches).
    type: path
    required: true
  create:
    description: Create the group and the user where they do not exist (O(state=present)).
    type: bool
    default: true
  model:
    description: A local model directory or file the user must be able to read, all of it.
    type: path
  user_optional:
    description:
      - With O(state=checked), a user that does not exist yet is not a failure; the model is then not checked.
    type: bool
    default: false
seealso:
  - module: ansible.builtin.user
    description: The general module for local users; this one does the account of the vLLM units in one call.
  - module: gpufleet.vllm.vllm_unit
    description: Its O(gpufleet.vllm.vllm_unit#module:account) option does the same in the call that writes the units.
"""

EXAMPLES = r"""
- name: Create the vLLM service account and check that it can read the model
  gpufleet.vllm.vllm_account:
    user: vllm
    group: vllm
    home: /var/lib/vllm
    model: /srv/models/llama-3.1-8b-instruct

- name: Check the model on every host before any is touched, where the user exists already
  gpufleet.vllm.vllm_account:
    state: checked
    user: vllm
    group: vllm
    home: /var/lib/vllm
    model: /srv/models/llama-3.1-8b-instruct
    user_optional: true
  register: access
"""

RETURN = r"""
account_changed:
  description: What was created or changed (would be, in check mode), of V(group), V(user) and V(home).
  returned: always
  type: list
  elements: str
  sample: [group, user, home]
ready:
  description: Whether the user and the group exist and own the home with mode 0750 (after the change).
  returned: always
  type: bool
  sample: true
model_checked:
  description: Whether O(model) was checked (and found readable); false without O(model) or without the user yet.
  returned: always
  type: bool
  sample: true
"""

import traceback
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.text.converters import to_native

from ansible_collections.gpufleet.vllm.plugins.module_utils._units._service_account import ARGUMENT_SPEC, AccountError, apply


def run_module(module: AnsibleModule) -> dict[str, Any]:
    def runner(argv: list[str], cwd: str | None = None) -> tuple[int, str, str]:
        rc, out, err = module.run_command(argv, cwd=cwd)
        return rc, out, err

    return apply(module.params, runner, module.check_mode, read_only=module.params["state"] == "checked")


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(ARGUMENT_SPEC, state=dict(type="str", choices=["present", "checked"], default="present"),
                           user_optional=dict(type="bool", default=False)),
        supports_check_mode=True,
    )
    try:
        result = run_module(module)
    except AccountError as exc:
        module.fail_json(msg=to_native(exc))
    except Exception as exc:  # pylint: disable=broad-exception-caught
        module.fail_json(msg=f"vllm_account failed unexpectedly: {to_native(exc)}", exception=traceback.format_exc())
    module.exit_json(**result)


if __name__ == "__main__":
    main()

# -*- coding: utf-8 -*-

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Shared attribute documentation for the modules and action plugins of gpufleet.vllm."""

from __future__ import annotations


class ModuleDocFragment:
    """Attribute documentation fragments: ``gpufleet.vllm.attributes[.<name>]``."""

    # Standard fragment: describes the attributes; each module states its own support.
    DOCUMENTATION = r"""
options: {}
attributes:
  check_mode:
    description: Can run in C(check_mode) and return changed status prediction without modifying target.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in C(check_mode)), when in diff mode.
  idempotent:
    description:
      - When run twice in a row outside check mode, with the same arguments, the second invocation indicates no change.
      - This assumes that the system controlled/queried by the module has not changed in a relevant way.
  platform:
    description: Target OS/families that can be operated against.
"""

    # Use together with the standard fragment: the module reads and never changes state.
    INFO_MODULE = r"""
options: {}
attributes:
  check_mode:
    support: full
    details:
      - This action does not modify state.
  diff_mode:
    support: N/A
    details:
      - This action does not modify state.
  idempotent:
    support: full
    details:
      - This action does not modify state.
"""

    # Use together with the standard fragment: Linux targets (NVML, systemd, vLLM).
    PLATFORM_LINUX = r"""
options: {}
attributes:
  platform:
    support: full
    platforms: linux
"""

    # Membership of the action group declared in meta/runtime.yml.
    ACTIONGROUP_VLLM = r"""
options: {}
attributes:
  action_group:
    description: Use C(group/gpufleet.vllm.vllm) or C(group/vllm) in C(module_defaults) to set defaults for this module.
    support: full
    membership:
      - gpufleet.vllm.vllm
      - vllm
"""

    # Describes the facts attribute; the module states its support.
    FACTS = r"""
options: {}
attributes:
  facts:
    description: Action returns an C(ansible_facts) dictionary that will update existing host facts.
"""

    # Use together with the standard fragment and FACTS: a read-only facts module.
    FACTS_MODULE = r"""
options: {}
attributes:
  check_mode:
    support: full
    details:
      - This action does not modify state.
  diff_mode:
    support: N/A
    details:
      - This action does not modify state.
  idempotent:
    support: full
    details:
      - This action does not modify state.
  facts:
    support: full
"""

    # Use for the controller-side action plugins (the module file is a documentation stub).
    ACTION_PLUGIN = r"""
options: {}
attributes:
  action:
    description: Indicates this has a corresponding action plugin so some parts of the options can be executed on the controller.
    support: full
    details:
      - Runs entirely on the controller; nothing is executed on the target host.
  async:
    description: Supports being used with the C(async) keyword.
    support: none
  platform:
    support: full
    platforms: all
    details:
      - Runs on the controller, whatever the target host's platform.
"""

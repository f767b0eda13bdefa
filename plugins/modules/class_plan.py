#!/usr/bin/python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
# This file only documents the action plugin of the same name.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: class_plan
short_description: What a host class's planning decides before any host is touched
version_added: 3.0.0
description:
  - Runs on the controller, once per host class, in one call. From the class's compatibility key, the profile
    store, the host snapshots (M(gpufleet.vllm.vllm_host_snapshot)), an approved plan (if any) and the run's
    settings it works out
  - the reference profile of the key (RV(reference)), read from O(store) as M(gpufleet.vllm.kv_profile)
    O(gpufleet.vllm.kv_profile#module:state=query) reads it;
  - whether the class runs a profiled canary first, and why (RV(canary)); the rollout and C(plan.yml) read
    this answer and nothing else;
  - with O(approved_plan), what moved since the plan was approved (RV(plan_moved)); any entry stops every
    class before a host is touched;
  - the inputs of the first-run outline (RV(first_run_spec)) but the manual canary, which is decided once
    the class is planned (the P(gpufleet.vllm.first_run_outline#filter) filter renders it).
  - C(playbooks/plays/plan_classes.yml) calls it on each class's canary host; the canaries, the plan
    (M(gpufleet.vllm.kv_plan)) and the class state (P(gpufleet.vllm.class_state#filter)) follow.
  - Never changes anything.
author:
  - gpufleet maintainers (@gpufleet)
extends_documentation_fragment:
  - gpufleet.vllm.attributes
  - gpufleet.vllm.attributes.ACTION_PLUGIN
  - gpufleet.vllm.attributes.INFO_MODULE
  - gpufleet.vllm.attributes.ACTIONGROUP_VLLM
options:
  host_class:
    description: The host class.
    type: str
    required: true
  store:
    description: Directory of the profile store on the controller (as M(gpufleet.vllm.kv_profile) O(gpufleet.vllm.kv_profile#module:store)).
    type: path
    required: true
  compat:
    description:
      - The class's compatibility key (the fields M(gpufleet.vllm.kv_profile) keys profiles by), as the
        C(gpufleet.vllm.vllm_canary) role's C(compat) entry point builds it on the canary host.
    type: dict
    required: true
  hosts:
    description: The class's hosts in their rollout order; O(canary_host) must be one of them.
    type: list
    elements: str
    required: true
  snapshots:
    description:
      - Host name to its M(gpufleet.vllm.vllm_host_snapshot) result, for every host of O(hosts).
      - Each one's C(instances) (unit states) feed the outline; with O(approved_plan), each one's C(gpus)
        are held against the plan's free-memory floors.
    type: dict
    required: true
  canary_host:
    description: The class's canary host.
    type: str
    required: true
  canary_instance:
    description: The instance the canaries use on the canary host.
    type: str
    required: true
  canary_chosen:
    description: The inventory named the canary host (C(gpufleet_canary_host)) rather than the first host of the class.
    type: bool
    default: false
  approved_plan:
    description: The plan artifact being applied (C(plan.yml)'s, approved); omitted when the run plans afresh.
    type: dict
  force_profile:
    description: The run asks for a fresh profile (C(gpufleet_force_profile)), whatever the store holds.
    type: bool
    default: false
  run_canaries:
    description: The run may run canaries; V(false) in C(plan.yml), where a class without a reference is not planned.
    type: bool
    default: true
  serial:
    description:
      - The run's batches (C(gpufleet_rollout_serial), as the run settings read it), a list of sizes and shares V(N%) of the
        class's hosts; V([1, "10%", "50%"]) when omitted.
    type: raw
  max_unavailable:
    description:
      - The class's capacity budget (C(gpufleet_max_unavailable)) - at most this much of its serving capacity is away
        (drained, stopping, restarting) at once - a number of hosts (V(2)), a share of the class's hosts (V(25%), rounded
        down), or KV-cache tokens (V(500000 tokens)), the tokens each host serves as its plan records count them
        (its active instances' planned C(kv_cache_tokens) in its snapshot; a host where an active instance's record gives
        no figure goes in a batch of its own). Each batch is the serial entry's size or fewer.
      - A budget that lets no host go at once, or less than one host serves, refuses the class before any host is
        touched (RV(refusal)); omitted, only O(serial) sizes the batches.
    type: raw
  boot_timeout:
    description:
      - The service's boot timeout in seconds (C(vllm_service_boot_timeout)); V(0) derives it from the reference's
        measured boot. The outline's upper bound when no boot was measured.
    type: raw
    default: 0
  enforce_eager:
    description:
      - The service's C(enforce_eager) C(vllm serve) option (C(gpufleet_serve_args)); it sets the boot timeout derived when
        none was measured. Only this option is passed, never the whole serve options (which may hold a secret).
    type: raw
    default: false
  drain:
    description: A drain hook is set (the outline says the canary host is drained first).
    type: bool
    default: false
  gangs:
    description:
      - The members of each instance over several of the class's hosts (a gang, C(docs/multi-host.md)), leader first.
      - A gang is away whole during its batch - a capacity budget O(max_unavailable) that cannot take all its members (or what
        they serve together) at once refuses the class, naming the gang.
    type: list
    elements: list
    default: []
    version_added: 3.0.0
notes:
  - Unreadable profile files are skipped and named in warnings, as M(gpufleet.vllm.kv_profile) does.
seealso:
  - module: gpufleet.vllm.kv_profile
  - module: gpufleet.vllm.kv_plan
  - module: gpufleet.vllm.vllm_host_snapshot
"""

EXAMPLES = r"""
- name: Work out what the class needs before any host is touched
  gpufleet.vllm.class_plan:
    host_class: h200-llama8b
    store: "{{ gpufleet_profile_store }}"
    compat: "{{ gpufleet_compat }}"
    hosts: "{{ groups['h200_llama8b'] | sort }}"
    # each host's gpufleet.vllm.vllm_host_snapshot result, registered as gpufleet_snapshot
    snapshots: "{{ dict(groups['h200_llama8b'] | zip(groups['h200_llama8b'] | map('extract', hostvars, 'gpufleet_snapshot'))) }}"
    canary_host: gpu-a1
    canary_instance: main
    serial: [1, "50%"]
  register: class_plan
  run_once: true

- name: Say why the class runs a profiled canary, or that it needs none
  ansible.builtin.debug:
    msg: "{{ class_plan.canary.why if class_plan.canary.profiled else 'reference ' ~ class_plan.reference.profile.path }}"
  run_once: true
"""

RETURN = r"""
key_hash:
  description: The hash of the canonical compatibility key.
  returned: success
  type: str
  sample: 3f2a9c0e5b7d1a44
refusal:
  description: Why the class is refused before any host is touched (its capacity budget, O(max_unavailable)); empty when it is not.
  returned: success
  type: list
  elements: str
  sample: ["gpufleet_max_unavailable 10% of the class's 4 host(s) lets no host be away at once"]
batches:
  description: The class's batches, each a list of hosts, as the rollout cuts them (O(serial) within O(max_unavailable)), the canary host first.
  returned: success
  type: list
  elements: list
  sample: [[gpu-a1], [gpu-a2, gpu-a3]]
compat:
  description: The canonical compatibility key fields.
  returned: success
  type: dict
reference:
  description:
    - The profile store's answer for the key, as M(gpufleet.vllm.kv_profile) O(gpufleet.vllm.kv_profile#module:state=query)
      returns it - C(status) (V(found), V(mismatch) or V(missing)), C(profile) (the reference record; on a mismatch the
      class's newest record; V(null) when missing), C(differences), C(key_hash), C(corrupt) and C(count).
  returned: success
  type: dict
canary:
  description: Whether the class runs a profiled canary, and what the run can do with the class.
  returned: success
  type: dict
  contains:
    reference_found:
      description: The store holds a reference profile for the key.
      type: bool
    profiled:
      description: A profiled canary runs first (or would, in a dry run).
      type: bool
    why:
      description: Why a profiled canary is needed; empty when it is not.
      type: str
    plan_now:
      description: The class is planned in this run (a reference is at hand, or the canaries make one).
      type: bool
    dry_run_stop:
      description: Why a run without canaries stops before planning the class; empty when it does not stop.
      type: str
plan_moved:
  description: With O(approved_plan), what moved since it was approved (key, reference, hosts, free memory below a planned floor); else empty.
  returned: success
  type: list
  elements: str
first_run_spec:
  description:
    - The inputs of the first-run outline (P(gpufleet.vllm.first_run_outline#filter)) - the canary host and instance, whether
      a profiled canary runs, each host's instances, the batches, the boot time the collection knows and where from, the boot
      timeout, one load test's seconds, whether a drain hook is set; C(manual_canary) is V(null) until the class is planned.
  returned: success
  type: dict
"""

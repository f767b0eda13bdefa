#!/usr/bin/python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
# This file only documents the action plugin of the same name.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: kv_profile
short_description: Read, build or record vLLM reference profiles in a profile store
version_added: 1.0.0
description:
  - Runs on the controller. A profile store is a directory of YAML files, one per recorded reference
    profile, under C(<store>/<host_class>/). Files are named
    C(<host_class>--<key hash>--<UTC timestamp>--<random>.yml), written atomically under an exclusive
    lock, and never overwritten; the history is kept.
  - The compatibility key (O(compat)) is canonicalised and hashed (first 16 hex digits of the SHA-256 of its
    canonical JSON). A profile only serves the exact key it was recorded under.
  - With O(state=query), returns the newest profile of O(host_class) under the key (RV(status=found)); if
    the class only has profiles under other keys, RV(status=mismatch) and RV(differences) names the fields
    that differ from the newest one; else RV(status=missing).
  - Unreadable or edited files are skipped and reported in RV(corrupt) and as warnings; they never hide the
    other profiles and are never rewritten.
  - With O(canary), the reference profile is built from a profiled M(gpufleet.vllm.vllm_canary) run (the same
    builder as the P(gpufleet.vllm.kv_reference#filter) filter) and returned in RV(reference_profile);
    O(state=present) records it, O(state=build) only builds it.
author:
  - gpufleet maintainers (@gpufleet)
extends_documentation_fragment:
  - gpufleet.vllm.attributes
  - gpufleet.vllm.attributes.ACTION_PLUGIN
  - gpufleet.vllm.attributes.ACTIONGROUP_VLLM
attributes:
  check_mode:
    support: full
    details:
      - With O(state=present) nothing is written; the result shows the record that would be written and C(changed=true).
      - O(state=build) writes nothing in any mode.
  diff_mode:
    support: full
    details:
      - With O(state=present) the diff shows the new file.
  idempotent:
    support: partial
    details:
      - O(state=query), O(state=latest) and O(state=build) never change anything. O(state=present) records a new profile every time.
options:
  store:
    description:
      - Directory of the profile store on the controller (created when recording).
      - Required unless O(state=build), which does not use it.
    type: path
  state:
    description:
      - V(query) reads, V(present) records O(profile) (or the profile built from O(canary)) as a new file.
      - V(latest) returns the newest profile of O(host_class) whatever its key (RV(key_hash) is its key), for
        checking a deployed plan's key against the class's current reference; it needs no O(compat).
      - V(build) builds the reference profile from O(canary) and returns it in RV(reference_profile) without
        reading or writing the store (a profiled canary that is not recorded); O(store), O(host_class) and
        O(compat) are not used. V(build) was added in version 2.0.0.
    type: str
    choices: [query, present, latest, build]
    default: query
  host_class:
    description:
      - Host class name (letters, digits, C(.), C(_), C(-); at most 128 characters).
      - Required unless O(state=build).
    type: str
  compat:
    description:
      - Compatibility key fields, for example C(model), C(model_revision), C(vllm_version), C(vllm_commit),
        C(torch_version), C(cuda_version), C(gpu_name), C(total_bytes), C(compute_capability), C(driver_version),
        C(world_size), C(rank_count), C(kv_cache_dtype), C(dtype), C(quantization), C(tensor_parallel_size),
        C(pipeline_parallel_size), C(data_parallel_size), C(enforce_eager), C(compilation_config),
        C(cuda_graph_sizes), C(max_model_len), C(max_num_batched_tokens), C(max_num_seqs), C(block_size),
        C(enable_sleep_mode), C(pytorch_cuda_alloc_conf), C(kv_offloading_backend), C(kv_offloading_size),
        C(kv_transfer_config), C(cpu_offload_gb), C(limit_mm_per_prompt). Other names are kept as given.
      - Integer and boolean fields are canonicalised (V("8192") equals V(8192)); V(null) fields are left out.
      - Required with O(state=query) and O(state=present).
    type: dict
  profile:
    description:
      - Data to record with O(state=present), in the shape M(gpufleet.vllm.kv_plan) reads as its reference
        (C(ranks) with C(rank), C(free_bytes), C(kv_bytes); C(vllm_free_bytes), C(total_bytes), C(block_size), ...).
      - O(state=present) needs this or O(canary); they are mutually exclusive.
    type: dict
  canary:
    description:
      - The inputs of a profiled M(gpufleet.vllm.vllm_canary) run, from which the reference profile is built
        (per rank the pre-boot NVML free memory, vLLM's fit suggestion and the KV memory the engine allocated;
        the engine's capacity figures; the geometry; facts about the run). See the
        P(gpufleet.vllm.kv_reference#filter) filter for the profile's fields.
      - Used with O(state=present) (the built profile is recorded) and O(state=build) (it is only returned).
    type: dict
    version_added: 2.0.0
    suboptions:
      result:
        description: The registered result of the profiled M(gpufleet.vllm.vllm_canary) task.
        type: dict
        required: true
      preboot_gpus:
        description: The C(gpus) list of M(gpufleet.vllm.gpu_memory_info) read just before the canary's boot.
        type: list
        elements: dict
        required: true
      gpus:
        description: The instance's GPU indices, in rank order.
        type: list
        elements: int
        required: true
      model_config:
        description:
          - The model's C(config.json), kept as the reference's geometry. A mapping is the config itself; a
            non-empty string is the path of the file on the controller (a relative path is looked up as
            P(ansible.builtin.file#lookup) looks it up, in the role's and the playbook's C(files/)).
          - Omitted or empty uses O(canary.model_config_file).
        type: raw
      model_config_file:
        description:
          - The registered result of M(ansible.builtin.slurp) reading the model's C(config.json) on the canary host,
            used when O(canary.model_config) is empty.
          - A skipped slurp, or none, leaves the reference without geometry (its C(geometry) is V(null)).
        type: dict
      serve_args:
        description: The C(vllm serve) options of the canary, kept with the geometry.
        type: dict
      facts:
        description: Facts about the canary run kept under the profile's C(canary) (host, instance, GPUs, utilization...).
        type: dict
      members:
        description:
          - A canary gang (an instance over several hosts, C(docs/multi-host.md)) - the other members' runs. Their ranks
            join the reference's, each rank then naming its C(host) (the leader's is O(canary.facts)'s C(host)); the
            profile's C(members) lists the gang's hosts, the leader first. The engine's figures are the leader's.
        type: list
        elements: dict
        version_added: 3.0.0
        suboptions:
          host:
            description: The member's inventory name.
            type: str
            required: true
          result:
            description: The member's M(gpufleet.vllm.vllm_canary) result (its O(gpufleet.vllm.vllm_canary#module:gang) run).
            type: dict
            required: true
          preboot_gpus:
            description: The C(gpus) the member read just before its boot (its result's C(gpu_probe.gpus)).
            type: list
            elements: dict
            required: true
          gpus:
            description: The member's GPU indices of the instance, in rank order.
            type: list
            elements: int
            required: true
seealso:
  - module: gpufleet.vllm.kv_plan
  - module: gpufleet.vllm.vllm_canary
  - plugin: gpufleet.vllm.kv_reference
    plugin_type: filter
"""

EXAMPLES = r"""
- name: Record the profiled canary's figures
  gpufleet.vllm.kv_profile:
    store: "{{ gpufleet_profile_store }}"
    state: present
    host_class: h200-llama8b
    compat: "{{ gpufleet_compat }}"
    profile:
      ranks:
        - {rank: 0, free_bytes: 45097156608, kv_bytes: 32212254720}
      vllm_free_bytes: {0: 44560285696}
      total_bytes: 150754820096
      block_size: 16
      bytes_per_block: 2097152
      num_blocks: 15360
      kv_cache_tokens: 245760
  run_once: true

- name: Find the reference profile of the class
  gpufleet.vllm.kv_profile:
    store: "{{ gpufleet_profile_store }}"
    host_class: h200-llama8b
    compat:
      model: meta-llama/Llama-3.1-8B-Instruct
      model_revision: 0e9e39f249a16976918f6564b8830bc894c89659
      vllm_version: 0.33.0
      gpu_name: NVIDIA H200
      total_bytes: 150754820096
      tensor_parallel_size: 1
      max_model_len: 8192
  register: gpufleet_reference
  run_once: true

# state=present records the built profile the same way; build only returns it.
- name: Build the reference profile of a profiled canary without recording it
  gpufleet.vllm.kv_profile:
    state: build
    canary:
      result:  # the registered gpufleet.vllm.vllm_canary result (mode profiled)
        ranks:
          - {rank: 0, initial_free_bytes: 44560285696, suggested_kv_bytes_fit: 32212254720, suggested_kv_bytes_full: 42949672960}
        block_size: 16
        num_blocks: 15360
        kv_cache_tokens: 245760
        max_concurrency: 30.0
        max_model_len: 8192
        verdict: pass
      preboot_gpus:  # gpu_memory_info's gpus, read just before the boot
        - {index: 0, name: NVIDIA H200, free_bytes: 45097156608, total_bytes: 150754820096}
      gpus: [0]
      serve_args: {max_model_len: 8192}
      facts: {host: gpu-a1, instance: vllm, gpus: [0], gpu_memory_utilization: 0.9}
  register: gpufleet_built
  run_once: true

- name: Say whether the store holds a profile for this key
  ansible.builtin.debug:
    msg: >-
      {{ gpufleet_reference.status }}
      {{ gpufleet_reference.profile.path if gpufleet_reference.status == 'found'
         else gpufleet_reference.differences | default([]) }}
  run_once: true
"""

RETURN = r"""
status:
  description: With O(state=query), V(found), V(mismatch) or V(missing).
  returned: state is query
  type: str
  sample: found
profile:
  description:
    - The stored record (C(format), C(host_class), C(key_hash), C(compat), C(recorded_at), C(profile), C(path)).
    - For V(mismatch), the newest record of the class; V(null) for V(missing).
  returned: state is not build
  type: dict
differences:
  description: Key fields that differ from the newest profile of the class (C(field), C(reference), C(current)).
  returned: state is query
  type: list
  elements: dict
key_hash:
  description: Hash of the canonical O(compat).
  returned: state is not build
  type: str
  sample: 3f2a9c0e5b7d1a44
compat:
  description: The canonical key fields.
  returned: state is query
  type: dict
count:
  description: Readable profiles of the class.
  returned: state is query
  type: int
corrupt:
  description: Files skipped because they cannot be read, parsed or trusted (C(path), C(error)).
  returned: state is query
  type: list
  elements: dict
record:
  description: The record written (C(path) is V(null) in check mode).
  returned: state is present
  type: dict
reference_profile:
  description:
    - The reference profile built from O(canary), as the P(gpufleet.vllm.kv_reference#filter) filter builds it
      (C(ranks), C(vllm_free_bytes), C(total_bytes), C(gpu_name), C(block_size), C(num_blocks), C(kv_cache_tokens),
      C(max_concurrency), C(max_model_len), C(engine_kv_bytes), C(geometry), C(canary), C(canary_result)).
    - With O(state=present), the data recorded under C(profile) in RV(record).
  returned: canary is given
  type: dict
  sample:
    ranks:
      - {rank: 0, free_bytes: 45097156608, kv_bytes: 32212254720, kv_bytes_full: 42949672960}
    vllm_free_bytes: {"0": 44560285696}
    total_bytes: 150754820096
    block_size: 16
    num_blocks: 15360
"""

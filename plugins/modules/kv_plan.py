#!/usr/bin/python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
# This file only documents the action plugin of the same name.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: kv_plan
short_description: Plan a safe vLLM KV-cache byte budget for one host class
version_added: 1.0.0
description:
  - Runs on the controller. From one reference profile (a profiled vLLM boot) and the free GPU memory
    every rank of every host of the class will see at boot, computes the byte budget for
    C(--kv-cache-memory-bytes) that is safe on every rank, the free-memory floor each boot must meet,
    the C(--gpu-memory-utilization) that lets vLLM's startup check pass at that floor, the resulting
    blocks, tokens and concurrency, and a decision with reasons.
  - "Drift per rank: B_adj = B_ref - max(0, F_ref - F_boot) - G, never above C(B_ref - G).
    The weakest rank sets the budget: B_launch = min(B_adj) over all ranks of all hosts."
  - "Free floor per reference rank: F_floor = F_ref - (B_ref - G - budget); a boot is safe while
    its NVML free memory is at least the floor."
  - "Startup utilization: floor4(min(vllm_free_ref - (B_ref - G - budget) - 0.005GiB) / total) from vLLM's own
    logged free memory (lower than NVML's); without it, the NVML floor minus O(cuda_context_bytes) is used
    and the reasons say so."
  - "Decisions, first that applies: V(refuse) (no reference, rank layout differs, mixed GPU models, memory
    sizes or compatibility keys, vLLM suggestions that are not positive or where fit > full, a budget that
    cannot hold one O(max_model_len) request), V(auto_profile) (free memory moves more than
    O(unstable_share) x guard between samples, or a host flagged C(unstable)), V(split) (the weakest hosts
    cost more than O(max_capacity_loss) of the median host's budget), V(reprofile) (every rank has at least
    O(reprofile_headroom) more free memory than the reference), else V(deploy)."
  - An admission shortfall (fewer blocks than the admission plan needs, but at least one full request) is
    deployable only with O(require_admission=false); it is reported in RV(admission) and RV(reasons).
  - "RV(deployable) says whether the plan may be deployed: V(deploy), V(reprofile) and V(auto_profile) may, V(split)
    only with O(split_policy=warn), V(refuse) never; with O(require_admission) a failed admission check
    (C(admission.ok) false) may not either."
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
    description: Name of the host class, used in messages and split group names.
    type: str
  reference:
    description:
      - The reference profile, as recorded by M(gpufleet.vllm.kv_profile) (the whole record or its C(profile) part).
      - C(ranks) is a list of C({rank, free_bytes, kv_bytes}) with optional C(kv_bytes_full) (vLLM's
        "fully utilize" suggestion, used to reject impossible figures); C(free_bytes) is NVML free memory
        just before the profiled boot, C(kv_bytes) vLLM's "fit into requested memory" suggestion.
      - Optional keys are C(vllm_free_bytes) (rank to vLLM's logged initial free memory), C(total_bytes),
        C(block_size) (the profiled engine's), C(bytes_per_block) or C(geometry) (C({config, serve_args}), the model's
        C(config.json) path or content and the C(vllm serve) options), C(kv_dtype_bytes), C(gpu_name),
        C(compat_hash), and the profiled engine's own figures C(num_blocks), C(kv_cache_tokens),
        C(max_concurrency), C(max_model_len) and C(engine_kv_bytes) (the exact KV bytes behind them, when known).
      - The runtime it was profiled on, C(vllm_version), C(torch_version), C(compute_capability) and C(cuda_version)
        (a whole record's compatibility key gives them), selects that vLLM release's rules; without them the newest
        known release's rules apply and the reasons say so (docs/model-families.md, supported releases).
      - Without C(block_size) in the serve args, the block size is the one vLLM of that release picks on that device for
        that layout (CUDA or C(serve_args.device=cpu)); where that choice is not modelled, the profiled engine's
        C(block_size), else the capacity is not computed. The reasons name the block size and where it came from.
      - A rank without C(kv_bytes) (builds that log no fit suggestion, such as the CPU build) uses the KV memory
        the engine allocated, C(kv_bytes_in_use); with a known KV layout and C(num_blocks) that is the bytes of its blocks.
      - "Capacity follows the model family (docs/model-families.md): one full-attention or MLA group from the
        geometry, sliding-window, chunked-local and state-space hybrids from their KV-cache groups as vLLM groups
        them (checked against the engine's C(max_concurrency)), an unknown layout from the engine's figures, or not at all
        (and the reasons say why); never the full-attention formula for a model that is not one full-attention group."
      - Sizes accept integers or strings such as V(0.5GiB).
      - Omitted or empty means there is no reference, and the decision is V(refuse).
    type: dict
  hosts:
    description:
      - Mapping of host (or C(host/instance)) to its ranks, each C({rank, boot_free_bytes}) with optional
        C(free_min_bytes), C(free_max_bytes), C(gpu_name), C(total_bytes), C(unstable), C(history_spread_bytes) (how far
        boot-free memory moved across recent probes) and C(history_min_bytes) (the lowest it was).
      - A host may instead be a mapping with C(ranks) and host-level C(unstable), C(gpu_name), C(total_bytes),
        C(compat_hash).
      - At least one of O(hosts) and O(hosts_from) is required.
    type: dict
  hosts_from:
    description:
      - Inventory group whose hosts' C(gpufleet_gpus) facts (from M(gpufleet.vllm.gpu_memory_facts)) are planned.
      - Each entry of the host's C(gpufleet_instances) (default one instance C(vllm) on every GPU) becomes a member
        C(<host>/<instance>) whose ranks are the instance's GPUs in order.
      - A host of the group without those facts is an error.
      - A host whose inventory sets C(gpufleet_unstable) is planned as flagged unstable (decision V(auto_profile)).
      - An instance that spans hosts (a C(gang), C(docs/multi-host.md)) is one member C(<leader>/<instance>) whose ranks are
        every rank of every member host, numbered in the whole instance (a member's first rank is the GPUs of the members
        before it), each naming the C(member) host it runs on; the weakest of them sets the gang's budget. Every member must
        be a host of the group with its facts.
    type: str
  guard_bytes:
    description: Guard C(G) subtracted from every rank's budget (integer or size string).
    type: raw
    default: 512MiB
  admission:
    description:
      - "The tokens the class must hold at once, C({tokens: N}) or C({concurrency: C, tokens_per_request: L})."
      - At least one O(max_model_len) request plus the null block is always required.
    type: dict
  max_model_len:
    description:
      - vLLM's C(max_model_len); used for the one-request check and the concurrency figures.
      - Defaults to C(max_model_len) of the reference geometry's C(serve_args).
    type: int
  budget_mode:
    description:
      - V(max_safe) deploys C(B_launch).
      - V(fit_admission) deploys the whole blocks the admission plan needs plus O(fit_headroom), never more than
        C(B_launch), and reports the VRAM left free per GPU. Needs O(admission) and a predictable geometry.
    type: str
    choices: [max_safe, fit_admission]
    default: max_safe
  fit_headroom:
    description: With O(budget_mode=fit_admission), share of extra blocks on top of what the admission plan needs.
    type: float
    default: 0.1
  max_capacity_loss:
    description:
      - Split threshold. When C(B_launch) is below (1 - max_capacity_loss) x median of the hosts' own weakest
        budgets, the decision is V(split) and the outlier hosts are named.
    type: float
    default: 0.05
  reprofile_headroom:
    description:
      - When every rank has at least this much more free memory than the reference, the decision is V(reprofile)
        (a fresh profiled canary would give a larger budget). Smaller headroom is only reported.
      - Default is 10% of the smallest reference suggestion C(B_ref).
    type: raw
  unstable_share:
    description:
      - A rank whose free memory moved by more than O(unstable_share) x O(guard_bytes) between samples
        (C(free_max_bytes - free_min_bytes)) makes the decision V(auto_profile).
    type: float
    default: 0.5
  cuda_context_bytes:
    description:
      - Allowance for vLLM's CUDA context used for the startup utilization when the reference has no vLLM-logged
        free memory for every rank, and for the utilization of an C(auto_profile) plan.
    type: raw
    default: 1GiB
  gate_margin_bytes:
    description:
      - Taken off the max safe bytes before rounding, so that the weakest rank keeps at least this much free memory
        above its floor when planned, and less free memory at the gate by up to that much still passes it.
      - The default covers a monitoring agent's CUDA context started after the probe (526.8 MiB measured on an
        NVIDIA H200, docs/measurements.md) at the cost of 768 MiB of KV cache per rank (docs/rollout.md).
      - With O(gate_margin_bytes) and O(budget_granularity_bytes) both 0 the budget is the exact formula's.
    type: raw
    default: 768MiB
  budget_granularity_bytes:
    description:
      - Round the budget down to a multiple of this many bytes and then to whole KV blocks (a budget below one
        granule to whole blocks only), so that small moves of free memory between runs give the same budget. 0 is off.
    type: raw
    default: 256MiB
  keep_step_bytes:
    description:
      - Keep the O(deployed) budget instead of the planned one while it is still safe (with the gate margin), still
        holds the admission plan (or one O(max_model_len) request) and differs from the planned budget by at most this
        many bytes; 0 never keeps it. Output C(budget_choice) says what was decided and why.
    type: raw
    default: 512MiB
  deployed:
    description:
      - The plan record the class runs now (the canary host's C(<instance>.plan.json)), with C(kv_cache_memory_bytes)
        and C(compat_key_hash); only a record of the reference's compatibility key is kept.
    type: dict
  split_policy:
    description:
      - What a V(split) decision deploys. V(per_host) runs the weakest rank's budget on the outlier hosts only and
        gives the other hosts the plan of their own group (RV(host_groups)); V(warn) deploys the weakest rank's budget
        on every host of the class; both are deployable. V(fail) stops the class (not deployable).
      - Each group's plan is the class's plan as it would be with only those hosts (floors, blocks, tokens), so the
        boot gate and the boot check of a host judge it against its own group.
    type: str
    choices: [per_host, warn, fail]
    default: per_host
    version_added: 2.0.0
  unstable_scope:
    description:
      - Which hosts a rank whose free memory is not steady sends to vLLM's own profiling (V(auto_profile)).
      - V(host) sends its host only (RV(host_groups)) and plans the class from its steady hosts, which keep a fixed
        budget and are not restarted for the unsteady one; with no steady host the class is V(auto_profile).
        V(class) makes the whole class V(auto_profile), as 1.x did.
    type: str
    choices: [host, class]
    default: host
    version_added: 2.0.0
  require_admission:
    description:
      - A plan that cannot hold its admission plan (C(admission.ok) false) is not deployable (RV(deployable)).
      - The plan itself does not change.
      - V(false) deploys a plan short of its admission plan (as long as it holds one request) and reports the shortfall.
    type: bool
    default: true
    version_added: 2.0.0
  probe_history:
    description:
      - Keep each planned host's probe (every GPU's boot-free memory) in a bounded per-host history beside the profile
        store, C(<store>/.probe-history/<host>.json) (written atomically under a lock; not in check mode), and treat a
        rank whose boot-free memory moved across the last O(probe_history.window) probes by more than
        O(unstable_share) x O(guard_bytes) as unstable, as well as ranks unstable within one probe.
      - Only with O(hosts_from).
    type: dict
    suboptions:
      store:
        description: Directory the history lives in (the profile store).
        type: path
        required: true
      keep:
        description: Probes kept per host.
        type: int
        default: 20
      window:
        description: Recent probes compared (at least 2, at most O(probe_history.keep)).
        type: int
        default: 5
seealso:
  - module: gpufleet.vllm.kv_profile
  - module: gpufleet.vllm.gpu_memory_facts
"""

EXAMPLES = r"""
- name: Plan the class from probed facts
  gpufleet.vllm.kv_plan:
    host_class: h200-llama8b
    reference: "{{ gpufleet_reference.profile }}"
    hosts_from: h200_llama8b
    guard_bytes: 0.5GiB
    max_model_len: 8192
    admission:
      concurrency: 16
      tokens_per_request: 8192
  register: gpufleet_plan
  run_once: true

- name: Plan from explicit figures (seed example, 28.25 GiB; no gate margin or rounding, the exact formula)
  gpufleet.vllm.kv_plan:
    host_class: demo
    reference:
      ranks:
        - {rank: 0, free_bytes: 42GiB, kv_bytes: 30GiB}
      total_bytes: 141GiB
      bytes_per_block: 2097152
    hosts:
      gpu-a: [{rank: 0, boot_free_bytes: 40.75GiB}]
    guard_bytes: 0.5GiB
    gate_margin_bytes: 0
    budget_granularity_bytes: 0
    max_model_len: 8192
  register: seed_plan
  run_once: true

- name: Reserve only what the admission plan needs and leave the rest of the GPU free
  gpufleet.vllm.kv_plan:
    host_class: h200-llama8b
    reference: "{{ gpufleet_reference.profile }}"
    hosts_from: h200_llama8b
    max_model_len: 8192
    budget_mode: fit_admission
    admission: {concurrency: 16, tokens_per_request: 8192}
  register: gpufleet_fit_plan
  run_once: true
"""

RETURN = r"""
decision:
  description: V(deploy), V(reprofile), V(split), V(auto_profile) or V(refuse).
  returned: always
  type: str
  sample: deploy
deployable:
  description:
    - Whether the plan may be deployed, from RV(decision), O(split_policy) and, with O(require_admission),
      RV(admission) (the rule is in the module's description).
  returned: always
  type: bool
  sample: true
reasons:
  description: Why, first the reason for the decision, then notes a person can act on.
  returned: always
  type: list
  elements: str
kv_cache_memory_bytes:
  description: Budget to deploy per GPU (C(--kv-cache-memory-bytes)); V(null) when there is nothing to plan.
  returned: always
  type: int
  sample: 30333206528
max_safe_bytes:
  description: C(B_launch), the weakest rank's adjusted budget.
  returned: always
  type: int
free_floor_bytes:
  description: Reference rank to the lowest NVML free memory at which that rank is still safe with the budget.
  returned: always
  type: dict
  sample: {"0": 43754979328}
gpu_memory_utilization:
  description:
    - Value for C(--gpu-memory-utilization) so that vLLM's startup check passes at the floor.
    - For V(auto_profile), the utilization at which that check passes at the lowest free memory seen on any rank
      (this probe's samples and, with O(probe_history), the recent probes) minus the guard and O(cuda_context_bytes);
      the reasons say where it comes from.
  returned: always
  type: float
  sample: 0.2854
utilization_source:
  description:
    - V(vllm) (vLLM's logged free memory) or V(nvml) (NVML floor minus the CUDA-context allowance).
    - V(lowest_free) for an V(auto_profile) plan (the lowest free memory seen minus the guard and the allowance).
  returned: always
  type: str
vllm_floor_bytes:
  description: Per reference rank, the free memory vLLM would log at a boot on the floor.
  returned: always
  type: dict
block_size:
  description:
    - KV block size in tokens, the one vLLM uses (given, picked by vLLM of the reference's release, or the profiled
      engine's); the reasons say which. V(null) when the capacity is not known.
  returned: always
  type: int
bytes_per_block:
  description: KV bytes per block on the largest pipeline stage (V(null) when the geometry is unknown).
  returned: always
  type: int
bytes_per_token:
  description: KV bytes per token on the largest pipeline stage (V(null) when the geometry is unknown).
  returned: always
  type: int
num_blocks:
  description: Blocks vLLM makes from the budget.
  returned: always
  type: int
kv_cache_tokens:
  description: Tokens vLLM reports for those blocks.
  returned: always
  type: int
max_concurrency:
  description: Whole O(max_model_len) requests that fit at once (the null block excluded).
  returned: always
  type: int
max_concurrency_vllm:
  description: The concurrency figure vLLM logs (blocks / blocks per request).
  returned: always
  type: float
capacity_source:
  description:
    - V(geometry) (one full-attention or MLA group, tokens = blocks x block size), V(layout) (KV-cache groups as vLLM
      groups them, tokens = int(max concurrency x max_model_len) as vLLM logs them) or V(engine) (an unknown layout,
      from the profiled canary's blocks per byte and blocks per request; blocks are a lower bound); null when not computed.
  returned: always
  type: str
blocks_per_request:
  description: Blocks one O(max_model_len) request holds, summed over every KV-cache group.
  returned: always
  type: int
kv_capacity:
  description:
    - The capacity model as the boot gate reads it from the plan file (C(_kv_capacity.capacity_record)) so that a host
      counts blocks and tokens exactly as the planner does; null without a capacity model.
  returned: always
  type: dict
  contains:
    source:
      description: V(geometry), V(layout) or V(engine).
      type: str
    block_size:
      description: Tokens per block.
      type: int
    bytes_per_block:
      description: Bytes of one block of every KV-cache group (null for V(engine)).
      type: int
    blocks_per_request:
      description: Blocks one O(max_model_len) request holds, summed over every group.
      type: int
    max_model_len:
      description: The request length C(blocks_per_request) is for.
      type: int
    engine_num_blocks:
      description: The profiled engine's blocks (V(engine) only).
      type: int
    engine_kv_bytes:
      description: The profiled engine's KV bytes (V(engine) only).
      type: int
profile_max_utilization:
  description:
    - The highest C(--gpu-memory-utilization) at which vLLM's own profiling sizes at most the planned budget on every
      rank, from the profiled reference's "fully utilize" suggestion and vLLM's free memory; the boot gate's
      V(profile) policy never starts above it. Null when the reference lacks those figures.
  returned: always
  type: float
kv_layout:
  description: The model family and, for multi-group models, its KV-cache groups (C(kind), C(layers), C(window)),
    C(group_size), C(page_bytes), C(bytes_per_block), C(in_flight_tokens), C(hybrid_manager), C(notes).
  returned: always
  type: dict
per_rank:
  description: One entry per host rank.
  returned: always
  type: list
  elements: dict
  contains:
    host: {description: Host or host/instance., type: str}
    rank: {description: Rank number., type: int}
    gpu: {description: "The rank's NVML index (from O(hosts_from), or a rank entry's C(gpu)).", type: int}
    uuid: {description: "The card's NVML UUID where the probe read it (a rank entry's C(uuid)).", type: str}
    pci_bus_id: {description: "The card's PCI bus id where the probe read it (a rank entry's C(pci_bus_id)).", type: str}
    member:
      description: "On an instance that spans hosts, the member host the rank runs on (a rank entry's C(member))."
      type: str
      version_added: 3.0.0
    boot_free_bytes: {description: Free memory at boot (NVML)., type: int}
    drift_bytes: {description: C(F_ref - F_boot) (negative when more is free)., type: int}
    adjusted_bytes: {description: C(B_adj) of this rank., type: int}
    headroom_bytes: {description: Free memory above the reference., type: int}
    floor_bytes: {description: Free floor of this rank., type: int}
    margin_bytes: {description: C(boot_free_bytes - floor_bytes)., type: int}
    weakest: {description: Whether this rank sets the budget., type: bool}
    unstable: {description: Whether this rank's free memory moves too much., type: bool}
    spread_bytes: {description: C(free_max_bytes - free_min_bytes) when sampled., type: int}
weakest:
  description: The rank that sets the budget (C(host), C(rank), C(adjusted_bytes); C(member), the host it runs on, for a rank of an instance that spans hosts).
  returned: always
  type: dict
split:
  description: Suggested sub-classes (C(name), C(hosts), C(kv_cache_memory_bytes)) when the decision is V(split), else empty.
  returned: always
  type: list
  elements: dict
host_groups:
  description:
    - Hosts of the class that run a plan of their own, each group with C(name), C(hosts), C(why) (V(split) - the
      non-outlier hosts under O(split_policy=per_host) - or V(unstable) - hosts whose free memory is not steady under
      O(unstable_scope=host), planned V(auto_profile)) and C(plan) (the plan of those hosts alone, shaped like this
      result). The class's other hosts run this plan. Empty when every host runs it.
    - P(gpufleet.vllm.host_plan#filter) returns a host's plan.
  returned: always
  type: list
  elements: dict
  version_added: 2.0.0
capacity:
  description: Median host budget, capacity lost to the weakest host, threshold and outlier hosts.
  returned: always
  type: dict
unstable:
  description: Ranks or hosts whose free memory is not steady.
  returned: always
  type: list
  elements: dict
admission:
  description: Required and available blocks and tokens, shortfall, C(ok).
  returned: when O(admission) is given and capacity is known
  type: dict
budget_choice:
  description:
    - How the budget was settled - C(max_safe_bytes), C(gate_margin_bytes), C(granularity_bytes), C(rounded_bytes)
      (after the margin and the rounding), C(planned_bytes), C(deployed_bytes), C(keep_step_bytes), C(kept) (the
      deployed budget is kept, nothing restarts) and C(reason).
  returned: when the class has a weakest rank
  type: dict
fit:
  description: With V(fit_admission), the blocks chosen, the budget and C(left_free_bytes_per_gpu) versus the max safe budget.
  returned: always
  type: dict
what_if_fp8:
  description:
    - Blocks, tokens and concurrency of the max safe budget with a 1-byte (fp8) KV cache, for every KV dtype
      (C(already_one_byte) true when the cache is 1 byte already, and then the figures are the plan's own).
    - Null for state-space hybrids (their block size follows the state pages) and engine-derived capacity.
  returned: always
  type: dict
headroom:
  description: Free memory above the reference (C(min_bytes), C(max_bytes), C(ranks_with_headroom), C(reprofile_threshold_bytes)).
  returned: always
  type: dict
boot_seconds:
  description:
    - Seconds the reference's profiled canary took from its start to answering C(/health) (C(canary.startup_seconds) of
      the recorded profile); V(null) when the record has none.
    - A unit's boot timeout of V(0) is derived from it (P(gpufleet.vllm.boot_timeout#filter)).
  returned: always
  type: float
  sample: 246.7
  version_added: 2.0.0
human:
  description: The main figures rendered like V(28.25GiB).
  returned: always
  type: dict
"""

#!/usr/bin/python
# -*- coding: utf-8 -*-

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_canary
short_description: Run one vLLM boot on loopback, load it briefly and judge it
version_added: 1.0.0
description:
  - Starts C(vllm serve) on 127.0.0.1 in its own process group, waits for C(/health) while watching that the
    engine is still alive, warms it up, runs a short streamed load test against C(/v1/completions) (time to
    first token measured on the client), scrapes C(/metrics) before and after, parses the engine log per rank,
    and stops the whole process group (SIGTERM, then SIGKILL), checking that no process of it remains.
  - In O(mode=profiled) vLLM sizes its own KV cache (C(--gpu-memory-utilization)); the result carries vLLM's
    per-rank suggestions. In O(mode=manual) the engine gets O(kv_cache_memory_bytes) and the module checks that
    exactly that budget was reserved.
  - The verdict is V(pass), V(fail) or V(inconclusive). A boot the engine refuses, an engine that dies, or one that
    is not healthy within O(startup_timeout) always fails the task, with the engine's own error in the task's C(msg).
  - Nothing is left running after the module returns, whatever happened.
  - On a serving host, O(takeover) gives the canary the GPUs of an instance in the same run - it leaves a hold on the
    instance, stops it and the units it names, and starts them again afterwards (see the option). O(gpu_probe) reads
    NVML free memory just before the boot, and O(read_model_config) reads the model's C(config.json), so that a canary
    is one call to the host.
  - With O(gang), the canary runs its rank of an instance that spans hosts (a canary gang, C(docs/multi-host.md)) - the
    leader as above with its rank arguments; a member that serves no API waits until each of its ranks logged its KV
    cache and holds its engine until O(gang.stop_file) appears (a member does not stop when its leader does).
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
      - In check mode the module renders and returns RV(argv) and starts nothing.
  diff_mode:
    support: none
  idempotent:
    support: none
    details:
      - Every run boots a fresh engine and measures it; results differ between runs.
options:
  executable:
    description: Path of the C(vllm) command-line program on the target.
    type: path
    required: true
  model:
    description: Model path or id passed to C(vllm serve).
    type: str
    required: true
  mode:
    description:
      - V(profiled) lets vLLM size the KV cache from O(gpu_memory_utilization).
      - V(manual) passes O(kv_cache_memory_bytes) as C(--kv-cache-memory-bytes).
    type: str
    choices: [profiled, manual]
    default: profiled
  kv_cache_memory_bytes:
    description:
      - KV cache budget per GPU rank for O(mode=manual), as an integer or a size string such as V(28.25GiB).
      - Always passed to vLLM as a plain integer.
    type: raw
  gpu_memory_utilization:
    description:
      - Passed as C(--gpu-memory-utilization). In profiled mode it sizes the cache; in manual mode vLLM still
        runs its startup free-memory check against it.
    type: float
  serve_args:
    description:
      - Other C(vllm serve) options. Keys use underscores or dashes (V(max_model_len) becomes C(--max-model-len)).
      - V(true) gives a bare flag, V(false) gives C(--no-<flag>) (vLLM boolean options), V(null) omits the option, a list gives the flag followed by its items,
        a dictionary is passed as JSON.
      - C(host), C(port), C(gpu_memory_utilization) and C(kv_cache_memory_bytes) are refused here, the module sets them.
      - Values of options whose name looks secret (C(api_key)...) are masked in RV(argv), everywhere in the
        result and in the invocation Ansible logs on the host; the load test sends C(api_key) as a bearer token.
      - C(api_key) reaches the engine in C(VLLM_API_KEY), never on its command line. Any other secret option
        (C(hf_token)...) is refused, since it would be on the engine's command line; give it in O(secret_env)
        (C(HF_TOKEN)...).
    type: dict
    default: {}
  env:
    description:
      - Extra environment variables for the engine, none of them secret (they show in the task's invocation); secrets
        go in O(secret_env).
      - C(VLLM_CPU_KVCACHE_SPACE) silently overrides a manual budget; it is refused with O(mode=manual) and not
        inherited from the module's environment in that mode.
      - Before 3.0.0 this option was C(no_log), and Ansible masked every occurrence of its values in the result, a
        C(1) or a C(0) there (C(VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)) hiding rank 1 or 0 of the reference profile.
    type: dict
    default: {}
  secret_env:
    description:
      - Secret environment variables for the engine (C(HF_TOKEN)...), over O(env). Their values are never logged nor
        returned; as for any C(no_log) option, Ansible masks every occurrence of them in the result.
    type: dict
    default: {}
    version_added: 3.0.0
  port:
    description: Loopback port for the engine. Default is a port that is free when the module starts.
    type: int
  startup_timeout:
    description: Seconds to wait for C(/health) to answer 200.
    type: int
    default: 900
  stop_timeout:
    description: Seconds between SIGTERM and SIGKILL when stopping the engine.
    type: int
    default: 30
  load:
    description: The short load test run after warm-up. V(requests=0) skips it (the verdict is then at best V(inconclusive)).
    type: dict
    default: {}
    suboptions:
      requests:
        description: Number of measured requests.
        type: int
        default: 16
      concurrency:
        description: Requests in flight at once.
        type: int
        default: 4
      prompt_tokens:
        description: Prompt length in tokens, calibrated with the engine's own C(/tokenize).
        type: int
        default: 32
      max_tokens:
        description: Tokens generated per request (end-of-sequence is ignored so each request generates exactly this many).
        type: int
        default: 16
      warmup:
        description: Requests sent one by one before measuring.
        type: int
        default: 2
      request_timeout:
        description: Seconds one request may take.
        type: int
        default: 120
  reference:
    description:
      - The result of a profiled canary (this module's return value) to compare with, under the same request mix.
    type: dict
  tolerances:
    description: Limits for the verdict and the comparison with O(reference).
    type: dict
    default: {}
    suboptions:
      token_ratio:
        description: Least accepted ratio of this run's KV cache tokens to the reference's.
        type: float
        default: 0.9
      latency_ratio:
        description: Highest accepted ratio of TTFT p95 and e2e p95 to the reference's.
        type: float
        default: 1.5
      preemptions:
        description: Preemptions tolerated during the load test (and above the reference's).
        type: int
        default: 0
  fail_on:
    description: Verdicts that fail the task. A refused or dead boot fails the task whatever this says.
    type: list
    elements: str
    choices: [fail, inconclusive]
    default: [fail]
  log_path:
    description:
      - Keep the engine log at this path on the target (written to a temporary name, then renamed into place;
        an existing file is kept as C(<log_path>.previous)). Default is a temporary file removed afterwards.
    type: path
  cuda_visible_devices:
    description: Value of C(CUDA_VISIBLE_DEVICES) for the engine (which GPUs, in rank order).
    type: str
  gang:
    description:
      - This host's rank of an instance that spans hosts (a gang), as M(gpufleet.vllm.vllm_service) would launch it
        (P(gpufleet.vllm.gang_member_launch#filter)); unset for an instance on this host alone.
      - Every member of the canary gang runs this module at the same time (the rendezvous joins them); the member
        that serves the API (the leader) is judged as any canary, on the capacity and load of the whole gang.
      - A member that serves no API (V(serves_api=false), C(--headless)) passes when each of its O(gang.ranks) ranks
        logged its KV cache line within O(startup_timeout) and its engine ran until O(gang.stop_file) appeared; its
        result carries its ranks' figures (numbered in the whole instance, or within the member where its log numbers
        them so). A stop file left from an earlier run is removed before the engine starts; the one that stopped it is
        left to the caller that wrote it (the role removes it).
    type: dict
    version_added: 3.0.0
    suboptions:
      args:
        description: The member's rank arguments of C(vllm serve) (C(--nnodes), C(--node-rank), C(--headless) ...).
        type: list
        elements: str
        required: true
      environment:
        description: The member's environment (C(VLLM_HOST_IP), C(NCCL_SOCKET_IFNAME), C(GLOO_SOCKET_IFNAME)), over O(env).
        type: dict
        default: {}
      serves_api:
        description: Whether this member runs the API server (the leader; every member of C(dp-hybrid)).
        type: bool
        default: true
      ranks:
        description: A member that serves no API - its ranks (the GPUs it gives the instance), each of which must log its KV cache.
        type: int
      stop_file:
        description: A member that serves no API - the absolute path whose appearance stops its engine (the caller creates
          it once the leader's canary is done).
        type: path
      hold_timeout:
        description: A member that serves no API - the most seconds it holds its engine after joining, waiting for O(gang.stop_file).
        type: int
        default: 3600
      limit_memlock:
        description:
          - The engine's locked-memory limit (C(RLIMIT_MEMLOCK)), V(infinity) or bytes, as the member's unit sets
            C(LimitMEMLOCK=) (NCCL pins its buffers); unset, the engine keeps the limit of the task. Raising it needs root.
        type: str
      device_allow:
        description: Accepted as P(gpufleet.vllm.gang_member_launch#filter) gives it, not applied (no systemd sandbox here).
        type: list
        elements: str
      node_rank:
        description: Accepted as P(gpufleet.vllm.gang_member_launch#filter) gives it (the arguments carry the rank).
        type: int
      leader:
        description: Accepted as P(gpufleet.vllm.gang_member_launch#filter) gives it.
        type: str
      first_rank:
        description: Accepted as P(gpufleet.vllm.gang_member_launch#filter) gives it (the member's first rank in the instance).
        type: int
      members:
        description: Accepted as P(gpufleet.vllm.gang_member_launch#filter) gives it (every member, the leader first).
        type: list
        elements: str
  vllm_version:
    description:
      - The engine's vLLM version (the compatibility key's C(vllm_version)), so that the canary follows that release's
        rules (docs/model-families.md, supported releases).
      - A profiled canary of vLLM 0.34 or later on CUDA is started with C(--no-enable-extensible-kv-cache) unless
        O(serve_args) sets C(enable_extensible_kv_cache), because the fixed budgets the collection deploys turn that mode
        off, so the reference must be measured without it too.
    type: str
    version_added: 2.0.0
  user:
    description:
      - Run the engine as this account (the service's user), with its supplementary groups and its home as the
        working directory, as systemd starts the service; give the service's cache locations (C(HOME), C(HF_HOME),
        C(VLLM_CACHE_ROOT)) in O(env) so that the canary reads the model cache the service uses.
      - Unset runs the engine as the user the module runs as. An account that does not exist is an error.
    type: str
  group:
    description: With O(user), the group the engine runs as (default the user's primary group).
    type: str
  takeover:
    description:
      - Take the GPUs of a serving instance for the canary, and give them back. Before anything stops, a hold
        (C(<state_dir>/units/vllm-<instance>.canary-hold.json), root, 0600, written in one rename) records that the
        instance served and which other units ran; then those units and the instance stop; after the canary, whatever
        happened to it (a failed boot, a signal), they start again, and the hold is taken off only once everything it
        names started.
      - A canary cut off before that (its host rebooted, the module killed) leaves the hold; the next run's snapshot,
        canary and O(gpufleet.vllm.vllm_unit#module:instances) treat the instance as serving and start it.
      - A hold found at the start (a cut-off canary's) counts as serving; its units are stopped and started with this one's.
      - Omitted, the canary stops nothing (the GPUs must be free).
    type: dict
    version_added: 3.0.0
    suboptions:
      instance:
        description: The instance whose unit (C(vllm-<instance>.service)) the canary stops and starts again.
        type: str
        required: true
      state_dir:
        description: The collection's state directory on the host (the hold is kept in its C(units) directory).
        type: path
        default: /etc/gpufleet
      stop_service:
        description: Stop the instance and the running O(takeover.stop_units); V(false) leaves them as they are (units
          a cut-off canary's hold names are still started again, and the hold kept).
        type: bool
        default: true
      stop_units:
        description: Other units that hold the instance's GPUs (hand-written units it takes over); those that run are
          stopped and started again.
        type: list
        elements: str
        default: []
  gpu_probe:
    description:
      - Read NVML free memory of these GPUs just before the engine starts (after O(takeover) stopped what held them),
        as M(gpufleet.vllm.gpu_memory_info) reads it; returned as RV(gpu_probe). The reference profile records it.
      - Needs C(pynvml) importable by the interpreter the module runs with (the probe's, C(gpu_probe_interpreter)).
    type: dict
    version_added: 3.0.0
    suboptions:
      devices:
        description: GPU indices or UUIDs to read (default all).
        type: list
        elements: str
      samples:
        description: Samples per GPU (the lowest free memory counts).
        type: int
        default: 1
      interval:
        description: Seconds between samples.
        type: float
        default: 1.0
      service_units:
        description: Units whose processes count as this host's own engine.
        type: list
        elements: str
        default: []
      service_pids:
        description: Process ids that count as this host's own engine.
        type: list
        elements: int
        default: []
  read_model_config:
    description:
      - Read the model's C(config.json) on the host (O(model) is a local directory) before anything stops, returned as
        RV(model_config_file) the way M(ansible.builtin.slurp) returns a file. One that cannot be read fails the task
        before the canary.
    type: bool
    default: false
    version_added: 3.0.0
notes:
  - The load test uses only the Python standard library on the target.
seealso:
  - module: gpufleet.vllm.vllm_boot_check
  - module: gpufleet.vllm.gpu_memory_info
"""

EXAMPLES = r"""
- name: Profiled canary (vLLM sizes its own cache)
  gpufleet.vllm.vllm_canary:
    executable: /opt/vllm/venv/bin/vllm
    model: /srv/models/llama-3.1-8b-instruct
    mode: profiled
    gpu_memory_utilization: 0.9
    serve_args:
      max_model_len: 8192
    load: {requests: 32, concurrency: 8, prompt_tokens: 512, max_tokens: 64}
  register: profiled

- name: Manual canary with the budget vLLM suggested, compared with the profiled one
  gpufleet.vllm.vllm_canary:
    executable: /opt/vllm/venv/bin/vllm
    model: /srv/models/llama-3.1-8b-instruct
    mode: manual
    # the budget that keeps the profiled boot's memory use (a plan gives kv_plan's kv_cache_memory_bytes)
    kv_cache_memory_bytes: "{{ profiled.ranks | map(attribute='suggested_kv_bytes_fit') | min }}"
    gpu_memory_utilization: 0.9
    serve_args:
      max_model_len: 8192
    load: {requests: 32, concurrency: 8, prompt_tokens: 512, max_tokens: 64}
    reference: "{{ profiled }}"
    tolerances: {token_ratio: 0.9, latency_ratio: 1.5, preemptions: 0}
  register: manual

- name: A canary on a serving host - the instance's GPUs taken over and given back, NVML read just before the boot
  gpufleet.vllm.vllm_canary:
    executable: /opt/vllm/venv/bin/vllm
    model: /srv/models/llama-3.1-8b-instruct
    mode: manual
    kv_cache_memory_bytes: "{{ manual.kv_cache_memory_bytes }}"
    gpu_memory_utilization: 0.9
    serve_args:
      max_model_len: 8192
    load: {requests: 8, concurrency: 4, prompt_tokens: 128, max_tokens: 16}
    cuda_visible_devices: "0"
    takeover:
      instance: main
    gpu_probe:
      devices: ["0"]
  vars:
    # the interpreter must import pynvml (a vLLM virtual environment's does)
    ansible_python_interpreter: /opt/vllm/venv/bin/python
  register: taken_over

- name: Show the verdict and the comparison
  ansible.builtin.debug:
    msg: "{{ manual.verdict }}: {{ manual.kv_cache_tokens }} tokens, {{ manual.comparison.token_ratio }} of the profiled boot's"
"""

RETURN = r"""
verdict:
  description: V(pass), V(fail) or V(inconclusive).
  returned: when not in check mode
  type: str
  sample: pass
reasons:
  description: Why the verdict is not V(pass) (empty on pass).
  returned: when not in check mode
  type: list
  elements: str
argv:
  description: The C(vllm serve) command line (secret option values masked; environment not included).
  returned: always
  type: list
  elements: str
port:
  description: Loopback port the engine used.
  returned: always
  type: int
startup_seconds:
  description: Seconds from start to the first healthy C(/health).
  returned: when not in check mode
  type: float
health:
  description:
    - V(healthy), V(exited) (died while booting) or V(timeout).
    - A gang member that serves no API - V(joined) (each of its ranks logged its KV cache), V(died) or V(timeout).
  returned: when not in check mode
  type: str
engines:
  description:
    - A data-parallel instance - how many engines C(/metrics) reported; RV(kv_cache_tokens) and RV(num_blocks) are then
      the least engine's (each engine takes the budget; a plan and a reference count one engine).
  returned: when C(/metrics) reported several engines
  type: int
held:
  description: A gang member that serves no API - what ended its hold, V(stop_file), V(died) or V(timeout).
  returned: when a gang member that serves no API joined
  type: str
held_seconds:
  description: A gang member that serves no API - seconds it held its engine after joining.
  returned: when a gang member that serves no API joined
  type: float
locked_memory_limit:
  description:
    - A gang member given O(gang.limit_memlock) - the locked-memory limit its engine started with, V(infinity) or bytes;
      below the one asked for where this host lets no process raise its hard limit (as systemd then starts the unit).
  returned: when O(gang.limit_memlock) was given and the engine started
  type: str
  sample: infinity
ranks:
  description: Per rank figures from the engine log (bytes; GiB figures of the log are exact to 0.005 GiB).
  returned: when not in check mode
  type: list
  elements: dict
  contains:
    rank:
      description: Global rank.
      type: int
    initial_free_bytes:
      description: Free memory vLLM logged at startup (GPU builds).
      type: int
    suggested_kv_bytes_fit:
      description: vLLM's suggestion to fit into the requested memory (profiled GPU boots, exact).
      type: int
    suggested_kv_bytes_full:
      description: vLLM's suggestion to fully use the GPU (profiled GPU boots, exact).
      type: int
    reserved_kv_bytes:
      description: KV bytes reserved from the manual budget.
      type: int
    current_kv_bytes:
      description: KV memory in use after a profiled GPU boot (the log's "Current kv cache memory in use").
      type: int
    auto_kv_bytes:
      description: KV memory the CPU build sized itself on a profiled boot (its "Auto set" line, 0.01 GiB steps).
      type: int
num_blocks:
  description: KV cache blocks (from C(/metrics) when readable, else the log).
  returned: when not in check mode
  type: int
block_size:
  description: Tokens per block.
  returned: when not in check mode
  type: int
kv_cache_tokens:
  description: KV cache size in tokens.
  returned: when not in check mode
  type: int
  sample: 195200
max_concurrency:
  description: vLLM's maximum concurrency for C(max_model_len) requests.
  returned: when not in check mode
  type: float
kv_cache_memory_bytes:
  description: The exact KV budget C(/metrics) reports (manual mode).
  returned: when not in check mode
  type: int
max_model_len:
  description: The C(max_model_len) of the engine's capacity line (the length its max concurrency is for).
  returned: when not in check mode
  type: int
load:
  description: Load test figures (seconds for latencies).
  returned: when not in check mode
  type: dict
  contains:
    completed:
      description: Requests that streamed to the end.
      type: int
    failed:
      description: Requests that failed.
      type: int
    ttft_p50:
      description: Median time to first token.
      type: float
    ttft_p95:
      description: 95th percentile time to first token.
      type: float
    e2e_p50:
      description: Median end-to-end latency.
      type: float
    e2e_p95:
      description: 95th percentile end-to-end latency.
      type: float
    throughput_rps:
      description: Completed requests per second.
      type: float
    warmup_ok:
      description: Whether every warm-up request succeeded (a failed warm-up fails the verdict).
      type: bool
preemptions:
  description: Preemptions counted by C(/metrics) during the load test (delta).
  returned: when not in check mode
  type: int
engine_errors:
  description: Failures the engine logged (V(kind), V(rank), V(message)).
  returned: when not in check mode
  type: list
  elements: dict
comparison:
  description: Comparison with O(reference) (ratios, own verdict and reasons); V(null) without a reference.
  returned: when not in check mode
  type: dict
log_tail:
  description: Last lines of the engine log.
  returned: when the verdict is not pass
  type: str
log_path:
  description: Where the engine log was kept.
  returned: when O(log_path) is set
  type: str
takeover:
  description: What the canary found and did with O(takeover) (in check mode, what it would stop).
  returned: with O(takeover)
  type: dict
  contains:
    unit:
      description: The instance's unit.
      type: str
    instance_serving:
      description: The instance served before the canary (it was active, or a cut-off canary's hold was there).
      type: bool
    instance_active:
      description: The instance's unit was active (or activating) when the canary started.
      type: bool
    active_state:
      description: The instance unit's C(ActiveState) when the canary started.
      type: str
    held_before:
      description: A cut-off canary's hold was there.
      type: bool
    stopped_units:
      description: The other units the canary stopped and started again (those that ran, and those a cut-off canary stopped).
      type: list
      elements: str
    hold_written:
      description: This canary left the hold.
      type: bool
    stopped:
      description: The units stopped, in that order.
      type: list
      elements: str
    started:
      description: The units started again.
      type: list
      elements: str
    hold_removed:
      description: The hold was taken off (everything it names runs again).
      type: bool
    errors:
      description: Units that could not be stopped or started again (the hold stays then).
      type: list
      elements: str
gpu_probe:
  description: NVML free memory just before the boot (M(gpufleet.vllm.gpu_memory_info)'s result, C(gpus) per GPU).
  returned: with O(gpu_probe), when not in check mode
  type: dict
model_config_file:
  description: The model's C(config.json) as M(ansible.builtin.slurp) returns it (C(content) base64, C(source), C(encoding)).
  returned: with O(read_model_config)
  type: dict
"""

import base64
import os
import platform
import traceback
from typing import Any, Mapping

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible.module_utils.common.text.converters import to_native
from ansible.module_utils.common.validation import check_type_dict

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._boot_check import primary_error
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._canary import (
    CanarySpec,
    GangMember,
    Terminated,
    Tolerances,
    canary_argv,
    raise_on_termination,
    run_canary,
    termination_deferred,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._canary_takeover import (
    ARGUMENT_SPEC as TAKEOVER_SPEC,
    Takeover,
    TakeoverError,
    TakeoverState,
    check_params as check_takeover,
    give_back,
    read_state,
    take,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._engine_process import free_port
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._load_test import LoadSpec
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import EngineSpecError, option_name, redact_argv
from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._gpu_memory import (
    ARGUMENT_SPEC as GPU_PROBE_SPEC,
    PYNVML_IMPORT_ERROR,
    check_params as check_gpu_probe,
    host_message,
    module_runner,
    pynvml,
    read as read_gpus,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._nvml_probe import NvmlProbeError
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import SizeError, parse_size
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError, integer, is_secret_option, port, text


def build_spec(params: Mapping[str, Any]) -> CanarySpec:
    kv_bytes = None
    if params["kv_cache_memory_bytes"] is not None:
        kv_bytes = parse_size(params["kv_cache_memory_bytes"], "kv_cache_memory_bytes")
    load = params["load"] or {}
    if params["port"] is not None:
        port(params["port"], "port")
    integer(params["startup_timeout"], "startup_timeout", low=1)
    integer(params["stop_timeout"], "stop_timeout", low=1)
    if params["cuda_visible_devices"] is not None:
        text(params["cuda_visible_devices"], "cuda_visible_devices", allow_empty=True)
    if params.get("vllm_version") is not None:
        text(params["vllm_version"], "vllm_version")
    if params.get("user") == "root":
        raise ValidationError("user: must not be root; the canary runs as the unprivileged user its instance runs as")
    # api_key goes to the engine in VLLM_API_KEY (canary_env); any other secret option would be on its command line
    on_command_line = sorted(str(key) for key in params["serve_args"] or {}
                             if is_secret_option(str(key)) and option_name(str(key)) != "api-key")
    if on_command_line:
        raise ValidationError(f"serve_args {', '.join(on_command_line)} would put a secret on the engine's command line "
                              "(/proc/PID/cmdline, readable by every user of the host); give it in secret_env instead "
                              "(for example HF_TOKEN for hf_token)")
    return CanarySpec(
        executable=params["executable"],
        model=params["model"],
        mode=params["mode"],
        kv_cache_memory_bytes=kv_bytes,
        gpu_memory_utilization=params["gpu_memory_utilization"],
        serve_args=dict(params["serve_args"] or {}),
        env={**(params["env"] or {}), **(params.get("secret_env") or {})},
        port=params["port"],
        startup_timeout=float(params["startup_timeout"]),
        stop_timeout=float(params["stop_timeout"]),
        load=LoadSpec(
            requests=load.get("requests", 16),
            concurrency=load.get("concurrency", 4),
            prompt_tokens=load.get("prompt_tokens", 32),
            max_tokens=load.get("max_tokens", 16),
            warmup=load.get("warmup", 2),
            request_timeout=float(load.get("request_timeout", 120)),
        ),
        reference=params["reference"],
        tolerances=Tolerances.from_dict(params["tolerances"]),
        log_path=params["log_path"],
        cuda_visible_devices=params["cuda_visible_devices"],
        user=params["user"],
        group=params["group"],
        vllm_version=params.get("vllm_version"),
        gang=GangMember.from_dict(params["gang"]) if params.get("gang") else None,
    )


def read_model_config(model: str) -> dict[str, Any]:
    """The model's ``config.json`` on this host, as ``ansible.builtin.slurp`` returns a file."""
    if not model.startswith("/"):
        raise ValueError(f"read_model_config: the model must be a local directory (an absolute path), got {model!r}")
    path = os.path.join(model, "config.json")
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise ValueError(f"read_model_config: cannot read {path}: {exc.strerror or exc}") from None
    return {"content": base64.b64encode(data).decode("ascii"), "source": path, "encoding": "base64"}


def takeover_failure(state: TakeoverState | None) -> str:
    """What a canary that took over an instance left behind when not everything started again, for its message."""
    if state is None or not state.errors:
        return ""
    return (f"; what it stopped did not all start again ({'; '.join(state.errors)}): the hold on {state.unit} stays, "
            "and the next run's canary or deploy starts it")


def run_taken_over(module: AnsibleModule, spec: CanarySpec, takeover: Takeover | None,
                   state: TakeoverState | None) -> tuple[dict[str, Any] | None, dict[str, Any], str | None]:
    """Take over the instance's GPUs, read NVML, run the canary, give the GPUs back (always).

    ``(the canary's result or None, the probe result, the error that stopped it or None)``: whatever
    went wrong, the caller reports the takeover with it.
    """
    params = module.params
    run = module_runner(module)
    extra: dict[str, Any] = {}
    error: str | None = None
    result: dict[str, Any] | None = None
    # a SIGTERM or SIGHUP (the task's timeout, a stopped connection) still gives the GPUs back
    restore_signals = raise_on_termination()
    try:
        try:
            if takeover is not None and state is not None:
                take(takeover, state, run)
            if params["gpu_probe"]:
                probe = read_gpus(dict(params["gpu_probe"]), pynvml, platform.node(), run)
                for warning in probe.pop("warnings", []):
                    module.warn(warning)
                extra["gpu_probe"] = probe
            result = run_canary(spec)
        finally:
            if takeover is not None and state is not None:
                # not cut short by a signal: one that arrives meanwhile is raised once everything started
                with termination_deferred():
                    give_back(takeover, state, run)
    except TakeoverError as exc:
        error = f"vLLM canary ({spec.mode}): {exc}"
    except NvmlProbeError as exc:
        error = f"vLLM canary ({spec.mode}): NVML before the boot: {host_message(exc, platform.node())}"
    except Terminated as exc:
        error = f"vLLM canary ({spec.mode}): {exc}"
    except (EngineSpecError, SizeError, ValidationError, ValueError) as exc:
        error = f"vLLM canary ({spec.mode}): {to_native(exc)}"
    except Exception as exc:  # pylint: disable=broad-exception-caught
        error = f"vllm_canary failed unexpectedly: {to_native(exc)}"
        extra["exception"] = traceback.format_exc()
    finally:
        restore_signals()
    return result, extra, error


def _secret_serve_arg_values(serve_args: Any) -> set[str]:
    """The values of the secret-looking options of ``serve_args`` (api_key...), to mask wherever they would appear;
    ``serve_args`` as given (a mapping, or the JSON or ``k=v`` text the module turns into one)."""
    if isinstance(serve_args, str):
        try:
            serve_args = check_type_dict(serve_args)
        except (TypeError, ValueError):
            return set()
    values: set[str] = set()
    for key, value in (serve_args if isinstance(serve_args, Mapping) else {}).items():
        if value not in (None, True, False, "") and is_secret_option(str(key)):
            values.update(str(item) for item in (value if isinstance(value, list) else [value]))
    return values


class _CanaryModule(AnsibleModule):  # type: ignore[misc]  # AnsibleModule is Any: ansible-core ships no type information
    """AnsibleModule that masks the secret serve_args values from the moment its parameters are loaded: Ansible logs
    the invocation on the host (the journal), and a parameter that fails validation returns it, while the module is
    set up, before :func:`main` could name them."""

    def _load_params(self) -> None:
        super()._load_params()
        self.no_log_values.update(_secret_serve_arg_values(self.params.get("serve_args")))


def main() -> None:
    module = _CanaryModule(
        argument_spec=dict(
            executable=dict(type="path", required=True),
            model=dict(type="str", required=True),
            mode=dict(type="str", choices=["profiled", "manual"], default="profiled"),
            kv_cache_memory_bytes=dict(type="raw"),
            gpu_memory_utilization=dict(type="float"),
            serve_args=dict(type="dict", default={}),
            env=dict(type="dict", default={}),
            secret_env=dict(type="dict", default={}, no_log=True),
            port=dict(type="int"),
            startup_timeout=dict(type="int", default=900),
            stop_timeout=dict(type="int", default=30),
            load=dict(
                type="dict",
                default={},
                options=dict(
                    requests=dict(type="int", default=16),
                    concurrency=dict(type="int", default=4),
                    prompt_tokens=dict(type="int", default=32, no_log=False),
                    max_tokens=dict(type="int", default=16, no_log=False),
                    warmup=dict(type="int", default=2),
                    request_timeout=dict(type="int", default=120),
                ),
            ),
            reference=dict(type="dict"),
            tolerances=dict(
                type="dict",
                default={},
                options=dict(
                    token_ratio=dict(type="float", default=0.9, no_log=False),
                    latency_ratio=dict(type="float", default=1.5),
                    preemptions=dict(type="int", default=0),
                ),
            ),
            fail_on=dict(type="list", elements="str", choices=["fail", "inconclusive"], default=["fail"]),
            log_path=dict(type="path"),
            cuda_visible_devices=dict(type="str"),
            gang=dict(type="dict", options=dict(
                args=dict(type="list", elements="str", required=True),
                environment=dict(type="dict", default={}),
                serves_api=dict(type="bool", default=True),
                ranks=dict(type="int"),
                stop_file=dict(type="path"),
                hold_timeout=dict(type="int", default=3600),
                limit_memlock=dict(type="str"),
                # what gang_member_launch gives besides, for the unit: taken as it comes, not applied here
                device_allow=dict(type="list", elements="str"),
                node_rank=dict(type="int"),
                leader=dict(type="str"),
                first_rank=dict(type="int"),
                members=dict(type="list", elements="str"),
            )),
            vllm_version=dict(type="str"),
            user=dict(type="str"),
            group=dict(type="str"),
            takeover=dict(type="dict", options=TAKEOVER_SPEC),
            gpu_probe=dict(type="dict", options=GPU_PROBE_SPEC),
            read_model_config=dict(type="bool", default=False),
        ),
        required_if=[("mode", "manual", ("kv_cache_memory_bytes",))],
        supports_check_mode=True,
    )
    params = module.params
    # Secret-looking serve_args values (api_key...) are masked wherever they would appear.
    module.no_log_values.update(_secret_serve_arg_values(params["serve_args"]))
    extra: dict[str, Any] = {}
    state: TakeoverState | None = None
    try:
        spec = build_spec(params)
        takeover = check_takeover(params["takeover"]) if params["takeover"] else None
        # first: whatever fails after this, the result says whether the instance served (its caller waits for it)
        if takeover is not None:
            state = read_state(takeover, module_runner(module))
            extra["takeover"] = state.as_result()
        if params["gpu_probe"]:
            check_gpu_probe(dict(params["gpu_probe"]))
            if pynvml is None:
                module.fail_json(msg=missing_required_lib("nvidia-ml-py (pynvml), for gpu_probe"), exception=PYNVML_IMPORT_ERROR,
                                 **extra)
        # before anything stops: a model whose config cannot be read fails here
        if params["read_model_config"]:
            extra["model_config_file"] = read_model_config(spec.model)
        if module.check_mode:
            port = spec.port or free_port(spec.host)
            module.exit_json(changed=False, argv=redact_argv(canary_argv(spec, port)), port=port, **extra)
    except (EngineSpecError, SizeError, ValidationError, TakeoverError, ValueError) as exc:
        module.fail_json(msg=to_native(exc), **extra)
    except Exception as exc:  # pylint: disable=broad-exception-caught
        module.fail_json(msg=f"vllm_canary failed unexpectedly: {to_native(exc)}", exception=traceback.format_exc(), **extra)

    result, probed, error = run_taken_over(module, spec, takeover, state)
    extra.update(probed)
    if state is not None:
        extra["takeover"] = state.as_result()
    changed = bool(spec.log_path) or bool(state is not None and (state.stopped or state.started or state.hold_written or state.hold_removed))
    left = takeover_failure(state)
    if error is not None or result is None:
        module.fail_json(msg=(error or f"vLLM canary ({spec.mode}) did not run") + left, changed=changed, **extra)
        return
    result.update(extra)
    verdict = result["verdict"]
    # a gang member that serves no API is up once its ranks joined its gang
    if result.get("health") not in ("healthy", "joined"):
        root = primary_error(result.get("engine_errors") or [])
        module.fail_json(
            msg=(f"vLLM canary ({spec.mode}) did not boot: " + "; ".join(result["reasons"]) if result["reasons"]
                 else f"vLLM canary ({spec.mode}) did not boot ({result.get('health')})") + left,
            engine_error=root, changed=changed, **result,
        )
    if verdict in params["fail_on"]:
        module.fail_json(msg=f"vLLM canary ({spec.mode}) verdict {verdict}: " + "; ".join(result["reasons"]) + left,
                         changed=changed, **result)
    if left:
        module.fail_json(msg=f"vLLM canary ({spec.mode}) verdict {verdict}" + left, changed=changed, **result)
    module.exit_json(changed=changed, **result)


if __name__ == "__main__":
    main()

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
      - Values of options whose name looks secret (C(api_key)...) are masked in RV(argv) and everywhere in the
        result; the load test sends C(api_key) as a bearer token.
    type: dict
    default: {}
  env:
    description:
      - Extra environment variables for the engine. Their values are never logged nor returned.
      - As for any C(no_log) option, Ansible masks every occurrence of these values in the result, so avoid short,
        common values here (put them in the engine's environment by other means).
      - C(VLLM_CPU_KVCACHE_SPACE) silently overrides a manual budget; it is refused with O(mode=manual) and not
        inherited from the module's environment in that mode.
    type: dict
    default: {}
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
  description: V(healthy), V(exited) (died while booting) or V(timeout).
  returned: when not in check mode
  type: str
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
"""

import traceback
from typing import Any, Mapping

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.text.converters import to_native

from ansible_collections.gpufleet.vllm.plugins.module_utils._boot_check import primary_error
from ansible_collections.gpufleet.vllm.plugins.module_utils._canary import CanarySpec, Tolerances, canary_argv, run_canary
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine_process import free_port
from ansible_collections.gpufleet.vllm.plugins.module_utils._load_test import LoadSpec
from ansible_collections.gpufleet.vllm.plugins.module_utils._serve_argv import EngineSpecError, redact_argv
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
    return CanarySpec(
        executable=params["executable"],
        model=params["model"],
        mode=params["mode"],
        kv_cache_memory_bytes=kv_bytes,
        gpu_memory_utilization=params["gpu_memory_utilization"],
        serve_args=dict(params["serve_args"] or {}),
        env=dict(params["env"] or {}),
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
    )


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            executable=dict(type="path", required=True),
            model=dict(type="str", required=True),
            mode=dict(type="str", choices=["profiled", "manual"], default="profiled"),
            kv_cache_memory_bytes=dict(type="raw"),
            gpu_memory_utilization=dict(type="float"),
            serve_args=dict(type="dict", default={}),
            env=dict(type="dict", default={}, no_log=True),
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
            vllm_version=dict(type="str"),
            user=dict(type="str"),
            group=dict(type="str"),
        ),
        required_if=[("mode", "manual", ("kv_cache_memory_bytes",))],
        supports_check_mode=True,
    )
    params = module.params
    # Secret-looking serve_args values (api_key...) are masked wherever they would appear.
    for key, value in (params["serve_args"] or {}).items():
        if value not in (None, True, False, "") and is_secret_option(str(key)):
            for item in value if isinstance(value, list) else [value]:
                module.no_log_values.add(str(item))
    try:
        spec = build_spec(params)
        if module.check_mode:
            port = spec.port or free_port(spec.host)
            module.exit_json(changed=False, argv=redact_argv(canary_argv(spec, port)), port=port)
        result = run_canary(spec)
    except (EngineSpecError, SizeError, ValidationError, ValueError) as exc:
        module.fail_json(msg=to_native(exc))
    except Exception as exc:  # pylint: disable=broad-exception-caught
        module.fail_json(msg=f"vllm_canary failed unexpectedly: {to_native(exc)}", exception=traceback.format_exc())

    verdict = result["verdict"]
    changed = bool(spec.log_path)
    if result.get("health") != "healthy":
        root = primary_error(result.get("engine_errors") or [])
        module.fail_json(
            msg=f"vLLM canary ({spec.mode}) did not boot: " + "; ".join(result["reasons"]) if result["reasons"]
            else f"vLLM canary ({spec.mode}) did not boot ({result.get('health')})",
            engine_error=root, changed=changed, **result,
        )
    if verdict in params["fail_on"]:
        module.fail_json(
            msg=f"vLLM canary ({spec.mode}) verdict {verdict}: " + "; ".join(result["reasons"]),
            changed=changed, **result,
        )
    module.exit_json(changed=changed, **result)


if __name__ == "__main__":
    main()

#!/usr/bin/python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
# This file only documents the action plugin of the same name.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: rollout_bake
short_description: Bake a rollout batch and judge its changed hosts from their engines' live metrics
version_added: 3.0.0
description:
  - Runs on the controller, after a batch's hosts passed their boot checks and took traffic again.
    Reads the C(/metrics) of every engine of the batch's changed hosts (the canary) and of the class's
    hosts not yet changed (the baseline), all at once, waits O(seconds), reads them again, and compares
    what happened in between, in the manner of Kayenta - request success rate, the 90th percentile of time
    to first token, of time per output token and of the whole request (vLLM's histograms), preemptions
    per request, KV-cache usage at the end, and (from Prometheus) the tightest GPU memory margin.
  - With O(prometheus_url), the readings come from that Prometheus server's HTTP query API instead, one instant
    query per reading for every engine - the series whose C(instance) label is the engine's C(host:port) as in its
    URL (Prometheus's label for a target it scrapes at that address). An engine it has no series of at the start
    counts from zero (started since its last scrape); one it has none of at the end is unread. The GPU memory
    margins come from the C(gpufleet_vllm_margin_bytes) series the metrics exporter writes for node_exporter's
    textfile collector, matched by the address of the host's engines.
  - Each check has thresholds and a minimum number of finished requests; the verdict is C(pass), C(fail) or
    C(inconclusive) (too few requests), and O(inconclusive) says what an inconclusive verdict counts as.
    A latency check with no baseline host and no absolute limit is C(skipped). The checks and their defaults
    are those of the C(gpufleet_analysis) variable (docs/rollout.md).
  - An engine of the batch that cannot be read, at the start or the end, is a failed analysis that names its
    URL. A baseline host that cannot be read is left out of the baseline and named in the result.
  - An engine that restarted during the bake counts from zero (its counters went down).
  - The action never fails on the verdict; the caller decides (rollout.yml rolls the batch's changed hosts
    back when the verdict counts as C(fail)).
author:
  - gpufleet maintainers (@gpufleet)
extends_documentation_fragment:
  - gpufleet.vllm.attributes
  - gpufleet.vllm.attributes.ACTION_PLUGIN
  - gpufleet.vllm.attributes.INFO_MODULE
options:
  seconds:
    description: How long the bake lasts, from the first reading to the second (0 to 86400).
    type: int
    required: true
  canary:
    description:
      - The engines of the batch's changed hosts, as the filter P(gpufleet.vllm.metrics_targets#filter) gives them.
    type: list
    elements: dict
    required: true
    suboptions: &targets
      host:
        description: The inventory host the engine runs on (a host's engines count together).
        type: str
        required: true
      instance:
        description: The instance's name.
        type: str
        required: true
      url:
        description: The engine's C(/metrics) URL, as the controller reaches it.
        type: str
        required: true
  baseline:
    description: The engines of the class's hosts not yet changed in this run. Empty for the last batch of a class.
    type: list
    elements: dict
    default: []
    suboptions: *targets
  checks:
    description:
      - Check name to its settings over the defaults (C(success_rate), C(ttft_p90), C(itl_p90), C(e2e_p90),
        C(preemptions), C(kv_usage), C(memory_margin)); C(false) turns a check off. Unknown checks or settings are an error naming them.
    type: raw
  inconclusive:
    description: What an inconclusive verdict counts as.
    type: str
    default: fail
    choices: [fail, pass]
  timeout:
    description: Seconds each reading of one engine (or each query of O(prometheus_url)) may take.
    type: float
    default: 10.0
  prometheus_url:
    description:
      - The base URL of a Prometheus server that scrapes the engines (C(http://prometheus:9090)), to read the
        metrics from its query API rather than from each engine. Credentials in the URL are refused.
    type: str
  since:
    description:
      - When the batch started (seconds since the epoch, the controller's clock). With O(prometheus_url), the
        C(memory_margin) check reads only a margin the metrics exporter wrote after it saw the instance start at or
        after this moment (C(gpufleet_vllm_last_start_timestamp_seconds)); an export from before the deploy, which
        judges the previous units against the previous floor, leaves the check skipped, saying so.
      - The hosts' clocks must agree with the controller's to within the time between the batch's start and the
        units' start (NTP).
    type: float
seealso:
  - plugin: gpufleet.vllm.metrics_targets
    plugin_type: filter
"""

EXAMPLES = r"""
# gpufleet_metrics_targets: a host's engines, as gpufleet.vllm.metrics_targets gives them
# (rollout.yml keeps it for every host of a class with gpufleet_bake_seconds)
- name: Bake the batch and judge its changed hosts against the hosts not yet changed
  gpufleet.vllm.rollout_bake:
    seconds: "{{ gpufleet_bake_seconds }}"
    canary: "{{ changed_hosts | map('extract', hostvars, 'gpufleet_metrics_targets') | flatten }}"
    baseline: "{{ unchanged_hosts | map('extract', hostvars, 'gpufleet_metrics_targets') | flatten }}"
    checks:
      itl_p90: {max_ratio: 1.3, min_requests: 5}
      ttft_p90: {max_seconds: 2.0, min_requests: 5}
      success_rate: {min_requests: 5}
      e2e_p90: false
      preemptions: false
  register: bake
  run_once: true

- name: Stop when the batch does worse than the baseline
  ansible.builtin.assert:
    that: bake.analysis.effective == 'pass'
    fail_msg: "{{ bake.msg }}"
  run_once: true
"""

RETURN = r"""
analysis:
  description:
    - The verdict (C(pass), C(fail), C(inconclusive)), what it counts as (C(effective)), every check with its
      verdict, why, the canary's and the baseline's figures, thresholds and sample counts, how many hosts each
      side counted, and the baseline hosts that could not be read (C(baseline_unread)); C(unread) lists the
      batch's engines that could not be read.
  returned: always
  type: dict
  sample:
    verdict: fail
    effective: fail
    canary_hosts: 1
    baseline_hosts: 1
    checks:
      - name: itl_p90
        verdict: fail
        why: "0.0475 s on the canary, 0.009 s on the baseline: 5.28 times (above 3)"
        canary: 0.0475
        baseline: 0.009
        threshold: {max_ratio: 3.0, max_seconds: null}
        samples: {canary: 12.0, baseline: 96.0}
    baseline_unread: {}
    source: each engine's /metrics
started:
  description: When the first reading started (UTC).
  returned: always
  type: str
finished:
  description: When the bake ended (UTC).
  returned: always
  type: str
seconds:
  description: The bake's length as asked.
  returned: always
  type: int
source:
  description: Where the readings came from (C(each engine's /metrics), or C(Prometheus URL)).
  returned: always
  type: str
canary_hosts:
  description: The batch's changed hosts judged.
  returned: always
  type: list
  elements: str
baseline_hosts:
  description: The hosts given as the baseline.
  returned: always
  type: list
  elements: str
msg:
  description: One line with the verdict and every check's.
  returned: always
  type: str
"""

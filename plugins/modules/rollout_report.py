#!/usr/bin/python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
# This file only documents the action plugin of the same name.
from __future__ import annotations

DOCUMENTATION = r"""
---
module: rollout_report
short_description: Write the report of a gpufleet.vllm run (JSON, Markdown, HTML)
version_added: 1.0.0
description:
  - Runs on the controller. Builds the report of a rollout, plan or probe run from what the playbook
    collected and writes it into a new directory C(<report_dir>/<kind>-<UTC timestamp>/) holding
    C(report.json) (versioned, C(schema_version) 2), C(report.md) and C(report.html).
  - C(report.html) is one self-contained page (inline CSS and SVG, no script, no external asset) with,
    per class, the decision and reasons, the launch bytes, blocks and tokens, the free-memory floor, the
    startup C(--gpu-memory-utilization), the weakest host and rank, the fp8 what-if, the right-size saving,
    a per host/rank chart and table of boot free memory against the floor and the drift, and the profiled
    and manual canaries side by side; then the batch timeline with each host's outcome and the rolled-back
    hosts with the engine's error.
  - A probe report (O(kind=probe)) shows, per host, its driver versions, each GPU's total, free and boot-free
    memory with a chart of the driver reserve, other processes, this host's own engine and free memory, the
    processes holding GPU memory, and each instance's unit state and the plan it runs with; hosts that could
    not be probed are listed with their error.
  - The report records whether the run was a dry run (C(check_mode), from C(ansible_check_mode) unless
    O(data) gives it), and says so in the summary.
  - The files are written into a temporary directory that is then renamed into place, so a run directory
    is complete or absent. An existing run directory is never replaced; a later name (C(-2), C(-3)...) is
    taken instead.
  - Reports written by older versions of the collection (schema 0, the flat JSON summary, and schema 1,
    without C(probe) and C(check_mode)) are read by the same renderer.
author:
  - gpufleet maintainers (@gpufleet)
extends_documentation_fragment:
  - gpufleet.vllm.attributes
  - gpufleet.vllm.attributes.ACTION_PLUGIN
attributes:
  check_mode:
    support: full
    details:
      - In check mode the report is built and returned but nothing is written. The playbooks of this collection
        set C(check_mode=false) on this task, so that a dry run (C(--check)) still leaves its report on the
        controller.
  diff_mode:
    support: none
  idempotent:
    support: none
    details:
      - Every run writes a new run directory.
options:
  report_dir:
    description:
      - Controller directory under which the run directory is created. It must exist and be writable.
      - Omitted or empty means the report is only returned, not written.
    type: path
  kind:
    description: What kind of run this is; the run directory name starts with it.
    type: str
    choices: [rollout, plan, probe, audit]
    default: rollout
  data:
    description:
      - What the playbook collected.
      - C(started), C(finished) are ISO 8601 times of the run.
      - C(classes) maps each class name to its class state (C(ok), C(failed), C(plan) as
        M(gpufleet.vllm.kv_plan) returns it, C(key_hash), C(manual_canary), C(reasons)) and optionally
        C(canaries), C({profiled, manual}) results of M(gpufleet.vllm.vllm_canary).
      - C(hosts) maps each host to C({class, batch, pending, touched, error, failed_task, rollback_failed}); C(batch) is
        the number of the serial batch the host ran in, C(pending) the instances that changed, C(touched) whether
        its units were stopped, C(error) the message of the failure that stopped it, C(rollback_failed) that a
        rollback of it failed (its outcome is C(failed), not C(rolled_back)).
      - C(batches) is a list of C({index, total, hosts, started, finished, analysis}), C(analysis) being the bake's
        verdict on the batch (M(gpufleet.vllm.rollout_bake)'s RV(gpufleet.vllm.rollout_bake#module:analysis), with
        C(seconds), C(started), C(finished), and C(error) for a bake that failed by itself), when its class bakes.
      - C(check_mode) says whether the run was a dry run (default C(ansible_check_mode)).
      - "C(probe) (required with O(kind=probe)) maps C(hosts) to C({host: {class, error, driver_version,
        cuda_driver_version, nvml_version, runtime, gpus, instances}}) where C(gpus) are the
        RV(gpufleet.vllm.gpu_memory_info#module:gpus) entries and each instance is C({name, unit, gpus, port,
        load_state, active_state, sub_state, plan}), C(plan) being the instance's plan file or null. A probe
        report's hosts come from this section."
      - "C(runtime), optional, is C({record, error}): the RV(gpufleet.vllm.vllm_host_snapshot#module:install_record) and
        RV(gpufleet.vllm.vllm_host_snapshot#module:install_record_error) of the host snapshot; the report keeps the
        release, the package and version of its stamp, and the error."
      - "C(audit) (required with O(kind=audit)) maps C(hosts) to C({host: {class, error, instances}}) where
        C(instances) are the RV(gpufleet.vllm.vllm_audit#module:instances) entries. An audit report's hosts come
        from this section; its summary lists the instances that would be refused at their next start."
      - Omitted, the rollout's data is read from the hostvars of the O(hosts_from) group (what
        C(playbooks/rollout.yml) and C(playbooks/plan.yml) keep on each host and on C(localhost)).
    type: dict
  hosts_from:
    description:
      - Without O(data), the inventory group whose hosts the report covers. Per class it reads the canary host's
        C(gpufleet_class_state), C(gpufleet_reference) and C(vllm_canary_result); per host its class, batch
        (C(gpufleet_batch_index)), pending instances (C(vllm_service_pending)), C(vllm_service_touched) and, for a host
        that failed in a serial batch, C(ansible_failed_result) and C(ansible_failed_task) (C(gpufleet_own_failure) when a
        class rollback ran in its name, C(gpufleet_host_error) with C(gpufleet_rollback_failed) when its rollback
        failed); from C(localhost), C(gpufleet_run.started), C(gpufleet_batches), and what a class rollback did
        (C(gpufleet_class_rolled_back), C(gpufleet_class_rollback_error)).
    type: str
    default: gpufleet_rollout
    version_added: 2.0.0
notes:
  - The playbooks of this collection call this action in their last play; set C(gpufleet_report_dir) to
    keep the reports.
seealso:
  - module: gpufleet.vllm.kv_plan
  - module: gpufleet.vllm.vllm_canary
  - module: gpufleet.vllm.gpu_memory_info
"""

EXAMPLES = r"""
- name: Write the rollout report
  gpufleet.vllm.rollout_report:
    report_dir: "{{ gpufleet_report_dir }}"
    kind: rollout
    data:
      started: "2026-11-29T10:00:00+00:00"
      classes:
        h200-tp1:
          ok: true
          failed: false
          key_hash: 3f2a9c0d11e4b7a2
          manual_canary: pass
          reasons: []
          plan:
            decision: deploy
            kv_cache_memory_bytes: 30333206528
            kv_cache_tokens: 925696
            free_floor_bytes: {0: 43754463232}
            gpu_memory_utilization: 0.2847
            per_rank: []
      hosts:
        gpu-a: {class: h200-tp1, batch: 1, pending: [vllm], touched: true}
      batches:
        - {index: 1, total: 1, hosts: [gpu-a], started: "2026-11-29T10:05:00+00:00"}
  register: report

- name: Show where it is
  ansible.builtin.debug:
    msg: "{{ report.summary }} -> {{ report.path }}/report.html"

- name: Write a probe report (what playbooks/probe.yml collects)
  gpufleet.vllm.rollout_report:
    report_dir: "{{ gpufleet_report_dir }}"
    kind: probe
    data:
      started: "2026-11-29T09:55:00+00:00"
      probe:
        hosts:
          gpu-a:
            class: h200-tp1
            driver_version: "580.159.04"
            gpus:
              - index: 0
                name: NVIDIA H200
                total_bytes: 150754820096
                free_bytes: 76544106496
                boot_free_bytes: 149464956928
                own_used_bytes: 72920850432
                reserved_bytes: 644939776
                processes: [{pid: 4242, name: python3, used_bytes: 72920850432, own: true}]
            instances:
              - name: vllm
                gpus: [0]
                port: 8000
                active_state: active
                sub_state: running
                plan: {decision: deploy, kv_cache_memory_bytes: 30333206528, kv_cache_tokens: 925696}
          gpu-b:
            class: h200-tp1
            error: "unreachable: ssh: connect to host gpu-b port 22: No route to host"
  register: probe_report
"""

RETURN = r"""
path:
  description: The run directory written; null when nothing was written (no O(report_dir), check mode).
  returned: always
  type: str
  sample: /var/lib/gpufleet/reports/rollout-20261129T100912Z
summary:
  description: One line summary (classes, host outcomes, failed hosts).
  returned: always
  type: str
  sample: "rollout: 1 class(es), 1 deployable; 3 deployed"
failed_hosts:
  description: Hosts that failed or were rolled back.
  returned: always
  type: list
  elements: str
  sample: []
classes:
  description:
    - Per class, the compact plan and verdicts the playbooks publish as job artifacts
      (C(status), C(decision), C(kv_cache_memory_bytes), C(kv_cache_tokens), C(gpu_memory_utilization),
      C(free_floor_bytes), C(weakest), C(manual_canary), C(canary_verdicts), C(hosts) with each host's outcome).
  returned: always
  type: dict
  sample: {"h200-tp1": {"status": "deployable", "decision": "deploy", "kv_cache_memory_bytes": 30333206528}}
report:
  description: The report as written to C(report.json) (schema version 2).
  returned: always
  type: dict
"""

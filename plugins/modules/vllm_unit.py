#!/usr/bin/python
# -*- coding: utf-8 -*-

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_unit
short_description: Compare, write, snapshot and restore the unit, plan record and secret environment of vLLM instances
version_added: 1.0.0
description:
  - Manages, in one round trip for all instances of a host, the files of each vLLM instance C(NAME)
    that the P(gpufleet.vllm.vllm_service#role) role deploys - the systemd unit C(<unit_dir>/vllm-NAME.service)
    (root, 0644), the plan record C(<state_dir>/NAME.plan.json) (root and O(plan_group), 0640) and the secret
    environment file C(<state_dir>/vllm-NAME.env) (root, 0600), and beside the unit the drop-in
    C(<unit_dir>/vllm-NAME.service.d/gpufleet-plan.conf) (root, 0644) that gives the boot gate the plan file's checksum
    (C(GPUFLEET_PLAN_SHA256)), written with the plan file - and the snapshot of them a rollback restores.
  - O(state=status) compares the desired unit and environment file with the files on disk and reads the
    services' state (C(systemctl show)); an instance is pending when its unit or environment differ, its service
    is not active, systemd has not loaded the unit on disk, the plan record does not name the unit on disk
    (the unit has not passed a boot check), or the recorded plan names another compatibility key than the
    desired one (O(instances[].plan)).
  - O(state=snapshot) keeps, in one document C(<state_dir>/units/vllm-NAME.snapshot.json) (root, 0600) written
    in one rename, a copy of each of these files or the fact that it does not exist, whether the service was
    serving (active, or held stopped by a canary that was cut off), and the O(change_id) of the change that
    takes it; a snapshot that cannot be written leaves the previous one as it was and stops nothing. It also
    opens the change, which O(state=recorded) and O(state=restored) close. While a change is open - a run was
    interrupted between the snapshot and the boot check - the instance is pending (V(an earlier change was
    interrupted)) and a new snapshot carries the existing one on (RV(instances[].resumed)), adding its own
    O(change_id), so a rollback still restores what ran before. A snapshot kept by a release before 2.0 (files
    C(<file>.previous), C(<file>.absent) and markers) is read and replaced by the document at the next snapshot.
  - O(state=present) writes the given unit, environment and plan files (the environment file first) and makes
    O(state_dir) a directory owned by root and O(plan_group) with mode 0750; files already as desired are left alone.
  - O(state=recorded) writes each plan record with the checksum of the unit now on disk and closes the change.
    Record a plan only after the unit passed its boot check (M(gpufleet.vllm.vllm_boot_check)).
  - O(state=restored) puts back the last snapshot - copies byte for byte; a file the change created removed (a unit
    that did not exist is stopped and disabled first) only while it is the file the change wrote (one changed since
    is left and named in RV(instances[].left)); files the snapshot knows nothing about left alone - and
    returns which units to restart (RV(instances[].restart) - kept and serving at the snapshot) and which to stop
    (RV(instances[].stop) - kept and not serving at the snapshot). With O(change_id), only a snapshot that change
    took or carried on is restored; any other is left with its instance (RV(instances[].skipped)). Restarting
    and C(daemon-reload) are left to M(ansible.builtin.systemd_service).
  - O(adopt_units) names units the instances take over (a hand-written C(vllm.service) and its drop-ins).
    With O(state=status) an instance is pending while one of them still runs or is enabled
    (V(takes over vllm.service (running and enabled))); O(state=snapshot) keeps each such unit (its file and
    drop-ins byte for byte, whether it ran and was enabled) with the snapshot that takes it over, in
    C(<state_dir>/units/adopted-UNIT.json), and drops the record of a unit taken over by an older change;
    O(state=restored) puts the kept files back and returns which units to enable and start again
    (RV(adopted[].enable), RV(adopted[].start)). Stopping, disabling, enabling and starting them is left to
    M(ansible.builtin.systemd_service).
  - Every file is written through a temporary file in its directory and renamed, so an interrupted run leaves
    the old file or the new one.
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
      - O(state=status) never changes anything; the other states report what they would change.
  diff_mode:
    support: full
    details:
      - The unit files (never the secret environment files) are shown before and after for O(state=status)
        and O(state=present). O(state=status) reports RV(ignore:changed=false); a task that wants the diff shown
        (callbacks show diffs of changed results) sets C(changed_when) on RV(pending).
  idempotent:
    support: full
options:
  state:
    description: What to do; see the description.
    type: str
    required: true
    choices: [status, snapshot, present, recorded, restored]
  instances:
    description:
      - The instances. O(state=snapshot) and O(state=restored) need only their names, which O(names) gives instead.
      - One of O(instances) and O(names) is required.
    type: list
    elements: dict
    suboptions:
      name:
        description: Instance name (letters, digits, C(_), C(.), C(-)); the unit is C(vllm-NAME.service).
        type: str
        required: true
      unit:
        description: Desired unit file content (O(state=status), O(state=present)).
        type: str
      plan:
        description:
          - The instance's plan file (its launch contract). O(state=recorded) writes it with the C(unit_checksum) of
            the unit on disk added; O(state=present) writes it without one (the boot gate reads it at the first start,
            before the boot check passed).
          - With O(state=status), an instance whose unit passed its boot check but whose recorded plan names another
            C(compat_key_hash) than this one is pending (the model's weights, the engine or the driver changed under
            an unchanged unit, and the running process is not what the plan was made for).
        type: dict
  names:
    description:
      - The instances' names, for O(state=snapshot) and O(state=restored), in place of O(instances).
    type: list
    elements: str
    version_added: 2.0.0
  env_files:
    description:
      - Desired secret environment file content per instance name (O(state=status), O(state=present)).
      - A separate option, not a key of O(instances), so that Ansible never logs it (also not in the host's journal).
    type: dict
  stop:
    description:
      - With O(state=snapshot) (or O(state=present) with O(snapshot=true)), then stop, in the same round trip, the services of the instances that are loaded and
        not inactive, and stop and disable the units of O(adopt_units) that still run or are enabled; RV(stopped)
        lists them. The snapshot keeps whether each ran, so O(state=restored) starts them again.
    type: bool
    default: false
    version_added: 2.0.0
  snapshot:
    description:
      - With O(state=present), first do what O(state=snapshot) does with the same options - keep the files and the
        units of O(adopt_units), then O(stop), O(gpu_probe) and O(gate) - in the same round trip, before any file is
        written, so that a host's change is one call; RV(snapshot) is what it kept. A failed O(gate) writes nothing.
    type: bool
    default: false
    version_added: 2.0.0
  restart:
    description:
      - With O(state=present), then reload systemd and enable and (re)start the instances' services, in the same
        round trip (check each boot with M(gpufleet.vllm.vllm_boot_check)); RV(started) lists them.
    type: bool
    default: false
    version_added: 2.0.0
  host_tools:
    description:
      - With O(state=present), first install these host tools - the boot gate the units start through, its library,
        the metrics exporter - exactly as M(gpufleet.vllm.vllm_host_tools) does with the same options (only what
        differs is written; RV(host_tools) is its result), so that the units and the tools they use go to the host in
        one round trip.
    type: dict
    version_added: 2.0.0
    suboptions:
      files:
        description: The files, with their contents (O(gpufleet.vllm.vllm_host_tools#module:files)).
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
            description: Octal mode, quoted.
            type: str
            default: '0644'
      directories:
        description: Directories to create (or fix) first (O(gpufleet.vllm.vllm_host_tools#module:directories)).
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
        description: Directories of Python files to byte-compile with O(host_tools.python).
        type: list
        elements: path
        default: []
      python:
        description: The interpreter that compiles O(host_tools.compile). Required with O(host_tools.compile).
        type: path
      units:
        description: systemd units to enable and start (restarted after any file changed), for example a C(.timer).
        type: list
        elements: str
        default: []
  gpu_probe:
    description:
      - With O(state=status), then read the GPUs through NVML, in the same round trip, while the instances serve;
        with O(state=snapshot) (or O(state=present) with O(snapshot=true)), after the snapshot and the stop
        (O(stop=true)). RV(gpu_probe) is the reading, as
        M(gpufleet.vllm.gpu_memory_info) returns it with the same options, for the free-memory gate before and after
        the stop (the P(gpufleet.vllm.vllm_service#role) role compares it with the plan's floors).
      - An NVML failure does not fail the module, which has read or stopped the units by then; RV(gpu_probe) holds the
        error, and the gate that reads it fails the host. Bad options, or an interpreter without C(pynvml), are refused
        before anything is read or stopped.
      - The module's action plugin runs the module with O(gpu_probe.python), the interpreter that imports C(pynvml)
        (C(nvidia-ml-py)), whatever C(ansible_python_interpreter) says.
    type: dict
    version_added: 2.0.0
    suboptions:
      python:
        description:
          - The Python interpreter on the host that imports C(pynvml), for example the vLLM virtual environment's
            (the fact C(gpu_probe_interpreter) the P(gpufleet.vllm.gpu_probe#role) role chooses).
        type: path
        required: true
      devices:
        description: GPUs to read, by index or UUID (O(gpufleet.vllm.gpu_memory_info#module:devices)); every GPU when omitted.
        type: list
        elements: str
      samples:
        description: Number of memory readings per GPU (O(gpufleet.vllm.gpu_memory_info#module:samples)).
        type: int
        default: 1
      interval:
        description: Seconds between two readings (O(gpufleet.vllm.gpu_memory_info#module:interval)).
        type: float
        default: 1.0
      service_units:
        description:
          - systemd units whose processes are this host's own engine, so that their memory counts as boot-free
            (O(gpufleet.vllm.gpu_memory_info#module:service_units)).
        type: list
        elements: str
        default: []
      service_pids:
        description: Extra process ids that count as this host's own engine (O(gpufleet.vllm.gpu_memory_info#module:service_pids)).
        type: list
        elements: int
        default: []
  gate:
    description:
      - With O(gpu_probe) and O(state=snapshot) (or O(state=present) with O(snapshot=true)), compare the reading taken
        after the stop with the launch record, as the filter P(gpufleet.vllm.gate_violations#filter) does, and fail -
        before anything is written - when a rank is below what its start needs (RV(gate_violations)); the message
        names the gate after the stop, the host and each rank, in the words of the gate before it. The snapshot and
        the stop stay, so that a rollback (O(state=restored)) starts the previous units again.
    type: dict
    version_added: 2.0.0
    suboptions:
      host:
        description: The host's name in the message.
        type: str
        required: true
      launch:
        description: The class's launch record (P(gpufleet.vllm.launch_contract#filter)).
        type: dict
        required: true
      instances:
        description: The instances that change, each with its C(name) and C(gpus) (rank R on C(gpus[R])).
        type: list
        elements: dict
        required: true
  change_id:
    description:
      - The change this call belongs to (the role gives one per host and run). O(state=snapshot), or
        O(state=present) with O(snapshot=true), stamps the snapshot with it; O(state=restored) then restores only a
        snapshot stamped with it, so that a change whose snapshot failed never restores an older change's files.
      - Empty for O(state=restored) restores the last snapshot, whoever took it (the rollback playbook).
    type: str
    default: ""
  runtime_venv:
    description:
      - The engine's venv, a symbolic link the P(gpufleet.vllm.vllm_runtime#role) role switches between releases
        (C(vllm_runtime_venv)).
      - With O(state=snapshot), for a change that switches the engine runtime, keep in the snapshot the release the venv
        points to now (RV(instances[].runtime_release)); a venv that is a plain directory keeps none.
      - With O(state=restored), read before anything is restored which release the restored snapshots kept and
        whether the venv points elsewhere now (RV(runtime)); switching it back is left to the
        P(gpufleet.vllm.vllm_runtime#role) role (C(tasks_from=switch)), before the restored units restart.
    type: path
    version_added: 2.0.0
  close_change:
    description:
      - With O(state=restored), close the change the snapshot opened. Restore with V(false) first, restart or stop
        what was restored, then restore again with V(true), so that a rollback interrupted before its restart is
        still known as an open change by the next run.
    type: bool
    default: true
  adopt_units:
    description:
      - Service units the instances take over, for example V(vllm.service) (O(state=status), O(state=snapshot),
        O(state=restored), and O(state=present) with O(snapshot=true)); not one of the instances' own
        C(vllm-NAME.service) units.
    type: list
    elements: str
    default: []
  unit_dir:
    description: Directory of the systemd units.
    type: path
    default: /etc/systemd/system
  state_dir:
    description: Directory of the plan records, environment files and the snapshot (C(units/)).
    type: path
    default: /etc/gpufleet
  plan_group:
    description: Group of the plan records, so that an application embedding vLLM can read them.
    type: str
    default: root
  account:
    description:
      - With O(state=present), the service account the units run as, made what they expect before any file is
        written (its group may be O(plan_group)), and the model checked as that user, in the same round trip - what
        M(gpufleet.vllm.vllm_account) does with O(state=present), with the same suboptions.
    type: dict
    suboptions:
      user:
        description: Service user.
        type: str
        required: true
      group:
        description: Service group.
        type: str
        required: true
      home:
        description: Home directory of the service.
        type: path
        required: true
      create:
        description: Create the group and the user where they do not exist.
        type: bool
        default: true
        version_added: 2.0.0
      model:
        description: A local model directory or file the user must be able to read, all of it; checked before any file is written.
        type: path
        version_added: 2.0.0
requirements:
  - systemd (C(systemctl)) for O(state=status), O(state=snapshot) and O(state=restored), and for O(state=present) with
    O(snapshot), O(restart) or O(host_tools.units).
  - With O(gpu_probe), C(nvidia-ml-py) (C(pynvml)) importable by O(gpu_probe.python), and the NVIDIA driver's C(libnvidia-ml.so.1).
seealso:
  - module: gpufleet.vllm.vllm_boot_check
  - module: ansible.builtin.systemd_service
"""

EXAMPLES = r"""
- name: Find which instances differ from the desired units (main takes over a hand-written vllm.service)
  gpufleet.vllm.vllm_unit:
    state: status
    instances:
      - name: main
        unit: "{{ lookup('ansible.builtin.template', 'vllm.service.j2') }}"
    adopt_units: [vllm.service]
  register: vllm_status

- name: Keep the files of instance main before stopping it
  gpufleet.vllm.vllm_unit:
    state: snapshot
    names: [main]
  when: "'main' in vllm_status.pending"

- name: Write a unit and its secret environment file, kept first as they are (nothing runs yet to stop first)
  gpufleet.vllm.vllm_unit:
    state: present
    snapshot: true
    instances:
      - name: main
        unit: "{{ lookup('ansible.builtin.template', 'vllm.service.j2') }}"
    env_files:
      main: "HF_TOKEN={{ hf_token | to_json }}\n"
    plan_group: vllm

- name: Record the plan the unit passed its boot check with
  gpufleet.vllm.vllm_unit:
    state: recorded
    instances:
      - name: main
        plan: {decision: deploy, kv_cache_memory_bytes: 59465973760}
    plan_group: vllm

- name: Put back the last snapshot
  gpufleet.vllm.vllm_unit:
    state: restored
    names: [main]
  register: vllm_restored
"""

RETURN = r"""
instances:
  description: One entry per instance, in the order given.
  returned: always
  type: list
  elements: dict
  contains:
    name:
      description: Instance name.
      type: str
    pending:
      description: Whether the instance needs a change (O(state=status)).
      type: bool
    reasons:
      description: Why it is pending, for example V(unit differs from the plan) or V(service is failed) (O(state=status)).
      type: list
      elements: str
    active_state:
      description: The service's C(ActiveState) (O(state=status), O(state=snapshot)).
      type: str
    unit_checksum:
      description: SHA-1 of the desired unit (O(state=status), O(state=present)) or of the recorded one (O(state=recorded)).
      type: str
    kept:
      description: Files kept as copies, by kind (V(unit), V(plan), V(env)) (O(state=snapshot)).
      type: list
      elements: str
    absent:
      description: Files recorded as absent (O(state=snapshot)).
      type: list
      elements: str
    resumed:
      description: The snapshot of an interrupted change was kept instead of taking a new one (O(state=snapshot)).
      type: bool
    written:
      description: Files written (O(state=present)), of V(env), V(unit), V(plan) and V(dropin).
      type: list
      elements: str
    restored:
      description: Files put back from their copy (O(state=restored)).
      type: list
      elements: str
    removed:
      description: Files removed because they did not exist at the snapshot (O(state=restored)).
      type: list
      elements: str
    unknown:
      description: Files the snapshot has neither a copy nor an absent marker of, left alone (O(state=restored)).
      type: list
      elements: str
    left:
      description:
        - Files the change created but that were changed since (another hand or run wrote them), left in place and not
          removed (O(state=restored)).
      type: list
      elements: str
    skipped:
      description:
        - Why the instance was not restored - it has no snapshot, or its last snapshot belongs to another change than
          O(change_id) (O(state=restored)); absent when it was restored.
      type: str
    serving:
      description: Whether the service was serving when the snapshot was taken (O(state=snapshot)).
      type: bool
    change_id:
      description: The change that took the snapshot (O(state=snapshot)).
      type: str
    stopped:
      description: A unit that did not exist before the change was stopped and disabled before its removal (O(state=restored)).
      type: bool
    restart:
      description: Whether the restored unit should be restarted - it was kept and its service was running (O(state=restored)).
      type: bool
    stop:
      description: Whether the restored unit should be stopped - it was kept and its service was not running (O(state=restored)).
      type: bool
    runtime_release:
      description:
        - The engine release the venv pointed to when the snapshot was taken, kept for a change that switched the runtime
          (O(runtime_venv)); empty when none was kept (O(state=snapshot), O(state=restored)).
      type: str
    launch:
      description:
        - The launch record of the restored plan file, which the restored unit's boot is checked against
          (O(gpufleet.vllm.vllm_boot_check#module:launch)); null when the snapshot keeps no plan file with one (O(state=restored)).
      type: dict
    boot_gate_state:
      description:
        - The boot gate's state file named by the restored plan file (O(gpufleet.vllm.vllm_boot_check#module:boot_gate_state));
          empty when the unit starts without the gate (O(state=restored)).
      type: str
    port:
      description: The port the restored plan file says the restored unit listens on; null without one (O(state=restored)).
      type: int
  sample:
    - name: main
      pending: true
      reasons: [unit differs from the plan, the unit on disk has not passed a boot check]
      active_state: active
      unit_checksum: 0b2c6ab4a3f5bb2f1a0f1c3e5b8b1c9a7b3f0e11
adopted:
  description: One entry per unit of O(adopt_units), in the order given.
  returned: when O(state) is V(status), V(snapshot) or V(restored), or V(present) with O(snapshot=true)
  type: list
  elements: dict
  contains:
    unit:
      description: Unit name.
      type: str
    found:
      description: Whether systemd knows the unit (O(state=status), O(state=snapshot)).
      type: bool
    holds:
      description: Whether it still runs or is enabled, so that it has yet to be taken over (O(state=status), O(state=snapshot)).
      type: bool
    running:
      description: Whether it runs (O(state=status), O(state=snapshot)).
      type: bool
    enabled:
      description: Whether it is enabled (O(state=status), O(state=snapshot)).
      type: bool
    kept:
      description: Whether this snapshot keeps it (O(state=snapshot)).
      type: bool
    restored:
      description: Files put back from the record (O(state=restored)).
      type: list
      elements: str
    enable:
      description: Whether to enable it again - it was enabled when it was taken over (O(state=restored)).
      type: bool
    start:
      description: Whether to start it again - it ran when it was taken over (O(state=restored)).
      type: bool
  sample:
    - unit: vllm.service
      found: true
      holds: true
      running: true
      enabled: true
snapshot:
  description: What the snapshot kept per instance (O(state=present) with O(snapshot=true)), as RV(instances) of O(state=snapshot).
  returned: when O(state=present) and O(snapshot=true)
  type: list
  elements: dict
  contains:
    name:
      description: Instance name.
      type: str
    kept:
      description: Files kept as copies, by kind (V(unit), V(plan), V(env)).
      type: list
      elements: str
    absent:
      description: Files recorded as absent.
      type: list
      elements: str
    active_state:
      description: The service's C(ActiveState) when the snapshot was taken.
      type: str
    resumed:
      description: The snapshot of an interrupted change was kept instead of taking a new one.
      type: bool
  sample:
    - name: main
      kept: []
      absent: [unit, plan, env]
      active_state: inactive
      resumed: false
gate_violations:
  description: The ranks below what their start needs, one sentence each (O(gate)); the module failed.
  returned: when O(gate) failed
  type: list
  elements: str
  sample: ["main rank 0 (GPU 0): boot-free 1073741824 B (1.00 GiB) < floor 42949672960 B (40.00 GiB), other processes: 4242"]
stopped:
  description: The units stopped (O(stop=true)), the instances' first, then those of O(adopt_units).
  returned: when O(stop=true)
  type: list
  elements: str
  sample: [vllm-main.service, vllm.service]
started:
  description: The units (re)started (O(restart=true)).
  returned: when O(state=present) and O(restart=true)
  type: list
  elements: str
  sample: [vllm-main.service]
host_tools:
  description: What O(host_tools) installed, as M(gpufleet.vllm.vllm_host_tools) returns it.
  returned: when O(state=present) and O(host_tools) is given
  type: dict
  contains:
    written:
      description: The directories and files created or changed (would be, in check mode).
      type: list
      elements: str
    compiled:
      description: The O(host_tools.compile) directories byte-compiled.
      type: list
      elements: str
    started:
      description: The O(host_tools.units) enabled, started or restarted.
      type: list
      elements: str
    changed:
      description: Whether anything was written, compiled or started.
      type: bool
  sample: {written: [], compiled: [], started: [], changed: false}
gpu_probe:
  description:
    - The NVML reading of O(gpu_probe) - the keys M(gpufleet.vllm.gpu_memory_info) returns (RV(gpufleet.vllm.gpu_memory_info#module:gpus),
      the driver and NVML versions, the own processes) - or, when NVML failed, C(error) (naming the host and the GPU),
      C(gpu) and C(nvml_error) (the NVML return code).
  returned: when O(gpu_probe) is given
  type: dict
  sample: {gpus: [{index: 0, total_bytes: 48305799168, boot_free_bytes: 47739011072, processes: []}], driver_version: 550.127.05}
account:
  description: What O(account) created or changed and whether the model was checked (RV(gpufleet.vllm.vllm_account#module:account_changed),
    RV(gpufleet.vllm.vllm_account#module:ready), RV(gpufleet.vllm.vllm_account#module:model_checked)).
  returned: when O(state=present) and O(account) is given
  type: dict
  sample: {account_changed: [group, user, home], ready: true, model_checked: true, changed: true}
runtime:
  description:
    - Which engine release the restore switches the venv back to, read before anything was restored (O(state=restored)
      with O(runtime_venv)).
  returned: when O(state=restored) and O(runtime_venv) is given
  type: dict
  contains:
    release:
      description: The release the restored snapshots kept; empty when none kept one, or when the venv points to it already.
      type: str
    current:
      description: The release the venv points to now (empty for a plain directory).
      type: str
    instances:
      description: The instances whose snapshot kept that release.
      type: list
      elements: str
  sample: {release: /opt/vllm/releases/vllm-0.33.1-0123456789, current: /opt/vllm/releases/vllm-0.33.2-abcdef0123, instances: [main]}
pending:
  description: Names of the pending instances (O(state=status)).
  returned: when O(state=status)
  type: list
  elements: str
  sample: [main]
"""

import platform
import sys
import traceback
from typing import Any

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible.module_utils.common.text.converters import to_native

from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import default
from ansible_collections.gpufleet.vllm.plugins.module_utils._gate._free_memory_gate import gate_violations
from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._gpu_memory import (
    ARGUMENT_SPEC as GPU_PROBE_SPEC,
    PYNVML_IMPORT_ERROR,
    check_params as check_gpu_probe,
    probe_report,
    pynvml,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import LaunchError
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._host_tools import (
    ARGUMENT_SPEC as HOST_TOOLS_SPEC,
    HostToolsError,
    apply as apply_host_tools,
    start_units,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._service_account import (
    ARGUMENT_SPEC as ACCOUNT_SPEC,
    AccountError,
    apply as apply_account,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._unit_files import (
    ADOPT_PROPERTIES,
    SHOW_PROPERTIES,
    Layout,
    UnitFilesError,
    adopted_status,
    adoption_reasons,
    group_id,
    record,
    restart_services,
    restore,
    restore_adopted,
    runtime_to_restore,
    snapshot,
    snapshot_adopted,
    status,
    stop_services,
    systemctl_show,
    validate_adopted,
    write,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError

ARGUMENT_SPEC: dict[str, Any] = dict(
    state=dict(type="str", required=True, choices=["status", "snapshot", "present", "recorded", "restored"]),
    instances=dict(
        type="list",
        elements="dict",
        options=dict(
            name=dict(type="str", required=True),
            unit=dict(type="str"),
            plan=dict(type="dict"),
        ),
    ),
    names=dict(type="list", elements="str"),
    env_files=dict(type="dict", no_log=True),
    stop=dict(type="bool", default=False),
    snapshot=dict(type="bool", default=False),
    restart=dict(type="bool", default=False),
    host_tools=dict(type="dict", options=HOST_TOOLS_SPEC),
    # the interpreter is the action plugin's: it runs the module with gpu_probe.python
    gpu_probe=dict(type="dict", options=dict(GPU_PROBE_SPEC, python=dict(type="path", required=True))),
    gate=dict(type="dict", options=dict(
        host=dict(type="str", required=True),
        launch=dict(type="dict", required=True),
        instances=dict(type="list", elements="dict", required=True),
    )),
    close_change=dict(type="bool", default=True),
    change_id=dict(type="str", default=""),
    runtime_venv=dict(type="path"),
    adopt_units=dict(type="list", elements="str", default=[]),
    unit_dir=dict(type="path", default=default("unit_dir")),
    state_dir=dict(type="path", default=default("state_dir")),
    plan_group=dict(type="str", default="root"),
    account=dict(type="dict", options=ACCOUNT_SPEC),
)


def _instances(params: dict[str, Any]) -> list[dict[str, Any]]:
    """The instances with their secret environment file; raises for an option the state does not take."""
    state = params["state"]
    env_files = params["env_files"] or {}
    if params["names"] is not None and state not in ("snapshot", "restored"):
        raise UnitFilesError("names is for state snapshot or restored; give instances with their unit and plan")
    # the deploy's write call takes the snapshot (state=present, snapshot) with its stop and its gate
    keeps = state == "snapshot" or (state == "present" and params["snapshot"])
    for option, allowed in (("snapshot", ("present",)), ("restart", ("present",)), ("host_tools", ("present",)), ("account", ("present",))):
        if params[option] and state not in allowed:
            raise UnitFilesError(f"{option} is for state {' or '.join(allowed)}")
    for option, status_too in (("stop", False), ("gpu_probe", True), ("gate", False)):
        if params[option] and not keeps and not (status_too and state == "status"):
            raise UnitFilesError(f"{option} is for state {'status, ' if status_too else ''}snapshot, or present with snapshot")
    if params["runtime_venv"] and not (keeps or state == "restored"):
        raise UnitFilesError("runtime_venv is for state snapshot, present with snapshot, or restored")
    if params["gate"] and not params["gpu_probe"]:
        raise UnitFilesError("gate compares the reading of gpu_probe: give gpu_probe too")
    given = params["instances"] or [{"name": name} for name in params["names"]]
    instances = [dict(i, env=env_files.get(i["name"])) for i in given]
    unknown = sorted(set(env_files) - {i["name"] for i in instances})
    if unknown:
        raise UnitFilesError(f"env_files names instances that are not in instances: {', '.join(unknown)}")
    return instances


def _check_gpu_probe(params: dict[str, Any]) -> None:
    """Refuse a gpu_probe that could not run before anything is read or stopped."""
    try:
        check_gpu_probe(params)
    except ValidationError as exc:
        raise UnitFilesError(f"gpu_probe: {exc}") from None
    if pynvml is None:
        raise UnitFilesError(f"gpu_probe: {missing_required_lib('nvidia-ml-py')} The interpreter is {sys.executable} "
                             f"(gpu_probe.python {params['python']}): {(PYNVML_IMPORT_ERROR or '').strip().splitlines()[-1]}")


def _run(module: AnsibleModule, instances: list[dict[str, Any]], result: dict[str, Any]) -> list[dict[str, Any]]:
    """Carry out the state on the host; the per-instance entries (``result`` gets the rest)."""
    params, check = module.params, module.check_mode
    state = params["state"]
    if params["gpu_probe"]:
        _check_gpu_probe(params["gpu_probe"])

    def runner(argv: list[str], cwd: str | None = None) -> tuple[int, str, str]:
        rc, out, err = module.run_command(argv, cwd=cwd)
        return rc, out, err

    names = [i["name"] for i in instances]
    adopt = validate_adopted(params["adopt_units"], names, "adopt_units")
    if adopt and state in ("present", "recorded") and not params["snapshot"]:
        raise UnitFilesError("adopt_units is for state status, snapshot or restored, or present with snapshot")
    systemctl = module.get_bin_path("systemctl", required=True) if state != "recorded" and (
        state != "present" or params["restart"] or params["snapshot"] or (params["host_tools"] or {}).get("units")) else ""
    # before any file: the units run as it, and its group may be the plan files' (plan_group)
    if state == "present" and params["account"]:
        try:
            result["account"] = apply_account(params["account"], runner, check)
        except AccountError as exc:
            raise UnitFilesError(f"account: {exc}") from None
    # the group may not exist yet when a first deploy is only being compared or snapshotted
    writes_plan_group = state in ("present", "recorded") and not check
    plan_gid = group_id(params["plan_group"], writes_plan_group) if state in ("present", "recorded", "restored") else 0
    layout = Layout(unit_dir=params["unit_dir"], state_dir=params["state_dir"], plan_gid=plan_gid)
    if state == "status":
        entries = status(layout, instances, systemctl_show(runner, systemctl), want_diff=module._diff)
        result["adopted"] = adopted_status(adopt, systemctl_show(runner, systemctl, ADOPT_PROPERTIES))
        # a unit still to take over makes every instance of the host pending: they take over together
        for entry in entries:
            entry["reasons"] = entry["reasons"] + adoption_reasons(result["adopted"])
            entry["pending"] = bool(entry["reasons"])
        result["pending"] = [e["name"] for e in entries if e["pending"]]
    elif state == "snapshot":
        entries = _snapshot(module, layout, instances, adopt, runner, systemctl, result)
    elif state == "present":
        if params["snapshot"]:
            # before any file is written; a gate that fails here leaves them all as they were
            _snapshot(module, layout, instances, adopt, runner, systemctl, result)
        tools = params["host_tools"]
        # the restart below reloads systemd: the tools' units start after it, without a reload of their own
        reloads = bool(params["restart"] and names)
        try:
            if tools:
                result["host_tools"] = apply_host_tools(tools, runner, systemctl, check, start=not reloads)
            entries = write(layout, instances, check, want_diff=module._diff)
            if params["restart"]:
                result["started"] = restart_services(layout, names, runner, check, systemctl_bin=systemctl)
            if tools and reloads:
                start_units(tools, result["host_tools"], runner, systemctl, check, reloaded=True)
        except HostToolsError as exc:
            raise UnitFilesError(f"host_tools: {exc}") from None
    elif state == "recorded":
        entries = record(layout, instances, check)
    else:
        if params["runtime_venv"]:
            # before anything is restored: two releases to switch back to restore nothing
            result["runtime"] = runtime_to_restore(layout, names, params["runtime_venv"], change_id=params["change_id"])
        entries = restore(layout, names, runner, check, systemctl_bin=systemctl, close=params["close_change"],
                          change_id=params["change_id"])
        result["adopted"] = restore_adopted(layout, adopt, check)
    if state == "status" and params["gpu_probe"]:
        # after the read, while the instances serve: what the gate before the stop compares
        result["gpu_probe"] = probe_report(module, params["gpu_probe"], pynvml, platform.node())
    return entries


def _snapshot(module: AnsibleModule, layout: Layout, instances: list[dict[str, Any]], adopt: list[str], runner: Any,
              systemctl: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """Keep the files (and the units to take over), then stop, read the GPUs and gate, as the options ask."""
    params, check = module.params, module.check_mode
    names = [i["name"] for i in instances]
    entries = snapshot(layout, names, systemctl_show(runner, systemctl), check, change_id=params["change_id"],
                       runtime_venv=params["runtime_venv"])
    if params["state"] == "present":
        # kept in the result at once: a gate that fails below still returns what was kept
        result["snapshot"] = entries
    result["adopted"] = snapshot_adopted(layout, adopt, systemctl_show(runner, systemctl, ADOPT_PROPERTIES), check,
                                         resumed=any(e.get("resumed") for e in entries))
    if params["stop"]:
        result["stopped"] = stop_services(layout, names, result["adopted"], systemctl_show(runner, systemctl, SHOW_PROPERTIES),
                                          runner, check, systemctl_bin=systemctl)
    if params["gpu_probe"]:
        # after the stop: what the gate after the stop compares
        result["gpu_probe"] = probe_report(module, params["gpu_probe"], pynvml, platform.node())
    gate = params["gate"]
    if gate:
        try:
            violations = gate_violations(result["gpu_probe"], gate["instances"], gate["launch"])
        except (LaunchError, KeyError, TypeError, ValueError) as exc:
            raise UnitFilesError(f"gate: {exc}") from None
        if violations:
            result["gate_violations"] = violations
            # the words of the gate before the stop (the role's gate.yml), for the same check
            raise UnitFilesError(f"Free-memory gate (after stop) failed on {gate['host']}: {'; '.join(violations)}")
    return entries


def main() -> None:
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        required_one_of=[("instances", "names")],
        mutually_exclusive=[("instances", "names")],
        supports_check_mode=True,
    )
    state = module.params["state"]
    result: dict[str, Any] = {"changed": False}
    try:
        entries = _run(module, _instances(module.params), result)
    except UnitFilesError as exc:
        # what happened before the failure (the snapshot, the stop, the reading) for the rollback and the report
        done = {k: result[k] for k in ("snapshot", "adopted", "stopped", "gpu_probe", "gate_violations") if k in result}
        module.fail_json(msg=f"vllm_unit ({state}): {to_native(exc)}", changed=bool(done.get("stopped")), **done)
    except Exception as exc:  # pylint: disable=broad-exception-caught
        module.fail_json(msg=f"vllm_unit ({state}) failed unexpectedly: {to_native(exc)}", exception=traceback.format_exc())

    diffs = [e.pop("diff") for e in entries if "diff" in e]
    if diffs:
        result["diff"] = diffs
    changes = [e.pop("changed", False) for e in entries + result.get("adopted", []) + result.get("snapshot", [])]
    if state != "status":
        result["changed"] = any(changes) or bool(result.get("stopped") or result.get("started")) or \
            bool(result.get("host_tools", {}).get("changed")) or \
            bool(result.get("account", {}).get("changed"))
    result["instances"] = entries
    module.exit_json(**result)


if __name__ == "__main__":
    main()

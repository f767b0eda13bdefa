#!/usr/bin/python
# -*- coding: utf-8 -*-

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_boot_check
short_description: Check a vLLM boot against its planned KV budget, free-memory floor and tokens
version_added: 1.0.0
description:
  - After a vLLM systemd unit was (re)started, waits for C(/health) and fails at once if the unit enters the
    failed state (or restarts) instead of waiting for the timeout.
  - Reads this boot's log (the unit's journal entries of its current C(InvocationID), or the latest boot in a log file),
    parses it per rank and checks that every rank reserved exactly O(expected_kv_cache_memory_bytes), that the
    free memory vLLM logged at startup is at least O(free_floor_bytes), that the cache holds at least
    O(min_tokens) tokens and that no failure line was logged.
  - vLLM's CPU build logs no initial free device memory, so there the floor is reported as not applicable, with why,
    in RV(not_applicable) (neither passed nor failed); the boot gate checks the NVML floor before every start.
  - Cross-checks C(/metrics) C(vllm:cache_config_info) (C(kv_cache_memory_bytes) exactly, tokens against the log).
  - Fails with a message naming the rank and the figures.
  - With O(record), a boot that passed every check and started as planned gets its plan record written in the same
    round trip, as O(gpufleet.vllm.vllm_unit#module:state=recorded) writes it.
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
      - In check mode the module contacts nothing and records nothing (in a dry run the unit was not restarted, so
        there is no new boot to check) and returns the list of checks it would make in RV(checks).
  diff_mode:
    support: none
    details:
      - The plan record O(record) writes is not shown.
  idempotent:
    support: full
    details:
      - Without O(record) the module changes nothing; a second O(record) of the same plan and unit writes nothing.
options:
  unit:
    description: systemd unit running the engine, for example V(vllm-main.service).
    type: str
  url:
    description: Base URL of the engine (V(http://host:port)); overrides O(host) and O(port).
    type: str
  host:
    description:
      - Address the engine listens on (the P(gpufleet.vllm.vllm_service#role) role gives C(vllm_service_health_host)).
        An engine that listens on every address (V(0.0.0.0), V(::) or empty) is asked on V(127.0.0.1).
    type: str
    default: 127.0.0.1
  port:
    description: Port of the engine on O(host).
    type: int
    default: 8000
  launch:
    description:
      - The launch record the unit was started with (C(launch) of M(gpufleet.vllm.kv_plan)'s plan, schema in
        C(docs/launch-contract.md)). Its budget, vLLM floors (C(vllm_floor_bytes)) and tokens
        (C(expect.kv_cache_tokens)) are the checks; an C(auto_profile) record checks health and errors only.
      - Mutually exclusive with O(expected_kv_cache_memory_bytes) and O(free_floor_bytes), which give the same
        checks one by one for a unit without a plan. O(min_tokens) overrides the record's tokens.
    type: dict
    version_added: 2.0.0
  expected_kv_cache_memory_bytes:
    description: The budget the unit was started with (integer or size string); each rank must have reserved it.
    type: raw
  free_floor_bytes:
    description:
      - Least initial free memory vLLM may log at startup, for every rank (integer or size string) or per rank
        (dictionary rank -> size).
      - Compared with vLLM's own logged figure (two decimals of GiB, so half a unit, 0.005 GiB, is allowed).
    type: raw
  min_tokens:
    description: Least KV cache size in tokens.
    type: int
  timeout:
    description: Seconds to wait for C(/health).
    type: int
    default: 900
  journal:
    description:
      - Read the unit's journal of this start (C(journalctl _SYSTEMD_INVOCATION_ID=<InvocationID> -o cat)), never selected by
        time (a clock stepped back would mix in an earlier start's lines).
      - Set V(false) and give O(log_path) for an engine that logs to a file.
    type: bool
    default: true
  log_path:
    description: Engine log file; the part written by the latest boot (from its last C(non-default args) line) is checked.
    type: path
  boot_gate_state:
    description:
      - State file of the unit's boot gate (the plan file's C(boot_gate.state_file)). The check waits up to
        30 seconds for the gate's record of this start (the unit's C(InvocationID)).
      - A refused start fails the check with the gate's own message; a start the gate shrank is compared with the
        budget and tokens the gate started (never above O(expected_kv_cache_memory_bytes)) and reported in
        RV(degraded); a start the gate turned into vLLM's own profiling is not compared with a byte budget.
    type: path
  fail_degraded:
    description:
      - Fail the check when the boot gate started the unit degraded (RV(degraded) set) instead of the plan, naming
        what the gate lowered; a deploy that must start what it planned sets it (the P(gpufleet.vllm.vllm_service#role)
        role does).
      - With V(false) a degraded start is only reported in RV(degraded).
      - Needs O(boot_gate_state).
    type: bool
    default: false
    version_added: 2.0.0
  headless:
    description:
      - The unit is a member of an instance over several hosts that runs no API server (C(--headless), C(docs/multi-host.md)).
        Instead of C(/health), the check reads the unit's journal until each of its O(local_ranks) ranks logged its KV cache
        line (they do once every rank of the instance joined), failing at once if the unit fails, then judges those ranks.
      - There is no C(/metrics) to cross-check. When the log holds no capacity line (tensor and pipeline parallel over
        nodes, where the engine core runs on the leader), the tokens are not checked here but by the member that serves the API.
        Both are listed in RV(not_applicable).
      - Needs O(unit) and O(journal).
    type: bool
    default: false
    version_added: 3.0.0
  local_ranks:
    description: With O(headless), the ranks this member runs (its GPUs of the instance).
    type: int
    default: 1
    version_added: 3.0.0
  first_rank:
    description:
      - A member of an instance over several hosts - the number of its first rank in the whole instance (its C(first_rank) of
        P(gpufleet.vllm.gang_member_launch#filter)). Its log numbers its ranks in the whole instance and the launch record's
        floors by its GPUs; the ranks are renumbered from this one (rank O(first_rank) is its GPU 0), each keeping its
        instance-wide number as C(global_rank) in RV(ranks).
      - Unset, a member with O(headless) numbers its ranks by their order in the log.
    type: int
    version_added: 3.0.0
  record:
    description:
      - After a boot that passed every check and that the boot gate did not shrink (RV(degraded) empty), write the
        instance's plan record C(<state_dir>/NAME.plan.json) (root and O(record.plan_group), 0640) with the checksum of
        the unit now on disk, and close the change a O(gpufleet.vllm.vllm_unit#module:state=snapshot) opened, as
        O(gpufleet.vllm.vllm_unit#module:state=recorded) does; RV(recorded) says what was written.
      - A failed check or a degraded start records nothing, so the change stays open for the rollback.
    type: dict
    version_added: 2.0.0
    suboptions:
      name:
        description: Instance name; O(unit) must be its unit C(vllm-NAME.service).
        type: str
        required: true
      plan:
        description: The instance's plan file (its launch contract), as O(gpufleet.vllm.vllm_unit#module:state=present) wrote it.
        type: dict
        required: true
      unit_dir:
        description: Directory of the systemd units.
        type: path
        default: /etc/systemd/system
      state_dir:
        description: Directory of the plan records.
        type: path
        default: /etc/gpufleet
      plan_group:
        description: Group of the plan record, so that an application embedding vLLM can read it.
        type: str
        default: root
requirements:
  - systemd (C(systemctl), C(journalctl)) when O(unit) is set.
seealso:
  - module: gpufleet.vllm.vllm_canary
"""

EXAMPLES = r"""
- name: Check the boot of the restarted unit against its launch record (of a kv_plan result)
  gpufleet.vllm.vllm_boot_check:
    unit: vllm-main.service
    port: 8000
    # the budget, vLLM's own logged free memory against the floor in vLLM's terms, the tokens
    launch: "{{ gpufleet_plan.launch }}"
    timeout: 600

- name: Check an engine that logs to a file
  gpufleet.vllm.vllm_boot_check:
    port: 8001
    journal: false
    log_path: /var/log/vllm/embedder.log
    expected_kv_cache_memory_bytes: 2GiB
  register: embedder_boot

- name: Show its cache
  ansible.builtin.debug:
    msg: "{{ embedder_boot.kv_cache_tokens }} tokens in {{ embedder_boot.kv_cache_memory_bytes | gpufleet.vllm.human_bytes }}"
"""

RETURN = r"""
ok:
  description: Whether every check passed.
  returned: when not in check mode
  type: bool
reasons:
  description: Failed checks, each naming the rank and the figures.
  returned: when not in check mode
  type: list
  elements: str
not_applicable:
  description:
    - Checks that do not apply to this engine, each with why; for example the free-memory floor on vLLM's CPU build,
      which logs no initial free device memory (its C(free_floor) entries in RV(checks) have C(applicable=false)).
  returned: when the engine became healthy
  type: list
  elements: str
checks:
  description: Every check made (or, in check mode, that would be made), with its figures.
  returned: always
  type: list
  elements: dict
health:
  description:
    - V(healthy), V(timeout) or V(failed_state) (the unit failed or restarted while booting).
    - With O(headless), V(healthy) means each of its ranks logged its KV cache line.
  returned: when not in check mode
  type: str
ranks:
  description: Per rank figures parsed from this boot's log.
  returned: when not in check mode
  type: list
  elements: dict
kv_cache_tokens:
  description: KV cache size in tokens (from C(/metrics), else the log).
  returned: when the engine became healthy
  type: int
kv_cache_memory_bytes:
  description: The budget C(/metrics) reports.
  returned: when the engine became healthy
  type: int
engine_errors:
  description: Failures the engine logged in this boot.
  returned: when not in check mode
  type: list
  elements: dict
log_source:
  description: Which log was read.
  returned: when not in check mode
  type: str
boot_gate:
  description: The boot gate's record of this start (action, per-rank free memory and floors, planned and started figures).
  returned: when O(boot_gate_state) is given and the gate recorded this start
  type: dict
degraded:
  description:
    - What the boot gate lowered, with bytes and tokens before and after (C(kv_cache_memory_bytes_before),
      C(kv_cache_memory_bytes_after), C(kv_cache_tokens_before), C(kv_cache_tokens_after)), the policy and its message.
    - V(null) when the unit started as planned.
  returned: when O(boot_gate_state) is given
  type: dict
recorded:
  description: The plan record O(record) wrote, with the unit's checksum, and whether it changed.
  returned: when O(record) is given and the boot passed as planned
  type: dict
  contains:
    name:
      description: Instance name.
      type: str
    unit_checksum:
      description: SHA-1 of the unit the plan record names.
      type: str
  sample: {name: main, unit_checksum: 2aae6c35c94fcfb415dbe95f408b9ce91ee846ed}
log_tail:
  description: Last lines of this boot's log.
  returned: on failure
  type: str
"""

import dataclasses
import traceback
from typing import Any, Mapping
from urllib.parse import urlsplit

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.text.converters import to_native

from ansible_collections.gpufleet.vllm.plugins.module_utils._defaults import default
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._boot_check import BootCheckSpec, Systemd, run_boot_check
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._engine_process import base_url, health_address
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import EngineSpecError
from ansible_collections.gpufleet.vllm.plugins.module_utils._gate._boot_gate import boot_expectations, wait_state
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import LaunchError, check_launch
from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import SizeError, parse_size
from ansible_collections.gpufleet.vllm.plugins.module_utils._units._unit_files import Layout, UnitFilesError, group_id, record
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import ValidationError, integer, port, text


def _floor(value: object) -> int | dict[int, int] | None:
    if value is None:
        return None
    if isinstance(value, dict):
        out: dict[int, int] = {}
        for key, size in value.items():
            try:
                rank = integer(key, "free_floor_bytes rank", low=0)
            except ValidationError:
                raise EngineSpecError(f"free_floor_bytes: rank {key!r} is not an integer") from None
            out[rank] = parse_size(size, f"free_floor_bytes[{rank}]")
        return out
    return parse_size(value, "free_floor_bytes")


def build_spec(params: Mapping[str, Any]) -> BootCheckSpec:
    host, tcp_port = text(params["host"], "host"), port(params["port"], "port")
    if any(c.isspace() for c in host) or "/" in host:
        raise EngineSpecError(f"host: expected an address or a host name, got {host!r}")
    host = health_address(host)
    if params["url"]:
        url = text(params["url"], "url")
        try:
            parts = urlsplit(url)
            url_port = parts.port
        except ValueError as exc:
            raise EngineSpecError(f"url {url!r}: {exc}") from None
        if parts.scheme != "http" or not parts.hostname:
            raise EngineSpecError(f"url {url!r}: only http://host[:port] is supported")
        host, tcp_port = parts.hostname, port(url_port or 80, "url port")
    if params["unit"] is not None:
        text(params["unit"], "unit")
    integer(params["timeout"], "timeout", low=1)
    integer(params.get("local_ranks", 1), "local_ranks", low=1, high=4096)
    if params.get("headless") and not params["journal"]:
        raise EngineSpecError("headless: a member without an API server is read from its unit's journal (journal=true)")
    if params["min_tokens"] is not None:
        integer(params["min_tokens"], "min_tokens", low=0)
    expected = None
    floor = _floor(params["free_floor_bytes"])
    min_tokens = params["min_tokens"]
    if params.get("launch") is not None:
        record = check_launch(params["launch"], "launch")
        expected = record["kv_cache_memory_bytes"]
        floor = record["vllm_floor_bytes"] or None
        if min_tokens is None and record["expect"] is not None:
            min_tokens = record["expect"]["kv_cache_tokens"]
    elif params["expected_kv_cache_memory_bytes"] is not None:
        expected = parse_size(params["expected_kv_cache_memory_bytes"], "expected_kv_cache_memory_bytes")
    return BootCheckSpec(
        unit=params["unit"],
        host=host,
        port=tcp_port,
        expected_kv_cache_memory_bytes=expected,
        free_floor_bytes=floor,
        min_tokens=min_tokens,
        timeout=float(params["timeout"]),
        journal=params["journal"],
        log_path=params["log_path"],
        headless=bool(params.get("headless")),
        local_ranks=int(params.get("local_ranks", 1)),
        first_rank=None if params.get("first_rank") is None else integer(params["first_rank"], "first_rank", low=0),
    )


def record_layout(params: Mapping[str, Any], unit: str | None) -> Layout:
    """The layout of O(record)'s plan record; its instance must own the checked ``unit``."""
    rec = params["record"]
    layout = Layout(unit_dir=rec["unit_dir"], state_dir=rec["state_dir"])
    if unit != layout.unit_name(rec["name"]):
        raise ValueError(f"record.name: instance {rec['name']!r} runs {layout.unit_name(rec['name'])}, not the checked unit {unit}")
    return layout


def planned_checks(spec: BootCheckSpec) -> list[dict[str, Any]]:
    checks: list[dict[str, Any]] = [
        {"check": "ranks_logged", "unit": spec.unit, "ranks": spec.local_ranks, "timeout": spec.timeout} if spec.headless
        else {"check": "health", "url": f"{base_url(spec.host, spec.port)}/health", "timeout": spec.timeout}]
    checks.append({"check": "engine_error", "log": f"journal of {spec.unit}" if spec.journal else spec.log_path})
    if spec.expected_kv_cache_memory_bytes is not None:
        checks.append({"check": "reserved_kv_bytes", "expected": spec.expected_kv_cache_memory_bytes})
        checks.append({"check": "metrics_kv_cache_memory_bytes", "expected": spec.expected_kv_cache_memory_bytes})
    if spec.free_floor_bytes is not None:
        checks.append({"check": "free_floor", "floor": spec.free_floor_bytes})
    if spec.min_tokens is not None:
        checks.append({"check": "min_tokens", "expected": spec.min_tokens})
    return checks


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            unit=dict(type="str"),
            url=dict(type="str"),
            host=dict(type="str", default="127.0.0.1"),
            port=dict(type="int", default=8000),
            launch=dict(type="dict"),
            expected_kv_cache_memory_bytes=dict(type="raw"),
            free_floor_bytes=dict(type="raw"),
            min_tokens=dict(type="int", no_log=False),
            timeout=dict(type="int", default=900),
            journal=dict(type="bool", default=True),
            log_path=dict(type="path"),
            boot_gate_state=dict(type="path"),
            fail_degraded=dict(type="bool", default=False),
            headless=dict(type="bool", default=False),
            local_ranks=dict(type="int", default=1),
            first_rank=dict(type="int"),
            record=dict(type="dict", options=dict(
                name=dict(type="str", required=True),
                plan=dict(type="dict", required=True),
                unit_dir=dict(type="path", default=default("unit_dir")),
                state_dir=dict(type="path", default=default("state_dir")),
                plan_group=dict(type="str", default="root"),
            )),
        ),
        required_if=[("journal", True, ("unit",)), ("journal", False, ("log_path",)), ("fail_degraded", True, ("boot_gate_state",)),
                     ("headless", True, ("unit",))],
        mutually_exclusive=[("launch", "expected_kv_cache_memory_bytes"), ("launch", "free_floor_bytes")],
        supports_check_mode=True,
    )
    try:
        spec = build_spec(module.params)
        layout = record_layout(module.params, spec.unit) if module.params["record"] else None
        if module.check_mode:
            module.exit_json(changed=False, checks=planned_checks(spec))
        systemctl = journalctl = None
        if spec.unit:
            systemctl = module.get_bin_path("systemctl", required=True)
            if spec.journal:
                journalctl = module.get_bin_path("journalctl", required=True)

        def runner(argv: list[str]) -> tuple[int, str, str]:
            rc, out, err = module.run_command(argv)
            return rc, out, err

        systemd = Systemd(runner, systemctl or "systemctl", journalctl or "journalctl")
        gate = degraded = None
        if module.params["boot_gate_state"] and spec.unit:
            def invocation() -> str | None:
                rc, out, _err = module.run_command([systemctl or "systemctl", "show", "-p", "InvocationID", "--value", "--", spec.unit])
                return out.strip() or None if rc == 0 else None

            gate = wait_state(module.params["boot_gate_state"], invocation)
            if gate is not None and gate.get("action") == "refuse":
                module.fail_json(msg=f"vLLM boot check of {spec.unit} failed: {gate.get('message')}", ok=False,
                                 reasons=[gate.get("message")], boot_gate=gate, degraded=None)
            expected, min_tokens, degraded = boot_expectations(gate, spec.expected_kv_cache_memory_bytes, spec.min_tokens)
            spec = dataclasses.replace(spec, expected_kv_cache_memory_bytes=expected, min_tokens=min_tokens)
        result = run_boot_check(spec, systemd)
        if module.params["boot_gate_state"]:
            result["degraded"] = degraded if gate is not None else None
            if gate is not None:
                result["boot_gate"] = gate
        changed = False
        if layout is not None and result["ok"] and not result.get("degraded"):
            plan_layout = dataclasses.replace(layout, plan_gid=group_id(module.params["record"]["plan_group"], True))
            entry = record(plan_layout, [{"name": module.params["record"]["name"], "plan": module.params["record"]["plan"]}], False)[0]
            changed = entry.pop("changed")
            result["recorded"] = entry
    except (EngineSpecError, LaunchError, SizeError, UnitFilesError, ValidationError, ValueError) as exc:
        module.fail_json(msg=to_native(exc))
    except Exception as exc:  # pylint: disable=broad-exception-caught
        module.fail_json(msg=f"vllm_boot_check failed unexpectedly: {to_native(exc)}", exception=traceback.format_exc())

    where = spec.unit or result.get("url")
    if not result["ok"]:
        module.fail_json(msg=f"vLLM boot check of {where} failed: " + "; ".join(result["reasons"]), **result)
    if module.params["fail_degraded"] and result.get("degraded"):
        # nothing was recorded (above): the change stays open for the caller's rollback
        degraded = result["degraded"]
        what = degraded.get("message") if isinstance(degraded, dict) and degraded.get("message") else degraded
        module.fail_json(msg=f"{where}: the boot gate started it degraded instead of the plan: {what}", **result)
    module.exit_json(changed=changed, **result)


if __name__ == "__main__":
    main()

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The boot gate on the simulated fleet: unit restarts with no controller in the loop.

Three hosts of one class (one L40S each), deployed once by ``playbooks/rollout.yml``:
``sim-bg-1`` with the default policy ``shrink``, ``sim-bg-2`` with ``refuse``, ``sim-bg-3``
with ``profile``. Then, on
the hosts themselves (``systemctl restart``, as systemd's own restart or an operator
would), a co-tenant injected into the fake NVML state:

1. within the margin: the unit starts as planned;
2. below the floor under ``shrink``: it starts with the drift rule applied to the floor
   (budget and tokens before/after in the gate's record and in vllm_boot_check);
3. below the floor under ``refuse``: no start, one journal line naming the rank, its free
   memory and its floor, exit 78 and no restart;
4. far below the floor under ``shrink``: the smaller budget misses the admission plan,
   refused the same way;
4b. below the floor under ``profile``: vLLM's own profiling at a utilization from the free
   memory now minus the guard, capped so that it sizes no more than the plan;
5. the same co-tenants at a guest reboot (systemd starts the units at boot);
6. ``audit.yml`` and the exporter's textfile metrics (scraped from the real
   prometheus-node-exporter in the guest) while the co-tenants are there;
7. the plan file edited on the host (budget and expectations doubled) with a co-tenant
   below the floor: the gate refuses it against the checksum the deploy's drop-in
   records, and the audit and the exporter say ``plan_edited``;
7b. a GPU whose row remapping is pending (NVML health): refused, named by index and UUID, exported;
8. a controller whose clock is 400 days ahead of the hosts' (libfaketime on ``ansible-playbook``
   alone: the test hosts share this machine's clock): the audit judges ages on the controller's
   clock, names the skew per host and says ``reprofile_due`` rather than ``ok``;

and no started budget ever exceeds the plan. One fleet, one rollout for the module.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from typing import Any

import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from simfleet import REPO, SimFleet, l40s_fleet  # pylint: disable=import-error

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._kv_capacity import floor_utilization

GIB = 1 << 30
MIB = 1 << 20
CLASS = "bg-l40s"
HOSTS = ["sim-bg-1", "sim-bg-2"]
SHRINK, REFUSE = HOSTS
PROFILE = "sim-bg-3"
UNIT = "vllm-main.service"
STATE = "/var/lib/gpufleet-vllm/main.boot-gate.json"
RESTART_SEC = 2

FLEET = {
    **l40s_fleet(0.5),
    "classes": {CLASS: {"gpu_model": "l40s", "gpus": 1, "model": "llama-3.1-8b-instruct"}},
    # a 1 GiB co-tenant on the refuse host while the class is planned: it is the weakest, so
    # the shrink host keeps a 1 GiB margin above the class's floor
    "hosts": {SHRINK: {"class": CLASS}, REFUSE: {"class": CLASS, "base_used": ["1GiB"]}, PROFILE: {"class": CLASS}},
}

# admission: 8 requests of 8192 tokens = 4097 blocks (8 GiB at 2 MiB per block): a shrink
# of a few GiB still holds it, one of 24 GiB does not
GROUP_VARS = {
    "gpufleet_model": "/srv/models/llama-3.1-8b-instruct",
    "gpufleet_model_config": str(REPO / "sim" / "models" / "llama-3.1-8b-instruct" / "config.json"),
    "gpufleet_serve_args": {"max_model_len": 8192, "max_num_seqs": 16, "dtype": "bfloat16", "block_size": 16},
    "gpufleet_instances": [{"name": "main", "gpus": [0], "port": 8000}],
    "gpufleet_guard": "0.5GiB",
    "gpufleet_admission": {"concurrency": 8, "tokens_per_request": 8192},
    "gpufleet_rollout_serial": ["100%"],
    "gpufleet_canary_load": {"requests": 2, "concurrency": 1, "prompt_tokens": 16, "max_tokens": 4},
    "gpufleet_canary_tolerances": {"latency_ratio": 20.0},
    "vllm_service_read_write_paths": ["/etc/fake-nvml"],
    "vllm_service_boot_timeout": 120,
    "vllm_service_restart_sec": RESTART_SEC,
}


@pytest.fixture(scope="module")
def fleet(harness, tmp_path_factory):  # harness: conftest (root + rootfs)
    f = SimFleet(tmp_path_factory.mktemp("bootgate"), harness, FLEET, GROUP_VARS)
    try:
        f.create({CLASS: [*HOSTS, PROFILE]})
        inventory = yaml.safe_load(f.inventory.read_text(encoding="utf-8"))
        group = inventory["all"]["children"][CLASS.replace("-", "_")]
        group["hosts"][REFUSE]["vllm_service_boot_gate"] = "refuse"
        group["hosts"][PROFILE]["vllm_service_boot_gate"] = "profile"
        f.inventory.write_text(yaml.safe_dump(inventory), encoding="utf-8")
        rc, out = f.rollout()
        assert rc == 0, out[-6000:]
        yield f
    finally:
        f.sim.destroy()


def gate_state(fleet: SimFleet, host: str) -> dict[str, Any]:
    text = fleet.read(host, STATE)
    assert text, f"{host}: no boot gate record at {STATE}"
    return json.loads(text)


def show_unit(fleet: SimFleet, host: str, unit: str, *props: str) -> dict[str, str]:
    out = fleet.harness.exec(host, ["systemctl", "show", "-p", ",".join(props), unit]).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def show(fleet: SimFleet, host: str, *props: str) -> dict[str, str]:
    return show_unit(fleet, host, UNIT, *props)


def restart(fleet: SimFleet, host: str) -> dict[str, Any]:
    """``systemctl restart`` on the host, then the gate's record of that start."""
    fleet.harness.exec(host, ["systemctl", "reset-failed", UNIT])
    fleet.harness.exec(host, ["systemctl", "restart", UNIT])
    invocation = show(fleet, host, "InvocationID")["InvocationID"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = fleet.read(host, STATE)
        state = json.loads(text) if text else {}
        if state.get("invocation_id") == invocation:
            return state
        time.sleep(0.2)
    raise AssertionError(f"{host}: the gate recorded no decision for invocation {invocation}")


def restart_refused(fleet: SimFleet, host: str) -> dict[str, str]:
    """``systemctl restart`` of a start the gate refuses: the unit ends failed with the gate's exit 78 (no restart loop)."""
    fleet.harness.exec(host, ["systemctl", "reset-failed", UNIT])
    fleet.harness.exec(host, ["systemctl", "restart", UNIT])
    deadline = time.monotonic() + 120
    while show(fleet, host, "ActiveState")["ActiveState"] not in ("failed", "inactive") and time.monotonic() < deadline:
        time.sleep(0.2)
    state = show(fleet, host, "ActiveState", "ExecMainStatus", "InvocationID", "NRestarts")
    assert state["ActiveState"] == "failed" and state["ExecMainStatus"] == "78", state
    return state


def journal_of(fleet: SimFleet, host: str, invocation: str, *needles: str, timeout: float = 60) -> str:
    """What one start of the unit wrote to the journal, read again until it holds every needle: journald takes
    a start's last lines from its stream after the unit already ended, later on a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        text = fleet.harness.exec(host, ["journalctl", f"_SYSTEMD_INVOCATION_ID={invocation}", "-o", "cat", "--no-pager"]).stdout
        if all(n in text for n in needles) or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def starting_margins(fleet: SimFleet) -> dict[str, int]:
    """Restart every host's unit and return each rank 0's margin to its floor, asserting that each host
    starts at or above its floor: the tests of this module share one fleet, and a test that sizes a
    co-tenant from the margin must not inherit what an earlier one left (a co-tenant, an engine's memory)."""
    margins = {}
    for host in HOSTS:
        record = restart(fleet, host)
        margins[host] = record["ranks"][0]["margin_bytes"]
        assert record["action"] == "start" and margins[host] >= 0, (
            f"{host} starts {margins[host]} B from its floor before this test changed anything; its fake NVML "
            f"state: {fleet.read(host, '/etc/fake-nvml/state')}")
    return margins


def current_record(fleet: SimFleet, host: str, timeout: float = 60) -> dict[str, Any]:
    """The gate's record of the unit's current start (systemd starts it on its own at boot)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        invocation = show(fleet, host, "InvocationID").get("InvocationID")
        text = fleet.read(host, STATE)
        state = json.loads(text) if text else {}
        if invocation and state.get("invocation_id") == invocation:
            return state
        time.sleep(0.5)
    raise AssertionError(f"{host}: no gate record of the unit's current start")


def boot_check(fleet: SimFleet, host: str, plan: dict[str, Any]) -> dict[str, Any]:
    """gpufleet.vllm.vllm_boot_check as the role calls it, ad hoc over SSH."""
    args = {"unit": UNIT, "port": 8000, "expected_kv_cache_memory_bytes": plan["kv_cache_memory_bytes"],
            "min_tokens": plan["kv_cache_tokens"], "timeout": 90, "boot_gate_state": STATE}
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_CALLBACK_RESULT_FORMAT="json")
    done = procgroup.run(["ansible", "-i", str(fleet.inventory), host, "-m", "gpufleet.vllm.vllm_boot_check",
                          "-a", json.dumps(args)], env=env, cwd=REPO, timeout=180)
    # "<host> | SUCCESS => {...}" or "<host> | FAILED! => {...}"
    head, sep, body = done.stdout.partition(" => ")
    assert sep and host in head, done.stdout + done.stderr
    result = json.loads(body)
    result["failed"] = "FAILED" in head or "UNREACHABLE" in head  # the callback leaves it out of the shown result
    return result


def engine_argv(fleet: SimFleet, host: str) -> list[str]:
    """The running engine's command line (after the gate's execv)."""
    pid = show(fleet, host, "MainPID")["MainPID"]
    return fleet.harness.exec(host, ["cat", f"/proc/{pid}/cmdline"]).stdout.split("\0")


def engine_budget(fleet: SimFleet, host: str) -> int | None:
    """--kv-cache-memory-bytes of the running engine's command line."""
    argv = engine_argv(fleet, host)
    return int(argv[argv.index("--kv-cache-memory-bytes") + 1]) if "--kv-cache-memory-bytes" in argv else None


def cotenant(fleet: SimFleet, host: str, size: int | None) -> None:
    fleet.sim.inject_cotenant(host, gpu=0, size=size, pid=None, remove=size is None)


def wait_active(fleet: SimFleet, host: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while fleet.active(host) != "active" and time.monotonic() < deadline:
        time.sleep(0.5)


def test_the_rollout_writes_a_format_3_plan_and_every_unit_starts_through_the_gate(fleet):
    for host, policy in ((SHRINK, "shrink"), (REFUSE, "refuse"), (PROFILE, "profile")):
        plan = fleet.plan(host)
        assert plan["format"] == 3 and plan["schema"] == 1 and plan["manual"] is True
        assert plan["boot_gate"] == {"policy": policy, "state_file": STATE, "gpu_health": "refuse"}
        # the cards by UUID and where they sit, one per GPU
        assert len(plan["gpu_uuids"]) == len(plan["gpu_pci_bus_ids"]) == len(plan["gpus"]), plan
        assert plan["capacity"]["bytes_per_block"] > 0 and plan["max_model_len"] == 8192
        assert plan["admission"]["required_blocks"] == 8 * 512 + 1
        state = gate_state(fleet, host)
        assert state["action"] == "start" and state["policy"] == policy
        assert state["ranks"][0]["floor_bytes"] == plan["free_floor_bytes"]["0"]
        assert state["ranks"][0]["margin_bytes"] >= 0
        assert engine_budget(fleet, host) == plan["kv_cache_memory_bytes"]
        assert f"--policy {policy}" in (fleet.unit(host) or "")
        assert "RestartPreventExitStatus=78" in (fleet.unit(host) or "")


PROBE_UNIT = """[Unit]
Description=gpufleet test: does RestartPreventExitStatus= stop restarts of a refusing {where}?
StartLimitIntervalSec=0

[Service]
Type=exec
{pre}ExecStart=/bin/sh -c '{main}'
Restart=on-failure
RestartSec=1
RestartPreventExitStatus=78
"""


def test_systemd_honours_restart_prevent_exit_status_only_for_the_main_process(fleet):
    """Why the gate is the unit's ExecStart (a wrapper that execs the engine), not an ExecStartPre:
    the same refusal (exit 78, listed in RestartPreventExitStatus=) stops the unit for good from
    the main process and is restarted like any failure from an ExecStartPre, on this systemd."""
    host = SHRINK
    units = {"gpufleet-probe-pre.service": PROBE_UNIT.format(where="ExecStartPre", pre="ExecStartPre=/bin/sh -c 'exit 78'\n",
                                                             main="exec sleep 600"),
             "gpufleet-probe-main.service": PROBE_UNIT.format(where="ExecStart", pre="", main="exit 78")}
    for name, text in units.items():
        (fleet.guest_path(host, f"/etc/systemd/system/{name}")).write_text(text, encoding="utf-8")
    fleet.harness.exec(host, ["systemctl", "daemon-reload"], check=True)
    try:
        for name in units:
            fleet.harness.exec(host, ["systemctl", "start", "--no-block", name])
        time.sleep(4.5)  # RestartSec=1: a unit that is restarted has been by now, several times
        pre = show_unit(fleet, host, "gpufleet-probe-pre.service", "NRestarts")
        main = show_unit(fleet, host, "gpufleet-probe-main.service", "NRestarts", "ActiveState", "ExecMainStatus")
        assert int(pre["NRestarts"]) >= 2, pre
        assert main == {"NRestarts": "0", "ActiveState": "failed", "ExecMainStatus": "78"}, main
        version = fleet.harness.exec(host, ["systemctl", "--version"]).stdout.split("\n", 1)[0]
        (fleet.workdir / "systemd-restart-prevent.txt").write_text(
            f"{version}: ExecStartPre exit 78 -> NRestarts {pre['NRestarts']} after 4.5 s; ExecStart exit 78 -> {main}\n",
            encoding="utf-8")
    finally:
        for name in units:
            fleet.harness.exec(host, ["systemctl", "stop", name])
            fleet.harness.exec(host, ["systemctl", "reset-failed", name])
            fleet.guest_path(host, f"/etc/systemd/system/{name}").unlink(missing_ok=True)
        fleet.harness.exec(host, ["systemctl", "daemon-reload"])


def test_a_cotenant_within_the_margin_starts_as_planned(fleet):
    plan = fleet.plan(SHRINK)
    margin = gate_state(fleet, SHRINK)["ranks"][0]["margin_bytes"]
    assert margin >= GIB - 64 * MIB, "the weakest host sets the floor: the other one keeps about 1 GiB above it"
    cotenant(fleet, SHRINK, margin // 2)
    try:
        state = restart(fleet, SHRINK)
        assert state["action"] == "start" and state["degraded"] is None
        assert 0 <= state["ranks"][0]["margin_bytes"] <= margin - margin // 2
        result = boot_check(fleet, SHRINK, plan)
        assert not result["failed"], result
        assert result["degraded"] is None
        assert result["kv_cache_memory_bytes"] == plan["kv_cache_memory_bytes"]
    finally:
        cotenant(fleet, SHRINK, None)


def test_a_cotenant_below_the_floor_shrinks_the_budget_under_shrink(fleet):
    plan = fleet.plan(SHRINK)
    margin = restart(fleet, SHRINK)["ranks"][0]["margin_bytes"]
    cotenant(fleet, SHRINK, margin + GIB)  # 1 GiB below the floor
    try:
        state = restart(fleet, SHRINK)
        assert state["action"] == "shrink", state["message"]
        want = plan["kv_cache_memory_bytes"] - GIB
        degraded = state["degraded"]
        assert degraded["kv_cache_memory_bytes_before"] == plan["kv_cache_memory_bytes"]
        assert degraded["kv_cache_memory_bytes_after"] == want
        assert degraded["kv_cache_tokens_before"] == plan["kv_cache_tokens"]
        assert degraded["kv_cache_tokens_after"] == want // plan["capacity"]["bytes_per_block"] * 16
        result = boot_check(fleet, SHRINK, plan)
        assert not result["failed"], result
        # the engine reserved exactly the shrunk budget, and says so in /metrics
        assert result["kv_cache_memory_bytes"] == want
        assert result["degraded"]["kv_cache_memory_bytes_after"] == want
        assert result["degraded"]["kv_cache_tokens_after"] == degraded["kv_cache_tokens_after"]
        assert engine_budget(fleet, SHRINK) == want < plan["kv_cache_memory_bytes"]
        journal = fleet.harness.exec(SHRINK, ["journalctl", "-u", UNIT, "-o", "cat", "--no-pager"]).stdout
        assert f"budget {plan['kv_cache_memory_bytes']} -> {want} B" in journal
    finally:
        cotenant(fleet, SHRINK, None)


def test_a_cotenant_below_the_floor_is_refused_without_a_restart_loop_under_refuse(fleet):
    plan = fleet.plan(REFUSE)
    margin = restart(fleet, REFUSE)["ranks"][0]["margin_bytes"]
    cotenant(fleet, REFUSE, margin + GIB)
    try:
        state = restart(fleet, REFUSE)
        assert state["action"] == "refuse" and state["started"] is None
        floor = plan["free_floor_bytes"]["0"]
        line = f"rank 0 (GPU 0) free {floor - GIB} B"
        assert line in state["message"] and f"< floor {floor} B" in state["message"]
        time.sleep(RESTART_SEC * 3)  # systemd would have restarted it by now
        props = show(fleet, REFUSE, "ActiveState", "NRestarts", "ExecMainStatus", "Result")
        assert props["ActiveState"] == "failed" and props["NRestarts"] == "0", props
        assert props["ExecMainStatus"] == "78", props
        journal = fleet.harness.exec(REFUSE, ["journalctl", "-u", UNIT, "-o", "cat", "--no-pager"]).stdout
        assert journal.count(line) == 1, "one journal line, no restart loop"
        result = boot_check(fleet, REFUSE, plan)
        assert result["failed"] and line in result["msg"]
    finally:
        cotenant(fleet, REFUSE, None)
    assert restart(fleet, REFUSE)["action"] == "start"
    wait_active(fleet, REFUSE)
    assert fleet.active(REFUSE) == "active"


def test_shrink_refuses_when_the_smaller_budget_misses_the_admission_plan(fleet):
    plan = fleet.plan(SHRINK)
    margin = restart(fleet, SHRINK)["ranks"][0]["margin_bytes"]
    bpb = plan["capacity"]["bytes_per_block"]
    # just enough shortfall that the shrunk budget holds one block fewer than the admission plan
    shortfall = plan["kv_cache_memory_bytes"] - (plan["admission"]["required_blocks"] - 1) * bpb
    cotenant(fleet, SHRINK, margin + shortfall)
    try:
        state = restart(fleet, SHRINK)
        assert state["action"] == "refuse", state["message"]
        assert "below the admission plan" in state["message"]
        assert state["attempted"]["num_blocks_after"] == plan["admission"]["required_blocks"] - 1
        time.sleep(RESTART_SEC * 3)
        props = show(fleet, SHRINK, "ActiveState", "NRestarts")
        assert props == {"ActiveState": "failed", "NRestarts": "0"}, props
    finally:
        cotenant(fleet, SHRINK, None)
    restart(fleet, SHRINK)
    wait_active(fleet, SHRINK)


def test_a_cotenant_below_the_floor_starts_vllm_profiling_under_profile(fleet):
    plan = fleet.plan(PROFILE)
    assert plan["profile_max_utilization"] is not None, "the profiled reference gives vLLM's non-KV memory"
    margin = restart(fleet, PROFILE)["ranks"][0]["margin_bytes"]
    cotenant(fleet, PROFILE, margin + GIB)  # 1 GiB below the floor
    try:
        state = restart(fleet, PROFILE)
        assert state["action"] == "profile", state["message"]
        rank = state["ranks"][0]
        assert rank["margin_bytes"] == -GIB
        # current free memory minus the guard and the CUDA-context allowance, never above the plan's
        # startup utilization nor above the utilization at which vLLM's profiling sizes the plan
        allowance = plan["free_floor_bytes"]["0"] - plan["vllm_floor_bytes"]["0"]
        from_free = floor_utilization(rank["free_bytes"] - plan["guard_bytes"] - allowance, rank["total_bytes"])
        want = min(from_free, plan["gpu_memory_utilization"], plan["profile_max_utilization"])
        assert state["started"] == {"kv_cache_memory_bytes": None, "gpu_memory_utilization": want,
                                    "num_blocks": None, "kv_cache_tokens": None}
        assert state["degraded"]["gpu_memory_utilization_after"] == want
        assert state["degraded"]["kv_cache_memory_bytes_before"] == plan["kv_cache_memory_bytes"]
        argv = engine_argv(fleet, PROFILE)
        assert "--kv-cache-memory-bytes" not in argv
        assert argv[argv.index("--gpu-memory-utilization") + 1] == str(want)
        result = boot_check(fleet, PROFILE, plan)
        assert not result["failed"], result
        assert result["degraded"]["action"] == "profile" and result["degraded"]["policy"] == "profile"
        # what vLLM's own profiling sized (its blocks, /metrics): never above the plan's blocks
        assert result["num_blocks"] and 0 < result["num_blocks"] <= plan["num_blocks"], result
        if result.get("kv_cache_memory_bytes") is not None:
            assert result["kv_cache_memory_bytes"] <= plan["kv_cache_memory_bytes"], result
        journal = fleet.harness.exec(PROFILE, ["journalctl", "-u", UNIT, "-o", "cat", "--no-pager"]).stdout
        assert journal.count("boot gate (profile) starts with vLLM's own profiling") == 1
        assert f"--gpu-memory-utilization {want}" in journal
    finally:
        cotenant(fleet, PROFILE, None)
    assert restart(fleet, PROFILE)["action"] == "start"
    wait_active(fleet, PROFILE)
    assert engine_budget(fleet, PROFILE) == plan["kv_cache_memory_bytes"]


def test_a_guest_reboot_with_a_cotenant_below_the_floor(fleet):
    """The machines reboot (their disks kept, /run and processes not), a co-tenant 1 GiB below the
    floor on both: systemd starts the units at boot, no controller in the loop."""
    margins = starting_margins(fleet)
    plans = {h: fleet.plan(h) for h in HOSTS}
    for host in HOSTS:
        wait_active(fleet, host)
        cotenant(fleet, host, margins[host] + GIB)
    try:
        before = {h: gate_state(fleet, h)["invocation_id"] for h in HOSTS}
        for host in HOSTS:
            fleet.harness.reboot(host)
        shrunk = current_record(fleet, SHRINK)
        refused = current_record(fleet, REFUSE)
        assert shrunk["invocation_id"] != before[SHRINK] and refused["invocation_id"] != before[REFUSE]
        want = plans[SHRINK]["kv_cache_memory_bytes"] - GIB
        assert shrunk["action"] == "shrink" and shrunk["degraded"]["kv_cache_memory_bytes_after"] == want
        wait_active(fleet, SHRINK)
        assert fleet.active(SHRINK) == "active" and engine_budget(fleet, SHRINK) == want
        assert refused["action"] == "refuse" and "< floor" in refused["message"]
        time.sleep(RESTART_SEC * 3)
        props = show(fleet, REFUSE, "ActiveState", "NRestarts")
        assert props == {"ActiveState": "failed", "NRestarts": "0"}, props
    finally:
        for host in HOSTS:
            cotenant(fleet, host, None)
    for host in HOSTS:
        assert restart(fleet, host)["action"] == "start"
        wait_active(fleet, host)


def test_no_started_budget_ever_exceeds_the_plan(fleet):
    for host in [*HOSTS, PROFILE]:
        plan = fleet.plan(host)
        state = gate_state(fleet, host)
        assert state["planned"]["kv_cache_memory_bytes"] == plan["kv_cache_memory_bytes"]
        budget = engine_budget(fleet, host)
        assert budget is not None and budget <= plan["kv_cache_memory_bytes"]
        journal = fleet.harness.exec(host, ["journalctl", "-u", UNIT, "-o", "cat", "--no-pager"]).stdout
        # every start's line states the budget it started with: none above the plan
        for line in journal.splitlines():
            if "boot gate (shrink) starts degraded" in line:
                after = int(line.split(" -> ")[1].split(" B")[0])
                assert after < plan["kv_cache_memory_bytes"], line
            if "boot gate (profile) starts" in line:
                util = float(line.split("--gpu-memory-utilization ")[1].split(" ")[0])
                assert util <= plan["profile_max_utilization"], line


def scrape(fleet: SimFleet, host: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """node_exporter's /metrics on the host, parsed with prometheus_client: (name, labels) -> value."""
    address = fleet.sim.info(host).address
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}:9100/metrics", timeout=5) as answer:  # nosec - test host
                text = answer.read().decode("utf-8")
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def exporter_samples(fleet: SimFleet, host: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One run of the exporter (what its timer runs), then node_exporter's textfile collector scraped."""
    fleet.harness.exec(host, ["systemctl", "start", "gpufleet-vllm-metrics.service"], check=True)
    fleet.harness.exec(host, ["systemctl", "start", "prometheus-node-exporter.service"], check=True)
    try:
        return scrape(fleet, host)
    finally:
        fleet.harness.exec(host, ["systemctl", "stop", "prometheus-node-exporter.service"])


def test_audit_and_textfile_metrics_report_the_hosts_below_their_floor(fleet):
    """Co-tenants below the floor on both hosts, no restart: audit.yml says what the next start
    would do (and fails), node_exporter serves the same margins from the exporter's textfile."""
    margins = starting_margins(fleet)
    for host in HOSTS:
        wait_active(fleet, host)
        cotenant(fleet, host, margins[host] + GIB)
    try:
        report_dir = fleet.workdir / "audit-reports"
        report_dir.mkdir()
        env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_HOST_KEY_CHECKING="False")
        done = procgroup.run(["ansible-playbook", "-i", str(fleet.inventory), str(REPO / "playbooks" / "audit.yml"),
                              "-e", json.dumps({"gpufleet_report_dir": str(report_dir)})], env=env, cwd=REPO, timeout=300)
        (fleet.workdir / "audit.log").write_text(done.stdout + done.stderr, encoding="utf-8")
        assert done.returncode != 0, "an instance that would be refused fails the audit"
        (run_dir,) = report_dir.glob("audit-*")
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
        assert report["kind"] == "audit"
        assert report["summary"]["audit"]["would_refuse"] == [f"{REFUSE}/main"]
        assert report["summary"]["audit"]["would_shrink"] == [f"{SHRINK}/main"]
        assert f"refused at next start: {REFUSE}/main" in done.stdout
        assert (run_dir / "report.md").is_file() and (run_dir / "report.html").is_file()
        audited = {h["host"]: h["instances"][0] for h in report["audit"]["hosts"]}
        for host in HOSTS:
            assert audited[host]["ranks"][0]["margin_bytes"] == -GIB, host
            assert audited[host]["key_matches"] is True, "the plan's key is the class's newest reference"

        # the exporter (what its timer runs) and node_exporter's textfile collector
        samples = exporter_samples(fleet, SHRINK)
        plan = fleet.plan(SHRINK)
        rank = (("class", CLASS), ("gpu", "0"), ("rank", "0"), ("vllm_instance", "main"))
        inst = (("class", CLASS), ("vllm_instance", "main"))
        assert samples[("gpufleet_vllm_margin_bytes", rank)] == -GIB
        assert samples[("gpufleet_vllm_floor_bytes", rank)] == plan["free_floor_bytes"]["0"]
        assert samples[("gpufleet_vllm_budget_bytes", inst)] == plan["kv_cache_memory_bytes"]
        assert samples[("gpufleet_vllm_would_shrink", inst)] == 1
        assert samples[("gpufleet_vllm_would_refuse", inst)] == 0
        assert abs(samples[("gpufleet_vllm_last_audit_timestamp_seconds", inst)] - time.time()) < 120
        assert samples[("node_textfile_scrape_error", ())] == 0
    finally:
        for host in HOSTS:
            cotenant(fleet, host, None)


def test_a_plan_file_edited_on_the_host_is_refused_by_the_gate_and_named_by_the_audit(fleet):
    """The plan file's budget and expectations doubled on the host, a co-tenant 256 MiB below the floor: the
    gate would have 'shrunk' from twice the plan. The drop-in the deploy wrote beside the unit records the
    file's checksum: the gate starts nothing and names both checksums; audit.yml and the exporter say
    plan_edited."""
    host = SHRINK
    margins = starting_margins(fleet)
    assert fleet.read(host, "/etc/systemd/system/vllm-main.service.d/gpufleet-plan.conf"), "the deploy wrote the drop-in"
    path = fleet.guest_path(host, fleet.plan_path)
    original = path.read_text(encoding="utf-8")
    doc = json.loads(original)
    launch = doc["launch"]
    launch["kv_cache_memory_bytes"] *= 2
    launch["expect"] = {k: v * 2 for k, v in launch["expect"].items()}
    path.write_text(json.dumps(doc, indent=4, sort_keys=True) + "\n", encoding="utf-8")  # owner and mode stay
    cotenant(fleet, host, margins[host] + 256 * MIB)
    try:
        state = restart_refused(fleet, host)
        journal = journal_of(fleet, host, state["InvocationID"], "was changed since the deploy wrote it (the unit's drop-in records checksum")
        assert "was changed since the deploy wrote it (the unit's drop-in records checksum" in journal, journal
        assert "starts degraded" not in journal and "budget" not in journal.split("was changed since")[0].rsplit("\n", 1)[-1]

        report_dir = fleet.workdir / "audit-edited"
        report_dir.mkdir()
        env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_HOST_KEY_CHECKING="False")
        done = procgroup.run(["ansible-playbook", "-i", str(fleet.inventory), str(REPO / "playbooks" / "audit.yml"),
                              "-e", json.dumps({"gpufleet_report_dir": str(report_dir)})], env=env, cwd=REPO, timeout=300)
        assert done.returncode != 0, "an edited plan file fails the audit"
        (run_dir,) = report_dir.glob("audit-*")
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
        assert report["summary"]["audit"]["plan_edited"] == [f"{host}/main"], report["summary"]
        assert f"plan file edited on the host: {host}/main" in done.stdout
        skews = [h["clock_skew_seconds"] for h in report["audit"]["hosts"]]
        assert all(s is not None and abs(s) < 120 for s in skews), f"one clock on this machine: {skews}"

        samples = exporter_samples(fleet, host)
        assert samples[("gpufleet_vllm_plan_edited", (("class", CLASS), ("vllm_instance", "main")))] == 1
    finally:
        path.write_text(original, encoding="utf-8")
        cotenant(fleet, host, None)
        fleet.harness.exec(host, ["systemctl", "reset-failed", UNIT])
        fleet.harness.exec(host, ["systemctl", "restart", UNIT])
        wait_active(fleet, host)
    assert fleet.active(host) == "active", "the file as the deploy wrote it starts again"


def test_another_card_at_the_planned_index_is_refused_and_exported(fleet):
    """The plan file names the instance's card by UUID (the rollout's probe read it). Another card at that
    index (replaced, or the GPUs enumerated anew after a reboot): the gate starts nothing on it and says
    which card it found; the exporter shows the refused start and the audit verdict."""
    host = SHRINK
    doc = json.loads(fleet.read(host, fleet.plan_path))
    (planned,) = doc["gpu_uuids"]
    assert planned.startswith("GPU-") and doc["gpus"] == [0]
    fleet.sim.inject_gpu_replaced(host, 0, clear=False)
    try:
        state = restart_refused(fleet, host)
        journal = journal_of(fleet, host, state["InvocationID"], f"the plan was made for {planned}",
                             "not starting on a card the plan was not made for")
        assert f"the plan was made for {planned}" in journal and "not starting on a card the plan was not made for" in journal, journal
        assert gate_state(fleet, host)["action"] == "refuse"

        samples = exporter_samples(fleet, host)
        inst = (("class", CLASS), ("vllm_instance", "main"))
        assert samples[("gpufleet_vllm_would_refuse", inst)] == 1
        assert samples[("gpufleet_vllm_last_start_refused", inst)] == 1
        assert samples[("gpufleet_vllm_last_start_action", (("action", "refuse"), *inst))] == 1
        assert samples[("gpufleet_vllm_nvml_error", inst)] == 0
    finally:
        fleet.sim.inject_gpu_replaced(host, 0, clear=True)
        fleet.harness.exec(host, ["systemctl", "reset-failed", UNIT])
        fleet.harness.exec(host, ["systemctl", "restart", UNIT])
        wait_active(fleet, host)
    assert fleet.active(host) == "active", "the planned card back at its index starts again"
    assert exporter_samples(fleet, host)[("gpufleet_vllm_last_start_refused", (("class", CLASS), ("vllm_instance", "main")))] == 0


def test_a_gpu_with_a_pending_row_remapping_is_refused_and_exported(fleet):
    """NVML health at the start: the card's rows were remapped after an uncorrectable error and the remapping waits
    for a GPU reset (``inject gpu-health --fault remap-pending``). Under the default ``gpu_health: refuse`` the gate
    starts nothing on it, naming the GPU's index and UUID and why; the exporter writes the failing check
    (``gpufleet_vllm_gpu_health{check="remap_pending"}`` 0) beside the refused start; once the GPU was reset, it starts."""
    host = SHRINK
    (uuid,) = json.loads(fleet.read(host, fleet.plan_path))["gpu_uuids"]
    fleet.sim.inject_gpu_health(host, 0, "remap-pending", clear=False)
    rank = (("class", CLASS), ("gpu", "0"), ("rank", "0"), ("uuid", uuid), ("vllm_instance", "main"))
    inst = (("class", CLASS), ("vllm_instance", "main"))
    try:
        state = restart_refused(fleet, host)
        journal = journal_of(fleet, host, state["InvocationID"], "not starting on an unhealthy GPU (gpu_health: refuse)")
        assert f"rank 0 (GPU 0, {uuid}): a row remapping is pending (reset the GPU to apply it)" in journal, journal
        assert "not starting on an unhealthy GPU (gpu_health: refuse)" in journal, journal
        record = gate_state(fleet, host)
        assert record["action"] == "refuse" and record["ranks"][0]["health"]["remapped_rows"]["pending"] is True

        samples = exporter_samples(fleet, host)
        assert samples[("gpufleet_vllm_gpu_health", (("check", "remap_pending"), *rank))] == 0
        assert samples[("gpufleet_vllm_gpu_health", (("check", "ecc_uncorrected"), *rank))] == 1
        assert samples[("gpufleet_vllm_would_refuse", inst)] == 1
        assert samples[("gpufleet_vllm_last_start_refused", inst)] == 1
    finally:
        fleet.sim.inject_gpu_health(host, 0, None, clear=True)
        fleet.harness.exec(host, ["systemctl", "reset-failed", UNIT])
        fleet.harness.exec(host, ["systemctl", "restart", UNIT])
        wait_active(fleet, host)
    assert fleet.active(host) == "active", "the GPU reset (no remapping pending), the unit starts again"
    assert exporter_samples(fleet, host)[("gpufleet_vllm_gpu_health", (("check", "remap_pending"), *rank))] == 1


def test_a_controller_clock_far_from_the_hosts_is_named_by_the_audit(fleet):
    """The controller's clock 400 days ahead of the hosts' (the hosts' 400 days behind, as in an
    unsynchronised rack): the plans' ages are judged on the controller's clock, which wrote their
    planned_at, so they are 400 days old, not negative; every host's skew is reported and every
    instance says reprofile_due with the reason, where a host clock alone would have said ok."""
    faketime = shutil.which("faketime")
    assert faketime, "tests/tools/apt-deps.sh installs faketime (libfaketime)"
    report_dir = fleet.workdir / "audit-skew"
    report_dir.mkdir()
    # an offset: every clock of the controller moves by the same 400 days and keeps running (libfaketime's
    # DONT_FAKE_MONOTONIC would break Python's sleeps, which wait on an absolute monotonic time)
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_HOST_KEY_CHECKING="False")
    done = procgroup.run([faketime, "-f", "+400d", "ansible-playbook", "-i", str(fleet.inventory),
                          str(REPO / "playbooks" / "audit.yml"),
                          "-e", json.dumps({"gpufleet_report_dir": str(report_dir), "gpufleet_reprofile_after_days": 30})],
                         env=env, cwd=REPO, timeout=300)
    found = list(report_dir.glob("audit-*"))
    assert len(found) == 1, "the audit wrote its report:\n" + done.stdout[-6000:]
    (run_dir,) = found
    report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    assert {h["host"] for h in report["audit"]["hosts"]} == {*HOSTS, PROFILE}, done.stdout[-4000:]
    days = 400 * 86400
    for host in report["audit"]["hosts"]:
        skew = host["clock_skew_seconds"]
        assert skew is not None and abs(skew + days) < 300, f"{host['host']}: the host is 400 days behind, got {skew} s"
        assert host["instances"], host
        for inst in host["instances"]:
            assert inst["verdict"] == "reprofile_due", inst
            why = " ".join(inst["reasons"])
            assert "s behind the controller's: ages are judged on the controller's; fix the host's time (NTP)" in why, why
            assert "days old (allowed 30): profile the class again" in why and 399 < inst["plan_age_days"] < 401, inst
    judged = sum(len(h["instances"]) for h in report["audit"]["hosts"])
    assert report["summary"]["audit"]["verdicts"] == {"reprofile_due": judged}, report["summary"]

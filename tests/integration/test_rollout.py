# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""playbooks/rollout.yml end to end, for real, over SSH, on a simulated three-host class.

The hosts are systemd-nspawn guests (real systemd, real sshd) whose GPUs come from the
fake NVML library and whose ``vllm`` is the simulated engine (sim/engine/vllm), set up
by sim/fleetctl.py from a fleet file written here (tests/integration/simfleet.py, shared
with the fault suite). Every test runs ansible-playbook
and then checks, on every host, the unit file on disk, the kept previous unit and
whether the service is active.

The tests run in file order and build on each other's end state (one fleet per module,
as booting and profiling cost most of the time). An engine that fails at boot and is rolled back
is tested on the real engine (tests/integration/test_real_engine.py):

1. clean rollout (profiled canary, plan, manual canary, three serial batches);
2. the same run again, with free memory moved by a few MiB, changes nothing (the budget is kept);
   the read-only playbooks (probe.yml, audit.yml; plan.yml --check in 7.) leave every host's files
   and units as they were;
   a class that bakes its batches under traffic and rolls the class back on a failure: a second batch whose
   new engine serves slower than the host not yet changed fails its analysis, it and the first batch's host
   are rolled back; without traffic an analysis is inconclusive, which fails the batch by default; a
   failing bake_start hook fails the bake; with no policy set (rollback_class), a host that fails its
   boot in a batch of two has the other host of its batch and the first batch's host rolled back;
3. a co-tenant appears on the second host after planning: its gate stops the rollout
   before its service is touched, the first batch keeps the new unit (the module's
   gpufleet_on_failure: stop), the third never runs;
4. a co-tenant appears on the second host between its two gates: the gate after the stop (read
   in the call that stopped the instance) fails, the host is rolled back and restarted;
5. an admission plan the class cannot hold stops the class before any host is touched;
6. an unreachable host is left out, the others are rolled out, the run fails;
7. a changed serve argument changes the compatibility key: plan.yml --check outlines what the rollout will do
   (the chosen canary host, the outage of its production instance) and changes no host's files or units;
   the rollout forces a profiled canary
   (as the service user) and re-probes only once the slowly restarted production instance has settled;
8. a new key under unchanged units (a driver upgrade on every host) restarts every host in its batch;
9. wrong service inputs on the last host stop the run before the first batch;
10. a host on another driver than its class reference stops the run before any host;
11. a host still on a hand-written ``vllm.service`` (simulated engine) with a drop-in: profile.yml
    runs the rollout's profiled canary there (drained through the hooks, as the service user, the
    hand-written unit stopped and running again before the undrain); the rollout takes it over
    (the canaries stop and restart it, its memory counts as the host's own at the gates, it is
    stopped and disabled in the change that starts vllm-main, kept with its drop-in), and
    rollback.yml puts it back, enabled and running.
"""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

import procgroup  # noqa: E402  pylint: disable=wrong-import-position,import-error
import pytest
import yaml
from simfleet import (  # pylint: disable=import-error
    PLAN as PLAN_PLAYBOOK,  # pylint: disable=import-error
    REPO,
    SIM_TEST_VARS,
    SimFleet,
    budget,
    fleetctl,
    l40s_fleet,
    recap,
)

HOSTS = ["sim-ro-1", "sim-ro-2", "sim-ro-3"]
MIB = 1024**2
UNIT = "/etc/systemd/system/vllm-main.service"
PLAN = "/etc/gpufleet/main.plan.json"

FLEET = {
    **l40s_fleet(1),
    "classes": {"ro-l40s": {"gpu_model": "l40s", "gpus": 2, "model": "llama-3.1-8b-instruct"}},
    "hosts": {
        "sim-ro-1": {"class": "ro-l40s", "base_used": [0, 0]},
        "sim-ro-2": {"class": "ro-l40s", "base_used": ["32MiB", 0]},
        "sim-ro-3": {"class": "ro-l40s", "base_used": [0, "96MiB"]},
    },
}

GROUP_VARS = {
    # stop: these tests check that a failed host leaves the class's earlier batches on the new plan (the default,
    # rollback_class, is tested by test_rollout.py's bake test and test_rollout_ramps.py)
    "gpufleet_on_failure": "stop",
    "gpufleet_model": "/srv/models/llama-3.1-8b-instruct",
    "gpufleet_model_config": str(REPO / "sim" / "models" / "llama-3.1-8b-instruct" / "config.json"),
    "gpufleet_serve_args": {
        "max_model_len": 8192,
        "tensor_parallel_size": 2,
        "max_num_seqs": 32,
        "dtype": "bfloat16",
        "block_size": 16,
    },
    "gpufleet_instances": [{"name": "main", "gpus": [0, 1], "port": 8000}],
    "gpufleet_guard": "0.5GiB",
    "gpufleet_admission": {"concurrency": 4, "tokens_per_request": 8192},
    "gpufleet_rollout_serial": [1, "10%", "50%"],
    "gpufleet_canary_load": {"requests": 8, "concurrency": 4, "prompt_tokens": 32, "max_tokens": 8},
    **SIM_TEST_VARS,
}


@pytest.fixture(scope="module")
def fleet(harness, tmp_path_factory):  # harness: conftest (root + rootfs)
    f = SimFleet(tmp_path_factory.mktemp("rollout"), harness, FLEET, GROUP_VARS)
    try:
        f.create()
        yield f
    finally:
        f.sim.destroy()


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    """State carried from one test to the next (units after each step)."""
    return {}


def test_clean_rollout(fleet, seen):
    assert all(u is None for u in fleet.units().values()), "the fleet must start without units"
    rc, out = fleet.rollout()
    assert rc == 0, out[-6000:]
    units = fleet.units()
    budgets = {h: budget(units[h]) for h in HOSTS}
    assert len(set(budgets.values())) == 1 and None not in budgets.values(), budgets
    for host in HOSTS:
        assert fleet.active(host) == "active", host
        # the unit names the planned cards by UUID, the ones the plan file records for its GPUs 0 and 1
        uuids = json.loads(fleet.read(host, fleet.plan_path))["gpu_uuids"]
        assert len(uuids) == 2 and all(u.startswith("GPU-") for u in uuids), uuids
        assert f"Environment=CUDA_VISIBLE_DEVICES={','.join(uuids)}" in units[host]
        plan = fleet.plan(host)
        assert plan["kv_cache_memory_bytes"] == budgets[host]
        assert plan["decision"] == "deploy"
        assert plan["unit"] == "vllm-main.service"
        assert fleet.previous(host) is None, f"{host}: first deploy keeps no previous unit"
    # one profiled canary recorded, one manual canary that passed
    assert len(fleet.profiles()) == 1
    assert "Manual canary on sim-ro-1 passed" in out
    # batches of one host each, in order
    batches = re.findall(r"TASK \[(?:gpufleet\.vllm\.vllm_service : )?Report what changes on this host\][^\n]*\nok: \[(\S+)\]", out)
    assert batches == HOSTS, batches
    seen["units_1"] = units


def move_free_memory(fleet, moves: dict[tuple[str, int], int]) -> None:
    """Move the free memory of some GPUs by a few bytes (the fake NVML state's base_used), as a real
    fleet's drivers, monitoring agents and allocator caches do between two runs."""
    for (host, gpu), delta in moves.items():
        path = str(fleet.sim.state_file(host))
        with fleetctl.nvml_state.locked(path):
            state = fleetctl.nvml_state.load(path)
            state["gpus"][gpu]["base_used"] = max(0, state["gpus"][gpu]["base_used"] + delta)
            fleetctl.nvml_state.save(path, state)


def test_second_run_changes_nothing(fleet, seen):
    """Free memory moves by a few MiB between the runs, up on one host and down on the weakest rank:
    the deployed budget is kept (the rounding and the gate margin absorb it), no canary, no restart."""
    before = fleet.units()
    assert before == seen["units_1"]
    first_plan = fleet.plan("sim-ro-1")
    moves = {("sim-ro-2", 0): -5 * MIB, ("sim-ro-3", 1): 7 * MIB}
    move_free_memory(fleet, moves)
    try:
        rc, out = fleet.rollout()
    finally:
        move_free_memory(fleet, {where: -delta for where, delta in moves.items()})
    assert rc == 0, out[-6000:]
    counters = recap(out)
    for host in HOSTS:
        assert counters[host]["changed"] == 0, (host, counters[host])
        assert counters[host]["failed"] == 0
        assert fleet.active(host) == "active"
    assert fleet.units() == before, "same unit bytes on every host"
    assert "nothing to do" in out
    assert "Run the manual canary with the planned budget" not in out or "skipping: [sim-ro-1]" in out
    assert "Manual canary on sim-ro-1" not in out, "no manual canary runs for a kept budget"
    assert len(fleet.profiles()) == 1, "a compatible profile exists: no new profiled canary"
    # the plan says why nothing changed: the deployed budget is kept within the keep step
    assert "is kept (no canary, no restart)" in out or "is the planned one" in out, out[-6000:]
    report = fleet.last_report()
    choice = next(c for c in report["classes"] if c["name"] == "ro-l40s")["budget_choice"]
    assert choice["kept"] is True and choice["deployed_bytes"] == first_plan["kv_cache_memory_bytes"], choice
    # the first run's budget was rounded down to the granule with the gate margin below the max safe bytes
    assert first_plan["kv_cache_memory_bytes"] % (256 * MIB) == 0


# What the collection could write on a host (units, plan records, the boot gate, venvs, the NVML binding's
# venv, the engine's home, wheelhouses), as path, type, size, mode and mtime; not what the OS or the test
# fleet changes by itself: the simulated GPUs' state (/etc/fake-nvml), systemd's own state, the metrics
# timer's textfile (/var/lib/prometheus), logs and temporary files.
HOST_FILES = ["sh", "-c", "find /etc /opt /srv /usr/local /var/lib -xdev"
              r" \( -path /etc/fake-nvml -o -path /var/lib/systemd -o -path /var/lib/prometheus \) -prune"
              r" -o -printf '%p %y %s %m %T@ %l\n' | sort"]
# every vllm-* and gpufleet-* unit (loaded or only a file), and the instance's invocation (a restart changes it)
UNIT_LISTS = ("systemctl list-units --all --plain --no-legend --no-pager 'vllm-*' 'gpufleet-*'",
              "systemctl list-unit-files --no-legend --no-pager 'vllm-*' 'gpufleet-*'",
              "systemctl show vllm-main.service -p InvocationID -p ActiveEnterTimestamp -p NRestarts")
# the metrics exporter's timer starts its service every 60 s by itself: for those two, only that they are loaded
METRICS_UNITS = ("gpufleet-vllm-metrics.service", "gpufleet-vllm-metrics.timer")


def host_units(fleet, host: str) -> str:
    loaded, files, shown = (fleet.harness.exec(host, ["sh", "-c", cmd], check=True).stdout for cmd in UNIT_LISTS)
    rows = []
    for line in loaded.splitlines():
        name, load, active, sub = line.split()[:4]
        rows.append(f"unit {name} {load}" if name in METRICS_UNITS else f"unit {name} {load} {active} {sub}")
    rows += ["file " + " ".join(line.split()[:2]) for line in files.splitlines() if line.strip()]
    return "\n".join(sorted(rows) + shown.splitlines())


def host_state(fleet) -> dict[str, tuple[str, str]]:
    return {host: (fleet.harness.exec(host, HOST_FILES, check=True).stdout, host_units(fleet, host)) for host in HOSTS}


def assert_hosts_unchanged(fleet, before: dict[str, tuple[str, str]], what: str) -> None:
    after = host_state(fleet)
    for host in HOSTS:
        for kind, old, new in (("files", before[host][0], after[host][0]), ("units", before[host][1], after[host][1])):
            gone = sorted(set(old.splitlines()) - set(new.splitlines()))
            added = sorted(set(new.splitlines()) - set(old.splitlines()))
            assert not gone and not added, f"{host}: {what} changed its {kind}: -{gone} +{added}"


def test_a_capacity_budget_caps_every_batch_and_one_that_holds_no_host_refuses_the_class(fleet):
    """gpufleet_max_unavailable 1: the same serial entries ([1, 100%], the two other hosts together) become
    one host a batch; a token budget one token short of what a host serves (its plan record's planned tokens)
    holds none: the class is refused before any canary or host is touched."""
    before = fleet.units()
    since = len(fleet.reports())
    rc, out = fleet.rollout({"gpufleet_rollout_serial": [1, "100%"], "gpufleet_max_unavailable": 1})
    assert rc == 0, out[-6000:]
    report = fleet.last_report(since)
    assert report is not None and [len(b["hosts"]) for b in report["batches"]] == [1, 1, 1], report["batches"]
    assert fleet.units() == before, "nothing changed: only the batches were cut smaller"

    tokens = fleet.plan("sim-ro-1")["kv_cache_tokens"]
    assert isinstance(tokens, int) and tokens > 0
    rc, out = fleet.rollout({"gpufleet_max_unavailable": f"{tokens - 1} tokens"})
    assert rc != 0
    assert (f"class ro-l40s is not deployable: gpufleet_max_unavailable {tokens - 1} tokens is less than what sim-ro-1 serves "
            f"({tokens} KV-cache tokens)") in out, out[-6000:]
    assert "Boot the canary engine" not in out and "Report what changes on this host" not in out, out[-6000:]
    assert fleet.units() == before
    for host in HOSTS:
        assert fleet.active(host) == "active", host


def test_read_only_playbooks_change_nothing_on_the_hosts(fleet):
    """probe.yml and audit.yml on the rolled-out class: every host's files and units are as they were
    (nothing installed, written or restarted), and each playbook read every host. (plan.yml --check is
    held to the same in test_compat_key_change_forces_a_profiled_canary, where it plans a change.)"""
    before = host_state(fleet)
    assert "vllm-main.service" in before[HOSTS[0]][1] and f"{PLAN} " in before[HOSTS[0]][0]
    for name in ("probe.yml", "audit.yml"):
        rc, out = fleet.rollout(playbook=REPO / "playbooks" / name)
        assert rc == 0, (name, out[-6000:])
        counters = recap(out)
        assert all(counters[h]["ok"] > 0 and counters[h]["failed"] == counters[h]["unreachable"] == 0 for h in HOSTS), (name, counters)
    assert_hosts_unchanged(fleet, before, "probe.yml or audit.yml")


BAKE = {"gpufleet_max_unavailable": 1, "gpufleet_bake_seconds": 4,
        # time per output token and success only: on a shared two-core machine the other latencies are noise
        "gpufleet_analysis": {"itl_p90": {"max_ratio": 3, "min_requests": 5}, "success_rate": {"min_requests": 5},
                              "ttft_p90": False, "e2e_p90": False, "preemptions": False}}


# a drain/undrain hook that records where it runs: its event, gpufleet_hook_host, the host a task without
# delegate_to ran on, and inventory_hostname
WHERE_HOOK = """\
- name: Read where the hook runs
  ansible.builtin.command: hostname
  register: where_hook_ran
  changed_when: false

- name: Record the hook
  ansible.builtin.shell: >-
    echo '{{{{ gpufleet_hook_event }}}} {{{{ gpufleet_hook_host }}}} {{{{ where_hook_ran.stdout }}}} {{{{ inventory_hostname }}}}' >> {log}
  delegate_to: localhost
  changed_when: false
"""


FAILING_BAKE_HOOK = """\
- name: Refuse the canary weight
  ansible.builtin.fail:
    msg: the load balancer refused the canary weight of {{ gpufleet_hook_host }}
"""


def completions(fleet, done: threading.Event, results: dict[str, dict[str, int]], clients: int = 2) -> list[threading.Thread]:
    """Clients sending short completions straight to every host's engine until ``done``, counting the answers."""
    def client(host: str) -> None:
        url = f"http://{fleet.sim.info(host).address}:8000/v1/completions"
        body = json.dumps({"prompt": "hello", "max_tokens": 8}).encode()
        for _unused in range(20000):  # bounded
            if done.is_set():
                return
            try:
                request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=10) as resp:
                    key = str(resp.status)
            except urllib.error.HTTPError as exc:
                key = str(exc.code)
            except OSError:
                key = "error"
                time.sleep(0.2)
            results[host][key] = results[host].get(key, 0) + 1

    threads = [threading.Thread(target=client, args=(h,), daemon=True) for h in HOSTS for _n in range(clients)]
    for t in threads:
        t.start()
    return threads


def test_a_batch_that_serves_slower_than_the_class_fails_its_bake_and_the_class_is_rolled_back(fleet):
    """A class that bakes each batch 4 s under real traffic and rolls the whole class back on a failure
    (gpufleet_on_failure: rollback_class): batch 1's host serves like the hosts not yet changed (its analysis
    passes); batch 2's new engine serves ten times slower per output token (the simulator's latency knob), so
    its time-per-output-token p90 fails against the baseline (the third host): that host rolls itself back, then
    the class rollback restores batch 1's host, the third host is never touched, every host serves its previous
    unit byte for byte, the run fails, and the report shows both analyses and who was rolled back why. A second
    run without traffic: too few requests make batch 1's analysis inconclusive, which counts as a failure by
    default, and that host is rolled back too; its failing bake_end hook is recorded beside the analysis, which
    keeps its figures. A third: a bake_start hook that fails counts as a failed bake. A
    fourth, without a bake: batch 2's host fails its boot, and the class rollback restores batch 1's host the same
    way."""
    before = fleet.units()
    since = len(fleet.reports())
    done = threading.Event()
    results: dict[str, dict[str, int]] = {h: {} for h in HOSTS}
    threads = completions(fleet, done, results)
    fleet.sim.inject_latency_next_boot("sim-ro-2", 0.05)
    try:
        rc, out = fleet.rollout({"gpufleet_guard": "0.75GiB", "gpufleet_on_failure": "rollback_class", **BAKE})
    finally:
        done.set()
        for t in threads:
            t.join(timeout=30)
        fleet.sim.inject_latency_next_boot("sim-ro-2", None)
    assert rc != 0, out[-6000:]
    assert all(results[h].get("200", 0) > 10 for h in HOSTS), results
    report = fleet.last_report(since)
    assert report is not None and [b["hosts"][0]["host"] for b in report["batches"]] == ["sim-ro-1", "sim-ro-2"], report["batches"]
    first, second = (b["analysis"] for b in report["batches"])
    assert first["verdict"] == "pass" and first["canary_hosts"] == 1 and first["baseline_hosts"] == 2, first
    checks = {c["name"]: c for c in second["checks"]}
    assert second["verdict"] == "fail" and checks["itl_p90"]["verdict"] == "fail", second
    assert checks["itl_p90"]["canary"] > 3 * checks["itl_p90"]["baseline"] and checks["itl_p90"]["samples"]["canary"] >= 5, checks
    assert second["baseline_hosts"] == 1 and set(checks) == {"itl_p90", "success_rate", "kv_usage", "memory_margin"}
    # the margins come from Prometheus only (test_rollout_ramps.py reads them there)
    assert checks["memory_margin"]["verdict"] == "skipped" and second["source"] == "each engine's /metrics", checks
    assert re.search(r"sim-ro-2: the bake of batch 2 of class ro-l40s failed: bake of 4 s, 1 changed host\(s\) against 1 baseline "
                     r"host\(s\): fail: .*itl_p90 fail: [^;]*\(above 3\);.*; rolled back: instance main: put back its unit", out), out[-6000:]
    assert "class ro-l40s: rolled back with sim-ro-2: sim-ro-1" in out, out[-6000:]
    hosts = {h["host"]: h for h in report["hosts"]}
    assert {h: e["outcome"] for h, e in hosts.items()} == {"sim-ro-1": "rolled_back", "sim-ro-2": "rolled_back", "sim-ro-3": "not_reached"}
    assert hosts["sim-ro-1"]["error"].startswith("rolled back with its class after sim-ro-2 failed: instance main: put back its unit")
    assert fleet.units() == before, "every host of the class has its previous unit back, byte for byte"
    for host in HOSTS:
        assert fleet.active(host) == "active", host

    # no traffic: inconclusive, counted as fail; its bake_end hook fails too, and the analysis keeps its figures
    failing = fleet.workdir / "failing-bake-hook.yml"
    failing.write_text(FAILING_BAKE_HOOK, encoding="utf-8")
    since = len(fleet.reports())
    rc, out = fleet.rollout({"gpufleet_guard": "0.75GiB", **BAKE, "gpufleet_bake_seconds": 1, "gpufleet_hooks": {"bake_end": str(failing)}})
    assert rc != 0, out[-6000:]
    report = fleet.last_report(since)
    assert report is not None and len(report["batches"]) == 1
    analysis = report["batches"][0]["analysis"]
    assert analysis["verdict"] == "inconclusive" and analysis["effective"] == "fail", analysis
    assert "0 request(s) finished on the canary during the bake, fewer than 5" in {c["why"] for c in analysis["checks"]}
    assert analysis["error"] == "sim-ro-1: the bake_end hook failed: the load balancer refused the canary weight of sim-ro-1", analysis
    assert "sim-ro-1: the bake of batch 1 of class ro-l40s failed: bake of 1 s, 1 changed host(s) against 2 baseline host(s): " \
           "inconclusive (counted as fail)" in out, out[-6000:]
    assert fleet.units() == before
    for host in HOSTS:
        assert fleet.active(host) == "active", host

    # a bake_start hook that fails counts as a failed bake, naming the host and the hook's words
    since = len(fleet.reports())
    rc, out = fleet.rollout({"gpufleet_guard": "0.75GiB", **BAKE, "gpufleet_hooks": {"bake_start": str(failing)}})
    assert rc != 0, out[-6000:]
    report = fleet.last_report(since)
    assert report is not None and len(report["batches"]) == 1
    analysis = report["batches"][0]["analysis"]
    assert analysis["verdict"] == "fail" and analysis["checks"] == [], analysis
    assert analysis["error"] == "sim-ro-1: the bake_start hook failed: the load balancer refused the canary weight of sim-ro-1", analysis
    assert fleet.units() == before
    for host in HOSTS:
        assert fleet.active(host) == "active", host

    # no bake, batches of one host then two: sim-ro-2 fails its boot (the engine runs out of memory) and rolls itself
    # back; the class rollback restores sim-ro-3 (its batch, which passed) and then batch 1's host, through their drain
    # and undrain hooks, run on each of them
    log = fleet.workdir / "class-rollback-hooks.log"
    hook = fleet.workdir / "where-hook.yml"
    hook.write_text(WHERE_HOOK.format(log=log), encoding="utf-8")
    since = len(fleet.reports())
    fleet.sim.inject_fail_next_boot("sim-ro-2", "oom")
    try:
        # a blank answer (as an AWX survey sends it) over the module's stop: unset, so the default, rollback_class
        rc, out = fleet.rollout({"gpufleet_guard": "0.75GiB", "gpufleet_max_unavailable": 2, "gpufleet_rollout_serial": [1, 2],
                                 "gpufleet_on_failure": "", "gpufleet_hooks": {"drain": str(hook), "undrain": str(hook)}})
    finally:
        fleet.sim.inject_fail_next_boot("sim-ro-2", None)
    assert rc != 0, out[-6000:]
    assert "class ro-l40s: rolled back with sim-ro-2: sim-ro-3, sim-ro-1" in out, out[-6000:]
    # event, the hook's host, the host its tasks ran on, the host whose path ran it
    lines = log.read_text(encoding="utf-8").splitlines()
    assert lines[-4:] == ["drain sim-ro-3 sim-ro-3 sim-ro-2", "undrain sim-ro-3 sim-ro-3 sim-ro-2",
                          "drain sim-ro-1 sim-ro-1 sim-ro-2", "undrain sim-ro-1 sim-ro-1 sim-ro-2"], lines
    assert "drain sim-ro-2 sim-ro-2 sim-ro-2" in lines, lines
    report = fleet.last_report(since)
    assert report is not None
    hosts = {h["host"]: h for h in report["hosts"]}
    assert {h: e["outcome"] for h, e in hosts.items()} == {"sim-ro-1": "rolled_back", "sim-ro-2": "rolled_back", "sim-ro-3": "rolled_back"}
    assert [hosts[h]["rolled_back_with"] for h in HOSTS] == ["sim-ro-2", None, "sim-ro-2"] and report["failed_hosts"] == ["sim-ro-2"]
    assert report["classes"][0]["final"]["state"] == "previous_plan" and report["classes"][0]["on_failure"] == "rollback_class"
    assert "CUDA out of memory" in hosts["sim-ro-2"]["error"] or "out of memory" in hosts["sim-ro-2"]["error"].lower(), hosts["sim-ro-2"]
    assert fleet.units() == before
    for host in HOSTS:
        assert fleet.active(host) == "active", host


def test_cotenant_after_planning_stops_the_rollout(fleet, seen):
    before = fleet.units()
    injected = threading.Event()

    def inject(line: str) -> None:
        # planning is over once the serial play starts: the co-tenant is not in the plan
        if line.startswith("PLAY [Roll out in serial batches]") and not injected.is_set():
            fleet.sim.inject_cotenant("sim-ro-2", gpu=1, size=1 << 30, pid=None, remove=False)
            injected.set()

    rc, out = fleet.rollout({"gpufleet_guard": "1GiB"}, on_line=inject)
    assert injected.is_set()
    assert rc != 0, "a failed gate must fail the run"
    assert re.search(r"Free-memory gate \(before stop\) failed on sim-ro-2: main rank 1 \(GPU 1\): boot-free", out), out[-6000:]
    after = fleet.units()
    # batch 1 moved to the new plan (a larger guard: a smaller budget)
    assert budget(after["sim-ro-1"]) < budget(before["sim-ro-1"])
    assert fleet.previous("sim-ro-1") == before["sim-ro-1"], "the previous unit is kept byte for byte"
    # sim-ro-2 was never touched, sim-ro-3 never reached
    assert after["sim-ro-2"] == before["sim-ro-2"]
    assert after["sim-ro-3"] == before["sim-ro-3"]
    reached = re.findall(r"TASK \[(?:gpufleet\.vllm\.vllm_service : )?Report what changes on this host\][^\n]*\nok: \[(\S+)\]", out)
    assert reached == ["sim-ro-1", "sim-ro-2"], reached
    for host in HOSTS:
        assert fleet.active(host) == "active", host
    fleet.sim.inject_cotenant("sim-ro-2", gpu=1, size=None, pid=None, remove=True)
    seen["units_3"] = after


def test_cotenant_between_the_gates_rolls_the_host_back(fleet, seen):
    """The gate after the stop reads the GPUs in the call that stopped the instances (vllm_unit gpu_probe).

    A co-tenant that takes memory once the gate before the stop passed on sim-ro-2 is seen there:
    the host is rolled back to the unit it ran, restarted, and sim-ro-3 is never reached.
    """
    before = fleet.units()
    assert before == seen["units_3"]
    injected, removed = threading.Event(), threading.Event()

    def remove() -> None:
        if injected.is_set() and not removed.is_set():
            removed.set()
            fleet.sim.inject_cotenant("sim-ro-2", gpu=0, size=None, pid=None, remove=True)

    def inject(line: str) -> None:
        if '"msg": "Free-memory gate (before stop) passed on sim-ro-2"' in line and not injected.is_set():
            fleet.sim.inject_cotenant("sim-ro-2", gpu=0, size=1 << 30, pid=None, remove=False)
            injected.set()
        # gone before the rollback restarts the previous unit, whose boot gate would shrink it
        elif "Free-memory gate (after stop) failed on sim-ro-2" in line:
            remove()

    try:
        rc, out = fleet.rollout({"gpufleet_guard": "1GiB"}, on_line=inject)
    finally:
        remove()
    assert injected.is_set(), out[-6000:]
    assert rc != 0, "a failed gate must fail the run"
    assert re.search(r"Free-memory gate \(after stop\) failed on sim-ro-2: main rank 0 \(GPU 0\): boot-free", out), out[-6000:]
    assert "the previous units were restored and restarted" in out, out[-6000:]
    after = fleet.units()
    # sim-ro-1 already ran the plan; sim-ro-2 runs its previous unit again, sim-ro-3 was never reached
    assert after == before
    for host in HOSTS:
        assert fleet.active(host) == "active", host


def test_admission_shortfall_stops_the_class(fleet):
    before = fleet.units()
    rc, out = fleet.rollout({"gpufleet_guard": "1GiB", "gpufleet_admission": {"tokens": 50_000_000}})
    assert rc != 0
    assert "cannot hold its admission plan" in out, out[-6000:]
    assert "Report what changes on this host" not in out, "no host may reach the serial batches"
    assert fleet.units() == before
    for host in HOSTS:
        assert fleet.active(host) == "active", host


def test_unreachable_host_is_left_out(fleet):
    before = fleet.units()
    fleet.sim.inject_unreachable("sim-ro-3", clear=False)
    try:
        # the exact formula (no gate margin, rounding or kept budget): the 96 MiB the left-out host costs show
        rc, out = fleet.rollout({"gpufleet_guard": "1GiB", "gpufleet_gate_margin": 0, "gpufleet_budget_granularity": 0,
                                 "gpufleet_budget_keep_step": 0})
    finally:
        fleet.sim.inject_unreachable("sim-ro-3", clear=True)
    assert rc != 0, "an unreachable host fails the run"
    assert re.search(r"sim-ro-3\s+:.*unreachable=1", out), out[-4000:]
    after = fleet.units()
    # The plan covers the hosts that could be probed: without sim-ro-3 (the weakest rank,
    # 96 MiB used on its GPU 1) the class budget is higher, and both reachable hosts run it.
    assert budget(after["sim-ro-1"]) == budget(after["sim-ro-2"])
    assert budget(after["sim-ro-1"]) > budget(before["sim-ro-1"])
    assert fleet.previous("sim-ro-1") == before["sim-ro-1"]
    assert fleet.previous("sim-ro-2") == before["sim-ro-2"]
    assert after["sim-ro-3"] == before["sim-ro-3"], "the unreachable host was not touched"
    for host in HOSTS:
        assert fleet.active(host) == "active", host


def watch_canary_user(fleet, host: str, users: list[str], then: Callable[[], None] | None = None) -> None:
    """In the background, record the account of the profiled canary engine once it runs on ``host``: the production
    instance is stopped then, and the canary is the engine on loopback without a fixed budget; ``then`` runs right
    after (while the canary engine runs)."""

    def look() -> None:
        for _attempt in range(60):
            ps = fleet.harness.exec(host, ["ps", "-eo", "user:20,args"]).stdout
            # on loopback: a hand-written unit the instance takes over also runs without a fixed budget
            found = [row.split()[0] for row in ps.splitlines()
                     if " serve " in row and "--host 127.0.0.1" in row and "--kv-cache-memory-bytes" not in row]
            if found:
                users.extend(found)
                if then is not None:
                    then()
                return
            time.sleep(0.5)
    threading.Thread(target=look, daemon=True).start()


def watch_canary_engine(fleet, host: str, seen: list[str], unit: str) -> None:
    """In the background, once a canary engine (on loopback) runs on ``host``, record ``unit``'s state then."""

    def look() -> None:
        for _attempt in range(120):
            ps = fleet.harness.exec(host, ["ps", "-eo", "args"]).stdout
            if any(" serve " in row and "--host 127.0.0.1" in row for row in ps.splitlines()):
                seen.append(fleet.harness.exec(host, ["systemctl", "is-active", unit]).stdout.strip())
                return
            time.sleep(0.25)
    threading.Thread(target=look, daemon=True).start()


def test_compat_key_change_forces_a_profiled_canary(fleet):
    """A new key on a running class: plan.yml first says what the rollout will do (the chosen canary
    host, whose production instance both canaries stop, for about how long); the rollout then runs the
    canaries on that host as the service user, and after the profiled canary waits for its production
    instance, restarted slowly with memory growing while it loads, before re-probing the class."""
    assert len(fleet.profiles()) == 1
    serve_args = {"max_model_len": 8192, "tensor_parallel_size": 2, "max_num_seqs": 48, "dtype": "bfloat16",
                  "block_size": 16}
    extra = {"gpufleet_guard": "1GiB", "gpufleet_serve_args": serve_args, "gpufleet_canary_host": "sim-ro-2"}
    before = host_state(fleet)
    rc, out = fleet.rollout(extra, playbook=PLAN_PLAYBOOK, args=["--check"])
    assert rc == 0, out[-6000:]
    # nothing installed, written or restarted on any host (files, units, the instances' invocations)
    assert_hosts_unchanged(fleet, before, "plan.yml --check")
    assert "class ro-l40s: canary host sim-ro-2 (gpufleet_canary_host), instance main; a profiled canary, then a manual canary" in out
    # the boot time the collection knows: the class's newest profile's canary (another key)
    assert "engine boot: about" in out and "the class's newest profile (another compatibility key)" in out, out[-6000:]
    assert re.search(r"sim-ro-2: vllm-main\.service is out of service for 5 engine boot\(s\) and 2 canary load test\(s\) "
                     r"\(2 canaries \(each followed by a restart with the old unit\), then batch 1\): about \d+ s in all", out), out[-6000:]
    assert re.search(r"sim-ro-1: vllm-main\.service is out of service for 1 engine boot\(s\) \(batch 2\)", out)
    assert "units replaced (the previous one is kept for rollback): sim-ro-2:vllm-main.service, sim-ro-1:vllm-main.service, " \
           "sim-ro-3:vllm-main.service" in out
    planned = fleet.last_report()
    first_run = next(c for c in planned["classes"] if c["name"] == "ro-l40s")["first_run"]
    assert first_run["canary_host"] == "sim-ro-2" and first_run["canary_rule"] == "gpufleet_canary_host"

    canary_users: list[str] = []
    slowed = threading.Event()

    def slow_restart() -> None:
        # the canary engine has booted: the production instance the canary starts again after it boots
        # slowly, its memory growing
        time.sleep(1.0)
        fleet.sim.inject_slow_next_boot("sim-ro-2", 15.0, 30)
        slowed.set()

    def watch(line: str) -> None:
        if "Boot the canary engine (profiled)" in line and not canary_users:
            watch_canary_user(fleet, "sim-ro-2", canary_users, then=slow_restart)

    rc, out = fleet.rollout(extra, on_line=watch)
    assert rc == 0, out[-6000:]
    assert slowed.is_set()
    assert canary_users and set(canary_users) == {"vllm"}, canary_users
    assert "the compatibility key changed" in out and "max_num_seqs" in out
    assert len(fleet.profiles()) == 2, "a new profile is recorded next to the old one"
    # the re-probe waited for the slow restart: the class is planned on settled memory, not auto_profile
    assert re.search(r"RETRYING: \[sim-ro-2\]: Wait (for the canary host's production instance to answer|until the canary "
                     r"host's GPU memory holds still) before the re-probe", out), out[-8000:]
    report = fleet.last_report()
    cls = next(c for c in report["classes"] if c["name"] == "ro-l40s")
    assert cls["decision"] == "deploy", cls["reasons"]
    # the chosen canary host goes first
    batches = re.findall(r"TASK \[(?:gpufleet\.vllm\.vllm_service : )?Report what changes on this host\][^\n]*\nok: \[(\S+)\]", out)
    assert batches == ["sim-ro-2", "sim-ro-1", "sim-ro-3"], batches
    units = fleet.units()
    for host in HOSTS:
        assert "--max-num-seqs 48" in units[host], host
        assert fleet.active(host) == "active", host
        assert fleet.plan(host)["compat_key_hash"] in fleet.profiles()[0].name + fleet.profiles()[1].name


def test_a_new_key_under_unchanged_units_restarts_every_host(fleet):
    """The driver was upgraded on every host of the class under running engines: the serve arguments
    and the budget are the same, so is every unit byte for byte, but the key moved (driver_version)
    and each engine still runs on what it loaded before, so every host restarts in its batch and
    records the new key. (New weights under the same model path move the key the same way, in
    model_fingerprint, on the real engine: tests/integration/test_real_engine.py.)"""
    extra = {"gpufleet_guard": "1GiB", "gpufleet_canary_host": "sim-ro-2", "gpufleet_serve_args": {
        "max_model_len": 8192, "tensor_parallel_size": 2, "max_num_seqs": 48, "dtype": "bfloat16", "block_size": 16}}
    before, keys_before = fleet.units(), {h: fleet.plan(h)["compat_key_hash"] for h in HOSTS}
    runs = {h: fleet.harness.exec(h, ["systemctl", "show", "vllm-main.service", "-p", "InvocationID", "--value"]).stdout
            for h in HOSTS}

    def driver(version: str):
        def mutate(state: dict[str, Any]) -> None:
            state["system"]["driver"] = version
        return mutate

    for host in HOSTS:
        fleet.sim._edit_state(host, driver("560.35.03"))  # pylint: disable=protected-access
    try:
        rc, out = fleet.rollout(extra)
    finally:
        for host in HOSTS:
            fleet.sim._edit_state(host, driver("550.127.05"))  # pylint: disable=protected-access
    assert rc == 0, out[-6000:]
    assert len(fleet.profiles()) == 3, "the new key gets a profiled canary of its own"
    assert fleet.units() == before, "same serve arguments and budget: the same unit bytes"
    # the role's change report: "<host>: <instance>: <reason>, <reason>; <instance>: ..."
    restarted = set(re.findall(r"\"(sim-ro-\d): [^\n]*\bmain: [^\n;]*the compatibility key changed since its boot check", out))
    assert restarted == set(HOSTS), out[-6000:]
    for host in HOSTS:
        plan = fleet.plan(host)
        assert plan["compat_key_hash"] != keys_before[host], plan
        assert any(plan["compat_key_hash"] in p.name for p in fleet.profiles()), plan
        now = fleet.harness.exec(host, ["systemctl", "show", "vllm-main.service", "-p", "InvocationID", "--value"]).stdout
        assert now != runs[host] and fleet.active(host) == "active", host


def test_wrong_service_inputs_on_a_later_host_stop_the_run_before_any_host(fleet):
    """The last host's own inventory gives its instance a port no unit can listen on: every
    host's instances are checked before any probe or canary, so the run stops with that
    host and the variable the inventory sets named, and nothing touched."""
    before = fleet.units()
    host_vars = fleet.inventory.parent / "host_vars"
    host_vars.mkdir(exist_ok=True)
    (host_vars / "sim-ro-3.yml").write_text(yaml.safe_dump({"gpufleet_instances": [
        {"name": "main", "gpus": [0, 1], "port": 70000}]}), encoding="utf-8")
    try:
        rc, out = fleet.rollout({"gpufleet_guard": "2GiB"})
    finally:
        (host_vars / "sim-ro-3.yml").unlink()
    assert rc != 0
    assert "sim-ro-3: gpufleet_instances[0].port: must be an integer in 1..65535, got 70000" in out, out[-6000:]
    assert "no host was probed or touched" in out
    assert "Boot the canary engine" not in out, "no canary may run"
    assert "Report what changes on this host" not in out, "no host may reach the serial batches"
    assert fleet.units() == before
    for host in HOSTS:
        assert fleet.active(host) == "active", host


def test_a_host_on_another_driver_stops_the_run_before_any_host(fleet):
    """A class halfway through a driver upgrade: the host whose driver differs from the class
    reference (its canary host) is named and nothing is touched."""
    before = fleet.units()

    def driver(version: str):
        def mutate(state: dict[str, Any]) -> None:
            state["system"]["driver"] = version
        return mutate

    fleet.sim._edit_state("sim-ro-2", driver("560.35.03"))  # pylint: disable=protected-access
    try:
        rc, out = fleet.rollout({"gpufleet_probe_samples": 2, "gpufleet_probe_interval": 0.2})
    finally:
        fleet.sim._edit_state("sim-ro-2", driver("550.127.05"))  # pylint: disable=protected-access
    assert rc != 0
    assert re.search(r"sim-ro-2: driver 560\.35\.03 differs from sim-ro-1's 550\.127\.05 \(the class was profiled on sim-ro-1\)",
                     out), out[-6000:]
    assert "no host was touched" in out
    assert "Report what changes on this host" not in out, "no host may reach the serial batches"
    assert fleet.units() == before


HAND_WRITTEN = """\
[Unit]
Description=vLLM, written by hand before gpufleet
After=network-online.target

[Service]
ExecStart=/opt/vllm/venv/bin/vllm serve /srv/models/llama-3.1-8b-instruct --host 0.0.0.0 --port 8000 \\
    --tensor-parallel-size 2 --max-model-len 8192 --gpu-memory-utilization 0.6
Environment=CUDA_VISIBLE_DEVICES=0,1
Restart=on-failure

[Install]
WantedBy=multi-user.target
"""
HAND_DROP_IN = "[Service]\nEnvironment=HAND_WRITTEN_DROP_IN=1\n"
LEGACY = "/etc/systemd/system/vllm.service"
LEGACY_DROP_IN = "/etc/systemd/system/vllm.service.d/10-local.conf"


def legacy_state(fleet: SimFleet, host: str) -> tuple[str, str]:
    active = fleet.harness.exec(host, ["systemctl", "is-active", "vllm.service"]).stdout.strip()
    enabled = fleet.harness.exec(host, ["systemctl", "is-enabled", "vllm.service"]).stdout.strip()
    return active, enabled


def test_a_hand_written_unit_is_taken_over_and_given_back_by_rollback(fleet):
    host = "sim-ro-3"
    # the host as it was before gpufleet: no vllm-main, a hand-written vllm.service with a drop-in, running
    setup = (f"systemctl disable --now vllm-main.service; rm -f {UNIT} {PLAN} /etc/gpufleet/vllm-main.env; "
             f"mkdir -p {os.path.dirname(LEGACY_DROP_IN)}; cat > {LEGACY} <<'EOF'\n{HAND_WRITTEN}EOF\n"
             f"printf '%s' '{HAND_DROP_IN}' > {LEGACY_DROP_IN}; systemctl daemon-reload; systemctl enable --now vllm.service; "
             "for i in $(seq 120); do python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=2)\" "
             "2>/dev/null && exit 0; sleep 0.5; done; exit 1")
    proc = fleet.harness.exec(host, ["sh", "-c", setup])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert legacy_state(fleet, host) == ("active", "enabled")
    host_vars = fleet.inventory.parent / "host_vars"
    host_vars.mkdir(exist_ok=True)
    (host_vars / f"{host}.yml").write_text(yaml.safe_dump({"vllm_service_adopt_units": ["vllm.service"]}), encoding="utf-8")
    try:
        # profile.yml runs the rollout's profiled canary: drained through the hooks, as the service user,
        # the hand-written unit stopped for it and running again (checked) before the undrain
        hooks = fleet.workdir / "profile-hooks.log"
        recorder = fleet.workdir / "profile-hook.yml"
        recorder.write_text(f"""---
- name: Record the hook
  ansible.builtin.shell: >-
    echo "{{{{ gpufleet_hook_event }}}} {{{{ gpufleet_hook_host }}}}
    {{{{ gpufleet_hook_instances | map(attribute='name') | join(',') }}}}" >> {hooks}
  delegate_to: localhost
  changed_when: false
""", encoding="utf-8")
        profiles = len(fleet.profiles())
        canary_users: list[str] = []
        # the hand-written unit's state while each canary engine runs: the canary stopped it
        during_canary: list[str] = []

        def watch(line: str) -> None:
            if "Boot the canary engine (profiled)" in line and not canary_users:
                watch_canary_user(fleet, host, canary_users)
                watch_canary_engine(fleet, host, during_canary, "vllm.service")

        rc, out = fleet.rollout({"gpufleet_class": "ro-l40s", "gpufleet_target": host, "gpufleet_canary_host": host,
                                 "gpufleet_hooks": {"drain": str(recorder), "undrain": str(recorder)}},
                                playbook=REPO / "playbooks" / "profile.yml", on_line=watch)
        assert rc == 0, out[-6000:]
        assert len(fleet.profiles()) == profiles + 1, "the new profile is recorded next to the others"
        assert hooks.read_text(encoding="utf-8").split() == ["drain", host, "main", "undrain", host, "main"]
        assert canary_users and set(canary_users) == {"vllm"}, canary_users
        assert during_canary == ["inactive"], during_canary
        assert re.search(r"TASK \[Check that the units the canary stopped run again\][^\n]*\nok: \[sim-ro-3\]", out), out[-6000:]
        assert legacy_state(fleet, host) == ("active", "enabled")

        # only this host: it is the canary host of the run, so the canaries must stop and restart vllm.service
        during_canary.clear()

        def watch_manual(line: str) -> None:
            if "Boot the canary engine (manual)" in line and not during_canary:
                watch_canary_engine(fleet, host, during_canary, "vllm.service")

        rc, out = fleet.rollout({"gpufleet_target": host}, on_line=watch_manual)
        assert rc == 0, out[-6000:]
        assert "Manual canary on sim-ro-3 passed" in out
        assert during_canary == ["inactive"], during_canary
        assert "takes over vllm.service (running and enabled)" in out, out[-6000:]
        # its engine holds the GPUs until it stops: it passes the gate only because its memory counts as the host's own
        assert "Free-memory gate (before stop) passed on sim-ro-3" in out
        assert fleet.active(host) == "active" and legacy_state(fleet, host) == ("inactive", "disabled")
        kept = json.loads(fleet.read(host, "/etc/gpufleet/units/adopted-vllm.service.json") or "{}")
        files = {path: base64.b64decode(f["data"]).decode() for path, f in kept["files"].items()}
        assert files == {LEGACY: HAND_WRITTEN, LEGACY_DROP_IN: HAND_DROP_IN}, files
        assert kept["running"] is True and kept["enabled"] is True
        assert fleet.plan(host)["kv_cache_memory_bytes"] == budget(fleet.unit(host))

        env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_PIPELINING="1", ANSIBLE_HOST_KEY_CHECKING="False")
        back = procgroup.run(["ansible-playbook", "-i", str(fleet.inventory), str(REPO / "playbooks" / "rollback.yml"),
                              "-e", f"gpufleet_rollback_hosts={host}"], cwd=REPO, env=env, timeout=600)
        assert back.returncode == 0, back.stdout[-6000:] + back.stderr[-2000:]
    finally:
        (host_vars / f"{host}.yml").unlink()
    # the new unit is gone, the hand-written one is back as it was: its files, enabled, serving
    assert fleet.unit(host) is None and fleet.active(host) != "active"
    assert legacy_state(fleet, host) == ("active", "enabled")
    assert fleet.read(host, LEGACY) == HAND_WRITTEN and fleet.read(host, LEGACY_DROP_IN) == HAND_DROP_IN
    show = fleet.harness.exec(host, ["systemctl", "show", "vllm.service", "--property=Environment"]).stdout
    assert "HAND_WRITTEN_DROP_IN=1" in show, show

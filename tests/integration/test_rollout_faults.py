# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""playbooks/rollout.yml under injected faults, for real, over SSH, on a small simulated class.

Three hosts of one class (two L40S each, one TP=2 instance) and a fourth host with a
different GPU model, systemd-nspawn guests with the fake NVML library and the simulated
engine (sim/engine/vllm), set up by sim/fleetctl.py from a fleet file written here. Every
test runs ansible-playbook, checks its exit status and what it reported, and then checks,
on every host, the unit file on disk, the kept previous unit, the plan file and whether
the service is active.

The tests run in file order and build on each other's end state (one fleet per module):

1. a weak outlier host (a co-tenant on one rank) with ``gpufleet_split_policy: fail``: the
   planner recommends a split and the class stops before any host is touched;
2. the same with ``warn``: the class deploys the weakest host's budget everywhere and the
   output and report name the outlier and the budget of each sub-class;
3. a host with another GPU model put in the class: the class is refused, the host named,
   no host touched;
4. free memory that moves between samples on one host: the class is planned
   ``auto_profile`` and deployed without a byte budget (vLLM's own profiling);
5. a GPU lost on the second host once planning is over: its gate stops the rollout before
   its service is touched, the first batch keeps the new unit, the third never runs;
6. the controller killed (SIGKILL of the whole run) right after the second host's new unit
   was written, before its boot check; a second controller is refused while a live run
   holds the class's lease; the killed run's lease is taken over and the next run finishes
   the rollout;
7. the snapshot directory read-only on a host during a budget change: nothing of it is
   stopped or restored, its files and service stay as they were;
8. the controller killed while the profiled canary holds the canary host (its module goes on on the
   host: it is then killed there too, with its engine, so that the hold stays); a normal run;
   then rollback.yml on that host: its instance serves at every step's end;
9. a host's link lost as the batch's write calls start: the batch's other hosts check
   their boots before the run stops; the next run finishes the lost host;
10. the controller killed at each remote call of one host's deploy in turn (the role's own
    deploy, tests/integration/playbooks/deploy_one_host.yml): the next run finishes the
    change on a checked unit, and rollback.yml puts back the unit from before it, serving;
11. a host held by a run of another controller (a host lease, as a controller that does not
    share this profile store leaves it): the batch of that host stops before any of its
    hosts is touched, naming the holder; once it is released the next run finishes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import procgroup  # pylint: disable=import-error
import pytest
from simfleet import L40S, REPO, SimFleet, budget, class_unit, l40s_fleet, reached, recap  # pylint: disable=import-error

from ansible_collections.gpufleet.vllm.plugins.module_utils._sizes import human_bytes, parse_size

GIB = 1 << 30
MIB = 1 << 20
CLASS = "ft-l40s"
HOSTS = ["sim-ft-1", "sim-ft-2", "sim-ft-3"]
HOST_LEASE = "/etc/gpufleet/.leases/host.json"
OTHER_GPU = "sim-ft-4"
# a co-tenant this large on one rank costs that host far more than max_capacity_loss (5 %)
# of the class's typical budget: the planner names it an outlier
OUTLIER_COTENANT = 4 * GIB
# free memory moving by more than unstable_share (0.5) x guard between samples is unsteady
NOISE = [0, 384 * MIB]

FLEET = {
    **l40s_fleet(0.5),
    "gpu_models": {
        "l40s": L40S,
        # same memory, another GPU: only the name tells them apart
        "l40": {"name": "NVIDIA L40", "total": 48305799168, "reserved": 462422016, "cc": "8.9"},
    },
    "classes": {CLASS: {"gpu_model": "l40s", "gpus": 2, "model": "llama-3.1-8b-instruct"}},
    "hosts": {
        "sim-ft-1": {"class": CLASS},
        "sim-ft-2": {"class": CLASS},
        "sim-ft-3": {"class": CLASS},
        OTHER_GPU: {"class": CLASS, "gpu_model": "l40"},
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
    "gpufleet_rollout_serial": [1],
    "gpufleet_canary_load": {"requests": 4, "concurrency": 2, "prompt_tokens": 32, "max_tokens": 8},
    # latency on a shared two-core test machine is noise, not a property of the budget
    "gpufleet_canary_tolerances": {"latency_ratio": 20.0},
    # the simulated engine records its GPU processes in the fake NVML state
    "vllm_service_read_write_paths": ["/etc/fake-nvml"],
    "vllm_service_boot_timeout": 120,
}

# the runs that deploy every host at once: one batch
ONE_BATCH = {"gpufleet_rollout_serial": ["100%"]}


@pytest.fixture(scope="module")
def fleet(harness, tmp_path_factory):  # harness: conftest (root + rootfs)
    f = SimFleet(tmp_path_factory.mktemp("faults"), harness, FLEET, GROUP_VARS)
    try:
        f.create({CLASS: HOSTS})
        yield f
    finally:
        f.sim.destroy()


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    """State carried from one test to the next."""
    return {}


def lease_path(fleet: SimFleet) -> Path:
    return fleet.store / ".leases" / f"{CLASS}.json"


def host_leases(fleet: SimFleet) -> dict[str, dict[str, Any]]:
    """The host leases on the fleet's hosts, by host."""
    found = {}
    for host in HOSTS:
        path = fleet.guest_path(host, HOST_LEASE)
        if path.exists():
            found[host] = json.loads(path.read_text(encoding="utf-8"))
    return found


def process_start(pid: int) -> str:
    """The start time of a live process as a lease records it (field 22 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        return fh.read().rsplit(")", 1)[1].split()[19]


def class_entry(report: dict[str, Any] | None, name: str = CLASS) -> dict[str, Any]:
    assert report is not None, "the run wrote no report"
    (entry,) = [c for c in report["classes"] if c["name"] == name]
    return entry


def outcomes(report: dict[str, Any] | None) -> dict[str, str]:
    assert report is not None, "the run wrote no report"
    return {h["host"]: h["outcome"] for h in report["hosts"]}


def test_outlier_with_split_policy_fail_stops_the_class(fleet, seen):
    assert all(u is None for u in fleet.units().values()), "the fleet must start without units"
    fleet.sim.inject_cotenant("sim-ft-3", gpu=1, size=OUTLIER_COTENANT, pid=None, remove=False)
    reports = len(fleet.reports())
    rc, out = fleet.rollout({"gpufleet_split_policy": "fail"})
    assert rc != 0, "a split with split_policy fail must fail the run"
    assert re.search(r"class ft-l40s should be split .*split outliers sim-ft-3/main into their own class", out), out[-6000:]
    assert reached(out) == [], "no host may reach the serial batches"
    entry = class_entry(fleet.last_report(reports))
    assert entry["decision"] == "split" and entry["status"] == "failed"
    groups = {g["name"]: g for g in entry["split"]}
    assert groups[f"{CLASS}-low"]["hosts"] == ["sim-ft-3/main"]
    assert groups[f"{CLASS}-main"]["hosts"] == ["sim-ft-1/main", "sim-ft-2/main"]
    assert groups[f"{CLASS}-main"]["kv_cache_memory_bytes"] > groups[f"{CLASS}-low"]["kv_cache_memory_bytes"]
    # nothing was deployed: no unit, no plan file, no service
    for host in HOSTS:
        assert fleet.unit(host) is None, host
        assert fleet.plan(host) == {}, host
        assert fleet.active(host) != "active", host
    assert len(fleet.profiles()) == 1, "the profiled canary ran and was recorded before planning"
    seen["split_groups"] = groups


def test_outlier_with_split_policy_warn_deploys_the_weakest_budget(fleet, seen):
    reports = len(fleet.reports())
    rc, out = fleet.rollout({"gpufleet_split_policy": "warn", **ONE_BATCH})
    assert rc == 0, out[-6000:]
    # the output names the outlier and what each sub-class could run
    assert "split outliers sim-ft-3/main into their own class" in out, out[-6000:]
    assert re.search(r"split: \[.*'ft-l40s-main'.*'sim-ft-1/main', 'sim-ft-2/main'.*'ft-l40s-low'.*'sim-ft-3/main'", out)
    assert "Manual canary on sim-ft-1 passed" in out
    entry = class_entry(fleet.last_report(reports))
    assert entry["decision"] == "split" and entry["status"] == "deployable"
    groups = {g["name"]: g for g in entry["split"]}
    assert groups == seen["split_groups"], "the same fleet plans the same split"
    low = groups[f"{CLASS}-low"]["kv_cache_memory_bytes"]
    units = fleet.units()
    for host in HOSTS:
        # every host of the class runs the weakest host's budget
        assert budget(units[host]) == low, host
        assert fleet.active(host) == "active", host
        plan = fleet.plan(host)
        assert plan["decision"] == "split" and plan["kv_cache_memory_bytes"] == low, host
        assert fleet.previous(host) is None, f"{host}: first deploy keeps no previous unit"
    assert outcomes(fleet.last_report(reports)) == {h: "deployed" for h in HOSTS}
    fleet.sim.inject_cotenant("sim-ft-3", gpu=1, size=None, pid=None, remove=True)
    seen["units_split"] = units


def test_a_cotenant_gone_since_the_last_probes_marks_the_rank_unstable(fleet, seen):
    # The two runs above probed sim-ft-3 with the co-tenant on GPU 1; it is gone now. Each probe
    # alone is steady, but across the host's probe history (on by default) the rank moved by the
    # co-tenant's size: a fixed byte budget is the wrong tool until that stops.
    before = fleet.units()
    reports = len(fleet.reports())
    # unstable_scope class: the whole class goes to vLLM's profiling (the next test shows the default, host)
    rc, out = fleet.rollout({"gpufleet_unstable_scope": "class"}, playbook=REPO / "playbooks" / "plan.yml")
    assert rc == 0, out[-6000:]
    entry = class_entry(fleet.last_report(reports))
    assert entry["decision"] == "auto_profile", entry
    moved = re.search(r"free memory is not steady on sim-ft-3/main rank 1 \(moved (\S+) across recent probes\)", out)
    assert moved, out[-6000:]
    assert abs(parse_size(moved.group(1)) - OUTLIER_COTENANT) < 64 * MIB, moved.group(0)
    steady = [h for h in HOSTS if h != "sim-ft-3"]
    assert not any(f"{h}/main" in line for h in steady for line in out.splitlines() if "is not steady on" in line)
    # the utilization comes from the lowest free memory seen: the probe that still had the co-tenant
    assert re.search(r"auto_profile: --gpu-memory-utilization 0\.\d+ from the lowest free memory seen, \S+ on host "
                     r"sim-ft-3/main rank 1", out), out[-6000:]
    assert fleet.units() == before, "plan.yml changes nothing"
    # the operator knows the co-tenant is gone for good: the later runs start from a steady history
    fleet.forget_probe_history("sim-ft-3")


def test_mixed_gpu_types_refuse_the_class(fleet, seen):
    before = fleet.units([*HOSTS, OTHER_GPU])
    assert before[OTHER_GPU] is None
    mixed = fleet.write_inventory({CLASS: [*HOSTS, OTHER_GPU]}, fleet.workdir / "inventory-mixed.yml")
    reports = len(fleet.reports())
    rc, out = fleet.rollout({"gpufleet_refused_class": "skip"}, inventory=mixed)
    # with gpufleet_refused_class skip, a refused class is skipped, not failed: the run itself succeeds and says why
    assert rc == 0, out[-6000:]
    assert re.search(r"class ft-l40s is skipped: GPU name differs from the reference \(NVIDIA L40S\): "
                     r"NVIDIA L40: sim-ft-4/main", out), out[-6000:]
    assert reached(out) == [], "no host of a refused class may reach the serial batches"
    report = fleet.last_report(reports)
    entry = class_entry(report)
    assert entry["decision"] == "refuse" and entry["status"] == "skipped"
    assert outcomes(report) == {h: "skipped" for h in [*HOSTS, OTHER_GPU]}
    assert fleet.units([*HOSTS, OTHER_GPU]) == before
    for host in HOSTS:
        assert fleet.active(host) == "active", host
    assert fleet.active(OTHER_GPU) != "active"
    assert recap(out)[OTHER_GPU]["changed"] == 0
    # by default a refused class fails the run, before any host is rolled out, naming the class and why
    rc, out = fleet.rollout(inventory=mixed)
    assert rc != 0, out[-6000:]
    assert re.search(r"class ft-l40s is not deployable: GPU name differs from the reference \(NVIDIA L40S\): "
                     r"NVIDIA L40: sim-ft-4/main", out), out[-6000:]
    assert "no host was rolled out" in out
    assert reached(out) == [], "no host of a refused class may reach the serial batches"
    assert fleet.units([*HOSTS, OTHER_GPU]) == before


def test_unsteady_free_memory_sends_its_host_alone_to_automatic_profiling(fleet, seen):
    before = fleet.units()
    assert before == seen["units_split"]
    fleet.sim.inject_noise("sim-ft-3", 1, NOISE)
    reports = len(fleet.reports())
    try:
        rc, out = fleet.rollout(ONE_BATCH)
    finally:
        fleet.sim.inject_noise("sim-ft-3", 1, None)
    assert rc == 0, out[-6000:]
    # the probe's samples disagree by the injected noise
    assert f"free memory is not steady on sim-ft-3/main rank 1 (moves {human_bytes(max(NOISE) - min(NOISE))})" in out, out[-6000:]
    # unstable_scope host (the default): that host alone; the others keep a fixed budget planned without it
    assert "only sim-ft-3 runs vLLM's own profiling (auto_profile); the class's 2 other hosts are planned without it" in out
    entry = class_entry(fleet.last_report(reports))
    assert entry["decision"] == "deploy" and entry["status"] == "deployable"
    units = fleet.units()
    # vLLM profiles sim-ft-3's KV cache itself: a utilization, no byte budget, no boot gate
    assert budget(units["sim-ft-3"]) is None and "--kv-cache-memory-bytes" not in units["sim-ft-3"]
    assert re.search(r"--gpu-memory-utilization 0\.\d+", units["sim-ft-3"])
    assert fleet.plan("sim-ft-3")["decision"] == "auto_profile" and fleet.plan("sim-ft-3").get("kv_cache_memory_bytes") is None
    low = seen["split_groups"][f"{CLASS}-low"]["kv_cache_memory_bytes"]
    for host in ("sim-ft-1", "sim-ft-2"):
        # no longer held down to the outlier's budget: their own, from the steady hosts
        assert budget(units[host]) is not None and budget(units[host]) > low, host
        assert fleet.plan(host)["decision"] == "deploy" and fleet.plan(host)["kv_cache_memory_bytes"] == budget(units[host])
    for host in HOSTS:
        assert fleet.active(host) == "active", host
        assert fleet.previous(host) == before[host], f"{host}: the split unit is kept byte for byte"
    assert outcomes(fleet.last_report(reports)) == {h: "deployed" for h in HOSTS}
    seen["units_auto"] = units


def test_gpu_lost_mid_rollout_stops_before_the_host(fleet, seen):
    before = fleet.units()
    assert before == seen["units_auto"]
    injected = threading.Event()

    def inject(line: str) -> None:
        # planning is over once the serial play starts: the GPU was there when it was probed
        if line.startswith("PLAY [Roll out in serial batches]") and not injected.is_set():
            fleet.sim.inject_gpu_lost("sim-ft-2", 1, clear=False)
            injected.set()

    reports = len(fleet.reports())
    try:
        rc, out = fleet.rollout({"gpufleet_guard": "1GiB"}, on_line=inject)
    finally:
        fleet.sim.inject_gpu_lost("sim-ft-2", 1, clear=True)
    assert injected.is_set()
    assert rc != 0, "a lost GPU must fail the run"
    assert re.search(r"sim-ft-2: .*GPU 1\b.*NVML_ERROR_GPU_IS_LOST", out), out[-6000:]
    assert reached(out) == ["sim-ft-1", "sim-ft-2"], reached(out)
    after = fleet.units()
    # batch 1 moved to the new manual plan, its previous unit kept byte for byte
    assert budget(after["sim-ft-1"]) is not None
    assert fleet.previous("sim-ft-1") == before["sim-ft-1"]
    assert fleet.plan("sim-ft-1")["kv_cache_memory_bytes"] == budget(after["sim-ft-1"])
    # sim-ft-2 was never touched, sim-ft-3 never reached
    assert after["sim-ft-2"] == before["sim-ft-2"]
    assert after["sim-ft-3"] == before["sim-ft-3"]
    assert fleet.previous("sim-ft-2") == seen["units_split"]["sim-ft-2"], "the kept unit of sim-ft-2 is untouched"
    for host in HOSTS:
        assert fleet.active(host) == "active", host
    assert outcomes(fleet.last_report(reports)) == {"sim-ft-1": "deployed", "sim-ft-2": "failed",
                                                    "sim-ft-3": "not_reached"}
    seen["units_lost"] = after


def test_interrupted_rollout_is_finished_by_the_next_run(fleet, seen):
    before = fleet.units()
    assert before == seen["units_lost"]
    unit_on_disk = fleet.guest_path("sim-ft-2", fleet.unit_path)
    killed: dict[str, Any] = {}
    done = threading.Event()

    def kill_when_written(proc: subprocess.Popen[str]) -> None:
        def watch() -> None:
            while not done.is_set() and proc.poll() is None:
                try:
                    text = unit_on_disk.read_text(encoding="utf-8")
                except OSError:
                    text = None
                if text != before["sim-ft-2"]:
                    # the new unit is on disk: the controller goes away before the boot check
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed["unit"] = text
                    return
                time.sleep(0.05)

        threading.Thread(target=watch, daemon=True).start()

    try:
        rc, out = fleet.rollout({"gpufleet_guard": "1GiB"}, on_start=kill_when_written)
    finally:
        done.set()
    assert killed, "the run ended before sim-ft-2's unit was written:\n" + out[-6000:]
    assert rc == -signal.SIGKILL
    assert reached(out) == ["sim-ft-1", "sim-ft-2"], reached(out)
    # where it stopped: the new unit written, the boot check not passed. The plan file is written in
    # the same call as the unit: it is the old one (recorded for the old unit) or the new one, which
    # names no unit checksum until a boot check passed; neither says the new unit was checked.
    assert budget(killed["unit"]) == budget(before["sim-ft-1"])
    plan = fleet.plan("sim-ft-2")
    assert plan.get("unit_checksum") != hashlib.sha1(killed["unit"].encode()).hexdigest(), plan  # nosec - a checksum
    assert plan["decision"] == "auto_profile" or (
        "unit_checksum" not in plan and plan["kv_cache_memory_bytes"] == budget(killed["unit"])), plan
    assert fleet.unit("sim-ft-3") == before["sim-ft-3"]

    # A second controller while another run holds the class (here: one planted for this live test
    # process) is refused, naming the holder, before any probe, canary or host.
    killed_lease = json.loads(lease_path(fleet).read_text(encoding="utf-8"))
    left = fleet.units()
    live = dict(killed_lease, run_id="live-run", owner="sre@other-desk", pid=os.getpid(), pid_start=process_start(os.getpid()))
    lease_path(fleet).write_text(json.dumps(live), encoding="utf-8")
    rc, out = fleet.rollout({"gpufleet_guard": "1GiB"})
    assert rc != 0 and reached(out) == [], out[-6000:]
    assert "host class ft-l40s is being changed by rollout run live-run of sre@other-desk" in out, out[-6000:]
    assert fleet.units() == left, "the refused run touched no host"
    # The killed controller's own lease: it no longer runs on this machine, so the next run takes the
    # class over at once and its report says so.
    lease_path(fleet).write_text(json.dumps(killed_lease), encoding="utf-8")
    reports = len(fleet.reports())
    rc, out = fleet.rollout({"gpufleet_guard": "1GiB"})
    assert rc == 0, out[-6000:]
    report = fleet.last_report(reports)
    assert report is not None, "the run wrote a report"
    taken, *hosts_taken = report["lease"]["taken_over"]
    assert taken.startswith(f"host class {CLASS}: took over the lease of rollout run {killed_lease['run_id']} of "), taken
    assert taken.endswith("(its controller no longer runs on this machine)"), taken
    # the killed run held sim-ft-2 for its batch: that host lease goes with the class lease
    assert [t.split(": took over")[0] for t in hosts_taken] == ["sim-ft-2: this host"], hosts_taken
    assert all(t.endswith("(its run no longer holds its class lease)") and killed_lease["run_id"] in t for t in hosts_taken)
    assert not lease_path(fleet).exists(), "the run released its lease at its end"
    assert host_leases(fleet) == {}, "the run released every host's lease at its batch's end"
    after = fleet.units()
    want = budget(before["sim-ft-1"])
    assert after["sim-ft-1"] == before["sim-ft-1"], "batch 1 already ran this plan"
    assert recap(out)["sim-ft-1"]["changed"] == 0
    for host in HOSTS:
        assert class_unit(after[host]) == class_unit(after["sim-ft-1"]), f"{host} runs the same unit as the rest of the class"
        assert fleet.active(host) == "active", host
        plan = fleet.plan(host)
        assert plan["decision"] == "deploy" and plan["kv_cache_memory_bytes"] == want, host
    assert fleet.previous("sim-ft-3") == before["sim-ft-3"]
    seen["units_before_interrupt"] = before


def test_interrupted_rollout_keeps_the_original_previous_unit(fleet, seen):
    """The unit kept for a rollback is the one the host ran before the interrupted run."""
    assert fleet.previous("sim-ft-2") == seen["units_before_interrupt"]["sim-ft-2"]


def read_only(fleet: SimFleet, host: str, path: str) -> Callable[[], None]:
    """Mount ``path`` of ``host`` read-only (a bind mount inside the guest); returns the undo."""
    for argv in (["mount", "--bind", path, path], ["mount", "-o", "remount,bind,ro", path]):
        fleet.harness.exec(host, argv, check=True)
    # lazily: a process of the guest may still hold the directory open
    return lambda: fleet.harness.exec(host, ["umount", "-l", path], check=True)


def test_a_snapshot_that_cannot_be_written_leaves_the_host_serving(fleet, seen):
    """The snapshot directory read-only on sim-ft-2 during a budget change: its write call fails before
    anything is stopped, and the rescue restores nothing (the last snapshot is an older change's)."""
    before = {h: (fleet.unit(h), fleet.read(h, f"/etc/gpufleet/vllm-{fleet.instance}.env"), fleet.read(h, fleet.plan_path),
                  fleet.snapshot(h)) for h in HOSTS}
    assert all(fleet.active(h) == "active" for h in HOSTS)
    undo = read_only(fleet, "sim-ft-2", "/etc/gpufleet/units")
    try:
        rc, out = fleet.rollout({"gpufleet_guard": "1.5GiB"})
    finally:
        undo()
    assert rc != 0, out[-6000:]
    assert reached(out) == ["sim-ft-1", "sim-ft-2"], reached(out)
    failure = next(line for line in out.splitlines() if "sim-ft-2:" in line and "Read-only file system" in line)
    assert "vllm-main.snapshot.json" in failure and "nothing of this change was kept, stopped or restored" in failure, failure
    assert "not restored (the last snapshot belongs to change" in failure, failure
    unit, env, plan, snap = before["sim-ft-2"]
    assert (fleet.unit("sim-ft-2"), fleet.read("sim-ft-2", f"/etc/gpufleet/vllm-{fleet.instance}.env"),
            fleet.read("sim-ft-2", fleet.plan_path), fleet.snapshot("sim-ft-2")) == (unit, env, plan, snap), \
        "the unit, secret env file, plan file and last snapshot are as they were"
    assert fleet.active("sim-ft-2") == "active", "the instance serves on"
    assert fleet.unit("sim-ft-3") == before["sim-ft-3"][0] and fleet.active("sim-ft-3") == "active"
    assert budget(fleet.unit("sim-ft-1")) != budget(before["sim-ft-1"][0]), "batch 1 took the new budget"


def cut_off_the_canary_module(fleet, host: str, timeout: float = 60.0) -> int | None:
    """Once the profiled canary's engine runs on ``host`` (on loopback, without a fixed budget), SIGKILL
    its parent, the vllm_canary module, and then the engine's process group; the module's pid (None: none ran)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = fleet.harness.exec(host, ["ps", "-eo", "ppid=,pgid=,args="]).stdout.splitlines()
        for row in rows:
            ppid, pgid, args = [*row.split(None, 2), ""][:3]
            if " serve " in f" {args} " and "--host 127.0.0.1" in args and "--kv-cache-memory-bytes" not in args:
                fleet.harness.exec(host, ["kill", "-KILL", ppid])
                fleet.harness.exec(host, ["kill", "-KILL", "--", f"-{pgid}"])
                return int(ppid)
        time.sleep(0.2)
    return None


def test_a_canary_killed_by_its_controller_never_makes_a_rollback_stop_the_instance(fleet, seen):
    """SIGKILL of the controller while the profiled canary holds the canary host's GPUs; then a normal
    run; then rollback.yml on that host: the instance serves at every step's end."""
    canary = "sim-ft-1"
    hold = fleet.guest_path(canary, f"/etc/gpufleet/units/vllm-{fleet.instance}.canary-hold.json")
    killed: dict[str, Any] = {}
    done = threading.Event()

    def kill_during_the_canary(proc: subprocess.Popen[str]) -> None:
        def watch() -> None:
            while not done.is_set() and proc.poll() is None:
                if hold.exists() and fleet.active(canary) != "active":
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed["hold"] = json.loads(hold.read_text(encoding="utf-8"))
                    return
                time.sleep(0.1)

        threading.Thread(target=watch, daemon=True).start()

    try:
        rc, out = fleet.rollout({"gpufleet_guard": "1.5GiB", "gpufleet_force_profile": True}, on_start=kill_during_the_canary)
    finally:
        done.set()
    assert killed, "the run ended before the profiled canary held the canary host:\n" + out[-6000:]
    # The controller's death does not cut the canary off: its module goes on on the host, and would start
    # the instance again itself. Cut it off there too (a rebooted host, a killed module): SIGKILL of the
    # module and of its engine, so that nothing of it runs its cleanup.
    module_pid = cut_off_the_canary_module(fleet, canary)
    assert module_pid, "the canary's module ran on after its controller was killed"
    assert fleet.active(canary) != "active" and hold.exists(), "the cut-off canary left the instance stopped, and its hold"

    rc, out = fleet.rollout({"gpufleet_guard": "1.5GiB"})
    assert rc == 0, out[-6000:]
    assert not hold.exists(), "the next run started the instance again and took the hold off"
    for host in HOSTS:
        assert fleet.active(host) == "active", host
    assert class_unit(fleet.unit("sim-ft-2")) == class_unit(fleet.unit(canary)), "the class runs one budget again"

    back = procgroup.run(["ansible-playbook", "-i", str(fleet.inventory), str(REPO / "playbooks" / "rollback.yml"),
                          "-e", f"gpufleet_rollback_hosts={canary}"], timeout=300, cwd=REPO,
                         env=dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_PIPELINING="1", ANSIBLE_HOST_KEY_CHECKING="False"))
    assert back.returncode == 0, back.stdout[-6000:]
    assert "restarted it (it served before the change)" in back.stdout, back.stdout[-6000:]
    assert fleet.active(canary) == "active", "a rollback never stops an instance that served before the change it undoes"


def test_a_link_lost_during_a_write_call_never_leaves_the_batch_unchecked(fleet, seen):
    """sim-ft-3's link goes down as the batch's write calls start (all three hosts in one batch): its call fails
    within the bounds (keep-alives here, gpufleet_remote_timeout otherwise); the batch's other hosts check their
    boots before the run stops, so no host serves an unchecked unit; the next run finishes sim-ft-3."""
    lost = "sim-ft-3"
    cut: dict[str, float] = {}

    def cut_the_link(line: str) -> None:
        if not cut and "TASK [gpufleet.vllm.vllm_service : Create the account, keep the files and stop the instances" in line:
            fleet.sim.inject_unreachable(lost, clear=False)
            cut["at"] = time.monotonic()

    try:
        rc, out = fleet.rollout({"gpufleet_guard": "2GiB", "gpufleet_remote_timeout": 120, **ONE_BATCH}, on_line=cut_the_link)
    finally:
        fleet.sim.inject_unreachable(lost, clear=True)
    assert cut, "the batch never reached its write calls:\n" + out[-6000:]
    assert rc != 0, out[-6000:]
    assert re.search(rf"{lost}\s+:.*unreachable=1", out), out[-4000:]
    for host in ("sim-ft-1", "sim-ft-2"):
        unit = fleet.unit(host)
        assert fleet.active(host) == "active", host
        assert fleet.plan(host).get("unit_checksum") == hashlib.sha1(unit.encode()).hexdigest(), \
            f"{host} runs a unit that passed its boot check"  # nosec - a checksum
        assert budget(unit) == budget(fleet.unit("sim-ft-1")), host

    rc, out = fleet.rollout({"gpufleet_guard": "2GiB", **ONE_BATCH})
    assert rc == 0, out[-6000:]
    for host in HOSTS:
        unit = fleet.unit(host)
        assert fleet.active(host) == "active", host
        assert fleet.plan(host).get("unit_checksum") == hashlib.sha1(unit.encode()).hexdigest(), host  # nosec
        assert class_unit(unit) == class_unit(fleet.unit("sim-ft-1")), f"{host} runs the class's one unit"


# The remote calls of a one-host budget update, in order (the role's task names).
DEPLOY_CALLS = ["Compare the units and environment files with the plan and read the services",
                "Create the account, keep the files and stop the instances",
                "Check each boot against the plan, and record the plan it passed with"]


class KillInCall:
    """Kills a run (its whole process group) half a second after the banner of the task ``call`` shows:
    by then the call has been sent to the host and runs there."""

    def __init__(self, call: str) -> None:
        self.banner = f"TASK [gpufleet.vllm.vllm_service : {call}"
        self.proc: subprocess.Popen[str] | None = None
        self.at: float | None = None

    def start(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def line(self, line: str) -> None:
        if self.banner in line and self.proc is not None and self.at is None:
            self.at = time.monotonic()
            threading.Timer(0.5, os.killpg, (self.proc.pid, signal.SIGKILL)).start()


def test_a_kill_at_every_remote_call_of_a_deploy_loses_nothing(fleet, seen):
    """The controller killed at each remote call of sim-ft-1's deploy in turn: the next run finishes the change
    on a checked unit, and rollback.yml then puts back the unit from before the killed change, serving."""
    host = "sim-ft-1"
    launch_b = json.loads(fleet.read(host, fleet.plan_path))
    kept = fleet.snapshot(host)
    assert kept and kept["files"]["plan"], "the last change kept a plan file to go back to"
    launch_a = json.loads(base64.b64decode(kept["files"]["plan"]["data"]))
    assert launch_a["launch"]["kv_cache_memory_bytes"] != launch_b["launch"]["kv_cache_memory_bytes"]
    unit_b = fleet.unit(host)
    deploy = REPO / "tests" / "integration" / "playbooks" / "deploy_one_host.yml"
    extra = {"target": host, "test_plan": {"launch": launch_a["launch"]}, "test_key": launch_a["compat_key_hash"]}
    for index, call in enumerate(DEPLOY_CALLS):
        killer = KillInCall(call)
        rc, out = fleet.rollout(extra, playbook=deploy, on_line=killer.line, on_start=killer.start)
        assert killer.at is not None and rc == -signal.SIGKILL, f"call {index}: the run was not killed in '{call}':\n" + out[-4000:]

        rc, out = fleet.rollout(extra, playbook=deploy)
        assert rc == 0, f"call {index}: the next run did not finish the change:\n" + out[-6000:]
        unit = fleet.unit(host)
        assert budget(unit) == launch_a["launch"]["kv_cache_memory_bytes"] and fleet.active(host) == "active", index
        assert fleet.plan(host).get("unit_checksum") == hashlib.sha1(unit.encode()).hexdigest(), index  # nosec

        back = procgroup.run(["ansible-playbook", "-i", str(fleet.inventory), str(REPO / "playbooks" / "rollback.yml"),
                              "-e", f"gpufleet_rollback_hosts={host}"], timeout=300, cwd=REPO,
                             env=dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_PIPELINING="1", ANSIBLE_HOST_KEY_CHECKING="False"))
        assert back.returncode == 0, back.stdout[-6000:]
        assert fleet.unit(host) == unit_b, f"call {index}: the rollback put back the unit from before the killed change"
        assert fleet.active(host) == "active", f"call {index}: the rollback left the instance serving"


def test_a_host_another_controller_changes_stops_its_batch_untouched(fleet, seen):
    """A host held by a run of another controller, one that does not share this profile store (so the class
    lease cannot see it): the batch of that host stops before any of its hosts is touched, naming the
    holder, and its lease is left to its holder; the batches before it changed their hosts and released
    them. Once the holder is done, the next run finishes the class."""
    before = fleet.units()
    now = time.time()
    other = {"format": 1, "scope": "host", "run_id": "desk-run", "owner": "sre@desk-2", "purpose": "rollout",
             "started": now, "renewed": now, "expires": now + 3600, "host": "desk-2", "pid": 4242, "pid_start": "1"}
    held = fleet.guest_path("sim-ft-3", HOST_LEASE)
    held.parent.mkdir(parents=True, exist_ok=True)
    held.write_text(json.dumps(other), encoding="utf-8")
    reports = len(fleet.reports())
    rc, out = fleet.rollout({"gpufleet_guard": "1.25GiB"})
    assert rc != 0, out[-6000:]
    assert reached(out) == ["sim-ft-1", "sim-ft-2"], reached(out)
    assert re.search(r"sim-ft-3: rollout_lease: this host is being changed by rollout run desk-run of sre@desk-2, started .*; "
                     r"this run stops before touching it .*; no host of this batch was touched", out), out[-6000:]
    after = fleet.units()
    assert after["sim-ft-3"] == before["sim-ft-3"] and fleet.active("sim-ft-3") == "active"
    assert budget(after["sim-ft-1"]) == budget(after["sim-ft-2"]) != budget(before["sim-ft-1"])
    report = fleet.last_report(reports)
    assert report is not None, "the stopped run wrote its report"
    stopped = {h["host"]: h for h in report["hosts"]}["sim-ft-3"]
    assert "desk-run of sre@desk-2" in (stopped["error"] or "") and report["failed_hosts"] == ["sim-ft-3"], report["hosts"]
    assert host_leases(fleet) == {"sim-ft-3": other}, "the other controller's lease is its own to release"
    # a rollback of that host is refused the same way, before it restores anything
    back = procgroup.run(["ansible-playbook", "-i", str(fleet.inventory), str(REPO / "playbooks" / "rollback.yml"),
                          "-e", "gpufleet_rollback_hosts=sim-ft-3"], timeout=300, cwd=REPO,
                         env=dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_HOST_KEY_CHECKING="False"))
    assert back.returncode != 0 and "this host is being changed by rollout run desk-run of sre@desk-2" in back.stdout, back.stdout[-4000:]
    assert fleet.unit("sim-ft-3") == before["sim-ft-3"] and fleet.active("sim-ft-3") == "active"

    held.unlink()
    rc, out = fleet.rollout({"gpufleet_guard": "1.25GiB"})
    assert rc == 0, out[-6000:]
    done = fleet.units()
    assert done["sim-ft-1"] == after["sim-ft-1"] and fleet.active("sim-ft-3") == "active"
    assert class_unit(done["sim-ft-3"]) == class_unit(done["sim-ft-1"]), "sim-ft-3 runs the class's unit now"
    assert host_leases(fleet) == {}

#!/usr/bin/env python
# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Rollout overhead of an instance over several hosts (a gang), at 2 and 4 members, on the simulated fleet.

For each gang size M: one fleet of M hosts (2 simulated L40S each, Llama-3.1-8B), and on it four
``ansible-playbook playbooks/rollout.yml`` runs, all in one batch of the M hosts:

1. the M hosts each with an instance of its own (TP=2), installed;
2. the same, updated (a larger guard: a new budget on every host);
3. one gang over the M hosts (``mode: mp``, TP=2 x PP=M, a pipeline stage per host, joined over the
   test hosts' fabric), which replaces the one-host instances;
4. the gang, updated (a larger guard again).

The overhead of a batch is its wall time minus its boot-to-healthy: for one-host instances the slowest
host's (systemd's ``Started vllm-main.service`` to the engine's ``Application startup complete.``), for
the gang the time from the first member's ``Started`` to the leader's ``Application startup complete.``
(the leader serves once every member joined). The per-gang overhead is the gang update's batch overhead
minus the one-host update's, the same hosts in the same run; per member it is that divided by M (goal:
2 s or less). The simulated engine joins a gang's members as vLLM does (``sim/engine/vllm``, ``GangLink``).

Run as root. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rollout_overhead as ro  # pylint: disable=wrong-import-position,import-error

GOAL_SECONDS_PER_MEMBER = 2.0
GANG_PORT = 29555
# the tasks that keep a gang's members together in a batch (the includes of roles/vllm_service/tasks/main.yml and
# the tasks of gang_start.yml and gang.yml): what a gang adds to a batch besides its own boot
GANG_TASK = re.compile(r"member of (this host's gangs|its gang)|every member of a gang|Stop with the gang|Go on with the whole gang|Change the whole gang")


def gang_boot_to_healthy(harness: Any, members: list[str]) -> float | None:
    """From the first member's start of the unit (its last) to the leader's ``Application startup complete.``."""
    starts = [ro.last_start(harness, host) for host in members]
    if any(started is None for started, _healthy in starts) or starts[0][1] is None:
        return None
    return round(starts[0][1] - min(started for started, _healthy in starts if started is not None), 3)


def gang_vars(harness: Any, members: list[str]) -> dict[str, Any]:
    """The gang over ``members`` (the first leads), on the test hosts' fabric."""
    fabric = {m: harness.get(m).fabric_address for m in members}
    gang = {"mode": "mp", "members": members, "address": fabric[members[0]], "port": GANG_PORT,
            "addresses": {m: fabric[m] for m in members[1:]}, "interface": ro.testhosts.FABRIC_IFACE}
    return {"gpufleet_instances": [{"name": ro.INSTANCE, "gpus": [0, 1], "port": 8000, "gang": gang}],
            "gpufleet_serve_args": {"max_model_len": 8192, "tensor_parallel_size": 2, "pipeline_parallel_size": len(members),
                                    "max_num_seqs": 32, "dtype": "bfloat16", "block_size": 16}}


def gang_task_seconds(log: Path) -> float:
    """Seconds the gang's own tasks took in the run (each task header to the next header), from the
    time-stamped output measure_rollout keeps."""
    total, current, opened = 0.0, False, 0.0
    for line in log.read_text(encoding="utf-8").splitlines():
        stamp, _sep, text = line.strip().partition(" ")
        if not text.startswith(("TASK [", "PLAY [", "PLAY RECAP")):
            continue
        when = float(stamp)
        if current:
            total += when - opened
        task = ro.TASK_RE.match(text)
        current, opened = bool(task and GANG_TASK.search(task.group(1))), when
    return round(total, 2)


def one_run(sim: Any, inventory: Path, names: list[str], kind: str, timeout: float, extra: dict[str, Any],
            gang: bool) -> dict[str, Any]:
    run = ro.measure_rollout(sim, inventory, names, kind, len(names), timeout, extra)
    run["gang_tasks_s"] = gang_task_seconds(inventory.parent / f"{kind}.log")
    if gang:
        boot = gang_boot_to_healthy(sim.h, names)
        run["gang_boot_to_healthy_s"] = boot
        rows = run.get("batches") or []
        if run.get("rc") == 0 and boot is not None and len(rows) == 1:
            rows[0]["slowest_boot_s"] = boot
            rows[0]["overhead_s"] = round(rows[0]["wall_s"] - boot, 2)
            run.pop("error", None)
            run.pop("output_tail", None)
    return run


def measure(members: int, prefix: str, boot_delay: float, timeout: float) -> dict[str, Any]:
    names = [f"{prefix}{members}-{i:02d}" for i in range(1, members + 1)]
    workdir = ro.CACHE / "bench" / f"gang-{members}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    path = workdir / "fleet.yml"
    path.write_text(yaml.safe_dump(ro.fleet_file(names, boot_delay)), encoding="utf-8")
    sim = ro.fleetctl.Fleet(path)
    out: dict[str, Any] = {"members": members, "engine_boot_delay_s": boot_delay,
                           "measured_at": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    runs: dict[str, dict[str, Any]] = {}
    try:
        with contextlib.redirect_stdout(sys.stderr):
            sim.create(reset_state=True, timeout=120 + 15 * members)
        inv = {"all": {"children": {ro.CLASS.replace("-", "_"): {
            "hosts": {n: sim.h.inventory_data(names=names)["all"]["hosts"][n] for n in names},
            "vars": ro.group_vars(workdir, [members])}}}}
        inventory = workdir / "inventory.yml"
        inventory.write_text(yaml.safe_dump(inv), encoding="utf-8")
        gang = gang_vars(sim.h, names)
        steps = [("hosts_install", {}, False), ("hosts_update", {"gpufleet_guard": "1GiB"}, False),
                 ("gang_install", dict(gang, gpufleet_guard="1GiB"), True),
                 ("gang_update", dict(gang, gpufleet_guard="1.5GiB"), True)]
        for kind, extra, is_gang in steps:
            runs[kind] = one_run(sim, inventory, names, kind, timeout, extra, is_gang)
            if runs[kind].get("rc") != 0:
                break
    except (ro.fleetctl.FleetError, ro.testhosts.HarnessError, RuntimeError, OSError) as exc:
        out["error"] = str(exc)
    finally:
        try:
            with contextlib.redirect_stdout(sys.stderr):
                sim.destroy()
            leftovers = [str(x) for x in sim.h.leftovers() if x.owner in names]
            out["teardown"] = "clean" if not leftovers else "leftovers: " + "; ".join(leftovers)
        except (ro.fleetctl.FleetError, ro.testhosts.HarnessError) as exc:
            out["teardown"] = f"failed: {exc}"
    out["runs"] = runs
    hosts, gang_run = runs.get("hosts_update", {}), runs.get("gang_update", {})
    if hosts.get("rc") == 0 and gang_run.get("rc") == 0 and gang_run.get("gang_boot_to_healthy_s") is not None:
        one = hosts["batches"][0]
        whole = gang_run["batches"][0]
        extra_s = whole["overhead_s"] - one["overhead_s"]
        out["one_host_batch_overhead_s"] = one["overhead_s"]
        out["gang_batch_overhead_s"] = whole["overhead_s"]
        out["gang_overhead_s"] = round(extra_s, 2)
        out["gang_overhead_per_member_s"] = round(extra_s / members, 3)
        out["within_goal"] = extra_s / members <= GOAL_SECONDS_PER_MEMBER
        # the gang's own tasks (skipped for one-host instances, run for the gang) in the update's batch
        out["gang_tasks_s"] = {"one_host": hosts.get("gang_tasks_s"), "gang": gang_run.get("gang_tasks_s")}
        out["remote_calls_per_host"] = {"one_host": hosts.get("remote_calls_per_host"), "gang": gang_run.get("remote_calls_per_host")}
    elif "error" not in out:
        out["error"] = "a run did not complete: " + ", ".join(f"{k} rc {v.get('rc')}" for k, v in runs.items())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", default="2,4", help="gang sizes, comma-separated")
    parser.add_argument("--prefix", default="sim-bg")
    parser.add_argument("--boot-delay", type=float, default=2.0, help="simulated engine boot delay (s)")
    parser.add_argument("--timeout", type=float, default=1800, help="limit per playbook run (s)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print(json.dumps({"error": "run as root: test hosts use systemd-nspawn and network namespaces"}))
        return 2
    started = time.monotonic()
    sizes = [measure(int(m), args.prefix, args.boot_delay, args.timeout) for m in args.members.split(",")]
    print(json.dumps({"benchmark": "gang_overhead", "goal_seconds_per_member": GOAL_SECONDS_PER_MEMBER, "sizes": sizes,
                      "command": "python bench/gang_overhead.py " + " ".join(sys.argv[1:]),
                      "seconds": round(time.monotonic() - started, 1)}, indent=2))
    return 0 if all("gang_overhead_per_member_s" in s and s.get("teardown") == "clean" for s in sizes) else 1


if __name__ == "__main__":
    sys.exit(main())

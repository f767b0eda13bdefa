# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A class of two gangs (instances over two hosts each) on the simulated fleet, rolled out one gang per batch.

Four simulated hosts with 2 GPUs each; gang A over the first two, gang B over the last two (``mode: mp``,
TP=2 x PP=2, a pipeline stage per host, joined over the test hosts' fabric by the simulated engine's
rendezvous). ``rollout.yml`` installs both; then an update whose second batch fails (gang B's leader runs
out of memory at its boot): gang B rolls back in its members' own rescues, and the class rollback
(``gpufleet_on_failure: rollback_class``) restores gang A, which passed in the first batch, as one unit -
both members restored and restarted, then each boot checked - so that the whole class runs the plan it ran
before the run, every file byte for byte, and gang A serves again.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from simfleet import REPO, SIM_TEST_VARS, SimFleet, l40s_fleet

CLASS = "gang-l40s"
A_HOSTS, B_HOSTS = ["sim-gr-a1", "sim-gr-a2"], ["sim-gr-b1", "sim-gr-b2"]
HOSTS = A_HOSTS + B_HOSTS
PORT = 8000

FLEET = {
    **l40s_fleet(1),
    "classes": {CLASS: {"gpu_model": "l40s", "gpus": 2, "model": "llama-3.1-8b-instruct"}},
    "hosts": {h: {"class": CLASS, "base_used": [0, 0]} for h in HOSTS},
}

GROUP_VARS = {
    "gpufleet_model": "/srv/models/llama-3.1-8b-instruct",
    "gpufleet_model_config": str(REPO / "sim" / "models" / "llama-3.1-8b-instruct" / "config.json"),
    "gpufleet_serve_args": {"max_model_len": 8192, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "max_num_seqs": 32,
                            "dtype": "bfloat16", "block_size": 16},
    "gpufleet_guard": "0.5GiB",
    "gpufleet_admission": {"concurrency": 2, "tokens_per_request": 8192},
    "gpufleet_canary_load": {"requests": 4, "concurrency": 2, "prompt_tokens": 32, "max_tokens": 8},
    "gpufleet_rollout_serial": [1],
    **SIM_TEST_VARS,
}


@pytest.fixture(scope="module")
def fleet(harness, tmp_path_factory):  # harness: conftest (root + rootfs)
    f = SimFleet(tmp_path_factory.mktemp("gangs"), harness, FLEET, GROUP_VARS)
    try:
        f.create(classes={CLASS: HOSTS})
        # each pair of hosts one gang, meeting on the test hosts' fabric at its leader's address
        data = yaml.safe_load(f.inventory.read_text(encoding="utf-8"))
        hosts = data["all"]["children"][CLASS.replace("-", "_")]["hosts"]
        for members in (A_HOSTS, B_HOSTS):
            fabric = {m: harness.get(m).fabric_address for m in members}
            gang = {"mode": "mp", "members": members, "address": fabric[members[0]], "port": 29555,
                    "addresses": {members[1]: fabric[members[1]]}, "interface": "fabric0"}
            for member in members:
                hosts[member]["gpufleet_instances"] = [{"name": "main", "gpus": [0, 1], "port": PORT, "gang": gang}]
        f.inventory.write_text(yaml.safe_dump(data), encoding="utf-8")
        yield f
    finally:
        f.sim.destroy()


def files(fleet: SimFleet) -> dict[str, tuple[str | None, str | None]]:
    return {h: (fleet.unit(h), fleet.read(h, fleet.plan_path)) for h in HOSTS}


def served_budget(fleet: SimFleet, host: str) -> int:
    """The KV-cache budget the gang's leader reports in its /metrics, read on the host itself."""
    code = (f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{PORT}/metrics', timeout=10)"
            ".read().decode())")
    text = fleet.harness.exec(host, ["python3", "-c", code], check=True).stdout
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info") and "kv_cache_memory_bytes=" in line:
            return int(line.split('kv_cache_memory_bytes="', 1)[1].split('"', 1)[0])
    raise AssertionError(f"{host}: no kv_cache_memory_bytes in /metrics:\n{text[-2000:]}")


def test_a_class_rollback_restores_a_gang_of_an_earlier_batch_as_one_unit(fleet: SimFleet) -> None:
    rc, out = fleet.rollout(timeout=900)
    assert rc == 0, out[-8000:]
    report: dict[str, Any] = fleet.last_report() or {}
    assert [(g["leader"], g["outcome"]) for g in report.get("gangs", [])] == [("sim-gr-a1", "deployed"), ("sim-gr-b1", "deployed")], \
        report.get("gangs")
    before = files(fleet)
    budget_before = served_budget(fleet, A_HOSTS[0])
    # the update: gang A passes in batch 1; gang B's leader runs out of memory at its boot in batch 2
    fleet.sim.inject_fail_next_boot(B_HOSTS[0], "oom")
    rc, out = fleet.rollout({"gpufleet_guard": "1GiB"}, timeout=900)
    assert rc != 0, out[-8000:]
    assert "the previous units were restored and restarted" in out, out[-8000:]
    # gang A: both members restored, then both boots checked (after every host of the class rollback was restored)
    phases = re.findall(r"TASK \[Restore the units, plan files and runtime this run replaced, and check each boot \((\w+)\)\]", out)
    assert phases == ["restore", "restore", "check", "check"], phases
    assert files(fleet) == before, "every host runs the files it ran before the run"
    for host in HOSTS:
        assert fleet.active(host) == "active", host
    assert served_budget(fleet, A_HOSTS[0]) == budget_before
    report = fleet.last_report() or {}
    outcomes = {h["host"]: h["outcome"] for h in report["hosts"]}
    assert outcomes == {h: "rolled_back" for h in HOSTS}, outcomes
    assert all(h["rolled_back_with"] in B_HOSTS for h in report["hosts"] if h["host"] in A_HOSTS), report["hosts"]
    assert report["classes"][0]["final"]["state"] == "previous_plan", report["classes"][0]["final"]
    body = json.dumps({"model": "/srv/models/llama-3.1-8b-instruct", "prompt": "a b c", "max_tokens": 2})
    code = ("import sys, urllib.request; r = urllib.request.Request('http://127.0.0.1:8000/v1/completions', "
            "data=sys.argv[1].encode(), headers={'Content-Type': 'application/json'}); "
            "print(urllib.request.urlopen(r, timeout=60).status)")
    assert fleet.harness.exec(A_HOSTS[0], ["python3", "-c", code, body], check=True).stdout.strip() == "200"

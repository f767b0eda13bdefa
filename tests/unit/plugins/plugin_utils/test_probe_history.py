# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Instability seen over time: the per-host probe history, its use by the planner, and the
utilization an auto_profile plan gets from the lowest free memory seen."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from ansible_collections.gpufleet.vllm.plugins.action.kv_plan import members_from_group
from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _probe_history as ph
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import floor_utilization, plan_class

GIB = 1 << 30
TOTAL = 48 * GIB


def gpus(*free: int) -> list[dict[str, Any]]:
    return [{"index": i, "boot_free_bytes": f, "free_min_bytes": f, "free_max_bytes": f, "total_bytes": TOTAL,
             "name": "NVIDIA L40S"} for i, f in enumerate(free)]


def test_history_is_bounded_atomic_and_survives_concurrent_writers(tmp_path):
    for n in range(7):
        ph.record(str(tmp_path), "gpu-a", gpus(40 * GIB + n), at=float(n), keep=5)
    probes = ph.load(str(tmp_path), "gpu-a")
    assert [p["at"] for p in probes] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert sorted(p.name for p in (tmp_path / ".probe-history").iterdir()) == [".lock", "gpu-a.json"]
    # concurrent planning runs append under the lock: none is lost
    threads = [threading.Thread(target=ph.record, args=(str(tmp_path), "gpu-b", gpus(GIB), float(n), 50)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ph.load(str(tmp_path), "gpu-b")) == 20
    # check mode reads and adds the probe, writes nothing
    assert len(ph.record(str(tmp_path), "gpu-c", gpus(GIB), 0.0, check=True)) == 1
    assert not (tmp_path / ".probe-history" / "gpu-c.json").exists()


def test_history_errors_name_the_file(tmp_path):
    with pytest.raises(ph.ProbeHistoryError, match="cannot name a file"):
        ph.record(str(tmp_path), "../x", gpus(GIB), 0.0)
    (tmp_path / ".probe-history").mkdir()
    (tmp_path / ".probe-history" / "gpu-a.json").write_text("{")
    with pytest.raises(ph.ProbeHistoryError, match="gpu-a.json: cannot read it"):
        ph.load(str(tmp_path), "gpu-a")


def test_movement_over_the_window():
    probes = [ph.entry(gpus(f), float(n)) for n, f in enumerate([40 * GIB, 38 * GIB, 40 * GIB, 40 * GIB, 40 * GIB, 40 * GIB])]
    assert ph.movement(probes, 0, window=5) == (2 * GIB, 38 * GIB)
    assert ph.movement(probes, 0, window=4) == (0, 40 * GIB)
    assert ph.movement(probes[:1], 0) is None
    assert ph.movement(probes, 3) is None


def task_vars(hostvars: dict[str, Any]) -> dict[str, Any]:
    return {"groups": {"c": sorted(hostvars)}, "hostvars": hostvars}


def test_members_carry_the_history_and_the_host_flag():
    hv = {"a": {"gpufleet_gpus": gpus(40 * GIB)}, "b": {"gpufleet_gpus": gpus(40 * GIB), "gpufleet_unstable": "yes"}}
    history = {"a": [ph.entry(gpus(f), 0.0) for f in (40 * GIB, 37 * GIB, 40 * GIB)]}
    members = members_from_group("c", task_vars(hv), history, window=5)
    assert members["a/vllm"][0]["history_spread_bytes"] == 3 * GIB
    assert members["a/vllm"][0]["history_min_bytes"] == 37 * GIB
    assert members["b/vllm"]["unstable"] is True and members["b/vllm"]["ranks"][0]["boot_free_bytes"] == 40 * GIB


REFERENCE = {"ranks": [{"rank": 0, "free_bytes": 40 * GIB, "kv_bytes": 30 * GIB}], "total_bytes": TOTAL,
             "block_size": 16, "bytes_per_block": 2 << 20}


def plan(hosts: dict[str, Any], scope: str = "class") -> dict[str, Any]:
    return plan_class({"host_class": "c", "reference": REFERENCE, "guard_bytes": "0.5GiB", "max_model_len": 8192,
                       "hosts": hosts, "unstable_scope": scope})


def test_a_rank_that_moved_across_probes_makes_the_class_auto_profile_with_a_lowest_free_utilization():
    steady = {"a/vllm": [{"rank": 0, "boot_free_bytes": 40 * GIB, "history_spread_bytes": GIB // 4}]}
    assert plan(steady)["decision"] == "deploy", "a move of half the guard is still steady"
    moved = {"a/vllm": [{"rank": 0, "boot_free_bytes": 40 * GIB, "history_spread_bytes": 3 * GIB,
                         "history_min_bytes": 37 * GIB}],
             "b/vllm": [{"rank": 0, "boot_free_bytes": 40 * GIB}]}
    got = plan(moved)
    assert got["decision"] == "auto_profile"
    assert "a/vllm rank 0 (moved 3GiB across recent probes)" in got["reasons"][0]
    assert got["unstable"][0]["moved_bytes"] == 3 * GIB
    # the lowest free memory seen (37 GiB, an earlier probe) less the guard and the CUDA-context allowance
    assert got["gpu_memory_utilization"] == floor_utilization(37 * GIB - GIB // 2 - GIB, TOTAL)
    assert got["utilization_source"] == "lowest_free"
    assert any("from the lowest free memory seen, 37GiB on host a/vllm rank 0" in r for r in got["reasons"])
    # unstable_scope host: only a runs vLLM's profiling, from the same lowest free memory; b keeps a fixed budget
    apart = plan(moved, "host")
    assert apart["decision"] == "deploy" and apart["weakest"]["host"] == "b/vllm"
    (group,) = apart["host_groups"]
    assert group["hosts"] == ["a"] and group["plan"]["decision"] == "auto_profile"
    assert group["plan"]["gpu_memory_utilization"] == got["gpu_memory_utilization"]


def test_a_rank_unstable_within_one_probe_gets_its_boot_free_memory_as_the_utilization_basis():
    """boot_free_bytes already comes from the probe's lowest sample; free_min_bytes is raw free memory,
    without what this host's running engine holds (a rollout probes while the old units run)."""
    got = plan({"a/vllm": [{"rank": 0, "boot_free_bytes": 39 * GIB, "free_min_bytes": 8 * GIB, "free_max_bytes": 9 * GIB}]})
    assert got["decision"] == "auto_profile"
    assert got["gpu_memory_utilization"] == floor_utilization(39 * GIB - GIB // 2 - GIB, TOTAL)


def test_kv_plan_action_records_the_history_and_plans_from_it(tmp_path):
    """The action as a playbook task runs it: hosts_from with probe_history, twice."""
    from ansible_collections.gpufleet.vllm.plugins.action import kv_plan as action  # pylint: disable=import-outside-toplevel

    hv = {"a": {"gpufleet_gpus": gpus(40 * GIB)}, "b": {"gpufleet_gpus": gpus(40 * GIB)}}
    plugin = action.ActionModule.__new__(action.ActionModule)
    plugin._task = SimpleNamespace(check_mode=False)  # pylint: disable=protected-access
    options = {"store": str(tmp_path), "keep": 20, "window": 5}
    first = plugin._record_history("c", task_vars(hv), options)  # pylint: disable=protected-access
    assert {h: len(p) for h, p in first.items()} == {"a": 1, "b": 1}
    hv["a"]["gpufleet_gpus"] = gpus(37 * GIB)  # a co-tenant came
    second = plugin._record_history("c", task_vars(hv), options)  # pylint: disable=protected-access
    members = members_from_group("c", task_vars(hv), second, 5)
    got = plan(members)
    assert got["decision"] == "auto_profile" and "moved 3GiB across recent probes" in got["reasons"][0]
    stored = json.loads((tmp_path / ".probe-history" / "a.json").read_text())
    assert [p["boot_free"]["0"] for p in stored["probes"]] == [40 * GIB, 37 * GIB]
    with pytest.raises(ph.ProbeHistoryError, match="window must be >= 2"):
        plugin._record_history("c", task_vars(hv), dict(options, window=1))  # pylint: disable=protected-access

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The first-run outline: canary host, what stops and for about how long, which units are written."""

from __future__ import annotations

import pytest

from ansible_collections.gpufleet.vllm.plugins.plugin_utils._first_run import CANARY_RULE, FirstRunError, outline, outline_lines


def spec(**over):
    base = {
        "host_class": "l40s",
        "canary_host": "gpu-1",
        "canary_instance": "main",
        "profiled_canary": True,
        "manual_canary": None,
        "hosts": {
            "gpu-1": [{"name": "main", "active_state": "active", "unit_exists": True}],
            "gpu-2": [{"name": "main", "active_state": "inactive", "unit_exists": False}],
            "gpu-3": [{"name": "main", "active_state": "active", "unit_exists": True},
                      {"name": "side", "active_state": "failed", "unit_exists": True}],
        },
        "batches": [["gpu-1"], ["gpu-2"], ["gpu-3"]],
        "boot_seconds": 40,
        "boot_source": "the reference profile's canary",
        "load_seconds": 20,
        "drain": True,
    }
    base.update(over)
    return base


def test_first_run_stops_the_canary_instance_for_both_canaries_and_its_batch():
    out = outline(spec())
    assert out["canary_rule"] == CANARY_RULE
    stops = {(s["host"], s["instance"]): s for s in out["stops"]}
    assert set(stops) == {("gpu-1", "main"), ("gpu-3", "main")}, "only running instances stop"
    canary = stops[("gpu-1", "main")]
    # profiled canary, old unit, manual canary, old unit, new unit: 5 boots, 2 load tests
    assert (canary["boots"], canary["load_tests"], canary["seconds"], canary["estimate"]) == (5, 2, 5 * 40 + 2 * 20, "about")
    assert canary["drained"] is True
    assert (stops[("gpu-3", "main")]["boots"], stops[("gpu-3", "main")]["seconds"]) == (1, 40)
    assert stops[("gpu-3", "main")]["when"] == "batch 3"
    units = {(u["host"], u["unit"]): u["action"] for u in out["units"]}
    assert units == {("gpu-1", "vllm-main.service"): "replace", ("gpu-2", "vllm-main.service"): "create",
                     ("gpu-3", "vllm-main.service"): "replace", ("gpu-3", "vllm-side.service"): "replace"}
    text = "\n".join(outline_lines(out))
    assert "canary host gpu-1 (the first healthy host of the class by name)" in text
    assert "gpu-1: vllm-main.service is out of service for 5 engine boot(s) and 2 canary load test(s)" in text
    assert "about 240 s in all (drained first)" in text
    assert "units written new: gpu-2:vllm-main.service" in text


def test_a_known_profile_and_no_manual_canary_stop_only_the_batches():
    out = outline(spec(profiled_canary=False, manual_canary=False, canary_chosen=True))
    assert out["canary_rule"] == "gpufleet_canary_host"
    canary = next(s for s in out["stops"] if s["host"] == "gpu-1")
    assert (canary["boots"], canary["load_tests"], canary["when"]) == (1, 0, "batch 1")
    assert "no manual canary" in outline_lines(out)[0]


def test_without_a_measured_boot_the_timeout_is_the_upper_bound():
    out = outline(spec(boot_seconds=None, load_seconds=None, boot_timeout=600, profiled_canary=False))
    canary = next(s for s in out["stops"] if s["host"] == "gpu-1")
    # manual canary + old unit + new unit = 3 boots at most 600 s, one load test (30 s when none was measured)
    assert (canary["estimate"], canary["seconds"]) == ("at most", 3 * 600 + 30)
    assert "boot timeout 600 s is the upper bound" in outline_lines(out)[1]


def test_a_fleet_without_units_stops_nothing():
    hosts = {"gpu-1": [{"name": "main", "active_state": "inactive", "unit_exists": False}]}
    out = outline(spec(hosts=hosts, batches=[["gpu-1"]]))
    assert out["stops"] == []
    assert "no running instance stops" in "\n".join(outline_lines(out))


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"canary_host": ""}, "canary_host"),
        ({"canary_host": "gpu-9"}, "hosts"),
        ({"boot_seconds": "soon"}, "boot_seconds"),
        ({"boot_seconds": -1}, "boot_seconds"),
        ({"hosts": {"gpu-1": [{"active_state": "active"}]}}, r"hosts.gpu-1\[0\].name"),
        ({"batches": "gpu-1"}, "batches"),
    ],
)
def test_bad_input_names_the_field(over, field):
    with pytest.raises(FirstRunError, match=field):
        outline(spec(**over))

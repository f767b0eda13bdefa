# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A start's boot timeout: the inventory's, or derived from the class's measured canary boot."""

from __future__ import annotations

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._boot_check import (
    BOOT_TIMEOUT_FACTOR,
    BOOT_TIMEOUT_MIN_SECONDS,
    UNMEASURED_BOOT_TIMEOUT_SECONDS,
    boot_timeout,
)
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import EngineSpecError
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan_inputs import PlanError, parse_reference


def test_the_inventorys_timeout_wins():
    assert boot_timeout(1800, 600.0)[0] == 1800
    assert boot_timeout("900", None)[0] == 900
    assert boot_timeout(12.2, None)[0] == 13
    assert "set in the inventory" in boot_timeout(1800)[1]


def test_a_measured_boot_sets_it():
    seconds, why = boot_timeout(0, 412.4)
    assert seconds == 1238 == -(-(BOOT_TIMEOUT_FACTOR * 412.4) // 1)
    assert "412.4 s the class's profiled canary took" in why
    # a quick boot still gets the floor: a busier host or a cold compile cache is slower
    assert boot_timeout(0, 20.0)[0] == BOOT_TIMEOUT_MIN_SECONDS


def test_without_a_measurement_compilation_doubles_it():
    assert boot_timeout(0, None, False)[0] == UNMEASURED_BOOT_TIMEOUT_SECONDS[False] == 1800
    assert boot_timeout(0, None, True)[0] == UNMEASURED_BOOT_TIMEOUT_SECONDS[True] == 900
    assert boot_timeout(0, 0, "true")[0] == 900, "a boot of 0 s measured nothing"
    assert "not --enforce-eager" in boot_timeout(0)[1]


@pytest.mark.parametrize("bad", [-1, "soon", True, None, float("nan")])
def test_bad_timeouts_name_the_field(bad):
    with pytest.raises(EngineSpecError, match="vllm_service_boot_timeout"):
        boot_timeout(bad, None, False, "vllm_service_boot_timeout")


def _reference(canary):
    return {"ranks": [{"rank": 0, "free_bytes": 80 * 1024**3, "kv_bytes": 40 * 1024**3}], "canary": canary}


def test_the_reference_carries_the_canary_boot():
    assert parse_reference(_reference({"startup_seconds": 246.7}))["boot_seconds"] == 246.7
    assert parse_reference(_reference({}))["boot_seconds"] is None
    assert parse_reference(_reference(None))["boot_seconds"] is None
    with pytest.raises(PlanError, match=r"reference\.canary\.startup_seconds"):
        parse_reference(_reference({"startup_seconds": "slow"}))

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
"""canary_need: the one answer to "does the class run a profiled canary, and why" (parts/plan_classes.yml reads it)."""
from __future__ import annotations

import pytest

from ansible_collections.gpufleet.vllm.plugins.plugin_utils._class_plan import ClassPlanError, canary_need, class_states

CHANGED = {"status": "mismatch", "differences": [{"field": "driver_version", "reference": "550.1", "current": "570.2"},
                                                 {"field": "vllm_version", "reference": "0.32.0", "current": "0.33.0"}]}


@pytest.mark.parametrize(("query", "force", "canaries", "profiled", "plan_now", "why"), [
    ({"status": "found"}, False, True, False, True, ""),
    ({"status": "found"}, True, True, True, True, "a fresh profile was asked for (gpufleet_force_profile)"),
    ({"status": "missing"}, False, True, True, True, "no reference profile in the store yet"),
    ({"status": "missing"}, True, True, True, True, "a fresh profile was asked for (gpufleet_force_profile)"),
    (CHANGED, False, True, True, True,
     'the compatibility key changed: {"field": "driver_version", "reference": "550.1", "current": "570.2"}, '
     '{"field": "vllm_version", "reference": "0.32.0", "current": "0.33.0"}'),
    # a dry run (plan.yml) plans a class with a reference, and only that
    ({"status": "found"}, False, False, False, True, ""),
    ({"status": "missing"}, False, False, True, False, "no reference profile in the store yet"),
])
def test_a_profiled_canary_runs_when_the_store_has_no_reference_for_the_key_or_one_is_asked_for(query, force, canaries, profiled, plan_now, why):
    need = canary_need(query, "h200", force_profile=force, run_canaries=canaries)
    assert (need.profiled, need.plan_now, need.why) == (profiled, plan_now, why)
    assert need.reference_found is (query["status"] == "found")
    assert bool(need.dry_run_stop) is (not canaries and query["status"] != "found")


def test_a_dry_run_says_which_key_fields_moved():
    assert canary_need(CHANGED, "h200", force_profile=False, run_canaries=False).dry_run_stop == (
        "class h200 has no reference profile for its compatibility key (mismatch: driver_version, vllm_version); "
        "a rollout runs a profiled canary first")
    assert canary_need({"status": "missing"}, "l40s", force_profile=False, run_canaries=False).dry_run_stop == (
        "class l40s has no reference profile for its compatibility key (missing); a rollout runs a profiled canary first")


@pytest.mark.parametrize(("query", "message"), [
    ({"status": "stale"}, "profile query: status must be one of found, missing, mismatch, got 'stale'"),
    ({}, "profile query: status must be one of found, missing, mismatch, got None"),
    ({"status": "mismatch", "differences": "driver"}, "profile query: differences must be a list"),
    ([], "profile query: expected the result of gpufleet.vllm.kv_profile state=query"),
])
def test_a_lookup_that_kv_profile_does_not_return_is_named(query, message):
    with pytest.raises(ClassPlanError) as exc:
        canary_need(query, "h200", force_profile=False, run_canaries=True)
    assert str(exc.value).startswith(message)


def test_every_planned_class_keeps_the_state_its_first_host_holds():
    state = {"ok": True, "profile_path": "/store/h200/p1.json", "plan": {}}
    failed = {"ok": False, "failed": True, "reasons": ["class l40s stopped on l-1: ..."], "plan": {}}
    classes = class_states([("h-2", "h200", state), ("h-1", "h200", state), ("l-1", "l40s", failed), ("x-1", "gone", None)])
    assert classes["h200"] == dict(state, reference_id="p1.json")
    # a class whose canary failed keeps its failure (the artifact shows it not deployable, with its reasons)
    assert classes["l40s"] == dict(failed, reference_id=None)
    # a class whose hosts never got a state is still in the artifact, empty
    assert classes["gone"] == {"reference_id": None}

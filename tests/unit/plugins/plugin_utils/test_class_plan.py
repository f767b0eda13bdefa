# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
"""canary_need: the one answer to "does the class run a profiled canary, and why" (plays/plan_classes.yml reads it)."""
from __future__ import annotations

import re

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.filter.class_plan import class_state as class_state_filter
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._class_plan import ClassPlanError, canary_need, class_state, class_states

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


def test_a_planned_class_state_takes_its_plans_reasons_and_keeps_every_field():
    plan = {"decision": "budget", "reasons": ["budget from the weakest rank"], "launch": {"manual": True}}
    state = class_state("planned", "h200", deployable=True, plan=plan, key_hash="k1", profile_path="/store/h200/p.json",
                        compat={"model": "m"}, applied_plan="", manual_canary="pass", first_run={"lines": []}).as_dict()
    assert state == {"ok": True, "failed": False, "needs_profile": False, "plan": plan, "key_hash": "k1",
                     "reasons": ["budget from the weakest rank"], "profile_path": "/store/h200/p.json", "compat": {"model": "m"},
                     "applied_plan": "", "manual_canary": "pass", "first_run": {"lines": []}}
    assert class_state("planned", "h200", plan=plan, reasons=["refused"]).as_dict()["ok"] is False


def test_failed_dry_run_and_lost_classes_have_the_fields_they_always_had():
    failed = class_state("failed", "c", plan={"decision": "split"}, reasons=["class c stopped on h1: x: y"]).as_dict()
    assert failed == {"ok": False, "failed": True, "needs_profile": False, "plan": {"decision": "split"}, "key_hash": "",
                      "reasons": ["class c stopped on h1: x: y"]}
    dry = class_state("needs_profile", "c", key_hash="k2", reasons=["no reference"], first_run={"lines": ["a"]}).as_dict()
    assert dry == {"ok": False, "failed": False, "needs_profile": True, "plan": {}, "key_hash": "k2", "reasons": ["no reference"],
                   "first_run": {"lines": ["a"]}}
    lost = class_state("unfinished", "c", canary_host="h9").as_dict()
    assert lost["failed"] is True and lost["reasons"] == ["class c: the canary host h9 did not finish planning"]


@pytest.mark.parametrize(("outcome", "fields", "message"), [
    ("deployed", {}, "outcome must be one of planned, needs_profile, failed, unfinished, got 'deployed'"),
    ("planned", {"plan": ["not", "a", "plan"]}, "plan must be a mapping, got list"),
    ("planned", {"compat": "k"}, "compat must be a mapping, got str"),
    ("failed", {"reasons": "one text"}, "reasons must be a list of texts"),
])
def test_a_class_state_from_bad_inputs_names_the_field(outcome, fields, message):
    with pytest.raises(ClassPlanError, match=re.escape(message)):
        class_state(outcome, "c", **fields)


def test_the_class_state_filter_names_an_unknown_field():
    with pytest.raises(AnsibleFilterError, match="class_state: .*unexpected keyword argument 'plans'"):
        class_state_filter("planned", "c", plans={})

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
"""canary_need: the one answer to "does the class run a profiled canary, and why" (plays/plan_classes.yml reads it);
prepare_class: everything gpufleet.vllm.class_plan works out for a class before any host is touched; class_state."""
from __future__ import annotations

import os
import re

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.gpufleet.vllm.plugins.filter.class_plan import class_state as class_state_filter
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._boot_check import boot_timeout
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._serve_argv import EngineSpecError
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import from_plan
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._class_plan import ClassPlanError, canary_need, class_state, class_states, prepare_class
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._profile_store import ProfileStore
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._rollout import RolloutError, plan_artifact

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


# ---------------------------------------------------------------- prepare_class (gpufleet.vllm.class_plan)
KEY = {"model": "tiny-llama", "vllm_version": "0.32.0", "gpu_name": "NVIDIA H200", "total_bytes": 150754820096}
GIB = 1 << 30
PROFILE = {"ranks": [{"rank": 0, "free_bytes": 42 * GIB, "kv_bytes": 30 * GIB}], "total_bytes": 150754820096,
           "canary": {"startup_seconds": 42.5, "load": {"seconds": 10, "warmup_seconds": 2.5}}}


def _snapshot(state: str = "active", free: int = 42 * GIB) -> dict:
    return {"gpus": [{"index": 0, "boot_free_bytes": free}],
            "instances": [{"name": "main", "active_state": state, "unit_exists": True, "plan": {}}]}


def _prepare(store, **over):
    args = {"hosts": ["a", "b", "c"], "snapshots": {"a": _snapshot(), "b": _snapshot("inactive"), "c": _snapshot()},
            "canary_host": "b", "canary_instance": "main", "serial": [1, "50%"]}
    args.update(over)
    return prepare_class(store, "h200", KEY, **args)


@pytest.fixture(name="store")
def _store(tmp_path):
    return ProfileStore(str(tmp_path / "profiles"))


def test_a_class_with_a_reference_needs_no_profiled_canary_and_is_outlined_canary_first(store):
    recorded = store.record({"host_class": "h200", "compat": KEY, "profile": PROFILE})
    got = _prepare(store, boot_timeout=0, enforce_eager=True)
    assert got.reference["status"] == "found" and got.reference["profile"]["path"] == recorded["path"]
    assert got.key_hash == recorded["key_hash"] and got.compat == recorded["compat"]
    assert got.canary == canary_need({"status": "found"}, "h200", force_profile=False, run_canaries=True)
    assert got.plan_moved == []
    spec = got.first_run_spec
    assert spec["batches"] == [["b"], ["a"], ["c"]] and spec["canary_host"] == "b" and spec["manual_canary"] is None
    assert spec["hosts"]["b"] == _snapshot("inactive")["instances"]
    # the boot the reference's canary measured, and the timeout derived from it (one reading: _plan_inputs.boot_timeout_for)
    assert (spec["boot_seconds"], spec["load_seconds"], spec["boot_source"]) == (42.5, 12.5, "the reference profile's canary")
    assert spec["boot_timeout"] == boot_timeout(0, 42.5, True, "vllm_service_boot_timeout")[0]
    assert got.as_dict()["canary"]["profiled"] is False


def test_the_outline_and_the_batches_keep_the_class_budget(store):
    got = _prepare(store, serial=[1, "100%"], max_unavailable=1)
    assert got.refusal == [] and got.batches == [["b"], ["a"], ["c"]] and got.first_run_spec["batches"] == got.batches
    assert got.as_dict()["batches"] == got.batches and got.as_dict()["refusal"] == []


def test_a_budget_that_cannot_take_a_host_away_refuses_the_class_before_any_canary(store):
    got = _prepare(store, max_unavailable="10%")
    assert got.refusal == ["gpufleet_max_unavailable 10% of the class's 3 host(s) lets no host be away at once: not even the "
                           "canary host b can be rolled out (give at least one host)"]
    # no canary: nothing of the class runs
    assert (got.canary.profiled, got.canary.plan_now, got.canary.dry_run_stop) == (False, False, "")
    plan = {"format": 3, "instance": "main", "launch": {"manual": True, "expect": {"kv_cache_tokens": 65536}}}
    snapshots = {h: {"gpus": [], "instances": [{"name": "main", "active_state": "active", "plan": plan}]} for h in ("a", "b", "c")}
    got = _prepare(store, snapshots=snapshots, max_unavailable="50000 tokens")
    assert len(got.refusal) == 1 and "b serves (65536 KV-cache tokens)" in got.refusal[0] and got.canary.plan_now is False
    got = _prepare(store, snapshots=snapshots, max_unavailable="140000 tokens", serial=[1, "100%"])
    assert got.refusal == [] and got.batches == [["b"], ["a", "c"]]


def test_a_gang_of_the_class_is_batched_whole_and_a_budget_that_cannot_take_it_refuses_the_class(store):
    got = _prepare(store, serial=[1, "100%"], gangs=[["a", "c"]])
    assert got.refusal == [] and got.batches == [["b"], ["a", "c"]]
    got = _prepare(store, serial=[1], max_unavailable=1, gangs=[["c", "a"]])
    assert got.refusal == ["gpufleet_max_unavailable 1 lets 1 host(s) be away at once, but the instance over c, a stops all 2 of "
                           "its members together (a gang runs whole or not at all)"]
    assert got.canary.plan_now is False


def test_a_class_without_a_reference_runs_a_profiled_canary_and_knows_no_boot(store):
    got = _prepare(store, boot_timeout=600)
    assert got.reference["status"] == "missing" and got.canary.profiled and got.canary.why == "no reference profile in the store yet"
    spec = got.first_run_spec
    assert spec["profiled_canary"] is True and spec["boot_seconds"] is None and spec["boot_timeout"] == 600
    assert spec["boot_source"] == "the class's newest profile (another compatibility key)"


def test_a_changed_key_times_the_outline_with_the_newest_profile_of_the_class(store):
    store.record({"host_class": "h200", "compat": dict(KEY, vllm_version="0.31.0"), "profile": PROFILE})
    got = _prepare(store)
    assert got.reference["status"] == "mismatch" and "vllm_version" in got.canary.why
    assert got.first_run_spec["boot_seconds"] == 42.5


def test_a_dry_run_without_a_reference_says_it_stops(store):
    got = _prepare(store, run_canaries=False)
    assert not got.canary.plan_now and got.canary.dry_run_stop.startswith("class h200 has no reference profile")


def _approved(store, recorded):
    plan = {"decision": "deploy", "kv_cache_memory_bytes": 20 * GIB, "gpu_memory_utilization": 0.8, "kv_cache_tokens": 160000,
            "free_floor_bytes": {"0": 40 * GIB}}
    plan["launch"] = from_plan(plan)
    classes = {"h200": {"ok": True, "reasons": [], "key_hash": recorded["key_hash"], "compat": recorded["compat"],
                        "reference_id": os.path.basename(recorded["path"]), "plan": plan}}
    hosts = {h: {"class": "h200", "instances": [{"name": "main", "gpus": [0], "unit_checksum": f"sum-{h}"}],
                 "gpus": [{"index": 0, "boot_free_bytes": 42 * GIB}]} for h in ("a", "b", "c")}
    return plan_artifact(classes, hosts, "2026-12-01T10:00:00+00:00", [1, "50%"])


def test_an_approved_plan_holds_until_the_fleet_moves_or_a_fresh_profile_is_asked_for(store):
    recorded = store.record({"host_class": "h200", "compat": KEY, "profile": PROFILE})
    doc = _approved(store, recorded)
    assert _prepare(store, approved_plan=doc).plan_moved == []
    assert _prepare(store, approved_plan=doc, force_profile=True).plan_moved == ["gpufleet_force_profile would record a new reference profile"]
    low = {"a": _snapshot(), "b": _snapshot("inactive"), "c": _snapshot(free=40 * GIB - 1)}
    moved = _prepare(store, approved_plan=doc, snapshots=low).plan_moved
    assert len(moved) == 1 and moved[0].startswith("c main rank 0 (GPU 0): free memory") and "below the planned floor" in moved[0]


@pytest.mark.parametrize(("over", "error", "message"), [
    ({"canary_host": "z"}, ClassPlanError, "hosts: expected the class's hosts with the canary host z among them"),
    ({"snapshots": {"a": _snapshot(), "b": _snapshot()}}, ClassPlanError, "snapshots: no host snapshot of c"),
    ({"snapshots": {"a": _snapshot(), "b": {"instances": "main"}, "c": _snapshot()}}, ClassPlanError, "snapshots[b].instances"),
    ({"serial": [0]}, RolloutError, "serial"),
    ({"boot_timeout": -5}, EngineSpecError, "vllm_service_boot_timeout"),
])
def test_bad_inputs_name_the_field(store, over, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _prepare(store, **over)

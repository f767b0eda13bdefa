# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""rollout_report reads a rollout's hostvars itself (_report.run_data): what each class and host
contributes, and that a failed looped task names each failed item."""
from __future__ import annotations

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import plan_checksum
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._report import build_report, failure_message, run_data
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._report_render import render_markdown, summary_line

STATE = {"ok": True, "failed": False, "needs_profile": False, "plan": {}, "key_hash": "k1", "manual_canary": "pass", "reasons": []}


def fleet() -> tuple[dict, dict]:
    hostvars = {
        "localhost": {"gpufleet_run": {"started": "2026-12-02T10:00:00"}, "gpufleet_batches": [{"index": 1, "total": 1, "hosts": ["a", "b"]}]},
        # b is the class's canary host (gpufleet_canary_host), not its first by name
        "a": {"gpufleet_host_class": "l40s", "gpufleet_class_state": STATE, "gpufleet_canary_of_class": "b",
              "vllm_service_pending": [{"name": "main"}], "vllm_service_touched": True},
        "b": {"gpufleet_host_class": "l40s", "gpufleet_class_state": STATE, "gpufleet_canary_of_class": "b",
              "vllm_canary_result": {"verdict": "pass"}, "gpufleet_reference": {"profile": {"canary_result": {"verdict": "pass", "mode": "profiled"}}},
              "vllm_service_pending": [{"name": "main"}], "vllm_service_touched": True,
              "ansible_failed_result": {"msg": "One or more items failed", "results": [
                  {"failed": True, "msg": "vllm-main.service: boot check failed"}, {"failed": False, "msg": "ok"}]},
              "ansible_failed_task": {"name": "Start and check the new units", "args": {"msg": "{{ item }}"}}},
    }
    groups = {"gpufleet_rollout": ["a", "b"], "gpufleet_class_l40s": ["a", "b"]}
    return hostvars, groups


def test_the_run_data_of_a_rollout_with_a_failed_host():
    hostvars, groups = fleet()
    data = run_data(hostvars, groups)
    assert data["started"] == "2026-12-02T10:00:00+00:00"
    assert data["batches"] == [{"index": 1, "total": 1, "hosts": ["a", "b"]}]
    assert data["classes"]["l40s"]["canaries"] == {"profiled": {"verdict": "pass", "mode": "profiled"}, "manual": {"verdict": "pass"}}
    assert data["hosts"]["a"] == {"class": "l40s", "batch": 1, "pending": ["main"], "touched": True, "error": None, "failed_task": None,
                                  "rollback_failed": False, "rolled_back_with": None, "plans": []}
    assert data["hosts"]["b"]["error"] == "One or more items failed: vllm-main.service: boot check failed"
    assert data["hosts"]["b"]["failed_task"] == "Start and check the new units"
    report = build_report(data, "rollout")
    assert {h["host"]: h["outcome"] for h in report["hosts"]} == {"a": "deployed", "b": "rolled_back"}


def test_the_failed_task_is_read_untemplated_when_ansible_gives_raw_vars():
    hostvars, groups = fleet()
    templated = dict(hostvars)
    templated["b"] = {k: v for k, v in hostvars["b"].items() if k != "ansible_failed_task"}
    data = run_data(templated, groups, raw_vars=lambda host: hostvars[host])
    assert data["hosts"]["b"]["failed_task"] == "Start and check the new units"


def test_a_host_that_never_reached_a_batch_has_no_error_and_no_group_means_no_host():
    hostvars, groups = fleet()
    hostvars["localhost"]["gpufleet_batches"] = [{"index": 1, "total": 2, "hosts": ["a"]}]
    assert run_data(hostvars, groups)["hosts"]["b"]["error"] is None
    assert run_data(hostvars, groups)["hosts"]["b"]["batch"] is None
    hostvars["localhost"]["gpufleet_batches"] = [{"index": 1, "total": 1, "hosts": ["a", "b"]}]
    assert run_data(hostvars, {}) == {"started": "2026-12-02T10:00:00+00:00", "classes": {}, "hosts": {},
                                      "batches": [{"index": 1, "total": 1, "hosts": ["a", "b"]}], "lease": None}


def test_the_lease_and_an_expired_one_taken_over_are_in_the_report_data():
    hostvars, groups = fleet()
    hostvars["localhost"]["gpufleet_lease"] = {
        "leases": [{"scope": "l40s", "run_id": "r2", "owner": "ops@bastion"}],
        "taken_over": [{"scope": "l40s", "msg": "host class l40s: took over the expired lease of rollout run r1"}]}
    assert run_data(hostvars, groups)["lease"] == {"run_id": "r2", "owner": "ops@bastion", "classes": ["l40s"],
                                                   "taken_over": ["host class l40s: took over the expired lease of rollout run r1"]}
    # a host lease of the killed run, taken over in a batch, is named with its host
    hostvars["b"]["gpufleet_host_lease"] = {"leases": [{"scope": "host", "run_id": "r2"}],
                                            "taken_over": [{"scope": "host", "msg": "this host: took over the lease of rollout run r1"}]}
    assert run_data(hostvars, groups)["lease"]["taken_over"] == [
        "host class l40s: took over the expired lease of rollout run r1", "b: this host: took over the lease of rollout run r1"]


def test_the_report_records_the_checksum_and_key_of_each_plan_file_the_deploy_wrote():
    hostvars, groups = fleet()
    hostvars["localhost"]["gpufleet_batches"] = [{"index": 1, "total": 1, "hosts": ["a", "b"]}]
    plan = {"format": 3, "instance": "main", "compat_key_hash": "k1", "launch": {"kv_cache_memory_bytes": 1}}
    hostvars["a"]["vllm_service_pending"] = [{"name": "main"}]
    hostvars["a"]["vllm_service_rendered"] = [{"name": "main", "unit": "[Service]\n", "plan": plan},
                                              {"name": "other", "unit": "[Service]\n", "plan": dict(plan, instance="other")}]
    data = run_data(hostvars, groups)
    assert data["hosts"]["a"]["plans"] == [{"instance": "main", "checksum": plan_checksum(plan), "compat_key_hash": "k1"}]
    report = build_report(data)
    (entry,) = [h for h in report["hosts"] if h["host"] == "a"]
    assert entry["plans"] == data["hosts"]["a"]["plans"], "report.json keeps what the host's drop-in records"


def test_a_check_run_once_for_the_run_names_each_host_it_concerns():
    """plays/probe.yml's gang check fails once for the run; the hosts it concerns carry the message."""
    stop = "gpufleet_instances dsv3 span(s) hosts (a, b): ... not rolled out yet"
    hostvars = {"localhost": {"gpufleet_run": {"started": "2026-12-02T10:00:00"}},
                # a ran the check (run_once): its own failed result
                "a": {"gpufleet_host_class": "h100", "gpufleet_inputs_failed": True, "gpufleet_host_error": stop,
                      "ansible_failed_result": {"msg": stop}, "ansible_failed_task": {"name": "Check the gangs on their members"}},
                # b, the other member: no result of its own, the play's words
                "b": {"gpufleet_host_class": "h100", "gpufleet_inputs_failed": True, "gpufleet_host_error": stop},
                # c, no member: stopped with them, no failure of its own
                "c": {"gpufleet_host_class": "l40s", "gpufleet_inputs_failed": False, "gpufleet_host_error": ""}}
    data = run_data(hostvars, {"gpufleet_rollout": ["a", "b", "c"]})
    assert (data["hosts"]["a"]["error"], data["hosts"]["a"]["failed_task"]) == (stop, "Check the gangs on their members")
    assert (data["hosts"]["b"]["error"], data["hosts"]["b"]["failed_task"]) == (stop, None)
    assert data["hosts"]["c"]["error"] is None
    outcomes = {h["host"]: h["outcome"] for h in build_report(data, "rollout")["hosts"]}
    assert outcomes == {"a": "failed", "b": "failed", "c": "skipped"}


def test_a_class_rollback_is_reported_host_by_host():
    """gpufleet_on_failure: rollback_class: the hosts the class rollback restored are rolled back with the host that
    failed; a class rollback that stopped on a host leaves that host failed, naming why."""
    hostvars, groups = fleet()
    hostvars["c"] = {"gpufleet_host_class": "l40s", "vllm_service_pending": [{"name": "main"}], "vllm_service_touched": True}
    hostvars["d"] = {"gpufleet_host_class": "l40s", "vllm_service_pending": [{"name": "main"}], "vllm_service_touched": True}
    groups["gpufleet_rollout"] = [*groups["gpufleet_rollout"], "c", "d"]
    hostvars["localhost"]["gpufleet_batches"] = [{"index": 1, "total": 3, "hosts": ["c"]}, {"index": 2, "total": 3, "hosts": ["d"]},
                                                 {"index": 3, "total": 3, "hosts": ["a", "b"]}]
    hostvars["localhost"]["gpufleet_class_rolled_back"] = {"d": {"class": "l40s", "after": "b", "summary": "instance main: put back"}}
    hostvars["localhost"]["gpufleet_class_rollback_error"] = "c: Check the boot of each restarted unit failed: timed out"
    data = run_data(hostvars, groups)
    assert data["hosts"]["d"]["error"] == "rolled back with its class after b failed: instance main: put back"
    assert data["hosts"]["c"]["error"] == "its class rollback stopped here: c: Check the boot of each restarted unit failed: timed out"
    report = build_report(data, "rollout")
    outcomes = {h["host"]: h["outcome"] for h in report["hosts"]}
    assert outcomes == {"a": "deployed", "b": "rolled_back", "c": "failed", "d": "rolled_back"}
    # d did not fail itself: it is rolled back with b, not a failed host, and its batch is rolled back, not failed
    assert [h["rolled_back_with"] for h in report["hosts"]] == [None, None, None, "b"]
    assert report["failed_hosts"] == ["b", "c"]
    assert [b["outcome"] for b in report["batches"]] == ["failed", "rolled_back", "failed"]
    assert report["rolled_back"][-1]["with_class_after"] == "b"
    assert report["classes"][0]["final"] == {"state": "failed", "new_plan": ["a"], "previous": ["b", "d"], "failed": ["c"]}


def test_a_class_rolled_back_entirely_is_back_on_its_previous_plan():
    """The class's policy comes from its batches; a class whose every changed host was rolled back ends on its
    previous plan, and the summary says so."""
    hostvars, groups = fleet()
    hostvars["c"] = {"gpufleet_host_class": "l40s", "vllm_service_pending": [{"name": "main"}], "vllm_service_touched": True}
    groups["gpufleet_rollout"] = ["a", "b", "c"]
    hostvars["a"] = dict(hostvars["a"], vllm_service_touched=False)  # not reached: its batch never ran
    hostvars["localhost"]["gpufleet_batches"] = [
        {"index": 1, "total": 2, "class": "l40s", "hosts": ["c"], "on_failure": "rollback_class", "finished": "2026-12-02T10:01:00+00:00"},
        {"index": 2, "total": 2, "class": "l40s", "hosts": ["b"], "on_failure": "rollback_class"}]
    hostvars["localhost"]["gpufleet_class_rolled_back"] = {"c": {"class": "l40s", "after": "b", "summary": "instance main: put back"}}
    report = build_report(run_data(hostvars, groups), "rollout")
    cls = report["classes"][0]
    assert cls["on_failure"] == "rollback_class"
    assert cls["final"] == {"state": "previous_plan", "new_plan": [], "previous": ["a", "b", "c"], "failed": []}, cls["final"]
    assert summary_line(report).endswith("failed hosts b; class l40s is back on its previous plan"), summary_line(report)
    assert "| where its hosts ended | on its previous plan (previous plan: a, b, c) |" in render_markdown(report)
    assert "| on a failed host or bake | rollback_class |" in render_markdown(report)


def test_a_failed_bake_whose_rollback_failed_is_a_failed_host_with_both_errors():
    hostvars, groups = fleet()
    hostvars["b"].update(gpufleet_rollback_failed=True,
                         gpufleet_host_error="the bake failed: bake of 4 s ...: fail; its rollback failed: Check the boot failed: timed out")
    data = run_data(hostvars, groups)
    assert data["hosts"]["b"]["error"] == "the bake failed: bake of 4 s ...: fail; its rollback failed: Check the boot failed: timed out"
    assert {h["host"]: h["outcome"] for h in build_report(data, "rollout")["hosts"]}["b"] == "failed"


def test_the_host_s_own_failure_is_reported_even_when_a_class_rollback_ran_in_its_name():
    """A class rollback that fails runs its tasks in the failed host's name, which replaces that host's failed task
    and result: the failure the host kept before (gpufleet_own_failure) is what the report says."""
    hostvars, groups = fleet()
    hostvars["b"].update(ansible_failed_result={"msg": "Take the lease of the host again failed: held"},
                         gpufleet_own_failure={"task": "Start and check the new units", "msg": "vllm-main.service: boot check failed"})
    data = run_data(hostvars, groups)
    own = ("vllm-main.service: boot check failed", "Start and check the new units")
    assert (data["hosts"]["b"]["error"], data["hosts"]["b"]["failed_task"]) == own


def test_a_failed_command_is_named_by_its_own_words():
    # ansible.builtin.command says only that it exited non-zero: the end of its stderr, on one line, follows
    result = {"msg": "non-zero return code", "rc": 2, "stderr": "usage: x\nhaproxy refused: no such server\n"}
    assert failure_message(result) == "non-zero return code 2: usage: x haproxy refused: no such server"
    assert failure_message(dict(result, stderr="e" * 1000)) == "non-zero return code 2: ..." + "e" * 400
    assert failure_message({"msg": "non-zero return code", "stderr": "  "}) == "non-zero return code"
    looped = {"msg": "One or more items failed", "results": [{"failed": True, **result}, {"failed": True, "msg": "other"}]}
    assert failure_message(looped) == "non-zero return code 2: usage: x haproxy refused: no such server; other"
    assert failure_message({"msg": "the lease is held"}) == "the lease is held" and failure_message(None) == "no message"

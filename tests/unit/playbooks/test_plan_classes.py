# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The class state plays/plan_classes.yml keeps when a class stops.

The expressions are the ones in the playbook (read from its file and templated by
Ansible's own templar).
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import typing as t

import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from task_lookup import including, only, plays_tasks, running, setting, tasks_in  # pylint: disable=import-error

from ansible_collections.gpufleet.vllm.plugins.filter.class_plan import class_deploy_order
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._class_plan import class_state, deploy_order
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._rollout import class_batches

ROOT = pathlib.Path(__file__).resolve().parents[3]

SPLIT_PLAN = {
    "decision": "split",
    "kv_cache_memory_bytes": 27 * 2**30,
    "reasons": ["split outliers h3/main into their own class"],
    "split": [{"name": "c-main", "hosts": ["h1/main", "h2/main"], "kv_cache_memory_bytes": 31 * 2**30},
              {"name": "c-low", "hosts": ["h3/main"], "kv_cache_memory_bytes": 27 * 2**30}],
}


def test_every_class_state_is_built_by_the_class_state_filter() -> None:
    """The class state's one writer: every task that sets gpufleet_class_state calls gpufleet.vllm.class_state,
    one per outcome (its behaviour is unit tested in test_class_plan.py); found by what they set, not by name."""
    plays = yaml.safe_load((ROOT / "playbooks" / "plays" / "plan_classes.yml").read_text(encoding="utf-8"))
    expressions = [str(t["ansible.builtin.set_fact"]["gpufleet_class_state"]) for t in tasks_in(plays_tasks(plays))
                   if "gpufleet_class_state" in (t.get("ansible.builtin.set_fact") or {})]
    outcomes = sorted(re.search(r"'(\w+)' \| gpufleet\.vllm\.class_state\(", e).group(1) for e in expressions)
    assert outcomes == ["failed", "needs_profile", "planned", "planned", "unfinished"], expressions
    # a class refused before any host is touched (its capacity budget) is planned not deployable, for the refusal's reasons
    assert any("'planned' | gpufleet.vllm.class_state(gpufleet_host_class, key_hash=gpufleet_class_plan.key_hash,"
               in e and "reasons=gpufleet_class_plan.refusal" in e for e in expressions), expressions
    # a failed class keeps the plan made so far (the report shows it)
    assert any("'failed' | gpufleet.vllm.class_state(gpufleet_host_class, plan=kv_plan_result | default({})" in e for e in expressions)


def test_a_class_stopped_after_planning_keeps_its_plan() -> None:
    state = class_state("failed", "c", plan=SPLIT_PLAN, reasons=[
        "class c stopped on h1: Stop the class on a split (split_policy fail), class c: kv_plan: class c should be split"]).as_dict()
    assert state["ok"] is False and state["failed"] is True
    assert state["plan"] == SPLIT_PLAN
    assert state["reasons"] == ["class c stopped on h1: Stop the class on a split (split_policy fail), class c: "
                                "kv_plan: class c should be split"]


def test_a_class_stopped_before_planning_has_no_plan() -> None:
    state = class_state("failed", "c", plan=None, reasons=["class c stopped on h1: a task: no message"]).as_dict()
    assert state["plan"] == {}
    assert state["failed"] is True


def classes_in_rollout_order(variables: dict[str, t.Any]) -> t.Any:
    """The classes the playbook hands to gpufleet.vllm.rollout_batches (unit tested on its own),
    through the filter the playbook calls with the play's hostvars."""
    plays = yaml.safe_load((ROOT / "playbooks" / "plays" / "plan_classes.yml").read_text(encoding="utf-8"))
    expression = setting(plays_tasks(plays), "gpufleet_batch_plan")["ansible.builtin.set_fact"]["gpufleet_batch_plan"]
    assert "gpufleet.vllm.class_deploy_order(ansible_play_hosts, gpufleet_run.classes, gpufleet_run.plan)" in expression
    run = variables["gpufleet_run"]
    return class_deploy_order(variables["hostvars"], variables["ansible_play_hosts"], run["classes"], run.get("plan"))


def test_classes_follow_the_stated_order_and_leave_out_classes_that_do_not_deploy() -> None:
    def host(name: str, cls: str, ok: bool) -> dict[str, t.Any]:
        return {"inventory_hostname": name, "gpufleet_host_class": cls, "gpufleet_class_state": {"ok": ok}}

    hosts = [host("l-2", "l40s", True), host("h-1", "h200", True), host("l-1", "l40s", True), host("l-3", "l40s", True),
             host("x-1", "mixed", False), host("h-2", "h200", True)]
    classes = classes_in_rollout_order({
        "ansible_play_hosts": [h["inventory_hostname"] for h in hosts],
        "hostvars": {h["inventory_hostname"]: h for h in hosts},
        # the stated order: gpufleet_classes as given (l40s first), not by name
        "gpufleet_run": {"classes": ["l40s", "mixed", "h200"], "serial": [1, "50%"]},
    })
    assert [(c["class"], c["hosts"]) for c in classes] == [("l40s", ["l-1", "l-2", "l-3"]), ("h200", ["h-1", "h-2"])]
    # no class of these hosts gives a budget, and no host has a snapshot here: what it serves is not known
    assert all(c["max_unavailable"] is None and set(c["capacity"].values()) == {None} for c in classes)
    assert deploy_order({"a": {"host_class": "c", "ok": False}}, ["c"]) == []


def test_a_gang_of_a_class_is_handed_to_the_batches_leader_first() -> None:
    """The instance over two hosts of a class (given alike by both, as validate.yml checks) comes with its
    class's order, its members leader first, so rollout_batches keeps it in one batch."""
    gang = {"mode": "mp", "members": ["h-2", "h-3"], "leader": "h-3"}

    def host(name: str, member: bool) -> dict[str, t.Any]:
        instances = [{"name": "big", "gpus": [0], "port": 8000, "gang": gang}] if member else [{"name": "main", "gpus": [0], "port": 8000}]
        return {"inventory_hostname": name, "gpufleet_host_class": "h100", "gpufleet_class_state": {"ok": True},
                "gpufleet_serve_args": {"tensor_parallel_size": 2}, "gpufleet_instances": instances}

    hosts = [host("h-1", False), host("h-2", True), host("h-3", True)]
    classes = classes_in_rollout_order({
        "ansible_play_hosts": [h["inventory_hostname"] for h in hosts], "hostvars": {h["inventory_hostname"]: h for h in hosts},
        "gpufleet_run": {"classes": ["h100"], "serial": [1, "50%"]}})
    assert [(c["class"], c["hosts"], c["gangs"]) for c in classes] == [("h100", ["h-1", "h-2", "h-3"], [["h-3", "h-2"]])]
    assert [b["hosts"] for b in class_batches(classes, [1, 1])] == [["h-1"], ["h-3", "h-2"]]


def canary_host_note(task_name: str, variables: dict[str, t.Any]) -> str:
    tasks = yaml.safe_load((ROOT / "playbooks" / "tasks" / "canary_undrain.yml").read_text(encoding="utf-8"))
    # three tasks set the note, one per outcome; each test names the outcome it renders
    note = only(tasks, f"is named {task_name!r}", lambda task: task.get("name") == task_name)["ansible.builtin.set_fact"]["gpufleet_canary_host_note"]
    # __gpufleet_boot_timeout: the task's own var (vllm_service_boot_timeout through gpufleet.vllm.boot_timeout)
    variables = dict(variables, inventory_hostname="h1", vllm_canary_instance={"name": "main", "port": 8000},
                     __gpufleet_boot_timeout=120)
    return Templar(loader=DataLoader(), variables=variables).template(trust_as_template(note))


def test_a_canary_host_left_drained_says_why() -> None:
    running = canary_host_note("Note that the canary host stays drained",
                               {"vllm_canary_instance_serving": True})
    assert running == ("the canary host h1 stays drained (out of its load balancer): its production instance main "
                       "did not answer /health within 120 s; undrain it by hand once it serves again")
    stopped = canary_host_note("Note that the canary host stays drained",
                               {"vllm_canary_instance_serving": False})
    assert "its production instance main was not running before the canaries" in stopped
    back = canary_host_note("Note that the canary host is back in its load balancer", {})
    assert back == "the canary host h1 was undrained: its production instance main answers /health again on its previous unit"


def test_every_failed_class_can_give_its_drained_canary_host_back() -> None:
    plays = yaml.safe_load((ROOT / "playbooks" / "plays" / "plan_classes.yml").read_text(encoding="utf-8"))
    task = including(plays_tasks(plays), "../tasks/canary_undrain.yml")
    assert task in next(t for t in plays_tasks(plays) if "rescue" in t)["rescue"], "the undrain runs when the class fails"
    assert task["when"] == "gpufleet_canary_drained | default(false) | bool"


def test_the_canary_host_goes_first_in_its_class() -> None:
    def host(name: str, cls: str, canary: str) -> dict[str, t.Any]:
        return {"inventory_hostname": name, "gpufleet_host_class": cls, "gpufleet_class_state": {"ok": True},
                "gpufleet_canary_of_class": canary}

    hosts = [host("l-1", "l40s", "l-3"), host("l-2", "l40s", "l-3"), host("l-3", "l40s", "l-3"), host("h-1", "h200", "h-1")]
    classes = classes_in_rollout_order({
        "ansible_play_hosts": [h["inventory_hostname"] for h in hosts],
        "hostvars": {h["inventory_hostname"]: h for h in hosts},
        "gpufleet_run": {"classes": ["l40s", "h200"], "serial": [1]},
    })
    assert [(c["class"], c["hosts"]) for c in classes] == [("l40s", ["l-3", "l-1", "l-2"]), ("h200", ["h-1"])]


def test_the_class_plan_reads_each_hosts_snapshot() -> None:
    """gpufleet.vllm.class_plan gets every host of the class with its snapshot (plays/probe.yml's
    gpufleet.vllm.vllm_host_snapshot, whose reading of systemd is unit tested in test_host_snapshot); what it
    makes of them (the outline's unit states, an approved plan's floors) is unit tested in test_class_plan."""
    plays = yaml.safe_load((ROOT / "playbooks" / "plays" / "plan_classes.yml").read_text(encoding="utf-8"))
    task = running(plays_tasks(plays), "gpufleet.vllm.class_plan")
    h1 = {"gpus": [{"index": 0}], "instances": [{"name": "main", "active_state": "active", "unit_exists": True, "plan": {}}]}
    h2 = {"gpus": [{"index": 0}], "instances": [{"name": "main", "active_state": "inactive", "unit_exists": False, "plan": {}}]}
    templar = Templar(loader=DataLoader(), variables={
        "gpufleet_class_hosts": ["h1", "h2"],
        "hostvars": {"h1": {"gpufleet_probe_result": h1}, "h2": {"gpufleet_probe_result": h2}},
    })
    args = task["gpufleet.vllm.class_plan"]
    assert templar.template(trust_as_template(args["snapshots"])) == {"h1": h1, "h2": h2}
    assert templar.template(trust_as_template(args["hosts"])) == ["h1", "h2"]


def test_only_the_canary_hosts_run_the_canary_play() -> None:
    """The profile, plan and canary tasks run in a play of their own on the canary hosts: the other hosts of a
    class have nothing to skip there (the cost that grew with the fleet), and localhost keeps the run alive."""
    plays = yaml.safe_load((ROOT / "playbooks" / "plays" / "plan_classes.yml").read_text(encoding="utf-8"))
    canary_play = next(p for p in plays if any(t.get("name") == "Work out the class" for t in p["tasks"]))
    assert canary_play["hosts"] == "gpufleet_canaries:localhost"
    assert running(plays[0]["tasks"], "ansible.builtin.group_by")["ansible.builtin.group_by"]["key"] == "gpufleet_canaries"
    for play in plays:
        if play is not canary_play:
            assert not [t for t in play["tasks"] if "when" in t and "gpufleet_class_canary" in str(t["when"])
                        and t.get("name") != "Group the canary hosts"]


def test_the_class_state_writers_render_through_ansible(tmp_path) -> None:
    """The planning play's own set_fact tasks (read from its file), run by ansible-playbook on localhost with the
    inputs each outcome has: each record is the one class_state builds (real Jinja, real filter loading)."""
    sys.path.insert(0, str(ROOT / "tests" / "examples"))
    import doc_examples  # pylint: disable=import-outside-toplevel,import-error

    plays = yaml.safe_load((ROOT / "playbooks" / "plays" / "plan_classes.yml").read_text(encoding="utf-8"))
    writers = {t["name"]: t for t in tasks_in(plays_tasks(plays)) if "gpufleet_class_state" in (t.get("ansible.builtin.set_fact") or {})}
    plan = {"decision": "budget", "reasons": ["budget from the weakest rank"], "launch": {"manual": True}}
    common = {"gpufleet_host_class": "c", "gpufleet_class_canary": "h9", "kv_plan_result": plan, "kv_plan_deployable": True,
              "gpufleet_reference": {"key_hash": "k1", "path": "/s/c/p1.yml"},
              "vllm_canary_compat_key": {"model": "m"}, "gpufleet_run": {"plan": None}, "gpufleet_manual_canary_needed": True,
              "vllm_canary_result": {"verdict": "pass"},
              "gpufleet_class_plan": {"key_hash": "k1", "canary": {"dry_run_stop": "no reference"},
                                      "refusal": ["gpufleet_max_unavailable 10% of the class's 2 host(s) lets no host be away at once"],
                                      "first_run_spec": {
                  "host_class": "c", "canary_host": "h9", "canary_instance": "main", "profiled_canary": False,
                  "hosts": {"h9": []}, "batches": [["h9"]], "drain": False}},
              "ansible_failed_task": {"name": "Boot the canary engine (manual)"},
              "ansible_failed_result": {"msg": "vLLM canary (manual) did not boot"}}
    tasks = []
    for name, task in writers.items():
        fact = task["ansible.builtin.set_fact"]["gpufleet_class_state"].replace("hostvars[gpufleet_class_canary].gpufleet_class_state", "undefined_state")
        tasks.append({"name": name, "ansible.builtin.set_fact": {"gpufleet_class_state": fact}})
        keep = "{{ got | default({}) | combine({" + repr(name) + ": gpufleet_class_state}) }}"
        tasks.append({"name": f"Keep {name}", "ansible.builtin.set_fact": {"got": keep}})
    out = tmp_path / "states.json"
    tasks.append({"name": "Write them", "ansible.builtin.copy": {"dest": str(out), "content": "{{ got | to_json }}", "mode": "0644"}})
    playbook = [{"hosts": "localhost", "connection": "local", "gather_facts": False, "vars": common, "tasks": tasks}]
    tree = doc_examples.make_collections_tree(tmp_path / "collections")
    proc = doc_examples.run_playbook(playbook, tmp_path, tree)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    got = json.loads(out.read_text(encoding="utf-8"))
    planned = got["Keep the class state"]
    assert planned["ok"] is True and planned["reasons"] == plan["reasons"] and planned["manual_canary"] == "pass"
    assert (planned["key_hash"], planned["profile_path"], planned["applied_plan"], planned["compat"]) == ("k1", "/s/c/p1.yml", "", {"model": "m"})
    assert planned["first_run"]["canary_host"] == "h9"
    assert got["Keep the failure of the class"] == {
        "ok": False, "failed": True, "needs_profile": False, "plan": plan, "key_hash": "",
        "reasons": ["class c stopped on localhost: Boot the canary engine (manual): vLLM canary (manual) did not boot"]}
    dry = got["Stop here when a profile is needed but canaries are off (dry run)"]
    assert dry["needs_profile"] is True and dry["reasons"] == ["no reference"] and dry["key_hash"] == "k1"
    assert got["Take the class state from the canary host"]["reasons"] == ["class c: the canary host h9 did not finish planning"]
    refused = got["Refuse the class whose capacity budget cannot take a host away (before any host is touched)"]
    assert (refused["ok"], refused["failed"], refused["needs_profile"], refused["key_hash"]) == (False, False, False, "k1")
    assert refused["reasons"] == ["gpufleet_max_unavailable 10% of the class's 2 host(s) lets no host be away at once"]

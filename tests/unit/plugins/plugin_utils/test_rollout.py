# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Per-class batches and the approved plan artifact (plugins/plugin_utils/_rollout.py)."""

from __future__ import annotations

import copy
import re

import pytest
from hypothesis import given, strategies as st

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import LaunchError, for_instance, from_plan
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._analysis import bake_settings
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._rollout import (
    PLAN_FORMAT,
    Budget,
    RolloutError,
    budget_problems,
    check_artifact,
    class_batches,
    class_on_failure,
    class_rollback_hosts,
    class_settings_problems,
    host_capacity,
    parse_budget,
    gate_violations,
    plan_artifact,
    plan_drift,
    run_settings,
    serial_sizes,
    unit_drift,
)

GIB = 1024**3


def hosts(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(1, count + 1)]


def test_demo_fleet_ramps_every_class_from_one_host():
    # the demo's l40s-tp2 class of three hosts used to be deployed at once as the third share of the whole fleet
    batches = class_batches([["h200-tp1", hosts("h", 4)], ["l40s-tp2", hosts("l", 3)]], [1, "10%", "50%"])
    assert [(b["class"], b["class_index"], b["class_total"], len(b["hosts"])) for b in batches] == [
        ("h200-tp1", 1, 3, 1), ("h200-tp1", 2, 3, 1), ("h200-tp1", 3, 3, 2),
        ("l40s-tp2", 1, 3, 1), ("l40s-tp2", 2, 3, 1), ("l40s-tp2", 3, 3, 1),
    ]
    assert [b["index"] for b in batches] == list(range(1, 7))
    assert {b["total"] for b in batches} == {6}
    assert [b["class_first"] for b in batches] == [True, False, False, True, False, False]
    assert [b["class_last"] for b in batches] == [False, False, True, False, False, True]
    assert serial_sizes(batches) == [1, 1, 2, 1, 1, 1]


@pytest.mark.parametrize(
    "serial, count, sizes",
    [
        ([1, "10%", "50%"], 10, [1, 1, 5, 3]),
        ([1, "10%", "50%"], 100, [1, 10, 50, 39]),
        ([1, "10%", "50%"], 1, [1]),
        (2, 5, [2, 2, 1]),
        ("100%", 7, [7]),
        (["33.5%"], 3, [1, 1, 1]),
        ([1, 3], 8, [1, 3, 3, 1]),
    ],
)
def test_sizes_are_shares_of_the_class(serial, count, sizes):
    assert serial_sizes(class_batches([["c", hosts("c", count)]], serial)) == sizes


@pytest.mark.parametrize(
    "classes, serial, field",
    [
        ([["c", ["a"]]], [1, "0%"], "gpufleet_rollout_serial[1]"),
        ([["c", ["a"]]], [], "gpufleet_rollout_serial"),
        ([["c", ["a"]]], [True], "gpufleet_rollout_serial[0]"),
        ([["c", ["a"]], ["c", ["b"]]], 1, "classes[1].class"),
        ([["c", ["a"]], ["d", ["a"]]], 1, "classes[1].hosts"),
        ([["c", "a"]], 1, "classes[0].hosts"),
        ("c", 1, "classes"),
    ],
)
def test_bad_input_names_the_field(classes, serial, field):
    with pytest.raises(RolloutError, match="^" + re.escape(field) + ":"):
        class_batches(classes, serial)


@given(
    st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=5),
    st.lists(st.one_of(st.integers(min_value=1, max_value=20), st.integers(min_value=1, max_value=100).map(lambda n: f"{n}%")),
             min_size=1, max_size=4),
)
def test_batches_cover_every_host_once_in_order_never_mixing_classes(counts, serial):
    classes = [[f"k{i}", hosts(f"k{i}", n)] for i, n in enumerate(counts)]
    batches = class_batches(classes, serial)
    flat = [h for b in batches for h in b["hosts"]]
    assert flat == [h for _c, hs in classes for h in hs]
    for b in batches:
        assert {h.rsplit("-", 1)[0] for h in b["hosts"]} == {b["class"]}
        assert b["hosts"]
    # every class starts with a batch of the first serial entry's size (a share: at least one host)
    for name, hs in classes:
        first = next(b for b in batches if b["class"] == name)
        item = str(serial[0])
        want = max(1, int(float(item[:-1]) / 100 * len(hs))) if item.endswith("%") else int(item)
        assert len(first["hosts"]) == min(want, len(hs))


# ---------------------------------------------------------------- capacity budget
@pytest.mark.parametrize("value, budget", [
    (2, Budget("hosts", 2, "2")),
    ("3", Budget("hosts", 3, "3")),
    ("25%", Budget("share", 25.0, "25%")),
    ("12.5%", Budget("share", 12.5, "12.5%")),
    ("500000 tokens", Budget("tokens", 500000, "500000 tokens")),
    ("131072tokens", Budget("tokens", 131072, "131072tokens")),
    (None, None),
    ("", None),
])
def test_a_budget_is_hosts_a_share_or_tokens(value, budget):
    assert parse_budget(value) == budget


@pytest.mark.parametrize("value", [0, -1, True, "0%", "150%", "2 GiB", "tokens", "1.5", [2], {"hosts": 2}, "0 tokens"])
def test_a_bad_budget_names_the_field(value):
    with pytest.raises(RolloutError, match=r"^gpufleet_max_unavailable: "):
        parse_budget(value)


@pytest.mark.parametrize("budget, serial, sizes", [
    (2, [1, "50%"], [1, 2, 2, 2, 1]),        # the budget caps the 50 % batches
    ("25%", [1, "100%"], [1, 2, 2, 2, 1]),   # 25 % of 8 hosts: 2
    ("10%", [1, "50%"], None),               # 10 % of 8 hosts holds none: refused (budget_problems)
    (8, [1, "50%"], [1, 4, 3]),              # a budget above every batch changes nothing
    (None, [1, "50%"], [1, 4, 3]),
])
def test_no_batch_takes_more_hosts_away_than_the_budget(budget, serial, sizes):
    members = hosts("l", 8)
    problems = budget_problems(parse_budget(budget), members)
    if sizes is None:
        assert problems == ["gpufleet_max_unavailable 10% of the class's 8 host(s) lets no host be away at once: not even the "
                            "canary host l-1 can be rolled out (give at least one host)"]
        return
    assert problems == []
    batches = class_batches([{"class": "l40s", "hosts": members, "max_unavailable": budget}], serial)
    assert [len(b["hosts"]) for b in batches] == sizes
    assert [h for b in batches for h in b["hosts"]] == members


def test_a_token_budget_counts_what_each_host_serves():
    members = hosts("l", 5)
    capacity = {"l-1": 100_000, "l-2": 100_000, "l-3": 50_000, "l-4": 0, "l-5": 200_000}
    batches = class_batches([{"class": "l40s", "hosts": members, "max_unavailable": "200000 tokens", "capacity": capacity}], [1, "100%"])
    assert [b["hosts"] for b in batches] == [["l-1"], ["l-2", "l-3", "l-4"], ["l-5"]]
    for b in batches:
        assert sum(capacity[h] for h in b["hosts"]) <= 200_000
    # a host that serves more than the budget can never go within it: the class is refused, naming it
    assert budget_problems(parse_budget("150000 tokens"), members, capacity) == [
        "gpufleet_max_unavailable 150000 tokens is less than what l-5 serves (200000 KV-cache tokens): that host can never be "
        "taken away within the budget"]
    assert budget_problems(parse_budget("150000 tokens"), ["l-5", "l-1"], capacity)[0].endswith("(the canary host)")


def test_a_gang_is_one_unit_of_a_batch_never_split_and_counted_once():
    """An instance over several hosts rolls out whole: its members in one batch, leader first, where its first
    member comes in the class's order; the serial sizes count it once, a host budget counts its members."""
    members = hosts("h", 7)
    gangs = [["h-3", "h-2"], ["h-5", "h-6", "h-7"]]
    batches = class_batches([{"class": "h100", "hosts": members, "gangs": gangs}], [1, 2, "100%"])
    assert [b["hosts"] for b in batches] == [["h-1"], ["h-3", "h-2", "h-4"], ["h-5", "h-6", "h-7"]]
    assert [b["gangs"] for b in batches] == [[], [["h-3", "h-2"]], [["h-5", "h-6", "h-7"]]]
    # a budget of 3 hosts takes the 3-member gang alone; one of 2 can never take it: refused, naming it
    batches = class_batches([{"class": "h100", "hosts": members, "gangs": gangs, "max_unavailable": 3}], ["100%"])
    assert [b["hosts"] for b in batches] == [["h-1", "h-3", "h-2"], ["h-4"], ["h-5", "h-6", "h-7"]]
    assert budget_problems(parse_budget(3), members, gangs=gangs) == []
    assert budget_problems(parse_budget(2), members, gangs=gangs) == [
        "gpufleet_max_unavailable 2 lets 2 host(s) be away at once, but the instance over h-5, h-6, h-7 stops all 3 of its "
        "members together (a gang runs whole or not at all)"]
    # a token budget counts what every member serves
    capacity = dict.fromkeys(members, 100)
    batches = class_batches([{"class": "h100", "hosts": members, "gangs": gangs, "max_unavailable": "300 tokens",
                              "capacity": capacity}], ["100%"])
    assert [b["hosts"] for b in batches] == [["h-1", "h-3", "h-2"], ["h-4"], ["h-5", "h-6", "h-7"]]
    assert budget_problems(parse_budget("250 tokens"), members, capacity, gangs)[0].startswith(
        "gpufleet_max_unavailable 250 tokens is less than what the gang h-5 + h-6 + h-7 serves (300 KV-cache tokens)")
    # without gangs nothing changes: no gangs key on the batches
    assert all("gangs" not in b for b in class_batches([{"class": "h100", "hosts": members}], [1, "100%"]))


@pytest.mark.parametrize(("gangs", "message"), [
    ("h-1", "classes[0].gangs: expected a list of gangs"),
    ([["h-1"]], "classes[0].gangs[0]: expected two or more distinct member hosts"),
    ([["h-1", "h-1"]], "classes[0].gangs[0]: expected two or more distinct member hosts"),
    ([["h-1", "x-9"]], "classes[0].gangs[0]: x-9 of the gang h-1, x-9 is/are not rolled out with the class"),
    ([["h-1", "h-2"], ["h-2", "h-3"]], "classes[0].gangs[1]: h-2 is also a member of classes[0].gangs[0]"),
])
def test_a_bad_gang_of_a_class_names_the_field(gangs, message):
    with pytest.raises(RolloutError) as exc:
        class_batches([{"class": "h100", "hosts": hosts("h", 3), "gangs": gangs}], [1])
    assert str(exc.value).startswith(message), str(exc.value)


def test_a_host_whose_capacity_is_not_known_goes_alone_under_a_token_budget():
    members = hosts("l", 4)
    capacity = {"l-1": 10, "l-2": None, "l-3": 10, "l-4": 10}
    batches = class_batches([{"class": "l40s", "hosts": members, "max_unavailable": "100 tokens", "capacity": capacity}], [1, "100%"])
    assert [b["hosts"] for b in batches] == [["l-1"], ["l-2"], ["l-3", "l-4"]]
    assert budget_problems(parse_budget("5 tokens"), ["l-2"], capacity) == []
    # a share rounds down in decimal: 29 % of 100 hosts is 29 (not 28.999...)
    assert parse_budget("29%").hosts(100) == 29


def test_what_a_host_serves_is_its_active_instances_planned_tokens():
    def plan(tokens):  # a plan record as the deploy writes it (format 3: the figures in launch.expect)
        return {"format": 3, "instance": "main", "launch": {"manual": True, "expect": {"kv_cache_tokens": tokens}}}

    snapshot = {"instances": [{"name": "a", "active_state": "active", "plan": plan(100)},
                              {"name": "b", "active_state": "inactive", "plan": plan(1000)},
                              {"name": "d", "active_state": "active", "plan": {"kv_cache_tokens": 20}}]}  # an older flat record
    assert host_capacity(snapshot) == 120 and host_capacity({}) == 0
    # an active instance whose record gives no figure (auto_profile, a hand-written unit): not known
    unknown = {"instances": [{"name": "a", "active_state": "active", "plan": {"format": 3, "launch": {"manual": False}}}]}
    assert host_capacity(unknown) is None


def test_a_class_gives_its_settings_once_and_valid():
    hv = {"a": {"gpufleet_host_class": "l40s", "gpufleet_max_unavailable": 2},
          "b": {"gpufleet_host_class": "l40s", "gpufleet_max_unavailable": 2},
          "c": {"gpufleet_host_class": "h200", "gpufleet_max_unavailable": "0%"},
          "d": {"gpufleet_host_class": "h100", "gpufleet_max_unavailable": None},
          "e": {"gpufleet_host_class": "h100", "gpufleet_max_unavailable": "1"}}
    assert class_settings_problems(hv) == [
        "class h100: its hosts give different gpufleet_max_unavailable (d: None; e: '1'); set it once in the class's group variables",
        "class h200: gpufleet_max_unavailable: expected hosts (2), a share of the class's hosts ('25%') or KV-cache tokens "
        "('500000 tokens'), got '0%'"]
    # the bake settings: the same on every host of a class, and valid
    bake = {"a": {"gpufleet_host_class": "l40s", "gpufleet_bake_seconds": 300},
            "b": {"gpufleet_host_class": "l40s", "gpufleet_bake_seconds": 60},
            "c": {"gpufleet_host_class": "h200", "gpufleet_bake_seconds": 60, "gpufleet_analysis_inconclusive": "ignore"},
            "d": {"gpufleet_host_class": "h100", "gpufleet_bake_seconds": "", "gpufleet_analysis": {"itl_p90": {"max_ratio": 1.2}}}}
    assert class_settings_problems(bake) == [
        "class h200: gpufleet_analysis_inconclusive: expected one of fail, pass, got 'ignore'",
        "class l40s: its hosts give different gpufleet_bake_seconds (a: 300; b: 60); set it once in the class's group variables"]
    assert class_settings_problems({"a": {"gpufleet_host_class": "l40s", "gpufleet_on_failure": "rollback"}}) == [
        "class l40s: gpufleet_on_failure: expected one of stop, rollback_class, got 'rollback'"]


def test_a_class_model_config_is_read_as_its_profiled_canary_reads_it_before_any_host_is_touched(tmp_path):
    good = tmp_path / "config.json"
    good.write_text('{"model_type": "llama"}', encoding="utf-8")
    (tmp_path / "list.json").write_text("[1]", encoding="utf-8")
    (tmp_path / "text.json").write_text("not json", encoding="utf-8")
    hv = {"a1": {"gpufleet_host_class": "a", "gpufleet_model_config": str(good)},
          "b1": {"gpufleet_host_class": "b", "gpufleet_model_config": str(tmp_path / "missing.json")},
          "b2": {"gpufleet_host_class": "b", "gpufleet_model_config": str(tmp_path / "missing.json")},
          "c1": {"gpufleet_host_class": "c", "gpufleet_model_config": str(tmp_path / "list.json")},
          "c2": {"gpufleet_host_class": "c", "gpufleet_model_config": {"model_type": "llama"}},
          "d1": {"gpufleet_host_class": "d", "gpufleet_model_config": str(tmp_path / "text.json")},
          "e1": {"gpufleet_host_class": "e", "gpufleet_model_config": 3},
          # unset, blank (an AWX answer), a mapping, and a relative path the canary's role finds in its files/
          "f1": {"gpufleet_host_class": "f"}, "f2": {"gpufleet_host_class": "f", "gpufleet_model_config": ""},
          "f3": {"gpufleet_host_class": "f", "gpufleet_model_config": None},
          # false values: the canary reads the model's config from the host (its default('', true))
          "f4": {"gpufleet_host_class": "f", "gpufleet_model_config": False}, "f5": {"gpufleet_host_class": "f", "gpufleet_model_config": []},
          "g1": {"gpufleet_host_class": "g", "gpufleet_model_config": "models/config.json"},
          "h1": {"gpufleet_host_class": "h", "gpufleet_model_config": str(tmp_path)}}
    problems = class_settings_problems(hv)
    assert problems[:2] == [
        f"class b: gpufleet_model_config: cannot read {tmp_path / 'missing.json'}: No such file or directory",
        f"class c: gpufleet_model_config ({tmp_path / 'list.json'}): expected a JSON object (the model's config.json), got list "
        "(on c1)"]
    assert problems[2].startswith(f"class d: gpufleet_model_config ({tmp_path / 'text.json'}): not JSON: "), problems
    assert problems[3:] == ["class e: gpufleet_model_config: expected a mapping or a controller path, got int",
                            f"class h: gpufleet_model_config: cannot read {tmp_path}: Is a directory"]
    # the run's classes only: another class's file is not this run's concern
    assert class_settings_problems(hv, ["a", "e"]) == ["class e: gpufleet_model_config: expected a mapping or a controller path, got int"]


def test_a_class_whose_serve_args_hold_a_secret_is_refused_before_its_canary_runs():
    hv = {"a1": {"gpufleet_host_class": "a", "gpufleet_serve_args": {"api_key": "k-secret", "max_model_len": 8192}},
          "a2": {"gpufleet_host_class": "a", "gpufleet_serve_args": {"api_key": "k-secret", "max_model_len": 8192}},
          "b1": {"gpufleet_host_class": "b", "gpufleet_serve_args": {"max_model_len": 8192}},
          "b2": {"gpufleet_host_class": "b", "gpufleet_serve_args": {"hf_token": "hf-secret"}}}
    problems = class_settings_problems(hv)
    assert problems == [
        "class a: gpufleet_serve_args api_key would put a secret on the unit's command line (a world-readable unit file, "
        "/proc/PID/cmdline, diffs in logs); set it in vllm_service_secret_env instead (for example VLLM_API_KEY for api_key, "
        "HF_TOKEN for hf_token), which is written to a root-only EnvironmentFile",
        "class b: gpufleet_serve_args hf_token would put a secret on the unit's command line (a world-readable unit file, "
        "/proc/PID/cmdline, diffs in logs); set it in vllm_service_secret_env instead (for example VLLM_API_KEY for api_key, "
        "HF_TOKEN for hf_token), which is written to a root-only EnvironmentFile (on b2)"]
    assert "k-secret" not in repr(problems) and "hf-secret" not in repr(problems)
    # serve args given as JSON text (the argument spec's dict type and the canary take it), whatever the run's classes
    text = {"c1": {"gpufleet_host_class": "c", "gpufleet_serve_args": '{"api_key": "k-secret"}'}}
    assert class_settings_problems(text, ["other"]) == [
        "class c: gpufleet_serve_args api_key would put a secret on the unit's command line (a world-readable unit file, "
        "/proc/PID/cmdline, diffs in logs); set it in vllm_service_secret_env instead (for example VLLM_API_KEY for api_key, "
        "HF_TOKEN for hf_token), which is written to a root-only EnvironmentFile"]


def test_a_class_whose_service_user_is_root_is_refused_before_its_canary_drains_a_host():
    hv = {"a1": {"gpufleet_host_class": "a", "vllm_service_user": "root"}, "a2": {"gpufleet_host_class": "a"},
          "b1": {"gpufleet_host_class": "b", "vllm_service_user": "vllm"}, "b2": {"gpufleet_host_class": "b", "vllm_service_user": ""}}
    assert class_settings_problems(hv) == [
        "class a: vllm_service_user: must not be root; vLLM runs as an unprivileged system user (for example vllm) (on a1)"]


def test_a_class_rollback_restores_the_earlier_batches_latest_first():
    batches = [{"class": "a", "hosts": ["a1"]}, {"class": "a", "hosts": ["a2", "a3", "a4"]}, {"class": "b", "hosts": ["b1"]},
               {"class": "a", "hosts": ["a5"]}]
    changed = {"a1": True, "a2": True, "a3": False, "a4": True, "b1": True, "a5": True}
    # the running batch's failing host (a5) rolls itself back; a3 did not change; b is another class
    assert class_rollback_hosts(batches, changed, {"a5"}) == ["a4", "a2", "a1"]
    assert class_rollback_hosts(batches[:1], changed, {"a1"}) == [] and class_rollback_hosts([], changed) == []
    # a running batch of several hosts: the ones that passed come first, latest first
    assert class_rollback_hosts(batches[:2], changed, {"a2"}) == ["a4", "a1"]
    assert class_rollback_hosts(batches[:2], changed, {"a2", "a4"}) == ["a1"]
    # a host of the running batch no longer in it (unreachable) is left out: the earlier batches are still restored
    assert class_rollback_hosts(batches[:2], changed, {"a2"}, active={"a2", "a3"}) == ["a1"]
    assert class_rollback_hosts(batches[:2], changed, {"a2"}, active={"a2", "a3", "a4"}) == ["a4", "a1"]


def test_a_class_rollback_restores_a_gang_and_checks_its_boots_last():
    """A gang's members come in the class rollback's order, next to each other: each is restored and restarted in turn,
    and their boots are checked once every host was restored (``gangs_only``: those members); a failing gang rolls
    back in its members' own rescues."""
    batches = [{"class": "a", "hosts": ["g1", "g2"]}, {"class": "a", "hosts": ["a3"]}, {"class": "a", "hosts": ["g3", "g4", "a5"]}]
    changed = dict.fromkeys(["g1", "g2", "a3", "g3", "g4", "a5"], True)
    gangs = {"g1", "g2", "g3", "g4"}
    assert class_rollback_hosts(batches, changed, {"a5"}, gang_members=gangs) == ["g4", "g3", "a3", "g2", "g1"]
    assert class_rollback_hosts(batches, changed, {"a5"}, gang_members=gangs, gangs_only=True) == ["g4", "g3", "g2", "g1"]
    # the failing gang of the running batch is no one's to restore here; a5 that passed is
    assert class_rollback_hosts(batches, changed, {"g3", "g4"}, gang_members=gangs) == ["a5", "a3", "g2", "g1"]
    assert class_rollback_hosts(batches, changed, {"g3", "g4"}, gang_members=gangs, gangs_only=True) == ["g2", "g1"]


def test_every_batch_of_a_class_carries_its_bake():
    bake = bake_settings(120, {"itl_p90": {"max_ratio": 1.3}})
    batches = class_batches([{"class": "l40s", "hosts": ["l1", "l2", "l3"], "bake": bake}, {"class": "h200", "hosts": ["h1"]}],
                            [1, "100%"])
    assert [(b["class"], b["bake"]) for b in batches] == [("l40s", bake), ("l40s", bake), ("h200", None)]
    # unset: a plan made now rolls the class back (class_on_failure resolves it before, from the inventory or the plan)
    assert {b["on_failure"] for b in batches} == {"rollback_class"}
    batches = class_batches([{"class": "l40s", "hosts": ["l1"], "on_failure": "rollback_class"}], 1)
    assert batches[0]["on_failure"] == "rollback_class"
    with pytest.raises(RolloutError, match=r"classes\[0\].on_failure: expected one of stop, rollback_class, got 'undo'"):
        class_batches([{"class": "l40s", "hosts": ["l1"], "on_failure": "undo"}], 1)
    with pytest.raises(RolloutError, match=r"classes\[0\].bake: expected the class's bake settings"):
        class_batches([{"class": "l40s", "hosts": ["l1"], "bake": {"seconds": "2m"}}], 1)


# ---------------------------------------------------------------- plan artifact
def artifact() -> dict:
    classes = {
        "l40s": {"ok": True, "reasons": [], "key_hash": "k1", "compat": {"model": "m", "dtype": "bfloat16"},
                 "reference_id": "l40s/20261201T100000Z.yml",
                 "plan": {"decision": "deploy", "kv_cache_memory_bytes": 20 * GIB, "gpu_memory_utilization": 0.8,
                          "kv_cache_tokens": 160000, "free_floor_bytes": {"0": 40 * GIB, "1": 41 * GIB}}},
    }
    # the planner's result carries its launch record, which the artifact's figures come from
    classes["l40s"]["plan"]["launch"] = from_plan(classes["l40s"]["plan"])
    host_facts = {
        h: {"class": "l40s", "instances": [{"name": "main", "gpus": [0, 1], "unit_checksum": f"sum-{h}"}],
            "gpus": [{"index": 0, "boot_free_bytes": 42 * GIB}, {"index": 1, "boot_free_bytes": 42 * GIB}]}
        for h in ("a", "b")
    }
    return plan_artifact(classes, host_facts, "2026-12-01T10:00:00+00:00", [1, "50%"])


def test_artifact_class_verdict_is_the_class_state_not_the_plans_copy():
    """A class planned deployable whose manual canary then failed is not deployable in the artifact."""
    plan = {"decision": "deploy", "deployable": True, "kv_cache_memory_bytes": GIB, "gpu_memory_utilization": 0.5}
    plan["launch"] = from_plan(plan)
    doc = plan_artifact({"c": {"ok": False, "reasons": ["manual canary failed"], "plan": plan}}, {}, "2026-12-01T10:00:00+00:00")
    assert doc["classes"]["c"]["deployable"] is False
    assert "deployable" not in doc["classes"]["c"]["plan"]


def current(**over) -> dict:
    now = {"key_hash": "k1", "compat": {"model": "m", "dtype": "bfloat16"}, "reference_id": "l40s/20261201T100000Z.yml",
           "hosts": {h: [{"index": 0, "boot_free_bytes": 42 * GIB}, {"index": 1, "boot_free_bytes": 42 * GIB}] for h in ("a", "b")}}
    now.update(over)
    return now


def test_artifact_keeps_what_an_apply_checks():
    doc = artifact()
    assert doc["format"] == PLAN_FORMAT
    cls = doc["classes"]["l40s"]
    assert cls["kv_cache_memory_bytes"] == 20 * GIB and cls["free_floor_bytes"] == {"0": 40 * GIB, "1": 41 * GIB}
    assert cls["gpu_memory_utilization"] == 0.8 and cls["kv_cache_tokens"] == 160000
    assert cls["plan"]["launch"]["expect"]["reserved_bytes"] == 20 * GIB
    assert cls["hosts"] == ["a", "b"] and cls["key_hash"] == "k1" and cls["reference_id"].endswith(".yml")
    assert doc["hosts"]["a"]["instances"][0]["unit_checksum"] == "sum-a"
    assert doc["hosts"]["b"]["boot_free_bytes"] == {"0": 42 * GIB, "1": 42 * GIB}
    assert check_artifact(doc) == doc


def test_nothing_moved():
    assert plan_drift(artifact(), "l40s", current()) == []
    assert unit_drift(artifact(), "a", [{"name": "main", "unit_checksum": "sum-a"}]) == []


def test_free_memory_below_the_planned_floor_is_named():
    now = current()
    now["hosts"]["b"][1]["boot_free_bytes"] = 41 * GIB - 1
    moved = plan_drift(artifact(), "l40s", now)
    assert moved == [f"b main rank 1 (GPU 1): free memory 41GiB ({41 * GIB - 1}) is below the planned floor 41GiB ({41 * GIB}); "
                     f"it was 42GiB ({42 * GIB}) when planned"]
    # on the floor is still safe
    now["hosts"]["b"][1]["boot_free_bytes"] = 41 * GIB
    assert plan_drift(artifact(), "l40s", now) == []


def test_a_gang_members_free_memory_is_held_against_the_floors_of_its_own_ranks():
    """Hosts a and b run one instance over both (ranks 0-1 on a, 2-3 on b): b's GPU 1 is the gang's rank 3."""
    doc = artifact()
    plan = doc["classes"]["l40s"]["plan"]
    plan["launch"]["free_floor_bytes"] = {"0": 40 * GIB, "1": 40 * GIB, "2": 40 * GIB, "3": 42 * GIB + 1}
    plan["per_rank"] = [{"host": "a/main", "rank": r, "member": "ab"[r // 2], "gpu": r % 2} for r in range(4)]
    assert plan_drift(doc, "l40s", current()) == [
        f"b main rank 1 (GPU 1): free memory 42GiB ({42 * GIB}) is below the planned floor 42GiB ({42 * GIB + 1}); "
        f"it was 42GiB ({42 * GIB}) when planned"]


def test_key_reference_and_hosts_that_moved_are_named():
    moved = plan_drift(artifact(), "l40s", current(key_hash="k2", compat={"model": "m", "dtype": "float16"},
                                                   reference_id="l40s/20261202T100000Z.yml",
                                                   hosts={"a": current()["hosts"]["a"], "c": []}))
    assert moved[0] == "class l40s: the compatibility key changed (dtype: 'bfloat16' -> 'float16')"
    assert moved[1] == "class l40s: the reference profile changed (l40s/20261201T100000Z.yml -> l40s/20261202T100000Z.yml)"
    assert "class l40s: hosts not in the approved plan: c" in moved
    assert "class l40s: planned hosts missing from this run: b" in moved


def test_class_missing_or_not_deployable():
    assert plan_drift(artifact(), "h200", current()) == ["class h200 is not in the approved plan (it has l40s)"]
    doc = copy.deepcopy(artifact())
    doc["classes"]["l40s"].update(deployable=False, decision="refuse", reasons=["GPU name differs"])
    assert plan_drift(doc, "l40s", current()) == ["class l40s was not deployable in the approved plan (refuse): GPU name differs"]


def test_unit_drift_names_the_instance():
    assert unit_drift(artifact(), "a", [{"name": "main", "unit_checksum": "other"}]) == [
        "a: the unit of instance main differs from the approved plan (checksum sum-a planned, other now)"]
    assert unit_drift(artifact(), "a", [{"name": "main", "unit_checksum": "sum-a"}, {"name": "extra", "unit_checksum": "x"}]) == [
        "a: instance extra is not in the approved plan"]
    assert unit_drift(artifact(), "z", []) == ["z is not in the approved plan"]


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.update(format="other"), "gpufleet_plan.format"),
        (lambda d: d.update(classes=[]), "gpufleet_plan.classes"),
        (lambda d: d["classes"]["l40s"].pop("plan"), "gpufleet_plan.classes.l40s.plan"),
        (lambda d: d["classes"]["l40s"]["plan"].pop("launch"), "gpufleet_plan.classes.l40s.plan.launch"),
        (lambda d: d["hosts"]["a"].update(instances=None), "gpufleet_plan.hosts.a.instances"),
    ],
)
def test_malformed_artifact_names_the_field(mutate, field):
    doc = copy.deepcopy(artifact())
    mutate(doc)
    with pytest.raises(RolloutError, match=f"^{field}:"):
        check_artifact(doc)
    with pytest.raises(RolloutError):
        check_artifact("not a plan")


# ---------------------------------------------------------------- the free-memory gate
def gpu(index: int, free: int, total: int = 80 * GIB, processes: list | None = None) -> dict:
    return {"index": index, "total_bytes": total, "boot_free_bytes": free, "processes": processes or []}


def launch(plan: dict, default_utilization: float = 0.9) -> dict:
    """The launch record a deploy gates with: a manual plan's budget and utilization, the floors given."""
    figures = {"kv_cache_memory_bytes": 8 * GIB, "gpu_memory_utilization": 0.5} if plan["decision"] != "auto_profile" else {}
    return for_instance({**figures, **plan}, default_utilization)


MANUAL = launch({"decision": "deploy", "free_floor_bytes": {"0": 40 * GIB, "1": 40 * GIB}})


def test_the_gate_passes_at_the_floor_and_names_each_rank_below_it():
    inst = [{"name": "main", "gpus": [0, 1]}]
    assert gate_violations([gpu(0, 40 * GIB), gpu(1, 41 * GIB)], inst, MANUAL) == []
    below = gate_violations([gpu(0, 40 * GIB - 1), gpu(1, 30 * GIB, processes=[{"pid": 4242, "own": False}, {"pid": 7, "own": True}])],
                            inst, MANUAL)
    assert below == [
        f"main rank 0 (GPU 0): boot-free {40 * GIB - 1} B (40GiB) < floor {40 * GIB} B (40GiB)",
        f"main rank 1 (GPU 1): boot-free {30 * GIB} B (30GiB) < floor {40 * GIB} B (40GiB), other processes: 4242",
    ]


def test_the_gate_keys_floors_by_rank_not_by_gpu_index():
    """An instance on GPUs 2 and 3 has ranks 0 and 1; integer and text keys both work (JSON has only text)."""
    floors = launch({"decision": "deploy", "free_floor_bytes": {0: 10 * GIB, "1": 50 * GIB}})
    out = gate_violations([gpu(2, 20 * GIB), gpu(3, 20 * GIB)], [{"name": "b", "gpus": ["2", 3]}], floors)
    assert out == [f"b rank 1 (GPU 3): boot-free {20 * GIB} B (20GiB) < floor {50 * GIB} B (50GiB)"]


def test_the_gate_names_a_missing_gpu_and_a_missing_floor():
    out = gate_violations([gpu(0, 80 * GIB)], [{"name": "main", "gpus": [0, 5]}],
                          launch({"decision": "deploy", "free_floor_bytes": {}}))
    assert out == ["main rank 0 (GPU 0): the plan has no floor for this rank", "main rank 1 (GPU 5): not found by NVML"]


def test_automatic_profiling_needs_vllms_own_startup_share():
    inst = [{"name": "main", "gpus": [0]}]
    auto = {"decision": "auto_profile", "gpu_memory_utilization": None}
    assert gate_violations([gpu(0, 90, total=100)], inst, launch(auto)) == []
    assert gate_violations([gpu(0, 89, total=100)], inst, launch(auto)) == ["main rank 0 (GPU 0): boot-free 89 B (89B) < floor 90 B (90B)"]
    # the plan's own utilization wins over the default
    assert gate_violations([gpu(0, 89, total=100)], inst, launch(dict(auto, gpu_memory_utilization=0.5))) == []


def test_the_gate_takes_only_a_launch_record():
    """A plan's flat fields are not a launch record: launch_contract makes one (the role does)."""
    with pytest.raises(LaunchError, match=r"launch.schema: None is not the schema"):
        gate_violations([gpu(0, 90, total=100)], [{"name": "main", "gpus": [0]}], {"decision": "deploy", "free_floor_bytes": {}})
    with pytest.raises(LaunchError, match=r"auto_profile record needs the utilization"):
        gate_violations([gpu(0, 90, total=100)], [{"name": "main", "gpus": [0]}],
                        dict(launch({"decision": "auto_profile"}), gpu_memory_utilization=None))


def test_the_gate_takes_a_whole_reading_and_fails_with_its_nvml_error():
    """vllm_unit's gpu_probe: the GPUs under ``gpus``, or the probe's error, which fails every gate it decides."""
    inst = [{"name": "main", "gpus": [0, 1]}]
    reading = {"gpus": [gpu(0, 40 * GIB), gpu(1, 30 * GIB)], "driver_version": "550.127.05"}
    assert gate_violations(reading, inst, MANUAL) == gate_violations(reading["gpus"], inst, MANUAL) != []
    lost = {"error": "gpu-a1: GPU 1: opening the GPU: GPU is lost (NVML_ERROR_GPU_IS_LOST)", "gpu": "1", "nvml_error": 15}
    assert gate_violations(lost, inst, MANUAL) == ["the NVML probe failed: gpu-a1: GPU 1: opening the GPU: GPU is lost (NVML_ERROR_GPU_IS_LOST)"]


RUN_NAMES = ["gpufleet_rollout_serial", "gpufleet_classes", "gpufleet_report_dir", "gpufleet_force_profile"]


@pytest.mark.parametrize(("answer", "serial"), [
    ("1,10%,50%", ["1", "10%", "50%"]),
    ('[1, "10%", "50%"]', ["1", "10%", "50%"]),
    ("1, 2 ,4", [1, 2, 4]),
    ("['2']", [2]),
    ("1,,2,", [1, 2]),
    ("\u0661", ["\u0661"]),  # an Arabic-Indic digit is text: the argument spec refuses it by name
])
def test_run_settings_read_survey_text_as_lists(answer, serial):
    got = run_settings(RUN_NAMES, {"gpufleet_rollout_serial": answer, "gpufleet_classes": " h200-tp1, 'l40s' "}, {})
    assert got == {"gpufleet_rollout_serial": serial, "gpufleet_classes": ["h200-tp1", "l40s"]}


def test_run_settings_take_extra_vars_first_then_the_first_host_and_treat_a_blank_answer_as_not_given():
    inventory = {"gpufleet_rollout_serial": [2, "20%"], "gpufleet_classes": ["h200"], "gpufleet_report_dir": "/r",
                 "gpufleet_force_profile": True}
    given = {"gpufleet_rollout_serial": "", "gpufleet_classes": "", "gpufleet_report_dir": "/given",
             "gpufleet_force_profile": False, "unrelated": 1}
    assert run_settings(RUN_NAMES, given, inventory) == {
        "gpufleet_rollout_serial": [2, "20%"], "gpufleet_classes": ["h200"], "gpufleet_report_dir": "/given",
        "gpufleet_force_profile": False}
    # blank in both: left out, so that the default applies; a list given as a list stays as it is
    assert run_settings(RUN_NAMES, {"gpufleet_report_dir": ""}, {"gpufleet_report_dir": ""}) == {}
    assert run_settings(["gpufleet_rollout_serial"], {"gpufleet_rollout_serial": ["1", 5]}, {}) == {"gpufleet_rollout_serial": ["1", 5]}


def test_a_class_without_a_failure_policy_rolls_back_unless_an_older_approved_plan_says_otherwise():
    # the inventory's policy wins; a blank AWX answer is unset
    assert class_on_failure("stop", "c") == "stop" and class_on_failure("stop", "c", {"classes": {"c": {"on_failure": "rollback_class"}}}) == "stop"
    assert class_on_failure(None, "c") == class_on_failure("", "c") == "rollback_class"
    # applying a plan: what it recorded; a plan that records none was approved with stop
    assert class_on_failure(None, "c", {"classes": {"c": {"on_failure": "rollback_class"}}}) == "rollback_class"
    assert class_on_failure(None, "c", {"classes": {"c": {"on_failure": "stop"}}}) == "stop"
    assert class_on_failure(" ", "c", {"classes": {"c": {}}}) == "stop"
    with pytest.raises(RolloutError, match=r"gpufleet_plan.classes.c.on_failure: expected one of stop, rollback_class, got 'undo'"):
        class_on_failure(None, "c", {"classes": {"c": {"on_failure": "undo"}}})
    # the artifact records each class's policy, rollback_class when the class state carries none
    plan = {"launch": {"decision": "fixed_budget", "kv_cache_memory_bytes": 1 << 30}}
    doc = plan_artifact({"c": {"ok": True, "plan": plan, "on_failure": "stop"}, "d": {"ok": True, "plan": plan}}, {},
                        "2026-12-01T10:00:00+00:00")
    assert (doc["classes"]["c"]["on_failure"], doc["classes"]["d"]["on_failure"]) == ("stop", "rollback_class")
    assert class_on_failure(None, "d", doc) == "rollback_class"

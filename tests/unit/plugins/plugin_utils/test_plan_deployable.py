# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""plan_deployable: the one rule that says whether a class's plan may be deployed."""
from __future__ import annotations

import itertools

import pytest

from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import DECISIONS, PlanError, plan_class, plan_deployable

GIB = 1024**3
# admission as the planner reports it: passed, failed, not checked (None), missing
ADMISSIONS = {"ok": {"ok": True}, "short": {"ok": False}, "none": None, "missing": "missing"}
# decision -> deployable with split_policy warn and fail, before the admission check
BY_DECISION = {
    "deploy": {"warn": True, "fail": True},
    "reprofile": {"warn": True, "fail": True},
    "auto_profile": {"warn": True, "fail": True},
    "split": {"warn": True, "fail": False},
    "refuse": {"warn": False, "fail": False},
}


def plan(decision, admission):
    out = {"decision": decision, "reasons": []}
    if admission != "missing":
        out["admission"] = admission
    return out


def test_every_planner_decision_has_a_rule():
    assert sorted(BY_DECISION) == sorted(DECISIONS)


@pytest.mark.parametrize(
    "decision, split_policy, require_admission, admission",
    list(itertools.product(sorted(BY_DECISION), ["warn", "fail"], [True, False], sorted(ADMISSIONS))),
)
def test_deployable_rule(decision, split_policy, require_admission, admission):
    expected = BY_DECISION[decision][split_policy] and not (require_admission and admission == "short")
    got = plan_deployable(plan(decision, ADMISSIONS[admission]), split_policy, require_admission)
    assert got is expected


def test_defaults_warn_on_split_and_ignore_admission():
    assert plan_deployable({"decision": "split", "admission": {"ok": False}}) is True


def test_require_admission_accepts_ansible_booleans():
    assert plan_deployable({"decision": "deploy", "admission": {"ok": False}}, "warn", "yes") is False  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "args, match",
    [
        (({"decision": "deploy"}, "maybe"), r"^split_policy: expected per_host, warn, fail, got 'maybe'$"),
        (({"decision": "ship"},), r"^plan.decision: expected one of deploy, reprofile, split, auto_profile, refuse, got 'ship'$"),
        (({},), r"^plan.decision: expected one of .*, got None$"),
        (([],), r"^plan: expected a kv_plan result \(a mapping\), got list$"),
        (({"decision": "deploy"}, "warn", "perhaps"), r"require_admission"),
    ],
)
def test_bad_input_names_the_field(args, match):
    with pytest.raises(PlanError, match=match):
        plan_deployable(*args)


def test_planner_output_judged():
    """A real plan: an admission shortfall is deployable only when admission is not required."""
    reference = {"ranks": [{"rank": 0, "free_bytes": 42 * GIB, "kv_bytes": 30 * GIB}], "total_bytes": 141 * GIB,
                 "bytes_per_block": 2097152, "vllm_version": "0.32.0"}
    short = plan_class({"host_class": "h200", "reference": reference, "guard_bytes": "0.5GiB", "max_model_len": 8192,
                        "hosts": {"a": [{"rank": 0, "boot_free_bytes": 42 * GIB}]}, "admission": {"tokens": 300_000}})
    assert short["decision"] == "deploy" and short["admission"]["ok"] is False
    assert plan_deployable(short, "warn", False) is True
    assert plan_deployable(short, "warn", True) is False
    refused = plan_class({"host_class": "h200", "reference": {}, "hosts": {"a": [{"rank": 0, "boot_free_bytes": 1}]}})
    assert refused["decision"] == "refuse"
    assert plan_deployable(refused, "warn", False) is False

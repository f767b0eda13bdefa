# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The manual canary of a fit_admission plan is judged against the plan's tokens.

The expressions are the ones in the role and the playbook (read from their files and
templated by Ansible's own templar); their output is judged by the canary module's
judge_canary, as the module does.
"""

from __future__ import annotations

import pathlib
import typing as t

import pytest
import yaml
from ansible.errors import AnsibleValueOmittedError
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from task_lookup import only, plays_tasks  # pylint: disable=import-error

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._canary import Tolerances, judge_canary
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import from_plan

ROOT = pathlib.Path(__file__).resolve().parents[3]
OMITTED = object()

LOAD = {"requests": 16, "concurrency": 4, "prompt_tokens": 64, "max_tokens": 32, "completed": 16, "failed": 0,
        "ttft_p95": 0.2, "e2e_p95": 1.5}
REFERENCE = {"mode": "profiled", "verdict": "pass", "kv_cache_tokens": 492128, "preemptions": 0, "load": LOAD}
PLAN_TOKENS = 288384  # 0.586 of the reference: a right-sized budget


def render(expr: str, variables: dict[str, t.Any]) -> t.Any:
    try:
        return Templar(loader=DataLoader(), variables=variables).template(trust_as_template(expr))
    except AnsibleValueOmittedError:
        return OMITTED


def module_args(min_tokens: int, tolerances: dict[str, t.Any] | None = None) -> tuple[t.Any, t.Any]:
    tasks = yaml.safe_load((ROOT / "roles" / "vllm_canary" / "tasks" / "main.yml").read_text())
    # the boot (the background start of a gang's member without API takes the same options)
    args = only(tasks, "boots the canary engine", lambda task: "gpufleet.vllm.vllm_canary" in task and "async" not in task)[
        "gpufleet.vllm.vllm_canary"]
    variables = {"vllm_canary_mode": "manual", "vllm_canary_reference": REFERENCE,
                 "vllm_canary_min_tokens": min_tokens, "vllm_canary_tolerances": tolerances or {}}
    return render(args["reference"], variables), render(args["tolerances"], variables)


def judge(tokens: int, min_tokens: int, ttft: float = 0.2) -> tuple[str, list[str]]:
    reference, tolerances = module_args(min_tokens)
    result = {"health": "healthy", "kv_cache_tokens": tokens, "preemptions": 0, "load": dict(LOAD, ttft_p95=ttft)}
    verdict, reasons = judge_canary(
        result, requested_kv_bytes=None,
        tolerances=Tolerances.from_dict(None if tolerances is OMITTED else tolerances),
        reference=None if reference is OMITTED else reference,
    )[:2]
    return verdict, reasons


def test_playbook_passes_the_planned_tokens_for_every_manual_budget():
    tasks = plays_tasks(yaml.safe_load((ROOT / "playbooks" / "plays" / "plan_classes.yml").read_text()))
    expr = only(tasks, "gives the canary the plan's tokens", lambda task: "vllm_canary_min_tokens" in (task.get("vars") or {}))[
        "vars"]["vllm_canary_min_tokens"]

    def planned(budget_mode: str, decision: str, tokens: int) -> dict:
        plan = {"budget_mode": budget_mode, "decision": decision, "kv_cache_tokens": tokens,
                "kv_cache_memory_bytes": 8 << 30, "gpu_memory_utilization": 0.5}
        return {"kv_plan_result": dict(plan, launch=from_plan(plan))}

    fit = planned("fit_admission", "deploy", PLAN_TOKENS)
    safe = planned("max_safe", "deploy", 490000)
    # split_policy warn deploys the weakest host's budget on the whole class
    split = planned("max_safe", "split", 416000)
    # a max_safe budget is below the reference by the drift, the guard, the gate margin and the rounding
    unknown = planned("max_safe", "deploy", 0)
    assert int(render(expr, fit)) == PLAN_TOKENS
    assert int(render(expr, safe)) == 490000
    assert int(render(expr, split)) == 416000
    assert int(render(expr, unknown)) == 0, "tokens the plan cannot count: token_ratio x the reference's"


def test_right_sized_canary_reaching_the_plan_passes():
    assert judge(PLAN_TOKENS, PLAN_TOKENS) == ("pass", [])


def test_same_canary_judged_against_the_reference_fails():
    verdict, reasons = judge(PLAN_TOKENS, 0)
    assert verdict == "fail"
    assert "0.5860 of the reference's 492128, below the tolerated 0.9" in reasons[0]


def test_canary_below_the_planned_tokens_fails():
    verdict, reasons = judge(PLAN_TOKENS - 16, PLAN_TOKENS)
    assert verdict == "fail"
    assert f"KV cache tokens {PLAN_TOKENS - 16}" in reasons[0] and str(PLAN_TOKENS) in reasons[0]


def test_latency_is_still_compared_with_the_profiled_run():
    verdict, reasons = judge(PLAN_TOKENS, PLAN_TOKENS, ttft=0.5)
    assert verdict == "fail"
    assert any("TTFT p95 is 2.50x the reference's" in r for r in reasons), reasons


@pytest.mark.parametrize("min_tokens", [0, PLAN_TOKENS])
def test_other_tolerances_are_kept(min_tokens):
    tolerances = module_args(min_tokens, {"latency_ratio": 3.0, "token_ratio": 0.8})[1]
    assert tolerances["latency_ratio"] == 3.0
    assert tolerances["token_ratio"] == (1.0 if min_tokens else 0.8)

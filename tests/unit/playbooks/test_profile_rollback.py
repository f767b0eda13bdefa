# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""profile.yml runs the rollout's own profiled canary; rollback.yml's refusal of a runtime switch back
that would leave instances behind.

The expressions are the ones in the playbooks (read from their files and templated by Ansible's
own templar). That the canary, the hooks, the runtime switch back and the boot check run is
tests/integration/test_rollout.py and test_rollout_runtime.py.
"""

from __future__ import annotations

import pathlib
import typing as t

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from task_lookup import including, only  # pylint: disable=import-error

ROOT = pathlib.Path(__file__).resolve().parents[3]


def plays(name: str) -> list[dict[str, t.Any]]:
    return yaml.safe_load((ROOT / "playbooks" / name).read_text(encoding="utf-8"))


def test_profile_and_the_rollout_run_one_canary_task_file_with_the_same_inputs() -> None:
    rollout = next(p for p in plays("plays/plan_classes.yml") if p["hosts"].startswith("gpufleet_canaries"))
    profile = next(p for p in plays("profile.yml") if p.get("name") == "Run the profiled canary")
    # both run the one canary task file
    including(rollout["tasks"], "../tasks/canary_profiled.yml")
    including(profile["tasks"], "tasks/canary_profiled.yml")
    assert "../vars/canary.yml" in rollout["vars_files"] and "vars/canary.yml" in profile["vars_files"]
    assert not [v for v in list(rollout["vars"]) + list(profile["vars"]) if v.startswith("vllm_canary_")], \
        "the canary's inputs have one home: vars/canary.yml"
    # the account, the adopted units and the service user the rollout's canaries use
    inputs = yaml.safe_load((ROOT / "playbooks" / "vars" / "canary.yml").read_text(encoding="utf-8"))
    assert inputs["vllm_canary_user"].startswith("{{ vllm_service_user")
    assert inputs["vllm_canary_stop_units"].startswith("{{ vllm_service_adopt_units")
    # what the canary stopped must serve again before the undrain, as after the rollout's canaries
    including(profile["tasks"], "tasks/canary_serving.yml")
    including(rollout["tasks"], "../tasks/canary_serving.yml")


def switch_back_allowed(selected: list[str], runtime: dict[str, t.Any]) -> bool:
    play = next(p for p in plays("rollback.yml") if p.get("name") == "Roll back vLLM units")
    task = only(play["tasks"], "refuses a switch back that leaves instances on the runtime",
                lambda task: "__switched" in (task.get("vars") or {}) and "ansible.builtin.assert" in task)
    variables = dict({k: trust_as_template(v) for k, v in task["vars"].items()}, gpufleet_rollback_plan={"runtime": runtime},
                     gpufleet_rollback_selected=[{"name": n} for n in selected])
    templar = Templar(loader=DataLoader(), variables=variables)
    return bool(templar.template(trust_as_template("{{ " + task["ansible.builtin.assert"]["that"] + " }}")))


@pytest.mark.parametrize(("selected", "runtime", "allowed"), [
    # no runtime switch to undo
    (["a"], {"release": "", "current": "/r2", "instances": []}, True),
    # every instance that ran the release goes back with it
    (["a", "b"], {"release": "/r1", "current": "/r2", "instances": ["a", "b"]}, True),
    # the rolled-back instance's snapshot kept no release: the venv stays
    (["c"], {"release": "/r1", "current": "/r2", "instances": ["a", "b"]}, True),
    # b ran the release too and would be left on /r2 under a switched venv
    (["a"], {"release": "/r1", "current": "/r2", "instances": ["a", "b"]}, False),
])
def test_a_runtime_switch_back_takes_every_instance_that_ran_the_release(selected, runtime, allowed) -> None:
    assert switch_back_allowed(selected, runtime) is allowed

# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""vllm_service model_access.yml: where the rollout checks that the service user can read the model,
and what the check does for a user that does not exist yet (run by ansible-playbook on localhost;
the unreadable file itself is found on real hosts in tests/integration/test_real_engine.py)."""

from __future__ import annotations

import pathlib
import typing as t

import pytest
import yaml
from _role_cases import run_role_cases  # pylint: disable=import-error  # beside this file

ROOT = pathlib.Path(__file__).resolve().parents[3]
MISSING_USER = "gpufleet-no-such-user"


def _tasks(tasks: list[dict[str, t.Any]]) -> list[dict[str, t.Any]]:
    """Every task, those in blocks included, in file order."""
    out = []
    for task in tasks:
        out.append(task)
        for key in ("block", "rescue", "always"):
            out.extend(_tasks(task.get(key, [])))
    return out


def test_the_rollout_checks_every_host_before_any_canary() -> None:
    plays = yaml.safe_load((ROOT / "playbooks" / "rollout.yml").read_text(encoding="utf-8"))
    names = [p.get("name") for p in plays]
    check_play = "Stage the vLLM runtime and check the model on every host"
    check = plays[names.index(check_play)]
    # before the canaries take the canary host out of service, and so before the first batch
    assert names.index(check_play) < names.index("Profile, plan and canary every class") < names.index("Roll out in serial batches")
    assert check["hosts"] == "gpufleet_rollout" and check["any_errors_fatal"] is True
    tasks = _tasks(check["tasks"])
    access = [task for task in tasks if (task.get("ansible.builtin.include_role") or {}).get("tasks_from") == "model_access"]
    assert len(access) == 1, "the check of every host includes the model check"
    assert access[0]["vars"] == {"vllm_service_model": "{{ gpufleet_model }}", "vllm_service_model_access_user_optional": True}
    # it runs whether or not the rollout stages a runtime, where the host snapshot could not check (no user yet)
    assert access[0]["when"] == "not gpufleet_probe_result.model_access.checked | default(false)"
    # (a model the snapshot found unreadable is checked again there, and fails the host with the role's message)
    probe = yaml.safe_load((ROOT / "playbooks" / "plays" / "probe.yml").read_text(encoding="utf-8"))[0]["tasks"]
    snapshot = next(task for task in probe if "gpufleet.vllm.vllm_host_snapshot" in task)
    assert snapshot["register"] == "gpufleet_probe_result" and "gpufleet_model" in snapshot["gpufleet.vllm.vllm_host_snapshot"]["model"]
    # a failure there is rescued into the report and stops the run before any host is touched
    rescue = check["tasks"][0]["rescue"]
    assert access[0] in check["tasks"][0]["block"]
    assert any("report_tasks.yml" in str(task.get("ansible.builtin.include_tasks", "")) for task in rescue)
    # once per run: the later checks of every host's inputs do not look again
    every_host = _tasks(plays[names.index("Check the service inputs of every host")]["tasks"])
    assert not [task for task in every_host if (task.get("ansible.builtin.include_role") or {}).get("tasks_from") == "model_access"]


def test_the_role_checks_again_in_the_call_that_creates_the_user_and_starts_the_units() -> None:
    tasks = yaml.safe_load((ROOT / "roles" / "vllm_service" / "tasks" / "deploy.yml").read_text(encoding="utf-8"))
    write = next(task for task in tasks if "gpufleet.vllm.vllm_unit" in task)["gpufleet.vllm.vllm_unit"]
    # the unit write (re)starts the instances, once the account exists and the model was found readable
    assert write["restart"] is True
    assert write["account"]["user"] == "{{ vllm_service_user }}" and write["account"]["create"] == "{{ vllm_service_create_user }}"
    # where the rollout's check could not look (no user yet), and only there
    assert "__vllm_service_model_readable" in write["account"]["model"] and "vllm_service_model" in write["account"]["model"]


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("model-access")
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text("{}", encoding="utf-8")
    cases = {case: {"vllm_service_user": MISSING_USER, "vllm_service_model": str(model),
                    "vllm_service_model_access_user_optional": optional}
             for case, optional in {"optional": True, "required": False}.items()}
    return run_role_cases(tmp, "vllm_service", "model_access", cases)[0]


def test_a_user_not_created_yet_is_left_to_the_check_before_its_unit_starts(outcome: dict[str, str]) -> None:
    assert outcome["optional"] == "ok", outcome["optional"]


def test_the_check_before_a_unit_starts_needs_the_user(outcome: dict[str, str]) -> None:
    msg = outcome["required"]
    assert f"the service user {MISSING_USER} cannot read the model" in msg, msg

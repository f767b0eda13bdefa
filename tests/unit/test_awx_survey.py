# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The AWX survey of the "vLLM KV rollout" job template matches the rollout playbook's inputs."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

REPO = Path(__file__).resolve().parents[2]
SURVEY = REPO / "meta" / "survey-rollout.json"
SPEC_FILE = REPO / "playbooks" / "vars" / "rollout_argument_spec.yml"
AWX_DOC = REPO / "docs" / "awx.md"
AWX_TYPES = {"text", "textarea", "password", "integer", "float", "multiplechoice", "multiselect"}


def run_spec() -> dict:
    return yaml.safe_load(SPEC_FILE.read_text(encoding="utf-8"))["gpufleet_argument_spec"]["run"]


def survey() -> dict:
    return json.loads(SURVEY.read_text(encoding="utf-8"))


def questions() -> dict[str, dict]:
    return {q["variable"]: q for q in survey()["spec"]}


def test_survey_is_well_formed():
    data = survey()
    assert data["name"] == "vLLM KV rollout" and data["description"]
    names = [q["variable"] for q in data["spec"]]
    assert len(names) == len(set(names)), "a variable is asked twice"
    for q in data["spec"]:
        assert q["type"] in AWX_TYPES, q
        assert q["question_name"] and q["question_description"], q
        assert isinstance(q["required"], bool), q
        if q["type"] == "multiplechoice":
            assert q["default"] in q["choices"], q
        if q["type"] == "text":
            assert 0 <= q["min"] <= q["max"], q
            assert q["default"] == "" or q["min"] <= len(q["default"]) <= q["max"], q
            assert q["min"] > 0 or not q["required"], f"{q['variable']}: a required text answer needs min > 0"


def test_survey_asks_exactly_the_run_settings():
    spec, asked = run_spec(), questions()
    assert sorted(asked) == sorted(spec), (
        f"survey and playbooks/vars/rollout_argument_spec.yml differ: only in the survey {sorted(set(asked) - set(spec))}, "
        f"only in the spec {sorted(set(spec) - set(asked))}"
    )


@pytest.mark.parametrize("name", sorted(run_spec()))
def test_question_matches_its_spec(name):
    opt, q = run_spec()[name], questions()[name]
    if opt.get("required"):
        assert q["required"], f"{name} is required by the playbook"
    elif q["required"]:
        assert q["default"] not in ("", None), f"{name}: a required question needs a default when the playbook has one"
    if opt.get("choices"):
        assert q["type"] == "multiplechoice" and sorted(q["choices"]) == sorted(str(c) for c in opt["choices"])
    elif opt["type"] == "bool":
        assert q["type"] == "multiplechoice" and sorted(q["choices"]) == ["false", "true"]
    else:
        assert q["type"] == "text", f"{name} ({opt['type']}) is asked as text"
    if "default" in opt and opt["default"] not in ([], None):
        assert q["default"] == str(opt["default"]).lower() if opt["type"] == "bool" else q["default"] == str(opt["default"])


def awx_answers(**over) -> dict:
    """Extra vars as AWX passes them: every answer is text; blank optional ones are left out."""
    answers = {q["variable"]: q["default"] for q in survey()["spec"] if q["default"] != ""}
    answers.update(gpufleet_profile_store="/var/lib/gpufleet/profiles", **over)
    return answers


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"gpufleet_rollout_serial": "1,10%,50%", "gpufleet_classes": "h200-tp1,l40s", "gpufleet_force_profile": "true"},
        {"gpufleet_report_dir": "/var/lib/gpufleet/reports", "gpufleet_split_policy": "fail"},
    ],
)
def test_survey_answers_pass_the_playbook_validation(over):
    spec = {k: {kk: vv for kk, vv in v.items() if kk != "description"} for k, v in run_spec().items()}
    result = ArgumentSpecValidator(spec).validate(awx_answers(**over))
    assert not result.error_messages, result.error_messages


def test_wrong_answer_is_refused():
    spec = {k: {kk: vv for kk, vv in v.items() if kk != "description"} for k, v in run_spec().items()}
    result = ArgumentSpecValidator(spec).validate(awx_answers(gpufleet_split_policy="maybe"))
    assert any("gpufleet_split_policy" in m for m in result.error_messages)


def test_awx_doc_job_template_uses_this_survey():
    text = AWX_DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    templates = [t for b in blocks for t in (yaml.safe_load(b) or []) if isinstance(t, dict) and "tasks" in t]
    tasks = [t for play in templates for t in play["tasks"] if "awx.awx.job_template" in t]
    rollout = [t for t in tasks if t["awx.awx.job_template"]["name"] == survey()["name"]]
    assert len(rollout) == 1, "docs/awx.md must show one awx.awx.job_template task for the rollout template"
    # every template that runs a gpufleet playbook keeps one job for the whole fleet (no slicing)
    assert all(t["awx.awx.job_template"]["job_slice_count"] == 1 for t in tasks)
    jt = rollout[0]["awx.awx.job_template"]
    assert jt["playbook"] == "playbooks/rollout.yml"
    assert jt["ask_limit_on_launch"] is True and jt["job_slice_count"] == 1 and jt["survey_enabled"] is True
    assert "meta/survey-rollout.json" in jt["survey_spec"]
    assert jt["name"] == survey()["name"]


def test_awx_doc_workflow_plans_approves_and_applies():
    text = AWX_DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    plays = [p for b in blocks for p in (yaml.safe_load(b) or []) if isinstance(p, dict) and "tasks" in p]
    tasks = [t for p in plays for t in p["tasks"]]
    templates = {t["awx.awx.job_template"]["name"]: t["awx.awx.job_template"] for t in tasks if "awx.awx.job_template" in t}
    workflows = [t["awx.awx.workflow_job_template"] for t in tasks if "awx.awx.workflow_job_template" in t]
    assert len(workflows) == 1
    nodes = {n["identifier"]: n for n in workflows[0]["workflow_nodes"]}
    plan, approve, apply = nodes["plan"], nodes["approve"], nodes["apply"]
    assert templates[plan["unified_job_template"]["name"]]["playbook"] == "playbooks/plan.yml"
    assert approve["unified_job_template"]["type"] == "workflow_approval"
    assert templates[apply["unified_job_template"]["name"]]["playbook"] == "playbooks/rollout.yml"
    assert [n["identifier"] for n in plan["related"]["success_nodes"]] == ["approve"]
    assert [n["identifier"] for n in approve["related"]["success_nodes"]] == ["apply"]
    assert "meta/survey-rollout.json" in workflows[0]["survey_spec"]


def test_awx_doc_templates_carry_the_model_token_credential():
    """The templates that run canaries or write units get the token from a credential whose
    injector sets the variable the example inventory maps onto the engine's secret environment."""
    text = AWX_DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    plays = [p for b in blocks for p in (yaml.safe_load(b) or []) if isinstance(p, dict) and "tasks" in p]
    tasks = [t for p in plays for t in p["tasks"]]
    types = {t["awx.awx.credential_type"]["name"]: t["awx.awx.credential_type"] for t in tasks if "awx.awx.credential_type" in t}
    creds = {t["awx.awx.credential"]["name"]: t["awx.awx.credential"] for t in tasks if "awx.awx.credential" in t}
    templates = {t["awx.awx.job_template"]["name"]: t["awx.awx.job_template"] for t in tasks if "awx.awx.job_template" in t}
    inventory = yaml.safe_load((REPO / "inventories" / "example" / "group_vars" / "gpufleet.yml").read_text(encoding="utf-8"))
    mapped = re.findall(r"\{\{\s*(\w+)\s*\}\}", inventory["vllm_service_secret_env"]["HF_TOKEN"])
    for name in ("vLLM KV rollout", "vLLM KV apply"):
        token_creds = [c for c in templates[name]["credentials"] if c in creds]
        assert len(token_creds) == 1, f"{name}: no model token credential among {templates[name]['credentials']}"
        ctype = types[creds[token_creds[0]]["credential_type"]]
        field = ctype["inputs"]["fields"][0]
        assert field["secret"] is True
        injected = ctype["injectors"]["extra_vars"]
        assert list(injected) == mapped, (injected, mapped)
        assert field["id"] in injected[mapped[0]]

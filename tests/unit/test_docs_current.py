# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Generated and hand-written user docs stay in step with the code.

* docs/variables.md is what tools/gen_variables_doc.py renders from the argument specs;
* docs/troubleshooting.md covers every error kind of the engine log parser, every planner
  decision and every planner refusal (each ``refuse.append(...)`` in the planner).
"""
from __future__ import annotations

import ast
import importlib.util
import re
import shutil
from pathlib import Path

import yaml

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import ERROR_KINDS
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import DECISIONS

REPO = Path(__file__).resolve().parents[2]
TROUBLE = REPO / "docs" / "troubleshooting.md"


def gen_module():
    spec = importlib.util.spec_from_file_location("gen_variables_doc", REPO / "tools" / "gen_variables_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- docs/variables.md
def test_variables_doc_is_current():
    committed = (REPO / "docs" / "variables.md").read_text(encoding="utf-8")
    assert committed == gen_module().render(REPO), "docs/variables.md is stale: run python tools/gen_variables_doc.py"


def test_variables_doc_lists_every_role_option():
    text = (REPO / "docs" / "variables.md").read_text(encoding="utf-8")
    for specs_file in sorted((REPO / "roles").glob("*/meta/argument_specs.yml")):
        role = specs_file.parent.parent.name
        for entry, spec in (yaml.safe_load(specs_file.read_text(encoding="utf-8"))["argument_specs"] or {}).items():
            title = f"### gpufleet.vllm.{role}" + ("" if entry == "main" else f" (tasks_from: {entry})")
            assert title in text, title
            for option in (spec or {}).get("options") or {}:
                assert f"| `{option}` |" in text, f"{role}/{entry}: {option} missing from docs/variables.md"


def test_variables_doc_follows_a_spec_change(tmp_path):
    """The staleness check can fail: a changed description changes the rendered doc."""
    for rel in ["playbooks/vars/rollout_argument_spec.yml", *[str(p.relative_to(REPO)) for p in REPO.glob("roles/*/meta/argument_specs.yml")]]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    gen = gen_module()
    before = gen.render(tmp_path)
    assert before == gen.render(REPO)
    spec_file = tmp_path / "roles" / "kv_plan" / "meta" / "argument_specs.yml"
    data = yaml.safe_load(spec_file.read_text(encoding="utf-8"))
    data["argument_specs"]["main"]["options"]["kv_plan_guard"]["description"] = "A guard | with a pipe."
    data["argument_specs"]["main"]["options"]["kv_plan_new_option"] = {"type": "int", "default": 3, "description": "New."}
    spec_file.write_text(yaml.safe_dump(data), encoding="utf-8")
    after = gen.render(tmp_path)
    assert after != before
    assert "| `kv_plan_guard` | raw |  | `\"0.5GiB\"` |  | A guard \\| with a pipe. |" in after
    assert "| `kv_plan_new_option` | int |  | `3` |  | New. |" in after


def test_generator_check_mode(tmp_path, monkeypatch, capsys):
    gen = gen_module()
    assert gen.main(["--check"]) == 0
    monkeypatch.setattr(gen, "REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    monkeypatch.setattr(gen, "render", lambda repo: "# other\n")
    assert gen.main(["--check"]) == 1
    assert "docs/variables.md is stale" in capsys.readouterr().err
    assert gen.main([]) == 0 and (tmp_path / "docs" / "variables.md").read_text(encoding="utf-8") == "# other\n"


# ---------------------------------------------------------------- docs/troubleshooting.md
def section(text: str, heading: str) -> str:
    match = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#+ |\Z)", text, re.S | re.M)
    assert match, f"docs/troubleshooting.md has no section {heading!r}"
    return match.group(1)


def first_column_codes(table: str) -> list[str]:
    return re.findall(r"^\| `([^`]+)` \|", table, re.M)


def test_every_engine_error_kind_is_explained():
    kinds = first_column_codes(section(TROUBLE.read_text(encoding="utf-8"), "Engine errors"))
    assert sorted(kinds) == sorted(ERROR_KINDS), f"documented {sorted(kinds)}, parser knows {sorted(ERROR_KINDS)}"


def test_every_planner_decision_is_explained():
    decisions = first_column_codes(section(TROUBLE.read_text(encoding="utf-8"), "Planner decisions"))
    assert sorted(decisions) == sorted(DECISIONS)


def refusal_texts() -> list[str]:
    """The literal text of every refuse.append(...) (or p.refuse.append(...)) message in the planner."""
    tree = ast.parse((REPO / "plugins" / "plugin_utils" / "_plan.py").read_text(encoding="utf-8"))
    texts = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"):
            continue
        target = node.func.value
        if (isinstance(target, ast.Name) and target.id == "refuse") or (isinstance(target, ast.Attribute) and target.attr == "refuse"):
            texts.append(" ... ".join(c.value for c in ast.walk(node.args[0]) if isinstance(c, ast.Constant) and isinstance(c.value, str)))
    assert len(texts) >= 10, "the planner's refusals were not found"
    return texts


def test_every_planner_refusal_is_explained():
    fragments = first_column_codes(section(TROUBLE.read_text(encoding="utf-8"), "Refusal reasons"))
    texts = refusal_texts()
    unexplained = [t for t in texts if not any(f in t for f in fragments)]
    assert not unexplained, "refusals without a row in docs/troubleshooting.md (Refusal reasons):\n" + "\n".join(unexplained)
    stale = [f for f in fragments if not any(f in t for t in texts)]
    assert not stale, f"rows that match no refusal of the planner any more: {stale}"

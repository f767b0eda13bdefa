# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""ansible-doc reads every module, action doc stub and filter of the collection, and their
EXAMPLES are YAML tasks (modules) or YAML (filters) that use what they document."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MODULES = sorted(p.stem for p in (REPO / "plugins" / "modules").glob("*.py") if not p.name.startswith("_"))
FILTERS = sorted(p.stem for p in (REPO / "plugins" / "filter").glob("*.yml"))


@pytest.fixture(scope="module")
def collections_path():
    """A collections tree holding this checkout as gpufleet.vllm."""
    tree = Path(tempfile.mkdtemp(prefix="ansible-doc-"))
    (tree / "ansible_collections" / "gpufleet").mkdir(parents=True)
    os.symlink(REPO, tree / "ansible_collections" / "gpufleet" / "vllm")
    yield tree
    shutil.rmtree(tree, ignore_errors=True)


def ansible_doc(collections_path: Path, plugin_type: str, names: list[str]) -> dict:
    binary = shutil.which("ansible-doc") or str(Path(sys.executable).parent / "ansible-doc")
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(collections_path), ANSIBLE_NOCOLOR="1")
    proc = subprocess.run(
        [binary, "-t", plugin_type, "--json", *[f"gpufleet.vllm.{n}" for n in names]],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )
    assert proc.returncode == 0, f"ansible-doc -t {plugin_type} failed (rc {proc.returncode}): {proc.stderr[-3000:]}"
    assert "WARNING" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_plugins_found():
    assert "rollout_report" in MODULES and "kv_plan" in MODULES and "gpu_memory_info" in MODULES
    assert FILTERS == ["human_bytes", "kv_bytes_per_token", "to_bytes", "vllm_secret_options", "vllm_serve_argv"]


def test_module_docs_and_examples(collections_path):
    docs = ansible_doc(collections_path, "module", MODULES)
    assert sorted(docs) == [f"gpufleet.vllm.{n}" for n in MODULES]
    problems = []
    for name, entry in sorted(docs.items()):
        doc = entry["doc"]
        if not doc.get("short_description") or doc.get("options") is None:
            problems.append(f"{name}: no short_description/options")
        if not entry.get("return"):
            problems.append(f"{name}: no RETURN")
        tasks = yaml.safe_load(entry.get("examples") or "")
        if not isinstance(tasks, list) or not tasks:
            problems.append(f"{name}: EXAMPLES is not a YAML list of tasks")
            continue
        if not all(isinstance(t, dict) and t.get("name") for t in tasks):
            problems.append(f"{name}: every example task needs a name")
        used = [t for t in tasks if isinstance(t, dict) and name in t]
        if not used:
            problems.append(f"{name}: no example task uses {name}")
        for task in used:
            args = task[name] or {}
            unknown = sorted(set(args) - set(doc["options"])) if isinstance(args, dict) else []
            if unknown:
                problems.append(f"{name}: example uses unknown options {unknown}")
    assert not problems, "\n".join(problems)


def test_filter_docs_and_examples(collections_path):
    docs = ansible_doc(collections_path, "filter", FILTERS)
    assert sorted(docs) == [f"gpufleet.vllm.{n}" for n in FILTERS]
    for name, entry in docs.items():
        examples = entry.get("examples") or ""
        assert examples.strip(), f"{name}: no EXAMPLES"
        yaml.safe_load(examples)
        assert name.rsplit(".", 1)[1] in examples, f"{name}: the examples do not use the filter"

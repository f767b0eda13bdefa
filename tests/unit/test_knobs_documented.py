# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Every knob is documented: a ``gpufleet_`` name the playbooks, roles or plugins read that the collection
never sets itself is something a user sets, so it must be in playbooks/vars/rollout_argument_spec.yml (and
so in docs/variables.md, which is generated from it). The example hooks under playbooks/examples/ have their
variables documented in their section of docs/rollout.md.

Read: a name inside a Jinja expression (``{{ }}``, ``{% %}``, ``when``, ``that``, ``until``, ``loop``...), or a
name a plugin looks up (``.get("gpufleet_...")``, ``["gpufleet_..."]``). Set: a mapping key (vars, set_fact,
vars files, include vars), ``register``, ``loop_var``, a group (group_by, add_host, ``hosts:``), a fact a
module returns.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

import yaml

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "playbooks" / "vars" / "rollout_argument_spec.yml"
EXAMPLES = REPO / "playbooks" / "examples"
NAME = re.compile(r"(?<![A-Za-z0-9_])(gpufleet_[A-Za-z0-9_]*[A-Za-z0-9])")
JINJA = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.S)
EXPRESSION_KEYS = {"when", "that", "until", "failed_when", "changed_when", "loop", "with_items"}
SETTING_KEYS = {"register", "loop_var", "index_var", "key"}
PLUGIN_READ = re.compile(r"""(?:\.get\(|\[)\s*["'](gpufleet_[A-Za-z0-9_]+)["']""")
FACT_KEY = re.compile(r"""["'](gpufleet_[A-Za-z0-9_]+)["']\s*:""")
# read, but not a variable anybody sets
NOT_KNOBS: dict[str, str] = {}
ROLLOUT_DOC = REPO / "docs" / "rollout.md"


def _walk(node: Any, key: str | None = None) -> Iterator[tuple[str | None, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, str(k))
            yield "__key__", k
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item, key)
    else:
        yield key, node


def scan(files: list[Path], spec: Path | None = None) -> tuple[set[str], set[str]]:
    """(read, set) names of these YAML files."""
    read: set[str] = set()
    written: set[str] = set()
    for path in files:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        if path == spec:
            written.update(data)  # the spec itself (gpufleet_argument_spec), not its options
        for key, value in _walk(data):
            if key == "__key__":
                if isinstance(value, str) and path != spec:
                    written.update(NAME.findall(value))
                continue
            if not isinstance(value, str):
                continue
            if key in SETTING_KEYS or (key in ("groups", "hosts", "name") and "{{" not in value):
                # a registered result, a loop variable, a group made or targeted; a task name is prose
                if key != "name":
                    written.update(NAME.findall(value))
                continue
            if key in EXPRESSION_KEYS:
                read.update(NAME.findall(value))
            for expression in JINJA.findall(value):
                read.update(NAME.findall(expression))
                written.update(re.findall(r"\{%-?\s*set\s+(gpufleet_[A-Za-z0-9_]+)", expression))
    return read, written


def _yaml_files(*folders: Path, skip: Path | None = None) -> list[Path]:
    return sorted(p for folder in folders for p in folder.rglob("*.yml") if skip is None or skip not in p.parents)


def documented() -> set[str]:
    spec = yaml.safe_load(SPEC.read_text(encoding="utf-8"))["gpufleet_argument_spec"]
    return {name for section in spec.values() for name in section}


def collection_names() -> tuple[set[str], set[str]]:
    """(read, set) names of the collection's playbooks (less the examples), roles and plugins."""
    read, written = scan(_yaml_files(REPO / "playbooks", REPO / "roles", skip=EXAMPLES), SPEC)
    for path in sorted((REPO / "plugins").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path.parent.name in ("action", "filter", "plugin_utils"):
            read.update(PLUGIN_READ.findall(text))
        if path.parent.name == "modules" or "module_utils" in path.parts:
            written.update(FACT_KEY.findall(text))  # facts a module returns (gpufleet_gpus, gpufleet_nvml)
    return read, written


def collection_knobs() -> set[str]:
    read, written = collection_names()
    return read - written - set(NOT_KNOBS)


def test_every_knob_is_in_an_argument_spec_and_docs_variables():
    missing = sorted(collection_knobs() - documented())
    assert not missing, (
        f"read by the collection, set by nobody but the user, and documented nowhere: {missing}; add each to "
        "playbooks/vars/rollout_argument_spec.yml (type, default, description) and run python tools/gen_variables_doc.py")
    text = (REPO / "docs" / "variables.md").read_text(encoding="utf-8")
    assert all(f"`{name}`" in text for name in documented())


def test_the_scan_finds_known_knobs_and_no_internal_names():
    knobs = collection_knobs()
    # user knobs read in each way: a Jinja default, a plugin's hostvars lookup, a run setting read by name
    assert {"gpufleet_gate_margin", "gpufleet_unstable", "gpufleet_reprofile_after_days", "gpufleet_target"} <= knobs
    # set by the collection: registered, a fact, a group, set_fact
    assert not {"gpufleet_probe_result", "gpufleet_gpus", "gpufleet_rollout", "gpufleet_run"} & knobs


def test_a_new_knob_is_caught(tmp_path):
    play = tmp_path / "play.yml"
    play.write_text("- hosts: all\n  tasks:\n    - ansible.builtin.debug:\n        msg: \"{{ gpufleet_brand_new | default(1) }}\"\n"
                    "      register: gpufleet_result\n      when: gpufleet_other_new | bool\n", encoding="utf-8")
    read, written = scan([play])
    assert read - written == {"gpufleet_brand_new", "gpufleet_other_new"}


def test_the_example_hooks_document_their_variables():
    # an example's variables are documented in its section of docs/rollout.md ("### Example: <name>")
    _read, collection_set = collection_names()
    text = ROLLOUT_DOC.read_text(encoding="utf-8")
    for example in sorted(p for p in EXAMPLES.iterdir() if p.is_dir()):
        read, written = scan(_yaml_files(example))
        match = re.search(r"^### Example: " + re.escape(example.name) + r"\n(.*?)(?=^##)", text, re.I | re.M | re.S)
        assert match, f"docs/rollout.md has no section '### Example: {example.name}'"
        missing = sorted(n for n in read - written - collection_set - documented() if f"`{n}`" not in match.group(1))
        assert not missing, f"{example.relative_to(REPO)}: variables its section of docs/rollout.md does not document: {missing}"

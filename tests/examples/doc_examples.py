# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Run the EXAMPLES of the collection's modules and filters as ansible-doc renders them.

Used by ``tests/unit/test_doc_examples.py`` (controller-side examples) and
``tests/integration/test_doc_examples_hosts.py`` (examples that need a GPU host).

* :func:`ansible_doc` / :func:`examples` read the documentation through ``ansible-doc``
  (the text a user reads, not the Python source);
* :func:`filter_cases` reads a filter's examples: a YAML mapping of variables, each
  preceded by a comment ``# => <YAML value>`` (the value the filter returns) or
  ``# => error: <text>`` (the error it raises contains this text);
* :func:`filter_playbook` and :func:`module_playbook` turn examples into a playbook;
* :func:`run_playbook` runs it with ``ansible-playbook`` and :func:`task_statuses`
  reads, per task name, the status of each host from the output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
RESULT_MARK = "# =>"


def make_collections_tree(root: Path) -> Path:
    """``root/ansible_collections/gpufleet/vllm`` linked to this checkout; returns ``root``."""
    (root / "ansible_collections" / "gpufleet").mkdir(parents=True, exist_ok=True)
    link = root / "ansible_collections" / "gpufleet" / "vllm"
    if not link.exists():
        os.symlink(REPO, link)
    return root


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def ansible_env(collections_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(collections_path), ANSIBLE_NOCOLOR="1",
               ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_RETRY_FILES_ENABLED="False")
    env.update(extra)
    return env


def ansible_doc(collections_path: Path, plugin_type: str, names: Sequence[str]) -> dict[str, Any]:
    """``ansible-doc -t TYPE --json`` of ``gpufleet.vllm.<name>`` for each name."""
    proc = subprocess.run(
        [_tool("ansible-doc"), "-t", plugin_type, "--json", *[f"gpufleet.vllm.{n}" for n in names]],
        capture_output=True, text=True, env=ansible_env(collections_path), timeout=300, check=False,
    )
    if proc.returncode != 0:
        raise AssertionError(f"ansible-doc -t {plugin_type} failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    if "WARNING" in proc.stderr or "ERROR" in proc.stderr:
        raise AssertionError(proc.stderr[-3000:])
    return json.loads(proc.stdout)


def examples(collections_path: Path, plugin_type: str, names: Sequence[str]) -> dict[str, str]:
    """``{name: EXAMPLES text}`` as ansible-doc gives it."""
    docs = ansible_doc(collections_path, plugin_type, names)
    return {full.rsplit(".", 1)[1]: entry.get("examples") or "" for full, entry in docs.items()}


# ---------------------------------------------------------------- filters
@dataclasses.dataclass
class FilterCase:
    """One variable of a filter's examples and its documented result."""

    key: str
    template: str
    expected: Any = None
    error: str | None = None


def filter_cases(text: str) -> list[FilterCase]:
    """The variables of a filter's EXAMPLES with the result documented above each one."""
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or not data:
        raise AssertionError(f"filter EXAMPLES must be a YAML mapping of variables, got {type(data).__name__}")
    results: dict[str, str] = {}
    pending: str | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(RESULT_MARK):
            pending = stripped[len(RESULT_MARK):].strip()
        elif stripped.startswith("#") or not stripped:
            continue
        else:
            match = re.match(r"^([A-Za-z_][A-Za-z0-9_]*):", line)
            if match:
                if pending is None:
                    raise AssertionError(f"example {match.group(1)!r} has no '{RESULT_MARK} <result>' comment above it")
                results[match.group(1)] = pending
            pending = None
    cases = []
    for key, template in data.items():
        if key not in results:
            raise AssertionError(f"example {key!r} has no '{RESULT_MARK} <result>' comment above it")
        documented = results[key]
        if documented.startswith("error:"):
            cases.append(FilterCase(key, str(template), error=documented[len("error:"):].strip()))
        else:
            cases.append(FilterCase(key, str(template), expected=yaml.safe_load(documented)))
    return cases


def filter_playbook(examples_by_filter: Mapping[str, Sequence[FilterCase]], variables: Mapping[str, Any],
                    out: Path) -> list[dict[str, Any]]:
    """One localhost play per filter whose vars are its examples as written, then a play that
    writes ``{filter: {results: {name: value}, errors: {name: message}}}`` to ``out``.

    Each variable is evaluated on its own (a loop item), so one that raises an error does
    not hide the others.
    """
    plays: list[dict[str, Any]] = []
    for pos, (name, cases) in enumerate(examples_by_filter.items()):
        play_vars = dict(variables)
        play_vars.update({c.key: c.template for c in cases})
        plays.append({
            "name": f"Run the examples of {name}", "hosts": "localhost", "connection": "local", "gather_facts": False,
            "vars": play_vars,
            "tasks": [{
                "name": f"Evaluate each example of {name}",
                "ansible.builtin.debug": {"msg": "{{ lookup('ansible.builtin.vars', item) }}"},
                "loop": [c.key for c in cases],
                "register": f"example_eval_{pos}",
                "ignore_errors": True,
            }],
        })
    content = "{%- set out = {} -%}"
    for pos, name in enumerate(examples_by_filter):
        content += (
            f"{{%- set bad = example_eval_{pos}.results | selectattr('failed', 'defined') | selectattr('failed') | list -%}}"
            f"{{%- set _ = out.update({{'{name}': {{'results': example_eval_{pos}.results"
            " | rejectattr('item', 'in', bad | map(attribute='item') | list) | items2dict(key_name='item', value_name='msg'),"
            " 'errors': bad | items2dict(key_name='item', value_name='msg')}}) -%}"
        )
    content += "{{ out | to_json }}"
    plays.append({
        "name": "Write what the examples gave", "hosts": "localhost", "connection": "local", "gather_facts": False,
        "tasks": [{"name": "Write what the examples gave",
                   "ansible.builtin.copy": {"dest": str(out), "content": content, "mode": "0644"}}],
    })
    return plays


# ---------------------------------------------------------------- modules
def example_tasks(text: str) -> list[dict[str, Any]]:
    tasks = yaml.safe_load(text)
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, dict) and t.get("name") for t in tasks):
        raise AssertionError("module EXAMPLES must be a YAML list of named tasks")
    return tasks


def module_playbook(text: str, hosts: str, variables: Mapping[str, Any] | None = None,
                    pre_tasks: Sequence[Mapping[str, Any]] = (), post_tasks: Sequence[Mapping[str, Any]] = (),
                    **play: Any) -> list[dict[str, Any]]:
    """One play running the examples as written, between the test's own pre and post tasks."""
    body: dict[str, Any] = {"name": "Run the module examples", "hosts": hosts, "gather_facts": False}
    body.update(play)
    if variables:
        body["vars"] = dict(variables)
    body["tasks"] = [*pre_tasks, *example_tasks(text), *post_tasks]
    return [body]


def run_playbook(playbook: list[dict[str, Any]], workdir: Path, collections_path: Path,
                 inventory: Path | None = None, args: Sequence[str] = (), timeout: float = 600,
                 env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Write ``playbook`` under ``workdir`` and run it (localhost only when no inventory is given)."""
    path = workdir / "examples.yml"
    path.write_text(yaml.safe_dump(playbook, sort_keys=False), encoding="utf-8")
    argv = [_tool("ansible-playbook"), str(path), *args]
    if inventory is not None:
        argv[1:1] = ["-i", str(inventory)]
    return subprocess.run(argv, capture_output=True, text=True, env=ansible_env(collections_path, **dict(env or {})),
                          timeout=timeout, check=False, cwd=workdir)


def task_statuses(output: str) -> dict[str, list[str]]:
    """``{task name: ["ok", "changed", "skipping", "fatal", ...]}`` from the default callback's output."""
    out: dict[str, list[str]] = {}
    current: str | None = None
    for line in output.splitlines():
        header = re.match(r"^TASK \[(.*)\] \**$", line)
        if header:
            current = header.group(1)
            out.setdefault(current, [])
            continue
        if line.startswith(("PLAY ", "PLAY RECAP")):
            current = None
            continue
        status = re.match(r"^(ok|changed|skipping|fatal|failed|unreachable): \[", line)
        if current is not None and status:
            out[current].append(status.group(1))
    return out


def assert_examples_ran(proc: subprocess.CompletedProcess[str], text: str) -> dict[str, list[str]]:
    """The playbook succeeded and every example task ran (not skipped) on every host without failing."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"ansible-playbook failed (rc {proc.returncode}):\n{output[-6000:]}"
    statuses = task_statuses(proc.stdout)
    for task in example_tasks(text):
        got = statuses.get(task["name"])
        assert got, f"example task {task['name']!r} did not run:\n{output[-4000:]}"
        assert set(got) <= {"ok", "changed"}, f"example task {task['name']!r}: {got}\n{output[-4000:]}"
    return statuses

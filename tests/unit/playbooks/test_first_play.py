# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The first play of every playbook calls one of the collection's filters in a keyword the controller's main
process templates (its name, or the hosts it targets): Ansible finds a collection's filter by loading every filter
file of the collection, and loading them there once means every worker forked afterwards has them, instead of each
per-host task that calls one of them loading them all again (docs/benchmarks.md). A real run of rollout.yml shows the
filters loaded when its first play starts."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import typing as t

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[3]
PLAYBOOKS = sorted(p.name for p in (ROOT / "playbooks").glob("*.yml"))


def first_play(path: pathlib.Path) -> dict[str, t.Any]:
    play = yaml.safe_load(path.read_text(encoding="utf-8"))[0]
    while "ansible.builtin.import_playbook" in play:
        path = path.parent / play["ansible.builtin.import_playbook"]
        play = yaml.safe_load(path.read_text(encoding="utf-8"))[0]
    return play


def main_process_keyword(play: dict[str, t.Any]) -> str:
    """The keyword the main process templates that calls the collection's filter."""
    for keyword in ("name", "hosts"):
        if "gpufleet.vllm." in str(play.get(keyword, "")):
            return keyword
    raise AssertionError(f"the first play {play.get('name')!r} calls none of the collection's filters in its name or hosts")


def test_every_playbook_is_checked() -> None:
    assert {"rollout.yml", "plan.yml", "probe.yml", "audit.yml", "profile.yml", "rollback.yml", "runtime.yml"} <= set(PLAYBOOKS)


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_the_first_play_calls_a_filter_of_the_collection_in_a_keyword_the_main_process_templates(playbook: str) -> None:
    main_process_keyword(first_play(ROOT / "playbooks" / playbook))


# a callback (runs in the controller's main process): which of the collection's filter files are loaded when each play
# starts, before any task of it runs
CALLBACK = """
import json, os, sys
from ansible.plugins.callback import CallbackBase

class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = 'aggregate'
    CALLBACK_NAME = 'loaded_filters'
    CALLBACK_NEEDS_ENABLED = True

    def v2_playbook_on_play_start(self, play):
        prefix = 'ansible_collections.gpufleet.vllm.plugins.filter.'
        with open(os.environ['LOADED_FILTERS_OUT'], 'a', encoding='utf-8') as out:
            out.write(json.dumps({'play': play.get_name(), 'loaded': sorted(m for m in sys.modules if m.startswith(prefix))}) + '\\n')
"""


def test_the_rollouts_first_play_loads_every_filter_of_the_collection_before_any_worker_runs(tmp_path: pathlib.Path) -> None:
    """ansible-playbook rollout.yml on an inventory of one unreachable host: its first play starts with every
    filter file of the collection loaded in the main process (nothing else of the run loaded them yet); a target
    pattern with a control character stops the run there, naming the variable."""
    sys.path.insert(0, str(ROOT / "tests" / "examples"))
    import doc_examples  # pylint: disable=import-outside-toplevel,import-error

    (tmp_path / "callbacks").mkdir()
    (tmp_path / "callbacks" / "loaded_filters.py").write_text(CALLBACK, encoding="utf-8")
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"gpu-1": {"ansible_host": "192.0.2.1"}}}}), encoding="utf-8")
    out = tmp_path / "loaded.jsonl"
    tree = doc_examples.make_collections_tree(tmp_path / "collections")
    env = doc_examples.ansible_env(tree, ANSIBLE_CALLBACK_PLUGINS=str(tmp_path / "callbacks"),
                                   ANSIBLE_CALLBACKS_ENABLED="loaded_filters", LOADED_FILTERS_OUT=str(out))
    argv = [doc_examples._tool("ansible-playbook"), "-i", str(inventory), str(ROOT / "playbooks" / "rollout.yml")]  # pylint: disable=protected-access
    subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False, cwd=tmp_path)
    first = json.loads(out.read_text(encoding="utf-8").splitlines()[0])
    assert first["play"] == "Check the inputs of all"
    files = sorted("ansible_collections.gpufleet.vllm.plugins.filter." + p.stem for p in (ROOT / "plugins" / "filter").glob("*.py"))
    assert first["loaded"] == files

    proc = subprocess.run([*argv, "-e", json.dumps({"gpufleet_target": "all\tgpu-1"})], capture_output=True, text=True, env=env,
                          timeout=300, check=False, cwd=tmp_path)
    assert proc.returncode != 0
    assert "gpufleet_target: must not contain control characters" in proc.stdout + proc.stderr

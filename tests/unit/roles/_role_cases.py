# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Run one task file of a role for several cases in one ansible-playbook run on localhost.

Each case is a block whose rescue keeps the failure message; the outcome maps every case to
``"ok"`` or that message.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import typing as t

ROOT = pathlib.Path(__file__).resolve().parents[3]
BIN = pathlib.Path(sys.executable).parent


def run_role_cases(tmp: pathlib.Path, role: str, tasks_from: str,
                   cases: t.Mapping[str, t.Mapping[str, t.Any]]) -> tuple[dict[str, str], str]:
    """``cases``: case name -> the role's variables for it. Returns (outcome, ansible-playbook's stdout)."""
    collections = tmp / "collections"
    (collections / "ansible_collections" / "gpufleet").mkdir(parents=True)
    os.symlink(ROOT, collections / "ansible_collections" / "gpufleet" / "vllm")
    tasks: list[dict[str, t.Any]] = []
    for case, role_vars in cases.items():
        tasks.append({
            "name": f"Case {case}",
            "block": [
                {"name": f"Run {tasks_from} for {case}",
                 "ansible.builtin.include_role": {"name": f"gpufleet.vllm.{role}", "tasks_from": tasks_from},
                 "vars": dict(role_vars)},
                {"name": f"Keep {case}", "ansible.builtin.set_fact": {f"case_{case}": "ok"}},
            ],
            "rescue": [{"name": f"Keep the failure of {case}",
                        "ansible.builtin.set_fact": {f"case_{case}": "{{ ansible_failed_result.msg }}"}}],
        })
    tasks.append({"name": "Write the outcome", "ansible.builtin.copy": {
        "dest": str(tmp / "outcome.json"), "mode": "0644",
        "content": "{{ {" + ", ".join(f"'{c}': case_{c}" for c in cases) + "} | to_json }}"}})
    playbook = tmp / f"{tasks_from}.yml"
    playbook.write_text(json.dumps([{"hosts": "localhost", "connection": "local", "gather_facts": False, "tasks": tasks}]))
    binary = BIN / "ansible-playbook"
    if not binary.exists():
        binary = pathlib.Path(shutil.which("ansible-playbook") or "ansible-playbook")
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_NOCOLOR="1",
               ANSIBLE_LOCALHOST_WARNING="0", ANSIBLE_INVENTORY_UNPARSED_WARNING="0")
    argv = [str(binary), "-i", "localhost,", "-e", f"ansible_python_interpreter={sys.executable}", str(playbook)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return json.loads((tmp / "outcome.json").read_text(encoding="utf-8")), proc.stdout

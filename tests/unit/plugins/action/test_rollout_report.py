# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest.mock import MagicMock

import pytest
from ansible.errors import AnsibleActionFail

from ansible_collections.gpufleet.vllm.plugins.action.rollout_report import ActionModule

DATA = {
    "started": "2026-11-29T10:00:00+00:00",
    "classes": {"h200": {"ok": True, "failed": False, "plan": {"decision": "deploy", "kv_cache_memory_bytes": 30333206528}, "reasons": []}},
    "hosts": {
        "gpu-a": {"class": "h200", "batch": 1, "pending": ["vllm"], "touched": True},
        "gpu-b": {"class": "h200", "batch": 1, "pending": ["vllm"], "touched": True, "error": "boot check: engine refused to start"},
    },
    "batches": [{"index": 1, "total": 1, "hosts": ["gpu-a", "gpu-b"], "started": "2026-11-29T10:01:00+00:00"}],
}


def action(args, check_mode=False):
    task = MagicMock()
    task.args = args
    task.async_val = 0
    task.check_mode = check_mode
    task.diff = False
    connection = MagicMock()
    connection._shell.tmpdir = "/nonexistent"
    return ActionModule(task, connection, MagicMock(check_mode=check_mode), MagicMock(), MagicMock(), MagicMock())


def test_writes_a_run_directory(tmp_path):
    result = action({"report_dir": str(tmp_path), "kind": "rollout", "data": DATA}).run(task_vars={})
    assert result["changed"] is True and not result.get("failed")
    path = Path(result["path"])
    assert path.parent == tmp_path and path.name.startswith("rollout-")
    assert sorted(os.listdir(path)) == ["report.html", "report.json", "report.md"]
    assert json.loads((path / "report.json").read_text(encoding="utf-8"))["rolled_back"][0]["host"] == "gpu-b"
    assert result["failed_hosts"] == ["gpu-b"]
    assert result["classes"]["h200"]["hosts"] == {"gpu-a": "deployed", "gpu-b": "rolled_back"}
    assert result["msg"].endswith(f"report: {path}/report.html")


def test_check_mode_and_no_dir_write_nothing(tmp_path):
    result = action({"report_dir": str(tmp_path), "kind": "plan", "data": DATA}, check_mode=True).run(task_vars={})
    assert result["changed"] is False and result["path"] is None and "check mode" in result["msg"]
    assert not os.listdir(tmp_path)
    result = action({"kind": "plan", "data": DATA}).run(task_vars={})
    assert result["path"] is None and result["report"]["kind"] == "plan"


def test_errors_are_clear(tmp_path):
    with pytest.raises(AnsibleActionFail, match=r"cannot write the report under .*missing: .*not a directory"):
        action({"report_dir": str(tmp_path / "missing"), "data": DATA}).run(task_vars={})
    with pytest.raises(AnsibleActionFail, match=r"rollout_report \(rollout\): data.classes"):
        action({"report_dir": str(tmp_path), "data": {"classes": ["h200"]}}).run(task_vars={})
    with pytest.raises(AnsibleActionFail, match="kind must be one of: rollout, plan, probe"):
        action({"report_dir": str(tmp_path), "kind": "deploy", "data": DATA}).run(task_vars={})


def test_a_dry_run_is_recorded_as_one(tmp_path):
    # The playbooks write the report with check_mode: false under --check; ansible_check_mode stays true.
    result = action({"report_dir": str(tmp_path), "kind": "plan", "data": DATA}).run(task_vars={"ansible_check_mode": True})
    assert result["path"] and result["report"]["check_mode"] is True
    stored = json.loads((Path(result["path"]) / "report.json").read_text(encoding="utf-8"))
    assert stored["check_mode"] is True and "check mode: nothing was changed" in result["summary"]
    result = action({"kind": "plan", "data": DATA}).run(task_vars={"ansible_check_mode": False})
    assert result["report"]["check_mode"] is False


def test_probe_report(tmp_path):
    data = {
        "probe": {
            "hosts": {
                "gpu-a": {"class": "h200", "gpus": [{"index": 0, "total_bytes": 150754820096, "free_bytes": 150109880320,
                                                     "boot_free_bytes": 150109880320, "processes": []}],
                          "instances": [{"name": "vllm", "gpus": [0], "port": 8000, "active_state": "inactive"}]},
                "gpu-b": {"error": "unreachable"},
            }
        }
    }
    result = action({"report_dir": str(tmp_path), "kind": "probe", "data": data}).run(task_vars={})
    assert Path(result["path"]).name.startswith("probe-")
    assert result["failed_hosts"] == ["gpu-b"] and result["classes"] == {}
    assert result["summary"].startswith("probe: 1 of 2 host(s) probed, 1 GPU(s), 0 of 1 instance(s) active; lowest boot free")
    with pytest.raises(AnsibleActionFail, match=r"rollout_report \(probe\): data.probe"):
        action({"kind": "probe", "data": {"classes": {}}}).run(task_vars={})


GANG_INVENTORY = """
all:
  children:
    gpufleet_rollout:
      hosts:
        ga: {{gpufleet_host_class: c1, gpufleet_serve_args: {{tensor_parallel_size: 2}},
             gpufleet_instances: [{{name: m, gpus: [0], port: 8000, gang: {gang}}}]}}
        gb: {{gpufleet_host_class: c1, gpufleet_serve_args: {{tensor_parallel_size: 2}},
             gpufleet_instances: [{{name: m, gpus: [0], port: 8000, gang: {gang}}}]}}
        solo: {{gpufleet_host_class: c2, gpufleet_instances: "{{{{ [{{'name': 'x', 'gpus': [0], 'port': 8001}}] }}}}"}}
  vars:
    ansible_connection: local
"""
GANG_PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - gpufleet.vllm.rollout_report:
        kind: "{{ kind }}"
        data: "{{ audit_data if kind == 'audit' else omit }}"
      register: report
    - ansible.builtin.copy:
        content: "{{ report.report.gangs | to_json }}"
        dest: "{{ out }}"
        mode: "0600"
  vars:
    # what audit.yml gives: each member's instance judged on its own host
    audit_data:
      audit:
        hosts:
          ga: {class: c1, error: null, instances: [{instance: m, verdict: ok, ranks: []}]}
          gb: {class: c1, error: null, instances: [{instance: m, verdict: would_refuse, ranks: []}]}
"""


@pytest.mark.parametrize(("kind", "gang", "expected"), [
    ("rollout", "{mode: mp, members: [ga, gb]}",
     [{"name": "m", "leader": "ga", "members": ["ga", "gb"], "class": "c1", "members_outcomes": {"ga": "skipped", "gb": "skipped"},
       "outcome": "skipped"}]),
    # a gang the inventory gets wrong (a leader the inventory does not know): no gang entry, and still a report
    ("rollout", "{mode: mp, members: [ga, gb], leader: nowhere}", []),
    # an audit's gang: its worst member's verdict
    ("audit", "{mode: mp, members: [ga, gb]}",
     [{"name": "m", "leader": "ga", "members": ["ga", "gb"], "class": "c1", "members_outcomes": {"ga": "audited", "gb": "audited"},
       "outcome": "audited", "members_verdicts": {"ga": "ok", "gb": "would_refuse"}, "verdict": "would_refuse"}]),
])
def test_a_runs_report_reads_its_gangs_from_hostvars(tmp_path, kind, gang, expected):
    """Through ansible-playbook, with Ansible's own hostvars: outside a template they cannot answer for a host the
    inventory does not know, which once failed the report of a run whose gang named one."""
    (tmp_path / "inventory.yml").write_text(GANG_INVENTORY.format(gang=gang), encoding="utf-8")
    (tmp_path / "play.yml").write_text(GANG_PLAY, encoding="utf-8")
    collections = tmp_path / "collections"
    (collections / "ansible_collections" / "gpufleet").mkdir(parents=True)
    os.symlink(Path(__file__).resolve().parents[4], collections / "ansible_collections" / "gpufleet" / "vllm")
    playbook = Path(sys.executable).parent / "ansible-playbook"
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_NOCOLOR="1", ANSIBLE_LOCALHOST_WARNING="0")
    out = tmp_path / "gangs.json"
    done = subprocess.run([str(playbook if playbook.exists() else shutil.which("ansible-playbook")), "-i", str(tmp_path / "inventory.yml"),
                           str(tmp_path / "play.yml"), "-e", f"out={out}", "-e", f"kind={kind}", "-e", f"ansible_python_interpreter={sys.executable}"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(out.read_text(encoding="utf-8")) == expected

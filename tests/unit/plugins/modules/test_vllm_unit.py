# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vllm_unit module shell: the secret environment files never reach a log or a result.

systemctl is a small script on PATH (every unit inactive); the logic itself is tested in
tests/unit/plugins/module_utils/test_unit_files.py.
"""
from __future__ import annotations

import json
import os
from typing import Any

import pytest
from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpufleet.vllm.plugins.modules import vllm_unit

SECRET = "hf_unit_test_secret_0123456789"
ENV = f'# Managed by gpufleet.vllm\nHF_TOKEN="{SECRET}"\n'
UNIT = "[Service]\nExecStart=/opt/vllm/venv/bin/vllm serve m\n"


@pytest.fixture
def fake_systemctl(tmp_path, monkeypatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "systemctl"
    script.write_text("#!/bin/sh\n# show: one inactive block per unit\nfor a in \"$@\"; do case $a in vllm-*) "
                      "printf 'LoadState=not-found\\nActiveState=inactive\\nNeedDaemonReload=no\\n\\n';; esac; done\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def run(capsys, monkeypatch, args: dict[str, Any]) -> tuple[int, dict[str, Any], list[str]]:
    logged: list[str] = []
    monkeypatch.setattr(AnsibleModule, "log", lambda self, msg, log_args=None: logged.append(str(msg) + str(log_args)))
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        vllm_unit.main()
    return exc.value.code or 0, json.loads(capsys.readouterr().out), logged


@pytest.mark.parametrize("state", ["status", "present"])
def test_the_secret_is_neither_logged_nor_returned(tmp_path, capsys, monkeypatch, fake_systemctl, state):
    (tmp_path / "systemd").mkdir()
    args = {"state": state, "instances": [{"name": "main", "unit": UNIT}], "env_files": {"main": ENV},
            "unit_dir": str(tmp_path / "systemd"), "state_dir": str(tmp_path / "gpufleet"), "_ansible_diff": True}
    rc, result, logged = run(capsys, monkeypatch, args)
    assert rc == 0, result
    assert logged and any("NOT_LOGGING_PARAMETER" in line for line in logged), logged
    assert SECRET not in "".join(logged), "the invocation log (the host's journal) carries the secret"
    assert SECRET not in json.dumps(result)
    if state == "status":
        assert result["pending"] == ["main"] and "environment file differs" in result["instances"][0]["reasons"]
        assert result["diff"][0]["after"] == UNIT
    else:
        assert result["changed"] and result["instances"][0]["written"] == ["env", "unit"]
        assert (tmp_path / "gpufleet" / "vllm-main.env").read_text() == ENV


def test_env_files_must_name_given_instances(tmp_path, capsys, monkeypatch, fake_systemctl):
    args = {"state": "status", "instances": [{"name": "main", "unit": UNIT}], "env_files": {"other": ENV},
            "unit_dir": str(tmp_path), "state_dir": str(tmp_path / "gpufleet")}
    rc, result, _logged = run(capsys, monkeypatch, args)
    assert rc == 1 and "env_files names instances that are not in instances: other" in result["msg"]


@pytest.mark.parametrize(("args", "message"), [
    ({"state": "present", "names": ["main"]}, "vllm_unit (present): names is for state snapshot or restored"),
    ({"state": "status", "instances": [{"name": "main"}], "stop": True}, "vllm_unit (status): stop is for state snapshot"),
    ({"state": "snapshot", "names": ["main"], "restart": True}, "vllm_unit (snapshot): restart is for state present"),
    ({"state": "snapshot", "names": ["main"], "instances": [{"name": "main"}]}, "mutually exclusive: instances|names"),
    ({"state": "snapshot"}, "one of the following is required: instances, names"),
])
def test_options_that_do_not_fit_the_state_are_refused_by_name(tmp_path, capsys, monkeypatch, fake_systemctl, args, message):
    rc, result, _logged = run(capsys, monkeypatch, dict(args, unit_dir=str(tmp_path), state_dir=str(tmp_path / "gpufleet")))
    assert rc == 1 and message in result["msg"], result


def test_a_snapshot_by_names_with_stop_keeps_the_files_and_stops_nothing_inactive(tmp_path, capsys, monkeypatch, fake_systemctl):
    (tmp_path / "systemd").mkdir()
    args = {"state": "snapshot", "names": ["main"], "stop": True,
            "unit_dir": str(tmp_path / "systemd"), "state_dir": str(tmp_path / "gpufleet")}
    rc, result, _logged = run(capsys, monkeypatch, args)
    assert rc == 0, result
    assert result["stopped"] == [] and result["instances"][0]["absent"] == ["unit", "plan", "env"]
    assert (tmp_path / "gpufleet" / "units" / "vllm-main.service.absent").exists()


def test_present_installs_the_host_tools_in_the_same_call_and_only_once(tmp_path, capsys, monkeypatch, fake_systemctl):
    (tmp_path / "systemd").mkdir()
    gate = tmp_path / "bin" / "gpufleet-vllm-boot-gate"
    args = {"state": "present", "instances": [{"name": "main", "unit": UNIT}], "unit_dir": str(tmp_path / "systemd"),
            "state_dir": str(tmp_path / "gpufleet"),
            "host_tools": {"files": [{"path": str(gate), "content": "#!/bin/sh\nexit 0\n", "mode": "0755"}]}}
    rc, result, _logged = run(capsys, monkeypatch, args)
    assert rc == 0, result
    assert result["host_tools"] == {"written": [str(gate)], "compiled": [], "started": [], "changed": True}
    assert gate.read_text() == "#!/bin/sh\nexit 0\n" and oct(gate.stat().st_mode & 0o777) == "0o755"
    assert result["instances"][0]["written"] == ["unit"]
    rc, again, _logged = run(capsys, monkeypatch, args)
    assert rc == 0 and again["changed"] is False and again["host_tools"]["changed"] is False


@pytest.mark.parametrize(("host_tools", "message"), [
    ({"files": [{"path": "relative/gate", "content": ""}]}, "vllm_unit (present): host_tools: files[0].path"),
    ({"files": [], "compile": ["/opt/lib"]}, "vllm_unit (present): host_tools: python: required with compile"),
])
def test_bad_host_tools_are_refused_by_field_before_any_unit_is_written(tmp_path, capsys, monkeypatch, fake_systemctl,
                                                                        host_tools, message):
    (tmp_path / "systemd").mkdir()
    rc, result, _logged = run(capsys, monkeypatch, {
        "state": "present", "instances": [{"name": "main", "unit": UNIT}], "unit_dir": str(tmp_path / "systemd"),
        "state_dir": str(tmp_path / "gpufleet"), "host_tools": host_tools})
    assert rc == 1 and message in result["msg"], result
    assert not (tmp_path / "systemd" / "vllm-main.service").exists()


def test_host_tools_are_for_state_present(tmp_path, capsys, monkeypatch, fake_systemctl):
    rc, result, _logged = run(capsys, monkeypatch, {"state": "status", "instances": [{"name": "main", "unit": UNIT}],
                                                    "unit_dir": str(tmp_path), "state_dir": str(tmp_path / "gpufleet"),
                                                    "host_tools": {"files": []}})
    assert rc == 1 and "vllm_unit (status): host_tools is for state present" in result["msg"], result

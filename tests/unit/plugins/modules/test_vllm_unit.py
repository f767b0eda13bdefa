# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The vllm_unit module shell: the secret environment files never reach a log or a result.

systemctl is a small script on PATH (every unit inactive); the logic itself is tested in
tests/unit/plugins/module_utils/test_unit_files.py.
"""
from __future__ import annotations

import grp
import json
import os
import pathlib
import platform
import pwd
from typing import Any

import pytest
from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import for_instance
from ansible_collections.gpufleet.vllm.plugins.module_utils._units import _service_account
from ansible_collections.gpufleet.vllm.plugins.modules import vllm_unit
from ansible_collections.gpufleet.vllm.tests.unit.plugins.module_utils.test_nvml_probe import FakeNvml, make_state

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
    ({"state": "status", "instances": [{"name": "main"}], "stop": True}, "vllm_unit (status): stop is for state snapshot, or present with snapshot"),
    ({"state": "present", "instances": [{"name": "main"}], "stop": True}, "vllm_unit (present): stop is for state snapshot, or present with snapshot"),
    ({"state": "snapshot", "names": ["main"], "gate": {"host": "h", "launch": {}, "instances": []}},
     "vllm_unit (snapshot): gate compares the reading of gpu_probe: give gpu_probe too"),
    ({"state": "snapshot", "names": ["main"], "restart": True}, "vllm_unit (snapshot): restart is for state present"),
    ({"state": "snapshot", "names": ["main"], "instances": [{"name": "main"}]}, "mutually exclusive: instances|names"),
    ({"state": "snapshot"}, "one of the following is required: instances, names"),
    ({"state": "snapshot", "names": ["main"], "snapshot": True}, "vllm_unit (snapshot): snapshot is for state present"),
    ({"state": "present", "instances": [{"name": "main"}], "adopt_units": ["vllm.service"]},
     "vllm_unit (present): adopt_units is for state status, snapshot or restored, or present with snapshot"),
    ({"state": "status", "instances": [{"name": "main"}], "runtime_venv": "/opt/vllm/venv"},
     "vllm_unit (status): runtime_venv is for state snapshot, present with snapshot, or restored"),
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
    assert result["stopped"] == [] and result["instances"][0]["absent"] == ["unit", "plan", "env", "dropin"]
    assert json.loads((tmp_path / "gpufleet" / "units" / "vllm-main.snapshot.json").read_text())["files"]["unit"] is None


def test_present_with_snapshot_keeps_the_files_first_in_the_same_call(tmp_path, capsys, monkeypatch, fake_systemctl):
    (tmp_path / "systemd").mkdir()
    args = {"state": "present", "snapshot": True, "instances": [{"name": "main", "unit": UNIT}], "env_files": {"main": ENV},
            "unit_dir": str(tmp_path / "systemd"), "state_dir": str(tmp_path / "gpufleet")}
    rc, result, _logged = run(capsys, monkeypatch, args)
    assert rc == 0, result
    assert result["snapshot"] == [{"name": "main", "kept": [], "absent": ["unit", "plan", "env", "dropin"], "active_state": "inactive",
                                   "serving": False, "change_id": "", "runtime_release": "", "resumed": False}]
    assert result["instances"][0]["written"] == ["env", "unit"] and result["changed"] is True
    # the change is open until the boot check records the plan: the next call keeps the same snapshot
    assert json.loads((tmp_path / "gpufleet" / "units" / "vllm-main.snapshot.json").read_text())["open"], "the change is open"
    rc, again, _logged = run(capsys, monkeypatch, args)
    assert rc == 0 and again["snapshot"][0]["resumed"] is True and again["snapshot"][0]["absent"] == ["unit", "plan", "env", "dropin"]
    assert again["changed"] is False


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


@pytest.fixture
def fake_runuser(tmp_path, monkeypatch) -> pathlib.Path:
    """runuser runs its command as it is (the test may not run as root); a file 'unreadable' is what find prints."""
    bin_dir = tmp_path / "runuser-bin"
    bin_dir.mkdir()
    script = bin_dir / "runuser"
    script.write_text("#!/bin/sh\n[ \"$(pwd)\" = / ] || exit 97\nwhile [ \"$1\" != -- ]; do shift; done; shift\n"
                      f"cat {bin_dir}/unreadable 2>/dev/null\nexit 0\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir / "unreadable"


def test_present_makes_the_account_and_checks_the_model_before_any_unit_is_written(tmp_path, capsys, monkeypatch, fake_systemctl,
                                                                                   fake_runuser):
    (tmp_path / "systemd").mkdir()
    me = pwd.getpwuid(os.getuid())
    # an account with the uid and group of this test (which may run as root, which vLLM may not run as), managed
    # elsewhere (create: false): only the home is made theirs
    svc = pwd.struct_passwd(("svc", "x", me.pw_uid, me.pw_gid, "", me.pw_dir, me.pw_shell))
    monkeypatch.setattr(_service_account, "_user", lambda name: svc if name == "svc" else None)
    account = {"user": "svc", "group": grp.getgrgid(me.pw_gid).gr_name, "home": str(tmp_path / "home"), "create": False,
               "model": str(tmp_path)}
    args = {"state": "present", "instances": [{"name": "main", "unit": UNIT}], "unit_dir": str(tmp_path / "systemd"),
            "state_dir": str(tmp_path / "gpufleet"), "account": account}
    fake_runuser.write_text(f"{tmp_path}/weights.safetensors\n")
    rc, result, _logged = run(capsys, monkeypatch, args)
    assert rc == 1 and result["msg"] == (
        f"vllm_unit (present): account: the service user svc cannot read the model {tmp_path}: "
        f"{tmp_path}/weights.safetensors (give the files to that user or make them readable; the engine would fail with "
        "FileNotFoundError)"), result
    assert not (tmp_path / "systemd" / "vllm-main.service").exists()
    # the account comes first (the model is checked as it): its home is there
    assert oct((tmp_path / "home").stat().st_mode & 0o777) == "0o750"
    fake_runuser.unlink()
    rc, result, _logged = run(capsys, monkeypatch, args)
    assert rc == 0, result
    assert result["account"] == {"changed": False, "account_changed": [], "ready": True, "model_checked": True}
    assert result["changed"] and result["instances"][0]["written"] == ["unit"]
    rc, again, _logged = run(capsys, monkeypatch, args)
    assert rc == 0 and again["changed"] is False and again["account"]["account_changed"] == []


def test_the_account_is_for_state_present(tmp_path, capsys, monkeypatch, fake_systemctl):
    rc, result, _logged = run(capsys, monkeypatch, {"state": "status", "instances": [{"name": "main", "unit": UNIT}],
                                                    "unit_dir": str(tmp_path), "state_dir": str(tmp_path / "gpufleet"),
                                                    "account": {"user": "vllm", "group": "vllm", "home": "/var/lib/vllm"}})
    assert rc == 1 and result["msg"] == "vllm_unit (status): account is for state present", result


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


# ---------------------------------------------------------------- gpu_probe: the gates' NVML reading
@pytest.fixture
def running_systemctl(tmp_path, monkeypatch) -> Any:
    """systemctl where every vllm-* unit is loaded and active until ``systemctl stop``, which it logs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "systemctl.log"
    script = bin_dir / "systemctl"
    script.write_text(
        "#!/bin/sh\n"
        f"echo \"$*\" >> {log}\n"
        f"if [ \"$1\" = stop ]; then touch {tmp_path}/stopped; exit 0; fi\n"
        f"state=active; [ -e {tmp_path}/stopped ] && state=inactive\n"
        "for a in \"$@\"; do case $a in vllm-*) "
        "printf 'LoadState=loaded\\nActiveState=%s\\nNeedDaemonReload=no\\n\\n' $state;; esac; done\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "stopped"


class StopAwareNvml(FakeNvml):
    """FakeNvml that notes, when NVML is initialised, whether the fake systemctl had stopped the units."""

    def __init__(self, state: dict[str, Any], stopped: Any) -> None:
        super().__init__(state)
        self.stopped_marker = stopped
        self.seen_stopped: list[bool] = []

    def nvmlInit(self) -> None:
        self.seen_stopped.append(self.stopped_marker.exists())
        super().nvmlInit()


def probe_args(tmp_path, state: str, **probe: Any) -> dict[str, Any]:
    (tmp_path / "systemd").mkdir(exist_ok=True)
    base = {"state": state, "unit_dir": str(tmp_path / "systemd"), "state_dir": str(tmp_path / "gpufleet"),
            "gpu_probe": dict({"python": "/opt/vllm/venv/bin/python", "devices": ["1"], "samples": 2, "interval": 0,
                               "service_units": ["vllm-main.service"]}, **probe)}
    return base | ({"instances": [{"name": "main", "unit": UNIT}]} if state == "status" else {"names": ["main"], "stop": True})


def test_status_reads_the_gpus_in_the_same_call_while_the_instances_serve(tmp_path, capsys, monkeypatch, running_systemctl):
    nvml = StopAwareNvml(make_state(2), running_systemctl)
    monkeypatch.setattr(vllm_unit, "pynvml", nvml)
    rc, result, _logged = run(capsys, monkeypatch, probe_args(tmp_path, "status"))
    assert rc == 0, result
    assert result["pending"] == ["main"]
    assert [g["index"] for g in result["gpu_probe"]["gpus"]] == [1] and result["gpu_probe"]["gpus"][0]["samples"] == 2
    assert result["gpu_probe"]["gpus"][0]["boot_free_bytes"] > 0
    assert nvml.seen_stopped == [False]


def test_snapshot_reads_the_gpus_after_the_stop(tmp_path, capsys, monkeypatch, running_systemctl):
    nvml = StopAwareNvml(make_state(2), running_systemctl)
    monkeypatch.setattr(vllm_unit, "pynvml", nvml)
    rc, result, _logged = run(capsys, monkeypatch, probe_args(tmp_path, "snapshot"))
    assert rc == 0, result
    assert result["stopped"] == ["vllm-main.service"] and result["changed"] is True
    assert nvml.seen_stopped == [True], "the gate after the stop read NVML before the units had stopped"
    assert [g["index"] for g in result["gpu_probe"]["gpus"]] == [1]


def test_an_nvml_failure_is_reported_for_the_gate_after_the_stop_not_raised(tmp_path, capsys, monkeypatch, running_systemctl):
    state = make_state(2)
    state["gpus"][1]["error"] = 15
    monkeypatch.setattr(vllm_unit, "pynvml", FakeNvml(state))
    monkeypatch.setattr(platform, "node", lambda: "gpu-a1")
    rc, result, _logged = run(capsys, monkeypatch, probe_args(tmp_path, "snapshot"))
    assert rc == 0, result
    # the snapshot and the stop happened: the rollback that the failed gate starts restores them
    assert result["stopped"] == ["vllm-main.service"]
    assert json.loads((tmp_path / "gpufleet" / "units" / "vllm-main.snapshot.json").read_text())["files"]["unit"] is None
    assert result["gpu_probe"]["error"].startswith("gpu-a1: GPU 1: opening the GPU: GPU is lost (NVML_ERROR_GPU_IS_LOST)")
    assert result["gpu_probe"]["gpu"] == "1" and result["gpu_probe"]["nvml_error"] == 15


@pytest.mark.parametrize(("state", "probe", "binding", "message"), [
    ("snapshot", {"samples": 0}, True, "vllm_unit (snapshot): gpu_probe: samples: "),
    ("snapshot", {"interval": -1}, True, "vllm_unit (snapshot): gpu_probe: interval: "),
    ("snapshot", {}, False, "vllm_unit (snapshot): gpu_probe: Failed to import the required Python library (nvidia-ml-py)"),
    ("present", {}, True, "vllm_unit (present): gpu_probe is for state status, snapshot, or present with snapshot"),
])
def test_a_gpu_probe_that_cannot_run_is_refused_before_anything_stops(tmp_path, capsys, monkeypatch, running_systemctl,
                                                                      state, probe, binding, message):
    monkeypatch.setattr(vllm_unit, "pynvml", FakeNvml(make_state(2)) if binding else None)
    monkeypatch.setattr(vllm_unit, "PYNVML_IMPORT_ERROR", None if binding else "ModuleNotFoundError: No module named 'pynvml'")
    args = probe_args(tmp_path, "snapshot", **probe)
    if state == "present":
        args = dict(args, state="present", instances=[{"name": "main", "unit": UNIT}], names=None, stop=False)
        del args["names"]
    rc, result, _logged = run(capsys, monkeypatch, args)
    assert rc == 1 and message in result["msg"], result
    assert not running_systemctl.exists() and not (tmp_path / "gpufleet" / "units").exists()
    if not binding:
        assert "gpu_probe.python /opt/vllm/venv/bin/python" in result["msg"] and "No module named 'pynvml'" in result["msg"]


# ---------------------------------------------------------------- the deploy's one call: keep, stop, gate, write
def write_call_args(tmp_path, floor: int) -> dict[str, Any]:
    launch = for_instance({"decision": "deploy", "kv_cache_memory_bytes": 8 << 30, "gpu_memory_utilization": 0.5,
                           "free_floor_bytes": {"0": floor}}, 0.9)
    return dict(probe_args(tmp_path, "snapshot"), state="present", snapshot=True, restart=True, names=None,
                instances=[{"name": "main", "unit": UNIT}],
                gate={"host": "gpu-a1", "launch": launch, "instances": [{"name": "main", "gpus": [1]}]})


@pytest.mark.parametrize("passes", [True, False])
def test_present_with_snapshot_stops_reads_and_gates_before_it_writes(tmp_path, capsys, monkeypatch, running_systemctl, passes):
    nvml = StopAwareNvml(make_state(2), running_systemctl)
    monkeypatch.setattr(vllm_unit, "pynvml", nvml)
    args = write_call_args(tmp_path, (100 if passes else 200) << 30)
    del args["names"]
    rc, result, _logged = run(capsys, monkeypatch, args)
    assert result["stopped"] == ["vllm-main.service"] and nvml.seen_stopped == [True], result
    assert result["snapshot"][0]["active_state"] == "active", "the snapshot keeps that it ran, so a rollback restarts it"
    assert json.loads((tmp_path / "gpufleet" / "units" / "vllm-main.snapshot.json").read_text())["open"], "the change is open"
    unit = tmp_path / "systemd" / "vllm-main.service"
    if passes:
        assert rc == 0 and result["instances"][0]["written"] == ["unit"] and result["started"] == ["vllm-main.service"], result
        assert unit.read_text() == UNIT
    else:
        assert rc == 1 and result["msg"].startswith(
            "vllm_unit (present): Free-memory gate (after stop) failed on gpu-a1: main rank 0 (GPU 1): boot-free "), result
        assert result["gate_violations"] == [result["msg"].split("gpu-a1: ", 1)[1]] and result["changed"] is True
        assert not unit.exists(), "a failed gate writes nothing"
        assert "restart" not in (tmp_path / "systemctl.log").read_text()


def test_the_host_tools_units_start_after_the_one_reload_of_the_restart(tmp_path, capsys, monkeypatch, running_systemctl):
    (tmp_path / "systemd").mkdir(exist_ok=True)
    timer = tmp_path / "systemd" / "gpufleet-vllm-metrics.timer"
    args = {"state": "present", "restart": True, "instances": [{"name": "main", "unit": UNIT}], "unit_dir": str(tmp_path / "systemd"),
            "state_dir": str(tmp_path / "gpufleet"),
            "host_tools": {"files": [{"path": str(timer), "content": "[Timer]\nOnCalendar=minutely\n"}],
                           "units": ["gpufleet-vllm-metrics.timer"]}}
    rc, result, _logged = run(capsys, monkeypatch, args)
    assert rc == 0, result
    calls = (tmp_path / "systemctl.log").read_text().splitlines()
    assert calls.count("daemon-reload") == 1, calls
    assert calls.index("daemon-reload") < calls.index("restart vllm-main.service") < calls.index("restart gpufleet-vllm-metrics.timer")
    assert result["host_tools"]["started"] == ["gpufleet-vllm-metrics.timer"] and result["host_tools"]["changed"] is True

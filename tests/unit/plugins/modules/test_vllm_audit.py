# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
"""vllm_audit reads a host as the snapshot does: the plan files with the boot gate's reader, NVML with the
probe every reader of a host uses, systemctl through the module's runner (the snapshot's)."""
from __future__ import annotations

import json
import platform
from typing import Any

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpufleet.vllm.plugins.module_utils import _audit
from ansible_collections.gpufleet.vllm.plugins.module_utils._gate import _boot_gate
from ansible_collections.gpufleet.vllm.plugins.modules import vllm_audit
from ansible_collections.gpufleet.vllm.tests.unit.plugins.module_utils.test_audit import plan_doc
from ansible_collections.gpufleet.vllm.tests.unit.plugins.module_utils.test_nvml_probe import FakeNvml, make_state
from ansible_collections.gpufleet.vllm.tests.unit.plugins.modules.test_vllm_host_snapshot import UNITS, FakeSystemctl

GIB = 1 << 30
TOTAL = 140 * GIB
FREE = TOTAL - (512 << 20)


def run(monkeypatch, capsys, args: dict[str, Any], nvml: FakeNvml, systemctl: FakeSystemctl) -> tuple[int, dict[str, Any]]:
    monkeypatch.setattr(vllm_audit, "pynvml", nvml)
    monkeypatch.setattr(platform, "node", lambda: "gpu-a1")
    monkeypatch.setattr(vllm_audit.AnsibleModule, "run_command", lambda self, argv, **kw: systemctl(argv, **kw))
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        vllm_audit.main()
    return exc.value.code or 0, json.loads(capsys.readouterr().out)


def test_the_audit_reads_the_host_through_the_snapshots_readers(monkeypatch, capsys, tmp_path):
    (tmp_path / "main.plan.json").write_text(json.dumps(plan_doc(floor=FREE - GIB, planned_at="2099-01-01T00:00:00Z")))
    (tmp_path / "broken.plan.json").write_text("{")
    systemctl = FakeSystemctl(UNITS)
    rc, out = run(monkeypatch, capsys, {"state_dir": str(tmp_path), "unit_dir": str(tmp_path)}, FakeNvml(make_state(2)), systemctl)
    assert rc == 0 and out["changed"] is False
    (inst,) = out["instances"]
    assert (inst["instance"], inst["next_start"], inst["ranks"][0]["margin_bytes"]) == ("main", "start", GIB)
    # the unit's processes are found with the module's own runner, as the snapshot finds them
    assert systemctl.calls == [["systemctl", "show", "-p", "ControlGroup,MainPID,LoadState", "--", "vllm-main.service"]]
    # an unreadable plan file is named as the boot gate's reader names it (what the next start would say)
    with pytest.raises(_boot_gate.BootGateError) as gate:
        _boot_gate.read_plan(str(tmp_path / "broken.plan.json"))
    assert out["errors"] == [str(gate.value)]


def test_an_nvml_failure_names_the_host_once(monkeypatch, capsys, tmp_path):
    (tmp_path / "main.plan.json").write_text(json.dumps(plan_doc()))
    state = make_state(2)
    state["system"]["init_error"] = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    rc, out = run(monkeypatch, capsys, {"state_dir": str(tmp_path), "unit_dir": str(tmp_path)}, FakeNvml(state), FakeSystemctl(UNITS))
    assert rc == 1 and out["msg"].startswith("gpu-a1: ") and not out["msg"].startswith("gpu-a1: gpu-a1"), out["msg"]


def test_the_probe_gets_the_callers_runner_also_when_each_instance_is_probed_alone(tmp_path, monkeypatch):
    (tmp_path / "a.plan.json").write_text(json.dumps(plan_doc(instance="a", unit="vllm-a.service", gpus=[0])))
    (tmp_path / "b.plan.json").write_text(json.dumps(plan_doc(instance="b", unit="vllm-b.service", gpus=[0])))
    seen: list[Any] = []

    def runner(_argv):
        return 0, "", ""

    def probe(nvml, devices, samples, service_units, host, run_command=None):  # noqa: ARG001
        seen.append((tuple(service_units), run_command))
        if len(service_units) > 1:
            from ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._nvml_probe import NvmlProbeError
            raise NvmlProbeError("GPU 0 is lost")
        return {"gpus": [{"index": 0, "boot_free_bytes": FREE, "total_bytes": TOTAL}]}

    monkeypatch.setattr("ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._nvml_probe.probe", probe)
    got = _audit.audit(str(tmp_path), None, now=1_800_000_000.0, unit_dir=str(tmp_path), run_command=runner)
    assert [i["instance"] for i in got["instances"]] == ["a", "b"]
    assert seen == [(("vllm-a.service", "vllm-b.service"), runner), (("vllm-a.service",), runner), (("vllm-b.service",), runner)]

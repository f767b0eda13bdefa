# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The drift audit: verdicts (the boot gate's rule under each unit's policy, plan age, key),
the textfile metrics written atomically, and audit reports in the report family."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ansible_collections.gpufleet.vllm.plugins.module_utils import _audit
from ansible_collections.gpufleet.vllm.plugins.module_utils._gate import _boot_gate
from ansible_collections.gpufleet.vllm.plugins.module_utils._units import _gang
from ansible_collections.gpufleet.vllm.plugins.module_utils._validate import systemd_exec_start
from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _report, _report_render
from ansible_collections.gpufleet.vllm.tests.fake_nvml import nvml_state

ROOT = Path(__file__).resolve().parents[4]
CACHE = Path(os.environ.get("GPUFLEET_CACHE") or ROOT / ".cache")
LIB = CACHE / "fake-nvml" / "libnvidia-ml.so.1"
GIB = 1 << 30
MIB = 1 << 20
TOTAL = 48305799168
RESERVED = 462422016
FREE = TOTAL - RESERVED
NOW = 1_800_000_000.0  # 2027-01-15


def plan_doc(policy: str = "shrink", floor: int = FREE - GIB, **over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": 2, "instance": "main", "unit": "vllm-main.service", "host_class": "c1", "decision": "deploy",
        "gpus": [0], "kv_cache_memory_bytes": 30 * GIB, "gpu_memory_utilization": 0.85, "free_floor_bytes": {"0": floor},
        "num_blocks": 15360, "kv_cache_tokens": 245760, "max_model_len": 8192, "guard_bytes": 512 * MIB,
        "admission": {"required_tokens": 65536, "required_blocks": 4097},
        "capacity": {"source": "geometry", "bytes_per_block": 2 * MIB, "block_size": 16},
        "planned_at": "2027-01-10T00:00:00Z", "compat_key_hash": "k1", "boot_gate": {"policy": policy, "state_file": None},
    }
    doc.update(over)
    return doc


def judge(doc: dict[str, Any], free: int, **kw: Any) -> dict[str, Any]:
    gpus = [{"index": 0, "boot_free_bytes": free, "total_bytes": TOTAL}]
    return _audit.judge(_boot_gate.parse_plan(doc), gpus, NOW, kw.pop("days", 30.0), **kw)


@pytest.mark.parametrize("policy,free,verdict,next_start", [
    ("shrink", FREE, "ok", "start"),
    ("shrink", FREE - 2 * GIB, "would_shrink", "shrink"),
    ("refuse", FREE - 2 * GIB, "would_refuse", "refuse"),
    ("profile", FREE - 2 * GIB, "would_shrink", "profile"),
    ("shrink", FREE - 30 * GIB, "would_refuse", "refuse"),  # the shrunk budget misses the admission plan
])
def test_verdict_is_what_the_gate_would_do_at_the_next_start(policy, free, verdict, next_start):
    got = judge(plan_doc(policy), free)
    assert (got["verdict"], got["next_start"]) == (verdict, next_start)
    assert got["min_margin_bytes"] == free - (FREE - GIB)


def test_old_plans_and_changed_keys_are_reprofile_due():
    assert judge(plan_doc(), FREE)["plan_age_days"] == pytest.approx((NOW - 1799539200) / 86400, abs=1e-3)
    old = judge(plan_doc(), FREE, days=3.0)
    assert old["verdict"] == "reprofile_due" and "days old (allowed 3)" in old["reasons"][0]
    key = judge(plan_doc(), FREE, reference_key_hash="k2")
    assert key["verdict"] == "reprofile_due" and key["key_matches"] is False
    assert judge(plan_doc(), FREE, reference_key_hash="k1")["verdict"] == "ok"
    # a start that would be refused stays the verdict: it is the worse news
    assert judge(plan_doc("refuse"), FREE - 2 * GIB, days=3.0)["verdict"] == "would_refuse"


def test_an_edited_plan_file_is_its_own_verdict_whatever_its_figures_say():
    """Budget and expectation doubled on the host, a co-tenant below the floor: not 'would_shrink' from the
    edited figures, but the edit itself (the gate refuses the next start)."""
    doc = plan_doc()
    recorded = _boot_gate.plan_checksum(doc)
    edited = dict(doc, kv_cache_memory_bytes=2 * doc["kv_cache_memory_bytes"], kv_cache_tokens=2 * doc["kv_cache_tokens"])
    got = judge(edited, FREE - GIB - 256 * MIB, checksum=recorded, plan_path="/etc/gpufleet/main.plan.json")
    assert got["verdict"] == "plan_edited" and got["recorded_checksum"] == recorded
    assert "plan file /etc/gpufleet/main.plan.json was changed since the deploy wrote it" in got["reasons"][0]
    assert judge(doc, FREE, checksum=recorded)["verdict"] == "ok", "the file as written"
    assert judge(edited, FREE)["verdict"] == "ok", "a unit of an earlier release records no checksum"


def test_a_plan_dated_in_the_future_of_the_judging_clock_is_not_fresh():
    """A host clock 400 days behind: the age would be negative and pass any limit."""
    future = judge(plan_doc(planned_at="2027-01-15T09:00:00Z"), FREE, days=1.0, clock="controller")
    assert future["verdict"] == "reprofile_due" and future["plan_age_days"] < 0
    assert "1.0 h in the future of the controller's clock" in future["reasons"][0]


def test_ages_are_judged_on_the_controllers_clock_and_the_hosts_skew_is_reported(tmp_path, monkeypatch):
    plans = tmp_path / "etc"
    plans.mkdir()
    (plans / "main.plan.json").write_text(json.dumps(plan_doc()))

    def probe(nvml, devices, samples, service_units, host, run_command=None):  # noqa: ARG001 - the audit's NVML probe
        return {"gpus": [{"index": 0, "boot_free_bytes": FREE, "total_bytes": TOTAL}]}

    monkeypatch.setattr("ansible_collections.gpufleet.vllm.plugins.module_utils._gpu._nvml_probe.probe", probe)
    behind = NOW - 400 * 86400  # the host's clock 400 days behind the controller's
    got = _audit.audit(str(plans), None, now=behind, reprofile_after_days=1.0, unit_dir=str(tmp_path), controller_time=NOW)
    assert got["clock_skew_seconds"] == -400 * 86400
    (inst,) = got["instances"]
    assert inst["plan_age_days"] == pytest.approx((NOW - 1799539200) / 86400, abs=1e-3), "on the controller's clock"
    assert inst["verdict"] == "reprofile_due"
    assert any("days old (allowed 1)" in r for r in inst["reasons"])
    assert any("the host's clock is 34560000 s behind the controller's" in r for r in inst["reasons"])
    alone = _audit.audit(str(plans), None, now=NOW, reprofile_after_days=30.0, unit_dir=str(tmp_path))
    assert alone["clock_skew_seconds"] is None and alone["instances"][0]["verdict"] == "ok"


def test_the_checksum_is_read_from_the_drop_in_beside_the_unit(tmp_path):
    digest = "a" * 64
    (tmp_path / "vllm-main.service.d").mkdir()
    (tmp_path / "vllm-main.service.d" / "gpufleet-plan.conf").write_text(
        f"# written by the deploy\n[Service]\nEnvironment=GPUFLEET_PLAN_SHA256={digest}\n")
    assert _audit.recorded_checksum(str(tmp_path), "vllm-main.service") == digest
    assert _audit.recorded_checksum(str(tmp_path), "vllm-other.service") is None


def test_textfile_metrics_carry_the_margin_and_the_degraded_flag(tmp_path):
    entry = judge(plan_doc(), FREE - 2 * GIB)
    entry["last_start"] = {"action": "shrink", "degraded": {"kv_cache_memory_bytes_after": 29 * GIB},
                           "kv_cache_memory_bytes": 29 * GIB, "kv_cache_tokens": 237568}
    report = {"checked_at": NOW, "errors": [], "instances": [entry]}
    out = tmp_path / "gpufleet_vllm.prom"
    prometheus_client.write_to_textfile(str(out), _audit.registry(report, prometheus_client))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(out.read_text()) for s in fam.samples}
    rank = (("class", "c1"), ("gpu", "0"), ("rank", "0"), ("vllm_instance", "main"))
    inst = (("class", "c1"), ("vllm_instance", "main"))
    assert samples[("gpufleet_vllm_margin_bytes", rank)] == -GIB
    assert samples[("gpufleet_vllm_floor_bytes", rank)] == FREE - GIB
    assert samples[("gpufleet_vllm_boot_free_bytes", rank)] == FREE - 2 * GIB
    assert samples[("gpufleet_vllm_budget_bytes", inst)] == 30 * GIB
    assert samples[("gpufleet_vllm_started_budget_bytes", inst)] == 29 * GIB
    assert samples[("gpufleet_vllm_degraded", inst)] == 1
    assert samples[("gpufleet_vllm_would_shrink", inst)] == 1
    assert samples[("gpufleet_vllm_would_refuse", inst)] == 0
    assert samples[("gpufleet_vllm_plan_edited", inst)] == 0
    assert samples[("gpufleet_vllm_plan_timestamp_seconds", inst)] == 1799539200
    assert samples[("gpufleet_vllm_last_audit_timestamp_seconds", inst)] == NOW
    assert [p.name for p in tmp_path.iterdir()] == ["gpufleet_vllm.prom"], "no temporary file is left"


def test_a_gang_member_is_labelled_with_where_its_gang_meets(tmp_path):
    """The rank arguments the role renders for a member of a gang are read back from its unit: the exporter labels the
    member with the address its members meet at, so that Prometheus judges the gang by its worst member."""
    gang = _gang.Gang("mp", ("gpu-a", "gpu-b"), "10.0.0.21", 29501, 2, 1, 1, {"gpu-a": 1, "gpu-b": 1}, {}, "")
    for host, leader in (("gpu-a", True), ("gpu-b", False)):
        words = ["serve", "/models/m", "--tensor-parallel-size", "2", *_gang.member_args(gang, host)]
        (tmp_path / f"vllm-{host}.service").write_text(
            f"[Service]\nExecStart={systemd_exec_start('/opt/vllm/bin/vllm', words)}\nRestart=on-failure\n")
        assert _audit.unit_gang(str(tmp_path), f"vllm-{host}.service") == {"gang": "10.0.0.21:29501", "leader": leader}
    dp = _gang.Gang("dp", ("gpu-a", "gpu-b"), "10.0.0.22", 13345, 1, 1, 2, {"gpu-a": 1, "gpu-b": 1}, {}, "")
    assert _gang.member_of_args(_gang.member_args(dp, "gpu-b")) == {"gang": "10.0.0.22:13345", "leader": False}
    assert _gang.member_of_args(_gang.member_args(dp, "gpu-a")) == {"gang": "10.0.0.22:13345", "leader": True}
    # an instance on one host, a unit that is not there: no gang
    (tmp_path / "vllm-one.service").write_text(f"[Service]\nExecStart={systemd_exec_start('/opt/vllm/bin/vllm', ['serve', 'm'])}\n")
    assert _audit.unit_gang(str(tmp_path), "vllm-one.service") is None
    assert _audit.unit_gang(str(tmp_path), "vllm-gone.service") is None
    entry = judge(plan_doc(), FREE - 2 * GIB)
    entry["gang"] = {"gang": "10.0.0.21:29501", "leader": False}
    alone = dict(judge(plan_doc(), FREE), instance="one", gang=None)
    out = tmp_path / "gpufleet_vllm.prom"
    prometheus_client.write_to_textfile(str(out), _audit.registry({"checked_at": NOW, "errors": [], "instances": [entry, alone]},
                                                                  prometheus_client))
    members = [s.labels for fam in text_string_to_metric_families(out.read_text()) for s in fam.samples
               if s.name == "gpufleet_vllm_gang_member"]
    assert members == [{"vllm_instance": "main", "class": "c1", "gang": "10.0.0.21:29501", "leader": "false"}], members


def run_exporter(tmp_path: Path, plans: Path, pythonpath_first: str = "") -> tuple[subprocess.CompletedProcess[str], Path]:
    """The exporter program in a fresh interpreter, real pynvml on the fake library (state in ``tmp_path/state``);
    ``pythonpath_first`` goes before the interpreter's own PYTHONPATH."""
    out = tmp_path / "textfile" / "gpufleet_vllm.prom"
    out.parent.mkdir()
    # this machine may run no systemd: a systemctl that knows the unit but no process of it
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text("#!/bin/sh\nprintf 'ControlGroup=\\nMainPID=0\\nLoadState=loaded\\n'\n")
    (bin_dir / "systemctl").chmod(0o755)
    code = ("import sys; from ansible_collections.gpufleet.vllm.plugins.module_utils._audit import exporter_main; "
            "sys.exit(exporter_main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "--state-dir", str(plans), "--out", str(out)],
                          env=dict(os.environ, LD_LIBRARY_PATH=str(LIB.parent), FAKE_NVML_STATE=str(tmp_path / "state"),
                                   PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                                   PYTHONPATH=os.pathsep.join(p for p in (pythonpath_first, os.environ.get("PYTHONPATH", "")) if p)),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done, out


@pytest.mark.skipif(not LIB.exists(), reason=f"fake NVML library not built ({LIB}); run `make fake-nvml`")
def test_exporter_end_to_end_on_the_fake_nvml(tmp_path):
    """The exporter program in a fresh interpreter: real pynvml on the fake library, two plan files
    (one unreadable), a co-tenant below the floor."""
    state = nvml_state.new_state()
    state["gpus"] = [nvml_state.make_gpu(0, TOTAL, reserved=RESERVED, name="NVIDIA L40S", cc="8.9")]
    nvml_state.add_process(state, gpu=0, pid=999999, used=2 * GIB, name="cotenant", pidns="other")
    nvml_state.save(tmp_path / "state", state)
    plans = tmp_path / "etc"
    plans.mkdir()
    (plans / "main.plan.json").write_text(json.dumps(plan_doc("refuse")))
    (plans / "broken.plan.json").write_text("{")
    done, out = run_exporter(tmp_path, plans)
    assert "1 instance(s), worst verdict would_refuse" in done.stdout
    samples = {(s.name, s.labels.get("vllm_instance")): s.value
               for fam in text_string_to_metric_families(out.read_text()) for s in fam.samples}
    assert samples[("gpufleet_vllm_margin_bytes", "main")] == -GIB, samples
    assert samples[("gpufleet_vllm_plan_file_errors", None)] == 1
    assert samples[("gpufleet_vllm_would_refuse", "main")] == 1


@pytest.mark.skipif(not LIB.exists(), reason=f"fake NVML library not built ({LIB}); run `make fake-nvml`")
def test_the_exporter_finds_the_pynvml_vllm_ships_as_the_boot_gate_does(tmp_path):
    """The exporter runs with the boot gate's interpreter, a vLLM venv that may lack nvidia-ml-py (the CPU build
    does) but has vllm/third_party/pynvml.py: it loads that copy (here, the real binding's source), as the gate does."""
    import pynvml  # pylint: disable=import-outside-toplevel
    shadow = tmp_path / "path"
    (shadow / "pynvml").mkdir(parents=True)
    (shadow / "pynvml" / "__init__.py").write_text("raise ImportError('No module named pynvml (nvidia-ml-py is not installed)')\n")
    (shadow / "vllm" / "third_party").mkdir(parents=True)
    (shadow / "vllm" / "__init__.py").write_text("raise RuntimeError('the vllm package must not be imported')\n")
    (shadow / "vllm" / "third_party" / "pynvml.py").write_text(Path(pynvml.__file__).read_text(encoding="utf-8"))
    state = nvml_state.new_state()
    state["gpus"] = [nvml_state.make_gpu(0, TOTAL, reserved=RESERVED, name="NVIDIA L40S", cc="8.9")]
    nvml_state.save(tmp_path / "state", state)
    plans = tmp_path / "etc"
    plans.mkdir()
    (plans / "main.plan.json").write_text(json.dumps(plan_doc("refuse")))
    done, out = run_exporter(tmp_path, plans, pythonpath_first=str(shadow))
    assert "1 instance(s)" in done.stdout, done.stderr
    assert "gpufleet_vllm_margin_bytes{" in out.read_text()


@pytest.mark.skipif(not LIB.exists(), reason=f"fake NVML library not built ({LIB}); run `make fake-nvml`")
def test_one_gpu_nvml_cannot_read_does_not_blind_the_other_instances(tmp_path):
    """GPU 1 is lost (every NVML call on it fails): the instance on GPU 0 keeps its figures, the one on GPU 1
    is named with the NVML error, and the last start's action and a refused last start are exported."""
    state = nvml_state.new_state()
    state["gpus"] = [nvml_state.make_gpu(0, TOTAL, reserved=RESERVED, name="NVIDIA L40S", cc="8.9"),
                     nvml_state.make_gpu(1, TOTAL, reserved=RESERVED, name="NVIDIA L40S", cc="8.9", error=15)]
    nvml_state.save(tmp_path / "state", state)
    plans = tmp_path / "etc"
    plans.mkdir()
    gate_state = tmp_path / "a.gate.json"
    doc_a = plan_doc(instance="a", unit="vllm-a.service", boot_gate={"policy": "refuse", "state_file": str(gate_state)})
    (plans / "a.plan.json").write_text(json.dumps(doc_a))
    # the gate's own record of a refused start (a co-tenant was there then)
    plan_a = _boot_gate.parse_plan(doc_a)
    refused = _boot_gate.decide(plan_a, [{"index": 0, "boot_free_bytes": FREE - 2 * GIB, "total_bytes": TOTAL}], "refuse")
    gate_state.write_text(json.dumps(_boot_gate.state_record(plan_a, refused, str(plans / "a.plan.json"), NOW - 60, None, 0.01)))
    (plans / "b.plan.json").write_text(json.dumps(plan_doc(instance="b", unit="vllm-b.service", gpus=[1])))
    done, out = run_exporter(tmp_path, plans)
    assert "b: NVML probe failed" in done.stderr and "2 instance(s), worst verdict would_refuse" in done.stdout
    samples = {(s.name, s.labels.get("vllm_instance"), s.labels.get("action")): s.value
               for fam in text_string_to_metric_families(out.read_text()) for s in fam.samples}
    assert samples[("gpufleet_vllm_margin_bytes", "a", None)] == GIB, samples
    assert samples[("gpufleet_vllm_nvml_error", "a", None)] == 0 and samples[("gpufleet_vllm_nvml_error", "b", None)] == 1
    assert samples[("gpufleet_vllm_would_refuse", "b", None)] == 1
    assert ("gpufleet_vllm_margin_bytes", "b", None) not in samples
    assert samples[("gpufleet_vllm_last_start_refused", "a", None)] == 1
    assert samples[("gpufleet_vllm_last_start_action", "a", "refuse")] == 1
    assert samples[("gpufleet_vllm_last_start_timestamp_seconds", "a", None)] == NOW - 60
    # an instance without a start record exports no last-start series
    assert ("gpufleet_vllm_last_start_refused", "b", None) not in samples


@pytest.mark.skipif(not LIB.exists(), reason=f"fake NVML library not built ({LIB}); run `make fake-nvml`")
def test_gpu_health_is_exported_per_check_and_an_unhealthy_gpu_would_be_refused(tmp_path):
    """Two H200-like GPUs (retired pages NOT_SUPPORTED, as on driver 580): GPU 1 has uncorrectable ECC errors since
    the driver loaded. Each answered check is one series (1 healthy, 0 not); retired pages have none; the instance on
    GPU 1 would be refused (gpu_health refuse, the default), the one on GPU 0 not."""
    uuids = ["GPU-00000000-0000-4000-8000-00000000000a", "GPU-00000000-0000-4000-8000-00000000000b"]
    state = nvml_state.new_state()
    state["gpus"] = [nvml_state.make_gpu(i, TOTAL, reserved=RESERVED, name="NVIDIA H200", uuid=uuids[i],
                                         unsupported=["nvmlDeviceGetRetiredPagesPendingStatus"],
                                         ecc_uncorrected_volatile=2 if i else 0) for i in range(2)]
    nvml_state.save(tmp_path / "state", state)
    plans = tmp_path / "etc"
    plans.mkdir()
    (plans / "a.plan.json").write_text(json.dumps(plan_doc(instance="a", unit="vllm-a.service")))
    (plans / "b.plan.json").write_text(json.dumps(plan_doc(instance="b", unit="vllm-b.service", gpus=[1])))
    _done, out = run_exporter(tmp_path, plans)
    health = {(s.labels["vllm_instance"], s.labels["gpu"], s.labels["uuid"], s.labels["check"]): s.value
              for fam in text_string_to_metric_families(out.read_text()) for s in fam.samples if s.name == "gpufleet_vllm_gpu_health"}
    assert health == {
        **{("a", "0", uuids[0], check): 1.0 for check in ("ecc_uncorrected", "remap_pending", "remap_failure", "nvml_queries")},
        **{("b", "1", uuids[1], check): 1.0 for check in ("remap_pending", "remap_failure", "nvml_queries")},
        ("b", "1", uuids[1], "ecc_uncorrected"): 0.0,
    }
    samples = {(s.name, s.labels.get("vllm_instance")): s.value
               for fam in text_string_to_metric_families(out.read_text()) for s in fam.samples}
    assert samples[("gpufleet_vllm_would_refuse", "a")] == 0 and samples[("gpufleet_vllm_would_refuse", "b")] == 1
    # which card each rank is on now: UUID and PCI bus id (the fake library puts card i at bus 0x18 + i)
    info = {(s.labels["vllm_instance"], s.labels["rank"], s.labels["uuid"], s.labels["pci_bus_id"]): s.value
            for fam in text_string_to_metric_families(out.read_text()) for s in fam.samples if s.name == "gpufleet_vllm_gpu_info"}
    assert info == {("a", "0", uuids[0], "00000000:18:00.0"): 1.0, ("b", "0", uuids[1], "00000000:19:00.0"): 1.0}


def test_exporter_refuses_a_file_node_exporter_would_not_read(tmp_path, capsys):
    assert _audit.exporter_main(["--out", str(tmp_path / "x.txt")], nvml=object(), prometheus=prometheus_client) == 2
    assert "node_exporter reads only *.prom files" in capsys.readouterr().err


def audit_data(verdicts: dict[str, str]) -> dict[str, Any]:
    hosts = {}
    for host, verdict in verdicts.items():
        entry = judge(plan_doc("refuse" if verdict == "would_refuse" else "shrink"),
                      FREE - 2 * GIB if verdict != "ok" else FREE)
        assert entry["verdict"] == verdict
        hosts[host] = {"class": "c1", "error": None, "instances": [entry]}
    hosts["gpu-gone"] = {"class": "c1", "error": "unreachable: ssh timed out", "instances": []}
    return {"started": "2027-01-15T08:00:00+00:00", "audit": {"hosts": hosts}}


def test_audit_report_names_the_hosts_that_would_be_refused():
    report = _report.build_report(audit_data({"gpu-a": "ok", "gpu-b": "would_refuse", "gpu-c": "would_shrink"}), "audit")
    assert report["kind"] == "audit"
    summary = report["summary"]["audit"]
    assert summary["would_refuse"] == ["gpu-b/main"] and summary["would_shrink"] == ["gpu-c/main"]
    assert summary["verdicts"] == {"would_refuse": 1, "would_shrink": 1, "ok": 1}
    assert report["failed_hosts"] == ["gpu-gone"] and report["summary"]["ok"] is False
    assert {h["host"]: h["outcome"] for h in report["hosts"]}["gpu-a"] == "audited"
    line = _report_render.summary_line(report)
    assert "refused at next start: gpu-b/main" in line and "failed hosts gpu-gone" in line
    md = _report_render.render_markdown(report)
    assert "| main | would refuse | refuse | 0 | 0 |" in md
    assert "-1GiB" in md
    page = _report_render.render_html(report)
    assert '<span class="bad">would refuse</span>' in page
    # stored and read back like every other report
    again = _report.load_report(json.loads(json.dumps(report)))
    assert again["audit"]["hosts"][1]["instances"][0]["verdict"] == "would_refuse"


def test_audit_report_rejects_an_unknown_verdict():
    data = audit_data({"gpu-a": "ok"})
    data["audit"]["hosts"]["gpu-a"]["instances"][0]["verdict"] = "fine"
    with pytest.raises(_report.ReportError, match="verdict: expected one of"):
        _report.build_report(data, "audit")


def test_an_audit_judges_a_gang_by_its_worst_member():
    """gpu-a leads a gang with gpu-b; gpu-b's rank would be refused: the whole gang would not start again. A member whose
    instance was not audited counts as refused, as nothing says it would start."""
    data = audit_data({"gpu-a": "ok", "gpu-b": "would_refuse", "gpu-c": "ok"})
    data["gangs"] = [{"name": "main", "leader": "gpu-a", "members": ["gpu-a", "gpu-b"], "host_class": "c1"},
                     {"name": "main", "leader": "gpu-c", "members": ["gpu-c", "gpu-gone"], "host_class": "c1"}]
    report = _report.build_report(data, "audit")
    first, second = report["gangs"]
    assert (first["verdict"], first["members_verdicts"]) == ("would_refuse", {"gpu-a": "ok", "gpu-b": "would_refuse"})
    assert (second["verdict"], second["members_verdicts"]["gpu-gone"]) == ("would_refuse", "would_refuse")
    assert report["summary"]["audit"]["gangs"] == {"main@gpu-a": "would_refuse", "main@gpu-c": "would_refuse"}
    md = _report_render.render_markdown(report)
    assert "| instance | class | members | verdict |" in md
    assert "| main (leader gpu-a) | c1 | gpu-a (ok), gpu-b (would refuse) | would refuse |" in md, md
    text = _report_render.render_html(report)
    assert "gpu-b (would refuse)" in text
    data["gangs"] = data["gangs"][:1]
    data["audit"]["hosts"]["gpu-b"] = data["audit"]["hosts"]["gpu-a"]
    assert _report.build_report(data, "audit")["summary"]["audit"]["gangs"] == {"main@gpu-a": "ok"}
    assert _report.load_report(json.loads(json.dumps(report)))["gangs"][0]["verdict"] == "would_refuse"

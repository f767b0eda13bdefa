# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

import datetime as dt
import json
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _report, _report_render
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._report import SCHEMA_VERSION, ReportError, build_report, load_report
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._report_render import (
    render_analysis_svg,
    render_html,
    render_markdown,
    summary_line,
    write_run_dir,
)

GIB = 1024**3
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "report"
WHEN = dt.datetime(2026, 11, 29, 10, 9, 12, tzinfo=dt.timezone.utc)


def seed_plan(**over):
    """The design's seed example on two hosts: F_ref 42 GiB, B_ref 30 GiB, G 0.5 GiB, weakest 40.75 GiB -> 28.25 GiB."""
    spec = {
        "host_class": "h200",
        "reference": {
            "ranks": [{"rank": 0, "free_bytes": "42GiB", "kv_bytes": "30GiB"}],
            "total_bytes": "141GiB",
            "bytes_per_block": 16 * 131072,
            "block_size": 16,
            "kv_dtype_bytes": 2,
        },
        "hosts": {"gpu-a/vllm": [{"rank": 0, "boot_free_bytes": "40.75GiB"}], "gpu-b/vllm": [{"rank": 0, "boot_free_bytes": "41.5GiB"}]},
        "guard_bytes": "0.5GiB",
        "max_model_len": 8192,
        "max_capacity_loss": 0.5,
    }
    spec.update(over)
    return plan_class(spec)


CANARY_PROFILED = {
    "verdict": "pass",
    "kv_cache_tokens": 246640,
    "num_blocks": 15415,
    "preemptions": 0,
    "load": {"completed": 16, "failed": 0, "ttft_p50": 0.041, "ttft_p95": 0.087, "e2e_p50": 0.61, "e2e_p95": 0.93},
    "reasons": [],
}
CANARY_MANUAL = dict(CANARY_PROFILED, verdict="pass", kv_cache_tokens=231424, load=dict(CANARY_PROFILED["load"], ttft_p95=0.091))


def rollout_data(plan=None, failed_b=False):
    plan = plan or seed_plan()
    hosts = {
        "gpu-a": {"class": "h200", "batch": 1, "pending": ["vllm"], "touched": True},
        "gpu-b": {"class": "h200", "batch": 2, "pending": ["vllm"], "touched": True},
        "gpu-c": {"class": "h200", "batch": None, "pending": []},
    }
    batches = [
        {"index": 1, "total": 3, "hosts": ["gpu-a"], "started": "2026-11-29T10:05:00+00:00", "finished": "2026-11-29T10:06:30+00:00"},
        {"index": 2, "total": 3, "hosts": ["gpu-b"], "started": "2026-11-29T10:06:31+00:00"},
    ]
    if failed_b:
        hosts["gpu-b"].update(
            error="vllm-vllm.service: boot check failed: ValueError: No available memory for the cache blocks.",
            failed_task="Start and check the new units",
        )
    else:
        batches[1]["finished"] = "2026-11-29T10:07:31+00:00"
        hosts["gpu-c"].update(batch=3)
        batches.append({"index": 3, "total": 3, "hosts": ["gpu-c"], "started": "2026-11-29T10:07:32+00:00", "finished": "2026-11-29T10:08:00+00:00"})
    return {
        "started": "2026-11-29T10:00:00+00:00",
        "finished": "2026-11-29T10:09:00+00:00",
        "classes": {
            "h200": {
                "ok": True,
                "failed": False,
                "plan": plan,
                "key_hash": "3f2a9c0d11e4b7a2",
                "manual_canary": "pass",
                "reasons": plan["reasons"],
                "canaries": {"profiled": CANARY_PROFILED, "manual": CANARY_MANUAL},
            }
        },
        "hosts": hosts,
        "batches": batches,
    }


class _Text(HTMLParser):
    def __init__(self):
        super().__init__()
        self.chunks = []
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.chunks.append(data)


def html_text(page):
    parser = _Text()
    parser.feed(page)
    return " ".join(" ".join(parser.chunks).split()), parser.tags


def test_a_gangs_ranks_name_the_member_host_they_run_on():
    """One instance over a and b: rank 1 runs on b (the weakest); the report keeps the member and says so."""
    plan = seed_plan(reference={"ranks": [{"rank": r, "free_bytes": "42GiB", "kv_bytes": "30GiB", "host": "ab"[r]} for r in range(2)],
                                "total_bytes": "141GiB", "bytes_per_block": 16 * 131072, "block_size": 16, "kv_dtype_bytes": 2},
                     hosts={"a/main": [{"rank": 0, "boot_free_bytes": "41.5GiB", "member": "a"},
                                       {"rank": 1, "boot_free_bytes": "40.75GiB", "member": "b"}]})
    report = build_report(rollout_data(plan), "rollout", generated=WHEN)
    cls = report["classes"][0]
    assert cls["weakest"] == {"host": "a/main", "rank": 1, "member": "b", "adjusted_bytes": int(28.25 * GIB)}
    assert [r.get("member") for r in cls["per_rank"]] == ["a", "b"]
    md = render_markdown(report)
    assert "| a/main (on b) (weakest) | 1 | 40.75GiB |" in md and "| a/main | 0 | 41.5GiB |" in md, md
    assert "a/main (on b) rank 1" in md


def test_seed_example_figures_reach_every_renderer():
    plan = seed_plan()
    assert plan["kv_cache_memory_bytes"] == int(28.25 * GIB)
    report = build_report(rollout_data(plan), "rollout", generated=WHEN)
    assert report["schema_version"] == SCHEMA_VERSION == 2
    assert report["probe"] is None and report["check_mode"] is False
    cls = report["classes"][0]
    assert cls["plan"]["kv_cache_memory_bytes"] == int(28.25 * GIB)
    assert cls["weakest"] == {"host": "gpu-a/vllm", "rank": 0, "adjusted_bytes": int(28.25 * GIB)}
    # F_floor = F_ref - (B_ref - G - B_launch) = 42 - (30 - 0.5 - 28.25) = 40.75 GiB
    assert cls["free_floor_bytes"] == {"0": int(40.75 * GIB)}
    assert cls["what_if_fp8"]["kv_cache_tokens"] == 2 * plan["kv_cache_tokens"]
    md = render_markdown(report)
    assert "28.25GiB (30333206528 bytes)" in md
    assert "rank 0: 40.75GiB" in md
    assert "| gpu-a/vllm (weakest) | 0 | 40.75GiB | 40.75GiB | +1.25GiB | 28.25GiB | +0B |" in md
    assert "| manual | pass | 231424 | 0 | 0 | 0.041 | 0.091 | 0.61 | 0.93 |" in md
    text, _tags = html_text(render_html(report))
    assert "28.25GiB (30333206528 bytes)" in text
    assert "gpu-a/vllm rank 0 *" in text  # SVG label of the weakest rank


def test_outcomes_batches_and_rolled_back_hosts():
    report = build_report(rollout_data(failed_b=True), "rollout", generated=WHEN)
    outcome = {h["host"]: h["outcome"] for h in report["hosts"]}
    assert outcome == {"gpu-a": "deployed", "gpu-b": "rolled_back", "gpu-c": "not_reached"}
    assert report["failed_hosts"] == ["gpu-b"]
    assert report["rolled_back"][0]["error"].endswith("No available memory for the cache blocks.")
    assert [(b["index"], b["outcome"], b["seconds"]) for b in report["batches"]] == [(1, "ok", 90.0), (2, "failed", 149.0)]
    assert report["summary"]["ok"] is False
    # the class ended split between the plans (a rollout that stops: gpufleet_on_failure stop)
    assert summary_line(report) == ("rollout: 1 class(es), 1 deployable; 1 rolled back, 1 not reached, 1 deployed; failed hosts gpu-b; "
                                    "class h200 split: 1 host(s) on the new plan, 2 on the previous")
    assert report["classes"][0]["final"] == {"state": "mixed", "new_plan": ["gpu-a"], "previous": ["gpu-b", "gpu-c"], "failed": []}
    # a dry run changed nothing: the host it would deploy is still on its previous plan
    dry = build_report(dict(rollout_data(), check_mode=True), "rollout", generated=WHEN)
    deployed = [h["host"] for h in dry["hosts"] if h["outcome"] == "deployed"]
    assert deployed and set(deployed) <= set(dry["classes"][0]["final"]["previous"]), (deployed, dry["classes"][0]["final"])
    assert not set(deployed) & set(dry["classes"][0]["final"]["new_plan"])
    assert load_report(dict(dry, classes=[{k: v for k, v in c.items() if k != "final"} for c in dry["classes"]]))["classes"][0]["final"] \
        == dry["classes"][0]["final"]
    md = render_markdown(report)
    assert "## Rolled back" in md and "**gpu-b** (class h200, batch 2): vllm-vllm.service: boot check failed" in md
    assert "| 2 of 3 | gpu-b (rolled back) | 149 | failed |" in md
    text, _tags = html_text(render_html(report))
    assert "No available memory for the cache blocks." in text


def test_a_host_failing_the_input_check_before_the_batches_fails_the_report():
    data = rollout_data()
    for name in data["hosts"]:
        data["hosts"][name].update(batch=None, pending=[], touched=False)
    data["batches"] = []
    data["hosts"]["gpu-c"].update(error="vllm_service on gpu-c: instance main needs gpus (a non-empty list) and a port in 1..65535.",
                                  failed_task="Check that every instance has GPUs and a port")
    report = build_report(data, "rollout", generated=WHEN)
    outcome = {h["host"]: h["outcome"] for h in report["hosts"]}
    assert outcome == {"gpu-a": "not_reached", "gpu-b": "not_reached", "gpu-c": "failed"}
    assert report["failed_hosts"] == ["gpu-c"] and report["summary"]["ok"] is False


def test_clean_rollout_is_ok_and_untouched_host_is_unchanged():
    data = rollout_data()
    data["hosts"]["gpu-c"]["pending"] = []
    report = build_report(data, "rollout", generated=WHEN)
    assert {h["host"]: h["outcome"] for h in report["hosts"]} == {"gpu-a": "deployed", "gpu-b": "deployed", "gpu-c": "unchanged"}
    assert report["summary"]["ok"] is True and report["rolled_back"] == []
    assert [b["outcome"] for b in report["batches"]] == ["ok", "ok", "ok"]


def test_failed_and_skipped_classes_and_plan_kind():
    data = {
        "classes": {
            "a100": {"ok": False, "failed": True, "plan": {}, "reasons": ["class a100 stopped on x: profiled canary failed"]},
            "l40s": {"ok": False, "failed": False, "plan": {"decision": "refuse"}, "reasons": ["no reference"]},
            "h200": {"ok": True, "failed": False, "plan": seed_plan(), "reasons": []},
        },
        "hosts": {"x": {"class": "a100"}, "y": {"class": "l40s"}, "z": {"class": "h200"}},
    }
    report = build_report(data, "plan", generated=WHEN)
    assert [(c["name"], c["status"]) for c in report["classes"]] == [("a100", "failed"), ("h200", "deployable"), ("l40s", "skipped")]
    assert {h["host"]: h["outcome"] for h in report["hosts"]} == {"x": "failed", "y": "skipped", "z": "planned"}
    assert report["summary"]["failed_classes"] == ["a100"]


def test_fit_admission_saving_is_reported():
    plan = seed_plan(budget_mode="fit_admission", admission={"tokens": 65536}, fit_headroom=0.1)
    report = build_report(rollout_data(plan), "rollout", generated=WHEN)
    fit = report["classes"][0]["fit"]
    assert fit["budget_bytes"] == plan["kv_cache_memory_bytes"] < int(28.25 * GIB)
    assert fit["left_free_bytes_per_gpu"] == int(28.25 * GIB) - fit["budget_bytes"]
    assert f"{_report.human_bytes(fit['left_free_bytes_per_gpu'])} per GPU left free for other work" in render_markdown(report)


def test_svg_marks_ranks_below_the_floor():
    plan = seed_plan()
    plan["per_rank"][0]["boot_free_bytes"] = int(39 * GIB)
    plan["per_rank"][0]["margin_bytes"] = int(39 * GIB) - plan["per_rank"][0]["floor_bytes"]
    svg = _report_render.render_svg(build_report(rollout_data(plan), "rollout", generated=WHEN)["classes"][0])
    assert svg.count("<rect") == 2
    assert 'fill="#c62828"' in svg and 'fill="#2e7d32"' in svg
    # zoomed axis: lowest 39, highest 41.5 GiB, span 2.5 GiB -> axis 37.75 .. 41.75 GiB
    ticks = [float(x) for x in re.findall(r'<line x1="([0-9.]+)"', svg)]
    assert ticks == [pytest.approx(230 + 560 * 3 / 4, abs=0.1)] * 2
    widths = [float(x) for x in re.findall(r'<rect x="230" y="[0-9.]+" width="([0-9.]+)"', svg)]
    assert widths == [pytest.approx(560 * 1.25 / 4, abs=0.1), pytest.approx(560 * 3.75 / 4, abs=0.1)]
    assert "axis 37.75GiB to 41.75GiB" in svg


def test_html_is_self_contained_and_escaped():
    data = rollout_data(failed_b=True)
    data["hosts"]["gpu-b"]["error"] = "<script>alert(1)</script> & failed"
    page = render_html(build_report(data, "rollout", generated=WHEN))
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert not re.search(r'(src|href)\s*=\s*"(https?:|//)', page)
    assert "<link" not in page and "@import" not in page and "url(" not in page
    _text, tags = html_text(page)
    assert ("svg", {"xmlns": "http://www.w3.org/2000/svg", "role": "img", "width": "1080", "height": "82", "viewbox": "0 0 1080 82"}) in tags


def test_bad_input_names_the_field():
    with pytest.raises(ReportError, match="kind"):
        build_report({"classes": {}}, "deploy")
    with pytest.raises(ReportError, match="data.classes"):
        build_report({"classes": ["h200"]})
    with pytest.raises(ReportError, match=r"data.hosts.gpu-a"):
        build_report({"classes": {}, "hosts": {"gpu-a": "x"}})
    with pytest.raises(ReportError, match="free_floor_bytes"):
        build_report({"classes": {"h200": {"plan": {"free_floor_bytes": {"0": "lots"}}}}})


def test_v0_report_still_renders():
    old = json.loads((FIXTURES / "rollout-v0.json").read_text(encoding="utf-8"))
    assert "schema_version" not in old
    report = load_report(old)
    assert report["upgraded_from"] == 0 and report["schema_version"] == SCHEMA_VERSION
    cls = report["classes"][0]
    assert cls["name"] == "ro-l40s" and cls["decision"] == "deploy"
    assert cls["plan"]["kv_cache_memory_bytes"] == old["classes"]["ro-l40s"]["kv_cache_memory_bytes"]
    assert cls["free_floor_bytes"] == dict(old["classes"]["ro-l40s"]["free_floor_bytes"])
    assert [h["host"] for h in report["hosts"]] == ["sim-ro-1", "sim-ro-2", "sim-ro-3"]
    assert {h["outcome"] for h in report["hosts"]} == {"unknown"}
    md = render_markdown(report)
    assert "read from a schema 0 report" in md
    assert _report.human_bytes(old["classes"]["ro-l40s"]["kv_cache_memory_bytes"]) in md
    text, _tags = html_text(render_html(report))
    assert "sim-ro-3/main rank 1" in text


def test_load_report_round_trip_and_unknown_version():
    report = build_report(rollout_data(), "rollout", generated=WHEN)
    again = load_report(json.loads(json.dumps(report)))
    assert render_markdown(again) == render_markdown(report)
    with pytest.raises(ReportError, match="unknown schema_version 7"):
        load_report({"schema_version": 7})
    with pytest.raises(ReportError, match="missing"):
        load_report({"schema_version": 1, "kind": "rollout"})


def test_write_run_dir_is_atomic_and_never_overwrites(tmp_path):
    report = build_report(rollout_data(), "rollout", generated=WHEN)
    first = write_run_dir(str(tmp_path), report, WHEN)
    second = write_run_dir(str(tmp_path), report, WHEN)
    assert os.path.basename(first) == "rollout-20261129T100912Z"
    assert os.path.basename(second) == "rollout-20261129T100912Z-2"
    assert sorted(os.listdir(tmp_path)) == ["rollout-20261129T100912Z", "rollout-20261129T100912Z-2"]  # no temp dir left
    for run in (first, second):
        assert sorted(os.listdir(run)) == ["report.html", "report.json", "report.md"]
        stored = json.loads(Path(run, "report.json").read_text(encoding="utf-8"))
        assert stored["schema_version"] == SCHEMA_VERSION and stored["kind"] == "rollout"


def test_write_run_dir_leaves_nothing_on_failure(tmp_path, monkeypatch):
    report = build_report(rollout_data(), "rollout", generated=WHEN)

    def broken(_report_obj):
        raise RuntimeError("renderer broke")

    monkeypatch.setattr(_report_render, "render_html", broken)
    with pytest.raises(RuntimeError):
        write_run_dir(str(tmp_path), report, WHEN)
    assert not os.listdir(tmp_path)
    with pytest.raises(ReportError, match="not a directory"):
        write_run_dir(str(tmp_path / "missing"), report, WHEN)


def test_class_artifacts_are_compact():
    report = build_report(rollout_data(failed_b=True), "rollout", generated=WHEN)
    arts = _report.class_artifacts(report)
    assert arts["h200"]["kv_cache_memory_bytes"] == int(28.25 * GIB)
    assert arts["h200"]["canary_verdicts"] == {"profiled": "pass", "manual": "pass"}
    assert arts["h200"]["hosts"] == {"gpu-a": "deployed", "gpu-b": "rolled_back", "gpu-c": "not_reached"}
    assert "per_rank" not in arts["h200"]


def test_canary_failed_flag_is_not_a_request_count():
    manual = dict(CANARY_MANUAL, failed=False, load=dict(CANARY_MANUAL["load"], failed=2))
    data = rollout_data()
    data["classes"]["h200"]["canaries"] = {"manual": manual, "profiled": dict(CANARY_PROFILED, failed=True, load={})}
    cls = build_report(data, "rollout", generated=WHEN)["classes"][0]
    assert cls["canaries"]["manual"]["failed"] == 2
    assert cls["canaries"]["profiled"]["failed"] is None and cls["canaries"]["profiled"]["ttft_p50"] is None


# ---------------------------------------------------------------- schema 2: probe reports, check mode, upgrades
def probe_gpu(index, free, *, total=141 * GIB, reserved=GIB // 2, own=0, processes=()):
    """One gpu_memory_info entry (free and boot free as the module reports them)."""
    return {
        "index": index,
        "uuid": f"GPU-0000000{index}",
        "name": "NVIDIA H200",
        "total_bytes": total,
        "free_bytes": free,
        "free_min_bytes": free,
        "free_max_bytes": free,
        "used_bytes": total - reserved - free,
        "reserved_bytes": reserved,
        "own_used_bytes": own,
        "boot_free_bytes": free + own,
        "processes": list(processes),
        "processes_reported": True,
        "samples": 3,
    }


PLAN_FILE = {
    "format": 1,
    "instance": "main",
    "unit": "vllm-main.service",
    "host_class": "h200",
    "compat_key_hash": "3f2a9c0d11e4b7a2",
    "decision": "deploy",
    "kv_cache_memory_bytes": 30333206528,
    "gpu_memory_utilization": 0.2847,
    "kv_cache_tokens": 231424,
    "num_blocks": 14464,
    "free_floor_bytes": {"0": int(40.75 * GIB)},
}


def probe_data():
    engine = {"pid": 4242, "name": "python3", "used_bytes": 100 * GIB, "kinds": ["compute"], "own": True}
    cotenant = {"pid": 61001, "name": "python3", "used_bytes": 2 * GIB, "kinds": ["compute"], "own": False}
    return {
        "started": "2026-11-29T10:00:00.123456",  # now(utc=true).isoformat() in a playbook: no offset
        "probe": {
            "hosts": {
                "gpu-a": {
                    "class": "h200",
                    "driver_version": "580.159.04",
                    "cuda_driver_version": "13.0",
                    "nvml_version": "13.580.159.04",
                    "runtime": {"record": {"venv": "/opt/vllm/venv", "release": "/opt/vllm/releases/vllm-0.33.0-3f2a9c1d0e",
                                           "stamp": {"package": "vllm", "version": "0.33.0", "python": "/usr/bin/python3.12"}},
                                "error": None},
                    "gpus": [
                        probe_gpu(0, int(40.5 * GIB), own=100 * GIB, processes=[engine]),
                        probe_gpu(1, int(138.5 * GIB), processes=[cotenant]),
                    ],
                    "instances": [
                        {"name": "main", "unit": "vllm-main.service", "gpus": [0], "port": 8000, "load_state": "loaded",
                         "active_state": "active", "sub_state": "running", "plan": PLAN_FILE},
                        {"name": "spare", "gpus": [1], "port": 8001, "load_state": "not-found", "active_state": "inactive",
                         "sub_state": "dead", "plan": None},
                    ],
                },
                "gpu-b": {"class": "h200", "error": "unreachable: ssh: connect to host gpu-b port 22: No route to host"},
            }
        },
    }


def test_probe_report_figures_reach_every_renderer():
    report = build_report(probe_data(), "probe", generated=WHEN)
    assert report["kind"] == "probe" and report["classes"] == [] and report["batches"] == []
    assert report["started"] == "2026-11-29T10:00:00.123456+00:00"
    assert {h["host"]: h["outcome"] for h in report["hosts"]} == {"gpu-a": "probed", "gpu-b": "failed"}
    assert report["failed_hosts"] == ["gpu-b"] and report["summary"]["ok"] is False
    hosts = {h["host"]: h for h in report["probe"]["hosts"]}
    gpu0 = hosts["gpu-a"]["gpus"][0]
    assert gpu0["boot_free_bytes"] == int(140.5 * GIB) and gpu0["processes"][0] == {
        "pid": 4242, "name": "python3", "used_bytes": 100 * GIB, "own": True}
    main = hosts["gpu-a"]["instances"][0]
    assert main["plan"]["kv_cache_memory_bytes"] == 30333206528 and main["plan"]["free_floor_bytes"] == {"0": int(40.75 * GIB)}
    assert hosts["gpu-a"]["instances"][1]["plan"] is None and hosts["gpu-b"]["ok"] is False
    # gpu-a GPU 1: 138.5 GiB free, nothing own; GPU 0: 40.5 free + 100 own = 140.5 GiB boot free
    assert report["summary"]["probe"] == {
        "hosts": 2, "probed": 1, "gpus": 2, "instances": 2, "active_instances": 1,
        "lowest_boot_free": {"host": "gpu-a", "index": 1, "bytes": int(138.5 * GIB)},
    }
    assert summary_line(report) == (
        "probe: 1 of 2 host(s) probed, 2 GPU(s), 1 of 2 instance(s) active; lowest boot free 138.5GiB (gpu-a GPU 1); failed hosts gpu-b"
    )
    md = render_markdown(report)
    assert hosts["gpu-a"]["runtime"] == {"release": "/opt/vllm/releases/vllm-0.33.0-3f2a9c1d0e", "package": "vllm", "version": "0.33.0",
                                         "error": None}
    assert hosts["gpu-b"]["runtime"] is None
    assert "## Host gpu-a" in md and ("- class h200, driver 580.159.04, CUDA 13.0, NVML 13.580.159.04, "
                                      "runtime vllm 0.33.0 (/opt/vllm/releases/vllm-0.33.0-3f2a9c1d0e)") in md
    assert "| 0 | NVIDIA H200 | 141GiB | 40.5GiB | 140.5GiB | 40.5GiB / 40.5GiB | 100GiB | none |" in md
    assert "| 1 | NVIDIA H200 | 141GiB | 138.5GiB | 138.5GiB | 138.5GiB / 138.5GiB | 0B | 1 (2GiB) |" in md
    assert "| 1 | 61001 | python3 | 2GiB | no |" in md
    assert "| main | vllm-main.service | active (running) | 0 | 8000 | 28.25GiB | 231424 | 0.2847 | deploy | 3f2a9c0d11e4b7a2 |" in md
    assert "| spare | vllm-spare.service | not installed | 1 | 8001 | no plan file | - | - | - | - |" in md
    assert "- probe failed: unreachable: ssh: connect to host gpu-b port 22: No route to host" in md
    assert "## Hosts" not in md, "a probe report shows each host in its own section"
    page = render_html(report)
    text, tags = html_text(page)
    assert "Host gpu-a" in text and "not installed" in text and "No route to host" in text
    # GPU 0 bar: reserve, own engine, free (no other process); GPU 1: reserve, co-tenant, free
    rects = [attrs["class"] for tag, attrs in tags if tag == "rect"]
    assert rects == ["gpu-reserved", "gpu-own", "gpu-free", "gpu-reserved", "gpu-other", "gpu-free"]
    widths = [float(w) for w in re.findall(r'class="gpu-own" x="[0-9.]+" y="[0-9.]+" width="([0-9.]+)"', page)]
    assert widths == [pytest.approx(560 * 100 / 141, abs=0.1)]
    assert load_report(json.loads(json.dumps(report))) == report


def test_a_probe_report_says_why_the_runtime_record_could_not_be_read():
    data = probe_data()
    data["probe"]["hosts"]["gpu-a"]["runtime"] = {
        "record": {"venv": "/opt/vllm/venv", "release": "/opt/vllm/releases/r1", "stamp": {}},
        "error": "/opt/vllm/releases/r1/.gpufleet-complete: missing: /opt/vllm/releases/r1 is not a complete release"}
    report = build_report(data, "probe", generated=WHEN)
    runtime = {h["host"]: h for h in report["probe"]["hosts"]}["gpu-a"]["runtime"]
    assert runtime["release"] == "/opt/vllm/releases/r1" and runtime["version"] is None and "not a complete release" in runtime["error"]
    assert "runtime unknown (/opt/vllm/releases/r1): /opt/vllm/releases/r1/.gpufleet-complete: missing" in render_markdown(report)
    # a host without a release of the runtime role (a plain venv) has no record and no runtime
    data["probe"]["hosts"]["gpu-a"]["runtime"] = {"record": {}, "error": None}
    assert {h["host"]: h for h in build_report(data, "probe", generated=WHEN)["probe"]["hosts"]}["gpu-a"]["runtime"] is None
    data["probe"]["hosts"]["gpu-a"]["runtime"] = {"record": {"release": "/r", "stamp": "vllm"}, "error": None}
    with pytest.raises(ReportError, match=re.escape("data.probe.hosts.gpu-a.runtime.record.stamp")):
        build_report(data, "probe", generated=WHEN)


def test_probe_report_input_errors_name_the_field():
    with pytest.raises(ReportError, match="data.probe: a probe report needs the probe results"):
        build_report({}, "probe")
    data = probe_data()
    data["probe"]["hosts"]["gpu-a"]["gpus"][0]["free_bytes"] = "plenty"
    with pytest.raises(ReportError, match=r"data.probe.hosts.gpu-a.gpus\[0\].free_bytes"):
        build_report(data, "probe")
    data = probe_data()
    data["probe"]["hosts"]["gpu-a"]["instances"][1] = {"gpus": [1]}
    with pytest.raises(ReportError, match=r"instances\[1\]: an instance needs a name"):
        build_report(data, "probe")
    with pytest.raises(ReportError, match=r"report.json \(schema 2\): missing probe"):
        load_report({k: v for k, v in build_report(probe_data(), "probe").items() if k != "probe"})


def test_check_mode_is_recorded_and_shown():
    data = rollout_data()
    data["check_mode"] = True
    report = build_report(data, "plan", generated=WHEN)
    assert report["check_mode"] is True
    assert summary_line(report).endswith("; check mode: nothing was changed on the hosts")
    assert "- dry run (check mode): nothing was changed on the hosts" in render_markdown(report)
    text, _tags = html_text(render_html(report))
    assert "Dry run (check mode): nothing was changed on the hosts." in text
    assert "check mode" not in summary_line(build_report(rollout_data(), "plan", generated=WHEN))


def test_v1_report_is_read_as_schema_2():
    old = json.loads((FIXTURES / "rollout-v1.json").read_text(encoding="utf-8"))
    assert old["schema_version"] == 1 and "probe" not in old and "check_mode" not in old
    report = load_report(old)
    assert report["schema_version"] == SCHEMA_VERSION and report["upgraded_from"] == 1
    assert report["probe"] is None and report["check_mode"] is False
    # Nothing is missing from a schema 1 report: it renders like the same run built now.
    now = build_report(rollout_data(failed_b=True), "rollout", generated=WHEN)
    assert render_markdown(report) == render_markdown(now)
    assert "read from a schema" not in render_markdown(report).lower()
    assert report["rolled_back"][0]["host"] == "gpu-b"


def test_a_batch_bake_is_reported_with_every_check():
    """The bake's verdict on a batch (rollout_bake's analysis in the batch record) reaches every renderer:
    the verdict, the checks' figures and thresholds, and the baseline hosts that could not be read."""
    data = rollout_data(failed_b=True)
    data["hosts"]["gpu-b"]["error"] = "the bake judged the batch's changed hosts worse than the class's others: ..."
    data["batches"][1]["analysis"] = {
        "verdict": "fail", "effective": "fail", "seconds": 300, "canary_hosts": 1, "baseline_hosts": 1,
        "source": "Prometheus http://prometheus.example:9090",
        "started": "2026-11-29T10:06:40+00:00", "finished": "2026-11-29T10:11:40+00:00",
        "checks": [
            {"name": "itl_p90", "verdict": "fail", "why": "0.0475 s on the canary, 0.009 s on the baseline: 5.28 times (above 3)",
             "canary": 0.0475, "baseline": 0.009, "threshold": {"max_ratio": 3.0, "max_seconds": None}, "limit": 0.027,
             "samples": {"canary": 12.0, "baseline": 96.0}},
            {"name": "success_rate", "verdict": "pass", "why": "1.0000 on the canary", "canary": 1.0, "baseline": 1.0,
             "threshold": {"max_drop": 0.01}, "limit": 0.99, "samples": {"canary": 12.0, "baseline": 96.0}},
        ],
        "baseline_unread": {"gpu-c": ["http://gpu-c:8000/metrics: <urlopen error timed out>"]},
    }
    report = build_report(data, "rollout", generated=WHEN)
    analysis = report["batches"][1]["analysis"]
    assert report["batches"][0]["analysis"] is None
    assert analysis["verdict"] == "fail" and analysis["seconds"] == 300 and analysis["checks"][0]["canary"] == 0.0475
    md = render_markdown(report)
    assert "**Bake of batch 2 of 3: fail, 300 s, 1 changed host(s) against 1 baseline host(s), read from Prometheus " \
           "http://prometheus.example:9090**" in md
    assert "| itl_p90 | fail | 0.0475 | 0.009 | 0.027 | max_ratio 3 | 12 / 96 | 0.0475 s on the canary" in md
    assert "- baseline host gpu-c left out: http://gpu-c:8000/metrics: <urlopen error timed out>" in md
    text, _tags = html_text(render_html(report))
    assert "Bake of batch 2 of 3: fail, 300 s" in text and "max_drop 0.01" in text and "baseline host gpu-c left out" in text
    # the drawing: per check the canary's bar (red: failed, green: passed), the baseline's and the limit's tick, to scale
    svg = render_analysis_svg(report["batches"][1])
    bars = re.findall(r'<rect class="bake-(canary|baseline)" x="\d+" y="[\d.]+" width="([\d.]+)" height="\d+" fill="(#\w+)"', svg)
    expected = [("canary", "#c62828"), ("baseline", "#9e9e9e"), ("canary", "#2e7d32"), ("baseline", "#9e9e9e")]
    assert [(kind, fill) for kind, _w, fill in bars] == expected, bars
    itl_canary, itl_baseline = float(bars[0][1]), float(bars[1][1])
    assert abs(itl_canary / itl_baseline - 0.0475 / 0.009) < 0.05, "the bars are to scale"
    assert svg.count('class="bake-limit"') == 2 and svg in render_html(report)
    assert json.loads(json.dumps(report)) == report
    data["batches"][1]["analysis"] = {"verdict": "fail", "effective": "fail", "checks": [], "error": "Timed out after 900 second(s)"}
    report = build_report(data, "rollout", generated=WHEN)
    assert report["batches"][1]["analysis"]["error"] == "Timed out after 900 second(s)"
    assert "- the bake itself failed: Timed out after 900 second(s)" in render_markdown(report)
    data["batches"][1]["analysis"] = {"verdict": "fail"}
    with pytest.raises(ReportError, match=r"data.batches\[1\].analysis: expected the analysis of gpufleet.vllm.rollout_bake"):
        build_report(data, "rollout", generated=WHEN)


def test_a_gangs_outcome_is_its_worst_members():
    """gpu-a and gpu-b run one instance (a gang): gpu-b was rolled back, so the gang was; gpu-c is alone. Every
    renderer shows the gang with each member's outcome; a gang without members is refused, naming the field."""
    data = dict(rollout_data(failed_b=True), gangs=[{"name": "main", "leader": "gpu-a", "members": ["gpu-a", "gpu-b"], "host_class": "h200"}])
    report = build_report(data, "rollout", generated=WHEN)
    assert report["gangs"] == [{"name": "main", "leader": "gpu-a", "members": ["gpu-a", "gpu-b"], "class": "h200",
                                "members_outcomes": {"gpu-a": "deployed", "gpu-b": "rolled_back"}, "outcome": "rolled_back"}]
    md = render_markdown(report)
    assert "## Gangs" in md and "| main (leader gpu-a) | h200 | gpu-a (deployed), gpu-b (rolled back) | rolled back |" in md, md
    text, _tags = html_text(render_html(report))
    assert "main (leader gpu-a)" in text and "gpu-b (rolled back)" in text
    # a member the report does not know (not reached) and one that passed: the gang is not reached
    gang = build_report(dict(rollout_data(), gangs=[{"name": "m", "members": ["gpu-a", "gpu-z"]}]), "rollout", generated=WHEN)["gangs"][0]
    assert (gang["leader"], gang["outcome"], gang["members_outcomes"]["gpu-z"]) == ("gpu-a", "not_reached", "not_reached")
    # no gang: an empty list, and no section
    plain = build_report(rollout_data(), "rollout", generated=WHEN)
    assert plain["gangs"] == [] and "## Gangs" not in render_markdown(plain)
    with pytest.raises(ReportError, match=r"data\.gangs\[0\]: expected a gang with its name and two or more members"):
        build_report(dict(rollout_data(), gangs=[{"name": "m", "members": ["gpu-a"]}]), "rollout", generated=WHEN)

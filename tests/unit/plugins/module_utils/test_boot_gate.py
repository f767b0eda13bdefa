# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The boot gate: its decision per policy (plain figures), the engine argv it hands over,
and the launcher end to end through the real pynvml on the fake NVML library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from ansible_collections.gpufleet.vllm.plugins.module_utils._gate import _boot_gate as gate
from ansible_collections.gpufleet.vllm.tests.fake_nvml import nvml_state

ROOT = Path(__file__).resolve().parents[4]
CACHE = Path(os.environ.get("GPUFLEET_CACHE") or ROOT / ".cache")
LIB = CACHE / "fake-nvml" / "libnvidia-ml.so.1"
GIB = 1 << 30
MIB = 1 << 20
TOTAL = 48305799168
BPB = 2 * MIB  # bytes per block of the test geometry
BUDGET = 30 * GIB
FLOOR = 40 * GIB


def plan_doc(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": 2, "instance": "main", "unit": "vllm-main.service", "decision": "deploy", "gpus": [0, 1],
        "kv_cache_memory_bytes": BUDGET, "gpu_memory_utilization": 0.85,
        "free_floor_bytes": {"0": FLOOR, "1": FLOOR}, "vllm_floor_bytes": {"0": FLOOR - 600 * MIB, "1": FLOOR - 600 * MIB},
        "num_blocks": BUDGET // BPB, "kv_cache_tokens": BUDGET // BPB * 16, "guard_bytes": 512 * MIB,
        "max_model_len": 8192, "admission": {"required_tokens": 32768, "required_blocks": 2049},
        "capacity": {"source": "geometry", "bytes_per_block": BPB, "block_size": 16},
        "boot_gate": {"policy": "shrink", "state_file": None},
    }
    doc.update(over)
    return doc


def gpus(free0: int, free1: int = FLOOR + GIB) -> list[dict[str, int]]:
    return [{"index": 0, "boot_free_bytes": free0, "total_bytes": TOTAL},
            {"index": 1, "boot_free_bytes": free1, "total_bytes": TOTAL}]


def test_every_rank_at_its_floor_starts_the_plan_under_every_policy():
    plan = gate.parse_plan(plan_doc())
    for policy in gate.POLICIES:
        verdict = gate.decide(plan, gpus(FLOOR), policy)
        assert verdict["action"] == "start"
        assert verdict["started"]["kv_cache_memory_bytes"] == BUDGET
        assert verdict["degraded"] is None
        assert [r["margin_bytes"] for r in verdict["ranks"]] == [0, GIB]


def test_refuse_names_the_rank_its_free_memory_and_its_floor():
    plan = gate.parse_plan(plan_doc())
    verdict = gate.decide(plan, gpus(FLOOR - 1, FLOOR), "refuse")
    assert verdict["action"] == "refuse"
    assert verdict["started"] is None
    assert f"rank 0 (GPU 0) free {FLOOR - 1} B" in verdict["message"]
    assert f"< floor {FLOOR} B" in verdict["message"]
    assert "rank 1" not in verdict["message"]


def test_shrink_applies_the_drift_rule_against_the_floor_of_the_worst_rank():
    plan = gate.parse_plan(plan_doc())
    verdict = gate.decide(plan, gpus(FLOOR - GIB, FLOOR - 2 * GIB), "shrink")
    assert verdict["action"] == "shrink"
    after = BUDGET - 2 * GIB
    assert verdict["started"]["kv_cache_memory_bytes"] == after
    assert verdict["started"]["kv_cache_tokens"] == after // BPB * 16
    assert verdict["degraded"]["kv_cache_memory_bytes_before"] == BUDGET
    assert verdict["degraded"]["kv_cache_tokens_before"] == BUDGET // BPB * 16
    assert verdict["degraded"]["kv_cache_tokens_after"] == after // BPB * 16
    # vLLM's startup check sees the same missing bytes: the utilization drops by them
    util = verdict["started"]["gpu_memory_utilization"]
    assert util < 0.85
    assert -(-int(TOTAL * util * 1) // 1) <= -(-int(TOTAL * 0.85) // 1) - 2 * GIB + 1


def test_shrink_refuses_when_the_smaller_budget_misses_the_admission_plan():
    plan = gate.parse_plan(plan_doc(admission={"required_tokens": 14 * GIB // BPB * 16,
                                               "required_blocks": 14 * GIB // BPB + 1}))
    assert gate.decide(plan, gpus(FLOOR - 15 * GIB), "shrink")["action"] == "shrink"
    verdict = gate.decide(plan, gpus(FLOOR - 17 * GIB), "shrink")
    assert verdict["action"] == "refuse"
    assert "below the admission plan" in verdict["message"]
    assert verdict["degraded"]["kv_cache_memory_bytes_after"] == BUDGET - 17 * GIB


def test_shrink_refuses_when_one_request_no_longer_fits():
    plan = gate.parse_plan(plan_doc(admission=None, max_model_len=8192))
    need = (8192 // 16 + 1) * BPB
    ok = gate.decide(plan, gpus(FLOOR - (BUDGET - need)), "shrink")
    assert ok["action"] == "shrink" and ok["started"]["kv_cache_memory_bytes"] == need
    verdict = gate.decide(plan, gpus(FLOOR - (BUDGET - need) - 1), "shrink")
    assert verdict["action"] == "refuse"
    assert "cannot hold one request of max_model_len 8192" in verdict["message"]


def test_profile_derives_the_utilization_from_free_memory_minus_guard_and_allowance():
    plan = gate.parse_plan(plan_doc())
    free = FLOOR - 3 * GIB
    verdict = gate.decide(plan, gpus(free), "profile")
    assert verdict["action"] == "profile"
    util = verdict["started"]["gpu_memory_utilization"]
    assert util == gate.floor_utilization(free - 512 * MIB - 600 * MIB, TOTAL)
    assert util < 0.85
    assert verdict["started"]["kv_cache_memory_bytes"] is None


def test_format_1_plan_files_are_read_and_shrink_scales_the_recorded_capacity():
    doc = plan_doc(format=1)
    for key in ("guard_bytes", "max_model_len", "admission", "capacity", "boot_gate", "vllm_floor_bytes"):
        doc.pop(key)
    plan = gate.parse_plan(doc)
    assert plan["capacity"]["source"] == "scaled"
    verdict = gate.decide(plan, gpus(FLOOR - GIB), "shrink")
    assert verdict["action"] == "shrink"
    assert verdict["started"]["kv_cache_tokens"] == plan["kv_cache_tokens"] * (BUDGET - GIB) // BUDGET


@pytest.mark.parametrize("field,value,needle", [
    ("format", 4, "format 4 is not one this gate reads"),
    ("gpus", [], "gpus must be a non-empty list"),
    ("kv_cache_memory_bytes", "30GiB", "kv_cache_memory_bytes must be an integer"),
    ("free_floor_bytes", {"x": 1}, "free_floor_bytes: rank 'x' is not an integer"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be a number in (0, 1]"),
])
def test_bad_plan_files_name_the_field(field, value, needle):
    with pytest.raises(gate.BootGateError, match=None) as info:
        gate.parse_plan(plan_doc(**{field: value}))
    assert needle in str(info.value)


def test_a_rank_without_a_floor_or_a_gpu_is_refused():
    plan = gate.parse_plan(plan_doc(free_floor_bytes={"0": FLOOR}))
    assert "no floor" in gate.decide(plan, gpus(FLOOR), "shrink")["message"]
    plan = gate.parse_plan(plan_doc())
    assert "not found by NVML" in gate.decide(plan, gpus(FLOOR)[:1], "shrink")["message"]


@settings(max_examples=300, deadline=None)
@given(free0=st.integers(0, 60 * GIB), free1=st.integers(0, 60 * GIB),
       policy=st.sampled_from(gate.POLICIES))
def test_the_gate_never_raises_a_budget_or_a_utilization(free0, free1, policy):
    plan = gate.parse_plan(plan_doc())
    verdict = gate.decide(plan, gpus(free0, free1), policy)
    if verdict["action"] == "refuse":
        assert verdict["started"] is None
        return
    started = verdict["started"]
    if started["kv_cache_memory_bytes"] is not None:
        assert started["kv_cache_memory_bytes"] <= BUDGET
    assert started["gpu_memory_utilization"] <= 0.85
    if min(free0, free1) >= FLOOR:
        assert verdict["action"] == "start"


def test_engine_argv_lowers_the_budget_and_drops_it_for_profiling():
    argv = ["/opt/vllm/venv/bin/vllm", "serve", "m", "--kv-cache-memory-bytes", str(BUDGET),
            "--gpu-memory-utilization", "0.85", "--max-model-len", "8192"]
    shrink = {"action": "shrink", "started": {"kv_cache_memory_bytes": 1000, "gpu_memory_utilization": 0.8}}
    assert gate.engine_argv(argv, shrink)[3:7] == ["--kv-cache-memory-bytes", "1000", "--gpu-memory-utilization", "0.8"]
    profile = {"action": "profile", "started": {"kv_cache_memory_bytes": None, "gpu_memory_utilization": 0.7}}
    out = gate.engine_argv(argv, profile)
    assert "--kv-cache-memory-bytes" not in out and out[3:5] == ["--gpu-memory-utilization", "0.7"]
    assert gate.engine_argv(argv, {"action": "start"}) == argv


def run_launcher(tmp_path: Path, plan_path: Path, state_path: Path, policy: str, invocation: str) -> subprocess.CompletedProcess[str]:
    """The launcher in a fresh interpreter: real pynvml on the fake library (state in ``tmp_path/state``), and an
    'engine' that prints the argv it was handed."""
    engine = tmp_path / "engine"
    engine.write_text("#!/bin/sh\necho ENGINE \"$@\"\n")
    engine.chmod(0o755)
    code = ("import sys; from ansible_collections.gpufleet.vllm.plugins.module_utils._gate._boot_gate import run; "
            "sys.exit(run(sys.argv[1:]))")
    return subprocess.run(
        [sys.executable, "-c", code, "--plan", str(plan_path), "--policy", policy, "--state", str(state_path),
         "--", str(engine), "serve", "m", "--kv-cache-memory-bytes", str(BUDGET), "--gpu-memory-utilization", "0.85"],
        env=dict(os.environ, LD_LIBRARY_PATH=str(LIB.parent), FAKE_NVML_STATE=str(tmp_path / "state"), INVOCATION_ID=invocation),
        capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.skipif(not LIB.exists(), reason=f"fake NVML library not built ({LIB}); run `make fake-nvml`")
@pytest.mark.parametrize("policy,cotenant,rc,budget", [
    ("shrink", 0, 0, BUDGET),
    ("refuse", GIB, gate.EXIT_REFUSED, None),
    ("shrink", GIB, 0, BUDGET - GIB),  # 2 GiB taken, floor 1 GiB below: 1 GiB short
])
def test_launcher_end_to_end_on_the_fake_nvml(tmp_path, policy, cotenant, rc, budget):
    """The launcher in a fresh interpreter: real pynvml, the fake library, a plan file, a
    state file, and an 'engine' that prints the argv it was handed."""
    state = nvml_state.new_state()
    state["gpus"] = [nvml_state.make_gpu(i, TOTAL, reserved=462422016, name="NVIDIA L40S", cc="8.9") for i in range(2)]
    free = TOTAL - 462422016
    # the floor sits 1 GiB below today's free memory; a co-tenant takes `cotenant` + 1 GiB
    floor = free - GIB
    if cotenant:
        nvml_state.add_process(state, gpu=1, pid=999999, used=cotenant + GIB, name="cotenant", pidns="other")
    nvml_state.save(tmp_path / "state", state)
    plan_path, state_path = tmp_path / "main.plan.json", tmp_path / "main.boot-gate.json"
    plan_path.write_text(json.dumps(plan_doc(free_floor_bytes={"0": floor, "1": floor}, vllm_floor_bytes={})))
    done = run_launcher(tmp_path, plan_path, state_path, policy, "abc123")
    assert done.returncode == rc, done.stderr
    record = json.loads(state_path.read_text())
    assert record["invocation_id"] == "abc123" and record["policy"] == policy
    assert record["ranks"][1]["free_bytes"] == free - (cotenant + GIB if cotenant else 0)
    if budget is None:
        assert "ENGINE" not in done.stdout
        assert f"rank 1 (GPU 1) free {free - 2 * GIB} B" in done.stderr
        assert record["action"] == "refuse"
    else:
        assert f"--kv-cache-memory-bytes {budget}" in done.stdout
        assert record["action"] == ("shrink" if cotenant else "start")
        assert (record["degraded"] is not None) == bool(cotenant)


UUID0, UUID1, UUID2 = "GPU-00000000-0000-0000-0000-00000000aaaa", "GPU-11111111-1111-1111-1111-11111111bbbb", "GPU-22222222-2222-2222-2222-22222222cccc"


def test_a_planned_card_that_is_not_at_its_index_any_more_is_refused_under_every_policy():
    plan = gate.parse_plan(plan_doc(gpu_uuids=[UUID0, UUID1]))
    same = [dict(g, uuid=u) for g, u in zip(gpus(FLOOR + GIB), (UUID0, UUID1))]
    swapped = [dict(g, uuid=u) for g, u in zip(gpus(FLOOR + GIB), (UUID1, UUID0))]
    replaced = [dict(g, uuid=u) for g, u in zip(gpus(FLOOR + GIB), (UUID0, UUID2))]
    for policy in gate.POLICIES:
        assert gate.decide(plan, same, policy)["action"] == "start"
        verdict = gate.decide(plan, swapped, policy)
        assert verdict["action"] == "refuse", policy
        assert (f"rank 0: GPU 0 is {UUID1}, the plan was made for {UUID0} ({UUID0} is GPU 1 now); rank 1: GPU 1 is {UUID0}, "
                f"the plan was made for {UUID1} ({UUID1} is GPU 0 now)") in verdict["message"]
        assert "not starting on a card the plan was not made for" in gate.decide(plan, replaced, policy)["message"]
    # with the PCI bus ids the plan file records, the message says where each card sits
    slots = ["00000000:18:00.0", "00000000:2A:00.0"]
    located = gate.parse_plan(plan_doc(gpu_uuids=[UUID0, UUID1], gpu_pci_bus_ids=slots))
    found = [dict(g, pci_bus_id=b) for g, b in zip(swapped, reversed(slots))]
    assert (f"rank 0: GPU 0 is {UUID1} at PCI 00000000:2A:00.0, the plan was made for {UUID0} at PCI 00000000:18:00.0 "
            f"({UUID0} is GPU 1 now)") in gate.decide(located, found, "shrink")["message"]
    assert gate.rank_rows(located, found)[0]["pci_bus_id"] == "00000000:2A:00.0"
    with pytest.raises(gate.BootGateError, match="gpu_pci_bus_ids must list one PCI bus id per GPU"):
        gate.parse_plan(plan_doc(gpu_uuids=[UUID0, UUID1], gpu_pci_bus_ids=slots[:1]))
    # a plan file without UUIDs (written before they were recorded) or a GPU without one is not judged by UUID
    assert gate.decide(gate.parse_plan(plan_doc()), swapped, "refuse")["action"] == "start"
    assert gate.decide(plan, gpus(FLOOR + GIB), "refuse")["action"] == "start"


@pytest.mark.parametrize("value", [["GPU-x"], [UUID0], [UUID0, 7], "GPU-00000000", [UUID0, UUID1 + "\n"]])
def test_bad_gpu_uuids_name_the_field(value):
    with pytest.raises(gate.BootGateError, match="gpu_uuids must list one NVML UUID"):
        gate.parse_plan(plan_doc(gpu_uuids=value))


@pytest.mark.skipif(not LIB.exists(), reason=f"fake NVML library not built ({LIB}); run `make fake-nvml`")
def test_launcher_refuses_a_start_after_the_gpus_were_enumerated_anew(tmp_path):
    """Real pynvml on the fake library: the two cards trade places (as after a reboot in which a GPU fell off
    the bus and came back), the plan names them by UUID: the engine is not started."""
    state = nvml_state.new_state()
    state["gpus"] = [nvml_state.make_gpu(i, TOTAL, reserved=462422016, name="NVIDIA L40S", cc="8.9", uuid=u)
                     for i, u in enumerate((UUID1, UUID0))]
    nvml_state.save(tmp_path / "state", state)
    plan_path, state_path = tmp_path / "main.plan.json", tmp_path / "main.boot-gate.json"
    floor = TOTAL - 462422016 - GIB
    plan_path.write_text(json.dumps(plan_doc(free_floor_bytes={"0": floor, "1": floor}, vllm_floor_bytes={}, gpu_uuids=[UUID0, UUID1])))
    done = run_launcher(tmp_path, plan_path, state_path, "shrink", "x1")
    assert done.returncode == gate.EXIT_REFUSED, done.stderr
    assert "ENGINE" not in done.stdout
    # the fake library puts card i at bus 0x18 + i: UUID1 (made at index 0) sits at 00000000:18:00.0
    assert f"rank 0: GPU 0 is {UUID1} at PCI 00000000:18:00.0, the plan was made for {UUID0}" in done.stderr
    assert json.loads(state_path.read_text())["action"] == "refuse"


HEALTHY = {"ecc_mode": "enabled", "ecc_uncorrected_volatile": 0, "retired_pages_pending": None,
           "remapped_rows": {"corrected": 0, "uncorrected": 0, "pending": False, "failure": False},
           "not_supported": ["retired_pages_pending"], "errors": {}}


def with_health(rows: list[dict[str, Any]], **sick: Any) -> list[dict[str, Any]]:
    """GPU 1 of ``rows`` with ``sick`` in its health record, GPU 0 healthy (both with UUIDs)."""
    out = []
    for row, uuid in zip(rows, (UUID0, UUID1)):
        health = dict(HEALTHY, **(sick if row["index"] == 1 else {}))
        out.append(dict(row, uuid=uuid, health=health))
    return out


@pytest.mark.parametrize("sick, words", [
    ({"remapped_rows": {"corrected": 0, "uncorrected": 1, "pending": True, "failure": False}},
     "a row remapping is pending (reset the GPU to apply it)"),
    ({"remapped_rows": {"corrected": 0, "uncorrected": 1, "pending": False, "failure": True}}, "a row remapping failed"),
    ({"ecc_uncorrected_volatile": 2}, "2 uncorrectable ECC error(s) since the driver loaded"),
    ({"xid": {"listened_ms": 100, "critical": [79], "other": []}}, "critical Xid event(s) 79 while the gate listened"),
])
def test_an_unhealthy_gpu_is_refused_under_every_policy_naming_its_index_uuid_and_why(sick, words):
    plan = gate.parse_plan(plan_doc(gpu_uuids=[UUID0, UUID1]))
    assert plan["gpu_health"] == "refuse", "refuse is the default, also for plan files written before it existed"
    for policy in gate.POLICIES:
        assert gate.decide(plan, with_health(gpus(FLOOR + GIB)), policy)["action"] == "start"
        verdict = gate.decide(plan, with_health(gpus(FLOOR + GIB), **sick), policy)
        assert verdict["action"] == "refuse", policy
        assert f"rank 1 (GPU 1, {UUID1}): {words}" in verdict["message"]
        assert "not starting on an unhealthy GPU (gpu_health: refuse)" in verdict["message"]
        assert verdict["started"] is None


def test_gpu_health_warn_starts_and_names_the_gpu_in_the_journal_line():
    plan = gate.parse_plan(plan_doc(gpu_uuids=[UUID0, UUID1], boot_gate={"policy": "shrink", "state_file": None, "gpu_health": "warn"}))
    sick = {"remapped_rows": {"corrected": 0, "uncorrected": 1, "pending": True, "failure": False}}
    verdict = gate.decide(plan, with_health(gpus(FLOOR + GIB), **sick), "refuse")
    assert verdict["action"] == "start"
    assert verdict["message"].endswith(f"; GPU health: rank 1 (GPU 1, {UUID1}): a row remapping is pending (reset the GPU "
                                       "to apply it) (gpu_health: warn, starting anyway)")
    assert any("a row remapping is pending" in r for r in verdict["reasons"])
    # warned about, then shrunk for memory: both in the line
    shrunk = gate.decide(plan, with_health(gpus(FLOOR - GIB), **sick), "shrink")
    assert shrunk["action"] == "shrink" and "GPU health: rank 1" in shrunk["message"]


def test_a_failed_health_query_is_reported_and_stops_nothing():
    plan = gate.parse_plan(plan_doc(gpu_uuids=[UUID0, UUID1]))
    verdict = gate.decide(plan, with_health(gpus(FLOOR + GIB), errors={"remapped_rows": "nvmlDeviceGetRemappedRows: NVML error 999"},
                                            remapped_rows=None), "refuse")
    assert verdict["action"] == "start"
    assert "health queries failed: remapped_rows: nvmlDeviceGetRemappedRows: NVML error 999" in verdict["message"]


@pytest.mark.parametrize("gate_doc, needle", [
    ({"gpu_health": "ignore"}, "boot_gate.gpu_health must be one of refuse, warn"),
    ({"xid_wait_ms": 20000}, "boot_gate.xid_wait_ms must be within 0..10000"),
    ({"xid_wait_ms": "soon"}, "xid_wait_ms must be an integer"),
])
def test_bad_health_options_name_the_field(gate_doc, needle):
    with pytest.raises(gate.BootGateError, match=needle.replace(".", r"\.")):
        gate.parse_plan(plan_doc(boot_gate={"policy": "shrink", "state_file": None, **gate_doc}))


@pytest.mark.skipif(not LIB.exists(), reason=f"fake NVML library not built ({LIB}); run `make fake-nvml`")
@pytest.mark.parametrize("fault, xid_wait_ms, refused, words", [
    ({}, 0, False, None),
    ({"remap_pending": 1, "remap_uncorrected": 1}, 0, True, "a row remapping is pending"),
    ({"ecc_uncorrected_volatile": 4}, 0, True, "4 uncorrectable ECC error(s)"),
    ({"xid": [79]}, 0, False, None),  # not listened for: NVML delivers no event raised before a process listens
    ({"xid": [13, 79]}, 100, True, "critical Xid event(s) 79 while the gate listened"),
    ({"xid": [13]}, 100, False, None),  # an application's Xid
])
def test_launcher_reads_gpu_health_on_an_h200_like_fake(tmp_path, fault, xid_wait_ms, refused, words):
    """Real pynvml on the fake library, GPUs that answer as an H200 on driver 580 does (retired pages NOT_SUPPORTED)."""
    state = nvml_state.new_state()
    state["gpus"] = [nvml_state.make_gpu(i, TOTAL, reserved=462422016, name="NVIDIA H200", cc="9.0", uuid=u,
                                         unsupported=["nvmlDeviceGetRetiredPagesPendingStatus"], **(fault if i == 1 else {}))
                     for i, u in enumerate((UUID0, UUID1))]
    nvml_state.save(tmp_path / "state", state)
    plan_path, state_path = tmp_path / "main.plan.json", tmp_path / "main.boot-gate.json"
    floor = TOTAL - 462422016 - GIB
    plan_path.write_text(json.dumps(plan_doc(free_floor_bytes={"0": floor, "1": floor}, vllm_floor_bytes={}, gpu_uuids=[UUID0, UUID1],
                                             boot_gate={"policy": "shrink", "state_file": None, "xid_wait_ms": xid_wait_ms})))
    done = run_launcher(tmp_path, plan_path, state_path, "shrink", "h1")
    record = json.loads(state_path.read_text())
    health = record["ranks"][1]["health"]
    assert health["not_supported"] == ["retired_pages_pending"] and health["errors"] == {}
    assert health["ecc_mode"] == "enabled"
    if refused:
        assert done.returncode == gate.EXIT_REFUSED, done.stderr
        assert "ENGINE" not in done.stdout and record["action"] == "refuse"
        assert f"rank 1 (GPU 1, {UUID1}): {words}" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert "ENGINE" in done.stdout and record["action"] == "start"
    assert ("xid" in health) == bool(xid_wait_ms)


def test_launcher_refuses_a_missing_plan_file_and_leaves_nvml_failures_to_the_restart_policy(tmp_path):
    lines: list[str] = []
    missing = gate.run(["--plan", str(tmp_path / "none.plan.json"), "--", "/bin/true"], log=lines.append)
    assert missing == gate.EXIT_REFUSED and "does not exist" in lines[-1]
    plan = tmp_path / "main.plan.json"
    plan.write_text(json.dumps(plan_doc()))

    class NoDriver:
        NVMLError = OSError

        @staticmethod
        def nvmlInit() -> None:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    handed: list[list[str]] = []
    rc = gate.run(["--plan", str(plan), "--", "/bin/true"], nvml=NoDriver(), log=lines.append,
                  execv=lambda path, argv: handed.append(argv))
    assert rc == gate.EXIT_PROBE_FAILED and "NVML probe failed" in lines[-1] and not handed
    bad = tmp_path / "bad.plan.json"
    bad.write_text(json.dumps(plan_doc(free_floor_bytes={"0": "lots"})))
    assert gate.run(["--plan", str(bad), "--", "/bin/true"], log=lines.append) == gate.EXIT_REFUSED
    assert "free_floor_bytes[0]: expected bytes as an integer" in lines[-1]


def test_check_only_answers_without_overwriting_the_record_of_the_last_start(tmp_path):
    plan = tmp_path / "main.plan.json"
    state = tmp_path / "main.boot-gate.json"
    plan.write_text(json.dumps(plan_doc(free_floor_bytes={}, boot_gate={"policy": "shrink", "state_file": str(state)})))
    handed: list[list[str]] = []
    lines: list[str] = []
    assert gate.run(["--plan", str(plan), "--", "/bin/true"], log=lines.append, execv=lambda path, argv: handed.append(argv)) == 0
    assert handed and state.is_file(), "a start records itself"
    started = state.read_text(encoding="utf-8")
    assert gate.run(["--plan", str(plan), "--check-only", "--", "/bin/true"], log=lines.append,
                    execv=lambda path, argv: handed.append(argv)) == 0
    assert len(handed) == 1, "a check starts nothing"
    assert state.read_text(encoding="utf-8") == started, "a check leaves the record of the last start as it was"


def test_boot_check_expectations_follow_the_gate_record_of_this_start(tmp_path):
    state = {"format": 1, "invocation_id": "inv-2", "action": "shrink", "policy": "shrink", "message": "m",
             "started": {"kv_cache_memory_bytes": BUDGET - GIB, "kv_cache_tokens": 1000},
             "degraded": {"kv_cache_memory_bytes_before": BUDGET, "kv_cache_memory_bytes_after": BUDGET - GIB}}
    path = tmp_path / "main.boot-gate.json"
    path.write_text(json.dumps(dict(state, invocation_id="inv-1")))
    current = iter(["inv-2", "inv-2", "inv-2"])
    waits: list[float] = []

    def rewrite(seconds: float) -> None:  # the gate of the new start writes its record meanwhile
        waits.append(seconds)
        path.write_text(json.dumps(state))

    got = gate.wait_state(str(path), lambda: next(current), timeout=5, sleep=rewrite)
    assert got is not None and got["invocation_id"] == "inv-2" and waits == [0.2]
    expected, tokens, degraded = gate.boot_expectations(got, BUDGET, 2000)
    assert (expected, tokens) == (BUDGET - GIB, 1000)
    assert degraded["kv_cache_memory_bytes_after"] == BUDGET - GIB and degraded["action"] == "shrink"
    # a record claiming more than the plan is never taken as the expectation
    more = dict(state, started={"kv_cache_memory_bytes": BUDGET + 1, "kv_cache_tokens": 1})
    assert gate.boot_expectations(more, BUDGET, 2000)[0] == BUDGET
    assert gate.boot_expectations(dict(state, action="start"), BUDGET, 2000) == (BUDGET, 2000, None)
    assert gate.boot_expectations(dict(state, action="profile"), BUDGET, 2000)[:2] == (None, None)
    clock = iter([0.0, 0.0, 10.0])
    assert gate.wait_state(str(tmp_path / "none.json"), lambda: "x", timeout=1, sleep=lambda s: None,
                           clock=lambda: next(clock)) is None


def test_pynvml_from_the_copy_vllm_ships_when_nvidia_ml_py_is_missing(tmp_path):
    """A vLLM venv may lack nvidia-ml-py but has vllm/third_party/pynvml.py: the gate loads that file
    alone (not the vllm package, whose import would cost torch at every start)."""
    pkg = tmp_path / "vllm"
    (pkg / "third_party").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('the vllm package must not be imported')\n")
    # like the real binding, the copy looks itself up in sys.modules while it loads
    (pkg / "third_party" / "pynvml.py").write_text("import sys\nMARK = sys.modules[__name__].__name__\n")
    import ansible_collections  # pylint: disable=import-outside-toplevel
    collections_root = str(Path(list(ansible_collections.__path__)[0]).parent)
    code = ("import sys; from ansible_collections.gpufleet.vllm.plugins.module_utils._gate import _boot_gate as g; "
            "m = g.load_pynvml(); print(m.MARK, m.__file__)")
    # -S: no site-packages, so no nvidia-ml-py
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, check=False,
                          env={"PYTHONPATH": f"{tmp_path}:{collections_root}", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    mark, path = proc.stdout.split()
    assert mark == "pynvml" and path == str(pkg / "third_party" / "pynvml.py")


def test_no_pynvml_anywhere_is_an_import_error_naming_both(tmp_path):
    import ansible_collections  # pylint: disable=import-outside-toplevel
    collections_root = str(Path(list(ansible_collections.__path__)[0]).parent)
    code = ("from ansible_collections.gpufleet.vllm.plugins.module_utils._gate import _boot_gate as g\n"
            "try:\n    g.load_pynvml()\nexcept ImportError as exc:\n    print(exc)\n")
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, check=False,
                          env={"PYTHONPATH": f"{tmp_path}:{collections_root}", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert "pynvml" in proc.stdout and "vllm/third_party/pynvml.py" in proc.stdout


def test_a_plan_without_any_floor_starts_as_planned_without_probing_nvml(tmp_path):
    """No NVML ranks (the CPU build): nothing to compare, so the gate starts the plan and never
    touches NVML (a host without a driver would otherwise never start)."""
    plan_path = tmp_path / "main.plan.json"
    plan_path.write_text(json.dumps(plan_doc(free_floor_bytes={}, vllm_floor_bytes={})), encoding="utf-8")
    verdict = gate.decide(gate.parse_plan(plan_doc(free_floor_bytes={}, vllm_floor_bytes={})), [], "refuse")
    assert verdict["action"] == "start" and "no free-memory floor" in verdict["message"]
    assert verdict["started"]["kv_cache_memory_bytes"] == BUDGET

    class NoNvml:  # any attribute access means the gate probed
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the gate used NVML ({name}) for a plan without floors")

    started: list[list[str]] = []
    rc = gate.run(["--plan", str(plan_path), "--policy", "refuse", "--state", str(tmp_path / "state.json"), "--",
                   "/bin/true", "serve", "m", "--kv-cache-memory-bytes", str(BUDGET)],
                  nvml=NoNvml(), execv=lambda exe, argv: started.append(argv), log=lambda line: None)
    assert rc in (0, None) and started and f"{BUDGET}" in started[0]


# ---------------------------------------------------------------- the planner's figures on the host

GEMMA3_27B = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16",
              "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
                              "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024,
                              "sliding_window_pattern": 6}}
MISTRAL_7B_V01 = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "hidden_size": 4096, "sliding_window": 4096, "torch_dtype": "bfloat16"}
H200 = 150754820096


def _class_spec(config: dict[str, Any], boot_free: int) -> dict[str, Any]:
    return {
        "host_class": "h200",
        "reference": {"ranks": [{"rank": 0, "free_bytes": 140 * GIB, "kv_bytes": 100 * GIB}], "total_bytes": H200,
                      "geometry": {"config": config, "serve_args": {"max_num_batched_tokens": 2048}}},
        "hosts": {"a": [{"rank": 0, "boot_free_bytes": boot_free}]},
        "guard_bytes": GIB // 2,
        "max_model_len": 32768,
        "admission": {"concurrency": 2, "tokens_per_request": 32768},
    }


def _plan_file(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan file the role writes from the planner's result (its launch record), as JSON reads it back."""
    from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._launch import plan_file

    doc = plan_file(plan["launch"], {"name": "main", "gpus": [0], "port": 8000}, host_class="h200", key_hash=None,
                    model="/srv/m", max_model_len=32768, planned_at="2026-12-02T00:00:00Z", gate_policy="shrink",
                    gate_state_dir="/var/lib/gpufleet-vllm")
    loaded: dict[str, Any] = json.loads(json.dumps(doc))
    return loaded


@pytest.mark.parametrize("config, family", [(GEMMA3_27B, "interleaved_sliding_window"), (MISTRAL_7B_V01, "sliding_window")])
def test_a_shrunk_multi_group_budget_has_the_planners_blocks_and_tokens(config, family):
    from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class

    planned = plan_class(_class_spec(config, 139 * GIB))
    assert planned["decision"] == "deploy", planned["reasons"]
    assert planned["capacity_source"] == "layout" and planned["kv_layout"]["family"] == family
    floor = planned["free_floor_bytes"][0]
    shortfall = 3 * GIB + 12345
    host_gpus = [{"index": 0, "boot_free_bytes": floor - shortfall, "total_bytes": H200}]
    verdict = gate.decide(gate.parse_plan(_plan_file(planned)), host_gpus, "shrink")
    assert verdict["action"] == "shrink", verdict["message"]
    # the planner, asked about a host that is `shortfall` below the floor, gives the same budget, blocks and tokens
    replanned = plan_class(_class_spec(config, 139 * GIB - shortfall))
    assert verdict["started"]["kv_cache_memory_bytes"] == replanned["kv_cache_memory_bytes"]
    assert verdict["started"]["num_blocks"] == replanned["num_blocks"]
    assert verdict["started"]["kv_cache_tokens"] == replanned["kv_cache_tokens"]
    # a single-group division would count other tokens: the layout's per-request blocks make the difference
    assert replanned["kv_cache_tokens"] != replanned["num_blocks"] * planned["block_size"]
    assert verdict["degraded"]["kv_cache_tokens_before"] == planned["kv_cache_tokens"]


def test_shrink_checks_one_request_with_the_blocks_of_every_kv_cache_group():
    from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class

    planned = plan_class(_class_spec(GEMMA3_27B, 139 * GIB))
    doc = _plan_file(planned)
    doc["launch"]["admission"] = None
    per_request = planned["blocks_per_request"]
    assert per_request > -(-32768 // planned["block_size"])  # more than one full-attention group would need
    floor = planned["free_floor_bytes"][0]
    bpb = planned["bytes_per_block"]
    # leave exactly one request's blocks (+ the null block) minus one block: refused, naming the layout's figure
    keep = per_request * bpb
    shortfall = planned["kv_cache_memory_bytes"] - keep
    verdict = gate.decide(gate.parse_plan(doc), [{"index": 0, "boot_free_bytes": floor - shortfall, "total_bytes": H200}],
                          "shrink")
    assert verdict["action"] == "refuse"
    assert f"({per_request + 1} blocks with the null block)" in verdict["message"]


def test_the_gate_and_the_planner_share_one_floor_utilization():
    from ansible_collections.gpufleet.vllm.plugins.module_utils._plan import _kv_capacity
    from ansible_collections.gpufleet.vllm.plugins.plugin_utils import _plan

    assert gate.floor_utilization is _kv_capacity.floor_utilization is _plan.floor_utilization


def test_profile_never_lets_vllm_size_more_than_the_planned_budget():
    """vLLM's profiling at a utilization gives ``ceil(total * u) - non_kv`` of KV cache; the reference's
    "fully utilize" suggestion shows ``non_kv``. The planner's cap keeps a profiled start at or below the plan."""
    import math

    from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class

    vllm_free, full = 139 * GIB, 120 * GIB  # non_kv 19 GiB (weights, activations, buffer)
    spec = _class_spec(MISTRAL_7B_V01, 139 * GIB)
    spec["reference"]["ranks"][0]["kv_bytes_full"] = full
    spec["reference"]["vllm_free_bytes"] = {0: vllm_free}
    planned = plan_class(spec)
    cap = planned["profile_max_utilization"]
    assert cap is not None and cap <= planned["gpu_memory_utilization"]
    doc = _plan_file(planned)
    assert doc["launch"]["profile_max_utilization"] == cap
    floor = planned["free_floor_bytes"][0]
    free = floor - GIB // 4  # just below the floor: the free figure alone would profile far above the plan
    uncapped = gate.decide(gate.parse_plan(dict(doc, launch=dict(doc["launch"], profile_max_utilization=None))),
                           [{"index": 0, "boot_free_bytes": free, "total_bytes": H200}], "profile")
    verdict = gate.decide(gate.parse_plan(doc), [{"index": 0, "boot_free_bytes": free, "total_bytes": H200}], "profile")
    assert verdict["action"] == uncapped["action"] == "profile"

    def profiled_kv(util: float) -> int:
        return math.ceil(H200 * util) - (vllm_free - full)

    assert profiled_kv(uncapped["started"]["gpu_memory_utilization"]) > planned["kv_cache_memory_bytes"]
    assert verdict["started"]["gpu_memory_utilization"] == cap
    assert profiled_kv(cap) <= planned["kv_cache_memory_bytes"]
    assert "capped at" in verdict["message"]
    # far below the floor the free figure is the lower one and stands
    low = gate.decide(gate.parse_plan(doc), [{"index": 0, "boot_free_bytes": floor - 30 * GIB, "total_bytes": H200}], "profile")
    assert low["started"]["gpu_memory_utilization"] < cap and "capped at" not in low["message"]


def test_a_plan_file_edited_since_the_deploy_is_refused_naming_both_checksums(tmp_path, monkeypatch):
    """Budget and expectation doubled in the plan file on the host: the unit's recorded checksum no longer
    matches, and the gate starts nothing (the edited file would have it 'shrink' from twice the plan)."""
    doc = plan_doc()
    recorded = gate.plan_checksum(doc)
    edited = dict(doc, kv_cache_memory_bytes=2 * doc["kv_cache_memory_bytes"], num_blocks=2 * doc.get("num_blocks", 1))
    plan = tmp_path / "main.plan.json"
    plan.write_text(json.dumps(edited))
    lines: list[str] = []
    handed: list[list[str]] = []
    argv = ["--plan", str(plan), "--plan-sha256", recorded, "--",
            "/bin/vllm", "serve", "m", "--kv-cache-memory-bytes", str(2 * BUDGET)]
    rc = gate.run(argv, log=lines.append, execv=lambda path, a: handed.append(a))
    assert rc == gate.EXIT_REFUSED and not handed
    # as systemd hands it over from the deploy's drop-in
    monkeypatch.setenv("GPUFLEET_PLAN_SHA256", recorded)
    assert gate.run(argv[:2] + argv[4:], log=lines.append, execv=lambda path, a: handed.append(a)) == gate.EXIT_REFUSED
    assert not handed
    assert f"was changed since the deploy wrote it (the unit's drop-in records checksum {recorded[:16]}, the file has " \
           f"{gate.plan_checksum(edited)[:16]})" in lines[-1], lines
    # the file as the deploy wrote it, with the unit checksum the boot check adds, starts
    plan.write_text(json.dumps(dict(doc, unit_checksum="abc")))
    assert gate.trust_problem(gate.read_plan(str(plan)), ["vllm", "--kv-cache-memory-bytes", str(BUDGET)], recorded,
                              str(plan)) is None


def test_a_plan_budget_that_is_not_the_units_is_refused(tmp_path):
    """Without a recorded checksum (a unit of an earlier release) the budget the journal line names must be
    the one the unit starts."""
    plan = tmp_path / "main.plan.json"
    plan.write_text(json.dumps(plan_doc()))
    lines: list[str] = []
    rc = gate.run(["--plan", str(plan), "--", "/bin/vllm", "serve", "m", f"--kv-cache-memory-bytes={2 * BUDGET}"],
                  log=lines.append, execv=lambda path, a: None)
    assert rc == gate.EXIT_REFUSED
    assert f"names the budget {BUDGET} B but the unit starts {2 * BUDGET} B" in lines[-1], lines

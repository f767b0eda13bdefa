# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""docs/launch-contract.md says what the code does: its plan file is one the collection reads,
its field table lists the record's fields, and its ``LLM(...)`` example passes the plan file's
budget to vLLM.

The example runs against a plan file written by ``_launch.plan_file`` from a real planner
result; ``vllm.LLM`` is replaced by a recorder (the controller has no vLLM), so the test shows
which engine arguments the example gives, not that an engine starts with them.
"""
from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._gate import _boot_gate
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan import _launch
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class

DOC = Path(__file__).resolve().parents[3] / "docs" / "launch-contract.md"
GIB = 1 << 30


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_documented_plan_file_is_one_the_gate_reads():
    (doc,) = [json.loads(b) for b in blocks("json")]
    assert doc["format"] == _launch.PLAN_FILE_FORMAT and doc["launch"]["schema"] == _launch.SCHEMA
    assert set(doc["launch"]) == set(_launch.FIELDS)
    assert _launch.check_launch(doc["launch"])["kv_cache_memory_bytes"] == doc["launch"]["kv_cache_memory_bytes"]
    plan = _boot_gate.parse_plan(doc)
    assert plan["policy"] == "shrink" and plan["num_blocks"] == doc["launch"]["expect"]["num_blocks"]


def test_the_field_table_lists_every_field_of_the_record():
    text = DOC.read_text()
    table = text[text.index("## The record"):text.index("## The plan file")]
    documented = re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.M)
    assert documented == list(_launch.FIELDS)
    assert f"(launch schema {_launch.SCHEMA}, plan file format {_launch.PLAN_FILE_FORMAT})" in text.splitlines()[0]


class _Recorder:
    calls: list[dict[str, Any]] = []

    def __init__(self, **kwargs: Any) -> None:
        _Recorder.calls.append(kwargs)


def _run_example(path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    (code,) = blocks("python")
    fake = types.ModuleType("vllm")
    fake.LLM = _Recorder  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _Recorder.calls.clear()
    code = code.replace("llm = llm_from_plan()", f"llm = llm_from_plan({str(path)!r})")
    exec(compile(code, str(DOC), "exec"), {"__name__": "example"})  # nosec B102 - the documented example, run as written
    (call,) = _Recorder.calls
    return call


def _plan_file(tmp_path: Path, launch: dict[str, Any], host_gpus: Any = None) -> Path:
    doc = _launch.plan_file(launch, {"name": "main", "gpus": [2, 3], "port": 8000}, host_class="h200", key_hash="k",
                            model="/srv/models/m", max_model_len=8192, planned_at="2026-12-02T10:00:00Z",
                            gate_policy="shrink", gate_state_dir="/var/lib/gpufleet-vllm", host_gpus=host_gpus)
    path = tmp_path / "main.plan.json"
    path.write_text(json.dumps(doc))
    return path


def test_the_example_starts_vllm_with_the_planned_budget(tmp_path, monkeypatch):
    launch = _launch.for_instance({"decision": "deploy", "kv_cache_memory_bytes": 30 * GIB, "gpu_memory_utilization": 0.31,
                                   "free_floor_bytes": {0: 60 * GIB, 1: 60 * GIB}, "num_blocks": 1920, "kv_cache_tokens": 30720}, 0.9)
    call = _run_example(_plan_file(tmp_path, launch), monkeypatch)
    assert call == {"model": "/srv/models/m", "max_model_len": 8192, "tensor_parallel_size": 2,
                    "gpu_memory_utilization": 0.31, "kv_cache_memory_bytes": 30 * GIB}
    import os  # pylint: disable=import-outside-toplevel

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_the_example_selects_the_planned_cards_by_uuid(tmp_path, monkeypatch):
    launch = _launch.for_instance({"decision": "auto_profile"}, 0.8)
    cards = [{"index": i, "uuid": f"GPU-0000000{i}-0000-4000-8000-000000000000"} for i in range(4)]
    _run_example(_plan_file(tmp_path, launch, cards), monkeypatch)
    import os  # pylint: disable=import-outside-toplevel

    assert os.environ["CUDA_VISIBLE_DEVICES"] == _launch.cuda_visible_devices([2, 3], cards)
    assert os.environ["CUDA_VISIBLE_DEVICES"].startswith("GPU-00000002-")


def test_the_example_lets_vllm_profile_an_auto_profile_plan(tmp_path, monkeypatch):
    call = _run_example(_plan_file(tmp_path, _launch.for_instance({"decision": "auto_profile"}, 0.8)), monkeypatch)
    assert "kv_cache_memory_bytes" not in call and call["gpu_memory_utilization"] == 0.8


def test_the_example_reads_the_planners_own_record(tmp_path, monkeypatch):
    h200 = 150_110_961_664
    spec = {"host_class": "h200", "guard_bytes": GIB // 2, "max_model_len": 8192,
            "reference": {"ranks": [{"rank": 0, "free_bytes": 130 * GIB, "kv_bytes": 100 * GIB},
                                    {"rank": 1, "free_bytes": 130 * GIB, "kv_bytes": 100 * GIB}], "total_bytes": h200,
                          "num_blocks": 51200, "block_size": 16},
            "hosts": {"a": [{"rank": 0, "boot_free_bytes": 129 * GIB}, {"rank": 1, "boot_free_bytes": 130 * GIB}]}}
    plan = plan_class(spec)
    assert plan["decision"] == "deploy", plan["reasons"]
    call = _run_example(_plan_file(tmp_path, plan["launch"]), monkeypatch)
    assert call["kv_cache_memory_bytes"] == plan["kv_cache_memory_bytes"]
    assert call["gpu_memory_utilization"] == plan["gpu_memory_utilization"]


def test_the_example_refuses_another_format(tmp_path, monkeypatch):
    path = tmp_path / "old.plan.json"
    path.write_text(json.dumps({"format": 2, "launch": {}}))
    with pytest.raises(RuntimeError, match="plan file format 2, launch schema None: this program reads format 3, schema 1"):
        _run_example(path, monkeypatch)

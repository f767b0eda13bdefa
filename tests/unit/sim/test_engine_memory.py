# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Geometry and memory arithmetic of the simulated engine.

The simulated engine and the collection's planner implement vLLM's block math
independently; these tests hold them to the same figures.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._geometry import geometry_from_config

MODELS = Path(__file__).resolve().parents[3] / "sim" / "models"

GiB = 1 << 30
MiB = 1 << 20
MODEL_NAMES = sorted(p.name for p in MODELS.iterdir() if (p / "config.json").is_file())
MLA = {"model_type": "deepseek_v2", "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
       "num_hidden_layers": 27, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
GQA_FEW_HEADS = {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
                 "num_hidden_layers": 28, "torch_dtype": "bfloat16"}
H200_TOTAL, H200_RESERVED = 150754820096, 566231040


def config(name: str) -> dict:
    return json.loads((MODELS / name / "config.json").read_text(encoding="utf-8"))


def test_models_are_hf_shaped() -> None:
    assert len(MODEL_NAMES) >= 2
    for name in MODEL_NAMES:
        cfg = config(name)
        for key in ("architectures", "model_type", "hidden_size", "num_attention_heads", "num_hidden_layers",
                    "num_key_value_heads", "torch_dtype", "max_position_embeddings", "vocab_size"):
            assert key in cfg, f"{name}: {key}"


CASES = [(tp, pp, bs, kvd) for tp in (1, 2, 4, 8, 16) for pp in (1, 2, 3) for bs in (16, 32) for kvd in ("auto", "fp8")]


@pytest.mark.parametrize("cfg", [config(n) for n in MODEL_NAMES] + [MLA, GQA_FEW_HEADS],
                         ids=MODEL_NAMES + ["mla", "gqa-4-heads"])
@pytest.mark.parametrize(("tp", "pp", "block_size", "kv_dtype"), CASES)
def test_block_bytes_agree_with_planner(engine, cfg, tp, pp, block_size, kv_dtype) -> None:
    serve = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "block_size": block_size,
             "kv_cache_dtype": kv_dtype}
    planner = geometry_from_config(cfg, serve)
    sim = engine.geometry_from_config(cfg, tp=tp, pp=pp, block_size=block_size, kv_cache_dtype=kv_dtype)
    # the stage with the most layers bounds the engine
    worst = max(sim.bytes_per_block(stage) for stage in range(pp))
    assert worst == planner.bytes_per_block
    for kv in (1, 10**9, 37 * GiB + 12345, 120 * GiB):
        assert kv // worst == planner.num_blocks(kv)
    for max_len in (1, 16, 4097, 32768, 131072):
        needed = (engine.cdiv(max_len, block_size) + 1) * worst
        assert needed == planner.bytes_for_one_request(max_len)


def test_llama_8b_bytes_per_token(engine) -> None:
    geo = engine.geometry_from_config(config("llama-3.1-8b-instruct"))
    assert geo.bytes_per_block(0) == 131_072 * 16   # 2*32*8*128*2 bytes per token


def rank(engine, r: int, nvml_free: int, total: int = H200_TOTAL - H200_RESERVED):
    return engine.RankInput(rank=r, gpu_index=r, device=r, nvml_free=nvml_free, total=total)


COSTS = {"cuda_context_bytes": 500 * MiB, "peak_activation_bytes": int(1.25 * GiB), "non_torch_bytes": 600 * MiB,
         "cuda_graph_bytes": int(0.75 * GiB), "graph_double_count": False}


def plan(engine, ranks, kv=None, util=0.92, max_len=32768, fault=None, eager=False, tp=2, weights=None):
    cfg = config("llama-3.1-70b-instruct")
    geo = engine.geometry_from_config(cfg, tp=tp)
    w = engine.weights_bytes_from_config(cfg) if weights is None else weights
    return geo, engine.plan_boot(ranks, geo, util=util, kv_bytes=kv, max_model_len=max_len, weights_total=w,
                                 costs=COSTS, enforce_eager=eager, fault=fault)


def test_profiled_suggestions_follow_vllm(engine) -> None:
    free0 = H200_TOTAL - H200_RESERVED
    free1 = free0 - int(1.5 * GiB)                      # co-tenant on rank 1
    geo, p = plan(engine, [rank(engine, 0, free0), rank(engine, 1, free1)])
    assert p.error is None
    total = H200_TOTAL - H200_RESERVED
    requested = math.ceil(total * 0.92)
    for rp, nvml in zip(p.ranks, (free0, free1)):
        assert rp.initial_free == nvml - 500 * MiB          # vLLM's free is below NVML's
        assert rp.requested == requested
        assert rp.kv_bytes == requested - rp.non_kv           # profiled: the rest of the requested share
        assert rp.suggest_fit == requested - rp.non_kv - 150 * MiB
        assert rp.suggest_full == rp.initial_free - rp.non_kv - 150 * MiB
    assert p.ranks[1].suggest_full == p.ranks[0].suggest_full - int(1.5 * GiB)
    assert p.num_blocks == p.ranks[0].kv_bytes // geo.bytes_per_block(0)
    assert p.tokens == p.num_blocks * 16
    assert p.max_concurrency == pytest.approx(p.num_blocks / engine.cdiv(32768, 16))


def test_weights_of_70b_are_realistic(engine) -> None:
    w = engine.weights_bytes_from_config(config("llama-3.1-70b-instruct"))
    assert 140e9 < w < 142e9          # 70.6 B parameters in bf16


def test_manual_budget_reserved_exactly_and_weakest_rank_bounds_blocks(engine) -> None:
    free = H200_TOTAL - H200_RESERVED
    geo, p = plan(engine, [rank(engine, 0, free), rank(engine, 1, free)], kv=30 * GiB)
    assert p.error is None and p.manual
    assert [rp.kv_bytes for rp in p.ranks] == [30 * GiB, 30 * GiB]
    assert p.num_blocks == 30 * GiB // geo.bytes_per_block(0)
    assert p.used_kv == {0: p.num_blocks * geo.bytes_per_block(0), 1: p.num_blocks * geo.bytes_per_block(0)}


def test_startup_check_uses_vllm_free_and_ceil(engine) -> None:
    total = H200_TOTAL - H200_RESERVED
    need = math.ceil(total * 0.92)
    ok_free = need + 500 * MiB                  # NVML free such that vLLM's free == requested
    p = plan(engine, [rank(engine, 0, ok_free), rank(engine, 1, ok_free)], kv=20 * GiB)[1]
    assert p.error is None
    p = plan(engine, [rank(engine, 0, ok_free), rank(engine, 1, ok_free - 1)], kv=20 * GiB)[1]
    assert p.error_stage == "init_device" and p.error_rank == 1
    assert p.error.startswith("ValueError: Free memory on device cuda:1 (")
    assert "on startup is less than desired GPU memory utilization (0.92, " in p.error


def test_manual_budget_too_large_is_cuda_oom(engine) -> None:
    free = H200_TOTAL - H200_RESERVED
    p = plan(engine, [rank(engine, 0, free), rank(engine, 1, free - 20 * GiB)], kv=70 * GiB, util=0.5)[1]
    assert p.error_stage == "allocate" and p.error_rank == 1
    assert p.error.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ")


def test_budget_below_one_request(engine) -> None:
    free = H200_TOTAL - H200_RESERVED
    geo, p = plan(engine, [rank(engine, 0, free), rank(engine, 1, free)], kv=1 * GiB, max_len=131072)
    assert p.error_stage == "kv_config"
    assert "To serve at least one request with the model's max seq len (131072)" in p.error
    # exactly one request + the null block fits
    need = (engine.cdiv(131072, 16) + 1) * geo.bytes_per_block(0)
    p = plan(engine, [rank(engine, 0, free), rank(engine, 1, free)], kv=need, max_len=131072)[1]
    assert p.error is None and p.num_blocks == engine.cdiv(131072, 16) + 1
    p = plan(engine, [rank(engine, 0, free), rank(engine, 1, free)], kv=need - 1, max_len=131072)[1]
    assert p.error_stage == "kv_config"


def test_no_memory_left_for_kv_when_profiled(engine) -> None:
    free = H200_TOTAL - H200_RESERVED
    p = plan(engine, [rank(engine, 0, free)], util=0.5, tp=1)[1]
    assert p.error_stage == "kv_config"
    assert p.error.startswith("ValueError: No available memory for the cache blocks.")


def test_injected_faults(engine) -> None:
    free = H200_TOTAL - H200_RESERVED
    ranks = [rank(engine, 0, free), rank(engine, 1, free)]
    expectations = {"oom": "allocate", "startup": "init_device", "one_request": "kv_config",
                    "no_memory": "kv_config", "profiling_error": "profile", "gpu_lost": "init_device"}
    for fault, stage in expectations.items():
        p = plan(engine, ranks, kv=30 * GiB, fault=fault)[1]
        assert p.error_stage == stage, fault


def test_graph_double_count_can_make_suggestions_negative(engine) -> None:
    free = H200_TOTAL - H200_RESERVED
    cfg = config("llama-3.1-8b-instruct")
    geo = engine.geometry_from_config(cfg)
    costs = dict(COSTS, cuda_graph_bytes=70 * GiB, graph_double_count=True)
    p = engine.plan_boot([rank(engine, 0, free)], geo, util=0.92, kv_bytes=None, max_model_len=8192,
                         weights_total=engine.weights_bytes_from_config(cfg), costs=costs, enforce_eager=False)
    assert p.error is None
    assert p.ranks[0].suggest_fit < 0


def test_visible_devices_by_index_and_uuid(engine) -> None:
    views = [engine.GpuView(i, f"GPU-{i}aaa", "NVIDIA H200", 10, 0, 10, 0) for i in range(4)]
    assert [g.index for g in engine.visible_gpus(views, "2,3")] == [2, 3]
    assert [g.index for g in engine.visible_gpus(views, "GPU-3aaa,GPU-1aaa")] == [3, 1]
    assert [g.index for g in engine.visible_gpus(views, "1,9,2")] == [1]     # CUDA stops at a bad entry
    assert len(engine.visible_gpus(views, None)) == 4

